#include "controller/reconciler.h"

#include "common/log.h"
#include "common/text.h"
#include "controller/kubevirt.h"
#include "controller/reconcile_util.h"
#include "controller/status_mapping.h"

namespace rdmig::controller {

using nlohmann::json;
using steady = std::chrono::steady_clock;
using namespace detail;

std::string object_path(const json& obj) {
  const auto& md = obj["metadata"];
  return "/apis/rdmig.io/v1alpha1/namespaces/" + md.value("namespace", "") + "/rdmamigrations/" +
         md.value("name", "");
}

bool is_terminal_phase(const std::string& phase) {
  return phase == "Succeeded" || phase == "Failed" || phase == "Cancelled";
}

std::optional<k8s::Clock::time_point> deletion_due(const json& obj, uint32_t default_ttl_seconds) {
  const json status = obj.value("status", json::object());
  if (!status.is_object() || !is_terminal_phase(status.value("phase", ""))) return std::nullopt;
  const json& done = status.value("completionTime", json());
  if (!done.is_string()) return std::nullopt;
  const auto at = k8s::parse_time(done.get<std::string>());
  if (!at) return std::nullopt;
  int64_t ttl = default_ttl_seconds;
  const json spec = obj.value("spec", json::object());
  if (spec.is_object() && spec.contains("ttlSecondsAfterFinished")) {
    const json& t = spec["ttlSecondsAfterFinished"];
    // The schema says integer >= 0; an API server that did not check gets the default.
    if (t.is_number_integer() && (t.is_number_unsigned() || t.get<int64_t>() >= 0)) {
      ttl = std::min<int64_t>(t.get<int64_t>(), kMaxTtlSeconds);
    }
  }
  return *at + std::chrono::seconds(ttl);
}

bool finished_needs_work(const json& obj, uint32_t default_ttl_seconds, k8s::Clock::time_point now) {
  if (obj["metadata"].contains("deletionTimestamp")) return false;
  if (has_finalizer(obj)) return true;
  const auto due = deletion_due(obj, default_ttl_seconds);
  return due && now >= *due;
}

Reconciler::Reconciler(const ControllerConfig& config, std::string agent_namespace, k8s::KubeClient& kube,
                       k8s::Informer& informer, AgentClient& agents, k8s::EventRecorder& events,
                       k8s::Informer* vmims)
    : config_(config),
      agent_namespace_(std::move(agent_namespace)),
      kube_(kube),
      informer_(informer),
      agents_(agents),
      events_(events),
      vmims_(vmims) {}

Result<json> Reconciler::write_status(const json& obj, json status) {
  update_display(status);
  auto written = detail::write_status(kube_, informer_, obj, object_path(obj), status);
  if (written) status_events(written.value(), obj.value("status", json::object()), written.value()["status"]);
  return written;
}

void Reconciler::status_events(const json& written, const json& before, const json& after) {
  // TransportFallback once: on the write that first shows the agents fell back to TCP.
  if (transport_fell_back(after) && !transport_fell_back(before)) {
    LOG_WARN("reconcile") << informer_.key_of(written) << ": " << transport_fallback_message(after);
    events_.record(written, "Warning", "TransportFallback", transport_fallback_message(after));
  }
  // FailedOver: on each write that shows more failovers than the one before (docs/failover.md).
  const auto failovers = [](const json& status) -> int64_t {
    const json& fo = status.value("failover", json::object());
    return fo.is_object() && fo.contains("failovers") && fo["failovers"].is_number_integer()
               ? fo["failovers"].get<int64_t>()
               : 0;
  };
  if (const int64_t now = failovers(after), was = failovers(before); now > was) {
    const std::string msg = "the agents failed " + std::to_string(now - was) + " data channel(s) over to a new link (" +
                            std::to_string(now) + " in all); the migration goes on. Last: " +
                            after["failover"].value("last", std::string("?"));
    LOG_WARN("reconcile") << informer_.key_of(written) << ": " << msg;
    events_.record(written, "Warning", "FailedOver", msg);
  }
}

namespace detail {

Result<json> write_status(k8s::KubeClient& kube, k8s::Informer& informer, const json& obj, const std::string& path,
                          json status) {
  json current = obj;
  for (int attempt = 0; attempt < 5; ++attempt) {
    status["observedGeneration"] = generation_of(current);
    current["status"] = status;
    auto written = kube.replace(path + "/status", current);
    if (written) {
      informer.observe(written.value());
      return written.value();
    }
    if (!k8s::is_conflict(written.error())) return written.error();
    // Someone changed the object (spec, finalizers): take the latest and write our status again.
    auto fresh = kube.get(path);
    if (!fresh) return fresh.error();
    current = fresh.value();
  }
  return Error{Errc::kFailedPrecondition, "status of " + informer.key_of(obj) + ": conflicts kept happening"};
}

Result<json> write_finalizer(k8s::KubeClient& kube, k8s::Informer& informer, const json& obj, const std::string& path,
                             bool present) {
  json current = obj;
  for (int attempt = 0; attempt < 5; ++attempt) {
    json finalizers = json::array();
    for (const auto& f : current["metadata"].value("finalizers", json::array())) {
      if (f != kFinalizer) finalizers.push_back(f);
    }
    if (present) finalizers.push_back(kFinalizer);
    current["metadata"]["finalizers"] = finalizers;
    auto written = kube.replace(path, current);
    if (written) {
      const auto& md = written.value()["metadata"];
      if (md.contains("deletionTimestamp") && md.value("finalizers", json::array()).empty()) {
        informer.forget(informer.key_of(current));  // that write deleted it
      } else {
        informer.observe(written.value());
      }
      return written.value();
    }
    if (written.error().code == Errc::kNotFound && !present) return json();  // already gone
    if (!k8s::is_conflict(written.error())) return written.error();
    auto fresh = kube.get(path);
    if (!fresh) return fresh.error();
    current = fresh.value();
  }
  return Error{Errc::kFailedPrecondition, "finalizer of " + informer.key_of(obj) + ": conflicts kept happening"};
}

}  // namespace detail

Result<json> Reconciler::set_finalizer(const json& obj, bool present) {
  return detail::write_finalizer(kube_, informer_, obj, object_path(obj), present);
}

Result<Next> Reconciler::transition(const json& obj, json status, const std::string& phase, const std::string& reason,
                                    const std::string& message_in) {
  const std::string before = status.value("phase", "");
  const std::string now = now_text();
  // Bounded, cut between characters: the status must stay writable whatever the text holds.
  const std::string message = utf8_prefix(message_in, kMaxMessageBytes);
  status["phase"] = phase;
  if (is_terminal_phase(phase)) status["reason"] = reason;  // the Reason column: how it ended
  else status.erase("reason");
  const int64_t gen = generation_of(obj);
  if (is_terminal_phase(phase)) {
    status["completionTime"] = now;
    if (phase == "Succeeded") {
      status.erase("failureReason");
      set_condition(status, "Succeeded", "True", reason, message, gen, now);
    } else {
      status["failureReason"] = message;
      set_condition(status, "Succeeded", "False", reason, message, gen, now);
    }
  } else {
    // Not decided yet: Unknown, with the phase as the reason (Pending, PreparingTarget, Migrating).
    set_condition(status, "Succeeded", "Unknown", reason, message, gen, now);
  }
  auto written = write_status(obj, status);
  if (!written) return written.error();
  if (before != phase) {
    LOG_INFO("reconcile") << informer_.key_of(obj) << ": " << (before.empty() ? "new" : before) << " -> " << phase
                          << " (" << reason << ": " << message << ")";
    // Failed and Cancelled Events carry the reason (VMPausedOnSource, CancelledOnAgent, ...).
    const bool failed = phase == "Failed";
    events_.record(written.value(), failed ? "Warning" : "Normal",
                   failed || phase == "Cancelled" ? reason : phase, message);
  }
  return is_terminal_phase(phase) ? Next::kDone : Next::kRequeueNow;
}

bool Reconciler::unreachable_too_long(const std::string& key, const std::string& side) {
  auto [it, inserted] = unreachable_since_.try_emplace(key + "#" + side, steady::now());
  return steady::now() - it->second >= std::chrono::seconds(config_.agents.unreachable_timeout_seconds);
}

void Reconciler::reachable(const std::string& key, const std::string& side) {
  unreachable_since_.erase(key + "#" + side);
}



Result<AgentAddress> Reconciler::find_agent(const std::string& node) {
  return locate_agent(kube_, config_, agent_namespace_, node);
}

Result<Next> Reconciler::reconcile(const std::string& key) {
  auto cached = informer_.get(key);
  if (!cached) {
    reachable(key, "source");
    reachable(key, "target");
    ended_since_.erase(key);
    stopping_.erase(key);
    return Next::kDone;
  }
  json obj = *cached;
  if (obj["metadata"].contains("deletionTimestamp")) return finalize(obj);
  const json status = obj.value("status", json::object());
  if (is_terminal_phase(status.value("phase", ""))) return finished(obj);
  if (!has_finalizer(obj)) {
    auto updated = set_finalizer(obj, true);
    if (!updated) return updated.error();
    obj = updated.value();
  }
  // A run that started keeps its kind's path even if the spec was edited past the schema.
  if (vmi_started(status)) return reconcile_vmi(obj);
  if (status.contains("migrationId")) return reconcile_qemu(obj);
  auto kind = source_kind(obj.value("spec", json()));
  if (!kind) return transition(obj, status, "Failed", "InvalidSpec", kind.error().message);
  return kind.value() == SourceKind::kVmi ? reconcile_vmi(obj) : reconcile_qemu(obj);
}

bool Reconciler::needs_poll(const json& obj) const {
  if (obj["metadata"].contains("deletionTimestamp")) return true;
  if (!is_terminal_phase(obj.value("status", json::object()).value("phase", ""))) return true;
  return finished_needs_work(obj, config_.ttl_seconds_after_finished, k8s::Clock::now());
}

Result<Next> Reconciler::finished(json obj) {
  const std::string key = informer_.key_of(obj);
  if (has_finalizer(obj)) {
    auto removed = set_finalizer(obj, false);
    if (!removed) return removed.error();
    if (removed.value().is_null()) return Next::kDone;  // already gone
    obj = removed.value();
    reachable(key, "source");
    reachable(key, "target");
    ended_since_.erase(key);
    stopping_.erase(key);
  }
  const auto due = deletion_due(obj, config_.ttl_seconds_after_finished);
  if (!due || k8s::Clock::now() < *due) return Next::kDone;
  auto removed = kube_.remove(object_path(obj));
  if (!removed && removed.error().code != Errc::kNotFound) return removed.error();
  LOG_INFO("reconcile") << key << ": deleted " << obj["status"].value("phase", "") << " object: finished at "
                        << obj["status"].value("completionTime", "") << ", ttlSecondsAfterFinished over";
  return Next::kDone;
}

Result<Next> Reconciler::finalize(json obj) {
  if (!has_finalizer(obj)) return Next::kDone;
  const json status = obj.value("status", json::object());
  auto stopped = vmi_started(status) ? finalize_vmi(obj) : finalize_qemu(obj);
  if (!stopped) return stopped.error();
  if (!stopped.value()) return Next::kPoll;
  const std::string key = informer_.key_of(obj);
  auto removed = set_finalizer(obj, false);
  if (!removed) return removed.error();
  reachable(key, "source");
  reachable(key, "target");
  ended_since_.erase(key);
  stopping_.erase(key);
  LOG_INFO("reconcile") << key << ": deleted; migration stopped, finalizer removed";
  return Next::kDone;
}

}  // namespace rdmig::controller
