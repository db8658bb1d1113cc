// Peers from the Kubernetes API (kubevirt.discovery: kubernetes): the rdmig agent pods give
// node -> agent data plane (the pod IP, which is the node's on the host network; the DaemonSet's dataPlane.port);
// the virt-handler pods give node -> handler pod IPs (static mode's redirect set). A thread
// lists both every discoveryIntervalSeconds and replaces the directory's peers (health kept).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "config/agent_config.h"
#include "k8s/cluster_config.h"
#include "kubevirt/hook/handler_identity.h"
#include "kubevirt/peers/peers.h"

namespace rdmig::k8s {
class KubeClient;
}

namespace rdmig::kubevirt {

// Pure: peers from the two pod lists (PodList JSON). Pods not Running, without a node or an
// IP, and this agent's own node are left out.
std::vector<KubevirtPeer> peers_from_pods(const nlohmann::json& agent_pods, const nlohmann::json& handler_pods,
                                          uint16_t data_port, const std::string& self_node);
// The UIDs of the running virt-handler pods on `node` (what HandlerIdentity trusts).
std::set<std::string> handler_pod_uids(const nlohmann::json& handler_pods, const std::string& node);
// The running launcher pods on `node` (label kubevirt.io=virt-launcher) by "<namespace>/<VMI
// UID>" (their kubevirt.io/created-by label): what LauncherIdentity trusts.
std::map<std::string, std::set<std::string>> launcher_pod_uids(const nlohmann::json& launcher_pods,
                                                               const std::string& node);

// How the agent reaches the API server (kubevirt.kubeconfig, else the pod's service account).
Result<k8s::ClusterConfig> agent_cluster_config(const KubevirtConfig& kv);

class PeerDiscovery {
 public:
  // Keeps `peers`, this node's virt-handler pods in `handlers` and its launcher pods in
  // `launchers` up to date.
  static Result<std::unique_ptr<PeerDiscovery>> start(const AgentConfig& config, const std::string& self_node,
                                                      PeerDirectory& peers, HandlerIdentity& handlers,
                                                      LauncherIdentity& launchers);
  ~PeerDiscovery();
  // One listing now (also what the thread does each interval).
  Status refresh();

 private:
  PeerDiscovery(const AgentConfig& config, std::string self_node, PeerDirectory& peers, HandlerIdentity& handlers,
                LauncherIdentity& launchers, std::unique_ptr<k8s::KubeClient> kube, std::string ns);
  void loop();

  const AgentConfig& config_;
  std::string self_node_;
  PeerDirectory& peers_;
  HandlerIdentity& handlers_;
  LauncherIdentity& launchers_;
  std::unique_ptr<k8s::KubeClient> kube_;
  std::string namespace_;
  // Guards stop_ alone; cv_ wakes thread_ for it. loop() (thread_) waits under it and releases
  // it for each refresh(), so no listing, and none of the directories' locks, runs under it;
  // the destructor sets stop_ under it.
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace rdmig::kubevirt
