// Which processes on this node are KubeVirt's virt-handler. A process name alone proves
// nothing (any pod can call itself virt-handler), and the agent enters that process's network
// namespace, installs rules there and dials from it. With peer discovery from the Kubernetes
// API the agent knows this node's virt-handler pods (namespace kubevirt.handlerNamespace,
// selector kubevirt.handlerSelector, spec.nodeName = this node): a process then counts only
// when its name matches and its cgroup places it in one of those pods (the pod UID in
// /proc/<pid>/cgroup, as the kubelet names pod cgroups with the cgroupfs or systemd driver).
// Without the API (discovery static) the name is all there is; docs/security.md says so.
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace rdmig::kubevirt {

// The pod UID in a /proc/<pid>/cgroup text ("...pod<uid>..." with dashes, or with
// underscores under the systemd driver), lower case with dashes; empty when none.
std::string pod_uid_in_cgroup(const std::string& cgroup_text);
std::string pod_uid_of(pid_t pid);

class HandlerIdentity {
 public:
  // `by_pod`: trust a process only inside a known virt-handler pod (none known until set_pods).
  HandlerIdentity(std::string comm, bool by_pod) : comm_(std::move(comm)) {
    if (by_pod) pods_.emplace();
  }
  // This node's virt-handler pod UIDs, from the API.
  void set_pods(std::set<std::string> uids);
  bool by_pod() const;
  // The virt-handler processes on this node (by name, and by pod when by_pod()).
  std::vector<pid_t> pids() const;
  // Why `pid` is not virt-handler, or nullopt when it is.
  std::optional<std::string> refuse(pid_t pid) const;
  const std::string& comm() const { return comm_; }

 private:
  const std::string comm_;
  // Guards pods_ alone: PeerDiscovery's thread replaces it (set_pods); hook calls and the
  // relay's threads read it (refuse, by_pod, pids). refuse() holds it while it reads the
  // process's /proc cgroup. No other lock is taken under it.
  mutable std::mutex mu_;
  std::optional<std::set<std::string>> pods_;
};

// Which processes are the launcher of a VMI (the agent opens libvirt connections into their
// root, reads the figures it reports and aborts jobs there). `--uid <vmiUID>` in a command line
// proves nothing: any pod can start such a process. With the API the agent knows this node's
// launcher pods, labelled as KubeVirt labels them (kubevirt.io=virt-launcher,
// kubevirt.io/created-by=<VMI UID>, in the VMI's namespace): a process then counts only when
// its cgroup places it in one of the VMI's. Without the API (discovery static) the command
// line is all there is; docs/security.md says so.
class LauncherIdentity {
 public:
  inline static const std::string kPodSelector = "kubevirt.io=virt-launcher";
  inline static const std::string kCreatedByLabel = "kubevirt.io/created-by";
  // `by_pod`: trust a process only inside a known launcher pod of the VMI (none until set_pods).
  explicit LauncherIdentity(bool by_pod) {
    if (by_pod) pods_.emplace();
  }
  // This node's launcher pod UIDs by "<VMI namespace>/<VMI UID>", from the API.
  void set_pods(std::map<std::string, std::set<std::string>> pods);
  // Why `pid` is not a launcher of the VMI (namespace, UID), or nullopt when it is.
  std::optional<std::string> refuse(pid_t pid, const std::string& vmi_namespace, const std::string& vmi_uid) const;

 private:
  // Guards pods_ alone: PeerDiscovery's thread replaces it (set_pods); the relay's workers
  // that open libvirt connections read it (refuse, via libvirt_stats), holding it while they
  // read the process's /proc cgroup. No other lock is taken under it.
  mutable std::mutex mu_;
  std::optional<std::map<std::string, std::set<std::string>>> pods_;
};

}  // namespace rdmig::kubevirt
