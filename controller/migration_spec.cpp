#include "controller/migration_spec.h"

#include "common/units.h"

namespace rdmig::controller {

using nlohmann::json;

namespace {

Error bad(const std::string& field, const std::string& what) {
  return Error{Errc::kInvalidArgument, field + ": " + what};
}

Result<QemuEndpoint> parse_endpoint(const json& spec, const char* side) {
  const std::string f = std::string("spec.") + side;
  auto it = spec.find(side);
  if (it == spec.end() || !it->is_object()) return bad(f, "required");
  if (it->size() != 1 || !it->contains("qemu")) {
    return bad(f, std::string("must name exactly one kind of endpoint; supported: ") +
                      (std::string(side) == "source" ? "qemu, vmi" : "qemu (with a qemu source)"));
  }
  const json& q = (*it)["qemu"];
  if (!q.is_object()) return bad(f + ".qemu", "must be an object with node and qmpSocket");
  QemuEndpoint e;
  if (!q.contains("node") || !q["node"].is_string() || q["node"].get<std::string>().empty()) {
    return bad(f + ".qemu.node", "required");
  }
  e.node = q["node"].get<std::string>();
  if (!q.contains("qmpSocket") || !q["qmpSocket"].is_string()) return bad(f + ".qemu.qmpSocket", "required");
  e.qmp_socket = q["qmpSocket"].get<std::string>();
  if (e.qmp_socket.empty() || e.qmp_socket.front() != '/') return bad(f + ".qemu.qmpSocket", "must be an absolute path");
  if (e.qmp_socket.size() > 107) return bad(f + ".qemu.qmpSocket", "longer than 107 characters");
  return e;
}

Result<std::optional<uint64_t>> uint_field(const json& spec, const char* key, uint64_t min, uint64_t max) {
  auto it = spec.find(key);
  if (it == spec.end() || it->is_null()) return std::optional<uint64_t>();
  if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<int64_t>() < 0)) {
    return bad(std::string("spec.") + key, "must be a non-negative integer");
  }
  const auto v = it->get<uint64_t>();
  if (v < min || v > max) {
    return bad(std::string("spec.") + key,
               "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got " + std::to_string(v));
  }
  return std::optional<uint64_t>(v);
}

// One component of a duration: its value in nanoseconds, or 0 with `ok` false on overflow.
bool add_component(uint64_t& total_ns, uint64_t whole, uint64_t frac, uint64_t frac_scale, uint64_t unit_ns) {
  uint64_t a = 0, b = frac * unit_ns / frac_scale;  // frac < frac_scale <= 10^6, unit_ns <= 3.6e12: no overflow
  if (__builtin_mul_overflow(whole, unit_ns, &a)) return false;
  if (__builtin_add_overflow(a, b, &a)) return false;
  return !__builtin_add_overflow(total_ns, a, &total_ns);
}

}  // namespace

Result<uint64_t> parse_duration_ms(const std::string& text, const std::string& field, uint64_t min_ms, uint64_t max_ms) {
  const std::string expected = "must be a duration like \"300ms\" or \"1.5s\" (units ns, us, ms, s, m, h)";
  if (text.empty()) return bad(field, expected + ", got an empty string");
  if (text.size() > 64) return bad(field, expected + ", got " + std::to_string(text.size()) + " characters");
  uint64_t ns = 0;
  size_t i = 0;
  while (i < text.size()) {
    uint64_t whole = 0, frac = 0, scale = 1;
    const size_t start = i;
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
      if (whole > 1'000'000'000'000ull) return bad(field, "'" + text + "' is out of range");
      whole = whole * 10 + static_cast<uint64_t>(text[i] - '0');
    }
    if (i == start) return bad(field, expected + ", got '" + text + "'");
    if (i < text.size() && text[i] == '.') {
      const size_t frac_start = ++i;
      for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
        if (scale == 1'000'000) return bad(field, "'" + text + "': at most 6 digits after the decimal point");
        frac = frac * 10 + static_cast<uint64_t>(text[i] - '0');
        scale *= 10;
      }
      if (i == frac_start) return bad(field, expected + ", got '" + text + "'");
    }
    const size_t unit_start = i;
    while (i < text.size() && !(text[i] >= '0' && text[i] <= '9') && text[i] != '.') ++i;
    const std::string unit = text.substr(unit_start, i - unit_start);
    uint64_t unit_ns = 0;
    if (unit == "ns") unit_ns = 1;
    else if (unit == "us" || unit == "\xC2\xB5s") unit_ns = 1'000;
    else if (unit == "ms") unit_ns = 1'000'000;
    else if (unit == "s") unit_ns = 1'000'000'000;
    else if (unit == "m") unit_ns = 60'000'000'000;
    else if (unit == "h") unit_ns = 3'600'000'000'000;
    else if (unit.empty()) return bad(field, "'" + text + "' needs a unit (ns, us, ms, s, m, h)");
    else return bad(field, "unknown unit '" + unit + "' in '" + text + "' (units ns, us, ms, s, m, h)");
    if (!add_component(ns, whole, frac, scale, unit_ns)) return bad(field, "'" + text + "' is out of range");
  }
  if (ns % 1'000'000 != 0) return bad(field, "'" + text + "' is not a whole number of milliseconds");
  const uint64_t ms = ns / 1'000'000;
  if (ms < min_ms || ms > max_ms) {
    return bad(field, "must be between " + std::to_string(min_ms) + "ms and " + std::to_string(max_ms) + "ms, got '" +
                          text + "'");
  }
  return ms;
}

