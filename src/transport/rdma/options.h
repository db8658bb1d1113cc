// What the RDMA transport is told by whoever runs it (the agent maps its config key `rdma` onto
// this). The transport owns the type: nothing under src/transport depends on the agent's config.
#pragma once

#include <string>

namespace rdmig::transport::rdma {

struct RdmaOptions {
  // Device sources, most specific first (transport/rdma/device.h says how they combine).
  std::string device;        // ibv device name, e.g. mlx5_0
  std::string netdev;        // network interface whose RoCE GID to use, e.g. ens1f0v0 or a VLAN on it
  std::string address;       // IP address to bind rdma_cm to and advertise (one of the netdev's)
  std::string resource_env;  // SR-IOV device plugin variable or resource name (PCIDEVICE_...)
  std::string pci_address;   // a VF's PCI address (a Multus network's device-info): its RDMA devices
  // Where device/netdev/address/pci_address came from when no config key set them (a Multus
  // network's entry, network_status.h): named in selection errors instead of the keys.
  std::string origin;
  // The config key these options came from, "rdma" or a rail's "rdma.devices[2]": errors name its
  // keys ("config key 'rdma.devices[2].netdev'").
  std::string key = "rdma";
  // IP ToS byte of RoCE v2 packets (DSCP << 2), set with rdma_set_option(RDMA_OPTION_ID_TOS) on
  // every rdma_cm id; -1 leaves the kernel's default (0, or the device's configfs default_roce_tos).
  int traffic_class = -1;
};

}  // namespace rdmig::transport::rdma
