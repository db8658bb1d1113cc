// KubevirtObserver: reports every KubeVirt migration on the cluster, whether an RdmaMigration
// started it or not (virtctl migrate, node drains, workload updates). From the
// VirtualMachineInstanceMigration cache it records, for VMIMs that no RdmaMigration owns, an
// Event on the VMI when the migration starts and when it ends (with rdmig's figures and
// whether rdmig carried it), and for every VMIM the rdmig_controller_vmi_* metrics by VMI
// namespace/name. Series of a VMI go when no VMIM of it is left in the cache (KubeVirt garbage
// collects old VMIMs) or when more than kubevirt.maxReportedVmis VMIs have series.
//
// Called from the worker thread only, while this replica leads.
#pragma once

#include <chrono>
#include <map>
#include <string>

#include "controller/agent_client.h"
#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "k8s/events.h"
#include "k8s/informer.h"
#include "k8s/kube_client.h"

namespace rdmig::controller {

class KubevirtObserver {
 public:
  KubevirtObserver(const ControllerConfig& config, std::string agent_namespace, k8s::KubeClient& kube,
                   k8s::Informer& vmims, AgentClient& agents, k8s::EventRecorder& events, ControllerMetrics& metrics);

  void observe_all();

 private:
  struct Seen {
    std::string ns, vmi;
    bool owned = false;       // by an RdmaMigration: its Events go on that object instead
    bool started = false;     // start reported
    bool ended = false;       // end reported
    std::chrono::steady_clock::time_point ended_at{};  // first seen terminal (figures wait)
  };
  void observe(const nlohmann::json& vmim, Seen& seen);
  nlohmann::json vmi_or_stub(const std::string& ns, const std::string& name);

  const ControllerConfig& config_;
  const std::string agent_namespace_;
  k8s::KubeClient& kube_;
  k8s::Informer& vmims_;
  AgentClient& agents_;
  k8s::EventRecorder& events_;
  ControllerMetrics& metrics_;
  bool first_pass_ = true;
  std::map<std::string, Seen> seen_;  // by VMIM uid
};

}  // namespace rdmig::controller