Result<SourceKind> source_kind(const json& spec) {
  if (!spec.is_object()) return bad("spec", "required");
  auto it = spec.find("source");
  if (it == spec.end() || !it->is_object()) return bad("spec.source", "required");
  if (it->size() == 1 && it->contains("qemu")) return SourceKind::kQemu;
  if (it->size() == 1 && it->contains("vmi")) return SourceKind::kVmi;
  return bad("spec.source", "must name exactly one kind of endpoint; supported: qemu, vmi");
}

Result<VmiRequest> parse_vmi_spec(const json& spec) {
  if (!spec.is_object()) return bad("spec", "required");
  VmiRequest r;
  const json& v = spec.value("source", json::object()).value("vmi", json());
  if (!v.is_object()) return bad("spec.source.vmi", "must be an object with name");
  for (const auto& [k, _] : v.items()) {
    if (k != "name") return bad("spec.source.vmi." + k, "unknown field (supported: name)");
  }
  if (!v.contains("name") || !v["name"].is_string() || v["name"].get<std::string>().empty()) {
    return bad("spec.source.vmi.name", "required");
  }
  r.name = v["name"].get<std::string>();
  if (r.name.size() > 253) return bad("spec.source.vmi.name", "longer than 253 characters");
  if (auto t = spec.find("target"); t != spec.end() && !t->is_null()) {
    if (!t->is_object()) return bad("spec.target", "must be an object");
    for (const auto& [k, val] : t->items()) {
      if (k == "qemu") return bad("spec.target.qemu", "not allowed with spec.source.vmi (use spec.target.nodeSelector)");
      if (k != "nodeSelector") return bad("spec.target." + k, "unknown field (supported with a vmi source: nodeSelector)");
      if (!val.is_object()) return bad("spec.target.nodeSelector", "must be a map of label keys to values");
      for (const auto& [lk, lv] : val.items()) {
        if (!lv.is_string()) return bad("spec.target.nodeSelector." + lk, "must be a string");
        r.node_selector[lk] = lv.get<std::string>();
      }
    }
  }
  for (const char* tunable : {"transport", "chunkSize", "multifdChannels", "ringDepth", "maxDowntime", "maxDowntimeMs",
                              "maxBandwidth", "completionTimeoutSeconds", "postCopy", "postCopyAfterPasses",
                              "postCopyAfterSeconds", "postCopyPreempt"}) {
    if (spec.contains(tunable) && !spec[tunable].is_null()) {
      return bad(std::string("spec.") + tunable,
                 "only for spec.source.qemu; under KubeVirt the agents' kubevirt config and KubeVirt's migration "
                 "policy decide it");
    }
  }
  if (auto it = spec.find("cancel"); it != spec.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad("spec.cancel", "must be true or false");
    r.cancel = it->get<bool>();
  }
  return r;
}

