// Striping a session's channels across RDMA rails (session/rails.h), and how a migration's
// status and failure reports name them (migration/job.h).
#include <gtest/gtest.h>

#include <optional>
#include <set>

#include "metrics/metrics.h"
#include "migration/job.h"
#include "session/rail_failover.h"
#include "session/rails.h"

namespace rdmig::migration {
namespace {

using namespace rdmig::session;
using nlohmann::json;

const net::DialPolicy kPeers = net::DialPolicy::peer_agents(false);

RdmaRail rail(uint32_t index, const std::string& device, const std::string& ip) {
  RdmaRail r;
  r.rail = index;
  r.device = device;
  r.ip = ip;
  r.port = 7472;
  r.gid = "0000:0000:0000:0000:0000:ffff:" + ip;
  return r;
}

RdmaSupport support(std::vector<RdmaRail> rails) {
  RdmaSupport s;
  s.available = !rails.empty();
  if (!rails.empty()) {
    s.ip = rails.front().ip;
    s.port = rails.front().port;
  }
  s.rails = std::move(rails);
  return s;
}

TEST(Rails, ChannelsAreStripedRoundRobinOverMatchedRails) {
  const auto local = support({rail(0, "rxea", "10.99.0.1"), rail(1, "rxea2", "10.99.2.1")});
  const auto pairs = match_rails(local.rails, {{0, "10.99.0.2:7472"}, {1, "10.99.2.2:7472"}});
  ASSERT_EQ(pairs.size(), 2u);
  const auto usage = rail_usage(pairs, 5);  // main + 4 multifd
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage[0].channels, (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(usage[1].channels, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(usage[1].device, "rxea2");
  EXPECT_EQ(usage[1].peer_address, "10.99.2.2:7472");
  EXPECT_EQ(rail_of_channel(7, 3), 1u);
  const auto one_channel = rail_usage(pairs, 1);  // no multifd: the main channel alone
  ASSERT_EQ(one_channel.size(), 1u) << "a rail without a channel is not reported as used";
  EXPECT_EQ(one_channel[0].rail, 0u);
}

TEST(Rails, DifferentRailCountsUseTheRailsBothHave) {
  const auto local = support({rail(0, "rxea", "10.99.0.1"), rail(1, "rxea2", "10.99.2.1")});
  const auto pairs = match_rails(local.rails, {{0, "10.99.0.2:7472"}});
  ASSERT_EQ(pairs.size(), 1u);
  EXPECT_EQ(pairs[0].local.device, "rxea");
  EXPECT_EQ(rail_usage(pairs, 5)[0].channels.size(), 5u);
}

TEST(Rails, RailsAreMatchedByIndexNotByPosition) {
  // Rail 0 is down on this node: its rail 1 pairs with the peer's rail 1, never the peer's rail 0.
  const auto local = support({rail(1, "rxea2", "10.99.2.1")});
  const auto pairs = match_rails(local.rails, {{0, "10.99.0.2:7472"}, {1, "10.99.2.2:7472"}});
  ASSERT_EQ(pairs.size(), 1u);
  EXPECT_EQ(pairs[0].rail, 1u);
  EXPECT_EQ(pairs[0].peer, "10.99.2.2:7472");
  auto none = rails_from_welcome(json{{"rdmaRails", json::array({json{{"rail", 0}, {"address", "10.99.0.2:7472"}}})}},
                                 local, kPeers);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("no RDMA rail in common"), std::string::npos) << none.error().message;
}

TEST(Rails, APeerWithOneEndpointIsOneRail) {
  const auto local = support({rail(0, "rxea", "10.99.0.1"), rail(1, "rxea2", "10.99.2.1")});
  auto pairs = rails_from_welcome(json{{"rdmaEndpoint", "10.99.0.2:7472"}}, local, kPeers);
  ASSERT_TRUE(pairs.ok()) << pairs.error().message;
  ASSERT_EQ(pairs->size(), 1u);
  EXPECT_EQ((*pairs)[0].local.device, "rxea");
  EXPECT_EQ((*pairs)[0].peer, "10.99.0.2:7472");
  session::Hello old_source;  // no rdmaRails
  EXPECT_EQ(rails_from_hello(old_source, local).size(), 1u);
}

TEST(Rails, WelcomeAdvertisesEveryRailAndTheFirstForOneDevicePeers) {
  const auto target = support({rail(0, "rxeb", "10.99.0.2"), rail(1, "rxeb2", "10.99.2.2")});
  json welcome;
  add_rails_to_welcome(welcome, target);
  EXPECT_EQ(welcome["rdmaEndpoint"], "10.99.0.2:7472");
  const auto source = support({rail(0, "rxea", "10.99.0.1"), rail(1, "rxea2", "10.99.2.1")});
  auto pairs = rails_from_welcome(welcome, source, kPeers);
  ASSERT_TRUE(pairs.ok()) << pairs.error().message;
  ASSERT_EQ(pairs->size(), 2u);
  EXPECT_EQ((*pairs)[1].peer, "10.99.2.2:7472");
  // The target computes the same match from the source's hello.
  session::Hello hello;
  hello.kind = session::HelloKind::kControl;
  hello.rdma_rails = rail_addresses(source);
  const auto mirrored = rails_from_hello(hello, target);
  ASSERT_EQ(mirrored.size(), 2u);
  EXPECT_EQ(mirrored[1].local.device, "rxeb2");
  EXPECT_EQ(mirrored[1].peer, "10.99.2.1");
}

// rdma.devices[i].alternateAddresses: the target lists each working alternate (its configured
// index, its rdma_cm endpoint) with its rail; the source pairs its alternate k with the target's
// alternate k of the same rail, both working, and leaves out what only one side has.
RdmaRail with_alternates(RdmaRail r, const std::vector<std::pair<uint32_t, std::string>>& alternates) {
  for (const auto& [slot, ip] : alternates) {
    r.alternates.push_back(rail(r.rail, r.device, ip));
    r.alternate_slots.push_back(slot);
  }
  return r;
}

TEST(Rails, AlternateAddressesArePairedByTheirConfiguredIndexOnTheSameRail) {
  // The target's rail 0 has alternates 0 and 2 working (1 was left out at start), rail 1 none.
  const auto target = support({with_alternates(rail(0, "rxeb", "10.99.0.2"), {{0, "10.100.0.2"}, {2, "10.102.0.2"}}),
                               rail(1, "rxeb2", "10.99.2.2")});
  json welcome;
  add_rails_to_welcome(welcome, target);
  EXPECT_EQ(welcome["rdmaRails"][0]["alternates"],
            json::parse(R"([{"index":0,"address":"10.100.0.2:7472"},{"index":2,"address":"10.102.0.2:7472"}])"));
  EXPECT_FALSE(welcome["rdmaRails"][1].contains("alternates"));  // none: the wire as before
  // The source has rail 0's alternates 1 and 2, and one on rail 1.
  const auto source = support({with_alternates(rail(0, "rxea", "10.99.0.1"), {{1, "10.101.0.1"}, {2, "10.102.0.1"}}),
                               with_alternates(rail(1, "rxea2", "10.99.2.1"), {{0, "10.103.0.1"}})});
  auto pairs = rails_from_welcome(welcome, source, kPeers);
  ASSERT_TRUE(pairs.ok()) << pairs.error().message;
  ASSERT_EQ(pairs->size(), 2u);
  ASSERT_EQ((*pairs)[0].alternates.size(), 1u);  // only index 2 on both
  EXPECT_EQ((*pairs)[0].alternates[0].index, 2u);
  EXPECT_EQ((*pairs)[0].alternates[0].local.ip, "10.102.0.1");
  EXPECT_EQ((*pairs)[0].alternates[0].peer, "10.102.0.2:7472");
  EXPECT_TRUE((*pairs)[1].alternates.empty());
  EXPECT_EQ(alternates_per_rail(pairs.value()), (std::vector<size_t>{1, 0}));
  EXPECT_TRUE(has_alternates(source));
  EXPECT_FALSE(has_alternates(support({rail(0, "rxea", "10.99.0.1")})));
  // Over the alternate: the same rail and device, the alternate's addresses, named as such.
  const auto over = on_alternate((*pairs)[0], 0);
  EXPECT_EQ(over.rail, 0u);
  EXPECT_EQ(over.local.device, "rxea");
  EXPECT_EQ(over.local.ip, "10.102.0.1");
  EXPECT_EQ(over.peer, "10.102.0.2:7472");
  EXPECT_TRUE(over.alternates.empty());
  EXPECT_EQ(rail_text(over), "rail 0: rxea 10.102.0.1 to 10.102.0.2:7472 (alternate address 2)");
  EXPECT_EQ(rail_text((*pairs)[0]), "rail 0: rxea 10.99.0.1 to 10.99.0.2:7472");
  EXPECT_EQ(failover_destination("rdma " + rail_text(over)), "address");
  EXPECT_EQ(failover_destination("rdma " + rail_text((*pairs)[0])), "rail");
  EXPECT_EQ(failover_destination("tcp 10.99.0.2:7471"), "tcp");
  // The target names where a re-dial arrived: its alternate 2 of rail 0 (address slot 3).
  session::Hello hello;
  hello.rdma_rails = rail_addresses(source);
  const auto mirrored = rails_from_hello(hello, target);
  EXPECT_EQ(arrival_rail_text(mirrored, 0, 3), "rail 0: rxeb 10.102.0.2 (alternate address 2)");
  EXPECT_EQ(arrival_rail_text(mirrored, 0, 0), "rail 0: rxeb 10.99.0.2 to 10.99.0.1");
  EXPECT_TRUE(mirrored[0].alternates.empty());  // the source's hello lists none: the target dials nothing
}

TEST(Rails, WelcomeAlternatesAreBoundedAndObeyThePeerDialPolicy) {
  const auto source = support({with_alternates(rail(0, "rxea", "10.99.0.1"), {{0, "10.100.0.1"}})});
  const auto welcome_with = [](const json& alternates) {
    return json{{"rdmaRails", json::array({json{{"rail", 0}, {"address", "10.99.0.2:7472"}, {"alternates", alternates}}})}};
  };
  for (const char* bad : {"169.254.169.254:7472", "127.0.0.1:7472", "[::]:7472", "peer.example:7472"}) {
    auto refused = rails_from_welcome(welcome_with(json::array({json{{"index", 0}, {"address", bad}}})), source, kPeers);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.error().message.find("welcome.rdmaRails[rail 0].alternates[0]"), std::string::npos)
        << refused.error().message;
  }
  for (const auto& bad : {json("10.100.0.2:7472"), json::array({"10.100.0.2:7472"}),
                          json::array({json{{"index", 4}, {"address", "10.100.0.2:7472"}}}),
                          json::array({json{{"index", 0}, {"address", "10.100.0.2:7472"}},
                                       json{{"index", 0}, {"address", "10.100.0.3:7472"}}}),
                          json::array({json{{"index", 0}}}),
                          json::array({json{{"index", 0}, {"address", std::string(301, 'a')}}}),
                          json(std::vector<json>(5, json{{"index", 0}, {"address", "10.100.0.2:7472"}}))}) {
    auto refused = rails_from_welcome(welcome_with(bad), source, kPeers);
    ASSERT_FALSE(refused.ok()) << bad.dump();
    EXPECT_EQ(refused.error().code, Errc::kInvalidArgument) << bad.dump();
    EXPECT_NE(refused.error().message.find("rdmaRails[0].alternates"), std::string::npos) << refused.error().message;
  }
  auto fine = rails_from_welcome(welcome_with(json::array({json{{"index", 0}, {"address", "10.100.0.2:7472"}}})),
                                 source, kPeers);
  ASSERT_TRUE(fine.ok()) << fine.error().message;
  EXPECT_EQ(fine->front().alternates.size(), 1u);
}

TEST(Rails, BytesChunksAndThroughputAreCountedPerRailAndOnlyTheGrowthReachesTheCounters) {
  Metrics metrics;
  const auto local = support({rail(0, "rxea", "10.99.0.1"), rail(1, "rxea2", "10.99.2.1")});
  auto usage = rail_usage(match_rails(local.rails, {{0, "a:1"}, {1, "b:1"}}), 3);
  const auto t0 = std::chrono::steady_clock::now();
  account_rail_traffic(usage, {{100, 20, 3}, {}, {10, 2, 1}, {}}, metrics, "migration", t0);
  EXPECT_EQ(usage[0].bytes_sent, 103u);
  EXPECT_EQ(usage[1].bytes_sent, 20u);
  EXPECT_EQ(usage[0].chunks_sent, 11u);
  EXPECT_EQ(usage[0].throughput_bytes_per_second, 0u) << "one count: no time to divide by";
  // Two seconds on: rail 0 moved 203 bytes sent and 8 received in all since the first count.
  account_rail_traffic(usage, {{200, 20, 3}, {8}, {20, 2, 1}, {4}}, metrics, "migration", t0 + std::chrono::seconds(2));
  EXPECT_EQ(usage[0].bytes_sent, 203u);
  EXPECT_EQ(usage[0].bytes_received, 8u);
  EXPECT_EQ(usage[0].chunks_sent, 21u);
  EXPECT_EQ(usage[0].chunks_received, 4u);
  EXPECT_EQ(usage[0].throughput_bytes_per_second, 105u);  // (203 + 8) / 2 s
  EXPECT_EQ(usage[1].throughput_bytes_per_second, 10u);
  // A channel that went (a shorter vector) keeps what it counted: totals never shrink.
  account_rail_traffic(usage, {{200}, {}, {20}, {}}, metrics, "migration", t0 + std::chrono::seconds(3));
  EXPECT_EQ(usage[0].bytes_sent, 203u);
  EXPECT_EQ(usage[1].chunks_sent, 2u);
  const auto j = to_json(usage[0]);
  EXPECT_EQ(j["chunksSent"], 21);
  EXPECT_EQ(j["chunksReceived"], 4);
  EXPECT_EQ(j["throughputBytesPerSecond"], 70);  // (203 + 8) / 3 s
  const std::string text = metrics.serialize();
  for (const char* sample :
       {R"(rdmig_rdma_rail_bytes_total{device="rxea",direction="sent",rail="0",traffic="migration"} 203)",
        R"(rdmig_rdma_rail_bytes_total{device="rxea2",direction="sent",rail="1",traffic="migration"} 20)",
        R"(rdmig_rdma_rail_chunks_total{device="rxea",direction="sent",rail="0",traffic="migration"} 21)",
        R"(rdmig_rdma_rail_chunks_total{device="rxea",direction="received",rail="0",traffic="migration"} 4)"}) {
    EXPECT_NE(text.find(sample), std::string::npos) << sample << "\n" << text;
  }
}


// A failover moves a channel off its rail: what it carried there stays there, what it carries
// after counts on the rail it moved to (or on none over TCP), and its failure names where it runs.
TEST(Rails, AChannelMovedByAFailoverCountsOnEachRailWhatItCarriedThereAndIsNamedWhereItRuns) {
  Metrics metrics;
  const auto local = support({rail(0, "rxea", "10.99.1.1"), rail(1, "rxea2", "10.99.2.1")});
  const auto pairs = match_rails(local.rails, {{0, "10.99.1.2:7472"}, {1, "10.99.2.2:7472"}});
  auto usage = rail_usage(pairs, 4);  // rail 0: channels 0, 2; rail 1: channels 1, 3
  const auto t0 = std::chrono::steady_clock::now();
  account_rail_traffic(usage, {{100, 200, 300, 400}, {1, 2, 3, 4}, {10, 20, 30, 40}, {}}, metrics, "migration", t0);
  EXPECT_EQ(usage[1].bytes_sent, 600u);
  // Channel 3 (rail 1) is cut after 450 bytes and resumes on rail 0.
  move_channel_off_rail(usage, pairs, 3, 0, {{100, 200, 300, 450}, {1, 2, 3, 5}, {10, 20, 30, 45}, {}});
  EXPECT_EQ(rail_of_channel_text(usage, 3), "rail 0: rxea 10.99.1.1 to 10.99.1.2:7472");
  EXPECT_EQ(usage[0].channels, (std::vector<uint32_t>{0, 2, 3}));
  EXPECT_EQ(usage[1].channels, (std::vector<uint32_t>{1}));
  // It carries 1000 more, all on rail 0; rail 1 keeps its 450 and channel 1's.
  account_rail_traffic(usage, {{100, 200, 300, 1450}, {1, 2, 3, 9}, {10, 20, 30, 145}, {}}, metrics, "migration",
                       t0 + std::chrono::seconds(1));
  EXPECT_EQ(usage[0].bytes_sent, 100u + 300 + 1000);
  EXPECT_EQ(usage[1].bytes_sent, 200u + 450);
  EXPECT_EQ(usage[0].bytes_received, 1u + 3 + 4);
  EXPECT_EQ(usage[1].bytes_received, 2u + 5);
  EXPECT_EQ(usage[0].chunks_sent, 10u + 30 + 100);
  EXPECT_EQ(usage[1].chunks_sent, 20u + 45);
  // Then rail 0 is cut too and it goes over TCP: no rail counts what TCP carries, each keeps its share.
  move_channel_off_rail(usage, pairs, 3, std::nullopt, {{100, 200, 300, 1500}, {1, 2, 3, 9}, {10, 20, 30, 150}, {}});
  EXPECT_EQ(rail_of_channel_text(usage, 3), "") << "over TCP: no rail";
  account_rail_traffic(usage, {{100, 200, 300, 9000}, {1, 2, 3, 9}, {10, 20, 30, 900}, {}}, metrics, "migration",
                       t0 + std::chrono::seconds(2));
  EXPECT_EQ(usage[0].bytes_sent, 100u + 300 + 1050);
  EXPECT_EQ(usage[1].bytes_sent, 200u + 450);
  // Back onto rail 1 (its path returned): only what it carries from there on counts there.
  move_channel_off_rail(usage, pairs, 3, 1, {{100, 200, 300, 9000}, {1, 2, 3, 9}, {10, 20, 30, 900}, {}});
  account_rail_traffic(usage, {{100, 200, 300, 9100}, {1, 2, 3, 9}, {10, 20, 30, 910}, {}}, metrics, "migration",
                       t0 + std::chrono::seconds(3));
  EXPECT_EQ(usage[1].bytes_sent, 200u + 450 + 100);
  EXPECT_EQ(usage[0].bytes_sent, 100u + 300 + 1050);
  EXPECT_EQ(rail_of_channel_text(usage, 3), "rail 1: rxea2 10.99.2.1 to 10.99.2.2:7472");
  const std::string text = metrics.serialize();
  for (const char* sample :
       {R"(rdmig_rdma_rail_bytes_total{device="rxea",direction="sent",rail="0",traffic="migration"} 1450)",
        R"(rdmig_rdma_rail_bytes_total{device="rxea2",direction="sent",rail="1",traffic="migration"} 750)"}) {
    EXPECT_NE(text.find(sample), std::string::npos) << sample << "\n" << text;
  }
  // A channel that ran over TCP from the start moves onto no rail's count until it arrives on one.
  move_channel_off_rail(usage, pairs, 7, std::nullopt, {});
  EXPECT_EQ(usage[0].channels, (std::vector<uint32_t>{0, 2}));
}

// A post-copy recovery retires every channel and resumes over one fresh TCP channel 0, whose
// counters start again from 0: the rails keep what the retired channels carried and count none of
// what the recovery carries (before, rail 0 counted channel 0's fresh bytes once they outgrew its
// old total).
TEST(Rails, ChannelsRetiredByAPostCopyRecoveryKeepTheirCountsAndTheFreshChannelCountsOnNoRail) {
  Metrics metrics;
  const auto local = support({rail(0, "rxea", "10.99.1.1"), rail(1, "rxea2", "10.99.2.1")});
  const auto pairs = match_rails(local.rails, {{0, "10.99.1.2:7472"}, {1, "10.99.2.2:7472"}});
  auto usage = rail_usage(pairs, 3);  // rail 0: channels 0, 2; rail 1: channel 1
  const auto t0 = std::chrono::steady_clock::now();
  account_rail_traffic(usage, {{100, 200, 300}, {5, 6, 7}, {1, 2, 3}, {1, 1, 1}}, metrics, "migration", t0);
  // Channel 1 failed over to rail 0 before (its 250 bytes on rail 1 stay there).
  move_channel_off_rail(usage, pairs, 1, 0, {{100, 250, 300}, {5, 6, 7}, {1, 3, 3}, {1, 1, 1}});
  // The recovery: the pumps' final counts.
  take_channels_off_rails(usage, {{150, 270, 330}, {9, 6, 8}, {2, 4, 4}, {2, 1, 2}});
  EXPECT_TRUE(usage[0].channels.empty());
  EXPECT_TRUE(usage[1].channels.empty());
  EXPECT_EQ(rail_of_channel_text(usage, 0), "") << "the fresh channel 0 runs over TCP";
  account_rail_traffic(usage, {{150, 270, 330}, {9, 6, 8}, {2, 4, 4}, {2, 1, 2}}, metrics, "migration",
                       t0 + std::chrono::seconds(1));
  EXPECT_EQ(usage[0].bytes_sent, 150u + 330 + 20);  // channels 0 and 2, and channel 1 since it came
  EXPECT_EQ(usage[1].bytes_sent, 250u);
  EXPECT_EQ(usage[0].bytes_received, 9u + 8);
  EXPECT_EQ(usage[0].chunks_sent, 2u + 4 + 1);
  // The fresh channel 0 carries 5000 bytes over TCP: no rail grows.
  account_rail_traffic(usage, {{5000}, {40}, {50}, {4}}, metrics, "migration", t0 + std::chrono::seconds(2));
  EXPECT_EQ(usage[0].bytes_sent, 500u);
  EXPECT_EQ(usage[0].bytes_received, 17u);
  EXPECT_EQ(usage[1].bytes_sent, 250u);
  const std::string text = metrics.serialize();
  EXPECT_NE(text.find(R"(rdmig_rdma_rail_bytes_total{device="rxea",direction="sent",rail="0",traffic="migration"} 500)"),
            std::string::npos)
      << text;
}

RdmaRail rail_with_mtu(uint32_t index, const std::string& device, const std::string& ip, uint32_t mtu) {
  auto r = rail(index, device, ip);
  r.mtu = mtu;
  return r;
}

TEST(Rails, MtusAreComparedOnEveryMatchedRailThatCarriesAChannelAndTheMismatchNamesTheRail) {
  // Rail 0 agrees (1024 both ends); rail 1 does not (source 4096, target 1024).
  const auto source = support({rail_with_mtu(0, "mlx5_0", "10.10.0.1", 1024), rail_with_mtu(1, "mlx5_1", "10.10.1.1", 4096)});
  auto target = support({rail_with_mtu(0, "mlx5_2", "10.10.0.2", 1024), rail_with_mtu(1, "mlx5_3", "10.10.1.2", 1024)});
  target.mtu = 1024;
  session::Hello hello;
  hello.kind = session::HelloKind::kControl;
  hello.rdma_mtu = 1024;  // the source's first rail, all an older target compared
  hello.rdma_rails = rail_addresses(source);
  const TransportOffer rdma_offer{TransportKind::kRdma, false};

  // Two channels: channel 1 goes over rail 1, whose ports would drop each other's larger packets.
  const auto mtus = rail_mtus(hello, target, 2);
  ASSERT_EQ(mtus.size(), 2u);
  EXPECT_EQ(mtus[1].rail, 1u);
  EXPECT_EQ(mtus[1].source, 4096u);
  EXPECT_EQ(mtus[1].target, 1024u);
  auto c = choose_transport(rdma_offer, TransportKind::kAuto, target, mtus);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->transport, TransportKind::kTcp);
  EXPECT_EQ(c->reason, "auto-no-peer-rdma:mtu-mismatch");
  EXPECT_NE(c->detail.find("rail 1 (target device mlx5_3): source 4096, target 1024"), std::string::npos) << c->detail;
  auto e = choose_transport(rdma_offer, TransportKind::kRdma, target, mtus);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("rail 1 (target device mlx5_3): source 4096, target 1024"), std::string::npos)
      << e.error().message;

