// KubeVirt mode's pure parts: the VMI the node hook receives, the skip rules, the flow hello,
// peers discovered from pod lists, the kubevirt: config keys, the launcher's libvirt URI and
// the addresses a target agent may dial.
#include <gtest/gtest.h>
#include <unistd.h>

#include <functional>
#include <iterator>
#include <sstream>

#include <nlohmann/json.hpp>

#include "api/probe_server.h"
#include "config/agent_config.h"
#include "common/net.h"
#include "kubevirt/flow/flow_protocol.h"
#include "kubevirt/hook/handler_identity.h"
#include "kubevirt/hook/hook_server.h"
#include "kubevirt/flow/kubevirt_metrics.h"
#include "kubevirt/flow/libvirt_stats.h"
#include "kubevirt/peers/peer_discovery.h"
#include "kubevirt/flow/sessions.h"
#include "kubevirt/hook/vmi.h"
#include "kubevirt/hook/vmi_api.h"

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

TEST(KubevirtVmiApi, AHookDocumentArmsOnlyWhatTheApiPublishedAndNamesTheFirstDifference) {
  const MigrationIntent caller = intent(state());
  auto same = confirm_hook_document(caller, vmi(state()));
  ASSERT_TRUE(same) << same.error().message;
  EXPECT_EQ(same->target_address, "10.244.1.7");
  // The API's values are the ones used: a post-copy switch the caller left out is the API's.
  json pc = state();
  pc["migrationConfiguration"] = {{"allowPostCopy", true}};
  auto api_pc = confirm_hook_document(caller, vmi(pc));
  ASSERT_TRUE(api_pc);
  EXPECT_TRUE(api_pc->allow_post_copy);
  auto refused = [&](json api, const std::string& field) {
    auto r = confirm_hook_document(caller, api);
    ASSERT_FALSE(r) << field;
    EXPECT_EQ(r.error().code, Errc::kFailedPrecondition);
    EXPECT_NE(r.error().message.find(field), std::string::npos) << r.error().message;
  };
  json other_uid = vmi(state());
  other_uid["metadata"]["uid"] = "u-2";
  refused(other_uid, "metadata.uid");
  json s = state();
  s["migrationUid"] = "m-2";
  refused(vmi(s), "migrationUid");
  s = state();
  s["targetNode"] = "c";
  refused(vmi(s), "targetNode");
  s = state();
  s["targetNodeAddress"] = "10.244.1.8";
  refused(vmi(s), "targetNodeAddress");
  s = state();
  s["targetDirectMigrationNodePorts"] = {{"41231", 0}, {"38804", 49152}, {"39000", 49153}};
  refused(vmi(s), "targetDirectMigrationNodePorts");
  // The libvirt control port (class 0) is not carried: a different one there arms the same.
  s = state();
  s["targetDirectMigrationNodePorts"] = {{"41232", 0}, {"38803", 49152}, {"39000", 49153}};
  EXPECT_TRUE(confirm_hook_document(caller, vmi(s)));
  json no_state = vmi(state());
  no_state["status"].erase("migrationState");
  refused(no_state, "migrationState");
}

TEST(KubevirtVmiApi, ATargetDialsOnlyThePublishedAddressAndCarriedPortsOfItsOwnMigration) {
  const VmiRef ref{"prod", "web-1", "u-1"};
  auto pub = published_target(vmi(state()), ref, "m-1", "b", "a");
  ASSERT_TRUE(pub) << pub.error().message;
  EXPECT_TRUE(pub->allows("10.244.1.7", 38803));
  EXPECT_TRUE(pub->allows("10.244.1.7", 39000));
  EXPECT_FALSE(pub->allows("10.244.1.7", 41231)) << "libvirt's control port is never carried";
  EXPECT_FALSE(pub->allows("10.244.1.7", 8443)) << "virt-handler's console server is not published";
  EXPECT_FALSE(pub->allows("10.244.1.8", 38803));
  EXPECT_EQ(pub->describe(), "10.244.1.7:[38803,39000]");
  auto refused = [](Result<PublishedTarget> r, const std::string& field) {
    ASSERT_FALSE(r) << field;
    EXPECT_NE(r.error().message.find(field), std::string::npos) << r.error().message;
  };
  refused(published_target(vmi(state()), VmiRef{"prod", "web-1", "u-9"}, "m-1", "b", "a"), "metadata.uid");
  refused(published_target(vmi(state()), ref, "m-9", "b", "a"), "migrationUid");
  refused(published_target(vmi(state()), ref, "m-1", "a", "a"), "targetNode");
  refused(published_target(vmi(state()), ref, "m-1", "", "a"), "targetNode");
  // The session's sourceNode must be the API's migrationState.sourceNode: named as the hello's field.
  refused(published_target(vmi(state()), ref, "m-1", "b", "c"), "hello.sourceNode");
  json s = state();
  s["targetNodeAddress"] = "127.0.0.1";
  refused(published_target(vmi(s), ref, "m-1", "b", "a"), "targetNodeAddress");
  s = state();
  s["targetDirectMigrationNodePorts"] = {{"41231", 0}};
  refused(published_target(vmi(s), ref, "m-1", "b", "a"), "targetDirectMigrationNodePorts");
  // IPv6: the same address however it is spelt.
  s = state();
  s["targetNodeAddress"] = "fd00::7";
  auto v6 = published_target(vmi(s), ref, "m-1", "b", "a");
  ASSERT_TRUE(v6);
  EXPECT_TRUE(v6->allows("fd00:0::7", 38803));
  EXPECT_FALSE(v6->allows("fd00::8", 38803));
}

