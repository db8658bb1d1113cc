// The qemu kind: a QEMU process on each node, driven through the agents' bare-QEMU REST API.
#include <algorithm>

#include "common/log.h"
#include "common/units.h"
#include "controller/reconcile_util.h"
#include "controller/reconciler.h"
#include "controller/status_mapping.h"

namespace rdmig::controller {

using nlohmann::json;
using namespace detail;

namespace {

// A 4xx from the API server that retrying cannot change (bad request, forbidden, invalid).
bool api_refusal(const Error& e) {
  return e.code == Errc::kInvalidArgument || e.code == Errc::kPermissionDenied;
}

// The reason of condition `type`, "" when absent.
std::string condition_reason(const json& status, const std::string& type, std::string* since = nullptr) {
  for (const auto& c : status.value("conditions", json::array())) {
    if (c.is_object() && c.value("type", "") == type) {
      if (since) *since = c.value("lastTransitionTime", "");
      return c.value("reason", "");
    }
  }
  return "";
}

constexpr const char* kTargetUnanswered = "TargetUnanswered";
// Held back by maxConcurrentPerNode: the Admitted condition's reason, status.reason and the Event.
constexpr const char* kWaitingForNodeSlot = "WaitingForNodeSlot";
constexpr const char* kAgentDraining = "AgentDraining";

// What an operator must know first about a VM left paused on the source, then the agents' words.
std::string paused_on_source_message(const json& status, const json& target_view, const std::string& agents) {
  std::string target = "the target agent did not answer";
  if (target_view.is_object() && target_view.contains("phase")) {
    target = "the target agent reports " + target_view.value("phase", std::string("?"));
    const json& ts = target_view.value("result", json::object()).value("targetState", json());
    if (ts.is_string()) target += " (target VM " + ts.get<std::string>() + ")";
  }
  return "VM left paused on the source node " + status.value("sourceNode", std::string("?")) +
         ": the source agent could not learn the target's verdict after QEMU handed the VM over; " + target +
         " on node " + status.value("targetNode", std::string("?")) +
         ". Decide where the VM runs before resuming anything (runbook RdmigVmPausedOnSource). " + agents;
}

}  // namespace

std::vector<std::string> nodes_in_use(const json& obj) {
  std::vector<std::string> out;
  const json status = obj.value("status", json::object());
  if (!status.is_object()) return out;
  const std::string phase = status.value("phase", "");
  if (phase != "PreparingTarget" && phase != "Migrating") return out;
  for (const char* field : {"sourceAgent", "targetAgent"}) {
    const json& a = status.value(field, json());
    if (a.is_object() && a.contains("node") && a["node"].is_string()) out.push_back(a["node"].get<std::string>());
  }
  return out;
}

int Reconciler::active_on_node(const std::string& node, const std::string& except_key) const {
  int n = 0;
  for (const auto& o : informer_.list()) {
    if (k8s::Informer::key_of(o) == except_key) continue;
    const auto nodes = nodes_in_use(o);
    if (std::find(nodes.begin(), nodes.end(), node) != nodes.end()) ++n;
  }
  return n;
}


Result<Next> Reconciler::reconcile_qemu(json obj) {
  json status = obj.value("status", json::object());
  const std::string phase = status.value("phase", "");
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
  if (phase.empty() || phase == "Pending") {
    const std::string ns = obj["metadata"].value("namespace", "");
    if (!config_.qemu.allowed(ns)) {
      return transition(obj, status, "Failed", "QemuKindNotAllowed",
                        "spec.source.qemu: the bare-QEMU kind is not enabled for namespace '" + ns +
                            "' (controller config qemu.allowedNamespaces); use spec.source.vmi for KubeVirt VMs");
    }
    status["sourceNode"] = req->source.node;
    status["targetNode"] = req->target.node;
    obj["status"] = status;
    return admit(obj, req.value());
  }
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
  // Held in Pending for `reason` (the Admitted condition and the Reason column say why): the
  // status is written only when it changes, and one Event marks when the hold starts, not every
  // pass that finds it still holding.
  auto hold = [&](const char* reason, const std::string& msg) -> Result<Next> {
    const json before = status;
    const bool held_before = condition_reason(before, "Admitted") == reason;
    set_condition(status, "Admitted", "False", reason, msg, gen, now_text());
    status["reason"] = reason;
    if (status != before) {
      auto w = write_status(obj, status);
      if (!w) return w.error();
      if (!held_before) events_.record(w.value(), "Normal", reason, msg);
    }
    return Next::kPoll;
  };
  for (const auto& node : {req.source.node, req.target.node}) {
    const int active = active_on_node(node, key);
    if (active >= static_cast<int>(config_.max_concurrent_per_node)) {
      return hold(kWaitingForNodeSlot, "waiting for a migration slot on node '" + node + "': it already takes part in " +
                                            std::to_string(active) + " migrations (maxConcurrentPerNode=" +
                                            std::to_string(config_.max_concurrent_per_node) + ")");
    }
  }
  // A node whose agent drains (an upgrade): the migration waits in Pending for its replacement,
  // it is not failed (docs/deploy.md, "Stopping an agent").
  auto hold_draining = [&](const std::string& side, const Error& e) { return hold(kAgentDraining, side + ": " + e.message); };
  auto source = find_agent(req.source.node);
  if (!source && agent_draining(source.error())) return hold_draining("source", source.error());
  if (!source) {
    if (api_refusal(source.error())) {
      return transition(obj, status, "Failed", "ApiServerRefused", "finding the source agent: " + source.error().message);
    }
    if (source.error().code != Errc::kNotFound) return source.error();
    return transition(obj, status, "Failed", "AgentNotFound", "source: " + source.error().message);
  }
  auto target = find_agent(req.target.node);
  if (!target && agent_draining(target.error())) return hold_draining("target", target.error());
  if (!target) {
    if (api_refusal(target.error())) {
      return transition(obj, status, "Failed", "ApiServerRefused", "finding the target agent: " + target.error().message);
    }
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
    return transition(obj, status, "Failed", unreachable_reason(existing.error()), existing.error().message);
  }
  reachable(key, "source");
  std::string unanswered_since;
  const bool unanswered = condition_reason(status, "TargetPrepared", &unanswered_since) == kTargetUnanswered;
  auto stale = agents_.get(dst, id);
  if (stale) {
    // Prepared by an earlier pass whose answer never came, or by an earlier run of the controller
    // that stopped before starting the source: either way its one-time token is not known here,
    // so this preparation cannot be used. Cancel it so that no target QEMU is held for nothing.
    if (!agent_phase_terminal(stale->value("phase", ""))) (void)agents_.cancel(dst, id);
    if (unanswered) {
      return transition(obj, status, "Failed", "TargetTimeout",
                        "the target agent answered after the request timeout (" +
                            std::to_string(config_.agents.request_timeout_seconds) +
                            "s, config agents.requestTimeoutSeconds); what it prepared was cancelled");
    }
    return transition(obj, status, "Failed", "Interrupted",
                       "the controller stopped while preparing the target; the prepared target was cancelled");
  }
  if (stale.error().code != Errc::kNotFound) {
    if (!unreachable_too_long(key, "target")) return Next::kPoll;
    return transition(obj, status, "Failed", unreachable_reason(stale.error()), stale.error().message);
  }
  reachable(key, "target");
  if (unanswered) {
    // The target never answered; it knows no such migration (yet). Its late answer may still
    // come: watch for it for a while (and cancel it then), then give up.
    const auto since = k8s::parse_time(unanswered_since);
    if (since && k8s::Clock::now() - *since < std::chrono::seconds(config_.agents.unreachable_timeout_seconds)) {
      return Next::kPoll;
    }
    return transition(obj, status, "Failed", "TargetTimeout",
                      "the target agent did not answer within the request timeout (" +
                          std::to_string(config_.agents.request_timeout_seconds) +
                          "s, config agents.requestTimeoutSeconds); it holds nothing for this migration");
  }
  const std::string vm = vm_name(obj);
  auto prepared = agents_.create(dst, target_request_body(req, id, vm));
  if (!prepared && prepared.error().code == Errc::kTimeout) {
    // The request went out and no answer came: the target may have started a job and a QEMU
    // incoming migration. Cancel it now, and on the next passes cancel whatever shows up late.
    (void)agents_.cancel(dst, id);
    set_condition(status, "TargetPrepared", "Unknown", kTargetUnanswered,
                  "no answer from the target agent: " + prepared.error().message + "; cancelled what it may have started",
                  gen, now_text());
    auto w = write_status(obj, status);
    if (!w) return w.error();
    LOG_WARN("reconcile") << key << ": " << prepared.error().message << "; cancel sent to the target agent";
    return Next::kPoll;
  }
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
    return transition(obj, status, "Failed", unreachable_reason(e),
                      std::string(side) + " agent unreachable for " +
                          std::to_string(config_.agents.unreachable_timeout_seconds) + "s: " + e.message);
  }
  copy_agent_status(status, s.value(), t.value());
  Verdict v = judge(s.value(), t.value());
  // While one side stops, the other's end decided the outcome: a side that ends Cancelled now was
  // cancelled by this controller (stop_on_agents), which must not turn TargetFailed into
  // CancelledOnAgent. Any other new verdict (a source that says it left the VM paused) stands.
  if (auto first = stopping_.find(key); first != stopping_.end() && v.code == kReasonCancelledOnAgent) v = first->second;
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
      return transition(obj, status, "Succeeded", v.code, msg);
    }
    case Outcome::kFailed:
    case Outcome::kCancelled: {
      const auto st = stop_on_agents(obj);  // cancels whichever side still runs
      if (!st.stopped) {
        stopping_.try_emplace(key, v);
        return Next::kPoll;
      }
      stopping_.erase(key);
      const bool cancelled = v.outcome == Outcome::kCancelled;
      const std::string msg =
          v.code == kReasonVmPausedOnSource ? paused_on_source_message(status, st.target, v.reason) : v.reason;
      return transition(obj, status, cancelled ? "Cancelled" : "Failed", v.code, msg);
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
  // `view` stays null when no answer came: every reader checks before use.
  auto side_stopped = [&](const char* side, const char* field, json& view) {
    if (!status.contains(field)) return true;
    const auto agent = AgentAddress::from_json(status[field]);
    auto r = agents_.get(agent, id);
    if (!r) {
      if (r.error().code == Errc::kNotFound) {
        out.note += std::string(out.note.empty() ? "" : "; ") + side + " agent " + agent.pod + " knows no migration " +
                    id + " (never started there, or the agent restarted)";
        return true;
      }
      if (unreachable_too_long(key, side)) {
        LOG_WARN("reconcile") << key << ": giving up on the " << side << " agent: " << r.error().message;
        out.note += std::string(out.note.empty() ? "" : "; ") + "gave up on the " + side +
                    " agent: " + r.error().message;
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
  out.source_succeeded = out.source.is_object() && out.source.value("phase", "") == "Succeeded";
  if (out.source_succeeded) {
    // The VM now lives on the target: never cancel it there; wait for the target to finish.
    const auto agent = AgentAddress::from_json(status.value("targetAgent", json::object()));
    auto r = agents_.get(agent, id);
    if (r) out.target = r.value();
    else out.note += std::string(out.note.empty() ? "" : "; ") + "target agent: " + r.error().message;
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
    if (st.source.is_object() && st.target.is_object()) copy_agent_status(status, st.source, st.target);
    if (st.source_succeeded) {
      return transition(obj, status, "Succeeded", "Succeeded", "migrated; spec.cancel came after the source had completed");
    }
    return transition(obj, status, "Cancelled", "Cancelled",
                      "cancelled through spec.cancel; the VM keeps running on the source" +
                          (st.note.empty() ? std::string() : " (" + st.note + ")"));
  }
  return transition(obj, status, "Cancelled", "Cancelled", "cancelled through spec.cancel before it started");
}


Result<bool> Reconciler::finalize_qemu(const json& obj) {
  const std::string phase = obj.value("status", json::object()).value("phase", "");
  if (phase == "PreparingTarget" || phase == "Migrating") {
    const auto st = stop_on_agents(obj);
    if (!st.stopped) return false;
    events_.record(obj, "Normal", "Cancelled",
                   "object deleted: migration stopped on the agents" + (st.note.empty() ? "" : " (" + st.note + ")"));
  }
  return true;
}

}  // namespace rdmig::controller