  // One channel uses rail 0 only: its MTUs agree, RDMA.
  auto one = choose_transport(rdma_offer, TransportKind::kAuto, target, rail_mtus(hello, target, 1));
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->transport, TransportKind::kRdma);
  EXPECT_EQ(one->reason, "auto-both-rdma");
}

TEST(Rails, ASourceThatListsRailsWithoutMtusIsComparedOnItsFirstRailByRdmaMtu) {
  auto target = support({rail_with_mtu(0, "mlx5_2", "10.10.0.2", 1024), rail_with_mtu(1, "mlx5_3", "10.10.1.2", 1024)});
  session::Hello hello;
  hello.kind = session::HelloKind::kControl;
  hello.rdma_mtu = 4096;
  hello.rdma_rails = {{0, "10.10.0.1"}, {1, "10.10.1.1"}};  // no per-rail "mtu"
  const auto mtus = rail_mtus(hello, target, 4);
  ASSERT_EQ(mtus.size(), 2u);
  EXPECT_EQ(mtus[0].source, 4096u);
  EXPECT_EQ(mtus[1].source, 0u) << "unknown: not compared";
  auto c = choose_transport(TransportOffer{TransportKind::kRdma, true}, TransportKind::kAuto, target, mtus);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("rail 0 (target device mlx5_2)"), std::string::npos) << c.error().message;
  // A one-device source (no rails at all): its rdmaMtu against this agent's first rail.
  session::Hello old_source;
  old_source.rdma_mtu = 2048;
  const auto legacy = rail_mtus(old_source, target, 4);
  ASSERT_EQ(legacy.size(), 1u);
  EXPECT_EQ(legacy[0].rail, 0u);
  EXPECT_EQ(legacy[0].source, 2048u);
  EXPECT_EQ(legacy[0].target, 1024u);
}