TEST(KubevirtVmi, SkipsPostCopySameNodeCrossClusterAndOtherNodes) {
  auto s = state();
  s["migrationConfiguration"] = {{"allowPostCopy", true}};
  EXPECT_NE(skip_reason(intent(s), "a")->find("post-copy"), std::string::npos);
  EXPECT_NE(skip_reason(intent(s), "a")->find("kubevirt.carryPostCopy is off"), std::string::npos);
  EXPECT_FALSE(skip_reason(intent(s), "a", /*carry_post_copy=*/true).has_value());
  EXPECT_TRUE(may_post_copy(intent(s)));
  EXPECT_FALSE(may_post_copy(intent(state())));
  s = state();
  s["mode"] = "PostCopy";
  EXPECT_NE(skip_reason(intent(s), "a")->find("post-copy"), std::string::npos);
  EXPECT_FALSE(skip_reason(intent(s), "a", true).has_value());
  EXPECT_TRUE(may_post_copy(intent(s)));
  // carryPostCopy lifts only the post-copy rule.
  s["targetNode"] = "a";
  EXPECT_NE(skip_reason(intent(s), "a", true)->find("same-node"), std::string::npos);
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

// A flow hello with every field set.
static session::Hello sample_hello(const std::string& transport) {
  session::Hello h;
  h.kind = session::HelloKind::kFlow;
  h.session = std::string(32, 'a');
  h.nonce = std::string(32, 'f');
  h.mode = "hook";
  h.vmi = VmiRef{"prod", "web-1", "u-1"};
  h.migration_uid = "m-1";
  h.source_node = "a";
  h.target_node = "b";
  h.chunk_size = 1 << 20;
  h.ring_depth = 16;
  h.transport = transport;
  return h;
}

TEST(KubevirtFlowProof, CoversEveryFieldOfTheHelloBothNoncesAndTheRole) {
  session::Hello h = sample_hello("tcp");
  h.rdma_rails = {{0, "10.10.0.1", 4096}, {1, "10.10.1.1", 4096}};
  const std::string token = "token-0123456789";
  const std::string proof = flow_proof(token, "source", h, "n1");
  EXPECT_EQ(proof.size(), 64u);
  // As the target re-reads it from the wire: the same proof.
  auto parsed = session::Hello::parse(h.to_json(), session::Purpose::kFlow);
  ASSERT_TRUE(parsed) << parsed.error().message;
  EXPECT_EQ(flow_proof(token, "source", parsed.value(), "n1"), proof);
  EXPECT_NE(flow_proof(token, "target", h, "n1"), proof) << "a proof of one role never serves as the other's";
  EXPECT_NE(flow_proof(token, "source", h, "n2"), proof);
  EXPECT_NE(flow_proof("token-other-123456", "source", h, "n1"), proof);
  for (auto change : std::vector<std::function<void(session::Hello&)>>{
           [](session::Hello& x) { x.target_node = "c"; }, [](session::Hello& x) { x.source_node = "c"; },
           [](session::Hello& x) { x.vmi.name = "db-1"; }, [](session::Hello& x) { x.migration_uid = "m-2"; },
           [](session::Hello& x) { x.nonce = std::string(32, 'c'); }, [](session::Hello& x) { x.session = std::string(32, 'd'); },
           [](session::Hello& x) { x.chunk_size = 1 << 22; }, [](session::Hello& x) { x.transport = "rdma"; },
           // A relay that swaps a rail's address (to draw the target's RDMA elsewhere) or its MTU.
           [](session::Hello& x) { x.rdma_rails = {{0, "10.10.0.1", 4096}}; },
           [](session::Hello& x) { x.rdma_rails = {{0, "10.10.0.9", 4096}, {1, "10.10.1.1", 4096}}; },
           [](session::Hello& x) { x.rdma_rails = {{0, "10.10.0.1", 1024}, {1, "10.10.1.1", 4096}}; }}) {
    session::Hello other = h;
    change(other);
    EXPECT_NE(flow_proof(token, "source", other, "n1"), proof);
  }
}

TEST(KubevirtFlowSigner, RefusesForgedReplayedAndReorderedControlMessages) {
  const std::string key = "k-0123456789abcdef";
  FlowSigner source(key, "source", "target"), target(key, "target", "source");
  const json open{{"type", "open"}, {"index", 0}, {"host", "10.244.1.7"}, {"port", 41231}};
  const json first = source.sign(open);
  const json second = source.sign(json{{"type", "end"}});
  auto got = target.verify(first);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(got.value(), open);
  EXPECT_FALSE(target.verify(first)) << "replayed";
  json forged = second;
  forged["type"] = "abort";
  EXPECT_FALSE(target.verify(forged)) << "changed";
  json redirected = source.sign(json{{"type", "open"}, {"index", 1}, {"host", "10.244.1.7"}, {"port", 1}});
  redirected["host"] = "169.254.169.254";
  FlowSigner fresh(key, "target", "source");
  ASSERT_TRUE(fresh.verify(first));
  EXPECT_FALSE(fresh.verify(redirected)) << "out of order (second skipped)";
  EXPECT_TRUE(target.verify(second));
  EXPECT_FALSE(target.verify(redirected)) << "destination changed in flight";
  // A message signed in the other direction is never taken as the peer's.
  FlowSigner echo(key, "source", "target");
  EXPECT_FALSE(echo.verify(source.sign(json{{"type", "abort"}})));
  EXPECT_FALSE(FlowSigner("other-key-0123456", "target", "source").verify(FlowSigner(key, "source", "target").sign(open)));
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

// Multus mode runs the agents on the pod network: peers dial the agent pod's own IP, not its
// node's (on the host network the two are the same address).
TEST(KubevirtDiscovery, PeersDialTheAgentPodIpNotItsNodeIp) {
  json agents{{"items",
               {{{"spec", {{"nodeName", "b"}}},
                 {"status", {{"phase", "Running"}, {"hostIP", "192.0.2.2"}, {"podIP", "10.244.2.9"}}}}}}};
  auto peers = peers_from_pods(agents, json{{"items", json::array()}}, 7471, "a");
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].agent, "10.244.2.9:7471");
}

