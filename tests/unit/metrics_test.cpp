// The agent's metrics: the label values alerts take increase() of exist from start-up, a label
// value from a peer stays in its fixed set, and a migration's info/timestamp series follow its
// phase and go with it.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "metrics/metrics.h"
#include "session/transport_choice.h"

using namespace rdmig;

namespace {
// The exposition lines of one metric name (exactly that name, labels or not).
std::vector<std::string> series(const std::string& text, const std::string& name) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + "{", 0) == 0 || line.rfind(name + " ", 0) == 0) out.push_back(line);
  }
  return out;
}

bool has_line(const std::string& text, const std::string& line) {
  return ("\n" + text).find("\n" + line + "\n") != std::string::npos;
}

bool is_fixed_pair(const std::string& transport, const std::string& reason) {
  for (const auto& t : kTransportReasons) {
    if (transport == t.transport && reason == t.reason) return true;
  }
  return false;
}
}  // namespace

TEST(Metrics, AlertedCountersExistAtZeroFromStartUp) {
  Metrics m;
  const std::string text = m.serialize();
  // The first fallback and the first failure after start-up must be an increase from 0.
  EXPECT_TRUE(has_line(text, R"(rdmig_transport_selected_total{reason="auto-no-source-rdma",transport="tcp"} 0)"))
      << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_transport_selected_total{reason="auto-no-peer-rdma",transport="tcp"} 0)"));
  EXPECT_TRUE(has_line(text, R"(rdmig_transport_selected_total{reason="auto-both-rdma",transport="rdma"} 0)"));
  EXPECT_EQ(series(text, "rdmig_transport_selected_total").size(), std::size(kTransportReasons));
  for (const char* role : {"source", "target"}) {
    for (const char* reason : kFailureReasons) {
      EXPECT_TRUE(has_line(text, std::string("rdmig_migration_failures_total{reason=\"") + reason + "\",role=\"" +
                                     role + "\"} 0"))
          << role << " " << reason;
    }
    EXPECT_TRUE(has_line(text, std::string("rdmig_migration_duration_seconds_count{result=\"failed\",role=\"") +
                                   role + "\"} 0"));
  }
  for (const char* transport : {"tcp", "rdma"}) {
    const std::string t = std::string("{transport=\"") + transport + "\"} 0";
    EXPECT_TRUE(has_line(text, "rdmig_downtime_seconds_count" + t)) << transport;
    EXPECT_TRUE(has_line(text, "rdmig_switchover_seconds_count" + t)) << transport;
    EXPECT_TRUE(has_line(text, "rdmig_chunk_write_latency_seconds_count" + t)) << transport;
    EXPECT_TRUE(has_line(text, "rdmig_chunk_size_bytes_count" + t)) << transport;
  }
}

TEST(Metrics, EveryTransportReasonTheHandshakeGivesIsAFixedLabelValue) {
  using session::TransportOffer;
  int choices = 0;
  for (const auto offered : {TransportKind::kTcp, TransportKind::kRdma}) {
    for (const bool required : {false, true}) {
      for (const auto requested : {TransportKind::kAuto, TransportKind::kTcp, TransportKind::kRdma}) {
        for (const bool available : {false, true}) {
          session::RdmaSupport rdma;
          rdma.available = available;
          rdma.reason = available ? "" : "no device";
          rdma.reason_code = available ? "" : "no-address";
          auto choice = session::choose_transport(TransportOffer{offered, required}, requested, rdma);
          if (!choice) continue;
          ++choices;
          // The target's reason code rides after ':' (auto-no-peer-rdma:no-address); the part before is the label.
          const std::string base = choice->reason.substr(0, choice->reason.find(':'));
          EXPECT_TRUE(is_fixed_pair(session::wire_name(choice->transport), base))
              << session::wire_name(choice->transport) << " " << choice->reason;
          if (!available && choice->transport == TransportKind::kTcp && base == "auto-no-peer-rdma") {
            EXPECT_EQ(choice->reason, "auto-no-peer-rdma:no-address");
          }
          Metrics m;
          m.transport_selected(session::wire_name(choice->transport), choice->reason);
          EXPECT_TRUE(has_line(m.serialize(), std::string("rdmig_transport_selected_total{reason=\"") + base +
                                                  "\",transport=\"" + session::wire_name(choice->transport) + "\"} 1"))
              << choice->reason;
        }
      }
    }
  }
  EXPECT_GE(choices, 10);
}

