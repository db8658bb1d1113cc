// Reconciler: drives one RdmaMigration object one step towards its end, from what the API
// cache, KubeVirt and the agents say. One reconcile path per source kind:
//
// qemu (reconcile_qemu.cpp; opt-in per namespace, config qemu.allowedNamespaces):
//   ""/Pending       validate the spec, wait for a free slot on both nodes, find the agent pods
//   PreparingTarget  POST role=target to the target agent, then role=source to the source agent
//   Migrating        poll both agents, mirror progress; end in Succeeded/Failed/Cancelled
//   spec.cancel and deletion cancel on the agents first: the source before the target, and
//   never the target once the source has completed (then the VM already lives on the target).
//
// vmi (reconcile_vmi.cpp; KubeVirt orchestrates, rdmig carries and measures):
//   ""/Pending       check the VMI (exists, Running, LiveMigratable, not migrating), create a
//                    VirtualMachineInstanceMigration owned by the object
//   PreparingTarget  VMIM Pending..TargetReady;  Migrating: VMIM Running
//   Succeeded/Failed as KubeVirt ends it, with rdmig's figures from the agents' records
//   spec.cancel and deletion delete the VMIM (KubeVirt's abort) and wait until it is gone.
//
// Deletion is held by the finalizer rdmig.io/cancel-on-delete until the migration stopped; a
// finished object (Succeeded/Failed/Cancelled) has nothing left to stop, so the finalizer goes
// when it finishes, and the object itself goes ttlSecondsAfterFinished (spec, else config) after
// status.completionTime.
// Each status change goes through the status subresource with the object's resourceVersion
// (409: re-read, retry) and records an Event.
//
// Called from the controller's single worker thread only; holds no locks of its own.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "controller/agent_client.h"
#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/migration_spec.h"
#include "controller/status_mapping.h"
#include "k8s/events.h"
#include "k8s/informer.h"
#include "k8s/kube_client.h"
#include "k8s/time_format.h"

namespace rdmig::controller {

inline constexpr const char* kFinalizer = "rdmig.io/cancel-on-delete";
inline constexpr const char* kGroupVersion = "rdmig.io/v1alpha1";

enum class Next { kDone, kRequeueNow, kPoll };

// What the worker drives: one kind of object, reconciled by key ("ns/name").
class ObjectReconciler {
 public:
  virtual ~ObjectReconciler() = default;
  virtual Result<Next> reconcile(const std::string& key) = 0;
  // Whether the worker's periodic pass must reconcile this cached object.
  virtual bool needs_poll(const nlohmann::json& obj) const = 0;
};

class Reconciler final : public ObjectReconciler {
 public:
  // `vmims`: the VirtualMachineInstanceMigration cache, null when KubeVirt support is off.
  Reconciler(const ControllerConfig& config, std::string agent_namespace, k8s::KubeClient& kube,
             k8s::Informer& informer, AgentClient& agents, k8s::EventRecorder& events, k8s::Informer* vmims);

  Result<Next> reconcile(const std::string& key) override;
  // Whether the worker's periodic pass must reconcile this cached object: it runs or is being
  // deleted, or it finished and still holds the finalizer or is due for deletion.
  bool needs_poll(const nlohmann::json& obj) const override;

 private:
  struct StopState {
    bool stopped = false;
    bool source_succeeded = false;
    nlohmann::json source, target;  // last agent views: null when no answer came
    std::string note;               // why a side counts as stopped without an answer ("" if none)
  };

  // A finished object: drop the finalizer; delete the object once its time-to-live is over.
  Result<Next> finished(nlohmann::json obj);

  Result<Next> finalize(nlohmann::json obj);

  // qemu kind (reconcile_qemu.cpp)
  Result<Next> reconcile_qemu(nlohmann::json obj);
  Result<bool> finalize_qemu(const nlohmann::json& obj);  // true once stopped
  Result<Next> admit(nlohmann::json obj, const MigrationRequest& req);
  Result<Next> prepare(nlohmann::json obj, const MigrationRequest& req);
  Result<Next> poll(nlohmann::json obj);
  Result<Next> cancel(nlohmann::json obj);

  // vmi kind (reconcile_vmi.cpp)
  Result<Next> reconcile_vmi(nlohmann::json obj);
  Result<Next> admit_vmi(nlohmann::json obj, const VmiRequest& req);
  Result<Next> follow_vmi(nlohmann::json obj);
  // Deletes the VMIM (KubeVirt's abort); true once it is gone or finished.
  Result<bool> stop_vmim(const nlohmann::json& obj);
  Result<Next> cancel_vmi(nlohmann::json obj);
  Result<bool> finalize_vmi(const nlohmann::json& obj);
  // rdmig's record from the agents into status and the CarriedByRdmig condition.
  void mirror_record(const nlohmann::json& obj, nlohmann::json& status, bool ended);

  // Asks the agents to stop (source first) and says whether both have.
  StopState stop_on_agents(const nlohmann::json& obj);
  // Records that `side` of `key` could not be reached; true once that lasted past the limit.
  bool unreachable_too_long(const std::string& key, const std::string& side);
  void reachable(const std::string& key, const std::string& side);

  // Writes `status` (409: re-read, retry), then records the Events the change itself implies
  // (status_events).
  Result<nlohmann::json> write_status(const nlohmann::json& obj, nlohmann::json status);
  // Events that follow from a status change whatever the path: TransportFallback (Warning) on the
  // write that first shows a TCP fallback, so once per migration.
  void status_events(const nlohmann::json& written, const nlohmann::json& before, const nlohmann::json& after);
  Result<nlohmann::json> set_finalizer(const nlohmann::json& obj, bool present);
  // Phase change with an Event; terminal phases also set completionTime and the Succeeded condition.
  Result<Next> transition(const nlohmann::json& obj, nlohmann::json status, const std::string& phase,
                          const std::string& reason, const std::string& message);
  Result<AgentAddress> find_agent(const std::string& node);
  int active_on_node(const std::string& node, const std::string& except_key) const;

  const ControllerConfig& config_;
  const std::string agent_namespace_;
  k8s::KubeClient& kube_;
  k8s::Informer& informer_;
  AgentClient& agents_;
  k8s::EventRecorder& events_;
  k8s::Informer* vmims_;
  std::map<std::string, std::chrono::steady_clock::time_point> unreachable_since_;
  std::map<std::string, std::chrono::steady_clock::time_point> ended_since_;  // vmi: waiting for figures
  // qemu: the first failure verdict of a migration whose other side is still being stopped
  // (kept in memory only: a controller restarted meanwhile judges afresh).
  std::map<std::string, Verdict> stopping_;
};

std::string object_path(const nlohmann::json& obj);
bool is_terminal_phase(const std::string& phase);

// When a finished object is to be deleted: status.completionTime plus spec.ttlSecondsAfterFinished
// (a non-negative integer), else plus `default_ttl_seconds`. nullopt when it has not finished
// (or has no readable completionTime).
std::optional<k8s::Clock::time_point> deletion_due(const nlohmann::json& obj, uint32_t default_ttl_seconds);
// A finished object the worker must look at again: it still holds the finalizer, or its
// deletion is due at `now`.
bool finished_needs_work(const nlohmann::json& obj, uint32_t default_ttl_seconds, k8s::Clock::time_point now);

// The nodes whose per-node slot a running (PreparingTarget, Migrating) qemu-kind object takes:
// those of the agents it was started on (status.sourceAgent/targetAgent), never what the spec
// says now. Empty for other objects.
std::vector<std::string> nodes_in_use(const nlohmann::json& obj);

}  // namespace rdmig::controller
