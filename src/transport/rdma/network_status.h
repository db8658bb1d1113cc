// A Multus secondary network as a device source: the pod's `k8s.v1.cni.cncf.io/network-status`
// annotation (a JSON array, one entry per attached interface, mounted as a downward API file)
// names the interface, its IP addresses and, through the NPWG device-info, the VF's PCI address
// and RDMA device. The agent picks the entry of the NetworkAttachmentDefinition it is told
// (RdmaOptions::network) and selects the device from it (device.h) as from explicit keys:
//   netdev  = the entry's "interface"
//   address = its first IPv4 in "ips", else its first non-link-local IPv6
//   device  = "device-info".pci."rdma-device" when present, else the RDMA devices under
//             "device-info".pci."pci-address", else any device holding that interface.
// The file comes from outside the agent: its size, nesting and entry count are bounded, and a
// malformed matching entry is refused naming the field.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"
#include "transport/rdma/options.h"

namespace rdmig::transport::rdma {

inline constexpr size_t kMaxNetworkStatusBytes = 256 * 1024;  // a few interfaces take ~1 KiB
inline constexpr size_t kMaxNetworkStatusEntries = 64;

// One entry of network-status as far as rdmig uses it.
struct NetworkAttachment {
  std::string name;         // "<namespace>/<nad>" as Multus writes it (the default network: its own name)
  std::string interface;    // e.g. net1
  std::vector<std::string> ips;
  std::string rdma_device;  // device-info.pci.rdma-device, e.g. mlx5_5
  std::string pci_address;  // device-info.pci.pci-address, e.g. 0000:3b:02.2
};

// The name Multus writes for `network` ("ns/nad", or "nad" in `pod_namespace`).
std::string qualified_network(const std::string& network, const std::string& pod_namespace);

// Finds `network` in the annotation's text. Errors: kNotFound when the text is empty or has no
// entry of that name (it may not be written yet), kInvalidArgument when it is not a bounded JSON
// array, names the network more than once, or its entry is unusable (no interface, a field of
// the wrong type); kUnavailable when the entry lists no usable IP address. Messages name what is wrong, not where it came from.
Result<NetworkAttachment> find_network_attachment(std::string_view text, const std::string& network,
                                                  const std::string& pod_namespace);

// The address rdmig advertises from an entry: its first IPv4, else its first non-link-local IPv6.
std::string preferred_address(const NetworkAttachment& entry);

// `base` (its trafficClass) with device/netdev/address set from the entry; `origin` says where
// they came from in selection errors and logs.
RdmaOptions options_for_attachment(const RdmaOptions& base, const NetworkAttachment& entry,
                                   const std::string& network_status_file);

// Reads `path` until it holds `network`'s entry or `deadline` passes (the downward API file can
// be empty for a moment after the container starts: Multus writes the annotation while the pod's
// sandbox is set up, the kubelet copies it into the file at its next sync of the pod). Only a
// missing, empty or entry-less file is waited for; a malformed one fails at once. `cancelled`
// ends the wait early. Errors name the file, the network and the config key `key` ("rdma" or a
// rail's "rdma.devices[2]") that asked for it.
Result<NetworkAttachment> wait_for_network_attachment(const std::string& path, const std::string& network,
                                                      const std::string& pod_namespace,
                                                      std::chrono::steady_clock::time_point deadline,
                                                      const std::function<bool()>& cancelled = {},
                                                      const std::string& key = "rdma");

}  // namespace rdmig::transport::rdma
