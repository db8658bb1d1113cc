#include "controller/drainplan_reconciler.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>

#include "common/log.h"
#include "common/text.h"
#include "common/units.h"
#include "controller/drain_execution.h"
#include "controller/kubevirt.h"
#include "controller/reconcile_util.h"
#include "controller/status_mapping.h"
#include "k8s/selectors.h"

namespace rdmig::controller {

using nlohmann::json;
using detail::now_text;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

bool terminal(const std::string& phase) {
  return phase == "Forecast" || phase == "Completed" || phase == "Failed" || phase == "Cancelled";
}

// A byte quantity that may be an integer or a string (the CRD's int-or-string fields).
Result<uint64_t> bytes_field(const json& spec, const char* key, uint64_t def) {
  const auto it = spec.find(key);
  if (it == spec.end() || it->is_null()) return def;
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  if (it->is_string()) return parse_bytes(it->get<std::string>(), std::string("spec.") + key);
  return Error{Errc::kInvalidArgument, std::string("spec.") + key + ": not a size"};
}

// "300ms", "1.5s".
Result<double> duration_field(const json& spec, const char* key, double def) {
  const auto it = spec.find(key);
  if (it == spec.end() || it->is_null()) return def;
  const std::string text = it->is_string() ? it->get<std::string>() : "";
  const std::string field = std::string("spec.") + key;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (...) {
    return Error{Errc::kInvalidArgument, field + ": not a duration (e.g. 300ms, 1.5s): " + text.substr(0, 64)};
  }
  const std::string unit = text.substr(used);
  if (unit == "ms") v /= 1000;
  else if (unit != "s") return Error{Errc::kInvalidArgument, field + ": unit ms or s: " + text.substr(0, 64)};
  if (!(v > 0) || v > 2000) return Error{Errc::kInvalidArgument, field + ": must be above 0 and at most 2000s"};
  return v;
}

uint32_t uint_field(const json& spec, const char* key, uint32_t def, uint32_t lo, uint32_t hi) {
  const auto it = spec.find(key);
  if (it == spec.end() || !it->is_number_integer()) return def;
  return static_cast<uint32_t>(std::clamp<int64_t>(it->get<int64_t>(), lo, hi));
}

std::string pathcheck_collection(const ControllerConfig& config, const std::string& ns) {
  return "/apis/rdmig.io/v1alpha1/namespaces/" + (config.watch_namespace.empty() ? ns : config.watch_namespace) +
         "/rdmapathchecks";
}

}  // namespace

std::string drainplan_path(const json& obj) {
  const auto& md = obj["metadata"];
  return "/apis/rdmig.io/v1alpha1/namespaces/" + md.value("namespace", "") + "/rdmadrainplans/" + md.value("name", "");
}

std::optional<uint64_t> vmi_resident_memory(const json& vmi) {
  const json md = vmi.value("metadata", json::object());
  const json ann = md.is_object() ? md.value("annotations", json::object()) : json::object();
  const auto v = annotation_number(ann, kResidentMemoryAnnotation);
  if (!v || *v < 1 || *v > kMaxExactWhole) return std::nullopt;
  return static_cast<uint64_t>(*v);
}

std::optional<uint64_t> vmi_memory(const json& vmi) {
  const json spec = vmi.value("spec", json::object());
  const json domain = spec.is_object() ? spec.value("domain", json::object()) : json::object();
  std::vector<json> candidates;
  if (domain.is_object()) {
    const json memory = domain.value("memory", json::object());
    if (memory.is_object() && memory.contains("guest")) candidates.push_back(memory["guest"]);
    const json resources = domain.value("resources", json::object());
    const json requests = resources.is_object() ? resources.value("requests", json::object()) : json::object();
    if (requests.is_object() && requests.contains("memory")) candidates.push_back(requests["memory"]);
  }
  for (const auto& c : candidates) {
    if (c.is_number_unsigned()) return c.get<uint64_t>();
    if (!c.is_string()) continue;
    const std::string text = c.get<std::string>();
    if (auto b = parse_bytes(text, "memory"); b) return b.value();
    // Decimal suffixes (k, M, G, T), as Kubernetes quantities allow.
    static const std::map<std::string, double> decimal{{"k", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}};
    size_t used = 0;
    try {
      const double v = std::stod(text, &used);
      const auto unit = decimal.find(text.substr(used));
      if (v > 0 && unit != decimal.end() && used > 0 && std::isdigit(static_cast<unsigned char>(text[0]))) {
        return static_cast<uint64_t>(v * unit->second);
      }
    } catch (...) {
    }
  }
  return std::nullopt;
}