TEST(Rails, HelloCarriesEachRailsMtuAndRefusesABadOne) {
  const auto source = support({rail_with_mtu(0, "mlx5_0", "10.10.0.1", 1024), rail_with_mtu(1, "mlx5_1", "10.10.1.1", 4096)});
  session::Hello hello;
  hello.kind = session::HelloKind::kControl;
  hello.migration_id = "m1";
  hello.channels = 2;
  hello.chunk_size = 1 << 20;
  hello.ring_depth = 16;
  hello.transport = "rdma";
  hello.nonce = "0123456789abcdef0123456789abcdef";
  hello.rdma_rails = rail_addresses(source);
  auto j = hello.to_json();
  auto back = session::Hello::parse(j, session::Purpose::kMigration);
  ASSERT_TRUE(back.ok()) << back.error().message;
  ASSERT_EQ(back->rdma_rails.size(), 2u);
  EXPECT_EQ(back->rdma_rails[1].mtu, 4096u);
  j["rdmaRails"][1]["mtu"] = 1500;
  auto bad = session::Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("rdmaRails[1].mtu"), std::string::npos) << bad.error().message;
}


TEST(Rails, AChannelsFailureNamesItsRailAndDevice) {
  const auto local = support({rail(0, "mlx5_0", "10.10.0.1"), rail(1, "mlx5_1", "10.10.1.1")});
  const auto usage = rail_usage(match_rails(local.rails, {{0, "10.10.0.2:7472"}, {1, "10.10.1.2:7472"}}), 4);
  EXPECT_EQ(rail_of_channel_text(usage, 3), "rail 1: mlx5_1 10.10.1.1 to 10.10.1.2:7472");
  EXPECT_EQ(rail_of_channel_text(usage, 2), "rail 0: mlx5_0 10.10.0.1 to 10.10.0.2:7472");
  EXPECT_EQ(rail_of_channel_text(usage, 9), "") << "no rail carries channel 9";
  EXPECT_EQ(rail_of_channel_text({}, 0), "") << "TCP: no rails";
}

