#include "controller/pathcheck_reconciler.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <tuple>

#include "common/log.h"
#include "common/units.h"
#include "controller/kubevirt.h"
#include "controller/reconcile_util.h"
#include "controller/status_mapping.h"
#include "k8s/selectors.h"
#include "k8s/time_format.h"

namespace rdmig::controller {

using nlohmann::json;
using detail::has_finalizer;
using detail::now_text;

namespace {

constexpr int64_t kAgentGraceSeconds = 30;  // past a pair's deadline before the controller gives up on it
// Starting a pair on its agents: a transient refusal (the agent runs its 4 checks or its buffer
// budget is taken, it does not answer, 503) is tried again this many times in all, 1, 2, 4 s
// apart; any other refusal, or the last, fails the pair naming it.
constexpr int kMaxPairStartAttempts = 4;

bool retryable(const Error& e) {
  return e.code == Errc::kResourceExhausted || e.code == Errc::kTimeout ||
         (e.code == Errc::kUnavailable && !AgentClient::is_tls_failure(e));
}

bool terminal(const std::string& phase) { return phase == "Succeeded" || phase == "Failed"; }
bool pair_done(const std::string& phase) { return phase == "Passed" || phase == "FellBack" || phase == "Failed"; }

int64_t int_field(const json& spec, const char* key, int64_t def) {
  auto it = spec.find(key);
  return it != spec.end() && it->is_number_integer() ? it->get<int64_t>() : def;
}

std::string rate_text(double bytes_per_second) { return format_bytes_human(bytes_per_second) + "/s"; }

// The check id both agents use for pair `index`: a DNS label unique to the object.
std::string check_id(const json& obj, size_t index) {
  std::string uid = obj["metadata"].value("uid", "");
  std::string clean;
  for (char c : uid) {
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) clean += c;
    if (clean.size() == 12) break;
  }
  if (clean.empty()) clean = random_hex(6);
  return "pc-" + clean + "-" + std::to_string(index);
}

// Sets condition `type` in `status.conditions`, keeping lastTransitionTime when the status holds.
void set_condition(json& status, const std::string& type, bool value, const std::string& reason,
                   const std::string& message) {
  json conditions = status.value("conditions", json::array());
  const std::string st = value ? "True" : "False";
  json out = json::array();
  json existing;
  for (const auto& c : conditions) {
    if (c.value("type", "") == type) existing = c;
    else out.push_back(c);
  }
  std::string since = now_text();
  if (existing.is_object() && existing.value("status", "") == st) since = existing.value("lastTransitionTime", since);
  out.push_back(json{{"type", type}, {"status", st}, {"lastTransitionTime", since},
                     {"reason", reason.empty() ? "Unknown" : reason}, {"message", message.substr(0, 32000)}});
  status["conditions"] = out;
}

}  // namespace

std::string pathcheck_path(const json& obj) {
  const auto& md = obj["metadata"];
  return "/apis/rdmig.io/v1alpha1/namespaces/" + md.value("namespace", "") + "/rdmapathchecks/" + md.value("name", "");
}

std::string pair_phase_of(const json& view, const std::string& transport) {
  const std::string phase = view.value("phase", "");
  if (phase == "Succeeded") {
    return transport == "auto" && view.value("transport", "") != "rdma" ? "FellBack" : "Passed";
  }
  if (phase == "Failed" || phase == "Cancelled") return "Failed";
  return "";
}

namespace {
bool is_count(const json& j) { return j.is_number_integer() && j.get<int64_t>() >= 0; }
}  // namespace

json pathcheck_rdma_end(const json& end) {
  if (!end.is_object()) return nullptr;
  json out = json::object();
  for (const char* key : {"device", "gid", "gidType", "netdev"}) {
    const auto it = end.find(key);
    if (it != end.end() && it->is_string()) out[key] = it->get<std::string>().substr(0, 64);
  }
  for (const auto& [key, lo, hi] : {std::tuple{"port", 0, 255}, std::tuple{"gidIndex", -1, 65535},
                                    std::tuple{"mtu", 0, 4096}}) {
    const auto it = end.find(key);
    if (it != end.end() && it->is_number_integer()) out[key] = std::clamp<int64_t>(it->get<int64_t>(), lo, hi);
  }
  return out;
}