json best_path_pair(const std::vector<json>& checks, const std::string& node, const std::vector<std::string>& targets) {
  json best;
  std::string best_time;
  for (const auto& check : checks) {
    const json status = check.value("status", json::object());
    if (!status.is_object()) continue;
    const std::string when = status.value("completionTime", "");
    json pick;
    for (const auto& pair : status.value("pairs", json::array())) {
      const std::string phase = pair.value("phase", "");
      if (pair.value("source", "") != node || (phase != "Passed" && phase != "FellBack")) continue;
      const std::string target = pair.value("target", "");
      if (!targets.empty() && std::find(targets.begin(), targets.end(), target) == targets.end()) continue;
      if (pair.value("throughputBytesPerSecond", 0.0) <= 0) continue;
      if (pick.is_null() || pair.value("throughputBytesPerSecond", 0.0) > pick.value("throughputBytesPerSecond", 0.0)) {
        pick = pair;
      }
    }
    if (pick.is_null() || (!best.is_null() && when <= best_time)) continue;
    const json spec = check.value("spec", json::object());
    best = json{{"pathCheck", check["metadata"].value("namespace", "") + "/" + check["metadata"].value("name", "")},
                {"source", node},
                {"target", pick.value("target", "")},
                {"transport", pick.value("transport", "")},
                {"throughputBytesPerSecond", pick.value("throughputBytesPerSecond", 0.0)},
                {"channels", spec.is_object() ? spec.value("channels", 1) : 1},
                {"rails", std::max<size_t>(1, pick.value("rails", json::array()).size())},
                {"rttMicroseconds", pick.value("rttMicroseconds", int64_t{0})}};
    if (!when.empty()) best["measuredAt"] = when;
    best_time = when;
  }
  return best;
}

namespace {

// In condition `type`'s message, the text `was` becomes `now` (nothing when `was` is empty or absent).
void reword_condition(json& status, const std::string& type, const std::string& was, const std::string& now) {
  if (was.empty() || was == now || !status.contains("conditions") || !status["conditions"].is_array()) return;
  for (auto& c : status["conditions"]) {
    if (!c.is_object() || c.value("type", "") != type) continue;
    std::string message = c.value("message", "");
    if (const auto at = message.find(was); at != std::string::npos) c["message"] = message.replace(at, was.size(), now);
  }
}

}  // namespace

DrainPlanReconciler::DrainPlanReconciler(const ControllerConfig& config, std::string agent_namespace,
                                         k8s::KubeClient& kube, k8s::Informer& informer, k8s::Informer& pathchecks,
                                         k8s::EventRecorder& events, ControllerMetrics& metrics)
    : config_(config),
      agent_namespace_(std::move(agent_namespace)),
      kube_(kube),
      informer_(informer),
      pathchecks_(pathchecks),
      events_(events),
      metrics_(metrics) {}

bool DrainPlanReconciler::needs_poll(const json& obj) const {
  if (obj["metadata"].contains("deletionTimestamp")) return false;
  const json status = obj.value("status", json::object());
  if (!status.is_object()) return true;
  if (!terminal(status.value("phase", ""))) return true;
  // Ended, but a cancel's stop of its path check failed: tried again each poll until it holds.
  const json record = status.value("createdPathCheck", json::object());
  return record.is_object() && record.contains("stopError");
}