TEST(KubevirtConfig, ReadsTheSectionAndNamesBadKeys) {
  auto c = parse_agent_config(
      "kubevirt: {enabled: true, discovery: kubernetes, staticMode: true, ruleTimeoutSeconds: 10,\n"
      "  peers: [{node: b, agent: '10.0.0.2:7471', handlerAddresses: [10.244.1.7]}]}\n");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_TRUE(c->kubevirt.enabled);
  EXPECT_EQ(c->kubevirt.peers.at(0).handler_addresses.at(0), "10.244.1.7");
  EXPECT_EQ(c->kubevirt.hook_socket, "/var/run/kubevirt/plugins/rdmig.sock");
  EXPECT_EQ(c->kubevirt.heartbeat_timeout_seconds, 3u);  // a cut link is noticed in seconds
  // The default mark stays clear of kube-proxy's (0x4000, 0x8000), Calico's and Cilium's bits.
  EXPECT_EQ(c->kubevirt.socket_mark, 0x2000u);
  EXPECT_EQ(c->kubevirt.socket_mark & 0xFFFFCF00u, 0u);
  auto marked = parse_agent_config("kubevirt: {socketMark: 0x10, socketMarkMask: 0x30}\n");
  ASSERT_TRUE(marked) << marked.error().message;
  EXPECT_EQ(marked->kubevirt.socket_mark, 0x10u);
  EXPECT_EQ(marked->kubevirt.socket_mark_mask, 0x30u);
  for (auto [text, key] : std::vector<std::pair<std::string, std::string>>{
           {"kubevirt: {discovery: dns}", "kubevirt.discovery"},
           {"kubevirt: {ruleTimeoutSeconds: 1}", "kubevirt.ruleTimeoutSeconds"},
           // Heartbeats come every 0.5 s: under 2 s one late heartbeat would fail a migration.
           {"kubevirt: {heartbeatTimeoutSeconds: 1}", "kubevirt.heartbeatTimeoutSeconds"},
           {"kubevirt: {hookSocket: relative.sock}", "kubevirt.hookSocket"},
           {"kubevirt: {peers: [{agent: 'x:1'}]}", "kubevirt.peers[0].node"},
           {"kubevirt: {peerz: []}", "peerz"},
           {"kubevirt: {socketMark: 0x4000, socketMarkMask: 0x4000}", "kubevirt.socketMarkMask"},
           {"kubevirt: {socketMark: 0x3000}", "kubevirt.socketMark"},
           {"kubevirt: {socketMark: 0xZZ}", "kubevirt.socketMark"},
           {"kubevirt: {multifdOnFailure: abort}", "kubevirt.multifdOnFailure"}}) {
    auto r = parse_agent_config(text);
    ASSERT_FALSE(r) << text;
    EXPECT_NE(r.error().message.find(key), std::string::npos) << r.error().message;
  }
}

