#include "kubevirt/peers/peer_discovery.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>

#include "common/log.h"
#include "common/net.h"
#include "k8s/cluster_config.h"
#include "k8s/http_kube_client.h"
#include "k8s/selectors.h"

namespace rdmig::kubevirt {

using nlohmann::json;

namespace {
std::string str_at(const json& obj, const char* a, const char* b) {
  auto i = obj.find(a);
  if (i == obj.end() || !i->is_object()) return "";
  auto j = i->find(b);
  return j != i->end() && j->is_string() ? j->get<std::string>() : "";
}
const json& items_of(const json& list) {
  static const json empty = json::array();
  auto it = list.find("items");
  return it != list.end() && it->is_array() ? *it : empty;
}
std::string env(const char* k) {
  const char* v = std::getenv(k);
  return v ? v : "";
}
}  // namespace

std::vector<KubevirtPeer> peers_from_pods(const json& agent_pods, const json& handler_pods, uint16_t data_port,
                                          const std::string& self_node) {
  std::map<std::string, KubevirtPeer> by_node;
  for (const auto& pod : items_of(agent_pods)) {
    const std::string node = str_at(pod, "spec", "nodeName");
    // The pod IP: the node's address for an agent on the host network, the pod's own on the pod
    // network (Multus mode, docs/deploy.md), where the node's address would reach nothing.
    std::string ip = str_at(pod, "status", "podIP");
    if (ip.empty()) ip = str_at(pod, "status", "hostIP");
    if (node.empty() || ip.empty() || node == self_node || str_at(pod, "status", "phase") != "Running") continue;
    by_node[node] = KubevirtPeer{node, net::format_endpoint(ip, data_port), {}};
  }
  for (const auto& pod : items_of(handler_pods)) {
    const std::string node = str_at(pod, "spec", "nodeName");
    auto it = by_node.find(node);
    if (it == by_node.end() || str_at(pod, "status", "phase") != "Running") continue;
    // status.podIPs (dual stack) when present, else status.podIP.
    const json status = pod.value("status", json::object());
    const json ips = status.is_object() ? status.value("podIPs", json::array()) : json::array();
    bool any = false;
    for (const auto& e : ips.is_array() ? ips : json::array()) {
      if (e.is_object() && e.contains("ip") && e["ip"].is_string()) {
        it->second.handler_addresses.push_back(e["ip"].get<std::string>());
        any = true;
      }
    }
    if (!any) {
      if (auto ip = str_at(pod, "status", "podIP"); !ip.empty()) it->second.handler_addresses.push_back(ip);
    }
  }
  std::vector<KubevirtPeer> out;
  for (auto& [node, p] : by_node) out.push_back(std::move(p));
  return out;
}

std::set<std::string> handler_pod_uids(const json& handler_pods, const std::string& node) {
  std::set<std::string> out;
  for (const auto& pod : items_of(handler_pods)) {
    if (str_at(pod, "spec", "nodeName") != node || str_at(pod, "status", "phase") != "Running") continue;
    std::string uid = str_at(pod, "metadata", "uid");
    std::transform(uid.begin(), uid.end(), uid.begin(), [](unsigned char c) { return std::tolower(c); });
    if (!uid.empty()) out.insert(uid);
  }
  return out;
}

std::map<std::string, std::set<std::string>> launcher_pod_uids(const json& launcher_pods, const std::string& node) {
  std::map<std::string, std::set<std::string>> out;
  for (const auto& pod : items_of(launcher_pods)) {
    if (str_at(pod, "spec", "nodeName") != node || str_at(pod, "status", "phase") != "Running") continue;
    auto label = [&](const std::string& key) -> std::string {
      auto m = pod.find("metadata");
      if (m == pod.end() || !m->is_object()) return "";
      auto l = m->find("labels");
      if (l == m->end() || !l->is_object()) return "";
      auto v = l->find(key);
      return v != l->end() && v->is_string() ? v->get<std::string>() : "";
    };
    if (label("kubevirt.io") != "virt-launcher") continue;
    const std::string vmi = label(LauncherIdentity::kCreatedByLabel);
    const std::string ns = str_at(pod, "metadata", "namespace");
    const std::string uid = str_at(pod, "metadata", "uid");
    if (vmi.empty() || ns.empty() || uid.empty()) continue;
    std::string lower = uid;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    out[ns + "/" + vmi].insert(lower);
  }
  return out;
}

Result<k8s::ClusterConfig> agent_cluster_config(const KubevirtConfig& kv) {
  std::map<std::string, std::string> environment;
  for (const char* k : {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}) environment[k] = env(k);
  auto cluster = kv.kubeconfig.empty()
                     ? k8s::in_cluster_config(environment, "/var/run/secrets/kubernetes.io/serviceaccount")
                     : k8s::load_kubeconfig_file(kv.kubeconfig);
  if (!cluster) return cluster.error().with_context("config key 'kubevirt.discovery' kubernetes");
  return cluster;
}

PeerDiscovery::PeerDiscovery(const AgentConfig& config, std::string self_node, PeerDirectory& peers,
                             HandlerIdentity& handlers, LauncherIdentity& launchers,
                             std::unique_ptr<k8s::KubeClient> kube, std::string ns)
    : config_(config), self_node_(std::move(self_node)), peers_(peers), handlers_(handlers), launchers_(launchers),
      kube_(std::move(kube)), namespace_(std::move(ns)) {}

Result<std::unique_ptr<PeerDiscovery>> PeerDiscovery::start(const AgentConfig& config, const std::string& self_node,
                                                            PeerDirectory& peers, HandlerIdentity& handlers,
                                                            LauncherIdentity& launchers) {
  const auto& kv = config.kubevirt;
  for (const auto* sel : {&kv.agent_selector, &kv.handler_selector}) {
    auto parsed = k8s::parse_label_selector(*sel, "config key 'kubevirt.agentSelector/handlerSelector'");
    if (!parsed) return parsed.error();
  }
  auto cluster = agent_cluster_config(kv);
  if (!cluster) return cluster.error();
  std::string ns = kv.agent_namespace;
  if (ns.empty()) ns = env("POD_NAMESPACE");
  if (ns.empty()) ns = cluster->namespace_;
  if (ns.empty()) return Error{Errc::kInvalidArgument, "config key 'kubevirt.agentNamespace': unknown namespace"};
  k8s::HttpOptions opts;
  opts.user_agent = "rdmig-agent/" + self_node;
  auto kube = k8s::HttpKubeClient::create(cluster.value(), opts);
  if (!kube) return kube.error();
  std::unique_ptr<PeerDiscovery> d(new PeerDiscovery(config, self_node, peers, handlers, launchers, std::move(kube.value()), ns));
  if (auto st = d->refresh(); !st) {
    LOG_WARN("kubevirt") << "peer discovery: " << st.error().message << " (retrying every "
                         << kv.discovery_interval_seconds << " s)";
  }
  d->thread_ = std::thread([p = d.get()] { p->loop(); });
  return d;
}

PeerDiscovery::~PeerDiscovery() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status PeerDiscovery::refresh() {
  const auto& kv = config_.kubevirt;
  auto agents = kube_->get("/api/v1/namespaces/" + k8s::url_encode(namespace_) +
                           "/pods?labelSelector=" + k8s::url_encode(kv.agent_selector));
  if (!agents) return agents.error().with_context("listing the rdmig agent pods");
  // The virt-handler pods: this node's are the only processes the agent trusts as virt-handler
  // (HandlerIdentity); static mode also redirects to the others' addresses.
  auto h = kube_->get("/api/v1/namespaces/" + k8s::url_encode(kv.handler_namespace) +
                      "/pods?labelSelector=" + k8s::url_encode(kv.handler_selector));
  json handlers = json::object();
  if (h) {
    handlers = h.value();
    handlers_.set_pods(handler_pod_uids(handlers, self_node_));
  } else if (kv.static_mode) {
    return h.error().with_context("listing the virt-handler pods");
  } else {
    // No pods known: no process is trusted as virt-handler (nothing is carried) until a
    // listing succeeds; the peers are still kept up to date.
    LOG_WARN("kubevirt") << "listing the virt-handler pods: " << h.error().message;
  }
  // This node's launcher pods, in every namespace (a VMI's launcher runs in the VMI's own): the
  // only processes whose libvirt the agent opens. On a failed listing the last one stays.
  auto l = kube_->get("/api/v1/pods?labelSelector=" + k8s::url_encode(LauncherIdentity::kPodSelector) +
                      "&fieldSelector=" + k8s::url_encode("spec.nodeName=" + self_node_));
  if (l) {
    launchers_.set_pods(launcher_pod_uids(l.value(), self_node_));
  } else {
    LOG_WARN("kubevirt") << "listing the virt-launcher pods: " << l.error().message;
  }
  auto found = peers_from_pods(agents.value(), kv.static_mode ? handlers : json::object(), config_.data_plane.port,
                               self_node_);
  LOG_DEBUG("kubevirt") << "peer discovery: " << found.size() << " peer agent(s)";
  return peers_.replace(found);
}

void PeerDiscovery::loop() {
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::seconds(config_.kubevirt.discovery_interval_seconds), [&] { return stop_; })) {
    lock.unlock();
    if (auto st = refresh(); !st) {
      LOG_WARN("kubevirt") << "peer discovery: " << st.error().message;
    }
    lock.lock();
  }
}

}  // namespace rdmig::kubevirt
