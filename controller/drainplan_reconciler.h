// Reconciles RdmaDrainPlan objects (docs/drain.md):
//   ""/Pending          check the spec and that spec.node runs an agent, list the node's VMIs,
//                       find the latest RdmaPathCheck pair from spec.node (to spec.targets when
//                       set) that carried its bytes; none: create <name>-paths (owned by the
//                       plan) and wait in WaitingForPathCheck
//   WaitingForPathCheck as above, until that check ends (all its pairs failed: Failed)
//   Forecast            status.vms and status.summary written (controller/drain_forecast.h);
//                       the forecast is not refreshed: a new forecast is a new object
//   Executing           spec.execute true: after the forecast, execute() (drainplan_execute.cpp)
//                       creates one RdmaMigration per VMI in the plan's order within its
//                       concurrency, re-plans the rest after each one ends, records each VM's
//                       measured figures beside its forecast
//   Completed           every VMI that was to migrate has a migration that ended
//   Failed              invalid spec, no agent on the node, KubeVirt off or absent, no usable path
//   Cancelling          spec.cancel seen while Executing: no migration is started from then on;
//                       the running ones finish (spec.runningOnCancel Finish) or are cancelled
//                       (Cancel: spec.cancel on each RdmaMigration)
//   Cancelled           spec.cancel seen before the drain started, or Cancelling with none running
// spec.cancel in any phase also stops the plan's own path check if it still runs (deleted, which
// cancels its pairs on the agents; stop_path_check), and a cancelled plan never creates one.
// Once executing, the plan keeps to the spec it started with (status.execution.spec): a change to
// any field but cancel and runningOnCancel is not acted on and is named in condition SpecChanged
// (the CRD's CEL rule refuses it where the API server runs it). status.execution.started names
// every VM the plan started, so a VM whose RdmaMigration is deleted is not started again.
// No finalizer: the plan itself starts nothing on the agents; a deleted plan's path check (always
// in its namespace: checks and plans are watched in the same scope) and, in its own namespace, its
// migrations go with it (owner references: the garbage collector deletes them, and deleting a
// check cancels its pairs on the agents, deleting a migration aborts it). The executing state is read from
// the objects each time (the migrations by label, the VMIs on the node, the plan's status), so a
// restarted controller continues. Called from its worker's thread only.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/drain_forecast.h"
#include "controller/reconciler.h"
#include "k8s/events.h"
#include "k8s/informer.h"
#include "k8s/kube_client.h"

namespace rdmig::controller {

inline constexpr const char* kDirtyRateAnnotation = "rdmig.io/dirty-rate-bytes-per-second";
inline constexpr const char* kDirtyRateTimeAnnotation = "rdmig.io/dirty-rate-time";
// The guest RAM the VMI's QEMU holds resident (KubeVirt's kubevirt_vmi_memory_resident_bytes, or
// the agent's residentRamBytes), copied onto the VMI as the dirty rate is; and when.
inline constexpr const char* kResidentMemoryAnnotation = "rdmig.io/resident-memory-bytes";
inline constexpr const char* kResidentMemoryTimeAnnotation = "rdmig.io/resident-memory-time";

std::string drainplan_path(const nlohmann::json& obj);

// A VMI's memory: spec.domain.memory.guest, else spec.domain.resources.requests.memory (binary
// or decimal quantities: 1Gi, 1024Mi, 1G, 1073741824); unset when neither parses.
std::optional<uint64_t> vmi_memory(const nlohmann::json& vmi);

// A VMI's resident guest RAM from its annotation (kResidentMemoryAnnotation): a number of bytes
// (as Prometheus writes it too: "1.34217728e+08"), above 0 and at most 2^53; unset otherwise.
std::optional<uint64_t> vmi_resident_memory(const nlohmann::json& vmi);

// The pair a drain from `node` would use: among the RdmaPathChecks given, the latest (by
// completionTime) pair from `node` that Passed or FellBack, to one of `targets` (empty: any);
// the fastest pair of that check. Null when none.
nlohmann::json best_path_pair(const std::vector<nlohmann::json>& checks, const std::string& node,
                              const std::vector<std::string>& targets);

class DrainPlanReconciler final : public ObjectReconciler {
 public:
  DrainPlanReconciler(const ControllerConfig& config, std::string agent_namespace, k8s::KubeClient& kube,
                      k8s::Informer& informer, k8s::Informer& pathchecks, k8s::EventRecorder& events,
                      ControllerMetrics& metrics);
  Result<Next> reconcile(const std::string& key) override;
  bool needs_poll(const nlohmann::json& obj) const override;