TEST(Rails, ConnectionsThatArriveOutOfOrderLandOnTheirRailsInOrder) {
  // KubeVirt's proxy dials its connections in no fixed order: each still goes on rail i mod n,
  // and the usage lists the rails in rail order with their channels sorted.
  const auto local = support({rail(0, "mlx5_0", "10.10.0.1"), rail(1, "mlx5_1", "10.10.1.1")});
  const auto peer = support({rail(0, "mlx5_2", "10.10.0.2"), rail(1, "mlx5_3", "10.10.1.2")});
  const auto pairs = rails_from_source(rail_addresses(peer), local);
  ASSERT_EQ(pairs.size(), 2u);
  std::vector<RailUsage> usage;
  for (uint32_t c : {3u, 0u, 2u, 1u}) add_channel_to_usage(usage, pairs, c);
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage[0].rail, 0u);
  EXPECT_EQ(usage[0].channels, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(usage[1].rail, 1u);
  EXPECT_EQ(usage[1].channels, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(usage[1].device, "mlx5_1");
  EXPECT_EQ(usage[1].peer_address, "10.10.1.2");
  // Only channel 1 arrived: rail 1 alone is listed.
  std::vector<RailUsage> one;
  add_channel_to_usage(one, pairs, 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].rail, 1u);
  EXPECT_EQ(rail_text(pairs[1]), "rail 1: mlx5_1 10.10.1.1 to 10.10.1.2");
  // A rail failover's re-dial on the target: named by the rail whose listener took it, in this
  // end's words (its device and address, the source's address); an index no rail has, by number.
  EXPECT_EQ(arrival_rail_text(pairs, 1), "rail 1: mlx5_1 10.10.1.1 to 10.10.1.2");
  EXPECT_EQ(arrival_rail_text(pairs, 0), "rail 0: mlx5_0 10.10.0.1 to 10.10.0.2");
  EXPECT_EQ(arrival_rail_text(pairs, 7), "rail 7");
  // The same as the usage a bare-QEMU job computes up front for all its channels.
  const auto upfront = rail_usage(pairs, 4);
  ASSERT_EQ(upfront.size(), usage.size());
  for (size_t i = 0; i < usage.size(); ++i) EXPECT_EQ(usage[i].channels, upfront[i].channels);
}

