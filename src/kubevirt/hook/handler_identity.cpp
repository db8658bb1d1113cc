#include "kubevirt/hook/handler_identity.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "kubevirt/intercept/netns.h"

namespace rdmig::kubevirt {

std::string pod_uid_in_cgroup(const std::string& text) {
  // A UID is 36 characters: 8-4-4-4-12 hex digits, joined by '-' (cgroupfs) or '_' (systemd).
  auto is_uid = [](const std::string& s) {
    if (s.size() != 36) return false;
    for (size_t i = 0; i < s.size(); ++i) {
      const bool sep = i == 8 || i == 13 || i == 18 || i == 23;
      if (sep ? (s[i] != '-' && s[i] != '_') : !std::isxdigit(static_cast<unsigned char>(s[i]))) return false;
    }
    return true;
  };
  for (size_t at = text.find("pod"); at != std::string::npos; at = text.find("pod", at + 3)) {
    std::string uid = text.substr(at + 3, 36);
    if (!is_uid(uid)) continue;
    std::replace(uid.begin(), uid.end(), '_', '-');
    std::transform(uid.begin(), uid.end(), uid.begin(), [](unsigned char c) { return std::tolower(c); });
    return uid;
  }
  return "";
}

std::string pod_uid_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/cgroup");
  std::stringstream ss;
  ss << f.rdbuf();
  return pod_uid_in_cgroup(ss.str());
}

void HandlerIdentity::set_pods(std::set<std::string> uids) {
  std::lock_guard lock(mu_);
  pods_ = std::move(uids);
}

bool HandlerIdentity::by_pod() const {
  std::lock_guard lock(mu_);
  return pods_.has_value();
}

std::optional<std::string> HandlerIdentity::refuse(pid_t pid) const {
  std::ifstream f("/proc/" + std::to_string(pid) + "/comm");
  std::string comm;
  std::getline(f, comm);
  if (comm != comm_) return "process " + std::to_string(pid) + " is '" + comm + "', not " + comm_;
  std::lock_guard lock(mu_);
  if (!pods_) return std::nullopt;
  const std::string uid = pod_uid_of(pid);
  if (uid.empty()) return "process " + std::to_string(pid) + " (" + comm_ + ") runs in no pod";
  if (!pods_->contains(uid)) {
    return "process " + std::to_string(pid) + " (" + comm_ + ") runs in pod " + uid + ", which is not one of this node's " +
           comm_ + " pods (" + std::to_string(pods_->size()) + " known)";
  }
  return std::nullopt;
}

std::vector<pid_t> HandlerIdentity::pids() const {
  std::vector<pid_t> out;
  for (pid_t pid : processes_named(comm_)) {
    if (!refuse(pid)) out.push_back(pid);
  }
  return out;
}

void LauncherIdentity::set_pods(std::map<std::string, std::set<std::string>> pods) {
  std::lock_guard lock(mu_);
  pods_ = std::move(pods);
}

std::optional<std::string> LauncherIdentity::refuse(pid_t pid, const std::string& vmi_namespace,
                                                    const std::string& vmi_uid) const {
  std::lock_guard lock(mu_);
  if (!pods_) return std::nullopt;
  const std::string uid = pod_uid_of(pid);
  const std::string who = "process " + std::to_string(pid);
  if (uid.empty()) return who + " runs in no pod";
  auto it = pods_->find(vmi_namespace + "/" + vmi_uid);
  if (it == pods_->end() || !it->second.contains(uid)) {
    return who + " runs in pod " + uid + ", which is not a launcher pod of VMI " + vmi_uid + " in " + vmi_namespace +
           " on this node (" + std::to_string(it == pods_->end() ? 0 : it->second.size()) + " known)";
  }
  return std::nullopt;
}

}  // namespace rdmig::kubevirt