Result<Next> DrainPlanReconciler::reconcile(const std::string& key) {
  auto cached = informer_.get(key);
  if (!cached) {
    const auto slash = key.find('/');
    if (slash != std::string::npos) metrics_.forget_drainplan(key.substr(0, slash), key.substr(slash + 1));
    return Next::kDone;
  }
  json obj = *cached;
  if (obj["metadata"].contains("deletionTimestamp")) return Next::kDone;
  const json status = obj.value("status", json::object());
  const std::string phase = status.is_object() ? status.value("phase", "") : "";
  export_metrics(obj);
  if (terminal(phase)) {
    // A plan that ended is left as it is on spec.cancel, but for its own path check if that still
    // runs (a forecast can come from a check whose other pairs still run).
    // A Cancelled plan did that as it was cancelled, unless that stop failed (stopError): retried
    // (needs_poll polls such a plan).
    const json record = status.is_object() ? status.value("createdPathCheck", json::object()) : json::object();
    const bool stop_failed = record.is_object() && record.contains("stopError");
    if ((phase != "Cancelled" || stop_failed) && read_cancel(obj.value("spec", json::object())).requested) {
      json st = status.is_object() ? status : json::object();
      // A retry reads the check from the API server: the cache may not hold one created a moment
      // before the cancel, and a check missing there must not end the retries.
      const auto stop = stop_path_check_for_cancel(obj, st, /*fresh=*/stop_failed);
      if (stop.changed) {
        // The Cancelled condition said the stop was failing: it says what holds now.
        reword_condition(st, "Cancelled", stopped_path_check_text(status), stopped_path_check_text(st));
        if (auto w = write_status(obj, st); !w) return w.error();
      }
      if (stop.failed) return *stop.failed;
    }
    return Next::kDone;
  }
  if (phase == "Executing" || phase == "Cancelling") return execute(obj);
  if (read_cancel(obj.value("spec", json::object())).requested) return cancel_before_start(obj);
  return forecast(obj);
}

Result<Next> DrainPlanReconciler::fail(const json& obj, const std::string& reason, const std::string& message) {
  json status = obj.value("status", json::object());
  status["phase"] = "Failed";
  set_condition(status, "Forecast", "False", reason, message, detail::generation_of(obj), now_text());
  events_.record(obj, "Warning", reason, message);
  auto w = write_status(obj, status);
  if (!w) return w.error();
  return Next::kDone;
}

std::pair<std::string, std::string> DrainPlanReconciler::own_path_check(const json& obj) const {
  const std::string ns = obj["metadata"].value("namespace", "");
  return {config_.watch_namespace.empty() ? ns : config_.watch_namespace,
          obj["metadata"].value("name", "").substr(0, 247) + "-paths"};
}

Result<bool> DrainPlanReconciler::stop_path_check(const json& obj, json& status, bool fresh) {
  const json record = status.value("createdPathCheck", json::object());
  if (record.is_object() && record.contains("stopTime")) return false;  // stopped already
  const auto [check_ns, name] = own_path_check(obj);
  const std::string key = check_ns + "/" + name;
  const std::string path = pathcheck_collection(config_, obj["metadata"].value("namespace", "")) + "/" + name;
  PathCheckStop stop;
  // The delete holds only for the check as read (preconditions uid and resourceVersion): one that
  // changed meanwhile (it ended and its result was written, in that instant) is read again and
  // judged again, so a finished check keeps its result. A few tries; then the reconcile retries.
  for (int attempt = 0;; ++attempt) {
    json check;
    if (fresh || attempt > 0) {
      auto got = kube_.get(path);
      if (!got) {
        if (got.error().code == Errc::kNotFound) return false;
        return got.error().with_context("reading path check " + key);
      }
      check = got.value();
    } else {
      auto cached = pathchecks_.get(key);
      if (!cached) return false;
      check = *cached;
    }
    stop = path_check_to_stop(check, obj["metadata"].value("uid", ""));
    if (!stop.stop) return false;
    const json md = check.value("metadata", json::object());
    json preconditions = json::object();
    for (const char* field : {"uid", "resourceVersion"}) {
      if (const std::string v = md.value(field, ""); !v.empty()) preconditions[field] = v;
    }
    const json options = {{"apiVersion", "v1"}, {"kind", "DeleteOptions"}, {"preconditions", preconditions}};
    auto removed = kube_.remove(path, options);
    if (removed) break;
    if (removed.error().code == Errc::kNotFound) return false;  // gone meanwhile: nothing left to stop
    if (k8s::is_conflict(removed.error()) && attempt < 4) {
      LOG_INFO("drainplan") << informer_.key_of(obj) << ": path check " << key
                            << " changed while it was being stopped; reading it again (" << removed.error().message
                            << ")";
      continue;
    }
    return removed.error().with_context("stopping path check " + key);
  }
  json next = record.is_object() ? record : json::object();
  next["name"] = key;
  next["stopTime"] = now_text();
  next["stopped"] = stop.where;
  status["createdPathCheck"] = next;
  const std::string message = "spec.cancel: path check " + key + " still ran (" + stop.where +
                              "): deleted, which cancels its pairs on the agents; the plan starts no other";
  events_.record(obj, "Normal", "PathCheckStopped", message);
  LOG_INFO("drainplan") << informer_.key_of(obj) << ": " << message;
  return true;
}

