// The VMI as the Kubernetes API has it (kubevirt.discovery: kubernetes). Whatever names a
// migration to the agent — the hook caller's VMI document on the source, a session hello on
// the target — is a claim; the API's VirtualMachineInstance (kubevirt.io/v1, verb get) is what
// KubeVirt itself published. The agent arms, and dials, only what the API confirms:
//   source: the hook document's UID and migrationUid must be the API's, and so must the target
//     node, address and carried ports; the API's values are the ones armed.
//   target: a session dials only targetNodeAddress:port for a memory or block port of the API's
//     targetDirectMigrationNodePorts, for the session's migrationUid, when targetNode is this node.
// Every call is bounded (kVmiApiTimeout); an error means "not carried", never a failed migration.
// Without the API (discovery static) none of this runs: docs/security.md says what that leaves.
#pragma once

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "common/result.h"
#include "config/agent_config.h"
#include "kubevirt/hook/vmi.h"

namespace rdmig::k8s {
class KubeClient;
}

namespace rdmig::kubevirt {

// Each GET, connect and read alike: the hook answers within about a second, and the target's
// look-up runs inside the source's 800 ms session set-up.
inline constexpr std::chrono::milliseconds kVmiApiTimeout{400};

class VmiApi {
 public:
  // An API client from kubevirt.kubeconfig (else the service account), calls bounded by `timeout`.
  static Result<std::unique_ptr<VmiApi>> create(const KubevirtConfig& config, const std::string& self_node,
                                                std::chrono::milliseconds timeout = kVmiApiTimeout);
  explicit VmiApi(std::unique_ptr<k8s::KubeClient> kube);
  ~VmiApi();
  // GET /apis/kubevirt.io/v1/namespaces/<ns>/virtualmachineinstances/<name>. kNotFound when the
  // VMI is gone; other errors name the call.
  Result<nlohmann::json> get(const VmiRef& vmi) const;

 private:
  std::unique_ptr<k8s::KubeClient> kube_;
};

// Source: the migration as the API has it, when the hook caller's document agrees with it on
// the VMI's UID, the migrationUid, the target node and address and the carried ports; an error
// naming the first difference otherwise.
Result<MigrationIntent> confirm_hook_document(const MigrationIntent& caller, const nlohmann::json& api_vmi);

// Target: what a session for (vmi, migration_uid) may dial on `this_node`, from the API's VMI.
struct PublishedTarget {
  std::string address;          // targetNodeAddress
  std::set<uint16_t> ports;     // its memory and block ports (targetDirectMigrationNodePorts)
  std::string describe() const;  // "10.0.0.2:[41000,41001]"
  bool allows(const std::string& host, uint16_t port) const;
};
// `source_node`: the session's sourceNode, which must be the API's migrationState.sourceNode
// (an error starting "hello.sourceNode" otherwise).
Result<PublishedTarget> published_target(const nlohmann::json& api_vmi, const VmiRef& vmi,
                                         const std::string& migration_uid, const std::string& this_node,
                                         const std::string& source_node);

// Two IP literals name the same address (IPv6 spellings differ: "::1" and "0::1").
bool same_address(const std::string& a, const std::string& b);

}  // namespace rdmig::kubevirt
