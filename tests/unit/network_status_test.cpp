// Multus mode: the pod's k8s.v1.cni.cncf.io/network-status (a downward API file, hostile input)
// parsed with bounds, the agent's network picked from it, and the wait for the file at start.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "common/units.h"
#include "transport/rdma/network_status.h"

using namespace rdmig;
using namespace rdmig::transport::rdma;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

// As Multus 4 writes it for a pod with the cluster network and one SR-IOV VF with the rdma CNI.
constexpr const char* kStatus = R"([{
    "name": "cbr0",
    "interface": "eth0",
    "ips": ["10.244.1.17"],
    "mac": "0a:58:0a:f4:01:11",
    "default": true,
    "dns": {}
},{
    "name": "rdmig-system/sriov-rdma",
    "interface": "net1",
    "ips": ["fd00:10:56::5", "10.56.217.5"],
    "mac": "ce:8b:2a:6f:01:02",
    "dns": {},
    "device-info": {
        "type": "pci",
        "version": "1.1.0",
        "pci": {"pci-address": "0000:3b:02.2", "rdma-device": "mlx5_5", "pf-pci-address": "0000:3b:00.0"}
    }
}])";

std::string entry(const std::string& name, const std::string& rest) {
  return "{\"name\":\"" + name + "\"," + rest + "}";
}

}  // namespace

TEST(NetworkStatus, PicksTheNetworkByNamespaceAndNameAndReadsItsDeviceInfo) {
  auto a = find_network_attachment(kStatus, "sriov-rdma", "rdmig-system");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->name, "rdmig-system/sriov-rdma");
  EXPECT_EQ(a->interface, "net1");
  EXPECT_EQ(a->rdma_device, "mlx5_5");
  EXPECT_EQ(a->pci_address, "0000:3b:02.2");
  EXPECT_EQ(preferred_address(*a), "10.56.217.5") << "IPv4 first, as for an interface's own addresses";
  // A qualified name needs no pod namespace.
  a = find_network_attachment(kStatus, "rdmig-system/sriov-rdma", "");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->interface, "net1");
}

TEST(NetworkStatus, ABareNameIsLookedUpInThePodsNamespaceOnly) {
  auto a = find_network_attachment(kStatus, "sriov-rdma", "other-ns");
  ASSERT_FALSE(a);
  EXPECT_EQ(a.error().code, Errc::kNotFound);
  EXPECT_NE(a.error().message.find("no entry 'other-ns/sriov-rdma'"), std::string::npos) << a.error().message;
  EXPECT_NE(a.error().message.find("cbr0, rdmig-system/sriov-rdma"), std::string::npos) << "lists what is there";
  // Without the pod's namespace a bare name cannot be qualified: the message says how to name it.
  a = find_network_attachment(kStatus, "sriov-rdma", "");
  ASSERT_FALSE(a);
  EXPECT_NE(a.error().message.find("<namespace>/<name>"), std::string::npos) << a.error().message;
  // An older Multus that wrote the bare name is still matched.
  a = find_network_attachment("[" + entry("sriov-rdma", R"("interface":"net1","ips":["10.0.0.5"])") + "]",
                              "sriov-rdma", "ns");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(qualified_network("a/b", "ns"), "a/b");
  EXPECT_EQ(qualified_network("b", "ns"), "ns/b");
}

TEST(NetworkStatus, EmptyOrMissingEntryIsNotFoundSoTheAgentWaits) {
  for (const char* text : {"", "  \n", "[]"}) {
    auto a = find_network_attachment(text, "ns/net", "");
    ASSERT_FALSE(a) << "'" << text << "'";
    EXPECT_EQ(a.error().code, Errc::kNotFound) << text;
  }
}