Result<MigrationRequest> parse_spec(const json& spec) {
  if (!spec.is_object()) return bad("spec", "required");
  MigrationRequest r;
  auto src = parse_endpoint(spec, "source");
  if (!src) return src.error();
  r.source = src.value();
  auto dst = parse_endpoint(spec, "target");
  if (!dst) return dst.error();
  r.target = dst.value();
  if (r.source.node == r.target.node) {
    return bad("spec.target.qemu.node", "must differ from spec.source.qemu.node ('" + r.source.node +
                                            "'): rdmig migrates between nodes");
  }
  if (auto it = spec.find("transport"); it != spec.end() && !it->is_null()) {
    if (!it->is_string()) return bad("spec.transport", "must be a string");
    r.transport = it->get<std::string>();
    if (r.transport != "auto" && r.transport != "rdma" && r.transport != "tcp") {
      return bad("spec.transport", "unknown transport '" + r.transport + "' (expected auto, rdma or tcp)");
    }
  }
  if (auto it = spec.find("chunkSize"); it != spec.end() && !it->is_null()) {
    if (!it->is_string()) return bad("spec.chunkSize", "must be a quantity like \"4Mi\"");
    auto bytes = parse_bytes(it->get<std::string>(), "spec.chunkSize");
    if (!bytes) return bytes.error();
    RDMIG_TRY(validate_chunk_size(bytes.value(), "spec.chunkSize"));
    r.chunk_size = bytes.value();
  }
  auto mf = uint_field(spec, "multifdChannels", 0, 64);
  if (!mf) return mf.error();
  r.multifd_channels = static_cast<uint32_t>(mf->value_or(0));
  auto depth = uint_field(spec, "ringDepth", 2, 1024);
  if (!depth) return depth.error();
  if (depth.value()) r.ring_depth = static_cast<uint32_t>(**depth);
  // maxDowntime (a duration) replaces maxDowntimeMs (integer milliseconds, still read in v1alpha1);
  // both at once is refused rather than one silently winning.
  const bool has_new = spec.contains("maxDowntime") && !spec["maxDowntime"].is_null();
  const bool has_old = spec.contains("maxDowntimeMs") && !spec["maxDowntimeMs"].is_null();
  if (has_new && has_old) {
    return bad("spec.maxDowntime", "set either spec.maxDowntime or the deprecated spec.maxDowntimeMs, not both");
  }
  if (has_new) {
    if (!spec["maxDowntime"].is_string()) return bad("spec.maxDowntime", "must be a duration string like \"300ms\"");
    auto ms = parse_duration_ms(spec["maxDowntime"].get<std::string>(), "spec.maxDowntime", kMinDowntimeMs, kMaxDowntimeMs);
    if (!ms) return ms.error();
    r.max_downtime_ms = ms.value();
  } else {
    auto dl = uint_field(spec, "maxDowntimeMs", kMinDowntimeMs, kMaxDowntimeMs);
    if (!dl) return dl.error();
    r.max_downtime_ms = dl->value_or(kDefaultDowntimeMs);
  }
  auto ct = uint_field(spec, "completionTimeoutSeconds", 10, 7 * 86400);
  if (!ct) return ct.error();
  if (ct.value()) r.completion_timeout_seconds = static_cast<uint32_t>(**ct);
  if (auto it = spec.find("maxBandwidth"); it != spec.end() && !it->is_null()) {
    Result<uint64_t> bw = uint64_t{0};
    if (it->is_string()) bw = parse_bytes(it->get<std::string>(), "spec.maxBandwidth");
    else if (it->is_number_integer() && (it->is_number_unsigned() || it->get<int64_t>() >= 0)) bw = it->get<uint64_t>();
    else return bad("spec.maxBandwidth", "must be a non-negative integer or a quantity like \"10Gi\" (bytes per second)");
    if (!bw) return bw.error();
    if (bw.value() > (uint64_t{1} << 50)) return bad("spec.maxBandwidth", "larger than 1Pi bytes per second");
    r.max_bandwidth_bytes_per_second = bw.value();
  }
  if (auto it = spec.find("postCopy"); it != spec.end() && !it->is_null()) {
    if (!it->is_string()) return bad("spec.postCopy", "must be a string");
    const auto mode = it->get<std::string>();
    if (mode != "never" && mode != "auto" && mode != "after") {
      return bad("spec.postCopy", "must be never, auto or after, got '" + mode + "'");
    }
    r.post_copy = mode;
  }
  auto passes = uint_field(spec, "postCopyAfterPasses", 2, 1000);
  if (!passes) return passes.error();
  auto seconds = uint_field(spec, "postCopyAfterSeconds", 1, 86400);
  if (!seconds) return seconds.error();
  for (const auto& [field, value] : {std::pair{"spec.postCopyAfterPasses", passes.value()},
                                     std::pair{"spec.postCopyAfterSeconds", seconds.value()}}) {
    if (value && r.post_copy.value_or("never") != "auto") return bad(field, "only with spec.postCopy auto");
  }
  if (passes.value()) r.post_copy_after_passes = static_cast<uint32_t>(**passes);
  if (seconds.value()) r.post_copy_after_seconds = static_cast<uint32_t>(**seconds);
  if (auto it = spec.find("postCopyPreempt"); it != spec.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad("spec.postCopyPreempt", "must be true or false");
    if (it->get<bool>() && r.post_copy.value_or("never") == "never") {
      return bad("spec.postCopyPreempt", "only with spec.postCopy auto or after");
    }
    r.post_copy_preempt = it->get<bool>();
  }
  if (auto it = spec.find("cancel"); it != spec.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad("spec.cancel", "must be true or false");
    r.cancel = it->get<bool>();
  }
  return r;
}