json pathcheck_rails(const json& view) {
  json out = json::array();
  for (const auto& [index, entry] : agent_rail_entries(view, kMaxPathCheckRails)) {
    const json& r = *entry;
    json rail{{"rail", index}};
    if (const auto ch = r.find("channels"); ch != r.end() && ch->is_array()) {
      rail["channels"] = bounded_channel_list(*ch, kMaxPathCheckRailChannels, kMaxPathCheckRailChannels);
    }
    // The source's bytes on the rail: set when the target verified the stream.
    if (const auto b = r.find("bytesSent"); b != r.end() && is_count(*b)) rail["bytes"] = *b;
    for (const auto& [from, to] : {std::pair{"localRdma", "sourceRdma"}, std::pair{"peerRdma", "targetRdma"}}) {
      const auto e = r.find(from);
      if (e != r.end() && e->is_object()) rail[to] = pathcheck_rdma_end(*e);
    }
    out.push_back(std::move(rail));
  }
  return out;
}

json pathcheck_summary(const json& pairs) {
  int64_t passed = 0, fell_back = 0, failed = 0;
  const json* worst = nullptr;
  int worst_rank = -1;
  double worst_rate = 0;
  for (const auto& p : pairs) {
    const std::string phase = p.value("phase", "");
    int rank = -1;
    if (phase == "Failed") ++failed, rank = 2;
    else if (phase == "FellBack") ++fell_back, rank = 1;
    else if (phase == "Passed") ++passed, rank = 0;
    if (rank < 0) continue;
    const double rate = p.value("throughputBytesPerSecond", 0.0);
    if (rank > worst_rank || (rank == worst_rank && rate < worst_rate)) {
      worst = &p, worst_rank = rank, worst_rate = rate;
    }
  }
  json summary{{"pairs", pairs.size()}, {"passed", passed}, {"fellBack", fell_back}, {"failed", failed}};
  if (worst) {
    const std::string who = worst->value("source", "") + "->" + worst->value("target", "");
    std::string what;
    if (worst_rank == 2) what = "failed: " + worst->value("error", std::string("?")).substr(0, 120);
    else if (worst_rank == 1) what = "tcp (" + worst->value("reason", std::string("?")) + ") " + rate_text(worst_rate);
    else what = worst->value("transport", std::string("?")) + " " + rate_text(worst_rate);
    summary["worst"] = who + " " + what;
  }
  return summary;
}

PathCheckReconciler::PathCheckReconciler(const ControllerConfig& config, std::string agent_namespace,
                                         k8s::KubeClient& kube, k8s::Informer& informer, AgentClient& agents,
                                         k8s::EventRecorder& events, ControllerMetrics& metrics)
    : config_(config),
      agent_namespace_(std::move(agent_namespace)),
      kube_(kube),
      informer_(informer),
      agents_(agents),
      events_(events),
      metrics_(metrics) {}

bool PathCheckReconciler::needs_poll(const json& obj) const {
  if (obj["metadata"].contains("deletionTimestamp")) return has_finalizer(obj);
  const json status = obj.value("status", json::object());
  const std::string phase = status.is_object() ? status.value("phase", "") : "";
  if (!terminal(phase)) return true;
  if (has_finalizer(obj)) return true;
  const json spec = obj.value("spec", json::object());
  if (!spec.is_object() || !spec.contains("ttlSecondsAfterFinished")) return false;
  const auto due = deletion_due(obj, 0);
  return due && k8s::Clock::now() >= *due;
}

Result<Next> PathCheckReconciler::reconcile(const std::string& key) {
  auto cached = informer_.get(key);
  if (!cached) return Next::kDone;
  json obj = *cached;
  if (obj["metadata"].contains("deletionTimestamp")) return finalize(obj);
  const json status = obj.value("status", json::object());
  const std::string phase = status.is_object() ? status.value("phase", "") : "";
  if (terminal(phase)) return finished(obj);
  if (phase.empty() || phase == "Pending") return begin(obj);
  return run(obj);
}

