#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <tuple>
#include <vector>

#include "config/agent_config.h"
#include "source_dir.h"

using rdmig::parse_agent_config;

TEST(AgentConfig, EmptyDocumentGivesDocumentedDefaults) {
  auto c = parse_agent_config("");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->api.port, 7470);
  EXPECT_EQ(c->data_plane.port, 7471);
  EXPECT_EQ(c->migration.chunk_size, 1u * 1024 * 1024);
  EXPECT_EQ(c->migration.ring_depth, 16u);
  EXPECT_EQ(c->transport, rdmig::TransportKind::kAuto);
}

TEST(AgentConfig, ShippedAgentYamlLoadsAndEqualsDefaults) {
  auto c = rdmig::load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  const rdmig::AgentConfig d;
  EXPECT_EQ(c->migration.chunk_size, d.migration.chunk_size);
  EXPECT_EQ(c->migration.ring_depth, d.migration.ring_depth);
  EXPECT_EQ(c->migration.verify_chunks, d.migration.verify_chunks);
  EXPECT_EQ(c->api.token_file, d.api.token_file);
  EXPECT_EQ(c->state_dir, d.state_dir);
  EXPECT_EQ(c->rdma.network_status_file, d.rdma.network_status_file);
  EXPECT_EQ(c->rdma.network_wait_seconds, d.rdma.network_wait_seconds);
}

TEST(AgentConfig, VerifyChunksIsOffByDefaultAndABoolean) {
  EXPECT_FALSE(parse_agent_config("")->migration.verify_chunks);
  auto c = parse_agent_config("migration:\n  verifyChunks: true\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_TRUE(c->migration.verify_chunks);
  auto bad = parse_agent_config("migration:\n  verifyChunks: sometimes\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("migration.verifyChunks"), std::string::npos) << bad.error().message;
}

TEST(AgentConfig, ParsesQuantityChunkSize) {
  auto c = parse_agent_config("migration:\n  chunkSize: 64Ki\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->migration.chunk_size, 65536u);
}

TEST(AgentConfig, RejectsChunkSizeThatIsNotPowerOfTwo) {
  auto c = parse_agent_config("migration:\n  chunkSize: 3Mi\n");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("migration.chunkSize"), std::string::npos) << c.error().message;
  EXPECT_NE(c.error().message.find("power of two"), std::string::npos);
}

TEST(AgentConfig, RejectsChunkSizeOutOfRange) {
  for (const char* v : {"32Ki", "2Gi"}) {
    auto c = parse_agent_config(std::string("migration:\n  chunkSize: ") + v + "\n");
    ASSERT_FALSE(c.ok()) << v;
    EXPECT_NE(c.error().message.find("migration.chunkSize"), std::string::npos);
  }
}

TEST(AgentConfig, RejectsUnknownKeyNamingIt) {
  auto c = parse_agent_config("migration:\n  chunksize: 4Mi\n");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("migration.chunksize"), std::string::npos) << c.error().message;
  auto top = parse_agent_config("trasnport: tcp\n");
  ASSERT_FALSE(top.ok());
  EXPECT_NE(top.error().message.find("trasnport"), std::string::npos);
}

TEST(AgentConfig, RejectsUnknownTransport) {
  auto c = parse_agent_config("transport: infiniband\n");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("transport"), std::string::npos);
  EXPECT_NE(c.error().message.find("infiniband"), std::string::npos);
}

TEST(AgentConfig, TcpSpliceDefaultsToAutoAndTakesOnAndOff) {
  auto d = parse_agent_config("");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->tcp.splice, rdmig::transport::SpliceMode::kAuto);
  for (auto [text, mode] : {std::pair{"on", rdmig::transport::SpliceMode::kOn}, std::pair{"off", rdmig::transport::SpliceMode::kOff},
                            std::pair{"auto", rdmig::transport::SpliceMode::kAuto}}) {
    auto c = parse_agent_config(std::string("tcp:\n  splice: ") + text + "\n");
    ASSERT_TRUE(c.ok()) << text << ": " << c.error().message;
    EXPECT_EQ(c->tcp.splice, mode) << text;
  }
}

