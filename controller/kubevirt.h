// KubeVirt objects as the controller uses them (kubevirt.io/v1 VirtualMachineInstance and
// VirtualMachineInstanceMigration), finding the agent pod on a node, and looking up rdmig's
// own record of a KubeVirt migration on the agents (GET /v1/kubevirt/migrations).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/result.h"
#include "controller/agent_client.h"
#include "controller/config.h"
#include "k8s/kube_client.h"

namespace rdmig::controller {

inline constexpr const char* kKubevirtApi = "/apis/kubevirt.io/v1";

// `j` without null members, recursively: what KubeVirt and the agents send may carry nulls
// ("reason": null, "libvirt": null), which read as absent from here on.
nlohmann::json without_nulls(const nlohmann::json& j);

std::string vmi_path(const std::string& ns, const std::string& name);
std::string vmim_path(const std::string& ns, const std::string& name);
std::string vmim_collection(const std::string& watch_namespace);  // "" = all namespaces

// The VMIM rdmig creates for an RdmaMigration: name "rdmig-<name>", owner reference to it,
// spec.vmiName, spec.addedNodeSelector when given.
std::string vmim_name_for(const nlohmann::json& rdma_migration);
nlohmann::json vmim_for(const nlohmann::json& rdma_migration, const std::string& vmi_name,
                        const std::map<std::string, std::string>& node_selector);

// True when the VMIM's controller owner reference names an RdmaMigration (with that uid, if given).
bool owned_by_rdma_migration(const nlohmann::json& vmim, const std::string& uid = "");
// The work-queue key ("namespace/name") of the RdmaMigration a VMIM's owner references name; "" when none.
std::string rdma_migration_key_of(const nlohmann::json& vmim);
bool vmim_phase_terminal(const std::string& phase);
// The VMI's status.migrationState when it is about the VMIM with `migration_uid`, else null.
nlohmann::json migration_state_for(const nlohmann::json& vmi, const std::string& migration_uid);
// Why a VMI cannot be migrated now (missing is checked by the caller): "" when it can.
// reason_code gets the condition reason for the status (VMINotRunning, NotLiveMigratable, AlreadyMigrating).
std::string vmi_refusal(const nlohmann::json& vmi, std::string& reason_code);

// Finds the Ready agent pod on a node (pods in `agent_namespace` by the configured labels);
// select_agent_pod says what else it answers (kUnavailable: the node's agent drains).
Result<AgentAddress> locate_agent(k8s::KubeClient& kube, const ControllerConfig& config,
                                  const std::string& agent_namespace, const std::string& node,
                                  bool draining_ok = false);

struct KubevirtRecord {
  std::optional<nlohmann::json> item;  // rdmig's record, when an agent has one
  bool reachable = false;              // at least one agent answered
  std::vector<std::string> mode_off;   // nodes whose agent answered "KubeVirt mode is off"
  std::string where;                   // "agent P on node N" that answered with the record
  std::string problems;                // agents not found or not answering, for messages
};

// Asks the source node's agent, then the target's: the source has the whole picture at the
// end (the target sends it libvirt's figures). An agent answering 404 has no record.
KubevirtRecord lookup_kubevirt_record(k8s::KubeClient& kube, AgentClient& agents, const ControllerConfig& config,
                                      const std::string& agent_namespace, const std::string& source_node,
                                      const std::string& target_node, const std::string& migration_uid);

}  // namespace rdmig::controller

namespace rdmig::controller {

// Why no agent has a record of a finished KubeVirt migration, as exactly as the cluster tells:
// the source node's agent runs without KubeVirt mode (AgentNotInKubevirtMode), the cluster
// serves no Plugin API (PluginApiMissing), no Plugin registers a PreMigrationSource node hook
// (PluginMissing), KubeVirt's "Plugins" feature gate is off (PluginsGateOff), else
// NoAgentRecord. Returns {reason, message}: the message names every missing piece it found, each
// with how to turn it on; the reason is the first of them (the most fundamental, in that order).
std::pair<std::string, std::string> diagnose_not_carried(k8s::KubeClient& kube, const KubevirtRecord& rec,
                                                         const std::string& source_node,
                                                         const std::string& target_node,
                                                         const std::string& migration_uid);

}  // namespace rdmig::controller
