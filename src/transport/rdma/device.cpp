#include "transport/rdma/device.h"

#include <ifaddrs.h>
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <net/if.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "transport/rdma/verbs.h"

extern char** environ;

namespace rdmig::transport::rdma {

namespace fs = std::filesystem;

namespace {

std::string read_first_line(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  if (in) std::getline(in, line);
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

std::vector<std::string> list_dir(const fs::path& p) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(p, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string upper_env_name(const std::string& s) {
  std::string out;
  for (char c : s) out.push_back((c >= 'a' && c <= 'z') ? static_cast<char>(c - 32) : (c == '.' || c == '/' || c == '-') ? '_' : c);
  return out;
}

}  // namespace

std::vector<std::string> SysfsView::netdevs_of(const std::string& device) const {
  const fs::path dev = fs::path(root) / "class/infiniband" / device;
  std::vector<std::string> out;
  // RoCE ports name their netdev in the GID table (works for rxe and for VFs).
  for (const auto& port : list_dir(dev / "ports")) {
    const auto nd = read_first_line(dev / "ports" / port / "gid_attrs/ndevs/0");
    if (!nd.empty() && std::find(out.begin(), out.end(), nd) == out.end()) out.push_back(nd);
  }
  for (const auto& nd : list_dir(dev / "device/net")) {
    if (std::find(out.begin(), out.end(), nd) == out.end()) out.push_back(nd);
  }
  if (const auto parent = read_first_line(dev / "parent"); !parent.empty()) {
    if (std::find(out.begin(), out.end(), parent) == out.end()) out.push_back(parent);
  }
  return out;
}

std::vector<std::string> SysfsView::devices_of_pci(const std::string& pci) const {
  return list_dir(fs::path(root) / "bus/pci/devices" / pci / "infiniband");
}

std::vector<std::string> SysfsView::devices() const { return list_dir(fs::path(root) / "class/infiniband"); }

std::string netdev_ip(const std::string& netdev) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string v4, v6;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || netdev != a->ifa_name) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET && v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
      v4 = buf;
    } else if (a->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      auto* s6 = reinterpret_cast<sockaddr_in6*>(a->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&s6->sin6_addr)) continue;
      inet_ntop(AF_INET6, &s6->sin6_addr, buf, sizeof buf);
      v6 = buf;
    }
  }
  freeifaddrs(list);
  return v4.empty() ? v6 : v4;
}

std::map<std::string, std::string> process_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

Result<RdmaDevice> select_device(const RdmaConfig& config, const std::map<std::string, std::string>& env,
                                 const SysfsView& sysfs, std::string (*ip_of)(const std::string&)) {
  auto finish = [&](const std::string& device, std::string netdev, const std::string& how,
                    const std::string& key) -> Result<RdmaDevice> {
    if (netdev.empty()) {
      auto nds = sysfs.netdevs_of(device);
      if (nds.empty()) {
        return Error{Errc::kUnavailable, key + ": RDMA device '" + device + "' has no network interface in sysfs"};
      }
      netdev = nds.front();
    }
    const std::string ip = ip_of(netdev);
    if (ip.empty()) {
      return Error{Errc::kUnavailable, key + ": interface '" + netdev + "' of RDMA device '" + device +
                                           "' has no IP address for rdma_cm"};
    }
    return RdmaDevice{device, netdev, ip, how};
  };

  if (!config.device.empty()) {
    const auto all = sysfs.devices();
    if (std::find(all.begin(), all.end(), config.device) == all.end()) {
      return Error{Errc::kUnavailable, "config key 'rdma.device': no RDMA device '" + config.device + "'"};
    }
    return finish(config.device, config.netdev, "config rdma.device", "config key 'rdma.device'");
  }
  if (!config.netdev.empty()) {
    for (const auto& dev : sysfs.devices()) {
      const auto nds = sysfs.netdevs_of(dev);
      if (std::find(nds.begin(), nds.end(), config.netdev) != nds.end()) {
        return finish(dev, config.netdev, "config rdma.netdev", "config key 'rdma.netdev'");
      }
    }
    return Error{Errc::kUnavailable, "config key 'rdma.netdev': no RDMA device on interface '" + config.netdev + "'"};
  }
  if (!config.resource_env.empty()) {
    const std::string key = "config key 'rdma.resourceEnv'";
    std::string var = config.resource_env;
    if (var.rfind("PCIDEVICE_", 0) != 0) var = "PCIDEVICE_" + upper_env_name(var);
    auto it = env.find(var);
    if (it == env.end() || it->second.empty()) {
      return Error{Errc::kUnavailable, key + ": environment variable " + var +
                                           " is not set (is the SR-IOV resource requested in the pod spec?)"};
    }
    std::vector<std::string> pcis;
    size_t start = 0;
    while (start <= it->second.size()) {
      const auto comma = it->second.find(',', start);
      const auto item = it->second.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!item.empty()) pcis.push_back(item);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    // The device plugin's _INFO names the RDMA device per PCI address when it knows it.
    if (auto info = env.find(var + "_INFO"); info != env.end()) {
      auto j = nlohmann::json::parse(info->second, nullptr, false);
      if (j.is_object()) {
        for (const auto& pci : pcis) {
          auto e = j.find(pci);
          if (e == j.end() || !e->is_object()) continue;
          auto r = e->find("rdma");
          if (r != e->end() && r->is_object() && r->contains("rdma_dev") && (*r)["rdma_dev"].is_string()) {
            return finish((*r)["rdma_dev"].get<std::string>(), "", var + "_INFO rdma_dev of " + pci, key);
          }
        }
      }
    }
    for (const auto& pci : pcis) {
      auto devs = sysfs.devices_of_pci(pci);
      if (!devs.empty()) return finish(devs.front(), "", var + " PCI " + pci, key);
    }
    return Error{Errc::kUnavailable, key + ": no RDMA device under the PCI addresses in " + var + " (" + it->second + ")"};
  }
  for (const auto& dev : sysfs.devices()) {
    for (const auto& nd : sysfs.netdevs_of(dev)) {
      if (!ip_of(nd).empty()) return finish(dev, nd, "first device with an IP address", "rdma");
    }
  }
  return Error{Errc::kUnavailable, "no RDMA device with an IP address on this node"};
}

int count_usable_devices() {
  int n = 0;
  DeviceListPtr list(ibv_get_device_list(&n));
  if (!list) return 0;
  int usable = 0;
  for (int i = 0; i < n; ++i) {
    ContextPtr ctx(ibv_open_device(list.get()[i]));
    if (!ctx) continue;
    ibv_port_attr port{};
    if (ibv_query_port(ctx.get(), 1, &port) == 0 && port.state == IBV_PORT_ACTIVE) ++usable;
  }
  return usable;
}

}  // namespace rdmig::transport::rdma