Result<Next> PathCheckReconciler::fail_invalid(const json& obj, const std::string& message) {
  json status = obj.value("status", json::object());
  status["phase"] = "Failed";
  status["completionTime"] = now_text();
  set_condition(status, "Complete", true, "InvalidSpec", message);
  events_.record(obj, "Warning", "InvalidSpec", message);
  auto w = write_status(obj, status);
  if (!w) return w.error();
  return Next::kDone;
}

Result<std::vector<std::string>> PathCheckReconciler::resolve_targets(const json& spec, const std::string& source) {
  const json targets = spec.value("targets", json::object());
  std::set<std::string> nodes;
  if (targets.contains("nodes") && targets["nodes"].is_array()) {
    for (const auto& n : targets["nodes"]) {
      if (n.is_string()) nodes.insert(n.get<std::string>());
    }
  } else if (targets.contains("selector") && targets["selector"].is_object()) {
    std::map<std::string, std::string> labels;
    for (const auto& [k, v] : targets["selector"].items()) {
      if (v.is_string()) labels[k] = v.get<std::string>();
    }
    auto list = kube_.get("/api/v1/nodes?labelSelector=" + k8s::url_encode(k8s::label_selector(labels)));
    if (!list) return list.error().with_context("listing nodes by targets.selector");
    for (const auto& n : list->value("items", json::array())) nodes.insert(n["metadata"].value("name", ""));
  } else if (targets.value("all", false)) {
    auto pods = kube_.get("/api/v1/namespaces/" + agent_namespace_ + "/pods?labelSelector=" +
                          k8s::url_encode(k8s::label_selector(config_.agents.labels)));
    if (!pods) return pods.error().with_context("listing agent pods for targets.all");
    for (const auto& p : pods->value("items", json::array())) {
      const std::string node = p.value("spec", json::object()).value("nodeName", "");
      if (!node.empty()) nodes.insert(node);
    }
  } else {
    return Error{Errc::kInvalidArgument, "spec.targets: name exactly one of nodes, selector, all (true)"};
  }
  nodes.erase(source);
  nodes.erase("");
  if (nodes.empty()) return Error{Errc::kInvalidArgument, "spec.targets: no target node besides the source"};
  if (nodes.size() > kMaxPathCheckPairs) {
    return Error{Errc::kInvalidArgument, "spec.targets: " + std::to_string(nodes.size()) + " nodes, at most " +
                                             std::to_string(kMaxPathCheckPairs) + " pairs per check"};
  }
  return std::vector<std::string>(nodes.begin(), nodes.end());
}

Result<Next> PathCheckReconciler::begin(json obj) {
  const json spec = obj.value("spec", json::object());
  const std::string source = spec.value("source", "");
  if (source.empty()) return fail_invalid(obj, "spec.source: required");
  // bytes: a quantity or a count (the schema's pattern), bounded here too.
  uint64_t bytes = kDefaultPathCheckBytes;
  if (auto it = spec.find("bytes"); it != spec.end()) {
    Result<uint64_t> b = it->is_string() ? parse_bytes(it->get<std::string>(), "spec.bytes")
                                         : (it->is_number_unsigned() ? Result<uint64_t>(it->get<uint64_t>())
                                                                     : Result<uint64_t>(Error{Errc::kInvalidArgument, "spec.bytes: not a size"}));
    if (!b) return fail_invalid(obj, b.error().message);
    bytes = b.value();
  }
  if (bytes < 1 || bytes > kMaxPathCheckBytes) {
    return fail_invalid(obj, "spec.bytes: must be between 1 and " + format_quantity(kMaxPathCheckBytes));
  }
  auto targets = resolve_targets(spec, source);
  if (!targets) {
    if (targets.error().code == Errc::kInvalidArgument) return fail_invalid(obj, targets.error().message);
    return targets.error();
  }
  if (!has_finalizer(obj)) {
    auto updated = set_finalizer(obj, true);
    if (!updated) return updated.error();
    obj = updated.value();
  }
  json pairs = json::array();
  for (const auto& t : targets.value()) {
    pairs.push_back(json{{"source", source}, {"target", t}, {"phase", "Pending"}, {"bytes", bytes},
                         {"checkId", check_id(obj, pairs.size())}});
  }
  json status = obj.value("status", json::object());
  status["phase"] = "Running";
  status["startTime"] = now_text();
  status["pairs"] = pairs;
  status["summary"] = pathcheck_summary(pairs);
  set_condition(status, "Complete", false, "Running", std::to_string(pairs.size()) + " pair(s) from " + source);
  events_.record(obj, "Normal", "Started", "checking " + std::to_string(pairs.size()) + " pair(s) from " + source);
  auto w = write_status(obj, status);
  if (!w) return w.error();
  return Next::kRequeueNow;
}