TEST(KubevirtConfig, MultifdOnFailureIsAutoByDefaultAndTakesDrainOrReset) {
  auto c = parse_agent_config("kubevirt: {enabled: true}\n");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->kubevirt.multifd_on_failure, "auto");
  for (const std::string v : {"auto", "drain", "reset"}) {
    auto r = parse_agent_config("kubevirt: {multifdOnFailure: " + v + "}\n");
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_EQ(r->kubevirt.multifd_on_failure, v);
  }
}

TEST(KubevirtConfig, FlowsKeepAFewChunksInFlightByDefault) {
  // Not migration.ringDepth (16, the bare-QEMU jobs'): what waits in front of KubeVirt's target
  // proxy when the guest stops drains inside the downtime.
  auto c = parse_agent_config("kubevirt: {enabled: true}\nmigration: {ringDepth: 32}\n");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->kubevirt.ring_depth, 0u) << "not set: by the chunk size";
  EXPECT_EQ(c->migration.ring_depth, 32u);
  // About 4 MiB in flight, at least four chunks.
  EXPECT_EQ(flow_ring_depth(0, 1 << 20), 4u);
  EXPECT_EQ(flow_ring_depth(0, 256 << 10), 16u);
  EXPECT_EQ(flow_ring_depth(0, 64 << 10), 64u);
  EXPECT_EQ(flow_ring_depth(0, 4 << 20), 4u);
  EXPECT_EQ(flow_ring_depth(0, 1ull << 30), 4u);
  auto deep = parse_agent_config("kubevirt: {ringDepth: 16}\n");
  ASSERT_TRUE(deep) << deep.error().message;
  EXPECT_EQ(deep->kubevirt.ring_depth, 16u);
  EXPECT_EQ(flow_ring_depth(deep->kubevirt.ring_depth, 1 << 20), 16u) << "set: as set";
  auto zero = parse_agent_config("kubevirt: {ringDepth: 0}\n");
  ASSERT_TRUE(zero) << zero.error().message;
  EXPECT_EQ(flow_ring_depth(zero->kubevirt.ring_depth, 256 << 10), 16u);
  for (const std::string v : {"1", "1025", "four", "-4"}) {
    auto r = parse_agent_config("kubevirt: {ringDepth: " + v + "}\n");
    ASSERT_FALSE(r) << v;
    EXPECT_NE(r.error().message.find("kubevirt.ringDepth"), std::string::npos) << r.error().message;
  }
}

TEST(KubevirtFailureAction, EveryQemuDrainsTheMultifdConnections) {
  // libvirt's numbers (virConnectGetVersion): major * 1000000 + minor * 1000 + micro.
  EXPECT_TRUE(drain_multifd_for_qemu(7002000));   // Debian 12, KubeVirt's Root row here
  EXPECT_TRUE(drain_multifd_for_qemu(9002004));   // multifd_send_set_error sets the exit flag from 9.0 on
  EXPECT_TRUE(drain_multifd_for_qemu(10000013));  // Debian 13: wedged once with every connection reset
  EXPECT_TRUE(drain_multifd_for_qemu(10001000));  // KubeVirt 1.9
  EXPECT_EQ(qemu_version_string(10000013), "10.0.13");
  EXPECT_EQ(qemu_version_string(7002000), "7.2.0");
}

TEST(KubevirtFlowRecord, TheFailureActionIsInTheRecord) {
  FlowRecord r;
  EXPECT_TRUE(to_json(r)["onFailure"].is_null());
  r.on_failure = "reset";
  r.on_failure_by = "qemu 10.0.13";
  EXPECT_EQ(to_json(r)["onFailure"], (nlohmann::json{{"multifd", "reset"}, {"by", "qemu 10.0.13"}}));
}

