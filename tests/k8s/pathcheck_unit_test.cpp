// The RdmaPathCheck status figures that need no cluster: a pair's phase from the source agent's
// view, the summary (counts, worst pair), and the rails and RDMA ports copied from an agent, bounded.
#include <gtest/gtest.h>

#include "controller/pathcheck_reconciler.h"

using nlohmann::json;
using namespace rdmig::controller;

TEST(PathCheckStatus, PairPhaseFollowsTheSourceAgentAndTheTransportAskedFor) {
  EXPECT_EQ(pair_phase_of(json{{"phase", "Migrating"}}, "auto"), "");
  EXPECT_EQ(pair_phase_of(json{{"phase", "Succeeded"}, {"transport", "rdma"}}, "auto"), "Passed");
  EXPECT_EQ(pair_phase_of(json{{"phase", "Succeeded"}, {"transport", "tcp"}}, "auto"), "FellBack");
  EXPECT_EQ(pair_phase_of(json{{"phase", "Succeeded"}, {"transport", "tcp"}}, "tcp"), "Passed");
  EXPECT_EQ(pair_phase_of(json{{"phase", "Failed"}}, "auto"), "Failed");
  EXPECT_EQ(pair_phase_of(json{{"phase", "Cancelled"}}, "rdma"), "Failed");
}

TEST(PathCheckStatus, SummaryCountsAndNamesTheWorstPair) {
  json pairs = json::array({
      json{{"source", "a"}, {"target", "b"}, {"phase", "Passed"}, {"transport", "rdma"}, {"throughputBytesPerSecond", 9e9}},
      json{{"source", "a"}, {"target", "c"}, {"phase", "Passed"}, {"transport", "rdma"}, {"throughputBytesPerSecond", 2e9}},
      json{{"source", "a"}, {"target", "d"}, {"phase", "Running"}},
  });
  auto s = pathcheck_summary(pairs);
  EXPECT_EQ(s["pairs"], 3);
  EXPECT_EQ(s["passed"], 2);
  EXPECT_EQ(s["failed"], 0);
  EXPECT_EQ(s["worst"].get<std::string>().rfind("a->c rdma", 0), 0u) << s;  // the slowest
  pairs.push_back(json{{"source", "a"}, {"target", "e"}, {"phase", "FellBack"}, {"transport", "tcp"},
                       {"reason", "auto-no-peer-rdma:no-device"}, {"throughputBytesPerSecond", 5e9}});
  s = pathcheck_summary(pairs);
  EXPECT_EQ(s["fellBack"], 1);
  EXPECT_NE(s["worst"].get<std::string>().find("a->e tcp (auto-no-peer-rdma:no-device)"), std::string::npos) << s;
  pairs.push_back(json{{"source", "a"}, {"target", "f"}, {"phase", "Failed"}, {"error", "connect refused"}});
  s = pathcheck_summary(pairs);
  EXPECT_EQ(s["failed"], 1);
  EXPECT_EQ(s["worst"], "a->f failed: connect refused");
  EXPECT_FALSE(pathcheck_summary(json::array()).contains("worst"));
}

namespace {
// A source agent's view of a check over two rails, as GET /v1/pathchecks/{id} answers it.
json rdma_end(const std::string& device, const std::string& gid, const std::string& netdev, int mtu) {
  return json{{"device", device}, {"port", 1},          {"gid", gid},  {"gidIndex", 3},
              {"gidType", "RoCE v2"}, {"netdev", netdev}, {"mtu", mtu}};
}
json rail_view(int rail, json channels, uint64_t bytes, json local, json peer) {
  return json{{"rail", rail},         {"device", local["device"]}, {"gid", local["gid"]},
              {"address", "10.10.0.1"}, {"peerAddress", "10.10.0.2:7472"}, {"channels", std::move(channels)},
              {"bytesSent", bytes},   {"bytesReceived", 0},        {"localRdma", std::move(local)},
              {"peerRdma", std::move(peer)}};
}
}  // namespace

