// KubeVirt mode's pure parts: the VMI the node hook receives, the skip rules, the flow hello,
// peers discovered from pod lists, and the kubevirt: config keys.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "config/agent_config.h"
#include "kubevirt/flow_protocol.h"
#include "kubevirt/peer_discovery.h"
#include "kubevirt/vmi.h"

using nlohmann::json;
using namespace rdmig;
using namespace rdmig::kubevirt;

namespace {
json vmi(json migration_state) {
  return json{{"metadata", {{"name", "web-1"}, {"namespace", "prod"}, {"uid", "u-1"}}},
              {"status", {{"migrationState", std::move(migration_state)}}}};
}
json state() {
  return json{{"migrationUid", "m-1"},
              {"sourceNode", "a"},
              {"targetNode", "b"},
              {"targetNodeAddress", "10.244.1.7"},
              {"targetDirectMigrationNodePorts", {{"41231", 0}, {"38803", 49152}, {"39000", 49153}}},
              {"mode", "PreCopy"}};
}
MigrationIntent intent(const json& s) {
  auto r = parse_vmi(vmi(s));
  EXPECT_TRUE(r) << r.error().message;
  return r.value();
}
}  // namespace

TEST(KubevirtVmi, ParsesMigrationStateAndCarriesMemoryAndBlockPortsOnly) {
  auto in = parse_vmi(vmi(state()));
  ASSERT_TRUE(in) << in.error().message;
  EXPECT_EQ(in->vmi.key(), "prod/web-1");
  EXPECT_EQ(in->target_address, "10.244.1.7");
  auto ports = carried_ports(in.value());
  std::sort(ports.begin(), ports.end());
  EXPECT_EQ(ports, (std::vector<uint16_t>{38803, 39000}));
  EXPECT_FALSE(skip_reason(in.value(), "a"));
}

TEST(KubevirtVmi, SkipsPostCopySameNodeCrossClusterAndOtherNodes) {
  auto s = state();
  s["migrationConfiguration"] = {{"allowPostCopy", true}};
  EXPECT_NE(skip_reason(intent(s), "a")->find("post-copy"), std::string::npos);
  s = state();
  s["mode"] = "PostCopy";
  EXPECT_NE(skip_reason(intent(s), "a")->find("post-copy"), std::string::npos);
  s = state();
  s["targetNode"] = "a";
  EXPECT_NE(skip_reason(intent(s), "a")->find("same-node"), std::string::npos);
  s = state();
  s["sourceState"] = json::object();
  s["targetState"] = {{"syncAddress", "10.0.0.1:9185"}};
  EXPECT_NE(skip_reason(intent(s), "a")->find("cross-cluster"), std::string::npos);
  EXPECT_NE(skip_reason(intent(state()), "c")->find("not on the migration's source node"), std::string::npos);
  s = state();
  s["targetDirectMigrationNodePorts"] = {{"41231", 0}};
  EXPECT_NE(skip_reason(intent(s), "a")->find("no memory or block port"), std::string::npos);
}

TEST(KubevirtVmi, RejectsHostileFieldsNamingThem) {
  auto s = state();
  s["targetNodeAddress"] = "10.0.0.1 } ; flush ruleset";
  EXPECT_NE(parse_vmi(vmi(s)).error().message.find("targetNodeAddress"), std::string::npos);
  s = state();
  s["targetDirectMigrationNodePorts"] = {{"70000", 49152}};
  EXPECT_NE(parse_vmi(vmi(s)).error().message.find("not a port"), std::string::npos);
  s = state();
  s["targetDirectMigrationNodePorts"] = {{"1x", 49152}};
  EXPECT_FALSE(parse_vmi(vmi(s)));
  EXPECT_FALSE(parse_vmi(json::array()));
  EXPECT_FALSE(parse_vmi(json{{"metadata", {{"name", "x"}}}}));
  EXPECT_NE(parse_vmi(vmi(json::object())).error().message.find("migrationUid"), std::string::npos);
}