// kubevirt.carryPostCopy: the record's postCopy is null unless the migration may switch; then it
// says whether the source saw libvirt switch it, when, and libvirt's page requests where given.
TEST(KubevirtFlowRecord, PostCopyIsNullUnlessAllowedThenSaysTheSwitchAndPageRequests) {
  FlowRecord r;
  EXPECT_TRUE(to_json(r)["postCopy"].is_null());
  r.post_copy.allowed = true;
  EXPECT_EQ(to_json(r)["postCopy"],
            (json{{"allowed", true}, {"switched", false}, {"switchedAtMs", nullptr}, {"pageRequests", nullptr}}));
  r.post_copy.switched = true;
  r.post_copy.switched_at_ms = 1700000000123;
  LibvirtJobStats stats;
  stats.postcopy_requests = 1988;
  r.libvirt = stats;
  EXPECT_EQ(to_json(r)["postCopy"],
            (json{{"allowed", true}, {"switched", true}, {"switchedAtMs", 1700000000123}, {"pageRequests", 1988}}));
  // The target's figures travel to the source as JSON: an absent, negative, huge or mistyped
  // count is "not given", never a number the record would show.
  EXPECT_EQ(libvirt_stats_from_json(to_json(stats)).postcopy_requests, 1988);
  EXPECT_EQ(libvirt_stats_from_json(json{{"downtimeMs", 5}}).postcopy_requests, -1);
  EXPECT_EQ(libvirt_stats_from_json(json{{"postcopyRequests", -7}}).postcopy_requests, -1);
  EXPECT_EQ(libvirt_stats_from_json(json{{"postcopyRequests", "12"}}).postcopy_requests, -1);
  EXPECT_EQ(libvirt_stats_from_json(json{{"postcopyRequests", UINT64_MAX}}).postcopy_requests, -1);
  EXPECT_TRUE(to_json(LibvirtJobStats{})["postcopyRequests"].is_null());
}

TEST(KubevirtLibvirtUri, SessionForAnUnprivilegedDaemonSystemForRootAndThePathEscaped) {
  // KubeVirt's default non-root launcher: an unprivileged daemon refuses /system.
  EXPECT_EQ(libvirt_uri("/proc/42/root/var/run/libvirt/virtqemud-sock", false),
            "qemu+unix:///session?socket=/proc/42/root/var/run/libvirt/virtqemud-sock");
  EXPECT_EQ(libvirt_uri("/proc/42/root/run/libvirt/libvirt-sock", true),
            "qemu+unix:///system?socket=/proc/42/root/run/libvirt/libvirt-sock");
  // A path from another pod's file system can never add or cut a URI parameter.
  EXPECT_EQ(libvirt_uri("/x/a&no_verify=1#b?c%d e", false),
            "qemu+unix:///session?socket=/x/a%26no_verify%3D1%23b%3Fc%25d%20e");
}

TEST(KubevirtLibvirtUri, DaemonUidIsThePeerCredentialOfTheListener) {
  const std::string path = ::testing::TempDir() + "/rdmig-uid-" + std::to_string(::getpid()) + ".sock";
  auto l = net::unix_listen(path);
  ASSERT_TRUE(l) << l.error().message;
  auto uid = daemon_uid(path);
  ASSERT_TRUE(uid) << uid.error().message;
  EXPECT_EQ(uid.value(), ::getuid());
  ::unlink(path.c_str());
  EXPECT_FALSE(daemon_uid(path));  // nobody listens
  EXPECT_FALSE(daemon_uid("/" + std::string(200, 'x')));  // longer than sun_path: refused, not cut
}

TEST(KubevirtTargetDial, OnlyUnicastAddressLiteralsNeverNamesOrLocalAddresses) {
  for (const char* ok : {"10.244.1.7", "192.0.2.1", "fd52:4d49:4b56:1::2", "2001:db8::1", "::ffff:10.0.0.1"}) {
    EXPECT_TRUE(net::check_unicast_literal(ok, "open.host")) << ok;
  }
  for (const char* bad : {"127.0.0.1", "127.1.2.3", "0.0.0.0", "169.254.169.254", "224.0.0.1", "255.255.255.255",
                          "0.1.2.3", "::1", "::", "fe80::1", "ff02::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254",
                          "localhost", "metadata.google.internal", "10.0.0.1 ", "", "1.2.3"}) {
    auto st = net::check_unicast_literal(bad, "open.host");
    ASSERT_FALSE(st) << bad;
    EXPECT_NE(st.error().message.find("open.host"), std::string::npos);
  }
}

TEST(KubevirtVmi, ATargetAddressThatIsNotAPodAddressArmsNothing) {
  for (const char* addr : {"127.0.0.1", "169.254.169.254", "::1", "0.0.0.0"}) {
    auto s = state();
    s["targetNodeAddress"] = addr;
    auto why = skip_reason(intent(s), "a");
    ASSERT_TRUE(why.has_value()) << addr;
    EXPECT_NE(why->find("targetNodeAddress"), std::string::npos) << *why;
  }
  EXPECT_FALSE(skip_reason(intent(state()), "a").has_value());
}