TEST(Rails, MtusFromAFlowHelloAreComparedOnEveryRailBothHave) {
  // A KubeVirt flow's connections arrive one by one: every matched rail may carry one.
  const auto source = support({rail_with_mtu(0, "mlx5_0", "10.10.0.1", 4096), rail_with_mtu(1, "mlx5_1", "10.10.1.1", 4096)});
  const auto target = support({rail_with_mtu(0, "mlx5_2", "10.10.0.2", 4096), rail_with_mtu(1, "mlx5_3", "10.10.1.2", 1024)});
  const auto mtus = rail_mtus(rail_addresses(source), 0, target, transport::kMaxChannels);
  ASSERT_EQ(mtus.size(), 2u);
  auto c = choose_transport(TransportOffer{TransportKind::kRdma, false}, TransportKind::kAuto, target, mtus);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->reason, "auto-no-peer-rdma:mtu-mismatch");
  EXPECT_NE(c->detail.find("rail 1 (target device mlx5_3): source 4096, target 1024"), std::string::npos) << c->detail;
  // A source without RDMA lists no rails: one rail, its MTU unknown, nothing to compare.
  const auto none = rail_mtus({}, 0, target, transport::kMaxChannels);
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(none[0].source, 0u);
}

TEST(Rails, StatusListsTheRailsLeftOutAtStartWithTheirReason) {
  MigrationStatus s;
  EXPECT_EQ(to_json(s)["railsLeftOut"], json::array()) << "none: an empty list, as rails";
  s.rails_left_out.push_back(RailLeftOut{1, "no-device", "RDMA device rxea2 port 1 is not active (link down?)"});
  const json want = json::array(
      {json{{"rail", 1}, {"reason", "no-device"}, {"message", "RDMA device rxea2 port 1 is not active (link down?)"}}});
  EXPECT_EQ(to_json(s)["railsLeftOut"], want);
}