bool PathCheckReconciler::start_pair(const json& obj, json& pair) {
  const json spec = obj.value("spec", json::object());
  const std::string id = pair.value("checkId", "");
  if (auto next = k8s::parse_time(pair.value("nextAttemptTime", "")); next && k8s::Clock::now() < *next) return false;
  auto fail = [&](const std::string& why) {
    pair["phase"] = "Failed";
    pair["error"] = why;
    pair.erase("nextAttemptTime");
    return false;
  };
  // A transient refusal leaves the pair Pending for another attempt, the refusal in its error.
  auto refused = [&](const Error& e, const std::string& why) {
    const auto attempts = int_field(pair, "attempts", 1);
    const std::string attempt =
        " (attempt " + std::to_string(attempts) + " of " + std::to_string(kMaxPairStartAttempts);
    if (!retryable(e) || attempts >= kMaxPairStartAttempts) return fail(attempts > 1 ? why + attempt + ")" : why);
    pair["error"] = why + attempt + "; trying again)";
    pair["nextAttemptTime"] = k8s::format_time(k8s::Clock::now() + std::chrono::seconds(int64_t{1} << (attempts - 1)));
    return false;
  };
  auto target_agent = locate_agent(kube_, config_, agent_namespace_, pair.value("target", ""));
  if (!target_agent) return fail("target agent: " + target_agent.error().message);
  auto source_agent = locate_agent(kube_, config_, agent_namespace_, pair.value("source", ""));
  if (!source_agent) return fail("source agent: " + source_agent.error().message);
  json body{{"id", id},
            {"bytes", pair.value("bytes", kDefaultPathCheckBytes)},
            {"transport", spec.value("transport", "auto")},
            {"channels", int_field(spec, "channels", 1)},
            {"timeoutSeconds", int_field(spec, "timeoutSeconds", 120)},
            {"allowDuringMigrations", spec.value("allowDuringMigrations", false)}};
  if (auto it = spec.find("chunkSize"); it != spec.end()) body["chunkSize"] = *it;
  pair["attempts"] = int_field(pair, "attempts", 0) + 1;
  json tbody = body;
  tbody["role"] = "target";
  auto t = agents_.create_pathcheck(target_agent.value(), tbody);
  if (!t) return refused(t.error(), "target agent " + target_agent->node + " (" + target_agent->address() + "): " +
                                        t.error().message);
  json sbody = body;
  sbody["role"] = "source";
  sbody["target"] = json{{"endpoint", t->value("endpoint", "")}, {"checkId", t->value("checkId", id)},
                         {"token", t->value("token", "")}};
  auto s = agents_.create_pathcheck(source_agent.value(), sbody);
  if (!s) {
    (void)agents_.cancel_pathcheck(target_agent.value(), id);  // leave nothing waiting behind
    return refused(s.error(), "source agent " + source_agent->node + " (" + source_agent->address() + "): " +
                                  s.error().message);
  }
  pair["phase"] = "Running";
  pair.erase("error");
  pair.erase("nextAttemptTime");
  pair["startTime"] = now_text();
  return true;
}