TEST(ProbePort, HealthzFailsWhenAWorkLoopStalledSoTheKubeletRestartsTheAgent) {
  const auto live = api::probe_response("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", true, true);
  EXPECT_EQ(live.rfind("HTTP/1.1 200 ", 0), 0u) << live;
  const auto stalled = api::probe_response("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", true, false);
  EXPECT_EQ(stalled.rfind("HTTP/1.1 503 ", 0), 0u) << stalled;
  EXPECT_NE(stalled.find("stalled"), std::string::npos);
  // Readiness is its own answer.
  EXPECT_EQ(api::probe_response("GET /readyz HTTP/1.1\r\n\r\n", true, false).rfind("HTTP/1.1 200 ", 0), 0u);
}

TEST(KubevirtHandlerIdentity, PodUidFromCgroupsOfBothKubeletDrivers) {
  // systemd driver (cgroup v2), cgroupfs driver (v1 lines), and nothing.
  EXPECT_EQ(pod_uid_in_cgroup("0::/kubepods.slice/kubepods-burstable.slice/"
                              "kubepods-burstable-pod3F2504E0_4F89_11D3_9A0C_0305E82C3301.slice/cri-containerd-ab.scope\n"),
            "3f2504e0-4f89-11d3-9a0c-0305e82c3301");
  EXPECT_EQ(pod_uid_in_cgroup("12:pids:/kubepods/besteffort/pod3f2504e0-4f89-11d3-9a0c-0305e82c3301/0123abc\n"
                              "0::/\n"),
            "3f2504e0-4f89-11d3-9a0c-0305e82c3301");
  EXPECT_EQ(pod_uid_in_cgroup("0::/user.slice/user-0.slice/session-1.scope\n"), "");
  EXPECT_EQ(pod_uid_in_cgroup("0::/podman/pod-notauid\n"), "");
}

TEST(KubevirtHandlerIdentity, TrustsOnlyRunningHandlerPodsOfThisNode) {
  const json pods{{"items",
                   {{{"metadata", {{"uid", "AAAA0000-0000-4000-8000-000000000001"}}},
                     {"spec", {{"nodeName", "a"}}},
                     {"status", {{"phase", "Running"}}}},
                    {{"metadata", {{"uid", "bbbb0000-0000-4000-8000-000000000002"}}},
                     {"spec", {{"nodeName", "b"}}},
                     {"status", {{"phase", "Running"}}}},
                    {{"metadata", {{"uid", "cccc0000-0000-4000-8000-000000000003"}}},
                     {"spec", {{"nodeName", "a"}}},
                     {"status", {{"phase", "Pending"}}}}}}};
  EXPECT_EQ(handler_pod_uids(pods, "a"), std::set<std::string>{"aaaa0000-0000-4000-8000-000000000001"});
  EXPECT_TRUE(handler_pod_uids(json::object(), "a").empty());
  // By pod: before the first listing nobody is virt-handler, whatever its name.
  HandlerIdentity by_pod("virt-handler", true);
  EXPECT_TRUE(by_pod.by_pod());
  EXPECT_TRUE(by_pod.refuse(::getpid()).has_value());
  HandlerIdentity by_name("rdmig-unit-tes", false);
  EXPECT_FALSE(by_name.by_pod());
}

