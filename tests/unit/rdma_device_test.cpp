// RDMA device, netdev, address and GID selection over a fake /sys: every deployment shape the
// Soft-RoCE VM cannot build (ConnectX VFs, PCI addresses, the device plugins' variables, RoCE
// v1 entries), plus the transport's independence from the agent's config.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <fstream>
#include <map>
#include <regex>
#include <tuple>

#include "common/units.h"
#include "source_dir.h"
#include "transport/rdma/device.h"
#include "transport/rdma/network_status.h"
#include "transport/rdma/sysfs.h"

using namespace rdmig;
using namespace rdmig::transport::rdma;
namespace fs = std::filesystem;

namespace {

constexpr const char* kV1 = "IB/RoCE v1";
constexpr const char* kV2 = "RoCE v2";

// Builds /sys/class/infiniband/<dev>/ports/<n>/{state,link_layer,gids/*,gid_attrs/{types,ndevs}/*}
// the way the kernel lays them out (unused entries are all-zero GIDs).
struct FakeSysfs {
  fs::path root;
  FakeSysfs() : root(fs::temp_directory_path() / ("rdmig-sysfs-" + random_hex(6))) {}
  ~FakeSysfs() { fs::remove_all(root); }
  FakeSysfs(const FakeSysfs&) = delete;
  FakeSysfs& operator=(const FakeSysfs&) = delete;

  void write(const fs::path& rel, const std::string& v) const {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << v << "\n";
  }
  fs::path port(const std::string& dev, int p) const {
    return fs::path("class/infiniband") / dev / "ports" / std::to_string(p);
  }
  void add_port(const std::string& dev, int p = 1, bool active = true, const std::string& link = "Ethernet") const {
    write(port(dev, p) / "state", active ? "4: ACTIVE" : "1: DOWN");
    write(port(dev, p) / "link_layer", link);
    write(port(dev, p) / "gids/15", "0000:0000:0000:0000:0000:0000:0000:0000");  // an unused entry
  }
  void gid(const std::string& dev, int index, const std::string& gid, const std::string& type,
           const std::string& ndev, int p = 1) const {
    write(port(dev, p) / "gids" / std::to_string(index), gid);
    write(port(dev, p) / "gid_attrs/types" / std::to_string(index), type);
    write(port(dev, p) / "gid_attrs/ndevs" / std::to_string(index), ndev);
  }
  void pci(const std::string& addr, const std::string& dev) const {
    fs::create_directories(root / "bus/pci/devices" / addr / "infiniband" / dev);
    fs::create_directories(root / "class/infiniband" / dev / "device/net");
  }
  SysfsView view() const { return SysfsView{root.string()}; }
};

// A ConnectX VF mlx5_2 (PCI 0000:3b:00.2, netdev ens1f0v0) with a VLAN ens1f0v0.100 and a
// macvlan mv0 on it, and an rxe0 on va. GID tables as the kernel fills them: link-local v1/v2
// first, then a v1/v2 pair per address.
struct Cluster : FakeSysfs {
  std::map<std::string, std::vector<std::string>> addresses = {
      {"ens1f0v0", {"192.0.2.10"}},
      {"ens1f0v0.100", {"198.51.100.7", "2001:db8:100::7"}},
      {"mv0", {"203.0.113.5"}},
      {"va", {"10.99.0.1"}},
  };
  Cluster() {
    add_port("mlx5_2");
    pci("0000:3b:00.2", "mlx5_2");
    gid("mlx5_2", 0, "fe80:0000:0000:0000:0a00:27ff:fe00:0002", kV1, "ens1f0v0");
    gid("mlx5_2", 1, "fe80:0000:0000:0000:0a00:27ff:fe00:0002", kV2, "ens1f0v0");
    gid("mlx5_2", 2, "0000:0000:0000:0000:0000:ffff:c000:020a", kV1, "ens1f0v0");
    gid("mlx5_2", 3, "0000:0000:0000:0000:0000:ffff:c000:020a", kV2, "ens1f0v0");
    gid("mlx5_2", 4, "0000:0000:0000:0000:0000:ffff:c633:6407", kV1, "ens1f0v0.100");
    gid("mlx5_2", 5, "0000:0000:0000:0000:0000:ffff:c633:6407", kV2, "ens1f0v0.100");
    gid("mlx5_2", 6, "2001:0db8:0100:0000:0000:0000:0000:0007", kV1, "ens1f0v0.100");
    gid("mlx5_2", 7, "2001:0db8:0100:0000:0000:0000:0000:0007", kV2, "ens1f0v0.100");
    gid("mlx5_2", 8, "0000:0000:0000:0000:0000:ffff:cb00:7105", kV1, "mv0");
    gid("mlx5_2", 9, "0000:0000:0000:0000:0000:ffff:cb00:7105", kV2, "mv0");
    add_port("rxe0");
    write("class/infiniband/rxe0/parent", "va");
    gid("rxe0", 0, "fe80:0000:0000:0000:0000:00ff:fe00:0001", kV1, "va");
    gid("rxe0", 1, "fe80:0000:0000:0000:0000:00ff:fe00:0001", kV2, "va");
    gid("rxe0", 2, "0000:0000:0000:0000:0000:ffff:0a63:0001", kV1, "va");
    gid("rxe0", 3, "0000:0000:0000:0000:0000:ffff:0a63:0001", kV2, "va");
  }
  AddressLookup lookup() const {
    return [this](const std::string& nd) {
      auto it = addresses.find(nd);
      return it == addresses.end() ? std::vector<std::string>{} : it->second;
    };
  }
  Selection select(const RdmaOptions& o, const std::map<std::string, std::string>& env = {}) const {
    return select_device(o, env, view(), lookup());
  }
};

RdmaOptions opts(const std::string& device, const std::string& netdev = "", const std::string& address = "",
                 const std::string& resource_env = "") {
  RdmaOptions o;
  o.device = device;
  o.netdev = netdev;
  o.address = address;
  o.resource_env = resource_env;
  return o;
}

}  // namespace