void PathCheckReconciler::poll_pair(const json& obj, json& pair) {
  const json spec = obj.value("spec", json::object());
  const std::string id = pair.value("checkId", "");
  auto gone_too_long = [&] {
    auto started = k8s::parse_time(pair.value("startTime", ""));
    const auto limit = std::chrono::seconds(int_field(spec, "timeoutSeconds", 120) + kAgentGraceSeconds);
    return !started || k8s::Clock::now() - *started > limit;
  };
  auto source_agent = locate_agent(kube_, config_, agent_namespace_, pair.value("source", ""));
  Result<json> view = source_agent ? agents_.get_pathcheck(source_agent.value(), id) : Result<json>(source_agent.error());
  if (!view) {
    if (view.error().code == Errc::kNotFound && source_agent) {
      pair["phase"] = "Failed";
      pair["error"] = "the source agent no longer knows check " + id + " (restarted?)";
    } else if (gone_too_long()) {
      pair["phase"] = "Failed";
      pair["error"] = "source agent unreachable past the check's deadline: " + view.error().message;
    }
    if (pair["phase"] == "Failed") cancel_pair(obj, pair);
    return;
  }
  pair["bytesVerified"] = view->value("bytesSent", uint64_t{0});
  const std::string phase = pair_phase_of(view.value(), spec.value("transport", "auto"));
  if (phase.empty()) return;
  pair["phase"] = phase;
  pair["transport"] = view->value("transport", "");
  pair["reason"] = view->value("transportReason", "");
  pair["throughputBytesPerSecond"] = view->value("throughputBytesPerSecond", 0.0);
  pair["durationMs"] = view->value("durationMs", int64_t{0});
  if (view->contains("rttMicroseconds")) pair["rttMicroseconds"] = (*view)["rttMicroseconds"];
  if (auto end = pathcheck_rdma_end(view->value("localRdma", json())); end.is_object()) pair["sourceRdma"] = end;
  if (auto end = pathcheck_rdma_end(view->value("peerRdma", json())); end.is_object()) pair["targetRdma"] = end;
  if (auto rails = pathcheck_rails(view.value()); !rails.empty()) pair["rails"] = std::move(rails);
  if (view->contains("error")) pair["error"] = (*view)["error"];
  if (phase == "Failed") {
    pair["bytesVerified"] = 0;  // the target did not confirm the stream
    cancel_pair(obj, pair);     // a target end still waiting for its source stops now
  }
}

void PathCheckReconciler::cancel_pair(const json& obj, const json& pair) {
  (void)obj;
  const std::string id = pair.value("checkId", "");
  for (const char* side : {"source", "target"}) {
    auto agent = locate_agent(kube_, config_, agent_namespace_, pair.value(side, ""));
    if (!agent) continue;
    auto r = agents_.cancel_pathcheck(agent.value(), id);
    if (!r && r.error().code != Errc::kNotFound) {
      LOG_WARN("pathcheck") << informer_.key_of(obj) << ": cancelling " << id << " on the " << side
                            << " agent: " << r.error().message;
    }
  }
}

