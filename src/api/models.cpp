#include "api/models.h"

#include <set>

#include "common/net.h"
#include "common/units.h"

namespace rdmig::api {

using nlohmann::json;
using migration::MigrationSpec;
using migration::Role;

namespace {

Error bad(const std::string& field, const std::string& what) {
  return Error{Errc::kInvalidArgument, field + ": " + what};
}

Status check_fields(const json& obj, const std::string& prefix, const std::set<std::string>& allowed) {
  for (const auto& [key, value] : obj.items()) {
    if (!allowed.contains(key)) return bad(prefix + key, "unknown field");
  }
  return ok_status();
}

Result<std::string> string_field(const json& obj, const std::string& prefix, const char* key,
                                 bool required, size_t max_len) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (required) return bad(prefix + key, "required");
    return std::string();
  }
  if (!it->is_string()) return bad(prefix + key, "must be a string");
  auto s = it->get<std::string>();
  if (required && s.empty()) return bad(prefix + key, "must not be empty");
  if (s.size() > max_len) return bad(prefix + key, "longer than " + std::to_string(max_len) + " characters");
  return s;
}

Result<uint64_t> uint_field(const json& obj, const std::string& prefix, const char* key, uint64_t def,
                            uint64_t min, uint64_t max) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return def;
  if (!it->is_number_integer() || (it->is_number_integer() && !it->is_number_unsigned() && it->get<int64_t>() < 0)) {
    return bad(prefix + key, "must be a non-negative integer");
  }
  const auto v = it->get<uint64_t>();
  if (v < min || v > max) {
    return bad(prefix + key, "must be between " + std::to_string(min) + " and " + std::to_string(max) +
                                 ", got " + std::to_string(v));
  }
  return v;
}

bool is_dns_label(const std::string& s) {
  if (s.empty() || s.size() > 63) return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return s.front() != '-' && s.back() != '-';
}

bool is_safe_name(const std::string& s) {
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.' || c == '/';
    if (!ok) return false;
  }
  return true;
}

// A size given as a quantity ("64Mi") or a byte count.
Result<uint64_t> size_field(const json& obj, const char* key, uint64_t def) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return def;
  if (it->is_string()) return parse_bytes(it->get<std::string>(), key);
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  return bad(key, "must be a size like \"4Mi\" or a byte count");
}

// "transport" (auto, tcp or rdma); absent or empty: the agent's own.
Result<TransportKind> transport_field(const json& body, TransportKind def) {
  auto tr = string_field(body, "", "transport", false, 16);
  if (!tr) return tr.error();
  if (tr->empty()) return def;
  return parse_transport(tr.value(), "transport");
}

// The source's "target": the target agent's data-plane endpoint, the id it gave the target end
// (id_key: migrationId or checkId, a DNS label) and its one-time token. The endpoint is a
// destination this agent will dial on the client's word: the dial policy decides here, before
// anything is connected (and again at the dial).
Result<migration::TargetRef> parse_target_ref(const json& body, const char* id_key, const net::DialPolicy& policy) {
  auto it = body.find("target");
  if (it == body.end() || it->is_null()) return bad("target", "required for role 'source'");
  if (!it->is_object()) return bad("target", std::string("must be an object with endpoint, ") + id_key + " and token");
  const json& t = *it;
  RDMIG_TRY(check_fields(t, "target.", {"endpoint", id_key, "token"}));
  auto ep_text = string_field(t, "target.", "endpoint", true, 300);
  if (!ep_text) return ep_text.error();
  auto ep = net::parse_endpoint(ep_text.value(), "target.endpoint");
  if (!ep) return ep.error();
  RDMIG_TRY(policy.check(ep->host, "target.endpoint"));
  migration::TargetRef ref;
  ref.host = ep->host;
  ref.port = ep->port;
  auto id = string_field(t, "target.", id_key, true, 63);
  if (!id) return id.error();
  if (!is_dns_label(id.value())) return bad(std::string("target.") + id_key, "must be a DNS label");
  ref.migration_id = id.value();
  auto token = string_field(t, "target.", "token", true, 128);
  if (!token) return token.error();
  ref.token = token.value();
  return ref;
}