TEST(Handshake, DifferentRdmaMtusAreTcpWithTheReasonOrAnErrorWhenRdmaIsRequired) {
  using session::TransportOffer;
  session::RdmaSupport rdma;
  rdma.available = true;
  rdma.mtu = 1024;
  auto on_rail0 = [](uint32_t peer) { return std::vector<session::RailMtu>{{0, "mlx5_0", peer, 1024}}; };
  // Same MTU, or the source's unknown (a peer that does not send it): RDMA.
  for (uint32_t peer : {1024u, 0u}) {
    auto c = session::choose_transport(TransportOffer{TransportKind::kRdma, false}, TransportKind::kAuto, rdma,
                                         on_rail0(peer));
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->transport, TransportKind::kRdma) << peer;
  }
  auto c = session::choose_transport(TransportOffer{TransportKind::kRdma, false}, TransportKind::kAuto, rdma,
                                       on_rail0(4096));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->transport, TransportKind::kTcp);
  EXPECT_EQ(c->reason, "auto-no-peer-rdma:mtu-mismatch");
  for (auto [required, requested] : {std::pair{true, TransportKind::kAuto}, std::pair{false, TransportKind::kRdma}}) {
    auto e = session::choose_transport(TransportOffer{TransportKind::kRdma, required}, requested, rdma,
                                         on_rail0(4096));
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.error().message.find("source 4096, target 1024"), std::string::npos) << e.error().message;
  }
}

TEST(Metrics, RdmaSelectedSaysTheChosenDeviceOrWhyNone) {
  Metrics m;
  RdmaSelectionInfo none;
  none.reason = "no-address";
  m.set_rdma_selection(none);
  std::string text = m.serialize();
  ASSERT_EQ(series(text, "rdmig_rdma_selected").size(), 1u) << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_rdma_selected{address="",device="",device_port="",gid_index="",gid_type="",netdev="",reason="no-address"} 0)")) << text;
  m.set_rdma_selection(RdmaSelectionInfo{"ok", "mlx5_2", "1", "ens1f0v0.100", "198.51.100.7", "5", "RoCE v2"});
  text = m.serialize();
  ASSERT_EQ(series(text, "rdmig_rdma_selected").size(), 1u) << "the old series is replaced: " << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_rdma_selected{address="198.51.100.7",device="mlx5_2",device_port="1",gid_index="5",gid_type="RoCE v2",netdev="ens1f0v0.100",reason="ok"} 1)")) << text;
}

TEST(Metrics, LabelValuesOutsideTheFixedSetsCountAsOther) {
  Metrics m;
  m.transport_selected("tcp", "auto-no-source-rdma");
  m.transport_selected("tcp", "a reason from a confused peer");
  m.transport_selected("tcp", "");
  m.transport_selected("rdma", "auto-no-peer-rdma");  // not a reason RDMA is chosen for
  m.migration_failed("source", "peer_lost");
  m.migration_failed("source", "something new");
  const std::string text = m.serialize();
  EXPECT_TRUE(has_line(text, R"(rdmig_transport_selected_total{reason="auto-no-source-rdma",transport="tcp"} 1)"));
  EXPECT_TRUE(has_line(text, R"(rdmig_transport_selected_total{reason="other",transport="tcp"} 2)")) << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_transport_selected_total{reason="other",transport="rdma"} 1)"));
  EXPECT_EQ(series(text, "rdmig_transport_selected_total").size(), std::size(kTransportReasons));
  EXPECT_TRUE(has_line(text, R"(rdmig_migration_failures_total{reason="peer_lost",role="source"} 1)"));
  EXPECT_TRUE(has_line(text, R"(rdmig_migration_failures_total{reason="other",role="source"} 1)"));
  EXPECT_EQ(series(text, "rdmig_migration_failures_total").size(), 2 * std::size(kFailureReasons));
}