// Rail 1 cut between two nodes: its channels fail by themselves (no ACK: "work completion
// failed"), and the other agent, which failed too, aborts every channel, so rail 0's channels end
// with "peer aborted". The failure names a channel of rail 1, not channel 0 (the first in index
// order) with the echo.
TEST(Rails, AFailureNamesAChannelThatFailedByItselfBeforeOnesThatCarryThePeersAbort) {
  const Error echo{Errc::kUnavailable, "rdma channel 0: peer aborted"};
  const Error cut{Errc::kIo, "rdma channel 3: work completion failed: transport retry counter exceeded (12)"};
  const auto f = channel_failure_to_report({echo, std::nullopt, echo, cut, echo});
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->channel, 3u);
  EXPECT_FALSE(f->peer_abort);
  EXPECT_EQ(f->error.message, cut.message);

  // Only echoes (the peer decided; its reason is on the control link): the first, marked.
  const auto only = channel_failure_to_report({std::nullopt, Error{Errc::kUnavailable, "channel 1: peer aborted: "
                                                                                        "target QEMU failed"}, echo});
  ASSERT_TRUE(only.has_value());
  EXPECT_EQ(only->channel, 1u);
  EXPECT_TRUE(only->peer_abort);

  EXPECT_FALSE(channel_failure_to_report({std::nullopt, std::nullopt}).has_value());
  EXPECT_FALSE(channel_failure_to_report({}).has_value());
}

