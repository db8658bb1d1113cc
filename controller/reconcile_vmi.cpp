// The vmi kind: KubeVirt migrates the VMI (a VirtualMachineInstanceMigration created here);
// rdmig's agents carry its connections when the node hook is installed, and report their
// figures through GET /v1/kubevirt/migrations. The status mirrors both.
#include "common/log.h"
#include "controller/kubevirt.h"
#include "controller/reconcile_util.h"
#include "controller/reconciler.h"
#include "controller/status_mapping.h"

namespace rdmig::controller {

using nlohmann::json;
using namespace detail;

namespace {

std::string ns_of(const json& obj) { return obj["metadata"].value("namespace", ""); }
std::string uid_of(const json& obj) { return obj.value("metadata", json::object()).value("uid", ""); }

std::string vmim_failure(const json& vmim, const json& ms) {
  if (ms.is_object() && !ms.value("failureReason", "").empty()) return ms.value("failureReason", "");
  for (const auto& c : vmim.value("status", json::object()).value("conditions", json::array())) {
    if (!c.value("message", "").empty()) return c.value("message", "");
  }
  return "KubeVirt reports the migration Failed without a reason";
}

}  // namespace

Result<Next> Reconciler::reconcile_vmi(json obj) {
  json status = obj.value("status", json::object());
  const std::string phase = status.value("phase", "");
  auto req = parse_vmi_spec(obj.value("spec", json()));
  if (!req) {
    auto stopped = stop_vmim(obj);
    if (!stopped) return stopped.error();
    if (!stopped.value()) return Next::kPoll;
    return transition(obj, status, "Failed", "InvalidSpec", req.error().message);
  }
  if (vmims_ == nullptr) {
    return transition(obj, status, "Failed", "KubevirtDisabled",
                      "spec.source.vmi: KubeVirt support is off in the controller's config (kubevirt.enabled)");
  }
  if (req->cancel) return cancel_vmi(obj);
  if (phase.empty()) {
    set_condition(status, "Admitted", "Unknown", "Checking", "checking VirtualMachineInstance " + req->name,
                  generation_of(obj), now_text());
    return transition(obj, status, "Pending", "Pending", "accepted; checking VirtualMachineInstance " + req->name);
  }
  if (!vmi_started(status)) return admit_vmi(obj, req.value());
  return follow_vmi(obj);
}

Result<Next> Reconciler::admit_vmi(json obj, const VmiRequest& req) {
  json status = obj.value("status", json::object());
  const std::string ns = ns_of(obj);
  const std::string name = vmim_name_for(obj);
  const int64_t gen = generation_of(obj);
  // Ours already (a write of the status was lost after the create): adopt it, no checks.
  json vmim;
  if (auto existing = kube_.get(vmim_path(ns, name)); existing) {
    if (!owned_by_rdma_migration(existing.value(), uid_of(obj))) {
      return transition(obj, status, "Failed", "MigrationNameTaken",
                        "VirtualMachineInstanceMigration " + ns + "/" + name + " exists and is not owned by this object");
    }
    vmim = existing.value();
  } else if (existing.error().code != Errc::kNotFound) {
    return existing.error();
  }
  auto vmi = kube_.get(vmi_path(ns, req.name));
  if (!vmi) {
    if (vmi.error().code != Errc::kNotFound) return vmi.error();
    return transition(obj, status, "Failed", "VMINotFound",
                      "spec.source.vmi.name: VirtualMachineInstance " + ns + "/" + req.name + " not found");
  }
  if (vmim.is_null()) {
    std::string code;
    const std::string refusal = vmi_refusal(vmi.value(), code);
    if (!refusal.empty()) return transition(obj, status, "Failed", code, refusal);
    for (const auto& other : vmims_->list()) {
      const auto& md = other.value("metadata", json::object());
      if (md.value("namespace", "") != ns || other.value("spec", json::object()).value("vmiName", "") != req.name) continue;
      if (vmim_phase_terminal(other.value("status", json::object()).value("phase", ""))) continue;
      return transition(obj, status, "Failed", "AlreadyMigrating",
                        "VirtualMachineInstance " + ns + "/" + req.name + " is already migrating: " +
                            "VirtualMachineInstanceMigration " + md.value("name", "") + " is active");
    }
    auto created = kube_.create(std::string(kKubevirtApi) + "/namespaces/" + ns + "/virtualmachineinstancemigrations",
                                vmim_for(obj, req.name, req.node_selector));
    if (!created) {
      if (created.error().code == Errc::kAlreadyExists) return Next::kRequeueNow;  // adopt or refuse next time
      if (created.error().code == Errc::kInvalidArgument || created.error().code == Errc::kPermissionDenied) {
        return transition(obj, status, "Failed", "MigrationRefused",
                          "creating VirtualMachineInstanceMigration " + name + ": " + created.error().message);
      }
      return created.error();
    }
    vmim = created.value();
    LOG_INFO("reconcile") << informer_.key_of(obj) << ": created VirtualMachineInstanceMigration " << ns << "/" << name
                          << " (uid " << uid_of(vmim) << ")";
  }
  status["kubevirt"] = json{{"migrationName", name}, {"migrationUid", uid_of(vmim)}, {"vmiUid", uid_of(vmi.value())}};
  const std::string node = vmi->value("status", json::object()).value("nodeName", "");
  if (!node.empty()) status["sourceNode"] = node;
  status["startTime"] = now_text();
  set_condition(status, "Admitted", "True", "MigrationCreated",
                "VirtualMachineInstanceMigration " + name + " created for VirtualMachineInstance " + req.name, gen,
                now_text());
  set_condition(status, "CarriedByRdmig", "Unknown", "NotYetSeen", "no rdmig agent has reported this migration yet",
                gen, now_text());
  return transition(obj, status, "PreparingTarget", "PreparingTarget",
                    "KubeVirt is preparing a target for VirtualMachineInstance " + req.name +
                        " (VirtualMachineInstanceMigration " + name + ")");
}

void Reconciler::mirror_record(const json& obj, json& status, bool ended) {
  const std::string uid = status["kubevirt"].value("migrationUid", "");
  const std::string src = status.value("sourceNode", ""), dst = status.value("targetNode", "");
  if (src.empty() && dst.empty()) return;
  const int64_t gen = generation_of(obj);
  const auto rec = lookup_kubevirt_record(kube_, agents_, config_, agent_namespace_, src, dst, uid);
  if (rec.item) {
    const json& item = *rec.item;
    if (item.value("carried", false)) {
      copy_kubevirt_record(status, item);
      set_condition(status, "CarriedByRdmig", "True", "Carried",
                    "carried by rdmig over " + item.value("transport", std::string("?")) +
                        (item.value("transportReason", "").empty() ? "" : " (" + item.value("transportReason", "") + ")") +
                        "; record from " + rec.where,
                    gen, now_text());
    } else {
      const std::string why = item.contains("reason") && item["reason"].is_string() ? item["reason"].get<std::string>()
                                                                                     : "no reason given";
      set_condition(status, "CarriedByRdmig", "False", "NotCarried",
                    "rdmig did not carry this migration (KubeVirt's own transport did): " + why, gen, now_text());
    }
    return;
  }
  if (!rec.reachable) {
    set_condition(status, "CarriedByRdmig", "Unknown", "AgentUnreachable",
                  "cannot ask the rdmig agents: " + rec.problems, gen, now_text());
    return;
  }
  if (ended) {
    const auto [reason, message] = diagnose_not_carried(kube_, rec, src, dst, uid);
    set_condition(status, "CarriedByRdmig", "False", reason, message, gen, now_text());
  }
}

Result<Next> Reconciler::follow_vmi(json obj) {
  const std::string key = informer_.key_of(obj);
  json status = obj.value("status", json::object());
  const std::string ns = ns_of(obj);
  const std::string name = status["kubevirt"].value("migrationName", "");
  const std::string uid = status["kubevirt"].value("migrationUid", "");
  const std::string vmi_name = obj["spec"]["source"]["vmi"].value("name", "");
  // The VMIM first: KubeVirt ends the VMI's migrationState before the VMIM's phase, so a VMI
  // read after a finished VMIM shows the end too.
  auto vmim = kube_.get(vmim_path(ns, name));
  if (!vmim && vmim.error().code != Errc::kNotFound) return vmim.error();
  auto vmi = kube_.get(vmi_path(ns, vmi_name));
  if (!vmi && vmi.error().code != Errc::kNotFound) return vmi.error();
  const json ms = vmi ? migration_state_for(vmi.value(), uid) : json();
  if (!vmim) {
    copy_kubevirt_state(status, json::object(), ms);
    if (ms.is_object() && ms.value("completed", false) && !ms.value("failed", false)) {
      mirror_record(obj, status, true);
      return transition(obj, status, "Succeeded", "Succeeded",
                        "migrated by KubeVirt; VirtualMachineInstanceMigration " + name + " was deleted after it ended");
    }
    return transition(obj, status, "Failed", "MigrationDeleted",
                      "VirtualMachineInstanceMigration " + ns + "/" + name + " was deleted before it finished");
  }
  const json vmim_obj = without_nulls(vmim.value());
  copy_kubevirt_state(status, vmim_obj, ms);
  const std::string vmim_phase = vmim_obj.value("status", json::object()).value("phase", "");
  const std::string phase = phase_for_vmim_phase(vmim_phase);
  const bool ended = phase == "Succeeded" || phase == "Failed";
  mirror_record(obj, status, ended);
  if (phase == "Succeeded") {
    // The source agent gets libvirt's figures from the target at the end: give it a moment.
    const bool carried = status.contains("transport");
    auto [since, _] = ended_since_.try_emplace(key, std::chrono::steady_clock::now());
    if (carried && !status.contains("downtimeMs") &&
        std::chrono::steady_clock::now() - since->second < std::chrono::seconds(config_.kubevirt.figures_wait_seconds)) {
      if (status != obj.value("status", json::object())) {
        auto w = write_status(obj, status);
        if (!w) return w.error();
      }
      return Next::kPoll;
    }
    ended_since_.erase(key);
    if (status.contains("progress")) status["progress"]["percent"] = 100;
    std::string msg = "migrated by KubeVirt from node " + status.value("sourceNode", std::string("?")) + " to node " +
                      status.value("targetNode", std::string("?"));
    if (status.contains("downtimeMs")) msg += "; downtime " + std::to_string(status["downtimeMs"].get<int64_t>()) + " ms";
    if (carried) {
      msg += "; carried by rdmig over " + status.value("transport", std::string("?"));
    } else {
      // Why, in this message and so in the Event: the condition's words (every missing piece).
      std::string why;
      for (const auto& c : status.value("conditions", json::array())) {
        if (c.value("type", "") == "CarriedByRdmig" && c.value("status", "") == "False") {
          const std::string reason = c.value("reason", ""), message = c.value("message", "");
          why = message.find(reason) == std::string::npos ? reason + ": " + message : message;  // a list names each
        }
      }
      msg += why.empty() ? "; not carried by rdmig (see condition CarriedByRdmig)" : "; not carried by rdmig: " + why;
    }
    return transition(obj, status, "Succeeded", carried ? "Succeeded" : "NotCarriedByRdmig", msg);
  }
  if (phase == "Failed") {
    ended_since_.erase(key);
    return transition(obj, status, "Failed", "MigrationFailed", "KubeVirt: " + vmim_failure(vmim_obj, ms));
  }
  if (phase.empty()) {
    return transition(obj, status, "Failed", "UnknownMigrationPhase",
                      "VirtualMachineInstanceMigration " + name + " is in phase '" + vmim_phase + "', unknown to rdmig");
  }
  if (phase != status.value("phase", "")) {
    return transition(obj, status, phase, phase,
                      phase == "Migrating" ? "KubeVirt migrates VirtualMachineInstance " + vmi_name + " from node " +
                                                 status.value("sourceNode", std::string("?")) + " to node " +
                                                 status.value("targetNode", std::string("?"))
                                           : "KubeVirt: VirtualMachineInstanceMigration " + name + " " + vmim_phase);
  }
  if (status != obj.value("status", json::object())) {
    auto w = write_status(obj, status);
    if (!w) return w.error();
  }
  return Next::kPoll;
}

Result<bool> Reconciler::stop_vmim(const json& obj) {
  const json status = obj.value("status", json::object());
  if (!vmi_started(status)) return true;
  const std::string path = vmim_path(ns_of(obj), status["kubevirt"].value("migrationName", ""));
  auto current = kube_.get(path);
  if (!current) {
    if (current.error().code == Errc::kNotFound) return true;
    return current.error();
  }
  if (vmim_phase_terminal(current->value("status", json::object()).value("phase", ""))) return true;
  if (!current->value("metadata", json::object()).contains("deletionTimestamp")) {
    // KubeVirt aborts a running migration when its VMIM is deleted; its finalizer keeps the
    // VMIM until the abort is done, so wait for it to go or to end.
    if (auto d = kube_.remove(path); !d && d.error().code != Errc::kNotFound) return d.error();
    LOG_INFO("reconcile") << informer_.key_of(obj) << ": deleted VirtualMachineInstanceMigration " << path;
  }
  return false;
}

Result<Next> Reconciler::cancel_vmi(json obj) {
  json status = obj.value("status", json::object());
  if (!vmi_started(status)) {
    return transition(obj, status, "Cancelled", "Cancelled", "cancelled through spec.cancel before it started");
  }
  auto stopped = stop_vmim(obj);
  if (!stopped) return stopped.error();
  if (!stopped.value()) return Next::kPoll;
  // Gone or ended: did KubeVirt complete before the abort?
  const std::string ns = ns_of(obj);
  const std::string uid = status["kubevirt"].value("migrationUid", "");
  auto vmi = kube_.get(vmi_path(ns, obj["spec"]["source"]["vmi"].value("name", "")));
  if (!vmi && vmi.error().code != Errc::kNotFound) return vmi.error();
  const json ms = vmi ? migration_state_for(vmi.value(), uid) : json();
  if (ms.is_object()) copy_kubevirt_state(status, json::object(), ms);  // keeps the name and uid we have
  if (ms.is_object() && ms.value("completed", false) && !ms.value("failed", false)) {
    mirror_record(obj, status, true);
    return transition(obj, status, "Succeeded", "Succeeded", "migrated; spec.cancel came after KubeVirt had completed");
  }
  return transition(obj, status, "Cancelled", "Cancelled",
                    "cancelled through spec.cancel: VirtualMachineInstanceMigration " +
                        status["kubevirt"].value("migrationName", std::string()) +
                        " deleted (KubeVirt's abort); the VM keeps running on node " +
                        status.value("sourceNode", std::string("?")));
}

Result<bool> Reconciler::finalize_vmi(const json& obj) {
  const std::string phase = obj.value("status", json::object()).value("phase", "");
  if (is_terminal_phase(phase)) return true;
  auto stopped = stop_vmim(obj);
  if (!stopped || !stopped.value()) return stopped;
  events_.record(obj, "Normal", "Cancelled",
                 "object deleted: VirtualMachineInstanceMigration deleted (KubeVirt's abort)");
  return true;
}

}  // namespace rdmig::controller
