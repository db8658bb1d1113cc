// Reconciles RdmaPathCheck objects (docs/pathcheck.md) through the agents' /v1/pathchecks:
//   ""        resolve spec.targets to nodes (list, node label selector, or every agent's node),
//             add the finalizer, write status.pairs (each Pending) and phase Running
//   Running   start pairs, at most spec.maxConcurrentPairs at once (POST role=target on the
//             target's agent, then role=source on the source's agent, one check id for both),
//             poll the running ones on the source agent, and write each pair's figures as it
//             ends; a pair that cannot start fails with the cause (no agent pod, agent refused)
//   Succeeded (no pair failed) / Failed, with summary counts, conditions and Events
// Deletion cancels the pairs still running on both agents, then drops the finalizer; a finished
// object is deleted spec.ttlSecondsAfterFinished after status.completionTime (unset: kept).
// Called from its worker's thread only.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "controller/agent_client.h"
#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/reconciler.h"
#include "k8s/events.h"
#include "k8s/informer.h"
#include "k8s/kube_client.h"

namespace rdmig::controller {

inline constexpr size_t kMaxPathCheckPairs = 64;
inline constexpr uint64_t kDefaultPathCheckBytes = uint64_t{1} << 30;
inline constexpr uint64_t kMaxPathCheckBytes = uint64_t{64} << 30;
// status.pairs[].rails: an agent uses at most 16 rails (transport::kMaxRails), a pair at most 64
// channels; whatever a source agent's view holds beyond that is dropped.
inline constexpr size_t kMaxPathCheckRails = 16;
inline constexpr size_t kMaxPathCheckRailChannels = 64;

std::string pathcheck_path(const nlohmann::json& obj);

// The pair figures and the summary (counts and the worst pair) of a status.pairs list.
nlohmann::json pathcheck_summary(const nlohmann::json& pairs);
// A pair's phase from the source agent's view of its check: Passed, FellBack (every byte
// carried, over TCP where `transport` auto could have used RDMA), Failed; "" while it runs.
std::string pair_phase_of(const nlohmann::json& agent_view, const std::string& transport);
// One end's RDMA port (device, port, gid, gidIndex, gidType, netdev, mtu) from an agent's view
// (localRdma, peerRdma), bounded as the CRD's schema bounds it: strings cut to 64 characters,
// numbers clamped, other keys dropped; null unless an object.
nlohmann::json pathcheck_rdma_end(const nlohmann::json& end);
// status.pairs[].rails from the source agent's view of its check: each rail the channels used
// (rail, channels, bytes, sourceRdma, targetRdma), one per rail index (the first listed), at most
// kMaxPathCheckRails; empty over TCP.
nlohmann::json pathcheck_rails(const nlohmann::json& agent_view);

class PathCheckReconciler final : public ObjectReconciler {
 public:
  PathCheckReconciler(const ControllerConfig& config, std::string agent_namespace, k8s::KubeClient& kube,
                      k8s::Informer& informer, AgentClient& agents, k8s::EventRecorder& events,
                      ControllerMetrics& metrics);
  Result<Next> reconcile(const std::string& key) override;
  bool needs_poll(const nlohmann::json& obj) const override;

 private:
  Result<Next> begin(nlohmann::json obj);
  Result<Next> run(nlohmann::json obj);
  Result<Next> finalize(nlohmann::json obj);
  Result<Next> finished(nlohmann::json obj);
  // Starts one pair; false with pair["error"] set when it could not start.
  bool start_pair(const nlohmann::json& obj, nlohmann::json& pair);
  // Polls one running pair and fills it in when it ended.
  void poll_pair(const nlohmann::json& obj, nlohmann::json& pair);
  void cancel_pair(const nlohmann::json& obj, const nlohmann::json& pair);
  Result<std::vector<std::string>> resolve_targets(const nlohmann::json& spec, const std::string& source);
  Result<nlohmann::json> write_status(const nlohmann::json& obj, nlohmann::json status);
  Result<nlohmann::json> set_finalizer(const nlohmann::json& obj, bool present);
  Result<Next> fail_invalid(const nlohmann::json& obj, const std::string& message);

  const ControllerConfig& config_;
  const std::string agent_namespace_;
  k8s::KubeClient& kube_;
  k8s::Informer& informer_;
  AgentClient& agents_;
  k8s::EventRecorder& events_;
  ControllerMetrics& metrics_;
};

}  // namespace rdmig::controller