TEST(NetworkStatus, MalformedOversizedOrTooDeepIsRefusedAtOnce) {
  const std::string deep = std::string(40, '[') + std::string(40, ']');
  std::string big = "[" + entry("ns/net", R"("interface":"net1","ips":["10.0.0.5"],"pad":")") ;
  big += std::string(kMaxNetworkStatusBytes, 'x') + "\"}]";
  std::string many = "[";
  for (size_t i = 0; i <= kMaxNetworkStatusEntries; ++i) many += (i ? "," : "") + entry("ns/n" + std::to_string(i), "\"x\":1");
  many += "]";
  for (const std::string& text : {std::string("[{\"name\":"), std::string("{\"name\":\"ns/net\"}"), deep, big, many,
                                   std::string("[1,2]"), std::string("null")}) {
    auto a = find_network_attachment(text, "ns/net", "");
    ASSERT_FALSE(a) << text.substr(0, 60);
    EXPECT_EQ(a.error().code, Errc::kInvalidArgument) << text.substr(0, 60) << ": " << a.error().message;
  }
  EXPECT_NE(find_network_attachment(big, "ns/net", "").error().message.find("bytes"), std::string::npos);
}

TEST(NetworkStatus, TheMatchingEntryIsCheckedFieldByField) {
  struct Case {
    const char* rest;
    const char* names;  // in the message
  };
  for (const auto& c : {Case{R"("ips":["10.0.0.5"])", "\"interface\""},
                        Case{R"("interface":7,"ips":["10.0.0.5"])", "\"interface\""},
                        Case{R"("interface":"../../etc","ips":["10.0.0.5"])", "not an interface name"},
                        Case{R"("interface":"net1","ips":"10.0.0.5")", "\"ips\""},
                        Case{R"("interface":"net1","ips":[5])", "\"ips\""},
                        Case{R"("interface":"net1","ips":["10.0.0.5"],"device-info":[])", "\"device-info\""},
                        Case{R"("interface":"net1","ips":["10.0.0.5"],"device-info":{"pci":{"rdma-device":"../mlx5_0"}})",
                             "rdma-device"},
                        Case{R"("interface":"net1","ips":["10.0.0.5"],"device-info":{"pci":{"pci-address":"3b:02.2"}})",
                             "pci-address"}}) {
    auto a = find_network_attachment("[" + entry("ns/net", c.rest) + "]", "ns/net", "");
    ASSERT_FALSE(a) << c.rest;
    EXPECT_EQ(a.error().code, Errc::kInvalidArgument) << c.rest;
    EXPECT_NE(a.error().message.find(c.names), std::string::npos) << c.rest << ": " << a.error().message;
  }
  // Another entry's oddities do not matter: only the agent's network is read.
  auto a = find_network_attachment(
      "[" + entry("ns/other", R"("interface":7)") + "," + entry("ns/net", R"("interface":"net1","ips":["10.0.0.5"])") + "]",
      "ns/net", "");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_TRUE(a->rdma_device.empty());
  EXPECT_TRUE(a->pci_address.empty());
}

TEST(NetworkStatus, NoUsableAddressIsUnavailableAndNamesIpam) {
  auto a = find_network_attachment("[" + entry("ns/net", R"("interface":"net1")") + "]", "ns/net", "");
  ASSERT_FALSE(a);
  EXPECT_EQ(a.error().code, Errc::kUnavailable);
  EXPECT_NE(a.error().message.find("ipam"), std::string::npos) << a.error().message;
  a = find_network_attachment("[" + entry("ns/net", R"("interface":"net1","ips":["fe80::1","bogus"])") + "]", "ns/net", "");
  ASSERT_FALSE(a);
  EXPECT_EQ(a.error().code, Errc::kUnavailable);
  EXPECT_NE(a.error().message.find("link-local"), std::string::npos) << a.error().message;
  // IPv6 only: its global address.
  a = find_network_attachment("[" + entry("ns/net", R"("interface":"net1","ips":["fe80::1","2001:db8::5"])") + "]",
                              "ns/net", "");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(preferred_address(*a), "2001:db8::5");
}

