// rdmig-controller's own Prometheus metrics (prometheus-cpp registry, served by main).
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace rdmig::controller {

class ControllerMetrics {
 public:
  ControllerMetrics();

  void reconciled(const std::string& result);  // success, error
  void agent_request(const std::string& code);  // HTTP status or "error"
  void set_leader(bool leading);
  // Objects by status.phase ("" counts as Pending); every phase is always exported.
  void set_phase_counts(const std::map<std::string, int>& counts);
  std::string serialize() const;

  // Every KubeVirt migration (rdmig's CR or not), by VMI. Series exist for at most
  // `max_vmis` VMIs (the least recently updated are dropped) and are removed by forget_vmi.
  struct VmiFigures {
    bool active = false;
    std::optional<bool> carried;          // unknown while running without a record
    std::optional<double> downtime_seconds, duration_seconds, transferred_bytes;
  };
  void set_max_vmis(size_t max_vmis) { max_vmis_ = max_vmis; }
  void set_vmi(const std::string& ns, const std::string& name, const VmiFigures& figures);
  void forget_vmi(const std::string& ns, const std::string& name);
  // result: Succeeded, Failed; carried: true, false, unknown.
  void kubevirt_migration_ended(const std::string& result, const std::string& carried);

  // One RdmaPathCheck pair that ended, by node pair: rdmig_controller_pathcheck_pairs_total
  // {source_node,target_node,result} (Passed, FellBack, Failed) and, for a pair that carried its
  // bytes, rdmig_controller_pathcheck_pair_throughput_bytes_per_second{source_node,target_node}.
  // Series exist for at most `max_pairs` node pairs (the least recently ended are dropped): the
  // cardinality is the node pairs checked, at most N x (N - 1) for N nodes.
  void set_max_pathcheck_pairs(size_t max_pairs) { max_pathcheck_pairs_ = max_pairs; }
  void pathcheck_pair_ended(const std::string& source_node, const std::string& target_node, const std::string& result,
                            std::optional<double> throughput_bytes_per_second);

  // One RdmaDrainPlan (docs/drain.md), by namespace and name: the forecast's drain time
  // (rdmig_controller_drainplan_predicted_drain_seconds), the drain's time so far or in all
  // (rdmig_controller_drainplan_actual_drain_seconds, executing plans only) and its VMs by state
  // (rdmig_controller_drainplan_vms{state}: pending, running, succeeded, failed, skipped,
  // cancelled). Series exist for at most `max_plans` plans (the least recently updated are
  // dropped) and are removed by forget_drainplan when the plan is deleted.
  struct DrainPlanFigures {
    double predicted_seconds = 0;
    std::optional<double> actual_seconds;
    std::map<std::string, int64_t> vms;  // by state
  };
  void set_max_drainplans(size_t max_plans) { max_drainplans_ = max_plans; }
  void set_drainplan(const std::string& ns, const std::string& name, const DrainPlanFigures& figures);
  void forget_drainplan(const std::string& ns, const std::string& name);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& reconciles_;
  prometheus::Family<prometheus::Gauge>& migrations_;
  prometheus::Gauge& leader_;
  prometheus::Family<prometheus::Counter>& agent_requests_;
  prometheus::Family<prometheus::Counter>& kv_ended_;
  prometheus::Family<prometheus::Gauge>& vmi_active_;
  prometheus::Family<prometheus::Gauge>& vmi_carried_;
  prometheus::Family<prometheus::Gauge>& vmi_downtime_;
  prometheus::Family<prometheus::Gauge>& vmi_duration_;
  prometheus::Family<prometheus::Gauge>& vmi_bytes_;
  prometheus::Family<prometheus::Counter>& pathcheck_pairs_;
  prometheus::Family<prometheus::Gauge>& pathcheck_throughput_;
  prometheus::Family<prometheus::Gauge>& drainplan_predicted_;
  prometheus::Family<prometheus::Gauge>& drainplan_actual_;
  prometheus::Family<prometheus::Gauge>& drainplan_vms_;
  size_t max_drainplans_ = 256;
  std::list<std::pair<std::string, std::string>> drainplan_order_;  // least recently updated first
  void remove_drainplan(const std::string& ns, const std::string& name);
  size_t max_vmis_ = 256;
  size_t max_pathcheck_pairs_ = 4096;
  std::list<std::pair<std::string, std::string>> pathcheck_order_;  // node pairs, least recently ended first
  void remove_pathcheck_pair(const std::string& source_node, const std::string& target_node);
  std::list<std::pair<std::string, std::string>> vmi_order_;  // least recently updated first
  void remove_series(const std::string& ns, const std::string& name);
};

}  // namespace rdmig::controller