TEST(KubevirtFlowHello, RoundTripsAndValidatesEveryField) {
  FlowHello h;
  h.session = std::string(32, 'a');
  h.mode = "hook";
  h.vmi = VmiRef{"prod", "web-1", "u-1"};
  h.migration_uid = "m-1";
  h.source_node = "a";
  h.target_node = "b";
  h.chunk_size = 1 << 20;
  h.ring_depth = 16;
  h.transport = "rdma";
  auto back = FlowHello::parse(h.to_json());
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->vmi.key(), "prod/web-1");
  for (auto [key, value, field] : std::vector<std::tuple<std::string, json, std::string>>{
           {"session", "ZZ", "hello.session"},
           {"chunkSize", 3, "hello.chunkSize"},
           {"ringDepth", 1, "hello.ringDepth"},
           {"transport", "ib", "hello.transport"},
           {"mode", "x", "hello.mode"},
           {"protocol", 1, "hello.protocol"}}) {
    auto j = h.to_json();
    j[key] = value;
    auto r = FlowHello::parse(j);
    ASSERT_FALSE(r) << key;
    EXPECT_NE(r.error().message.find(field), std::string::npos) << r.error().message;
  }
  // The proof of the shared token depends on the nonce and the session.
  EXPECT_NE(flow_mac("token-0123456789", "n1", h.session), flow_mac("token-0123456789", "n2", h.session));
  EXPECT_EQ(flow_mac("token-0123456789", "n1", h.session).size(), 64u);
}

TEST(KubevirtDiscovery, PeersFromRunningAgentPodsWithTheirNodesHandlerIps) {
  json agents{{"items",
               {{{"spec", {{"nodeName", "a"}}}, {"status", {{"phase", "Running"}, {"hostIP", "192.0.2.1"}}}},
                {{"spec", {{"nodeName", "b"}}}, {"status", {{"phase", "Running"}, {"hostIP", "192.0.2.2"}}}},
                {{"spec", {{"nodeName", "c"}}}, {"status", {{"phase", "Pending"}, {"hostIP", "192.0.2.3"}}}},
                {{"spec", {{"nodeName", "d"}}}, {"status", {{"phase", "Running"}, {"hostIP", "2001:db8::4"}}}}}}};
  json handlers{{"items",
                 {{{"spec", {{"nodeName", "b"}}},
                   {"status", {{"phase", "Running"}, {"podIPs", {{{"ip", "10.244.2.5"}}, {{"ip", "fd00::5"}}}}}}},
                  {{"spec", {{"nodeName", "d"}}}, {"status", {{"phase", "Running"}, {"podIP", "10.244.4.5"}}}}}}};
  auto peers = peers_from_pods(agents, handlers, 7471, "a");
  ASSERT_EQ(peers.size(), 2u);  // not itself, not a pod that is not running
  EXPECT_EQ(peers[0].node, "b");
  EXPECT_EQ(peers[0].agent, "192.0.2.2:7471");
  EXPECT_EQ(peers[0].handler_addresses, (std::vector<std::string>{"10.244.2.5", "fd00::5"}));
  EXPECT_EQ(peers[1].agent, "[2001:db8::4]:7471");
  EXPECT_EQ(peers[1].handler_addresses, (std::vector<std::string>{"10.244.4.5"}));
}

TEST(KubevirtConfig, ReadsTheSectionAndNamesBadKeys) {
  auto c = parse_agent_config(
      "kubevirt: {enabled: true, discovery: kubernetes, staticMode: true, ruleTimeoutSeconds: 10,\n"
      "  peers: [{node: b, agent: '10.0.0.2:7471', handlerAddresses: [10.244.1.7]}]}\n");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_TRUE(c->kubevirt.enabled);
  EXPECT_EQ(c->kubevirt.peers.at(0).handler_addresses.at(0), "10.244.1.7");
  EXPECT_EQ(c->kubevirt.hook_socket, "/var/run/kubevirt/plugins/rdmig.sock");
  for (auto [text, key] : std::vector<std::pair<std::string, std::string>>{
           {"kubevirt: {discovery: dns}", "kubevirt.discovery"},
           {"kubevirt: {ruleTimeoutSeconds: 1}", "kubevirt.ruleTimeoutSeconds"},
           {"kubevirt: {hookSocket: relative.sock}", "kubevirt.hookSocket"},
           {"kubevirt: {peers: [{agent: 'x:1'}]}", "kubevirt.peers[0].node"},
           {"kubevirt: {peerz: []}", "peerz"}}) {
    auto r = parse_agent_config(text);
    ASSERT_FALSE(r) << text;
    EXPECT_NE(r.error().message.find(key), std::string::npos) << r.error().message;
  }
}
