#include "controller/controller_metrics.h"

#include <prometheus/text_serializer.h>

#include "metrics/metrics.h"

namespace rdmig::controller {

ControllerMetrics::ControllerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      reconciles_(prometheus::BuildCounter()
                      .Name("rdmig_controller_reconciles_total")
                      .Help("Reconciles of RdmaMigration objects by result (success, error)")
                      .Register(*registry_)),
      migrations_(prometheus::BuildGauge()
                      .Name("rdmig_controller_migrations")
                      .Help("RdmaMigration objects by status phase, as this replica sees them")
                      .Register(*registry_)),
      leader_(prometheus::BuildGauge()
                  .Name("rdmig_controller_leader")
                  .Help("1 when this replica holds the leader lease and acts, else 0")
                  .Register(*registry_)
                  .Add({})),
      agent_requests_(prometheus::BuildCounter()
                          .Name("rdmig_controller_agent_requests_total")
                          .Help("Requests to agents' REST API by HTTP status code (error: no response)")
                          .Register(*registry_)),
      kv_ended_(prometheus::BuildCounter()
                    .Name("rdmig_controller_kubevirt_migrations_total")
                    .Help("KubeVirt migrations (VirtualMachineInstanceMigrations) seen to end, by result and whether "
                          "rdmig carried them (true, false, unknown)")
                    .Register(*registry_)),
      vmi_active_(prometheus::BuildGauge()
                      .Name("rdmig_controller_vmi_migration_active")
                      .Help("1 while a KubeVirt migration of this VMI runs, else 0")
                      .Register(*registry_)),
      vmi_carried_(prometheus::BuildGauge()
                       .Name("rdmig_controller_vmi_migration_carried")
                       .Help("1 when rdmig carried the VMI's last migration, 0 when KubeVirt's own transport did")
                       .Register(*registry_)),
      vmi_downtime_(prometheus::BuildGauge()
                        .Name("rdmig_controller_vmi_migration_downtime_seconds")
                        .Help("Downtime of the VMI's last migration as libvirt reports it")
                        .Register(*registry_)),
      vmi_duration_(prometheus::BuildGauge()
                        .Name("rdmig_controller_vmi_migration_duration_seconds")
                        .Help("Duration of the VMI's last migration (libvirt's total time, else KubeVirt's timestamps)")
                        .Register(*registry_)),
      vmi_bytes_(prometheus::BuildGauge()
                     .Name("rdmig_controller_vmi_migration_transferred_bytes")
                     .Help("Bytes rdmig carried in the VMI's last migration")
                     .Register(*registry_)),
      pathcheck_pairs_(prometheus::BuildCounter()
                           .Name("rdmig_controller_pathcheck_pairs_total")
                           .Help("RdmaPathCheck pairs that ended, by source node, target node and result (Passed, "
                                 "FellBack, Failed)")
                           .Register(*registry_)),
      pathcheck_throughput_(prometheus::BuildGauge()
                                .Name("rdmig_controller_pathcheck_pair_throughput_bytes_per_second")
                                .Help("Throughput of the last RdmaPathCheck pair from the source node to the target "
                                      "node that carried its bytes")
                                .Register(*registry_)),
      drainplan_predicted_(prometheus::BuildGauge()
                               .Name("rdmig_controller_drainplan_predicted_drain_seconds")
                               .Help("An RdmaDrainPlan's forecast drain time for its order and concurrency")
                               .Register(*registry_)),
      drainplan_actual_(prometheus::BuildGauge()
                            .Name("rdmig_controller_drainplan_actual_drain_seconds")
                            .Help("An executing RdmaDrainPlan's drain time so far, or in all once completed")
                            .Register(*registry_)),
      drainplan_vms_(prometheus::BuildGauge()
                         .Name("rdmig_controller_drainplan_vms")
                         .Help("An RdmaDrainPlan's VMs by state (pending, running, succeeded, failed, skipped)")
                         .Register(*registry_)) {
  reconciles_.Add({{"result", "success"}});
  reconciles_.Add({{"result", "error"}});
  set_phase_counts({});
  register_build_info(*registry_);
}

void ControllerMetrics::reconciled(const std::string& result) { reconciles_.Add({{"result", result}}).Increment(); }
void ControllerMetrics::agent_request(const std::string& code) { agent_requests_.Add({{"code", code}}).Increment(); }
void ControllerMetrics::set_leader(bool leading) { leader_.Set(leading ? 1 : 0); }

void ControllerMetrics::set_phase_counts(const std::map<std::string, int>& counts) {
  for (const char* phase : {"Pending", "PreparingTarget", "Migrating", "Succeeded", "Failed", "Cancelled"}) {
    auto it = counts.find(phase);
    set_gauge(migrations_, {{"phase", phase}}, it == counts.end() ? 0 : it->second);
  }
}

void ControllerMetrics::kubevirt_migration_ended(const std::string& result, const std::string& carried) {
  kv_ended_.Add({{"result", result}, {"carried", carried}}).Increment();
}

void ControllerMetrics::remove_series(const std::string& ns, const std::string& name) {
  const std::map<std::string, std::string> labels{{"namespace", ns}, {"name", name}};
  for (auto* family : {&vmi_active_, &vmi_carried_, &vmi_downtime_, &vmi_duration_, &vmi_bytes_}) {
    if (family->Has(labels)) family->Remove(&family->Add(labels));
  }
}

void ControllerMetrics::set_vmi(const std::string& ns, const std::string& name, const VmiFigures& f) {
  vmi_order_.remove({ns, name});
  vmi_order_.emplace_back(ns, name);
  while (vmi_order_.size() > max_vmis_) {
    remove_series(vmi_order_.front().first, vmi_order_.front().second);
    vmi_order_.pop_front();
  }
  const std::map<std::string, std::string> labels{{"namespace", ns}, {"name", name}};
  set_gauge(vmi_active_, labels, f.active ? 1 : 0);
  auto set_or_remove = [&](prometheus::Family<prometheus::Gauge>& family, const std::optional<double>& v) {
    if (v) set_gauge(family, labels, *v);
    else if (family.Has(labels)) family.Remove(&family.Add(labels));
  };
  set_or_remove(vmi_carried_, f.carried ? std::optional<double>(*f.carried ? 1 : 0) : std::nullopt);
  set_or_remove(vmi_downtime_, f.downtime_seconds);
  set_or_remove(vmi_duration_, f.duration_seconds);
  set_or_remove(vmi_bytes_, f.transferred_bytes);
}

void ControllerMetrics::forget_vmi(const std::string& ns, const std::string& name) {
  vmi_order_.remove({ns, name});
  remove_series(ns, name);
}

void ControllerMetrics::remove_pathcheck_pair(const std::string& source_node, const std::string& target_node) {
  for (const char* result : {"Passed", "FellBack", "Failed"}) {
    const std::map<std::string, std::string> labels{
        {"source_node", source_node}, {"target_node", target_node}, {"result", result}};
    if (pathcheck_pairs_.Has(labels)) pathcheck_pairs_.Remove(&pathcheck_pairs_.Add(labels));
  }
  const std::map<std::string, std::string> labels{{"source_node", source_node}, {"target_node", target_node}};
  if (pathcheck_throughput_.Has(labels)) pathcheck_throughput_.Remove(&pathcheck_throughput_.Add(labels));
}

void ControllerMetrics::pathcheck_pair_ended(const std::string& source_node, const std::string& target_node,
                                             const std::string& result, std::optional<double> throughput) {
  pathcheck_order_.remove({source_node, target_node});
  pathcheck_order_.emplace_back(source_node, target_node);
  while (pathcheck_order_.size() > max_pathcheck_pairs_) {
    remove_pathcheck_pair(pathcheck_order_.front().first, pathcheck_order_.front().second);
    pathcheck_order_.pop_front();
  }
  pathcheck_pairs_.Add({{"source_node", source_node}, {"target_node", target_node}, {"result", result}}).Increment();
  if (throughput) {
    set_gauge(pathcheck_throughput_, {{"source_node", source_node}, {"target_node", target_node}}, *throughput);
  }
}

void ControllerMetrics::remove_drainplan(const std::string& ns, const std::string& name) {
  const std::map<std::string, std::string> labels{{"namespace", ns}, {"name", name}};
  for (auto* family : {&drainplan_predicted_, &drainplan_actual_}) {
    if (family->Has(labels)) family->Remove(&family->Add(labels));
  }
  for (const char* state : {"pending", "running", "succeeded", "failed", "skipped", "cancelled"}) {
    const std::map<std::string, std::string> l{{"namespace", ns}, {"name", name}, {"state", state}};
    if (drainplan_vms_.Has(l)) drainplan_vms_.Remove(&drainplan_vms_.Add(l));
  }
}

void ControllerMetrics::set_drainplan(const std::string& ns, const std::string& name, const DrainPlanFigures& f) {
  drainplan_order_.remove({ns, name});
  drainplan_order_.emplace_back(ns, name);
  while (drainplan_order_.size() > max_drainplans_) {
    remove_drainplan(drainplan_order_.front().first, drainplan_order_.front().second);
    drainplan_order_.pop_front();
  }
  const std::map<std::string, std::string> labels{{"namespace", ns}, {"name", name}};
  set_gauge(drainplan_predicted_, labels, f.predicted_seconds);
  if (f.actual_seconds) set_gauge(drainplan_actual_, labels, *f.actual_seconds);
  else if (drainplan_actual_.Has(labels)) drainplan_actual_.Remove(&drainplan_actual_.Add(labels));
  for (const char* state : {"pending", "running", "succeeded", "failed", "skipped", "cancelled"}) {
    const auto it = f.vms.find(state);
    set_gauge(drainplan_vms_, {{"namespace", ns}, {"name", name}, {"state", state}},
              static_cast<double>(it == f.vms.end() ? 0 : it->second));
  }
}

void ControllerMetrics::forget_drainplan(const std::string& ns, const std::string& name) {
  drainplan_order_.remove({ns, name});
  remove_drainplan(ns, name);
}

std::string ControllerMetrics::serialize() const {
  prometheus::TextSerializer s;
  return s.Serialize(registry_->Collect());
}

}  // namespace rdmig::controller