DrainPlanReconciler::CancelStop DrainPlanReconciler::stop_path_check_for_cancel(const json& obj, json& status,
                                                                                bool fresh) {
  auto stopped = stop_path_check(obj, status, fresh);
  json record = status.value("createdPathCheck", json::object());
  if (!record.is_object()) record = json::object();
  if (stopped) {
    if (!record.contains("stopError")) return CancelStop{stopped.value(), std::nullopt};
    record.erase("stopError");  // it holds now (stopped, or nothing left to stop)
    status["createdPathCheck"] = record;
    return CancelStop{true, std::nullopt};
  }
  const auto [check_ns, name] = own_path_check(obj);
  const std::string error = utf8_prefix(stopped.error().message, 512);
  // Unchanged since the last try: the worker logs the retry.
  if (record.value("stopError", std::string()) == error) return CancelStop{false, stopped.error()};
  LOG_WARN("drainplan") << informer_.key_of(obj) << ": spec.cancel: " << error
                        << "; the cancel goes on, the stop is tried again";
  if (!record.contains("name")) record["name"] = check_ns + "/" + name;
  record["stopError"] = error;
  status["createdPathCheck"] = record;
  // A check whose status changed under each try (409 on the delete's preconditions: it is being
  // written as it runs) is no failure to warn of: the next poll reads it again.
  if (k8s::is_conflict(stopped.error())) return CancelStop{true, stopped.error()};
  events_.record(obj, "Warning", "PathCheckStopFailed",
                 "spec.cancel: path check " + check_ns + "/" + name + " still runs: " + error +
                     "; the cancel goes on without it, and the stop is tried again until it holds");
  return CancelStop{true, stopped.error()};
}