TEST(RdmaGid, AddressesMapToTheirRoceV2Gids) {
  EXPECT_EQ(gid_of_address("192.0.2.10"), parse_gid("0000:0000:0000:0000:0000:ffff:c000:020a"));
  EXPECT_EQ(gid_of_address("2001:db8:100::7"), parse_gid("2001:0db8:0100:0000:0000:0000:0000:0007"));
  EXPECT_NE(gid_of_address("192.0.2.11"), parse_gid("0000:0000:0000:0000:0000:ffff:c000:020a"));
  EXPECT_FALSE(gid_of_address("mlx5_0").has_value());
  EXPECT_FALSE(parse_gid("not a gid").has_value());
}

TEST(RdmaSysfs, ReadsEveryGidEntryWithItsTypeAndNetdev) {
  Cluster c;
  const auto gids = c.view().gids("mlx5_2", 1);
  ASSERT_EQ(gids.size(), 10u) << "the all-zero entry 15 is skipped";
  EXPECT_EQ(gids[5].index, 5);
  EXPECT_EQ(gids[5].type, kV2);
  EXPECT_EQ(gids[5].ndev, "ens1f0v0.100");
  const auto nds = c.view().netdevs_of("mlx5_2");
  EXPECT_EQ(nds, (std::vector<std::string>{"ens1f0v0", "ens1f0v0.100", "mv0"}));
  EXPECT_EQ(c.view().netdevs_of("rxe0"), std::vector<std::string>{"va"});
}