// postCopy (never | auto | after) and, with auto only, postCopyAfterPasses / postCopyAfterSeconds.
Result<migration::PostCopySpec> parse_post_copy(const json& body) {
  migration::PostCopySpec pc;
  auto mode = string_field(body, "", "postCopy", false, 16);
  if (!mode) return mode.error();
  if (mode->empty() || mode.value() == "never") pc.mode = migration::PostCopyMode::kNever;
  else if (mode.value() == "auto") pc.mode = migration::PostCopyMode::kAuto;
  else if (mode.value() == "after") pc.mode = migration::PostCopyMode::kAfter;
  else return bad("postCopy", "must be 'never', 'auto' or 'after', got '" + mode.value() + "'");
  for (const char* key : {"postCopyAfterPasses", "postCopyAfterSeconds"}) {
    if (body.contains(key) && pc.mode != migration::PostCopyMode::kAuto) {
      return bad(key, "only with postCopy 'auto'");
    }
  }
  // Pass 1 is QEMU's first bitmap sync, before any page is sent: 2 is the end of the first copy.
  auto passes = uint_field(body, "", "postCopyAfterPasses", pc.after_passes, 2, 1000);
  if (!passes) return passes.error();
  pc.after_passes = static_cast<uint32_t>(passes.value());
  auto seconds = uint_field(body, "", "postCopyAfterSeconds", pc.after_seconds, 1, 86400);
  if (!seconds) return seconds.error();
  pc.after_seconds = static_cast<uint32_t>(seconds.value());
  if (const auto it = body.find("postCopyPreempt"); it != body.end()) {
    if (!it->is_boolean()) return bad("postCopyPreempt", "must be true or false");
    pc.preempt = it->get<bool>();
    if (pc.preempt && pc.mode == migration::PostCopyMode::kNever) return bad("postCopyPreempt", "only with postCopy 'auto' or 'after'");
  }
  return pc;
}

}  // namespace

Result<MigrationSpec> parse_create_request(const json& body, const AgentConfig& defaults) {
  if (!body.is_object()) return bad("body", "must be a JSON object");
  MigrationSpec spec;
  auto role = string_field(body, "", "role", true, 16);
  if (!role) return role.error();
  if (role.value() == "source") spec.role = Role::kSource;
  else if (role.value() == "target") spec.role = Role::kTarget;
  else return bad("role", "must be 'source' or 'target', got '" + role.value() + "'");

  const std::set<std::string> common{"role", "id", "vm", "qmpSocket", "multifdChannels", "chunkSize",
                                     "ringDepth", "transport"};
  std::set<std::string> allowed = common;
  if (spec.role == Role::kSource) {
    allowed.insert({"target", "verifyChunks", "maxDowntimeMs", "maxBandwidthBytesPerSecond", "completionTimeoutSeconds",
                    "noProgressTimeoutSeconds", "postCopy", "postCopyAfterPasses", "postCopyAfterSeconds",
                    "postCopyPreempt"});
  } else {
    allowed.insert({"completionTimeoutSeconds", "noProgressTimeoutSeconds"});
  }
  if (auto st = check_fields(body, "", allowed); !st) {
    // Say why a known field of the other role is refused.
    for (const auto& [key, v] : body.items()) {
      if (!allowed.contains(key) && key == "target") return bad("target", "only for role 'source'");
      if (!allowed.contains(key) && key.rfind("postCopy", 0) == 0) {
        return bad(key, "only for role 'source' (the target follows the source)");
      }
    }
    return st.error();
  }

  auto id = string_field(body, "", "id", false, 63);
  if (!id) return id.error();
  if (!id->empty() && !is_dns_label(id.value())) {
    return bad("id", "must be a DNS label (lower-case letters, digits, '-'; at most 63)");
  }
  spec.id = id.value();
  auto vm = string_field(body, "", "vm", false, 253);
  if (!vm) return vm.error();
  if (!is_safe_name(vm.value())) return bad("vm", "may hold only letters, digits and - _ . /");
  spec.vm = vm.value();

  auto qmp = string_field(body, "", "qmpSocket", true, 107);
  if (!qmp) return qmp.error();
  if (qmp->front() != '/') return bad("qmpSocket", "must be an absolute path");
  spec.qmp_socket = qmp.value();

  auto mf = uint_field(body, "", "multifdChannels", 0, 0, migration::kMaxMultifdChannels);
  if (!mf) return mf.error();
  spec.multifd_channels = static_cast<uint32_t>(mf.value());

  auto chunk = size_field(body, "chunkSize", defaults.migration.chunk_size);
  if (!chunk) return chunk.error();
  RDMIG_TRY(validate_chunk_size(chunk.value(), "chunkSize"));
  spec.chunk_size = chunk.value();
  auto depth = uint_field(body, "", "ringDepth", defaults.migration.ring_depth, 2, 1024);
  if (!depth) return depth.error();
  spec.ring_depth = static_cast<uint32_t>(depth.value());

  auto kind = transport_field(body, defaults.transport);
  if (!kind) return kind.error();
  spec.transport = kind.value();
  auto ct = uint_field(body, "", "completionTimeoutSeconds", defaults.migration.completion_timeout_seconds,
                       10, 7 * 86400);
  if (!ct) return ct.error();
  spec.completion_timeout_seconds = static_cast<uint32_t>(ct.value());
  // Both sides: the source watches QEMU's progress, the target the bytes from the source agent.
  auto np = uint_field(body, "", "noProgressTimeoutSeconds", defaults.migration.no_progress_timeout_seconds, 5, 86400);
  if (!np) return np.error();
  spec.no_progress_timeout_seconds = static_cast<uint32_t>(np.value());

  if (spec.role == Role::kSource) {
    auto target = parse_target_ref(body, "migrationId", peer_dial_policy(defaults.data_plane));
    if (!target) return target.error();
    spec.target = std::move(target.value());

    auto dl = uint_field(body, "", "maxDowntimeMs", 300, 1, 2000000);
    if (!dl) return dl.error();
    spec.max_downtime_ms = dl.value();
    auto bw = uint_field(body, "", "maxBandwidthBytesPerSecond", 0, 0, uint64_t{1} << 50);
    if (!bw) return bw.error();
    spec.max_bandwidth_bytes_per_second = bw.value();
    spec.verify_chunks = defaults.migration.verify_chunks;
    if (const auto it = body.find("verifyChunks"); it != body.end()) {
      if (!it->is_boolean()) return bad("verifyChunks", "must be true or false");
      spec.verify_chunks = it->get<bool>();
    }
    auto pc = parse_post_copy(body);
    if (!pc) return pc.error();
    spec.post_copy = pc.value();
  }
  return spec;
}