TEST(Metrics, MigrationInfoFollowsThePhaseAndGoesWithTheMigration) {
  Metrics m;
  auto g = m.migration_gauges("m-1", "source", "vms/web");
  auto other = m.migration_gauges("m-2", "target", "vms/db");
  std::string text = m.serialize();
  ASSERT_EQ(series(text, "rdmig_migration_info").size(), 2u) << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_migration_info{migration="m-1",name="web",namespace="vms",phase="Pending",role="source",transport=""} 1)"))
      << text;
  const auto start = series(text, "rdmig_migration_start_time_seconds");
  ASSERT_EQ(start.size(), 2u);
  const double started = std::stod(start[0].substr(start[0].rfind(' ') + 1));
  EXPECT_GT(started, 1.7e9);  // unix seconds, not milliseconds or a monotonic clock
  EXPECT_LT(started, 1e10);
  EXPECT_TRUE(series(text, "rdmig_migration_end_time_seconds").empty()) << "no end time while it runs";

  m.migration_phase(g, "Connecting", "");
  m.migration_phase(g, "Migrating", "tcp");
  text = m.serialize();
  EXPECT_EQ(series(text, "rdmig_migration_info").size(), 2u) << "one series per migration: " << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_migration_info{migration="m-1",name="web",namespace="vms",phase="Migrating",role="source",transport="tcp"} 1)"));

  m.migration_ended(g, "Failed", "tcp");
  m.migration_phase(g, "Completing", "tcp");  // late: the result stays
  text = m.serialize();
  EXPECT_TRUE(has_line(text, R"(rdmig_migration_info{migration="m-1",name="web",namespace="vms",phase="Failed",role="source",transport="tcp"} 1)"))
      << text;
  EXPECT_EQ(series(text, "rdmig_migration_info").size(), 2u);
  const auto end = series(text, "rdmig_migration_end_time_seconds");
  ASSERT_EQ(end.size(), 1u);
  EXPECT_NE(end[0].find(R"(migration="m-1")"), std::string::npos);
  EXPECT_GE(std::stod(end[0].substr(end[0].rfind(' ') + 1)), started);

  m.remove_migration_gauges(g);  // forgotten: its series go, the other migration's stay
  text = m.serialize();
  for (const char* name : {"rdmig_migration_info", "rdmig_migration_start_time_seconds",
                           "rdmig_migration_end_time_seconds", "rdmig_migration_transferred_bytes"}) {
    for (const auto& line : series(text, name)) EXPECT_EQ(line.find("m-1"), std::string::npos) << line;
  }
  EXPECT_EQ(series(text, "rdmig_migration_info").size(), 1u);
  EXPECT_EQ(series(text, "rdmig_migration_start_time_seconds").size(), 1u);
  m.remove_migration_gauges(other);
  EXPECT_TRUE(series(m.serialize(), "rdmig_migration_info").empty());
}

TEST(Metrics, PerVmSeriesUseKubevirtsNamespaceAndNameLabels) {
  // KubeVirt's migration metrics label a VM with namespace and name: so do these, so that one
  // PromQL join relates both. A bare name gets name only (Prometheus adds the agent's namespace).
  Metrics m;
  auto g = m.migration_gauges("m-1", "source", "vms/web");
  auto bare = m.migration_gauges("m-2", "source", "lab-vm");
  m.set_downtime("vms/web", "tcp", 0.05);
  m.set_switchover("lab-vm", "tcp", 0.08);
  const std::string text = m.serialize();
  EXPECT_TRUE(has_line(text, R"(rdmig_last_downtime_seconds{name="web",namespace="vms"} 0.05)")) << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_last_switchover_seconds{name="lab-vm"} 0.08)")) << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_migration_total_bytes{migration="m-1",name="web",namespace="vms",role="source"} 0)"))
      << text;
  EXPECT_TRUE(has_line(text, R"(rdmig_migration_total_bytes{migration="m-2",name="lab-vm",role="source"} 0)")) << text;
  EXPECT_EQ(text.find("vm=\""), std::string::npos) << text;
  m.remove_migration_gauges(g);
  m.remove_migration_gauges(bare);
}