Result<Next> DrainPlanReconciler::wait_for_path_check(const json& obj, const std::vector<std::string>& targets) {
  const json spec = obj["spec"];
  const std::string ns = obj["metadata"].value("namespace", "");
  const auto [check_ns, name] = own_path_check(obj);
  auto existing = pathchecks_.get(check_ns + "/" + name);
  if (existing) {
    const json st = existing->value("status", json::object());
    const std::string phase = st.is_object() ? st.value("phase", "") : "";
    if (phase == "Succeeded" || phase == "Failed") {
      // Ended, yet no pair carried its bytes (else best_path_pair had found it).
      const json summary = st.value("summary", json::object());
      return fail(obj, "PathCheckFailed",
                  "path check " + check_ns + "/" + name + " from " + spec.value("node", "") +
                      " carried nothing: " + (summary.is_object() ? summary.value("worst", std::string("?")) : "?"));
    }
  } else {
    json targets_spec = targets.empty() ? json{{"all", true}} : json{{"nodes", targets}};
    auto bytes = bytes_field(spec, "pathCheckBytes", 256 * kMiB);
    json body{{"apiVersion", kGroupVersion},
              {"kind", "RdmaPathCheck"},
              {"metadata",
               {{"name", name},
                {"namespace", check_ns},
                {"labels",
                 {{kPlanLabel, obj["metadata"].value("name", "").substr(0, 63)},
                  {kPlanUidLabel, obj["metadata"].value("uid", "")}}}}},
              {"spec",
               {{"source", spec.value("node", "")},
                {"targets", targets_spec},
                {"bytes", format_quantity(bytes ? bytes.value() : 256 * kMiB)},
                {"channels", uint_field(spec, "channels", 1, 1, 16)}}}};
    if (check_ns == ns) {  // an owner reference must not cross namespaces
      body["metadata"]["ownerReferences"] =
          json::array({json{{"apiVersion", kGroupVersion}, {"kind", "RdmaDrainPlan"},
                            {"name", obj["metadata"].value("name", "")}, {"uid", obj["metadata"].value("uid", "")},
                            {"controller", true}, {"blockOwnerDeletion", false}}});
    }
    auto created = kube_.create(pathcheck_collection(config_, ns), body);
    if (!created && created.error().code != Errc::kAlreadyExists) {
      return created.error().with_context("creating path check " + check_ns + "/" + name);
    }
    if (created) pathchecks_.observe(created.value());
    events_.record(obj, "Normal", "PathCheckCreated",
                   "no path check has measured " + spec.value("node", "") + " -> " +
                       (targets.empty() ? std::string("any node") : targets.front() + (targets.size() > 1 ? ", ..." : "")) +
                       ": created " + check_ns + "/" + name);
  }
  json status = obj.value("status", json::object());
  if (status.value("phase", "") == "WaitingForPathCheck") return Next::kPoll;
  status["phase"] = "WaitingForPathCheck";
  status["createdPathCheck"] = json{{"name", check_ns + "/" + name}};
  set_condition(status, "Forecast", "False", "WaitingForPathCheck",
                "no measured path from " + spec.value("node", "") + ": waiting for path check " + check_ns + "/" + name,
                detail::generation_of(obj), now_text());
  auto w = write_status(obj, status);
  if (!w) return w.error();
  return Next::kPoll;
}

Result<DrainPlanReconciler::Inputs> DrainPlanReconciler::read_spec(const json& spec) {
  Inputs in;
  if (!spec.is_object()) return Error{Errc::kInvalidArgument, "spec: required"};
  in.node = spec.value("node", "");
  if (in.node.empty()) return Error{Errc::kInvalidArgument, "spec.node: required"};
  const std::string policy = spec.value("notConverging", std::string("Skip"));
  if (policy != "Skip" && policy != "Migrate") {
    return Error{Errc::kInvalidArgument, "spec.notConverging: Skip or Migrate, not " + policy.substr(0, 64)};
  }
  in.migrate_not_converging = policy == "Migrate";
  DrainSettings& settings = in.settings;
  auto downtime = duration_field(spec, "maxDowntime", 0.3);
  if (!downtime) return downtime.error();
  settings.migration.accepted_downtime = downtime.value();
  auto chunk = bytes_field(spec, "chunkSize", 4 * kMiB);
  if (!chunk) return chunk.error();
  if (auto ok = validate_chunk_size(chunk.value(), "spec.chunkSize"); !ok) return ok.error();
  settings.migration.chunk_size = chunk.value();
  auto capacity = bytes_field(spec, "pathCapacity", 0);
  if (!capacity) return capacity.error();
  in.capacity = static_cast<double>(capacity.value());
  auto assumed = bytes_field(spec, "assumedDirtyRate", 0);
  if (!assumed) return assumed.error();
  if (spec.contains("assumedDirtyRate")) in.assumed_dirty_rate = static_cast<double>(assumed.value());
  auto max_bandwidth = bytes_field(spec, "maxBandwidth", 0);
  if (!max_bandwidth) return max_bandwidth.error();
  settings.migration.max_bandwidth = static_cast<double>(max_bandwidth.value());
  settings.migration.channels = uint_field(spec, "channels", 1, 1, 16);
  settings.migration.ring_depth = uint_field(spec, "ringDepth", 16, 1, 1024);
  settings.migration.auto_converge = spec.value("autoConverge", false);
  settings.migration.switchover = uint_field(spec, "switchoverMs", 20, 0, 60000) / 1000.0;
  settings.timeout_per_gib = uint_field(spec, "completionTimeoutPerGiB", 150, 1, 86400);
  settings.max_channels = uint_field(spec, "maxChannels", 16, 1, 64);
  for (const auto& t : spec.value("targets", json::array())) {
    if (t.is_string() && t.get<std::string>() != in.node) in.targets.push_back(t.get<std::string>());
  }
  if (spec.contains("targets") && in.targets.empty()) {
    return Error{Errc::kInvalidArgument, "spec.targets: no target node besides spec.node"};
  }
  return in;
}

