#include "transport/rdma/device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <infiniband/verbs.h>
#include <net/if.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "transport/rdma/verbs.h"
#include "common/text.h"

extern char** environ;

namespace rdmig::transport::rdma {

namespace {

// ", "-joined, "none" when empty.
std::string list_or_none(const std::vector<std::string>& items) {
  return items.empty() ? "none" : join(items);
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const auto comma = text.find(',', start);
    auto item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(std::move(item));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// Selection gets as far as it can; the furthest failure is the one reported.
struct Progress {
  int stage = 0;  // 0 no device, 1 no address, 2 no GID
  std::string reason = kNoDevice;
  std::string message;
  void at(int s, const char* r, std::string m) {
    if (s < stage || (s == stage && !message.empty())) return;
    stage = s;
    reason = r;
    message = std::move(m);
  }
};

struct Candidates {
  std::vector<std::string> devices;
  std::string how;
  std::string key;  // config key named in errors
};

}  // namespace

std::string device_plugin_variable(const std::string& resource) {
  if (resource.rfind("PCIDEVICE_", 0) == 0) return resource;
  std::string out = "PCIDEVICE_";
  for (char c : resource) {
    out.push_back((c >= 'a' && c <= 'z') ? static_cast<char>(c - 32) : (c == '.' || c == '/' || c == '-') ? '_' : c);
  }
  return out;
}

std::vector<std::string> netdev_addresses(const std::string& netdev) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return {};
  std::vector<std::string> v4, v6;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || netdev != a->ifa_name) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
      v4.emplace_back(buf);
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      auto* s6 = reinterpret_cast<sockaddr_in6*>(a->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&s6->sin6_addr)) continue;  // rdma_cm would need a scope id
      inet_ntop(AF_INET6, &s6->sin6_addr, buf, sizeof buf);
      v6.emplace_back(buf);
    }
  }
  freeifaddrs(list);
  v4.insert(v4.end(), v6.begin(), v6.end());
  return v4;
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