TEST(PathCheckStatus, RailsNameEveryRailWithBothPortsAndItsBytes) {
  const json view{
      {"phase", "Succeeded"},
      {"transport", "rdma"},
      {"localRdma", rdma_end("mlx5_0", "0000:0000:0000:0000:0000:ffff:0a0a:0001", "ens1f0v0", 4096)},
      {"rails", json::array({rail_view(0, {0, 2}, 2048, rdma_end("mlx5_0", "g-a0", "ens1f0v0", 4096),
                                       rdma_end("mlx5_4", "g-b0", "ens1f0v3", 4096)),
                             rail_view(1, {1}, 1024, rdma_end("mlx5_1", "g-a1", "ens2f0v0", 1024),
                                       rdma_end("mlx5_5", "g-b1", "ens2f0v3", 1024))})}};
  const json rails = pathcheck_rails(view);
  ASSERT_EQ(rails.size(), 2u) << rails;
  EXPECT_EQ(rails[1]["rail"], 1);
  EXPECT_EQ(rails[1]["channels"], json::array({1}));
  EXPECT_EQ(rails[1]["bytes"], 1024);
  EXPECT_EQ(rails[1]["sourceRdma"], rdma_end("mlx5_1", "g-a1", "ens2f0v0", 1024));
  EXPECT_EQ(rails[1]["targetRdma"], rdma_end("mlx5_5", "g-b1", "ens2f0v3", 1024));
  EXPECT_EQ(rails[0]["targetRdma"]["netdev"], "ens1f0v3");
  EXPECT_FALSE(rails[0].contains("address")) << "only what the CRD's schema lists";
  // Over TCP the agent lists no rails: none in the status.
  EXPECT_TRUE(pathcheck_rails(json{{"phase", "Succeeded"}, {"transport", "tcp"}}).empty());
  EXPECT_TRUE(pathcheck_rails(json{{"rails", "lots"}}).empty());
}

TEST(PathCheckStatus, RailsFromAHostileAgentAreBounded) {
  json many = json::array();
  const std::string huge(1000, 'x');
  for (int i = 0; i < 1000; ++i) {
    json channels = json::array();
    for (int c = 0; c < 200; ++c) channels.push_back(c);
    many.push_back(rail_view(i % 16, channels, 1, rdma_end(huge, huge, huge, 1 << 30),
                             json{{"device", 7}, {"port", -9}, {"gidIndex", -100}, {"extra", huge}}));
  }
  many.push_back("not a rail");
  many.push_back(json{{"rail", -1}});
  const json rails = pathcheck_rails(json{{"rails", many}});
  ASSERT_EQ(rails.size(), kMaxPathCheckRails);
  for (const auto& r : rails) {
    EXPECT_LE(r["channels"].size(), kMaxPathCheckRailChannels);
    EXPECT_EQ(r["sourceRdma"]["device"].get<std::string>().size(), 64u);
    EXPECT_EQ(r["sourceRdma"]["gid"].get<std::string>().size(), 64u);
    EXPECT_EQ(r["sourceRdma"]["mtu"], 4096);
    EXPECT_FALSE(r["targetRdma"].contains("device")) << "not a string";
    EXPECT_FALSE(r["targetRdma"].contains("extra"));
    EXPECT_EQ(r["targetRdma"]["port"], 0);
    EXPECT_EQ(r["targetRdma"]["gidIndex"], -1);
  }
  EXPECT_LT(rails.dump().size(), 64u * 1024) << "a status the API server takes";
  // A pair's own ends are bounded the same way.
  EXPECT_TRUE(pathcheck_rdma_end("mlx5_0").is_null());
  EXPECT_EQ(pathcheck_rdma_end(rdma_end(huge, "g", "n", 1024))["device"].get<std::string>().size(), 64u);
}

TEST(PathCheckMetrics, PairsAreCountedPerNodePairAndTheirSeriesAreBounded) {
  ControllerMetrics m;
  m.set_max_pathcheck_pairs(2);
  m.pathcheck_pair_ended("node-a", "node-b", "Passed", 2.5e9);
  m.pathcheck_pair_ended("node-a", "node-b", "Passed", 3e9);
  m.pathcheck_pair_ended("node-a", "node-c", "Failed", std::nullopt);
  std::string text = m.serialize();
  EXPECT_NE(text.find(R"(rdmig_controller_pathcheck_pairs_total{result="Passed",source_node="node-a",target_node="node-b"} 2)"),
            std::string::npos) << text;
  EXPECT_NE(text.find(R"(rdmig_controller_pathcheck_pair_throughput_bytes_per_second{source_node="node-a",target_node="node-b"} 3000000000)"),
            std::string::npos) << text;
  EXPECT_NE(text.find(R"(rdmig_controller_pathcheck_pairs_total{result="Failed",source_node="node-a",target_node="node-c"} 1)"),
            std::string::npos) << text;
  EXPECT_EQ(text.find(R"(rdmig_controller_pathcheck_pair_throughput_bytes_per_second{source_node="node-a",target_node="node-c"})"),
            std::string::npos) << "a failed pair carried nothing: " << text;
  // A third node pair drops the least recently ended one's series (node-a -> node-b).
  m.pathcheck_pair_ended("node-b", "node-a", "FellBack", 1e8);
  text = m.serialize();
  EXPECT_EQ(text.find(R"(target_node="node-b")"), std::string::npos) << text;
  EXPECT_NE(text.find(R"(source_node="node-b",target_node="node-a"} 1)"), std::string::npos) << text;
}