forecast::PathMeasure DrainPlanReconciler::path_measure(const json& spec, const json& path_pair, Inputs& in) {
  forecast::PathMeasure path;
  path.throughput = path_pair.value("throughputBytesPerSecond", 0.0);
  path.channels = path_pair.value("channels", 1u);
  path.rtt_seconds = static_cast<double>(path_pair.value("rttMicroseconds", int64_t{0})) / 1e6;
  path.capacity = in.capacity;
  const uint32_t per_pair = uint_field(spec, "maxConcurrentPerPair", 2, 1, 16);
  const uint32_t rails = path_pair.value("rails", 1u);
  in.settings.max_concurrency =
      spec.contains("maxConcurrentPerRail") ? std::min(per_pair, uint_field(spec, "maxConcurrentPerRail", 1, 1, 16) * rails)
                                            : per_pair;
  return path;
}

Result<std::vector<DrainVm>> DrainPlanReconciler::node_vms(const json& spec, const Inputs& in) {
  std::map<std::string, std::string> labels;
  const json selector = spec.value("selector", json::object());
  if (selector.is_object()) {
    for (const auto& [k, v] : selector.items()) {
      if (v.is_string()) labels[k] = v.get<std::string>();
    }
  }
  labels["kubevirt.io/nodeName"] = in.node;
  // With watchNamespace the controller sees that namespace's VMIs only (its Role's reach).
  const std::string vmis = config_.watch_namespace.empty()
                               ? "/apis/kubevirt.io/v1/virtualmachineinstances"
                               : "/apis/kubevirt.io/v1/namespaces/" + config_.watch_namespace + "/virtualmachineinstances";
  auto list = kube_.get(vmis + "?labelSelector=" + k8s::url_encode(k8s::label_selector(labels)));
  if (!list) return list.error();
  std::vector<DrainVm> vms;
  for (const auto& vmi : list->value("items", json::array())) {
    const json st = vmi.value("status", json::object());
    if (st.is_object() && st.contains("nodeName") && st.value("nodeName", "") != in.node) continue;
    const json md = vmi.value("metadata", json::object());
    DrainVm vm{.ns = md.value("namespace", ""), .name = md.value("name", ""), .memory = vmi_memory(vmi)};
    const json ann = md.value("annotations", json::object());
    if (const auto rate = annotation_number(ann, kDirtyRateAnnotation)) {
      vm.dirty_rate = *rate, vm.dirty_source = "annotation";
      vm.dirty_time = ann.value(kDirtyRateTimeAnnotation, std::string());
    }
    if (!vm.dirty_rate && in.assumed_dirty_rate) vm.dirty_rate = *in.assumed_dirty_rate, vm.dirty_source = "assumed";
    if (auto resident = vmi_resident_memory(vmi)) {
      vm.resident = resident;
      if (ann.is_object() && ann.contains(kResidentMemoryTimeAnnotation) && ann[kResidentMemoryTimeAnnotation].is_string()) {
        vm.resident_time = ann[kResidentMemoryTimeAnnotation].get<std::string>();
      }
    }
    vms.push_back(std::move(vm));
  }
  std::sort(vms.begin(), vms.end(), [](const DrainVm& a, const DrainVm& b) {
    return std::tie(a.ns, a.name) < std::tie(b.ns, b.name);
  });
  return vms;
}