Selection select_device(const RdmaOptions& options, const std::map<std::string, std::string>& env,
                        const SysfsView& sysfs, const AddressLookup& addresses_of) {
  Selection out;
  auto fail = [&](const std::string& reason, const std::string& message) {
    out.reason = reason;
    out.error = Error{Errc::kUnavailable, message};
    return out;
  };
  const auto all = sysfs.devices();

  // 1. Candidate devices.
  // The config key an error names, or where the values came from (a Multus network's entry).
  const auto key = [&](const char* name) {
    return options.origin.empty() ? "config key '" + options.key + "." + name + "'" : options.origin;
  };
  Candidates c;
  if (!options.device.empty()) {
    if (std::find(all.begin(), all.end(), options.device) == all.end()) {
      return fail(kNoDevice, key("device") + ": no RDMA device '" + options.device + "' on this node (devices: " +
                                 list_or_none(all) + ")" +
                                 (options.origin.empty() ? "" : "; the rdma CNI moves the VF's device into the pod's "
                                                                "network namespace: is it in the network's plugin chain, "
                                                                "with 'rdma system' in netns exclusive mode?"));
    }
    c = {{options.device}, options.origin.empty() ? options.key + ".device" : options.origin, key("device")};
  } else if (!options.pci_address.empty()) {
    c.devices = sysfs.devices_of_pci(options.pci_address);
    c.key = key("device");
    c.how = (options.origin.empty() ? std::string("PCI") : options.origin) + " " + options.pci_address;
    if (c.devices.empty()) {
      return fail(kNoDevice, c.key + ": no RDMA device under PCI address " + options.pci_address +
                                 " (is the VF bound to its RDMA driver, e.g. mlx5_core, and the rdma CNI in the "
                                 "network's plugin chain?)");
    }
  } else if (const std::string var = options.resource_env.empty() ? "" : device_plugin_variable(options.resource_env);
             !var.empty() && env.count(var) && !env.at(var).empty()) {
    const auto pcis = split_commas(env.at(var));
    c.key = key("resourceEnv") + " (" + var + "=" + env.at(var) + ")";
    // The SR-IOV device plugin's _INFO: {"<pci>": {"generic": {...}, "rdma": {"rdma_dev": "mlx5_3", ...}}}.
    if (auto info = env.find(var + "_INFO"); info != env.end()) {
      const auto j = nlohmann::json::parse(info->second, nullptr, false);
      for (const auto& pci : pcis) {
        if (!j.is_object() || !j.contains(pci) || !j[pci].is_object()) continue;
        const auto& e = j[pci];
        if (!e.contains("rdma") || !e["rdma"].is_object()) continue;
        const auto& r = e["rdma"];
        if (r.contains("rdma_dev") && r["rdma_dev"].is_string()) {
          const auto name = r["rdma_dev"].get<std::string>();
          if (std::find(all.begin(), all.end(), name) != all.end()) {
            c.devices.push_back(name);
            c.how = var + "_INFO rdma_dev of " + pci;
          }
        }
      }
    }
    if (c.devices.empty()) {
      for (const auto& pci : pcis) {
        for (const auto& d : sysfs.devices_of_pci(pci)) c.devices.push_back(d);
      }
      c.how = var + " PCI " + env.at(var);
    }
    if (c.devices.empty()) {
      return fail(kNoDevice, c.key + ": no RDMA device under those PCI addresses (is the resource's VF bound "
                                     "to its RDMA driver, e.g. mlx5_core?)");
    }
  } else {
    c.devices = all;
    c.key = options.origin.empty() ? "config keys '" + options.key + ".netdev' / '" + options.key + ".address'"
                                   : options.origin;
    if (!options.origin.empty()) {
      c.how = options.origin;
    } else if (options.resource_env.empty()) {
      c.how = "any device";
    } else {
      c.how = "any device (" + device_plugin_variable(options.resource_env) +
              " not set: the shared-device plugin sets none)";
    }
    if (all.empty()) {
      if (!options.origin.empty()) {
        return fail(kNoDevice, options.origin + ": no RDMA device in the pod's view (/sys/class/infiniband is empty; "
                                                "is the rdma CNI in the network's plugin chain, and /dev/infiniband "
                                                "mounted?)");
      }
      return fail(kNoDevice, options.resource_env.empty()
                                 ? "no RDMA device on this node (/sys/class/infiniband is empty)"
                                 : "no RDMA device on this node and " + device_plugin_variable(options.resource_env) +
                                       " is not set (is the resource requested in the pod spec?)");
    }
  }

  // 2./3. Ports, netdevs, addresses, GIDs.
  Progress p;
  for (const auto& dev : c.devices) {
    for (int port : sysfs.ports(dev)) {
      const std::string where = "RDMA device " + dev + " port " + std::to_string(port);
      if (!sysfs.port_active(dev, port)) {
        p.at(0, kNoDevice, c.key + ": " + where + " is not active (link down?)");
        continue;
      }
      const auto gids = sysfs.gids(dev, port);
      const bool infiniband = sysfs.link_layer(dev, port) == "InfiniBand";
      std::vector<std::string> netdevs;
      if (!options.netdev.empty()) {
        netdevs = sysfs.netdevs_of(dev);
        if (std::find(netdevs.begin(), netdevs.end(), options.netdev) == netdevs.end()) {
          p.at(0, kNoDevice, key("netdev") + ": interface '" + options.netdev + "' is not on " + where +
                                 " (its interfaces: " + list_or_none(netdevs) + ")");
          continue;
        }
        netdevs = {options.netdev};
      } else {
        netdevs = sysfs.netdevs_of(dev);
      }
      if (netdevs.empty()) {
        p.at(0, kNoDevice, c.key + ": " + where + " has no network interface in sysfs");
        continue;
      }
      for (const auto& nd : netdevs) {
        auto addrs = addresses_of(nd);
        if (!options.address.empty()) {
          // By value, not by spelling: "FD00:100:0::1" is the interface's fd00:100::1, and the
          // interface's spelling is the one bound, advertised and reported.
          const auto want = gid_of_address(options.address);
          const auto same = std::find_if(addrs.begin(), addrs.end(),
                                         [&](const std::string& a) { return want && gid_of_address(a) == want; });
          if (same == addrs.end()) {
            p.at(1, kNoAddress, key("address") + ": " + options.address + " is not an address of " + nd +
                                    " (" + where + "; its addresses: " + list_or_none(addrs) + ")");
            continue;
          }
          addrs = {*same};
        }
        if (addrs.empty()) {
          p.at(1, kNoAddress, c.key + ": interface " + nd + " of " + where +
                                  " has no IP address for rdma_cm (give it one, or set " + options.key +
                                  ".netdev to an interface on it that has one, e.g. a VLAN)");
          continue;
        }
        for (const auto& ip : addrs) {
          if (infiniband) {
            RdmaDevice d{dev, port, nd, ip, 0, gids.empty() ? "" : gids.front().text, "IB", c.how};
            out.device = d;
            return out;
          }
          const auto want = gid_of_address(ip);
          const GidEntry* v1 = nullptr;
          for (const auto& g : gids) {
            if (!want || g.gid != *want || g.ndev != nd) continue;
            if (is_roce_v2(g.type)) {
              out.device = RdmaDevice{dev, port, nd, ip, g.index, g.text, g.type, c.how};
              return out;
            }
            v1 = &g;
          }
          p.at(2, kGidNotFound, c.key + ": " + where + " has no RoCE v2 GID for " + ip + " on " + nd +
                                    (v1 ? " (only a " + v1->type + " entry, index " + std::to_string(v1->index) +
                                              "; is RoCE v2 enabled on the NIC?)"
                                        : " (is the address new? the kernel adds GIDs as addresses appear)"));
        }
      }
    }
  }
  if (p.message.empty()) p.message = c.key + ": no RDMA device port found (" + list_or_none(c.devices) + ")";
  return fail(p.reason, p.message);
}

uint32_t port_active_mtu(const std::string& device, int port) {
  int n = 0;
  DeviceListPtr list(ibv_get_device_list(&n));
  if (!list) return 0;
  for (int i = 0; i < n; ++i) {
    if (device != ibv_get_device_name(list.get()[i])) continue;
    ContextPtr ctx(ibv_open_device(list.get()[i]));
    if (!ctx) return 0;
    ibv_port_attr pa{};
    if (ibv_query_port(ctx.get(), static_cast<uint8_t>(port), &pa) != 0) return 0;
    const int m = static_cast<int>(pa.active_mtu);  // IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5
    return m >= 1 && m <= 5 ? 128u << m : 0;
  }
  return 0;
}

int count_usable_devices() {
  int n = 0;
  DeviceListPtr list(ibv_get_device_list(&n));
  if (!list) return 0;
  int usable = 0;
  for (int i = 0; i < n; ++i) {
    ContextPtr ctx(ibv_open_device(list.get()[i]));
    if (!ctx) continue;
    ibv_device_attr attr{};
    if (ibv_query_device(ctx.get(), &attr) != 0) continue;
    for (uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx.get(), port, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
        ++usable;
        break;
      }
    }
  }
  return usable;
}

}  // namespace rdmig::transport::rdma
