#include "controller/reconciler.h"

#include "common/log.h"
#include "common/units.h"
#include "controller/status_mapping.h"
#include "k8s/selectors.h"
#include "k8s/time_format.h"

namespace rdmig::controller {

using nlohmann::json;
using steady = std::chrono::steady_clock;

namespace {

std::string now_text() { return k8s::format_time(k8s::Clock::now()); }

int64_t generation_of(const json& obj) { return obj["metadata"].value("generation", int64_t{0}); }

bool has_finalizer(const json& obj) {
  for (const auto& f : obj["metadata"].value("finalizers", json::array())) {
    if (f == kFinalizer) return true;
  }
  return false;
}

std::string node_of(const json& obj, const char* side) {
  const auto& spec = obj.value("spec", json::object());
  if (!spec.contains(side) || !spec[side].is_object()) return "";
  const auto& q = spec[side].value("qemu", json::object());
  return q.is_object() ? q.value("node", "") : "";
}

}  // namespace

std::string object_path(const json& obj) {
  const auto& md = obj["metadata"];
  return "/apis/rdmig.io/v1alpha1/namespaces/" + md.value("namespace", "") + "/rdmamigrations/" +
         md.value("name", "");
}

bool is_terminal_phase(const std::string& phase) {
  return phase == "Succeeded" || phase == "Failed" || phase == "Cancelled";
}

Reconciler::Reconciler(const ControllerConfig& config, std::string agent_namespace, k8s::KubeClient& kube,
                       k8s::Informer& informer, AgentClient& agents, k8s::EventRecorder& events)
    : config_(config),
      agent_namespace_(std::move(agent_namespace)),
      kube_(kube),
      informer_(informer),
      agents_(agents),
      events_(events) {}

Result<json> Reconciler::write_status(const json& obj, json status) {
  json current = obj;
  for (int attempt = 0; attempt < 5; ++attempt) {
    status["observedGeneration"] = generation_of(current);
    current["status"] = status;
    auto written = kube_.replace(object_path(current) + "/status", current);
    if (written) {
      informer_.observe(written.value());
      return written.value();
    }
    if (!k8s::is_conflict(written.error())) return written.error();
    // Someone changed the object (spec, finalizers): take the latest and write our status again.
    auto fresh = kube_.get(object_path(current));
    if (!fresh) return fresh.error();
    current = fresh.value();
  }
  return Error{Errc::kFailedPrecondition, "status of " + informer_.key_of(obj) + ": conflicts kept happening"};
}

Result<json> Reconciler::set_finalizer(const json& obj, bool present) {
  json current = obj;
  for (int attempt = 0; attempt < 5; ++attempt) {
    json finalizers = json::array();
    for (const auto& f : current["metadata"].value("finalizers", json::array())) {
      if (f != kFinalizer) finalizers.push_back(f);
    }
    if (present) finalizers.push_back(kFinalizer);
    current["metadata"]["finalizers"] = finalizers;
    auto written = kube_.replace(object_path(current), current);
    if (written) {
      const auto& md = written.value()["metadata"];
      if (md.contains("deletionTimestamp") && md.value("finalizers", json::array()).empty()) {
        informer_.forget(informer_.key_of(current));  // that write deleted it
      } else {
        informer_.observe(written.value());
      }
      return written.value();
    }
    if (written.error().code == Errc::kNotFound && !present) return json();  // already gone
    if (!k8s::is_conflict(written.error())) return written.error();
    auto fresh = kube_.get(object_path(current));
    if (!fresh) return fresh.error();
    current = fresh.value();
  }
  return Error{Errc::kFailedPrecondition, "finalizer of " + informer_.key_of(obj) + ": conflicts kept happening"};
}

Result<Next> Reconciler::transition(const json& obj, json status, const std::string& phase, const std::string& reason,
                                    const std::string& message) {
  const std::string before = status.value("phase", "");
  const std::string now = now_text();
  status["phase"] = phase;
  const int64_t gen = generation_of(obj);
  if (is_terminal_phase(phase)) {
    status["completionTime"] = now;
    if (phase == "Succeeded") {
      status.erase("failureReason");
      set_condition(status, "Succeeded", "True", "Succeeded", message, gen, now);
    } else {
      status["failureReason"] = message;
      set_condition(status, "Succeeded", "False", reason, message, gen, now);
    }
  }
  auto written = write_status(obj, status);
  if (!written) return written.error();
  if (before != phase) {
    LOG_INFO("reconcile") << informer_.key_of(obj) << ": " << (before.empty() ? "new" : before) << " -> " << phase
                          << " (" << reason << ": " << message << ")";
    events_.record(written.value(), phase == "Failed" ? "Warning" : "Normal", phase == "Failed" ? reason : phase,
                   message);
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
  const std::string path = "/api/v1/namespaces/" + agent_namespace_ + "/pods?labelSelector=" +
                           k8s::url_encode(k8s::label_selector(config_.agents.labels)) +
                           "&fieldSelector=" + k8s::url_encode("spec.nodeName=" + node);
  auto pods = kube_.get(path);
  if (!pods) return pods.error().with_context("listing agent pods");
  auto picked = select_agent_pod(pods.value(), node, config_.agents.port_name, config_.agents.port);
  if (!picked) {
    return Error{picked.error().code, picked.error().message + " (namespace '" + agent_namespace_ +
                                          "', labelSelector '" + config_.agents.label_selector + "')"};
  }
  return picked;
}

int Reconciler::active_on_node(const std::string& node, const std::string& except_key) const {
  int n = 0;
  for (const auto& o : informer_.list()) {
    if (k8s::Informer::key_of(o) == except_key) continue;
    const std::string phase = o.value("status", json::object()).value("phase", "");
    if (phase != "PreparingTarget" && phase != "Migrating") continue;
    if (node_of(o, "source") == node || node_of(o, "target") == node) ++n;
  }
  return n;
}

Result<Next> Reconciler::reconcile(const std::string& key) {
  auto cached = informer_.get(key);
  if (!cached) {
    reachable(key, "source");
    reachable(key, "target");
    return Next::kDone;
  }
  json obj = *cached;
  if (obj["metadata"].contains("deletionTimestamp")) return finalize(obj);
  const json status = obj.value("status", json::object());
  const std::string phase = status.value("phase", "");
  if (is_terminal_phase(phase)) return Next::kDone;
  if (!has_finalizer(obj)) {
    auto updated = set_finalizer(obj, true);
    if (!updated) return updated.error();
    obj = updated.value();
  }
  auto req = parse_spec(obj.value("spec", json()));
  if (!req) {
    if (!phase.empty() && phase != "Pending") {
      // Spec edited into something invalid mid-run: stop what runs before failing.
      const auto st = stop_on_agents(obj);
      if (!st.stopped) return Next::kPoll;
    }
    return transition(obj, status, "Failed", "InvalidSpec", req.error().message);
  }
  if (req->cancel) return cancel(obj);
  if (phase.empty() || phase == "Pending") return admit(obj, req.value());
  if (phase == "PreparingTarget") return prepare(obj, req.value());
  if (phase == "Migrating") return poll(obj);
  return transition(obj, status, "Failed", "UnknownPhase", "status.phase '" + phase + "' is not one rdmig knows");
}

Result<Next> Reconciler::admit(json obj, const MigrationRequest& req) {
  const std::string key = informer_.key_of(obj);
  json status = obj.value("status", json::object());
  const int64_t gen = generation_of(obj);
  if (status.value("phase", "").empty()) {
    set_condition(status, "Admitted", "Unknown", "Waiting", "waiting for a slot on both nodes", gen, now_text());
    return transition(obj, status, "Pending", "Pending", "accepted; waiting to start");
  }
  for (const auto& node : {req.source.node, req.target.node}) {
    const int active = active_on_node(node, key);
    if (active >= static_cast<int>(config_.max_concurrent_per_node)) {
      const std::string msg = "node '" + node + "' already takes part in " + std::to_string(active) +
                              " migrations (maxConcurrentPerNode=" + std::to_string(config_.max_concurrent_per_node) + ")";
      const json before = status;
      set_condition(status, "Admitted", "False", "NodeBusy", msg, gen, now_text());
      if (status != before) {
        auto w = write_status(obj, status);
        if (!w) return w.error();
      }
      return Next::kPoll;
    }
  }
  auto source = find_agent(req.source.node);
  if (!source) {
    if (source.error().code != Errc::kNotFound) return source.error();
    return transition(obj, status, "Failed", "AgentNotFound", "source: " + source.error().message);
  }
  auto target = find_agent(req.target.node);
  if (!target) {
    if (target.error().code != Errc::kNotFound) return target.error();
    return transition(obj, status, "Failed", "AgentNotFound", "target: " + target.error().message);
  }
  auto id = agent_migration_id(obj);
  if (!id) return transition(obj, status, "Failed", "InvalidObject", id.error().message);
  // Record the agents and the id before calling them: whatever happens next, the status says
  // where a migration may run, so cancel and deletion can always reach it.
  status["migrationId"] = id.value();
  status["sourceAgent"] = source->to_json();
  status["targetAgent"] = target->to_json();
  status["startTime"] = now_text();
  set_condition(status, "Admitted", "True", "Admitted", "agents " + source->pod + " and " + target->pod + " chosen",
                gen, now_text());
  return transition(obj, status, "PreparingTarget", "PreparingTarget",
                    "preparing the target on node " + req.target.node + " (agent " + target->pod + ")");
}

Result<Next> Reconciler::prepare(json obj, const MigrationRequest& req) {
  const std::string key = informer_.key_of(obj);
  json status = obj.value("status", json::object());
  const std::string id = status.value("migrationId", "");
  const auto src = AgentAddress::from_json(status.value("sourceAgent", json::object()));
  const auto dst = AgentAddress::from_json(status.value("targetAgent", json::object()));
  const int64_t gen = generation_of(obj);

  // A restarted controller may find the migration already started: adopt it.
  auto existing = agents_.get(src, id);
  if (existing) {
    set_condition(status, "TargetPrepared", "True", "Prepared", "found running on the agents", gen, now_text());
    return transition(obj, status, "Migrating", "Migrating", "migration " + id + " found running; adopted");
  }
  if (existing.error().code != Errc::kNotFound) {
    if (!unreachable_too_long(key, "source")) return Next::kPoll;
    return transition(obj, status, "Failed", "AgentUnreachable", existing.error().message);
  }
  reachable(key, "source");
  auto stale = agents_.get(dst, id);
  if (stale) {
    // Prepared by an earlier run of the controller that stopped before starting the source;
    // its one-time token is gone, so this preparation cannot be used.
    (void)agents_.cancel(dst, id);
    return transition(obj, status, "Failed", "Interrupted",
                       "the controller stopped while preparing the target; the prepared target was cancelled");
  }
  if (stale.error().code != Errc::kNotFound) {
    if (!unreachable_too_long(key, "target")) return Next::kPoll;
    return transition(obj, status, "Failed", "AgentUnreachable", stale.error().message);
  }
  reachable(key, "target");
  const std::string vm = vm_name(obj);
  auto prepared = agents_.create(dst, target_request_body(req, id, vm));
  if (!prepared) {
    return transition(obj, status, "Failed", "TargetRefused", "preparing the target: " + prepared.error().message);
  }
  auto started = agents_.create(src, source_request_body(req, id, vm, prepared.value()));
  if (!started) {
    (void)agents_.cancel(dst, id);
    return transition(obj, status, "Failed", "SourceRefused", "starting the source: " + started.error().message);
  }
  set_condition(status, "TargetPrepared", "True", "Prepared",
                "target listening at " + prepared->value("endpoint", std::string("?")), gen, now_text());
  return transition(obj, status, "Migrating", "Migrating",
                    "migrating from node " + req.source.node + " to node " + req.target.node);
}

Result<Next> Reconciler::poll(json obj) {
  const std::string key = informer_.key_of(obj);
  json status = obj.value("status", json::object());
  const std::string id = status.value("migrationId", "");
  const auto src = AgentAddress::from_json(status.value("sourceAgent", json::object()));
  const auto dst = AgentAddress::from_json(status.value("targetAgent", json::object()));

  auto s = agents_.get(src, id);
  auto t = agents_.get(dst, id);
  const std::pair<const char*, Result<json>*> sides[] = {{"source", &s}, {"target", &t}};
  for (const auto& [side, r] : sides) {
    if (r->ok()) {
      reachable(key, side);
      continue;
    }
    const Error& e = r->error();
    if (e.code == Errc::kNotFound) {
      // The agent lost the migration (it restarted): the other side cannot finish alone.
      (void)stop_on_agents(obj);
      return transition(obj, status, "Failed", "AgentLostMigration",
                        std::string(side) + " agent no longer knows migration " + id + " (agent restarted?)");
    }
    if (!unreachable_too_long(key, side)) return Next::kPoll;
    (void)stop_on_agents(obj);
    return transition(obj, status, "Failed", "AgentUnreachable",
                      std::string(side) + " agent unreachable for " +
                          std::to_string(config_.agents.unreachable_timeout_seconds) + "s: " + e.message);
  }
  copy_agent_status(status, s.value(), t.value());
  const Verdict v = judge(s.value(), t.value());
  switch (v.outcome) {
    case Outcome::kRunning: {
      if (status != obj.value("status", json::object())) {
        auto w = write_status(obj, status);
        if (!w) return w.error();
      }
      return Next::kPoll;
    }
    case Outcome::kSucceeded: {
      std::string msg = "migrated";
      if (status.contains("downtimeMs")) msg += "; downtime " + std::to_string(status["downtimeMs"].get<int64_t>()) + " ms";
      if (status.contains("totalTimeMs")) msg += "; total " + std::to_string(status["totalTimeMs"].get<int64_t>()) + " ms";
      return transition(obj, status, "Succeeded", "Succeeded", msg);
    }
    case Outcome::kFailed:
    case Outcome::kCancelled: {
      const auto st = stop_on_agents(obj);  // cancels whichever side still runs
      if (!st.stopped) return Next::kPoll;
      const bool cancelled = v.outcome == Outcome::kCancelled;
      return transition(obj, status, cancelled ? "Cancelled" : "Failed", cancelled ? "Cancelled" : "MigrationFailed",
                        v.reason);
    }
  }
  return Next::kPoll;
}

Reconciler::StopState Reconciler::stop_on_agents(const json& obj) {
  StopState out;
  const std::string key = informer_.key_of(obj);
  const json status = obj.value("status", json::object());
  const std::string id = status.value("migrationId", "");
  if (id.empty()) {
    out.stopped = true;
    return out;
  }
  // One side: true when it is not running (terminal, unknown to its agent, or unreachable
  // past the limit); asks it to cancel otherwise.
  auto side_stopped = [&](const char* side, const char* field, json& view) {
    if (!status.contains(field)) return true;
    const auto agent = AgentAddress::from_json(status[field]);
    auto r = agents_.get(agent, id);
    if (!r) {
      if (r.error().code == Errc::kNotFound) return true;
      if (unreachable_too_long(key, side)) {
        LOG_WARN("reconcile") << key << ": giving up on the " << side << " agent: " << r.error().message;
        return true;
      }
      return false;
    }
    reachable(key, side);
    view = r.value();
    if (agent_phase_terminal(view.value("phase", ""))) return true;
    if (auto c = agents_.cancel(agent, id); !c) {
      LOG_WARN("reconcile") << key << ": cancel on the " << side << " agent: " << c.error().message;
    }
    return false;
  };
  if (!side_stopped("source", "sourceAgent", out.source)) return out;
  out.source_succeeded = out.source.value("phase", "") == "Succeeded";
  if (out.source_succeeded) {
    // The VM now lives on the target: never cancel it there; wait for the target to finish.
    const auto agent = AgentAddress::from_json(status.value("targetAgent", json::object()));
    auto r = agents_.get(agent, id);
    if (r) out.target = r.value();
    out.stopped = !r || agent_phase_terminal(out.target.value("phase", ""));
    return out;
  }
  out.stopped = side_stopped("target", "targetAgent", out.target);
  return out;
}

Result<Next> Reconciler::cancel(json obj) {
  json status = obj.value("status", json::object());
  const std::string phase = status.value("phase", "");
  if (phase == "PreparingTarget" || phase == "Migrating") {
    const auto st = stop_on_agents(obj);
    if (!st.stopped) return Next::kPoll;
    if (!st.source.is_null() && !st.target.is_null()) copy_agent_status(status, st.source, st.target);
    if (st.source_succeeded) {
      return transition(obj, status, "Succeeded", "Succeeded", "migrated; spec.cancel came after the source had completed");
    }
  }
  return transition(obj, status, "Cancelled", "Cancelled",
                    phase == "PreparingTarget" || phase == "Migrating"
                        ? "cancelled through spec.cancel; the VM keeps running on the source"
                        : "cancelled through spec.cancel before it started");
}

Result<Next> Reconciler::finalize(json obj) {
  if (!has_finalizer(obj)) return Next::kDone;
  const json status = obj.value("status", json::object());
  const std::string phase = status.value("phase", "");
  if (phase == "PreparingTarget" || phase == "Migrating") {
    const auto st = stop_on_agents(obj);
    if (!st.stopped) return Next::kPoll;
    events_.record(obj, "Normal", "Cancelled", "object deleted: migration stopped on the agents");
  }
  const std::string key = informer_.key_of(obj);
  auto removed = set_finalizer(obj, false);
  if (!removed) return removed.error();
  reachable(key, "source");
  reachable(key, "target");
  LOG_INFO("reconcile") << key << ": deleted; agents stopped, finalizer removed";
  return Next::kDone;
}

}  // namespace rdmig::controller
