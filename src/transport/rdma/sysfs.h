// What the kernel tells about RDMA devices under /sys: devices, ports, their GID tables (value,
// type, netdev of every entry), the netdevs of a device and the devices of a PCI function.
// `root` makes the tree injectable: unit tests build a fake one.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace rdmig::transport::rdma {

using GidBytes = std::array<uint8_t, 16>;

struct GidEntry {
  int index = 0;
  GidBytes gid{};
  std::string text;  // as sysfs writes it: fe80:0000:...
  std::string type;  // "RoCE v2", "IB/RoCE v1" (gid_attrs/types), "" when unreadable
  std::string ndev;  // gid_attrs/ndevs: the netdev the entry belongs to ("" on InfiniBand)
};

struct SysfsView {
  std::string root = "/sys";

  std::vector<std::string> devices() const;                                    // class/infiniband/*
  std::vector<int> ports(const std::string& device) const;                      // .../ports/*
  std::string link_layer(const std::string& device, int port) const;            // Ethernet | InfiniBand
  bool port_active(const std::string& device, int port) const;                  // state "4: ACTIVE"
  // Every non-zero GID of the port with its type and netdev (all indices, not only 0).
  std::vector<GidEntry> gids(const std::string& device, int port) const;
  // Netdevs of a device: every ndev of its GID tables, then device/net/*, then an rxe's parent.
  std::vector<std::string> netdevs_of(const std::string& device) const;
  std::vector<std::string> devices_of_pci(const std::string& pci) const;  // bus/pci/devices/<pci>/infiniband/*
};

// Parses a GID as sysfs writes it (eight groups of four hex digits; any IPv6 text form works).
std::optional<GidBytes> parse_gid(const std::string& text);
// The GID that RoCE v2 uses for an IP address: IPv4-mapped (::ffff:a.b.c.d) for IPv4, the
// address itself for IPv6. nullopt when `ip` is not an address.
std::optional<GidBytes> gid_of_address(const std::string& ip);
// True for the RoCE v2 GID type as the kernel names it.
bool is_roce_v2(const std::string& gid_type);

}  // namespace rdmig::transport::rdma
