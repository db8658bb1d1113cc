#include "controller/kubevirt_observer.h"

#include <set>

#include "common/log.h"
#include "controller/kubevirt.h"
#include "k8s/time_format.h"

namespace rdmig::controller {

using nlohmann::json;

KubevirtObserver::KubevirtObserver(const ControllerConfig& config, std::string agent_namespace, k8s::KubeClient& kube,
                                   k8s::Informer& vmims, AgentClient& agents, k8s::EventRecorder& events,
                                   ControllerMetrics& metrics)
    : config_(config),
      agent_namespace_(std::move(agent_namespace)),
      kube_(kube),
      vmims_(vmims),
      agents_(agents),
      events_(events),
      metrics_(metrics) {
  metrics_.set_max_vmis(config_.kubevirt.max_reported_vmis);
}

json KubevirtObserver::vmi_or_stub(const std::string& ns, const std::string& name) {
  auto vmi = kube_.get(vmi_path(ns, name));
  if (vmi) return without_nulls(vmi.value());
  return json{{"apiVersion", "kubevirt.io/v1"},
              {"kind", "VirtualMachineInstance"},
              {"metadata", {{"namespace", ns}, {"name", name}}}};
}

void KubevirtObserver::observe_all() {
  if (!vmims_.synced()) return;
  std::set<std::string> present;
  std::set<std::pair<std::string, std::string>> vmis_present;
  for (const auto& raw : vmims_.list()) {
    const json vmim = without_nulls(raw);
    const auto& md = vmim.value("metadata", json::object());
    const std::string uid = md.value("uid", "");
    if (uid.empty()) continue;
    present.insert(uid);
    auto [it, inserted] = seen_.try_emplace(uid);
    Seen& s = it->second;
    if (inserted) {
      s.ns = md.value("namespace", "");
      s.vmi = vmim.value("spec", json::object()).value("vmiName", "");
      s.owned = owned_by_rdma_migration(vmim);
      // Migrations that ended before this controller started are not news.
      if (first_pass_ && vmim_phase_terminal(vmim.value("status", json::object()).value("phase", ""))) {
        s.started = s.ended = true;
      }
    }
    vmis_present.insert({s.ns, s.vmi});
    if (!s.ended) observe(vmim, s);
  }
  first_pass_ = false;
  for (auto it = seen_.begin(); it != seen_.end();) {
    if (present.count(it->first)) {
      ++it;
      continue;
    }
    if (!vmis_present.count({it->second.ns, it->second.vmi})) metrics_.forget_vmi(it->second.ns, it->second.vmi);
    it = seen_.erase(it);
  }
}

void KubevirtObserver::observe(const json& vmim, Seen& s) {
  const auto& md = vmim.value("metadata", json::object());
  const std::string name = md.value("name", ""), uid = md.value("uid", "");
  const std::string phase = vmim.value("status", json::object()).value("phase", "");
  const bool terminal = vmim_phase_terminal(phase);
  if (!s.started) {
    s.started = true;
    ControllerMetrics::VmiFigures f;
    f.active = !terminal;
    metrics_.set_vmi(s.ns, s.vmi, f);
    if (!s.owned) {
      events_.record(vmi_or_stub(s.ns, s.vmi), "Normal", "MigrationStarted",
                     "VirtualMachineInstanceMigration " + name + " started (not through an RdmaMigration); "
                     "rdmig reports it");
    }
  }
  if (!terminal) return;
  const json vmi = vmi_or_stub(s.ns, s.vmi);
  const json ms = migration_state_for(vmi, uid);
  const std::string src = ms.is_object() ? ms.value("sourceNode", "") : "";
  const std::string dst = ms.is_object() ? ms.value("targetNode", "") : "";
  const auto rec = lookup_kubevirt_record(kube_, agents_, config_, agent_namespace_, src, dst, uid);
  const bool carried = rec.item && rec.item->value("carried", false);
  const json lv = rec.item ? rec.item->value("libvirt", json()) : json();
  const auto now = std::chrono::steady_clock::now();
  if (s.ended_at == std::chrono::steady_clock::time_point{}) s.ended_at = now;
  if (phase == "Succeeded" && carried && !(lv.is_object() && lv.contains("downtimeMs")) &&
      now - s.ended_at < std::chrono::seconds(config_.kubevirt.figures_wait_seconds)) {
    return;  // the source agent gets libvirt's figures from the target at the end: next pass
  }
  s.ended = true;
  ControllerMetrics::VmiFigures f;
  std::string carried_label = "unknown", how;
  if (rec.item) {
    carried_label = carried ? "true" : "false";
    f.carried = carried;
    if (carried) {
      how = "carried by rdmig over " + rec.item->value("transport", std::string("?"));
      if (rec.item->contains("bytesSent") && (*rec.item)["bytesSent"].is_number()) {
        f.transferred_bytes = (*rec.item)["bytesSent"].get<double>();
      }
    } else {
      how = "not carried by rdmig: " + rec.item->value("reason", std::string("no reason given"));
    }
  } else {
    how = rec.reachable ? "no rdmig agent has a record of it (node hook not installed?)"
                        : "rdmig agents not reachable: " + rec.problems;
  }
  std::string downtime;
  if (lv.is_object() && lv.contains("downtimeMs") && lv["downtimeMs"].is_number()) {
    f.downtime_seconds = lv["downtimeMs"].get<double>() / 1000.0;
    downtime = "; downtime " + std::to_string(lv["downtimeMs"].get<int64_t>()) + " ms";
  }
  // libvirt's total time (ms) when rdmig has it, else KubeVirt's timestamps (whole seconds).
  if (lv.is_object() && lv.contains("totalTimeMs") && lv["totalTimeMs"].is_number()) {
    f.duration_seconds = lv["totalTimeMs"].get<double>() / 1000.0;
  } else if (ms.is_object()) {
    auto start = k8s::parse_time(ms.value("startTimestamp", "")), end = k8s::parse_time(ms.value("endTimestamp", ""));
    if (start && end && *end >= *start) f.duration_seconds = std::chrono::duration<double>(*end - *start).count();
  }
  metrics_.set_vmi(s.ns, s.vmi, f);
  metrics_.kubevirt_migration_ended(phase, carried_label);
  LOG_INFO("kubevirt") << s.ns << "/" << s.vmi << ": VirtualMachineInstanceMigration " << name << " " << phase << "; "
                       << how;
  if (s.owned) return;
  const std::string where = src.empty() ? "" : " from node " + src + (dst.empty() ? "" : " to node " + dst);
  if (phase == "Succeeded") {
    events_.record(vmi, "Normal", "MigrationSucceeded",
                   "VirtualMachineInstanceMigration " + name + " succeeded" + where + downtime + "; " + how);
  } else {
    const std::string why = ms.is_object() ? ms.value("failureReason", "") : "";
    events_.record(vmi, "Warning", "MigrationFailed",
                   "VirtualMachineInstanceMigration " + name + " failed" + where +
                       (why.empty() ? "" : ": " + why) + "; " + how);
  }
}

}  // namespace rdmig::controller
