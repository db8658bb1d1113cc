// Choosing the RDMA device, port, GID and IP address an agent uses (rdma_cm binds to the
// address and peers dial it; rdma_cm then uses the RoCE v2 GID of that address).
//
// 1. Candidate devices: RdmaOptions::device when set; else the RDMA devices under
//    RdmaOptions::pci_address when set (a Multus network's device-info, network_status.h); else the SR-IOV device plugin's
//    PCIDEVICE_<RESOURCE> variable (its _INFO JSON's "rdma_dev" when present, else the RDMA
//    devices under each PCI address); else, also when resource_env names a variable that is
//    not set (the shared-device plugin exports none), every device.
// 2. On each candidate's active ports, netdevs from every GID table entry (all
//    gid_attrs/ndevs/*, so a VLAN or macvlan on the port is found), device/net and an rxe's
//    parent; only RdmaOptions::netdev when set.
// 3. Addresses of those netdevs (IPv4 first, then global IPv6; only RdmaOptions::address when
//    set, compared by value), and for each the RoCE v2 GID of that address on that netdev
//    (IPv4-mapped for IPv4). The first address that has one wins. Never GID index 0 by default:
//    index 0 is the link-local entry (RoCE v1 on a ConnectX, v2 on rxe). InfiniBand ports use their IPoIB address and GID 0.
// A failure says how far selection got (reason) and what to fix (message, naming the key).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "transport/rdma/options.h"
#include "transport/rdma/sysfs.h"

namespace rdmig::transport::rdma {

struct RdmaDevice {
  std::string name;    // ibv device name (rxe0, mlx5_3)
  int port = 1;
  std::string netdev;  // the interface whose address and GID are used
  std::string ip;      // address rdma_cm binds to and peers dial
  int gid_index = -1;
  std::string gid;       // as sysfs writes it
  std::string gid_type;  // "RoCE v2", or "IB" on InfiniBand
  std::string how;       // how the device was found, for logs ("rdma.device", "PCIDEVICE_X 0000:3b:00.2")
};

// Why no device was chosen; also a metric label and part of a migration's transport reason.
inline constexpr const char* kNoDevice = "no-device";         // no (matching) RDMA device, or its port is down
inline constexpr const char* kNoAddress = "no-address";       // device found, its netdev has no usable IP address
inline constexpr const char* kGidNotFound = "gid-not-found";  // address found, no RoCE v2 GID for it

struct Selection {
  std::optional<RdmaDevice> device;
  std::string reason;  // when no device: kNoDevice, kNoAddress or kGidNotFound
  Error error;         // when no device: what to fix
  bool ok() const { return device.has_value(); }
};

// Addresses of a netdev, IPv4 first then global IPv6 (no link-local), from getifaddrs.
std::vector<std::string> netdev_addresses(const std::string& netdev);
using AddressLookup = std::function<std::vector<std::string>(const std::string& netdev)>;

Selection select_device(const RdmaOptions& options, const std::map<std::string, std::string>& env,
                        const SysfsView& sysfs, const AddressLookup& addresses_of = &netdev_addresses);

// "PCIDEVICE_NVIDIA_COM_SRIOV_RDMA" for "nvidia.com/sriov_rdma" (and for itself).
std::string device_plugin_variable(const std::string& resource);

std::map<std::string, std::string> process_environment();

// Active MTU of a port in bytes (256..4096) as libibverbs reports it; 0 when it cannot be read.
uint32_t port_active_mtu(const std::string& device, int port);

// Devices with at least one active port that libibverbs can open right now (0 without RDMA).
int count_usable_devices();

}  // namespace rdmig::transport::rdma