 private:
  struct Inputs {
    std::string node;
    DrainSettings settings;
    std::vector<std::string> targets;
    double capacity = 0;                      // spec.pathCapacity, bytes/s (0: the measured rate)
    std::optional<double> assumed_dirty_rate;
    bool migrate_not_converging = false;      // spec.notConverging: Migrate
  };
  static Result<Inputs> read_spec(const nlohmann::json& spec);
  // The path's figures from a path check pair; sets in.settings.max_concurrency (pair, rails).
  static forecast::PathMeasure path_measure(const nlohmann::json& spec, const nlohmann::json& path_pair, Inputs& in);
  // The VMIs on spec.node now (spec.selector), sorted; kNotFound: KubeVirt's API is absent.
  Result<std::vector<DrainVm>> node_vms(const nlohmann::json& spec, const Inputs& in);
  Result<Next> forecast(nlohmann::json obj);
  Result<Next> execute(nlohmann::json obj);
  Result<Next> cancel_before_start(const nlohmann::json& obj);
  // spec.cancel (and the plan's annotation) on one of its running RdmaMigrations; false: not now
  // (a conflict or the object gone), the next poll tries again.
  Result<bool> cancel_migration(const nlohmann::json& plan, const nlohmann::json& migration);
  // Condition SpecChanged (and an Event when the fields named change) for a spec edited while
  // executing; `frozen` is what the plan keeps to.
  void check_spec_unchanged(const nlohmann::json& obj, const nlohmann::json& frozen, nlohmann::json& status);
  Result<nlohmann::json> start_migration(const nlohmann::json& plan, const DrainVm& vm, const PlannedVm* planned,
                                         size_t order, const Inputs& in);
  void export_metrics(const nlohmann::json& obj);
  Result<Next> fail(const nlohmann::json& obj, const std::string& reason, const std::string& message);
  Result<Next> wait_for_path_check(const nlohmann::json& obj, const std::vector<std::string>& targets);
  // The path check this plan creates when no check measured its path: {namespace, name}.
  std::pair<std::string, std::string> own_path_check(const nlohmann::json& obj) const;
  // spec.cancel: the plan's own path check, when it still runs (path_check_to_stop), is deleted
  // (RdmaPathCheck has no cancel of its own; its finalizer cancels the pairs on both agents),
  // recorded in status.createdPathCheck (stopTime, stopped) and Event PathCheckStopped; once.
  // fresh: read the check from the API server (one created a moment ago may not be cached yet),
  // else from the cache. The delete holds only for the check as read (preconditions uid and
  // resourceVersion): one that changed meanwhile is read again and judged again, so a check that
  // ended in that instant keeps its result. Returns whether it stopped one now.
  Result<bool> stop_path_check(const nlohmann::json& obj, nlohmann::json& status, bool fresh);
  // stop_path_check for a cancel, which a failed stop never holds up (an API server that refuses
  // the delete, RBAC without it, must not keep a drain from being cancelled): the error goes in
  // status.createdPathCheck.stopError (Event PathCheckStopFailed when it changes, but for a check
  // that kept changing under the delete's preconditions) and the cancel goes on; later reconciles
  // (polls, of the Cancelled plan too: needs_poll) try again until the stop holds. Returns whether
  // status changed, and the failure (for the caller to be retried on) if any.
  struct CancelStop {
    bool changed = false;
    std::optional<Error> failed;
  };
  CancelStop stop_path_check_for_cancel(const nlohmann::json& obj, nlohmann::json& status, bool fresh);
  Result<nlohmann::json> write_status(const nlohmann::json& obj, nlohmann::json status);

  const ControllerConfig& config_;
  const std::string agent_namespace_;
  k8s::KubeClient& kube_;
  k8s::Informer& informer_;
  k8s::Informer& pathchecks_;
  k8s::EventRecorder& events_;
  ControllerMetrics& metrics_;
};

}  // namespace rdmig::controller
