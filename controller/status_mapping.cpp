#include "controller/status_mapping.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "common/json_limits.h"
#include "common/text.h"
#include "common/units.h"

namespace rdmig::controller {

using nlohmann::json;

bool agent_phase_terminal(const std::string& phase) {
  return phase == "Succeeded" || phase == "Failed" || phase == "Cancelled";
}

namespace {
std::string reason_of(const json& s) {
  const auto& r = s.value("result", json::object());
  if (r.contains("reason") && r["reason"].is_string()) return r["reason"].get<std::string>();
  return "";
}
std::string with_reason(const std::string& side, const std::string& phase, const std::string& reason) {
  return side + " agent: migration " + phase + (reason.empty() ? "" : ": " + reason);
}
}  // namespace

bool vm_left_paused_on_source(const json& source) {
  if (!source.is_object() || source.value("phase", "") != "Failed") return false;
  // The agent names the kind (result.failureKind); agents from before it said so in words only.
  if (source.contains("result") && source["result"].is_object() && source["result"].contains("failureKind") &&
      source["result"]["failureKind"].is_string()) {
    return source["result"]["failureKind"].get<std::string>() == "vm_paused_on_source";
  }
  return reason_of(source).find(kPausedOnSourceText) != std::string::npos;
}

Verdict judge(const json& source, const json& target) {
  const std::string sp = source.value("phase", "");
  const std::string tp = target.value("phase", "");
  if (sp == "Succeeded" && tp == "Succeeded") return {Outcome::kSucceeded, kReasonSucceeded, ""};
  if (sp == "Cancelled") {
    return {Outcome::kCancelled, kReasonCancelledOnAgent, with_reason("source", "cancelled", reason_of(source))};
  }
  if (sp == "Failed") {
    // The source's reason usually says "peer closed"; the target's may say why.
    std::string reason = with_reason("source", "failed", reason_of(source));
    if (tp == "Failed" && !reason_of(target).empty()) reason += "; " + with_reason("target", "failed", reason_of(target));
    return {Outcome::kFailed, vm_left_paused_on_source(source) ? kReasonVmPausedOnSource : kReasonSourceFailed, reason};
  }
  if (tp == "Failed" || tp == "Cancelled") {
    return {Outcome::kFailed, kReasonTargetFailed,
            with_reason("target", tp == "Failed" ? "failed" : "cancelled", reason_of(target))};
  }
  return {Outcome::kRunning, "", ""};
}

bool transport_fell_back(const json& status) {
  if (!status.is_object()) return false;
  const json& t = status.value("transport", json());
  const json& r = status.value("transportReason", json());
  if (!t.is_string() || !r.is_string() || r.get<std::string>().empty()) return false;
  return t.get<std::string>() == "tcp" && r.get<std::string>() != "requested";
}

std::string transport_fallback_message(const json& status) {
  const std::string reason = status.value("transportReason", std::string());
  // "auto-no-peer-rdma:no-address": the agents' reason, then the agent's own RDMA reason code.
  const auto colon = reason.find(':');
  const std::string base = reason.substr(0, colon);
  const std::string code = colon == std::string::npos ? "" : reason.substr(colon + 1);
  std::string why;
  if (base == "auto-no-peer-rdma") why = "the target agent has no usable RDMA device";
  else if (base == "auto-no-source-rdma" || base == "auto-no-local-rdma") why = "the source agent has no usable RDMA device";
  else if (base == "target-requested-tcp") why = "the target agent was configured for TCP";
  if (!why.empty() && !code.empty()) {
    if (code == "no-device") why += " (no RDMA device matches its rdma config, or its port is down)";
    else if (code == "no-address") why += " (the RDMA device's interface has no IP address)";
    else if (code == "gid-not-found") why += " (no RoCE v2 GID for the interface's address)";
    else if (code == "listener-failed") why += " (its rdma_cm listener could not start)";
    else if (code == "transport-tcp") why += " (it is configured with transport: tcp)";
    if (code == "mtu-mismatch") {
      why = "the two agents' RDMA ports have different active MTUs (give both RDMA interfaces the same MTU)";
    } else if (code == "unreachable") {
      why = "both agents have RDMA, but the source's rdma_cm could not reach the target agent's RDMA address "
            "(address or route resolution failed, the connect timed out or was refused: check routing and that "
            "RoCE v2, UDP 4791, passes between the nodes; the source agent's log names the failing call)";
    } else {
      why += "; its log and rdmig_rdma_selected say which";
    }
  }
  return "the agents carry this migration over TCP, not RDMA (transportReason " + reason +
         (why.empty() ? "" : ": " + why) + ")";
}

void copy_agent_status(json& status, const json& source, const json& target) {
  if (!status.is_object()) status = json::object();
  const json& p = source.value("progress", json::object());
  json progress = status.value("progress", json::object());
  auto copy_int = [&](const char* from, const char* to) {
    if (p.contains(from) && p[from].is_number()) progress[to] = static_cast<int64_t>(std::llround(p[from].get<double>()));
  };
  copy_int("transferredBytes", "transferredBytes");
  copy_int("remainingBytes", "remainingBytes");
  copy_int("totalBytes", "totalBytes");
  copy_int("throughputBytesPerSecond", "throughputBytesPerSecond");
  copy_int("dirtyRateBytesPerSecond", "dirtyRateBytesPerSecond");
  copy_int("passes", "passes");
  copy_int("chunksSent", "chunksSent");
  if (p.contains("percent") && p["percent"].is_number()) {
    progress["percent"] = std::clamp<int64_t>(static_cast<int64_t>(std::floor(p["percent"].get<double>())), 0, 100);
  }
  const json& tprog = target.value("progress", json::object());
  if (tprog.contains("chunksReceived") && tprog["chunksReceived"].is_number()) {
    progress["chunksReceived"] = tprog["chunksReceived"].get<int64_t>();
  }
  if (!progress.empty()) status["progress"] = progress;

  if (source.contains("transport") && source["transport"].is_string()) status["transport"] = source["transport"];
  // The source learns the reason from the target's welcome; either side's will do before that.
  for (const json* side : {&source, &target}) {
    if (side->contains("transportReason") && (*side)["transportReason"].is_string() &&
        !(*side)["transportReason"].get<std::string>().empty()) {
      status["transportReason"] = (*side)["transportReason"];
      break;
    }
  }
  if (source.contains("channels") && source["channels"].is_number()) status["channels"] = source["channels"];
  if (source.contains("chunkSize") && source["chunkSize"].is_number_integer() && source["chunkSize"].get<int64_t>() > 0) {
    status["chunkSize"] = format_quantity(source["chunkSize"].get<uint64_t>());
  }
  const json& r = source.value("result", json::object());
  auto copy_ms = [&](const char* key) {
    if (r.contains(key) && r[key].is_number()) status[key] = r[key].get<int64_t>();
  };
  copy_ms("downtimeMs");
  copy_ms("switchoverMs");
  copy_ms("totalTimeMs");
  if (r.contains("targetState") && r["targetState"].is_string()) status["targetState"] = r["targetState"];
  // Failover (docs/failover.md): the source's count and its last one, when both agents run it.
  if (const json& fo = source.value("failover", json::object());
      fo.is_object() && fo.contains("enabled") && fo["enabled"].is_boolean() && fo["enabled"].get<bool>()) {
    json f{{"enabled", true}};
    if (fo.contains("failovers") && fo["failovers"].is_number_integer() && fo["failovers"].get<int64_t>() >= 0) {
      f["failovers"] = fo["failovers"].get<int64_t>();
    }
    // An over-long reason is left out, not cut (the CRD bounds it at 1024).
    if (fo.contains("last") && fo["last"].is_string() && fo["last"].get<std::string>().size() <= 1024) f["last"] = fo["last"];
    status["failover"] = std::move(f);
  }
  // Post-copy: the source's switch and figures (with the target's page-fault figures in them).
  if (const json& pc = source.value("postCopy", json::object()); pc.is_object() && pc.value("mode", "") != "" &&
                                                                  pc.value("mode", "") != "never") {
    json out{{"mode", pc.value("mode", "")}, {"switched", pc.value("switched", false)}};
    if (pc.contains("preempt") && pc["preempt"].is_boolean()) out["preempt"] = pc["preempt"];
    for (const char* key : {"switchAfterMs", "phaseMs", "pageRequests", "blocktimeMs"}) {
      if (pc.contains(key) && pc[key].is_number_integer()) out[key] = pc[key].get<int64_t>();
    }
    if (pc.contains("trigger") && pc["trigger"].is_string() && pc["trigger"].get<std::string>().size() <= 64) {
      out["trigger"] = pc["trigger"];
    }
    for (const char* key : {"pageLatencyUs", "pageLatencyP50Us", "pageLatencyP99Us"}) {
      if (pc.contains(key) && page_latency_us_in_bounds(pc[key])) {
        out[key] = static_cast<int64_t>(std::llround(pc[key].get<double>()));
      }
    }
    status["postCopy"] = std::move(out);
  }
  if (auto rails = status_rails(source, target); !rails.empty()) status["rails"] = std::move(rails);
  if (auto left = status_rails_left_out(source, target); !left.empty()) status["railsLeftOut"] = std::move(left);
  // After the end QEMU may report no current rate: show the average over the whole run.
  if (agent_phase_terminal(source.value("phase", "")) && progress.value("throughputBytesPerSecond", int64_t{0}) == 0 &&
      status.value("totalTimeMs", int64_t{0}) > 0 && progress.value("transferredBytes", int64_t{0}) > 0) {
    status["progress"]["throughputBytesPerSecond"] =
        progress["transferredBytes"].get<int64_t>() * 1000 / status["totalTimeMs"].get<int64_t>();
  }
}

namespace {
bool is_count(const json& j) { return j.is_number_integer() && j.get<int64_t>() >= 0; }

// A short string field of an agent's document, or nothing: an over-long one is left out, not cut,
// so the status never shows a truncated address or GID as if it were real.
void copy_short(json& out, const char* to, const json& from, const char* key, size_t max) {
  const auto it = from.find(key);
  if (it != from.end() && it->is_string() && !it->get_ref<const std::string&>().empty() &&
      it->get_ref<const std::string&>().size() <= max) {
    out[to] = *it;
  }
}

}  // namespace

json bounded_channel_list(const json& channels, size_t max_items, uint64_t max_index) {
  json out = json::array();
  for (const auto& c : channels) {
    if (out.size() >= max_items) break;
    if (is_count(c) && c.get<uint64_t>() <= max_index) out.push_back(c);
  }
  return out;
}

std::vector<std::pair<uint64_t, const json*>> agent_rail_entries(const json& view, size_t max_rails) {
  std::vector<std::pair<uint64_t, const json*>> out;
  const auto it = view.find("rails");
  if (it == view.end() || !it->is_array()) return out;
  std::set<uint64_t> seen;
  for (const auto& r : *it) {
    if (out.size() >= max_rails) break;
    if (!r.is_object()) continue;
    const auto idx = r.find("rail");
    if (idx == r.end() || !is_count(*idx) || idx->get<uint64_t>() >= max_rails) continue;
    if (seen.insert(idx->get<uint64_t>()).second) out.emplace_back(idx->get<uint64_t>(), &r);
  }
  return out;
}

json status_rails(const json& source, const json& target) {
  std::map<uint64_t, json> by_rail;
  for (const auto& [role, side] : {std::pair{"source", &source}, std::pair{"target", &target}}) {
    if (!side->is_object()) continue;
    const bool is_source = std::string_view(role) == "source";
    for (const auto& [rail, r] : agent_rail_entries(*side, kMaxStatusRails)) {
      json& e = by_rail[rail];
      e["rail"] = rail;
      if (const auto ch = r->find("channels"); ch != r->end() && ch->is_array() && !e.contains("channels")) {
        e["channels"] = bounded_channel_list(*ch, kMaxStatusRailChannels, kMaxStatusRailChannels - 1);
      }
      // Payload bytes from the source to the target on this rail: the source's count, else the
      // target's.
      for (const auto& [to, from] : {std::pair{"bytes", is_source ? "bytesSent" : "bytesReceived"},
                                     std::pair{"chunks", is_source ? "chunksSent" : "chunksReceived"},
                                     std::pair{"throughputBytesPerSecond", "throughputBytesPerSecond"}}) {
        const auto v = r->find(from);
        if (v != r->end() && is_count(*v) && (is_source || !e.contains(to))) e[to] = *v;
      }
      const std::string me = is_source ? "source" : "target", peer = is_source ? "target" : "source";
      copy_short(e, (me + "Device").c_str(), *r, "device", 64);
      copy_short(e, (me + "Gid").c_str(), *r, "gid", 64);
      copy_short(e, (me + "Address").c_str(), *r, "address", 64);
      if (!e.contains(peer + "Address")) copy_short(e, (peer + "Address").c_str(), *r, "peerAddress", 64);
    }
  }
  json out = json::array();
  for (auto& [rail, e] : by_rail) out.push_back(std::move(e));
  return out;
}

json status_rails_left_out(const json& source, const json& target) {
  json out = json::array();
  for (const auto& [role, side] : {std::pair{"source", &source}, std::pair{"target", &target}}) {
    if (!side->is_object()) continue;
    const auto it = side->find("railsLeftOut");
    if (it == side->end() || !it->is_array()) continue;
    size_t n = 0;
    for (const auto& r : *it) {
      if (n >= kMaxStatusRails) break;
      if (!r.is_object()) continue;
      const auto idx = r.find("rail");
      if (idx == r.end() || !is_count(*idx) || idx->get<uint64_t>() >= kMaxStatusRails) continue;
      json e{{"side", role}, {"rail", *idx}};
      copy_short(e, "reason", r, "reason", 64);
      copy_short(e, "message", r, "message", 512);
      out.push_back(std::move(e));
      ++n;
    }
  }
  return out;
}

namespace {
std::string decimal_si(double v, const char* unit) {
  const char* prefixes[] = {"", "k", "M", "G", "T", "P"};
  int i = 0;
  while (v >= 1000.0 && i < 5) {
    v /= 1000.0;
    ++i;
  }
  char buf[48];
  if (i == 0 || v >= 100.0) std::snprintf(buf, sizeof buf, "%.0f%s%s", v, prefixes[i], unit);
  else std::snprintf(buf, sizeof buf, "%.1f%s%s", v, prefixes[i], unit);
  return buf;
}
bool number(const json& j, const char* key) { return j.is_object() && j.contains(key) && j[key].is_number(); }
}  // namespace

void update_display(json& status) {
  if (!status.is_object()) return;
  json display = json::object();
  const json& p = status.value("progress", json::object());
  if (number(p, "percent")) display["progress"] = std::to_string(p["percent"].get<int64_t>()) + "%";
  else if (number(p, "transferredBytes")) display["progress"] = decimal_si(p["transferredBytes"].get<double>(), "B") + " sent";
  if (number(status, "downtimeMs")) display["downtime"] = std::to_string(status["downtimeMs"].get<int64_t>()) + "ms";
  if (number(status, "switchoverMs")) display["switchover"] = std::to_string(status["switchoverMs"].get<int64_t>()) + "ms";
  if (number(p, "throughputBytesPerSecond") && p["throughputBytesPerSecond"].get<double>() > 0) {
    display["throughput"] = decimal_si(p["throughputBytesPerSecond"].get<double>(), "B/s");
  }
  if (number(p, "transferredBytes")) display["bytes"] = decimal_si(p["transferredBytes"].get<double>(), "B");
  if (display.empty()) status.erase("display");
  else status["display"] = display;
}

void copy_kubevirt_record(json& status, const json& item) {
  if (!status.is_object()) status = json::object();
  if (!item.is_object()) return;
  auto str = [&](const char* from, const char* to) {
    if (item.contains(from) && item[from].is_string()) status[to] = item[from];
  };
  str("transport", "transport");
  str("transportReason", "transportReason");
  if (number(item, "connections")) status["channels"] = item["connections"].get<int64_t>();
  json progress = status.value("progress", json::object());
  auto num = [&](const json& from, const char* key, const char* to) {
    if (number(from, key)) progress[to] = static_cast<int64_t>(std::llround(from[key].get<double>()));
  };
  num(item, "bytesSent", "transferredBytes");
  num(item, "chunksSent", "chunksSent");
  num(item, "chunksReceived", "chunksReceived");
  num(item, "throughputBytesPerSecond", "throughputBytesPerSecond");
  if (number(item, "progressPercent")) {  // optional: libvirt's dataProcessed/dataTotal, when the agent knows it
    progress["percent"] = std::clamp<int64_t>(static_cast<int64_t>(item["progressPercent"].get<double>()), 0, 100);
  }
  const json& lv = item.value("libvirt", json::object());
  if (lv.is_object()) {
    num(lv, "dataTotalBytes", "totalBytes");
    if (number(lv, "downtimeMs")) status["downtimeMs"] = lv["downtimeMs"].get<int64_t>();
    if (number(lv, "totalTimeMs")) status["totalTimeMs"] = lv["totalTimeMs"].get<int64_t>();
  }
  if (number(item, "switchoverMs")) status["switchoverMs"] = item["switchoverMs"].get<int64_t>();
  if (!progress.empty()) status["progress"] = progress;
  // The record is one agent's view: its rails fill that side (and the peer's address).
  const bool from_target = item.value("role", "") == "target";
  if (auto rails = from_target ? status_rails(json::object(), item) : status_rails(item, json::object());
      !rails.empty()) {
    status["rails"] = std::move(rails);
  }
}

void copy_kubevirt_state(json& status, const json& vmim, const json& ms) {
  json kv = status.value("kubevirt", json::object());
  const auto& md = vmim.value("metadata", json::object());
  const auto& st = vmim.value("status", json::object());
  if (md.contains("name")) kv["migrationName"] = md["name"];
  if (md.contains("uid")) kv["migrationUid"] = md["uid"];
  if (st.contains("phase") && st["phase"].is_string()) kv["migrationPhase"] = st["phase"];
  if (st.contains("phaseTransitionTimestamps") && st["phaseTransitionTimestamps"].is_array()) {
    json stamps = json::array();
    for (const auto& t : st["phaseTransitionTimestamps"]) {
      if (t.is_object() && t.contains("phase") && t.contains("phaseTransitionTimestamp")) {
        stamps.push_back(json{{"phase", t["phase"]}, {"phaseTransitionTimestamp", t["phaseTransitionTimestamp"]}});
      }
    }
    kv["phaseTransitionTimestamps"] = stamps;
  }
  if (ms.is_object()) {
    for (const char* k : {"targetPod", "mode", "startTimestamp", "endTimestamp", "failureReason", "abortStatus"}) {
      if (ms.contains(k) && ms[k].is_string() && !ms[k].get<std::string>().empty()) kv[k] = ms[k];
    }
    for (const char* k : {"completed", "failed"}) {
      if (ms.contains(k) && ms[k].is_boolean()) kv[k] = ms[k];
    }
    if (ms.contains("sourceNode") && ms["sourceNode"].is_string()) status["sourceNode"] = ms["sourceNode"];
    if (ms.contains("targetNode") && ms["targetNode"].is_string() && !ms["targetNode"].get<std::string>().empty()) {
      status["targetNode"] = ms["targetNode"];
    }
  }
  status["kubevirt"] = kv;
}

std::string phase_for_vmim_phase(const std::string& p) {
  if (p == "Pending" || p == "Scheduling" || p == "Scheduled" || p == "PreparingTarget" || p == "TargetReady" ||
      p.empty()) {
    return "PreparingTarget";
  }
  if (p == "Running") return "Migrating";
  if (p == "Succeeded" || p == "Failed") return p;
  return "";
}

void set_condition(json& status, const std::string& type, const std::string& status_value, const std::string& reason,
                   const std::string& message_in, int64_t generation, const std::string& now) {
  if (!status.is_object()) status = json::object();
  const std::string message = utf8_prefix(message_in, kMaxMessageBytes);
  json& conds = status["conditions"];
  if (!conds.is_array()) conds = json::array();
  for (auto& c : conds) {
    if (c.value("type", "") != type) continue;
    if (c.value("status", "") != status_value) c["lastTransitionTime"] = now;
    c["status"] = status_value;
    c["reason"] = reason;
    c["message"] = message;
    c["observedGeneration"] = generation;
    return;
  }
  conds.push_back(json{{"type", type},
                       {"status", status_value},
                       {"reason", reason},
                       {"message", message},
                       {"observedGeneration", generation},
                       {"lastTransitionTime", now}});
}

}  // namespace rdmig::controller