TEST(KubevirtLauncherIdentity, TrustsOnlyTheVmisRunningLauncherPodsOfThisNode) {
  auto pod = [](const std::string& uid, const std::string& ns, const std::string& node, const std::string& phase,
                json labels) {
    return json{{"metadata", {{"uid", uid}, {"namespace", ns}, {"labels", std::move(labels)}}},
                {"spec", {{"nodeName", node}}},
                {"status", {{"phase", phase}}}};
  };
  const json launcher{{"kubevirt.io", "virt-launcher"}, {"kubevirt.io/created-by", "vmi-1"}};
  const json pods{{"items",
                   {pod("AAAA0000-0000-4000-8000-000000000001", "prod", "a", "Running", launcher),
                    pod("bbbb0000-0000-4000-8000-000000000002", "dev", "a", "Running", launcher),
                    pod("cccc0000-0000-4000-8000-000000000003", "prod", "b", "Running", launcher),
                    pod("dddd0000-0000-4000-8000-000000000004", "prod", "a", "Succeeded", launcher),
                    pod("eeee0000-0000-4000-8000-000000000005", "prod", "a", "Running",
                        {{"kubevirt.io", "virt-handler"}, {"kubevirt.io/created-by", "vmi-1"}}),
                    pod("ffff0000-0000-4000-8000-000000000006", "prod", "a", "Running",
                        {{"kubevirt.io", "virt-launcher"}, {"kubevirt.io/created-by", 7}}),
                    pod("abab0000-0000-4000-8000-000000000007", "prod", "a", "Running", "not an object")}}};
  const std::map<std::string, std::set<std::string>> want{{"prod/vmi-1", {"aaaa0000-0000-4000-8000-000000000001"}},
                                                          {"dev/vmi-1", {"bbbb0000-0000-4000-8000-000000000002"}}};
  EXPECT_EQ(launcher_pod_uids(pods, "a"), want);
  EXPECT_TRUE(launcher_pod_uids(json::object(), "a").empty());
  // By pod: before the first listing no process is a launcher, whatever its command line.
  LauncherIdentity by_pod(true);
  EXPECT_TRUE(by_pod.refuse(::getpid(), "prod", "vmi-1").has_value());
  by_pod.set_pods(launcher_pod_uids(pods, "a"));
  const auto why = by_pod.refuse(::getpid(), "prod", "vmi-1");  // this test runs in no such pod
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("process " + std::to_string(::getpid())), std::string::npos) << *why;
  // Static discovery: the command line is all there is.
  LauncherIdentity by_cmdline(false);
  EXPECT_FALSE(by_cmdline.refuse(::getpid(), "prod", "vmi-1").has_value());
}

// ---- KubeVirt mode's metrics (kubevirt_metrics.h) ----

namespace {
std::vector<std::string> metric_lines(const std::string& text, const std::string& name) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + "{", 0) == 0 || line.rfind(name + " ", 0) == 0) out.push_back(line);
  }
  return out;
}
FlowRecord record(const std::string& name, const std::string& phase, bool carried) {
  FlowRecord r;
  r.migration_uid = "m-" + name + phase;
  r.vmi = VmiRef{"prod", name, "u-" + name};
  r.role = "source";
  r.source_node = "a";
  r.target_node = "b";
  r.carried = carried;
  r.phase = phase;
  r.transport = carried ? "tcp" : "";
  r.transport_reason = carried ? "auto-no-peer-rdma" : "";
  r.connections = carried ? 3 : 0;
  r.reason = carried ? "" : "post-copy is allowed for this migration";
  r.finished_at_ms = 1700000000000;
  return r;
}
}  // namespace

TEST(KubevirtMetrics, EveryNotCarriedReasonHasItsCode) {
  // The texts skip_reason() gives, as the hook records them.
  auto s = state();
  s["migrationConfiguration"] = {{"allowPostCopy", true}};
  EXPECT_EQ(not_carried_code(*skip_reason(intent(s), "a")), "post_copy");
  s = state();
  s["targetNode"] = "a";
  EXPECT_EQ(not_carried_code(*skip_reason(intent(s), "a")), "same_node");
  s = state();
  s["sourceState"] = json::object();
  s["targetState"] = {{"syncAddress", "10.0.0.1:9185"}};
  EXPECT_EQ(not_carried_code(*skip_reason(intent(s), "a")), "decentralized");
  EXPECT_EQ(not_carried_code(*skip_reason(intent(state()), "c")), "wrong_node");
  s = state();
  s["targetDirectMigrationNodePorts"] = {{"41231", 0}};
  EXPECT_EQ(not_carried_code(*skip_reason(intent(s), "a")), "no_ports");
  s = state();
  s.erase("targetNodeAddress");
  EXPECT_EQ(not_carried_code(*skip_reason(intent(s), "a")), "no_target_address");
  // relay_source.cpp's own reasons (built there around an error message).
  EXPECT_EQ(not_carried_code("post-copy is allowed for this migration and the agent on b did not confirm failover "
                             "(dataPlane.failover): not carried"),
            "post_copy");
  EXPECT_EQ(not_carried_code("no rdmig agent known for node b"), "no_peer_agent");
  EXPECT_EQ(not_carried_code("the path to the agent on b is unhealthy (x): KubeVirt's own path"), "peer_unhealthy");
  EXPECT_EQ(not_carried_code("the agent on b declined: the API has no VMI"), "peer_declined");
  EXPECT_EQ(not_carried_code("agent draining: the rdmig agent on a is shutting down (an upgrade or a node drain); "
                             "KubeVirt's own path"),
            "draining");
  EXPECT_EQ(not_carried_code("the agent on b declined: peer agent b (10.0.0.2:7471) refused the session: agent "
                             "draining: the rdmig agent on b is shutting down"),
            "peer_draining");
  EXPECT_EQ(not_carried_code("cannot reach the agent on b: connection refused"), "peer_unreachable");
  EXPECT_EQ(not_carried_code("the hook caller is not virt-handler: process 1 is 'sh'"), "caller_refused");
  EXPECT_EQ(not_carried_code("the API has no VMI prod/web-1 (deleted?): not found"), "api_check");
  EXPECT_EQ(not_carried_code("cannot find the network namespace of virt-handler (hook caller pid 7)"), "no_handler_netns");
  EXPECT_EQ(not_carried_code("nft: add element failed"), "other");
  for (const char* code : kNotCarriedReasons) EXPECT_FALSE(std::string(code).empty());
}

