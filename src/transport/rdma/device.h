// Finding the RDMA device an agent should use and the IP address rdma_cm binds to.
// Sources, in order: rdma.device (e.g. mlx5_0), rdma.netdev (e.g. ens1f0v0), the SR-IOV
// device plugin's environment (PCIDEVICE_<RESOURCE>=<pci addr>[,..] and, when present,
// PCIDEVICE_<RESOURCE>_INFO JSON with an "rdma" entry naming "rdma_dev"), else the first
// device whose port is active and whose netdev has an IP address. Mapped through sysfs;
// `sysfs_root` lets tests point at a fake tree.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/result.h"
#include "config/agent_config.h"

namespace rdmig::transport::rdma {

struct RdmaDevice {
  std::string name;    // ibv device name (rxe0, mlx5_3)
  std::string netdev;  // its network interface
  std::string ip;      // address rdma_cm binds to and peers dial
  std::string how;     // how it was chosen, for logs ("config rdma.device", "SR-IOV env ...")
};

struct SysfsView {
  std::string root = "/sys";
  // Device name -> netdevs (from <root>/class/infiniband/<dev>/device/net/* or .../parent).
  std::vector<std::string> netdevs_of(const std::string& device) const;
  // PCI address -> RDMA device names (<root>/bus/pci/devices/<addr>/infiniband/*).
  std::vector<std::string> devices_of_pci(const std::string& pci) const;
  std::vector<std::string> devices() const;  // <root>/class/infiniband/*
};

// Address of a netdev (first IPv4, else IPv6), from getifaddrs. Empty when none.
std::string netdev_ip(const std::string& netdev);

// Picks the device as described above. `env` is the process environment (tests pass their
// own); `ip_of` resolves a netdev to an address.
Result<RdmaDevice> select_device(const RdmaConfig& config, const std::map<std::string, std::string>& env,
                                 const SysfsView& sysfs,
                                 std::string (*ip_of)(const std::string&) = &netdev_ip);

std::map<std::string, std::string> process_environment();

// Devices libibverbs can open right now (0 when the kernel has no RDMA support).
int count_usable_devices();

}  // namespace rdmig::transport::rdma