TEST(AgentConfig, RejectsBadTcpSpliceNamingTheKey) {
  for (const char* doc : {"tcp:\n  splice: maybe\n", "tcp:\n  splice: [on]\n", "tcp:\n  zerocopy: on\n", "tcp: on\n"}) {
    auto c = parse_agent_config(doc);
    ASSERT_FALSE(c.ok()) << doc;
    EXPECT_NE(c.error().message.find("tcp"), std::string::npos) << c.error().message;
  }
  auto c = parse_agent_config("tcp:\n  splice: maybe\n");
  EXPECT_NE(c.error().message.find("tcp.splice"), std::string::npos) << c.error().message;
  EXPECT_NE(c.error().message.find("maybe"), std::string::npos) << c.error().message;
}

TEST(AgentConfig, RejectsBadPortAndDepthNamingTheKey) {
  auto p = parse_agent_config("api:\n  port: 70000\n");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message.find("api.port"), std::string::npos);
  auto d = parse_agent_config("migration:\n  ringDepth: -1\n");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message.find("migration.ringDepth"), std::string::npos);
  auto l = parse_agent_config("logLevel: loud\n");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.error().message.find("logLevel"), std::string::npos);
}

TEST(AgentConfig, RejectsRelativeStateDirAndMalformedYaml) {
  EXPECT_FALSE(parse_agent_config("stateDir: run/rdmig\n").ok());
  auto bad = parse_agent_config("api: [1, 2\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("YAML"), std::string::npos);
}

TEST(AgentConfig, RdmaTrafficClassIsAToSByteWithoutEcnBits) {
  auto c = parse_agent_config("");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rdma.traffic_class, -1) << "unset: the kernel's default";
  c = parse_agent_config("rdma:\n  trafficClass: 104\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rdma.traffic_class, 104);
  c = parse_agent_config("rdma:\n  trafficClass: 0\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rdma.traffic_class, 0);
  for (const char* doc : {"rdma:\n  trafficClass: 256\n", "rdma:\n  trafficClass: -4\n", "rdma:\n  trafficClass: 105\n",
                          "rdma:\n  trafficClass: af31\n"}) {
    auto bad = parse_agent_config(doc);
    ASSERT_FALSE(bad.ok()) << doc;
    EXPECT_NE(bad.error().message.find("rdma.trafficClass"), std::string::npos) << bad.error().message;
  }
  EXPECT_NE(parse_agent_config("rdma:\n  trafficClass: 105\n").error().message.find("ECN"), std::string::npos);
}

TEST(AgentConfig, RdmaAddressMustBeAnIpAddress) {
  auto c = parse_agent_config("rdma:\n  netdev: ens1f0v0.100\n  address: 2001:db8::7\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rdma.address, "2001:db8::7");
  EXPECT_EQ(c->rdma.netdev, "ens1f0v0.100");
  auto bad = parse_agent_config("rdma:\n  address: node-a.example\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("rdma.address"), std::string::npos) << bad.error().message;
  bad = parse_agent_config("rdma:\n  serviceLevel: 3\n");
  ASSERT_FALSE(bad.ok()) << "unknown keys are refused";
}

TEST(AgentConfig, SingleRdmaKeysAreOneRail) {
  auto c = parse_agent_config("rdma:\n  device: mlx5_0\n  trafficClass: 104\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  const auto rails = c->rdma.rails();
  ASSERT_EQ(rails.size(), 1u);
  EXPECT_EQ(rails[0].device, "mlx5_0");
  EXPECT_EQ(rails[0].traffic_class, 104);
}

TEST(AgentConfig, RdmaDevicesListsRailsInOrderWithTheirOwnKeys) {
  auto c = parse_agent_config(
      "rdma:\n  trafficClass: 104\n  devices:\n"
      "    - netdev: ens1f0\n"
      "    - device: mlx5_1\n      address: 10.99.2.1\n      trafficClass: 8\n"
      "    - resourceEnv: nvidia.com/rail3\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  const auto rails = c->rdma.rails();
  ASSERT_EQ(rails.size(), 3u);
  EXPECT_EQ(rails[0].netdev, "ens1f0");
  EXPECT_EQ(rails[0].traffic_class, 104) << "a rail's trafficClass defaults to rdma.trafficClass";
  EXPECT_EQ(rails[1].device, "mlx5_1");
  EXPECT_EQ(rails[1].address, "10.99.2.1");
  EXPECT_EQ(rails[1].traffic_class, 8);
  EXPECT_EQ(rails[2].resource_env, "nvidia.com/rail3");
}

TEST(AgentConfig, RdmaDevicesErrorsNameTheRailAndField) {
  const auto error_of = [](const std::string& doc) {
    auto c = parse_agent_config(doc);
    return c.ok() ? std::string("(accepted)") : c.error().message;
  };
  EXPECT_NE(error_of("rdma:\n  devices:\n    - netdev: a\n    - netdev: b\n      address: not-an-ip\n")
                .find("rdma.devices[1].address"),
            std::string::npos);
  EXPECT_NE(error_of("rdma:\n  devices:\n    - netdev: a\n    - netdev: b\n      trafficClass: 105\n")
                .find("rdma.devices[1].trafficClass"),
            std::string::npos);
  EXPECT_NE(error_of("rdma:\n  devices:\n    - netdev: a\n    - netdev: b\n      serviceLevel: 3\n")
                .find("rdma.devices[1]"),
            std::string::npos);
  EXPECT_NE(error_of("rdma:\n  devices:\n    - netdev: a\n    - {}\n").find("rdma.devices[1]"), std::string::npos);
  EXPECT_NE(error_of("rdma:\n  devices:\n    - netdev: a\n    - netdev: a\n").find("rdma.devices[1]"),
            std::string::npos)
      << "the same device twice";
  EXPECT_NE(error_of("rdma:\n  devices: []\n").find("rdma.devices"), std::string::npos);
  EXPECT_NE(error_of("rdma:\n  devices: mlx5_0\n").find("rdma.devices"), std::string::npos);
  EXPECT_NE(error_of("rdma:\n  netdev: x\n  devices:\n    - netdev: a\n").find("rdma.netdev"), std::string::npos)
      << "the single keys and the list exclude each other";
}

// The same address spelled two ways is one NIC: refused as two rails (issue 38).
TEST(AgentConfig, RdmaDevicesWithOneAddressSpelledTwoWaysAreTheSameRail) {
  for (const auto& [a, b] : {std::pair{"fd00::1", "fd00:0:0::1"}, std::pair{"fd00::1", "FD00:0000::0001"},
                             std::pair{"10.0.0.1", "::ffff:10.0.0.1"}}) {
    auto c = parse_agent_config(std::string("rdma:\n  devices:\n    - address: '") + a + "'\n    - address: '" + b +
                                "'\n");
    ASSERT_FALSE(c.ok()) << a << " and " << b << " accepted as two rails";
    EXPECT_NE(c.error().message.find("rdma.devices[1]"), std::string::npos) << c.error().message;
    EXPECT_NE(c.error().message.find("same device as rdma.devices[0]"), std::string::npos) << c.error().message;
  }
  auto c = parse_agent_config("rdma:\n  devices:\n    - address: 'fd00::1'\n    - address: 'fd00::2'\n");
  EXPECT_TRUE(c.ok()) << c.error().message;
}

// dataPlane.allowLoopbackPeers: false unless the config says it is a lab; a boolean.
TEST(AgentConfig, AllowLoopbackPeersIsOffByDefaultAndABoolean) {
  EXPECT_FALSE(parse_agent_config("")->data_plane.allow_loopback_peers);
  EXPECT_FALSE(rdmig::load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml")->data_plane.allow_loopback_peers);
  auto c = parse_agent_config("dataPlane:\n  allowLoopbackPeers: true\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_TRUE(c->data_plane.allow_loopback_peers);
  EXPECT_TRUE(rdmig::peer_dial_policy(c->data_plane).allows_loopback());
  EXPECT_FALSE(rdmig::peer_dial_policy(rdmig::DataPlaneConfig{}).allows_loopback());
  for (const char* bad : {"yes", "1", "[true]", "{a: 1}", "'true '"}) {
    auto r = parse_agent_config(std::string("dataPlane:\n  allowLoopbackPeers: ") + bad + "\n");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("dataPlane.allowLoopbackPeers"), std::string::npos) << r.error().message;
  }
}

// dataPlane.tls: off by default (and in the shipped agent.yaml); off|on (YAML booleans too).
TEST(AgentConfig, DataPlaneTlsIsOffByDefaultAndOffOrOn) {
  EXPECT_FALSE(parse_agent_config("")->data_plane.tls);
  EXPECT_FALSE(rdmig::load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml")->data_plane.tls);
  for (const char* on : {"on", "'on'", "true"}) {
    auto c = parse_agent_config(std::string("dataPlane:\n  tls: ") + on + "\n");
    ASSERT_TRUE(c.ok()) << c.error().message;
    EXPECT_TRUE(c->data_plane.tls) << on;
  }
  for (const char* off : {"off", "false"}) {
    auto c = parse_agent_config(std::string("dataPlane:\n  tls: ") + off + "\n");
    ASSERT_TRUE(c.ok()) << c.error().message;
    EXPECT_FALSE(c->data_plane.tls) << off;
  }
  for (const char* bad : {"auto", "yes", "1", "[on]", "{a: 1}", "''"}) {
    auto r = parse_agent_config(std::string("dataPlane:\n  tls: ") + bad + "\n");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("dataPlane.tls"), std::string::npos) << r.error().message;
  }
}

// dataPlane.failoverPaths: [rail, address, tcp] by default; some of them, each once, in order.
TEST(AgentConfig, FailoverPathsDefaultToRailThenAddressThenTcpAndTakeEachOnce) {
  const std::vector<std::string> dflt{"rail", "address", "tcp"};
  EXPECT_EQ(parse_agent_config("")->data_plane.failover_paths, dflt);
  EXPECT_EQ(rdmig::load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml")->data_plane.failover_paths, dflt);
  for (const auto& [yaml, want] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"[tcp]", {"tcp"}}, {"[rail]", {"rail"}}, {"[tcp, rail]", {"tcp", "rail"}}, {"[address]", {"address"}},
           {"[address, rail, tcp]", {"address", "rail", "tcp"}}}) {
    auto c = parse_agent_config("dataPlane:\n  failoverPaths: " + yaml + "\n");
    ASSERT_TRUE(c.ok()) << c.error().message;
    EXPECT_EQ(c->data_plane.failover_paths, want) << yaml;
    EXPECT_EQ(c->data_plane.fails_over_to("rail"), yaml.find("rail") != std::string::npos) << yaml;
  }
  for (const char* bad : {"[]", "[rail, rail]", "[tcp, tcp]", "[gid]", "rail", "[rail, tcp, rail]", "[[rail]]",
                          "[address, tcp, address]", "[rail, address, tcp, rail]"}) {
    auto r = parse_agent_config(std::string("dataPlane:\n  failoverPaths: ") + bad + "\n");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("dataPlane.failoverPaths"), std::string::npos) << r.error().message;
  }
}

// rdma.alternateAddresses / rdma.devices[i].alternateAddresses: other addresses of the rail's
// device (failover paths only); IP literals, at most 4, none twice, none another rail's.
TEST(AgentConfig, AlternateAddressesAreOtherAddressesOfTheRailsDevice) {
  auto one = parse_agent_config("rdma:\n  device: rxe0\n  address: 10.99.0.1\n  alternateAddresses: [10.100.0.1, fd00:100::1]\n");
  ASSERT_TRUE(one.ok()) << one.error().message;
  EXPECT_EQ(one->rdma.rails().front().alternate_addresses, (std::vector<std::string>{"10.100.0.1", "fd00:100::1"}));
  EXPECT_TRUE(parse_agent_config("")->rdma.alternate_addresses.empty());
  auto two = parse_agent_config(
      "rdma:\n  devices:\n  - device: rxe0\n    alternateAddresses: [10.100.0.1]\n  - device: rxe1\n"
      "    alternateAddresses: [10.101.0.1]\n");
  ASSERT_TRUE(two.ok()) << two.error().message;
  EXPECT_EQ(two->rdma.rails()[1].alternate_addresses, (std::vector<std::string>{"10.101.0.1"}));
  for (const auto& [yaml, key] : std::vector<std::pair<std::string, std::string>>{
           {"rdma:\n  alternateAddresses: [eth0]\n", "rdma.alternateAddresses[0]"},
           {"rdma:\n  alternateAddresses: 10.100.0.1\n", "rdma.alternateAddresses"},
           {"rdma:\n  alternateAddresses: [10.0.0.1, 10.0.0.2, 10.0.0.3, 10.0.0.4, 10.0.0.5]\n", "rdma.alternateAddresses"},
           {"rdma:\n  alternateAddresses: [10.0.0.1, 10.0.0.1]\n", "rdma.alternateAddresses[1]"},
           {"rdma:\n  address: 10.0.0.1\n  alternateAddresses: ['::ffff:10.0.0.1']\n", "rdma.alternateAddresses[0]"},
           {"rdma:\n  network: rdma-net\n  alternateAddresses: [10.0.0.1]\n", "rdma.alternateAddresses"},
           {"rdma:\n  alternateAddresses: [10.0.0.1]\n  devices:\n  - device: rxe0\n", "rdma.alternateAddresses"},
           {"rdma:\n  devices:\n  - device: rxe0\n    alternateAddresses: [10.0.0.9]\n  - device: rxe1\n"
            "    address: 10.0.0.9\n", "rdma.devices[1]"},
           {"rdma:\n  devices:\n  - device: rxe0\n    alternateAddresses: [10.0.0.9]\n  - device: rxe1\n"
            "    alternateAddresses: [10.0.0.9]\n", "rdma.devices[1]"}}) {
    auto r = parse_agent_config(yaml);
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_NE(r.error().message.find(key), std::string::npos) << yaml << ": " << r.error().message;
  }
}

// kubevirt.plaintextMigrations: carry (default) or refuse.
TEST(AgentConfig, KubevirtPlaintextMigrationsIsCarryOrRefuse) {
  EXPECT_EQ(parse_agent_config("")->kubevirt.plaintext_migrations, "carry");
  EXPECT_EQ(rdmig::load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml")->kubevirt.plaintext_migrations, "carry");
  auto c = parse_agent_config("kubevirt:\n  plaintextMigrations: refuse\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->kubevirt.plaintext_migrations, "refuse");
  for (const char* bad : {"drop", "Carry", "[carry]", "true"}) {
    auto r = parse_agent_config(std::string("kubevirt:\n  plaintextMigrations: ") + bad + "\n");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("kubevirt.plaintextMigrations"), std::string::npos) << r.error().message;
  }
}

// kubevirt.carryPostCopy: off by default (agent.yaml too); on only with dataPlane.failover on.
TEST(AgentConfig, KubevirtCarryPostCopyIsOffByDefaultAndNeedsFailover) {
  EXPECT_FALSE(parse_agent_config("")->kubevirt.carry_post_copy);
  EXPECT_FALSE(rdmig::load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml")->kubevirt.carry_post_copy);
  auto c = parse_agent_config("dataPlane:\n  failover: on\nkubevirt:\n  carryPostCopy: true\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_TRUE(c->kubevirt.carry_post_copy);
  for (const char* yaml : {"kubevirt:\n  carryPostCopy: true\n",
                           "dataPlane:\n  failover: off\nkubevirt:\n  carryPostCopy: true\n",
                           "dataPlane:\n  failover: on\nkubevirt:\n  carryPostCopy: sometimes\n",
                           "dataPlane:\n  failover: on\nkubevirt:\n  carryPostCopy: [true]\n"}) {
    auto r = parse_agent_config(yaml);
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_NE(r.error().message.find("kubevirt.carryPostCopy"), std::string::npos) << r.error().message;
  }
  auto off = parse_agent_config("kubevirt:\n  carryPostCopy: false\n");
  ASSERT_TRUE(off.ok()) << off.error().message;
}

TEST(AgentConfig, RdmaNetworkNamesAMultusNetworkAndItsStatusFile) {
  auto c = parse_agent_config("rdma:\n  network: sriov-rdma\n  trafficClass: 104\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rdma.network, "sriov-rdma");
  EXPECT_EQ(c->rdma.network_status_file, "/etc/podinfo/network-status");
  EXPECT_EQ(c->rdma.network_wait_seconds, 30u);
  ASSERT_EQ(c->rdma.rails().size(), 1u);
  EXPECT_EQ(c->rdma.rails()[0].network, "sriov-rdma");
  EXPECT_EQ(c->rdma.rails()[0].traffic_class, 104);
  c = parse_agent_config(
      "rdma:\n  networkStatusFile: /run/podinfo/ns\n  networkWaitSeconds: 0\n  devices:\n"
      "    - network: rdmig-system/rail0\n    - network: rdmig-system/rail1\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rdma.network_status_file, "/run/podinfo/ns");
  EXPECT_EQ(c->rdma.network_wait_seconds, 0u);
  EXPECT_EQ(c->rdma.connect_timeout_seconds, 15u) << "the default";
  ASSERT_EQ(c->rdma.rails().size(), 2u);
  EXPECT_EQ(c->rdma.rails()[1].network, "rdmig-system/rail1");
}

TEST(AgentConfig, RdmaNetworkExcludesTheKeysItsEntryGives) {
  const auto error_of = [](const std::string& doc) {
    auto c = parse_agent_config(doc);
    return c.ok() ? std::string("(accepted)") : c.error().message;
  };
  // One source of truth: the entry gives device, interface and address; a key beside it is refused.
  for (const char* key : {"device: mlx5_0", "netdev: net1", "address: 10.0.0.5", "resourceEnv: nvidia.com/x"}) {
    const auto msg = error_of(std::string("rdma:\n  network: sriov-rdma\n  ") + key + "\n");
    EXPECT_NE(msg.find("cannot be set beside rdma.network"), std::string::npos) << key << ": " << msg;
    const std::string name = std::string(key).substr(0, std::string(key).find(':'));
    EXPECT_NE(msg.find("rdma." + name), std::string::npos) << key << ": " << msg;
  }
  EXPECT_NE(error_of("rdma:\n  devices:\n    - network: a\n      netdev: net1\n").find("rdma.devices[0].netdev"),
            std::string::npos);
  EXPECT_NE(error_of("rdma:\n  network: a\n  devices:\n    - network: b\n").find("rdma.network"), std::string::npos)
      << "the single form and the rails exclude each other";
  EXPECT_NE(error_of("rdma:\n  devices:\n    - network: a\n    - network: a\n").find("rdma.devices[1]"),
            std::string::npos)
      << "the same network twice";
  for (const char* bad : {"Sriov", "a/b/c", "ns/", "/net", "net@net1", "-net", "a_b"}) {
    EXPECT_NE(error_of(std::string("rdma:\n  network: '") + bad + "'\n").find("rdma.network"), std::string::npos)
        << bad;
  }
  EXPECT_NE(error_of("rdma:\n  networkStatusFile: podinfo/ns\n").find("rdma.networkStatusFile"), std::string::npos);
  EXPECT_NE(error_of("rdma:\n  networkWaitSeconds: 60\n").find("rdma.networkWaitSeconds"), std::string::npos)
      << "longer than the liveness probe allows before the probe server starts";
  EXPECT_NE(error_of("rdma:\n  connectTimeoutSeconds: 0\n").find("rdma.connectTimeoutSeconds"), std::string::npos);
  EXPECT_NE(error_of("rdma:\n  connectTimeoutSeconds: 61\n").find("rdma.connectTimeoutSeconds"), std::string::npos)
      << "beyond what a target waits for the source's channels";
}

TEST(AgentConfig, PathCheckLimitsDefaultToTheFormerConstantsAndTheShippedYamlSpellsThemOut) {
  auto c = parse_agent_config("");
  ASSERT_TRUE(c.ok()) << c.error().message;
  const auto& p = c->path_check;
  EXPECT_EQ(p.max_concurrent, 4u);
  EXPECT_EQ(p.history_size, 32u);
  EXPECT_EQ(p.default_bytes, uint64_t{1} << 30);
  EXPECT_EQ(p.max_bytes, uint64_t{64} << 30);
  EXPECT_EQ(p.max_channels, 16u);
  EXPECT_EQ(p.default_timeout_seconds, 120u);
  EXPECT_EQ(p.max_timeout_seconds, 3600u);
  EXPECT_EQ(p.stall_timeout_seconds, 10u);
  EXPECT_EQ(p.rtt_samples, 5u);
  auto shipped = rdmig::load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml");
  ASSERT_TRUE(shipped.ok()) << shipped.error().message;
  const auto& s = shipped->path_check;
  EXPECT_EQ(std::tie(s.max_concurrent, s.history_size, s.default_bytes, s.max_bytes, s.max_channels,
                     s.default_timeout_seconds, s.max_timeout_seconds, s.stall_timeout_seconds, s.rtt_samples),
            std::tie(p.max_concurrent, p.history_size, p.default_bytes, p.max_bytes, p.max_channels,
                     p.default_timeout_seconds, p.max_timeout_seconds, p.stall_timeout_seconds, p.rtt_samples));
}

TEST(AgentConfig, PathCheckLimitsAreConfigurable) {
  auto c = parse_agent_config(
      "pathCheck:\n  maxConcurrent: 2\n  historySize: 8\n  defaultBytes: 8Mi\n  maxBytes: 16Mi\n"
      "  maxChannels: 2\n  defaultTimeoutSeconds: 30\n  maxTimeoutSeconds: 60\n  stallTimeoutSeconds: 3\n"
      "  rttSamples: 9\n");
  ASSERT_TRUE(c.ok()) << c.error().message;
  const auto& p = c->path_check;
  EXPECT_EQ(p.max_concurrent, 2u);
  EXPECT_EQ(p.history_size, 8u);
  EXPECT_EQ(p.default_bytes, 8u << 20);
  EXPECT_EQ(p.max_bytes, 16u << 20);
  EXPECT_EQ(p.max_channels, 2u);
  EXPECT_EQ(p.default_timeout_seconds, 30u);
  EXPECT_EQ(p.max_timeout_seconds, 60u);
  EXPECT_EQ(p.stall_timeout_seconds, 3u);
  EXPECT_EQ(p.rtt_samples, 9u);
}

TEST(AgentConfig, RejectsBadPathCheckLimitsNamingTheKey) {
  for (const auto& [yaml, key] : std::vector<std::pair<std::string, std::string>>{
           {"pathCheck: {maxConcurrent: 0}", "pathCheck.maxConcurrent"},
           {"pathCheck: {maxConcurrent: 65}", "pathCheck.maxConcurrent"},
           {"pathCheck: {historySize: 0}", "pathCheck.historySize"},
           {"pathCheck: {maxBytes: 0}", "pathCheck.maxBytes"},
           {"pathCheck: {maxBytes: 2Ti}", "pathCheck.maxBytes"},
           {"pathCheck: {maxBytes: lots}", "pathCheck.maxBytes"},
           {"pathCheck: {maxBytes: 1Gi, defaultBytes: 2Gi}", "pathCheck.defaultBytes"},
           {"pathCheck: {maxChannels: 0}", "pathCheck.maxChannels"},
           {"pathCheck: {maxChannels: 65}", "pathCheck.maxChannels"},
           {"pathCheck: {maxTimeoutSeconds: 4}", "pathCheck.maxTimeoutSeconds"},
           {"pathCheck: {maxTimeoutSeconds: 60, defaultTimeoutSeconds: 120}", "pathCheck.defaultTimeoutSeconds"},
           {"pathCheck: {stallTimeoutSeconds: 0}", "pathCheck.stallTimeoutSeconds"},
           {"pathCheck: {rttSamples: 0}", "pathCheck.rttSamples"},
           {"pathCheck: {maxconcurrent: 2}", "pathCheck.maxconcurrent"},
       }) {
    auto c = parse_agent_config(yaml);
    ASSERT_FALSE(c.ok()) << yaml;
    EXPECT_NE(c.error().message.find(key), std::string::npos) << yaml << ": " << c.error().message;
  }
}