TEST(Rails, WelcomeRailAddressesObeyThePeerDialPolicy) {
  // The source connects to the welcome's rail addresses on the target's word: each passes the
  // agent's peer dial policy (common/dial_policy.h), as a REST client's target.endpoint does.
  const auto local = support({rail(0, "rxea", "10.99.0.1"), rail(1, "rxea2", "10.99.2.1")});
  for (const char* bad : {"169.254.169.254:7472", "0.0.0.0:7472", "[::ffff:169.254.169.254]:7472", "[::]:7472",
                          "224.0.0.1:7472", "127.0.0.1:7472", "rdma-peer.example:7472"}) {
    auto refused = rails_from_welcome(
        json{{"rdmaRails", json::array({json{{"rail", 0}, {"address", "10.99.0.2:7472"}},
                                        json{{"rail", 1}, {"address", bad}}})}},
        local, kPeers);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_EQ(refused.error().code, Errc::kInvalidArgument) << bad;
    EXPECT_NE(refused.error().message.find("welcome.rdmaRails[rail 1]"), std::string::npos) << refused.error().message;
    auto legacy = rails_from_welcome(json{{"rdmaEndpoint", bad}}, local, kPeers);
    ASSERT_FALSE(legacy.ok()) << bad;
    EXPECT_NE(legacy.error().message.find("welcome.rdmaRails[rail 0]"), std::string::npos) << legacy.error().message;
  }
  // Loopback only where the agent's config says it is a lab (dataPlane.allowLoopbackPeers).
  auto lab = rails_from_welcome(json{{"rdmaEndpoint", "127.0.0.1:7472"}}, local, net::DialPolicy::peer_agents(true));
  EXPECT_TRUE(lab.ok()) << lab.error().message;
}

}  // namespace
}  // namespace rdmig::migration

// session::redial_over_paths: the one failover loop of bare-QEMU source jobs and KubeVirt source
// sessions (docs/failover.md): the paths in dataPlane.failoverPaths order, the rails after the one
// that failed, a refusal ending the tries, and where the channel resumed kept for its next failure.
namespace {
struct PathLog {
  std::vector<std::string> tried;
  std::set<std::string> down;      // paths whose try fails (unreachable)
  std::string refusing;            // a path whose peer answers and refuses
  rdmig::session::RedialOverRail rail() {
    return [this](rdmig::session::RailSpot at, std::chrono::steady_clock::time_point) {
      return attempt("rail " + std::to_string(at.rail) +
                     (at.address == 0 ? std::string() : " address " + std::to_string(at.address)));
    };
  }
  rdmig::session::RedialOverTcp tcp() {
    return [this](std::chrono::steady_clock::time_point) { return attempt("tcp"); };
  }
  rdmig::Result<rdmig::session::Resumed> attempt(const std::string& path) {
    tried.push_back(path);
    if (path == refusing) return rdmig::Error{rdmig::Errc::kPermissionDenied, path + ": refused"};
    if (down.count(path)) return rdmig::Error{rdmig::Errc::kUnavailable, path + ": unreachable"};
    return rdmig::session::Resumed{nullptr, 0, path};
  }
};
std::chrono::steady_clock::time_point in_5s() { return std::chrono::steady_clock::now() + std::chrono::seconds(5); }
using Spot = std::optional<rdmig::session::RailSpot>;
Spot on_rail(size_t r, size_t address = 0) { return rdmig::session::RailSpot{r, address}; }
}  // namespace

