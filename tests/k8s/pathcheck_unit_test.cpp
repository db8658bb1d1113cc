// The RdmaPathCheck status figures that need no cluster: a pair's phase from the source agent's
// view, and the summary (counts, worst pair).
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