Result<pathcheck::CheckSpec> parse_pathcheck_request(const json& body, const AgentConfig& defaults) {
  if (!body.is_object()) return bad("body", "must be a JSON object");
  pathcheck::CheckSpec spec;
  auto role = string_field(body, "", "role", true, 16);
  if (!role) return role.error();
  if (role.value() == "source") spec.role = Role::kSource;
  else if (role.value() == "target") spec.role = Role::kTarget;
  else return bad("role", "must be 'source' or 'target', got '" + role.value() + "'");
  std::set<std::string> allowed{"role", "id", "bytes", "chunkSize", "ringDepth", "channels",
                                "transport", "allowDuringMigrations", "timeoutSeconds"};
  if (spec.role == Role::kSource) allowed.insert("target");
  if (auto st = check_fields(body, "", allowed); !st) {
    if (body.contains("target")) return bad("target", "only for role 'source'");
    return st.error();
  }
  auto id = string_field(body, "", "id", false, 63);
  if (!id) return id.error();
  if (!id->empty() && !is_dns_label(id.value())) {
    return bad("id", "must be a DNS label (lower-case letters, digits, '-'; at most 63)");
  }
  spec.id = id.value();
  const PathCheckConfig& limits = defaults.path_check;
  auto bytes = size_field(body, "bytes", limits.default_bytes);
  if (!bytes) return bytes.error();
  if (bytes.value() < 1 || bytes.value() > limits.max_bytes) {
    return bad("bytes", "must be between 1 and " + format_quantity(limits.max_bytes) +
                            " (this agent's pathCheck.maxBytes), got " + std::to_string(bytes.value()));
  }
  spec.bytes = bytes.value();
  auto chunk = size_field(body, "chunkSize", defaults.migration.chunk_size);
  if (!chunk) return chunk.error();
  RDMIG_TRY(validate_chunk_size(chunk.value(), "chunkSize"));
  spec.chunk_size = chunk.value();
  auto depth = uint_field(body, "", "ringDepth", defaults.migration.ring_depth, 2, 1024);
  if (!depth) return depth.error();
  spec.ring_depth = static_cast<uint32_t>(depth.value());
  auto channels = uint_field(body, "", "channels", 1, 1, limits.max_channels);
  if (!channels) {
    return Error{channels.error().code, channels.error().message + " (this agent's pathCheck.maxChannels)"};
  }
  spec.channels = static_cast<uint32_t>(channels.value());
  auto kind = transport_field(body, defaults.transport);
  if (!kind) return kind.error();
  spec.transport = kind.value();
  if (auto it = body.find("allowDuringMigrations"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad("allowDuringMigrations", "must be true or false");
    spec.allow_during_migrations = it->get<bool>();
  }
  auto timeout = uint_field(body, "", "timeoutSeconds", limits.default_timeout_seconds, 5,
                            limits.max_timeout_seconds);
  if (!timeout) {
    return Error{timeout.error().code, timeout.error().message + " (this agent's pathCheck.maxTimeoutSeconds)"};
  }
  spec.timeout_seconds = static_cast<uint32_t>(timeout.value());
  if (spec.role == Role::kSource) {
    auto target = parse_target_ref(body, "checkId", peer_dial_policy(defaults.data_plane));
    if (!target) return target.error();
    spec.target = std::move(target.value());
  }
  return spec;
}

json error_body(const Error& error, std::string_view reason) {
  json body{{"error", {{"code", errc_name(error.code)}, {"message", error.message}}}};
  if (!reason.empty()) body["error"]["reason"] = std::string(reason);
  return body;
}

int http_status(Errc code) {
  switch (code) {
    case Errc::kInvalidArgument: return 400;
    case Errc::kUnauthenticated: return 401;
    case Errc::kPermissionDenied: return 403;
    case Errc::kNotFound: return 404;
    case Errc::kAlreadyExists: return 409;
    case Errc::kFailedPrecondition: return 409;
    case Errc::kResourceExhausted: return 429;
    case Errc::kUnprocessable: return 422;
    case Errc::kUnavailable: return 503;
    case Errc::kTimeout: return 504;
    default: return 500;
  }
}

}  // namespace rdmig::api