TEST(RailFailover, TriesTheOtherRailsInOrderThenTcpAndKeepsWhereTheChannelWent) {
  PathLog log;
  log.down = {"rail 2", "rail 0"};
  Spot current = on_rail(1);  // the channel ran over rail 1 of three
  const rdmig::session::FailoverPaths paths{{"rail", "tcp"}, 3, {}, true};
  auto r = rdmig::session::redial_over_paths(5, paths, current, in_5s(), log.rail(), log.tcp());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(log.tried, (std::vector<std::string>{"rail 2", "rail 0", "tcp"}));
  EXPECT_EQ(r->path, "tcp");
  // Why the preferred paths were passed over goes with it (the failover's record and log say it).
  EXPECT_EQ(r->passed_over, "rail 2: unreachable; rail 0: unreachable");
  EXPECT_FALSE(current.has_value());  // over TCP now
  // Its next failure (over TCP) may go to any rail, the first one included.
  log = PathLog{};
  auto again = rdmig::session::redial_over_paths(5, paths, current, in_5s(), log.rail(), log.tcp());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(log.tried, (std::vector<std::string>{"rail 0"}));
  EXPECT_EQ(again->passed_over, "");
  EXPECT_EQ(current, on_rail(0));
  // The words of the record and the log: the paths passed over follow, only when there were any.
  rdmig::session::FailoverEvent ev{5, "channel 5: reset", "tcp 10.0.0.2:7471", 3, std::chrono::milliseconds(40),
                                   "rdma", std::nullopt, r->passed_over};
  EXPECT_EQ(rdmig::session::failover_words(ev),
            "channel 5: reset; resumed on tcp 10.0.0.2:7471 after 40 ms, 3 chunk(s) resent (passed over: rail 2: "
            "unreachable; rail 0: unreachable)");
  ev.passed_over.clear();
  ev.reason = "reset";
  EXPECT_EQ(rdmig::session::failover_words(ev), "channel 5: reset; resumed on tcp 10.0.0.2:7471 after 40 ms, 3 chunk(s) resent");
}

TEST(RailFailover, FollowsTheConfiguredOrderAndLeavesOutWhatTheTargetDidNotOffer) {
  PathLog log;
  log.down = {"tcp"};
  Spot current = on_rail(0);
  // [tcp, rail]: TCP first; the other rail once TCP fails.
  auto r = rdmig::session::redial_over_paths(1, {{"tcp", "rail"}, 2, {}, true}, current, in_5s(),
                                             log.rail(), log.tcp());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(log.tried, (std::vector<std::string>{"tcp", "rail 1"}));
  // No failoverRails from the target (rails 0) and no TCP (RDMA required): nothing to try.
  log = PathLog{};
  current = on_rail(0);
  auto none = rdmig::session::redial_over_paths(1, {{"rail", "tcp"}, 0, {}, false}, current,
                                                in_5s(), log.rail(), log.tcp());
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(log.tried.empty());
  EXPECT_NE(none.error().message.find("no failover path"), std::string::npos) << none.error().message;
  EXPECT_EQ(current, on_rail(0));
}

TEST(RailFailover, APeerThatRefusesEndsTheTriesAndEveryFailureIsNamed) {
  PathLog log;
  log.refusing = "rail 0";
  Spot current = on_rail(1);
  auto r = rdmig::session::redial_over_paths(3, {{"rail", "tcp"}, 2, {}, true}, current, in_5s(),
                                             log.rail(), log.tcp());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, rdmig::Errc::kPermissionDenied);
  EXPECT_EQ(log.tried, (std::vector<std::string>{"rail 0"}));  // not TCP after a refusal
  log = PathLog{};
  log.down = {"rail 0", "tcp"};
  auto both = rdmig::session::redial_over_paths(3, {{"rail", "tcp"}, 2, {}, true}, current, in_5s(),
                                                log.rail(), log.tcp());
  ASSERT_FALSE(both.ok());
  EXPECT_EQ(both.error().message, "rail 0: unreachable; tcp: unreachable");
  EXPECT_EQ(current, on_rail(1));
}

// "address" (dataPlane.failoverPaths): the other addresses of the rail the channel runs on (its
// alternates, and its own address once it runs on an alternate), after the current one; never
// another rail's alternates, and nothing for a channel over TCP.
TEST(RailFailover, AddressTriesTheSameRailsOtherAddressesAfterTheOtherRailsAndBeforeTcp) {
  using rdmig::session::failover_tries;
  const rdmig::session::FailoverPaths paths{{"rail", "address", "tcp"}, 2, {2, 1}, true};
  // On rail 0's own address: rail 1, then rail 0's alternates 0 and 1 (addresses 1, 2), then TCP.
  EXPECT_EQ(failover_tries(paths, on_rail(0)),
            (std::vector<Spot>{on_rail(1), on_rail(0, 1), on_rail(0, 2), std::nullopt}));
  // On rail 0's alternate 0: its alternate 1, then its own address again (wrapping around).
  EXPECT_EQ(failover_tries({{"address"}, 2, {2, 1}, false}, on_rail(0, 1)),
            (std::vector<Spot>{on_rail(0, 2), on_rail(0, 0)}));
  // Over TCP: no rail's alternate (only the rails' own addresses, under "rail").
  EXPECT_EQ(failover_tries(paths, std::nullopt), (std::vector<Spot>{on_rail(0), on_rail(1), std::nullopt}));
  // The target offered no alternates (or "address" is not listed here): none tried.
  EXPECT_EQ(failover_tries({{"address", "tcp"}, 2, {}, true}, on_rail(1)), (std::vector<Spot>{std::nullopt}));
  EXPECT_EQ(failover_tries({{"address"}, 2, {0, 0}, false}, on_rail(1)), (std::vector<Spot>{}));
  // [address, rail]: the same device's other address first.
  EXPECT_EQ(failover_tries({{"address", "rail"}, 2, {0, 1}, false}, on_rail(1)),
            (std::vector<Spot>{on_rail(1, 1), on_rail(0)}));

  PathLog log;
  log.down = {"rail 1", "rail 0 address 1"};
  Spot current = on_rail(0);
  auto r = rdmig::session::redial_over_paths(4, paths, current, in_5s(), log.rail(), log.tcp());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(log.tried, (std::vector<std::string>{"rail 1", "rail 0 address 1", "rail 0 address 2"}));
  EXPECT_EQ(current, on_rail(0, 2));  // its next failure starts from there
}