Result<Next> DrainPlanReconciler::forecast(json obj) {
  const json spec = obj.value("spec", json::object());
  auto in = read_spec(spec);
  if (!in) return fail(obj, "InvalidSpec", in.error().message);
  const std::string node = in->node;
  if (auto agent = locate_agent(kube_, config_, agent_namespace_, node, /*draining_ok=*/true); !agent) {
    // No agent pod on the node fails the plan; the API server not answering the list is retried.
    if (agent.error().code != Errc::kNotFound) return agent.error().with_context("finding the agent on " + node);
    return fail(obj, "NoAgent", "spec.node " + node + ": " + agent.error().message);
  }
  if (!config_.kubevirt.enabled) return fail(obj, "KubevirtOff", "the controller's KubeVirt support is off (kubevirt.enabled)");
  // The path first, from the cache: a plan waiting for its path check costs no VMI list per poll.
  const json path_pair = best_path_pair(pathchecks_.list(), node, in->targets);
  if (path_pair.is_null()) return wait_for_path_check(obj, in->targets);
  auto vms = node_vms(spec, in.value());
  if (!vms) {
    if (vms.error().code == Errc::kNotFound) return fail(obj, "KubevirtAbsent", "listing VMIs: " + vms.error().message);
    return vms.error().with_context("listing the VMIs on " + node);
  }
  const forecast::PathMeasure path = path_measure(spec, path_pair, in.value());
  const json result = drain_forecast(vms.value(), path, path_pair.value("target", ""), in->settings);
  const json summary = result["summary"];

  json status = obj.value("status", json::object());
  status["phase"] = "Forecast";
  status["forecastTime"] = now_text();
  status["path"] = path_pair;
  status["vms"] = result["vms"];
  status["summary"] = summary;
  const int64_t n = summary.value("vms", 0), bad = summary.value("notConverging", 0), none = summary.value("noInput", 0);
  const std::string headline = std::to_string(n) + " VM(s) from " + node + " to " + path_pair.value("target", "") +
                               ": drain " + summary.value("predictedDrain", "") + " (lower bound " +
                               summary.value("lowerBound", "") + "), up to " +
                               std::to_string(summary.value("concurrency", 0)) + " at once";
  set_condition(status, "Forecast", "True", "Forecast", headline, detail::generation_of(obj), now_text());
  std::string why = std::to_string(bad) + " VM(s) do not converge within their limits, " + std::to_string(none) +
                    " lack their memory in the spec";
  if (const int64_t u = summary.value("unmeasuredDirtyRate", 0); u > 0) {
    why += ", " + std::to_string(u) + " have no measured dirty rate (forecast at 0)";
  }
  set_condition(status, "WithinLimits", bad == 0 && none == 0 ? "True" : "False",
                bad > 0 ? "NotConverging" : none > 0 ? "MissingInput" : "AllConverge", why,
                detail::generation_of(obj), now_text());
  events_.record(obj, bad > 0 || none > 0 ? "Warning" : "Normal", "Forecast", headline + "; " + why);
  const bool execute = spec.value("execute", false);
  if (execute) {
    // The drain starts from this forecast; execute() creates the migrations (drainplan_execute.cpp).
    status["phase"] = "Executing";
    // The spec the drain keeps to from now on (drainplan_cancel.cpp: a later edit is not acted on).
    status["execution"] = json{{"startTime", k8s::format_micro_time(k8s::Clock::now())},
                               {"predictedDrainSeconds", summary.value("predictedDrainSeconds", 0.0)},
                               {"spec", frozen_spec(spec)}};
    set_condition(status, "Executed", "Unknown", "Executing", "the drain runs in the plan's order",
                  detail::generation_of(obj), now_text());
  }
  auto w = write_status(obj, status);
  if (!w) return w.error();
  if (execute) events_.record(obj, "Normal", "DrainStarted", headline);
  return execute ? Next::kRequeueNow : Next::kDone;
}

Result<json> DrainPlanReconciler::write_status(const json& obj, json status) {
  return detail::write_status(kube_, informer_, obj, drainplan_path(obj), std::move(status));
}

}  // namespace rdmig::controller
