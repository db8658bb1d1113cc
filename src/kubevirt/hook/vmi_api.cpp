#include "kubevirt/hook/vmi_api.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

#include "common/net.h"
#include "k8s/http_kube_client.h"
#include "k8s/selectors.h"
#include "kubevirt/peers/peer_discovery.h"

namespace rdmig::kubevirt {

using nlohmann::json;

Result<std::unique_ptr<VmiApi>> VmiApi::create(const KubevirtConfig& config, const std::string& self_node,
                                               std::chrono::milliseconds timeout) {
  auto cluster = agent_cluster_config(config);
  if (!cluster) return cluster.error();
  k8s::HttpOptions opts;
  opts.user_agent = "rdmig-agent/" + self_node;
  opts.call_timeout = timeout;
  auto kube = k8s::HttpKubeClient::create(cluster.value(), opts);
  if (!kube) return kube.error();
  return std::make_unique<VmiApi>(std::move(kube.value()));
}

VmiApi::VmiApi(std::unique_ptr<k8s::KubeClient> kube) : kube_(std::move(kube)) {}
VmiApi::~VmiApi() = default;

Result<json> VmiApi::get(const VmiRef& vmi) const {
  auto got = kube_->get("/apis/kubevirt.io/v1/namespaces/" + k8s::url_encode(vmi.namespace_) +
                        "/virtualmachineinstances/" + k8s::url_encode(vmi.name));
  if (!got) return got.error().with_context("the API's VMI " + vmi.key());
  if (!got->is_object()) return Error{Errc::kProtocol, "the API's VMI " + vmi.key() + ": not an object"};
  return got;
}

namespace {
std::string ports_text(std::vector<uint16_t> ports) {
  std::sort(ports.begin(), ports.end());
  std::string out = "[";
  for (size_t i = 0; i < ports.size(); ++i) out += (i ? "," : "") + std::to_string(ports[i]);
  return out + "]";
}
}  // namespace

bool same_address(const std::string& a, const std::string& b) {
  unsigned char x[16]{}, y[16]{};
  if (::inet_pton(AF_INET, a.c_str(), x) == 1 && ::inet_pton(AF_INET, b.c_str(), y) == 1) {
    return std::memcmp(x, y, 4) == 0;
  }
  if (::inet_pton(AF_INET6, a.c_str(), x) == 1 && ::inet_pton(AF_INET6, b.c_str(), y) == 1) {
    return std::memcmp(x, y, 16) == 0;
  }
  return false;
}

Result<MigrationIntent> confirm_hook_document(const MigrationIntent& caller, const json& api_vmi) {
  auto api = parse_vmi(api_vmi);
  const std::string what = "the API's VMI " + caller.vmi.key();
  if (!api) return Error{Errc::kFailedPrecondition, what + ": " + api.error().message};
  auto differs = [&](const std::string& field, const std::string& theirs, const std::string& ours) {
    return Error{Errc::kFailedPrecondition, "the hook's VMI document does not match the API: " + field + " is '" +
                                                theirs + "' in the document, '" + ours + "' in the API"};
  };
  if (api->vmi.namespace_ != caller.vmi.namespace_ || api->vmi.name != caller.vmi.name) {
    return differs("metadata.namespace/name", caller.vmi.key(), api->vmi.key());
  }
  if (api->vmi.uid != caller.vmi.uid) return differs("metadata.uid", caller.vmi.uid, api->vmi.uid);
  if (api->migration_uid != caller.migration_uid) {
    return differs("migrationState.migrationUid", caller.migration_uid, api->migration_uid);
  }
  if (api->target_node != caller.target_node) {
    return differs("migrationState.targetNode", caller.target_node, api->target_node);
  }
  if (!same_address(api->target_address, caller.target_address) && api->target_address != caller.target_address) {
    return differs("migrationState.targetNodeAddress", caller.target_address, api->target_address);
  }
  const std::string theirs = ports_text(carried_ports(caller)), ours = ports_text(carried_ports(api.value()));
  if (theirs != ours) return differs("migrationState.targetDirectMigrationNodePorts (memory, block)", theirs, ours);
  return api;
}

std::string PublishedTarget::describe() const {
  return address + ":" + ports_text(std::vector<uint16_t>(ports.begin(), ports.end()));
}

bool PublishedTarget::allows(const std::string& host, uint16_t port) const {
  return ports.contains(port) && same_address(host, address);
}

Result<PublishedTarget> published_target(const json& api_vmi, const VmiRef& vmi, const std::string& migration_uid,
                                         const std::string& this_node, const std::string& source_node) {
  auto api = parse_vmi(api_vmi);
  const std::string what = "the API's VMI " + vmi.key();
  if (!api) return Error{Errc::kFailedPrecondition, what + ": " + api.error().message};
  auto refuse = [&](const std::string& why) { return Error{Errc::kFailedPrecondition, what + ": " + why}; };
  if (api->vmi.uid != vmi.uid) return refuse("metadata.uid is '" + api->vmi.uid + "', the session names '" + vmi.uid + "'");
  if (api->migration_uid != migration_uid) {
    return refuse("migrationState.migrationUid is '" + api->migration_uid + "', the session names '" + migration_uid +
                  "'");
  }
  if (this_node.empty() || api->target_node != this_node) {
    return refuse("migrationState.targetNode is '" + api->target_node + "', this agent runs on '" + this_node + "'");
  }
  if (api->source_node != source_node) {
    return Error{Errc::kFailedPrecondition, "hello.sourceNode: the session names '" + source_node + "', " + what +
                                                " has migrationState.sourceNode '" + api->source_node + "'"};
  }
  if (api->target_address.empty()) return refuse("no migrationState.targetNodeAddress published");
  if (auto st = net::check_unicast_literal(api->target_address, "targetNodeAddress"); !st) {
    return refuse(st.error().message);
  }
  PublishedTarget out;
  out.address = api->target_address;
  for (uint16_t p : carried_ports(api.value())) out.ports.insert(p);
  if (out.ports.empty()) return refuse("no memory or block port in migrationState.targetDirectMigrationNodePorts");
  return out;
}

}  // namespace rdmig::kubevirt