TEST(NetworkStatus, TheSameNetworkAttachedTwiceIsRefusedNamingBothInterfaces) {
  const std::string twice = "[" + entry("ns/net", R"("interface":"net1","ips":["10.0.0.5"])") + "," +
                            entry("ns/net", R"("interface":"net2","ips":["10.0.0.6"])") + "]";
  auto a = find_network_attachment(twice, "net", "ns");
  ASSERT_FALSE(a);
  EXPECT_EQ(a.error().code, Errc::kInvalidArgument);
  EXPECT_NE(a.error().message.find("net1, net2"), std::string::npos) << a.error().message;
}

TEST(NetworkStatus, OptionsComeFromTheEntryAndNameTheirOrigin) {
  RdmaOptions base;
  base.traffic_class = 104;
  auto a = find_network_attachment(kStatus, "rdmig-system/sriov-rdma", "");
  ASSERT_TRUE(a) << a.error().message;
  auto o = options_for_attachment(base, *a, "/etc/podinfo/network-status");
  EXPECT_EQ(o.device, "mlx5_5");
  EXPECT_EQ(o.pci_address, "") << "rdma-device wins over the PCI address";
  EXPECT_EQ(o.netdev, "net1");
  EXPECT_EQ(o.address, "10.56.217.5");
  EXPECT_EQ(o.traffic_class, 104);
  EXPECT_NE(o.origin.find("rdma.network"), std::string::npos) << o.origin;
  EXPECT_NE(o.origin.find("/etc/podinfo/network-status"), std::string::npos) << o.origin;
  a->rdma_device.clear();
  o = options_for_attachment(base, *a, "f");
  EXPECT_EQ(o.device, "");
  EXPECT_EQ(o.pci_address, "0000:3b:02.2");
}

TEST(NetworkStatus, WaitsForTheFileToHoldTheEntryUntilTheDeadline) {
  const fs::path dir = fs::temp_directory_path() / ("rdmig-netstatus-" + random_hex(6));
  fs::create_directories(dir);
  const std::string path = (dir / "network-status").string();
  // Missing: waits the whole time, then names the file and the volume to mount.
  const auto t0 = std::chrono::steady_clock::now();
  auto a = wait_for_network_attachment(path, "rdmig-system/sriov-rdma", "", t0 + 300ms);
  ASSERT_FALSE(a);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms);
  EXPECT_NE(a.error().message.find(path), std::string::npos) << a.error().message;
  EXPECT_NE(a.error().message.find("downward API"), std::string::npos) << a.error().message;
  // Empty at start (the kubelet's first copy), filled a moment later: found.
  std::ofstream(path) << "";
  std::thread writer([&] {
    std::this_thread::sleep_for(200ms);
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp) << kStatus;
    fs::rename(tmp, path);
  });
  a = wait_for_network_attachment(path, "sriov-rdma", "rdmig-system", std::chrono::steady_clock::now() + 10s);
  writer.join();
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->interface, "net1");
  // Malformed: no waiting.
  std::ofstream(path) << "[{";
  const auto t1 = std::chrono::steady_clock::now();
  a = wait_for_network_attachment(path, "sriov-rdma", "rdmig-system", t1 + 10s);
  ASSERT_FALSE(a);
  EXPECT_EQ(a.error().code, Errc::kInvalidArgument);
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 2s);
  // Cancelled (the agent stopping): returns before the deadline.
  std::ofstream(path) << "";
  const auto t2 = std::chrono::steady_clock::now();
  a = wait_for_network_attachment(path, "sriov-rdma", "rdmig-system", t2 + 10s, [] { return true; });
  ASSERT_FALSE(a);
  EXPECT_EQ(a.error().code, Errc::kNotFound);
  EXPECT_LT(std::chrono::steady_clock::now() - t2, 2s);
  fs::remove_all(dir);
}