TEST(RdmaDeviceSelection, ExplicitDeviceUsesTheRoceV2GidOfItsFirstAddressNotIndexZero) {
  Cluster c;
  auto s = c.select(opts("mlx5_2"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "mlx5_2");
  EXPECT_EQ(s.device->port, 1);
  EXPECT_EQ(s.device->netdev, "ens1f0v0");
  EXPECT_EQ(s.device->ip, "192.0.2.10");
  EXPECT_EQ(s.device->gid_index, 3);
  EXPECT_EQ(s.device->gid_type, kV2);
  EXPECT_EQ(s.device->how, "rdma.device");
}

TEST(RdmaDeviceSelection, VlanNetdevIsFoundThroughItsGidEntries) {
  Cluster c;
  auto s = c.select(opts("", "ens1f0v0.100"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "mlx5_2");
  EXPECT_EQ(s.device->ip, "198.51.100.7");
  EXPECT_EQ(s.device->gid_index, 5);
}

TEST(RdmaDeviceSelection, MacvlanNetdevIsFoundThroughItsGidEntries) {
  Cluster c;
  auto s = c.select(opts("", "mv0"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "mlx5_2");
  EXPECT_EQ(s.device->ip, "203.0.113.5");
  EXPECT_EQ(s.device->gid_index, 9);
}

TEST(RdmaDeviceSelection, Ipv6AddressUsesTheIpv6RoceV2Gid) {
  Cluster c;
  auto s = c.select(opts("", "ens1f0v0.100", "2001:db8:100::7"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->ip, "2001:db8:100::7");
  EXPECT_EQ(s.device->gid_index, 7);
  EXPECT_EQ(s.device->gid_type, kV2);
  // IPv6 only on the netdev: the IPv6 GID without asking.
  c.addresses["ens1f0v0.100"] = {"2001:db8:100::7"};
  s = c.select(opts("", "ens1f0v0.100"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->gid_index, 7);
}

TEST(RdmaDeviceSelection, AddressAloneFindsItsDeviceAndNetdev) {
  Cluster c;
  auto s = c.select(opts("", "", "10.99.0.1"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "rxe0");
  EXPECT_EQ(s.device->netdev, "va");
  EXPECT_EQ(s.device->gid_index, 3);
  s = c.select(opts("", "", "203.0.113.5"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->netdev, "mv0");
}

// rdma.address is compared by value: an operator's spelling of an IPv6 address (upper case, zero
// groups) is the interface's address, and the interface's spelling is what is bound and reported.
TEST(RdmaDeviceSelection, AddressIsComparedByValueNotBySpelling) {
  Cluster c;
  auto s = c.select(opts("", "", "2001:DB8:100:0:0::7"));
  ASSERT_TRUE(s.ok()) << s.reason << ": " << s.error.message;
  EXPECT_EQ(s.device->netdev, "ens1f0v0.100");
  EXPECT_EQ(s.device->ip, "2001:db8:100::7");
  EXPECT_EQ(s.device->gid_index, 7);
  s = c.select(opts("", "", "2001:db8:100::8"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoAddress);
}

// The GID table of rxea in the two-node Soft-RoCE VMs (Debian 12, 6.1) with eth0 10.99.1.1 and
// fd00:99::1 (added last), VLAN eth0.100 10.100.0.1 + fd00:100::1 and macvlan mv100 over it
// 10.101.0.1, copied from /sys: rxe has RoCE v2 entries only; index 0 is eth0's link-local GID,
// and the VLAN's link-local entry (4) has the same value on eth0.100; an address added later
// takes the next free index (10). tests/rdma/test_pathcheck_rdma_two_nodes.py checks the same
// choices between two real devices.
TEST(RdmaDeviceSelection, RxeTableAsTheKernelFillsItForVlanMacvlanAndIpv6) {
  FakeSysfs f;
  f.add_port("rxea");
  f.write("class/infiniband/rxea/parent", "eth0");
  const std::vector<std::tuple<int, std::string, std::string>> table = {
      {0, "fe80:0000:0000:0000:5054:00ff:fe99:0101", "eth0"},
      {1, "0000:0000:0000:0000:0000:ffff:0a63:0101", "eth0"},
      {2, "0000:0000:0000:0000:0000:ffff:0a64:0001", "eth0.100"},
      {3, "fd00:0100:0000:0000:0000:0000:0000:0001", "eth0.100"},
      {4, "fe80:0000:0000:0000:5054:00ff:fe99:0101", "eth0.100"},
      {5, "0000:0000:0000:0000:0000:ffff:0a65:0001", "mv100"},
      {7, "fe80:0000:0000:0000:a817:9bff:fe17:0867", "mv100"},
      {10, "fd00:0099:0000:0000:0000:0000:0000:0001", "eth0"},
  };
  for (const auto& [i, g, nd] : table) f.gid("rxea", i, g, kV2, nd);
  const std::map<std::string, std::vector<std::string>> addrs = {
      {"eth0", {"10.99.1.1", "fd00:99::1"}}, {"eth0.100", {"10.100.0.1", "fd00:100::1"}}, {"mv100", {"10.101.0.1"}}};
  const AddressLookup lookup = [&](const std::string& nd) {
    auto it = addrs.find(nd);
    return it == addrs.end() ? std::vector<std::string>{} : it->second;
  };
  EXPECT_EQ(f.view().netdevs_of("rxea"), (std::vector<std::string>{"eth0", "eth0.100", "mv100"}));
  struct Want {
    RdmaOptions o;
    std::string netdev, ip;
    int index;
  };
  for (const auto& w : {Want{opts("rxea"), "eth0", "10.99.1.1", 1},
                        Want{opts("", "eth0.100"), "eth0.100", "10.100.0.1", 2},
                        Want{opts("", "", "fd00:100::1"), "eth0.100", "fd00:100::1", 3},
                        Want{opts("", "mv100"), "mv100", "10.101.0.1", 5},
                        Want{opts("", "", "fd00:99::1"), "eth0", "fd00:99::1", 10}}) {
    auto s = select_device(w.o, {}, f.view(), lookup);
    ASSERT_TRUE(s.ok()) << w.netdev << " " << w.ip << ": " << s.error.message;
    EXPECT_EQ(s.device->netdev, w.netdev);
    EXPECT_EQ(s.device->ip, w.ip);
    EXPECT_EQ(s.device->gid_index, w.index) << w.ip;
    EXPECT_EQ(s.device->gid_type, kV2);
  }
}

TEST(RdmaDeviceSelection, OnlyRoceV1GidIsGidNotFound) {
  FakeSysfs f;
  f.add_port("mlx5_4");
  f.gid("mlx5_4", 0, "fe80:0000:0000:0000:0a00:27ff:fe00:0004", kV1, "eth4");
  f.gid("mlx5_4", 1, "0000:0000:0000:0000:0000:ffff:c000:0214", kV1, "eth4");
  auto s = select_device(opts("mlx5_4"), {}, f.view(),
                         [](const std::string&) { return std::vector<std::string>{"192.0.2.20"}; });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kGidNotFound);
  EXPECT_NE(s.error.message.find("only a IB/RoCE v1 entry, index 1"), std::string::npos) << s.error.message;
  // A v2 entry for that address (type files as the kernel writes them) makes it usable.
  f.gid("mlx5_4", 2, "0000:0000:0000:0000:0000:ffff:c000:0214", kV2, "eth4");
  s = select_device(opts("mlx5_4"), {}, f.view(),
                    [](const std::string&) { return std::vector<std::string>{"192.0.2.20"}; });
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->gid_index, 2);
}

TEST(RdmaDeviceSelection, GidOfAnotherNetdevDoesNotCount) {
  Cluster c;
  // The VLAN's address appears on the PF too (a misconfiguration): its GIDs belong to the VLAN.
  c.addresses["ens1f0v0"] = {"198.51.100.7"};
  auto s = c.select(opts("", "ens1f0v0"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kGidNotFound);
  EXPECT_NE(s.error.message.find("no RoCE v2 GID for 198.51.100.7 on ens1f0v0"), std::string::npos) << s.error.message;
}

TEST(RdmaDeviceSelection, VfWithoutAnAddressIsNoAddressNamingTheInterface) {
  FakeSysfs f;
  f.add_port("mlx5_7");
  f.pci("0000:3b:00.7", "mlx5_7");
  fs::create_directories(f.root / "class/infiniband/mlx5_7/device/net/ens1f0v5");
  f.gid("mlx5_7", 0, "fe80:0000:0000:0000:0a00:27ff:fe00:0007", kV1, "ens1f0v5");
  f.gid("mlx5_7", 1, "fe80:0000:0000:0000:0a00:27ff:fe00:0007", kV2, "ens1f0v5");
  auto s = select_device(opts("", "", "", "nvidia.com/sriov_rdma"), {{"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA", "0000:3b:00.7"}},
                         f.view(), [](const std::string&) { return std::vector<std::string>{}; });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoAddress);
  EXPECT_NE(s.error.message.find("ens1f0v5"), std::string::npos) << s.error.message;
  EXPECT_NE(s.error.message.find("rdma.resourceEnv"), std::string::npos) << s.error.message;
}

TEST(RdmaDeviceSelection, SriovDevicePluginVariableWithAndWithoutInfo) {
  Cluster c;
  const std::map<std::string, std::string> plain{{"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA", "0000:3b:00.2"}};
  auto s = c.select(opts("", "", "", "PCIDEVICE_NVIDIA_COM_SRIOV_RDMA"), plain);
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "mlx5_2");
  EXPECT_EQ(s.device->how, "PCIDEVICE_NVIDIA_COM_SRIOV_RDMA PCI 0000:3b:00.2");
  // The resource name maps to the same variable.
  s = c.select(opts("", "", "", "nvidia.com/sriov_rdma"), plain);
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "mlx5_2");
  // The plugin's _INFO (its rdma info provider's keys) names the RDMA device: it wins.
  auto with_info = plain;
  with_info["PCIDEVICE_NVIDIA_COM_SRIOV_RDMA_INFO"] =
      R"({"0000:3b:00.2":{"generic":{"deviceID":"0000:3b:00.2"},"rdma":{"rdma_cm":"/dev/infiniband/rdma_cm",)"
      R"("uverbs":"/dev/infiniband/uverbs4","umad":"/dev/infiniband/umad4","issm":"/dev/infiniband/issm4","rdma_dev":"rxe0"}}})";
  s = c.select(opts("", "", "", "nvidia.com/sriov_rdma"), with_info);
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "rxe0");
  EXPECT_EQ(s.device->how, "PCIDEVICE_NVIDIA_COM_SRIOV_RDMA_INFO rdma_dev of 0000:3b:00.2");
  // With the plugin's device and a netdev on it: the VLAN on the VF.
  s = c.select(opts("", "ens1f0v0.100", "", "nvidia.com/sriov_rdma"), plain);
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->gid_index, 5);
  // A PCI address with no RDMA device (VF not bound to its RDMA driver).
  s = c.select(opts("", "", "", "nvidia.com/sriov_rdma"), {{"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA", "0000:3b:00.3"}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoDevice);
  EXPECT_NE(s.error.message.find("0000:3b:00.3"), std::string::npos) << s.error.message;
}

// Multus mode: a network-status entry maps onto the same selection as explicit keys would
// (network_status.h); errors name rdma.network and the entry, not keys nobody set.
TEST(RdmaDeviceSelection, MultusEntrySelectsByRdmaDevicePciAddressOrInterface) {
  Cluster c;
  const auto from = [](const std::string& rest) {
    auto a = find_network_attachment("[{\"name\":\"ns/rdma\"," + rest + "}]", "ns/rdma", "");
    EXPECT_TRUE(a) << a.error().message;
    return options_for_attachment(RdmaOptions{}, a.value(), "/etc/podinfo/network-status");
  };
  // device-info's rdma-device, as the SR-IOV CNI writes it with the rdma CNI.
  auto s = c.select(from(R"("interface":"ens1f0v0","ips":["192.0.2.10"],)"
                         R"("device-info":{"type":"pci","pci":{"pci-address":"0000:3b:00.2","rdma-device":"mlx5_2"}})"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "mlx5_2");
  EXPECT_EQ(s.device->netdev, "ens1f0v0");
  EXPECT_EQ(s.device->ip, "192.0.2.10");
  EXPECT_EQ(s.device->gid_index, 3);
  EXPECT_NE(s.device->how.find("rdma.network"), std::string::npos) << s.device->how;
  // Only the PCI address: the RDMA devices under it, as for the SR-IOV device plugin's variable.
  s = c.select(from(R"("interface":"ens1f0v0.100","ips":["198.51.100.7"],"device-info":{"pci":{"pci-address":"0000:3b:00.2"}})"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "mlx5_2");
  EXPECT_EQ(s.device->gid_index, 5);
  EXPECT_NE(s.device->how.find("0000:3b:00.2"), std::string::npos) << s.device->how;
  // No device-info (a macvlan or shared-mode network): the device that holds the interface.
  s = c.select(from(R"("interface":"va","ips":["10.99.0.1"])"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "rxe0");
  EXPECT_EQ(s.device->gid_index, 3);
  // IPv4 preferred over the IPv6 listed first.
  s = c.select(from(R"("interface":"ens1f0v0.100","ips":["2001:db8:100::7","198.51.100.7"])"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->ip, "198.51.100.7");
}

TEST(RdmaDeviceSelection, MultusEntryFailuresNameTheNetworkNotTheKeys) {
  Cluster c;
  const auto from = [](const std::string& rest) {
    auto a = find_network_attachment("[{\"name\":\"ns/rdma\"," + rest + "}]", "ns/rdma", "");
    EXPECT_TRUE(a) << a.error().message;
    return options_for_attachment(RdmaOptions{}, a.value(), "/etc/podinfo/network-status");
  };
  // The rdma CNI did not move the device into the pod's namespace: not in the pod's view.
  auto s = c.select(from(R"("interface":"net1","ips":["10.56.217.5"],"device-info":{"pci":{"rdma-device":"mlx5_5"}})"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoDevice);
  EXPECT_NE(s.error.message.find("config key 'rdma.network' ('ns/rdma'"), std::string::npos) << s.error.message;
  EXPECT_EQ(s.error.message.find("rdma.device'"), std::string::npos) << s.error.message;
  EXPECT_NE(s.error.message.find("pod's network namespace"), std::string::npos) << s.error.message;
  s = c.select(from(R"("interface":"net1","ips":["10.56.217.5"],"device-info":{"pci":{"pci-address":"0000:3b:02.7"}})"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error.message.find("0000:3b:02.7"), std::string::npos) << s.error.message;
  EXPECT_NE(s.error.message.find("rdma CNI"), std::string::npos) << s.error.message;
  // The interface is not on the device.
  s = c.select(from(R"("interface":"net1","ips":["10.56.217.5"],"device-info":{"pci":{"rdma-device":"mlx5_2"}})"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error.message.find("rdma.network"), std::string::npos) << s.error.message;
  EXPECT_NE(s.error.message.find("'net1' is not on"), std::string::npos) << s.error.message;
  // The entry's address is not (or no longer) on the interface.
  s = c.select(from(R"("interface":"ens1f0v0","ips":["192.0.2.99"])"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoAddress);
  EXPECT_NE(s.error.message.find("192.0.2.99 is not an address of ens1f0v0"), std::string::npos) << s.error.message;
  EXPECT_NE(s.error.message.find("rdma.network"), std::string::npos) << s.error.message;
}

TEST(RdmaDeviceSelection, SharedDevicePluginSetsNoVariableSoNetdevOrAddressSelects) {
  Cluster c;
  auto s = c.select(opts("", "va", "", "rdma/hca_shared_devices_a"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->name, "rxe0");
  EXPECT_NE(s.device->how.find("PCIDEVICE_RDMA_HCA_SHARED_DEVICES_A not set"), std::string::npos) << s.device->how;
  s = c.select(opts("", "", "203.0.113.5", "rdma/hca_shared_devices_a"));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->netdev, "mv0");
}

TEST(RdmaDeviceSelection, FailuresSayHowFarSelectionGotAndNameTheKey) {
  Cluster c;
  auto s = c.select(opts("mlx5_9"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoDevice);
  EXPECT_NE(s.error.message.find("rdma.device"), std::string::npos);
  EXPECT_NE(s.error.message.find("mlx5_2, rxe0"), std::string::npos) << s.error.message;

  s = c.select(opts("rxe0", "ens1f0v0"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoDevice);
  EXPECT_NE(s.error.message.find("rdma.netdev"), std::string::npos) << s.error.message;

  s = c.select(opts("", "", "192.0.2.99"));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoAddress);
  EXPECT_NE(s.error.message.find("rdma.address"), std::string::npos) << s.error.message;

  FakeSysfs down;
  down.add_port("mlx5_0", 1, false);
  s = select_device(opts("mlx5_0"), {}, down.view(),
                    [](const std::string&) { return std::vector<std::string>{"192.0.2.1"}; });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoDevice);
  EXPECT_NE(s.error.message.find("not active"), std::string::npos) << s.error.message;

  s = select_device(RdmaOptions{}, {}, SysfsView{"/nonexistent"}, c.lookup());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.reason, kNoDevice);
}

// A rail of rdma.devices is named by its place in the list, never as the single rail's keys
// (issue 38): the agent sets RdmaOptions::key to "rdma.devices[<i>]".
TEST(RdmaDeviceSelection, FailuresOfARailNameItsPlaceInRdmaDevices) {
  Cluster c;
  auto rail = [](RdmaOptions o) {
    o.key = "rdma.devices[1]";
    return o;
  };
  const std::pair<RdmaOptions, const char*> cases[] = {
      {rail(opts("mlx5_9")), "config key 'rdma.devices[1].device'"},
      {rail(opts("rxe0", "ens1f0v0")), "config key 'rdma.devices[1].netdev'"},
      {rail(opts("", "", "192.0.2.99")), "config key 'rdma.devices[1].address'"},
      {rail(opts("", "", "", "nvidia.com/sriov_rdma")), "config key 'rdma.devices[1].resourceEnv'"},
  };
  const std::map<std::string, std::string> env = {{"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA", "0000:3b:00.3"}};
  for (const auto& [o, want] : cases) {
    auto s = c.select(o, env);
    ASSERT_FALSE(s.ok()) << want;
    EXPECT_NE(s.error.message.find(want), std::string::npos) << s.error.message;
    for (const char* single : {"'rdma.device'", "'rdma.netdev'", "'rdma.address'", "'rdma.resourceEnv'"}) {
      EXPECT_EQ(s.error.message.find(single), std::string::npos) << s.error.message;
    }
  }
  // A rail found by its device says so by its own key.
  auto s = c.select(rail(opts("mlx5_2")));
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->how, "rdma.devices[1].device");
  // A rail's interface without an address names the rail's netdev key in its advice.
  FakeSysfs bare;
  bare.add_port("mlx5_0");
  bare.gid("mlx5_0", 0, "fe80:0000:0000:0000:0000:0000:0000:0001", kV2, "eth9");
  s = select_device(rail(opts("mlx5_0")), {}, bare.view(),
                    [](const std::string&) { return std::vector<std::string>{}; });
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error.message.find("rdma.devices[1].netdev"), std::string::npos) << s.error.message;
  // A rail's Multus network: its entry's origin names the rail's network key.
  auto a = find_network_attachment(R"([{"name":"ns/rdma","interface":"net1","ips":["10.56.217.5"],)"
                                   R"("device-info":{"pci":{"rdma-device":"mlx5_5"}}}])",
                                   "ns/rdma", "");
  ASSERT_TRUE(a) << a.error().message;
  s = c.select(options_for_attachment(rail(RdmaOptions{}), a.value(), "/etc/podinfo/network-status"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error.message.find("config key 'rdma.devices[1].network' ('ns/rdma'"), std::string::npos)
      << s.error.message;
}

TEST(RdmaDeviceSelection, SecondPortIsUsedWhenTheFirstIsDown) {
  FakeSysfs f;
  f.add_port("mlx5_0", 1, false);
  f.gid("mlx5_0", 2, "0000:0000:0000:0000:0000:ffff:c000:0201", kV2, "p1", 1);
  f.add_port("mlx5_0", 2);
  f.gid("mlx5_0", 3, "0000:0000:0000:0000:0000:ffff:c000:0202", kV2, "p2", 2);
  auto s = select_device(opts("mlx5_0"), {}, f.view(), [](const std::string& nd) {
    return std::vector<std::string>{nd == "p1" ? "192.0.2.1" : "192.0.2.2"};
  });
  ASSERT_TRUE(s.ok()) << s.error.message;
  EXPECT_EQ(s.device->port, 2);
  EXPECT_EQ(s.device->netdev, "p2");
  EXPECT_EQ(s.device->gid_index, 3);
}

// Over the real /sys of the Soft-RoCE VM (RDMIG_RDMA_IP is the rxe device's address): the
// address's RoCE v2 GID, as the kernel filled the table, not entry 0.
TEST(RdmaDeviceSelection, RealSysfsGivesTheRoceV2GidOfTheDevicesAddress) {
  const char* ip = std::getenv("RDMIG_RDMA_IP");
  if (!ip || !*ip) GTEST_SKIP() << "no RDMA device here (set RDMIG_RDMA_IP; runs in the Soft-RoCE VM)";
  RdmaOptions o;
  o.address = ip;
  auto s = select_device(o, process_environment(), SysfsView{});
  ASSERT_TRUE(s.ok()) << s.reason << ": " << s.error.message;
  EXPECT_EQ(s.device->ip, ip);
  EXPECT_EQ(s.device->gid_type, "RoCE v2");
  EXPECT_GT(s.device->gid_index, 0);
  EXPECT_EQ(parse_gid(s.device->gid), gid_of_address(ip)) << s.device->gid;
  std::cout << "chose " << s.device->name << " port " << s.device->port << " netdev " << s.device->netdev
            << " GID " << s.device->gid_index << " (" << s.device->gid_type << ") " << s.device->gid << "\n";
  // The same device by name and by its netdev.
  auto by_name = select_device(opts(s.device->name, "", ip), {}, SysfsView{});
  ASSERT_TRUE(by_name.ok()) << by_name.error.message;
  EXPECT_EQ(by_name.device->gid_index, s.device->gid_index);
  auto by_netdev = select_device(opts("", s.device->netdev, ip), {}, SysfsView{});
  ASSERT_TRUE(by_netdev.ok()) << by_netdev.error.message;
  EXPECT_EQ(by_netdev.device->name, s.device->name);
}

// The design: src/transport knows channels only, never the agent's config. Options of its own
// (transport/rdma/options.h) keep it so; this keeps it true.
TEST(TransportLayering, NoFileUnderSrcTransportIncludesConfig) {
  const fs::path dir = fs::path(rdmig_test::source_dir()) / "src/transport";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  const std::regex include_config(R"(^\s*#\s*include\s*["<]config/)");
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    ++files;
    std::ifstream in(e.path());
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      EXPECT_FALSE(std::regex_search(line, include_config)) << e.path().string() << ":" << n << ": " << line;
    }
  }
  EXPECT_GT(files, 10);
}