TEST(KubevirtMetrics, OneInfoSeriesPerVmiWithTheLastMigrationsNodesResultTransportAndReason) {
  Metrics m;
  KubevirtMetrics k(m);
  // Every reason code and carried transport exists at 0 from start-up (increase() in the alerts).
  std::string text = m.serialize();
  EXPECT_EQ(metric_lines(text, "rdmig_kubevirt_not_carried_total").size(), std::size(kNotCarriedReasons));
  EXPECT_EQ(metric_lines(text, "rdmig_kubevirt_carried_total").size(), 4u);
  k.finished(record("web-1", "Succeeded", true));
  k.hook_not_carried("post-copy is allowed for this migration: kubevirt.carryPostCopy is off on this agent");
  k.finished(record("web-2", "NotCarried", false));
  text = m.serialize();
  auto info = metric_lines(text, "rdmig_kubevirt_migration_info");
  ASSERT_EQ(info.size(), 2u) << text;
  if (info[0].find("name=\"web-1\"") == std::string::npos) std::swap(info[0], info[1]);
  EXPECT_NE(info[0].find("result=\"Succeeded\""), std::string::npos) << info[0];
  EXPECT_NE(info[0].find("transport=\"tcp\",transport_reason=\"auto-no-peer-rdma\""), std::string::npos) << info[0];
  EXPECT_NE(info[0].find("source_node=\"a\",target_node=\"b\""), std::string::npos) << info[0];
  EXPECT_NE(info[0].find(" 1700000000"), std::string::npos) << info[0];
  EXPECT_NE(info[1].find("reason=\"post_copy\",result=\"NotCarried\""), std::string::npos) << info[1];
  EXPECT_NE(text.find("rdmig_kubevirt_not_carried_total{reason=\"post_copy\"} 1"), std::string::npos);
  EXPECT_NE(text.find("rdmig_kubevirt_carried_total{role=\"source\",transport=\"tcp\"} 1"), std::string::npos);
  EXPECT_NE(text.find("rdmig_kubevirt_migration_connections{name=\"web-1\",namespace=\"prod\",role=\"source\"} 3"),
            std::string::npos);
  // The VMI's next migration replaces its info series; forgetting the VMI removes it.
  k.finished(record("web-1", "NotCarried", false));
  text = m.serialize();
  const auto after = metric_lines(text, "rdmig_kubevirt_migration_info");
  ASSERT_EQ(after.size(), 2u) << text;
  for (const auto& line : after) EXPECT_EQ(line.find("result=\"Succeeded\""), std::string::npos) << line;
  k.forget(record("web-1", "NotCarried", false));
  k.forget(record("web-2", "NotCarried", false));
  EXPECT_TRUE(metric_lines(m.serialize(), "rdmig_kubevirt_migration_info").empty());
  EXPECT_TRUE(metric_lines(m.serialize(), "rdmig_kubevirt_migration_connections").empty());
}

TEST(KubevirtMetrics, HookServingFollowsTheSocketFile) {
  Metrics m;
  auto& gauge = register_hook_serving(m);
  const std::string dir = ::testing::TempDir() + "rdmig-hook-" + std::to_string(::getpid());
  const std::string path = dir + "/hook.sock";
  auto server = HookServer::start(path, [](const std::string&, const std::string&, const std::string&, pid_t) {});
  ASSERT_TRUE(server) << server.error().message;
  m.on_scrape([&] { gauge.Set(server.value()->serving() ? 1 : 0); });
  EXPECT_NE(m.serialize().find("rdmig_kubevirt_hook_serving 1"), std::string::npos);
  // Removed (a cleanup of the plugin directory) or replaced by another listener: not served.
  ASSERT_EQ(::unlink(path.c_str()), 0);
  EXPECT_NE(m.serialize().find("rdmig_kubevirt_hook_serving 0"), std::string::npos);
  auto other = net::unix_listen(path, 1);
  ASSERT_TRUE(other);
  EXPECT_NE(m.serialize().find("rdmig_kubevirt_hook_serving 0"), std::string::npos);
  server.value().reset();
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}