Result<std::string> agent_migration_id(const json& object) {
  const std::string uid = object.value("metadata", json::object()).value("uid", "");
  if (uid.empty()) return Error{Errc::kInvalidArgument, "metadata.uid: missing"};
  std::string id = "m-";
  for (char c : uid) {
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-') id.push_back(c);
    else if (c >= 'A' && c <= 'Z') id.push_back(static_cast<char>(c - 'A' + 'a'));
  }
  if (id.size() > 63) id.resize(63);
  while (id.back() == '-') id.pop_back();
  return id;
}

std::string vm_name(const json& object) {
  const auto& md = object.value("metadata", json::object());
  const std::string full = md.value("namespace", "") + "/" + md.value("name", "");
  if (full.size() <= kMaxVmName) return full;
  // Too long for the agents (a namespace of up to 63 and a name of up to 253 characters): keep the
  // start and a hash of the whole, so that the same object always gets the same, distinct name.
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (unsigned char c : full) {
    h ^= c;
    h *= 1099511628211ull;
  }
  static const char* hex = "0123456789abcdef";
  std::string suffix = "-";
  for (int i = 7; i >= 0; --i) suffix.push_back(hex[(h >> (i * 4)) & 15]);
  return full.substr(0, kMaxVmName - suffix.size()) + suffix;
}

json target_request_body(const MigrationRequest& r, const std::string& id, const std::string& vm) {
  json b{{"role", "target"},
         {"id", id},
         {"vm", vm},
         {"qmpSocket", r.target.qmp_socket},
         {"multifdChannels", r.multifd_channels},
         {"transport", r.transport}};
  if (r.chunk_size) b["chunkSize"] = *r.chunk_size;
  if (r.ring_depth) b["ringDepth"] = *r.ring_depth;
  if (r.completion_timeout_seconds) b["completionTimeoutSeconds"] = *r.completion_timeout_seconds;
  return b;
}

json source_request_body(const MigrationRequest& r, const std::string& id, const std::string& vm,
                         const json& target_reply) {
  json b{{"role", "source"},
         {"id", id},
         {"vm", vm},
         {"qmpSocket", r.source.qmp_socket},
         {"multifdChannels", r.multifd_channels},
         {"transport", r.transport},
         {"maxDowntimeMs", r.max_downtime_ms},
         {"maxBandwidthBytesPerSecond", r.max_bandwidth_bytes_per_second},
         {"target",
          {{"endpoint", target_reply.value("endpoint", "")},
           {"migrationId", target_reply.value("migrationId", id)},
           {"token", target_reply.value("token", "")}}}};
  if (r.chunk_size) b["chunkSize"] = *r.chunk_size;
  if (r.ring_depth) b["ringDepth"] = *r.ring_depth;
  if (r.completion_timeout_seconds) b["completionTimeoutSeconds"] = *r.completion_timeout_seconds;
  if (r.post_copy) b["postCopy"] = *r.post_copy;
  if (r.post_copy_after_passes) b["postCopyAfterPasses"] = *r.post_copy_after_passes;
  if (r.post_copy_after_seconds) b["postCopyAfterSeconds"] = *r.post_copy_after_seconds;
  if (r.post_copy_preempt) b["postCopyPreempt"] = true;
  return b;
}

}  // namespace rdmig::controller