Result<Next> PathCheckReconciler::run(json obj) {
  const json spec = obj.value("spec", json::object());
  json status = obj.value("status", json::object());
  json pairs = status.value("pairs", json::array());
  const json before = pairs;
  const auto max_running = static_cast<size_t>(std::clamp<int64_t>(int_field(spec, "maxConcurrentPairs", 1), 1, 4));
  size_t running = 0;
  for (auto& p : pairs) {
    if (p.value("phase", "") != "Running") continue;
    poll_pair(obj, p);
    if (p.value("phase", "") == "Running") ++running;
  }
  for (auto& p : pairs) {
    if (running >= max_running) break;
    if (p.value("phase", "") != "Pending") continue;
    if (start_pair(obj, p)) ++running;
  }
  // Events for pairs that ended in this pass.
  for (size_t i = 0; i < pairs.size(); ++i) {
    const std::string now = pairs[i].value("phase", "");
    if (!pair_done(now) || before[i].value("phase", "") == now) continue;
    const std::string who = pairs[i].value("source", "") + "->" + pairs[i].value("target", "");
    std::optional<double> throughput;  // a failed pair carried nothing
    if (now != "Failed") throughput = pairs[i].value("throughputBytesPerSecond", 0.0);
    metrics_.pathcheck_pair_ended(pairs[i].value("source", ""), pairs[i].value("target", ""), now, throughput);
    if (now == "Failed") {
      events_.record(obj, "Warning", "PairFailed", who + ": " + pairs[i].value("error", std::string("?")));
    } else if (now == "FellBack") {
      events_.record(obj, "Warning", "PairFellBack", who + ": tcp (" + pairs[i].value("reason", std::string("?")) + ") " +
                                                         rate_text(pairs[i].value("throughputBytesPerSecond", 0.0)));
    } else {
      events_.record(obj, "Normal", "PairPassed", who + ": " + pairs[i].value("transport", std::string("?")) + " " +
                                                      rate_text(pairs[i].value("throughputBytesPerSecond", 0.0)));
    }
  }
  status["pairs"] = pairs;
  const json summary = pathcheck_summary(pairs);
  status["summary"] = summary;
  const bool all_done = std::all_of(pairs.begin(), pairs.end(), [](const json& p) { return pair_done(p.value("phase", "")); });
  if (all_done) {
    const int64_t failed = summary.value("failed", 0), fell_back = summary.value("fellBack", 0);
    status["phase"] = failed > 0 ? "Failed" : "Succeeded";
    status["completionTime"] = now_text();
    const std::string counts = std::to_string(summary.value("passed", 0)) + " passed, " + std::to_string(fell_back) +
                               " fell back, " + std::to_string(failed) + " failed; worst " + summary.value("worst", "");
    set_condition(status, "Complete", true, failed > 0 ? "PairsFailed" : "AllPairsCarried", counts);
    const bool all_rdma = std::all_of(pairs.begin(), pairs.end(), [](const json& p) {
      return p.value("phase", "") == "Passed" && p.value("transport", "") == "rdma";
    });
    set_condition(status, "RdmaOnEveryPair", all_rdma,
                  all_rdma ? "AllRdma" : failed > 0 ? "PairsFailed" : fell_back > 0 ? "TransportFallback" : "TcpRequested",
                  counts);
    events_.record(obj, failed > 0 ? "Warning" : "Normal", failed > 0 ? "PairsFailed" : "Completed", counts);
  }
  if (pairs == before && !all_done) return Next::kPoll;
  auto w = write_status(obj, status);
  if (!w) return w.error();
  return all_done ? Next::kRequeueNow : Next::kPoll;
}

Result<Next> PathCheckReconciler::finalize(json obj) {
  if (!has_finalizer(obj)) return Next::kDone;
  const json status = obj.value("status", json::object());
  for (const auto& p : status.value("pairs", json::array())) {
    if (p.value("phase", "") == "Running") cancel_pair(obj, p);
  }
  events_.record(obj, "Normal", "Deleted", "cancelled the pairs still running on the agents");
  auto removed = set_finalizer(obj, false);
  if (!removed) return removed.error();
  return Next::kDone;
}

Result<Next> PathCheckReconciler::finished(json obj) {
  if (has_finalizer(obj)) {
    auto removed = set_finalizer(obj, false);
    if (!removed) return removed.error();
    if (removed.value().is_null()) return Next::kDone;
    obj = removed.value();
  }
  const json spec = obj.value("spec", json::object());
  if (!spec.is_object() || !spec.contains("ttlSecondsAfterFinished")) return Next::kDone;
  const auto due = deletion_due(obj, 0);
  if (!due || k8s::Clock::now() < *due) return Next::kDone;
  auto removed = kube_.remove(pathcheck_path(obj));
  if (!removed && removed.error().code != Errc::kNotFound) return removed.error();
  LOG_INFO("pathcheck") << informer_.key_of(obj) << ": deleted: ttlSecondsAfterFinished over";
  return Next::kDone;
}

Result<json> PathCheckReconciler::write_status(const json& obj, json status) {
  return detail::write_status(kube_, informer_, obj, pathcheck_path(obj), std::move(status));
}

Result<json> PathCheckReconciler::set_finalizer(const json& obj, bool present) {
  return detail::write_finalizer(kube_, informer_, obj, pathcheck_path(obj), present);
}

}  // namespace rdmig::controller
