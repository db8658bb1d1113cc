// A KubeVirt flow session whose agents both chose RDMA, but whose source cannot reach the target
// over rdma_cm, carries its connections over TCP instead (transport auto), both sides naming why
// (auto-no-peer-rdma:unreachable); with rdma required the connection is refused naming the same.
// The target's RDMA endpoint here is 127.0.0.1:1, where no rdma_cm listener is: the connect fails
// at once without an RDMA device (this machine), or is refused or unroutable with one (the
// Soft-RoCE VM), always within the connect bound.
#include <gtest/gtest.h>
#include <poll.h>
#include <cerrno>
#include <sys/socket.h>

#include <thread>

#include "common/net.h"
#include "common/token_source.h"
#include "kubevirt/flow/sessions.h"
#include "session/transport_choice.h"
#include "socket_pair.h"
#include "transport/channel_proof.h"
#include "transport/rdma/cm.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/wire.h"

using nlohmann::json;
using namespace rdmig;
using namespace rdmig::kubevirt;
using namespace std::chrono_literals;

namespace {

struct Side {
  // `mtus`: one rail per entry (rail i on 127.0.0.1, rdma_cm port i + 1, where no listener is),
  // each port's active MTU.
  explicit Side(TransportKind transport, std::vector<uint32_t> mtus = {0}) {
    config.transport = transport;
    config.data_plane.allow_loopback_peers = true;  // the rails are on 127.0.0.1: a lab's config
    rdma.available = true;  // as both agents had found a device
    rdma.ip = "127.0.0.1";
    rdma.port = 1;  // no rdma_cm listener there
    for (uint32_t i = 0; i < mtus.size(); ++i) {
      session::RdmaRail rail;
      rail.rail = i;
      rail.device = "rxe-test" + std::to_string(i);
      rail.ip = rdma.ip;
      rail.port = static_cast<uint16_t>(i + 1);
      rail.mtu = mtus[i];
      rdma.rails.push_back(rail);
    }
    rdma.mtu = mtus.front();
  }
  SessionContext ctx() {
    return SessionContext{config, metrics, rdma, TokenSource::fixed("fallback-test-token-0123456789"),
                          [](uint64_t, const std::string&) -> Result<BufferTicket> { return BufferTicket(std::make_shared<int>(0)); }};
  }
  AgentConfig config;
  Metrics metrics;
  session::RdmaSupport rdma;
};

// The target agent's data-plane port in miniature: the flow hello makes a TargetSession, a
// flow-data hello hands its connection to that session.
class TargetAgent {
 public:
  explicit TargetAgent(Side& side, StatsReader stats = nullptr) : side_(side), stats_(std::move(stats)) {
    auto l = net::tcp_listen("127.0.0.1", 0);
    EXPECT_TRUE(l.ok());
    listener_ = std::move(l.value());
    port_ = net::local_port(listener_.get()).value();
    thread_ = std::thread([this] { serve(); });
  }
  ~TargetAgent() {
    stop_ = true;
    ::shutdown(listener_.get(), SHUT_RDWR);
    thread_.join();
  }
  uint16_t port() const { return port_; }
  std::shared_ptr<TargetSession> session() {
    std::lock_guard lock(mu_);
    return session_;
  }

 private:
  void serve() {
    while (!stop_) {
      auto fd = net::accept_for(listener_.get(), 100ms);
      if (!fd) continue;
      auto hello = transport::recv_message(fd->get(), 5s);
      if (!hello) continue;
      if (hello->value("kind", "") == "flow") {
        auto h = session::Hello::parse(hello.value(), session::Purpose::kFlow);
        ASSERT_TRUE(h.ok()) << h.error().message;
        auto s = TargetSession::accept(
            side_.ctx(), std::move(fd.value()), h.value(),
            [](const session::Hello&) -> Result<NetnsLocator> {
              return NetnsLocator{[](const net::Endpoint& dst) -> Result<std::shared_ptr<NetNs>> {
                return Error{Errc::kPermissionDenied, "no virt-handler owns " + dst.to_string() + " in this test"};
              }};
            },
            stats_);
        if (!s) continue;  // refused: the source sees why
        s.value()->start();
        std::lock_guard lock(mu_);
        session_ = s.value();
      } else if (auto s = session()) {
        // As the relay does: the channel proves the session's key first.
        auto dh = session::Hello::parse(hello.value(), session::Purpose::kFlow);
        ASSERT_TRUE(dh.ok()) << dh.error().message;
        auto proof = transport::check_channel(fd->get(), s->channel_terms(dh->index), dh->nonce, 5s);
        ASSERT_TRUE(proof.ok()) << proof.error().message;
        (void)s->add_tcp_channel(std::move(fd.value()), dh->index, proof.value(), dh->tls);
      }
    }
  }

  Side& side_;
  StatsReader stats_;
  UniqueFd listener_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::shared_ptr<TargetSession> session_;
  std::thread thread_;
};

PeerInfo peer(const TargetAgent& agent) {
  PeerInfo p;
  p.node = "node-b";
  p.agent = net::Endpoint{"127.0.0.1", agent.port()};
  return p;
}

FlowRecord source_record() {
  FlowRecord r;
  r.migration_uid = "mig-fallback";
  r.role = "source";
  r.source_node = "node-a";
  r.target_node = "node-b";
  r.mode = "static";
  return r;
}

double selected(Metrics& m, const std::string& transport, const std::string& reason) {
  const std::string text = m.serialize();
  const std::string line = "rdmig_transport_selected_total{reason=\"" + reason + "\",transport=\"" + transport + "\"} ";
  const auto at = text.find(line);
  return at == std::string::npos ? -1 : std::stod(text.substr(at + line.size()));
}

using rdmig_test::socket_pair;  // socket_pair.h

}  // namespace

TEST(KubevirtFlowFallback, UnreachableRdmaWithTransportAutoCarriesOverTcpAndBothSidesSayWhy) {
  Side src(TransportKind::kAuto), dst(TransportKind::kAuto);
  TargetAgent agent(dst);
  auto s = SourceSession::open(src.ctx(), peer(agent), source_record(), 5s);
  ASSERT_TRUE(s.ok()) << s.error().message;
  EXPECT_EQ(s.value()->record().transport, "rdma");  // both chose RDMA
  auto [qemu, proxy] = socket_pair();
  const auto t0 = std::chrono::steady_clock::now();
  auto st = s.value()->add_connection(std::move(proxy), net::Endpoint{"10.99.2.2", 49152});
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(st.ok()) << st.error().message;
  EXPECT_LT(took, session::kRdmaConnectTimeout + 5s);
  const auto rec = s.value()->record();
  EXPECT_EQ(rec.transport, "tcp");
  EXPECT_EQ(rec.transport_reason, session::kPeerRdmaUnreachable);
  // The target switched before it took the TCP channel.
  auto t = agent.session();
  ASSERT_TRUE(t);
  EXPECT_EQ(t->record().transport, "tcp");
  EXPECT_EQ(t->record().transport_reason, session::kPeerRdmaUnreachable);
  // Counted once each side, as the fallback; the RDMA choice that did not hold is not counted.
  for (Metrics* m : {&src.metrics, &dst.metrics}) {
    EXPECT_EQ(selected(*m, "tcp", "auto-no-peer-rdma"), 1);
    EXPECT_EQ(selected(*m, "rdma", "auto-both-rdma"), 0);
  }
  s.value().reset();
}

TEST(KubevirtFlowFallback, UnreachableRdmaWithRdmaRequiredRefusesTheConnectionNamingWhy) {
  Side src(TransportKind::kRdma), dst(TransportKind::kAuto);
  TargetAgent agent(dst);
  auto s = SourceSession::open(src.ctx(), peer(agent), source_record(), 5s);
  ASSERT_TRUE(s.ok()) << s.error().message;
  auto [qemu, proxy] = socket_pair();
  auto st = s.value()->add_connection(std::move(proxy), net::Endpoint{"10.99.2.2", 49152});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find(session::kPeerRdmaUnreachable), std::string::npos) << st.error().message;
  EXPECT_NE(st.error().message.find("rdma is required"), std::string::npos) << st.error().message;
  EXPECT_EQ(s.value()->record().transport, "rdma");
  EXPECT_EQ(selected(src.metrics, "tcp", "auto-no-peer-rdma"), 0);
  s.value().reset();
}

TEST(KubevirtFlowRails, ARailWhosePortsMtusDifferCarriesOverTcpNamingTheRail) {
  // Both agents have two rails; rail 1's ports disagree (4096 here, 1024 there): with transport
  // auto the target chooses TCP at the welcome, naming the rail, before anything goes over RDMA.
  Side src(TransportKind::kAuto, {4096, 4096}), dst(TransportKind::kAuto, {4096, 1024});
  TargetAgent agent(dst);
  auto s = SourceSession::open(src.ctx(), peer(agent), source_record(), 5s);
  ASSERT_TRUE(s.ok()) << s.error().message;
  EXPECT_EQ(s.value()->record().transport, "tcp");
  EXPECT_EQ(s.value()->record().transport_reason, "auto-no-peer-rdma:mtu-mismatch");
  auto [qemu, proxy] = socket_pair();
  auto st = s.value()->add_connection(std::move(proxy), net::Endpoint{"10.99.2.2", 49152});
  ASSERT_TRUE(st.ok()) << st.error().message;
  EXPECT_TRUE(s.value()->record().rails.empty()) << "over TCP no rail carries anything";
  s.value().reset();
}

TEST(KubevirtFlowRails, ConnectionIGoesOnRailIModTwoAndItsFailureNamesTheRail) {
  // Two rails on each side whose MTUs agree: the welcome lists both of the target's endpoints
  // (127.0.0.1:1 and :2, where no rdma_cm listens), so connection 0 tries rail 0 and connection
  // 1 tries rail 1; with rdma required each refusal names its rail, device and endpoint.
  Side src(TransportKind::kRdma, {4096, 4096}), dst(TransportKind::kAuto, {4096, 4096});
  TargetAgent agent(dst);
  auto s = SourceSession::open(src.ctx(), peer(agent), source_record(), 5s);
  ASSERT_TRUE(s.ok()) << s.error().message;
  EXPECT_EQ(s.value()->record().transport, "rdma");
  for (uint32_t i = 0; i < 2; ++i) {
    auto [qemu, proxy] = socket_pair();
    auto st = s.value()->add_connection(std::move(proxy), net::Endpoint{"10.99.2.2", 49152});
    ASSERT_FALSE(st.ok());
    const std::string want = "RDMA channel " + std::to_string(i) + " on rail " + std::to_string(i) + " (rxe-test" +
                             std::to_string(i) + " 127.0.0.1 to 127.0.0.1:" + std::to_string(i + 1) + ")";
    EXPECT_NE(st.error().message.find(want), std::string::npos) << st.error().message;
  }
  s.value().reset();
}

// After "end" the target reads libvirt's verdict: figures when the incoming job completed, a
// failure when the VM runs nowhere on its node (libvirt removed the domain, or the target pod
// is gone). The source's record follows the target's libvirt, not the clean ends of its streams:
// a migration whose target pod was deleted as the last bytes went out is Failed, never Succeeded.
TEST(KubevirtFlowVerdict, TheSourceSucceedsOnlyWhenTheTargetsLibvirtHasTheVm) {
  struct Case {
    Result<LibvirtJobStats> stats;
    const char* phase;
    const char* reason;
  };
  LibvirtJobStats done;
  done.domain = "default_vm";
  done.downtime_ms = 42;
  const std::vector<Case> cases = {
      {done, "Succeeded", ""},
      {Error{Errc::kFailedPrecondition, "the migrated VMI does not run on this node: no virt-launcher process"},
       "Failed", "target agent aborted: after the stream ended: the migrated VMI does not run on this node"},
      // Figures that could not be read (a daemon that refused the agent) say nothing about the VM.
      {Error{Errc::kNotFound, "libvirt at qemu+unix:///session?socket=x: permission denied"}, "Succeeded", ""},
  };
  for (const auto& c : cases) {
    Side src(TransportKind::kTcp), dst(TransportKind::kTcp);
    TargetAgent agent(dst, [&](const VmiRef& vmi) -> Result<LibvirtJobStats> {
      EXPECT_EQ(vmi.uid, "vmi-uid-1");
      return c.stats;
    });
    FlowRecord rec = source_record();
    rec.mode = "hook";
    rec.vmi = VmiRef{"default", "vm", "vmi-uid-1"};
    auto s = SourceSession::open(src.ctx(), peer(agent), rec, 5s);
    ASSERT_TRUE(s.ok()) << s.error().message;
    s.value()->finish();
    const auto r = s.value()->record();
    EXPECT_EQ(r.phase, c.phase) << r.reason;
    EXPECT_EQ(r.reason.rfind(c.reason, 0), 0u) << r.reason;
    if (c.stats) {
      ASSERT_TRUE(r.libvirt);
      EXPECT_EQ(r.libvirt->downtime_ms, 42);
    }
    s.value().reset();
  }
}

// A rail failover's re-dial (docs/failover.md): an RDMA connect request for a channel that runs is
// taken only where the target offered it (failoverRails in its welcome: failover on both agents,
// "rail" in its failoverPaths) and proved with the session's channel key over a fresh nonce;
// anything else is refused and displaces nothing. The channel that runs here stands in for an
// RDMA one (delivered through the same plan over a TCP pair, no RDMA device needed); displaced,
// its link is aborted, which its far end sees.
namespace {

struct LinkPair {
  UniqueFd near, far;  // near: the channel's socket; far: the peer's end, watched
};

LinkPair link_pair() {
  auto l = net::tcp_listen("127.0.0.1", 0);
  EXPECT_TRUE(l.ok());
  auto c = net::tcp_connect(net::Endpoint{"127.0.0.1", net::local_port(l->get()).value()}, 2s);
  EXPECT_TRUE(c.ok());
  auto a = net::accept_for(l->get(), 2s);
  EXPECT_TRUE(a.ok());
  return {std::move(a.value()), std::move(c.value())};
}

// True when `fd`'s connection ended (EOF or reset) within `within`; what the channel sent on it
// (its credits) is read and dropped.
bool ended_within(int fd, std::chrono::milliseconds within) {
  const auto until = std::chrono::steady_clock::now() + within;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    char b[4096];
    const ssize_t n = ::recv(fd, b, sizeof b, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
  }
}

transport::rdma::ConnectRequest connect_request(TargetSession& t, uint32_t index, const std::string& key) {
  transport::rdma::ConnectRequest req;
  req.session = transport::rdma::session_from_hex(t.session_key()).value();
  req.index = static_cast<uint16_t>(index);
  transport::rdma::sign_request(req, key);  // a fresh nonce each time
  return req;
}

struct RailRedialCase {
  Side src{TransportKind::kAuto}, dst{TransportKind::kAuto};
  std::unique_ptr<TargetAgent> agent;
  std::unique_ptr<SourceSession> source;
  std::shared_ptr<TargetSession> target;
  transport::rdma::ConnectRequest first;
  LinkPair running;

  // `dst_failover`, `dst_paths`: the target agent's dataPlane.failover and failoverPaths;
  // `dst_alternate`: its rail 0 has an alternate address (rdma.alternateAddresses[0]).
  void open(bool dst_failover, std::vector<std::string> dst_paths = {"rail", "tcp"}, bool dst_alternate = false) {
    src.config.data_plane.failover = true;
    dst.config.data_plane.failover = dst_failover;
    dst.config.data_plane.failover_paths = std::move(dst_paths);
    if (dst_alternate) {
      auto alt = dst.rdma.rails[0];
      alt.ip = "127.0.0.2";
      dst.rdma.rails[0].alternates.push_back(alt);
      dst.rdma.rails[0].alternate_slots.push_back(0);
    }
    agent = std::make_unique<TargetAgent>(dst);
    auto s = SourceSession::open(src.ctx(), peer(*agent), source_record(), 5s);
    ASSERT_TRUE(s.ok()) << s.error().message;
    source = std::move(s.value());
    // The agent's thread publishes the session once accept() returned (after its welcome).
    for (const auto until = std::chrono::steady_clock::now() + 5s; !target && std::chrono::steady_clock::now() < until;) {
      target = agent->session();
      if (!target) std::this_thread::sleep_for(10ms);  // polling a condition, with a deadline
    }
    ASSERT_TRUE(target);
    ASSERT_EQ(target->record().transport, "rdma");
    // Channel 0 connects as a first connect does, and runs (waiting for its destination).
    first = connect_request(*target, 0, target->channel_terms(0).key);
    auto plan = target->rdma_plan(first);
    ASSERT_TRUE(plan.ok()) << plan.error().message;
    running = link_pair();
    plan->deliver(channel_over(std::move(running.near)));
  }
  // A channel with the session's chunk size and depth over `fd`.
  std::unique_ptr<transport::Channel> channel_over(UniqueFd fd) {
    const uint64_t chunk = src.config.migration.chunk_size;
    return transport::TcpChannel::create(std::move(fd), 0, static_cast<uint32_t>(chunk),
                                         flow_ring_depth(src.config.kubevirt.ring_depth, chunk),
                                         dst.metrics.transport("tcp"));
  }
  ~RailRedialCase() {
    source.reset();
    target.reset();
    agent.reset();
  }
};

}  // namespace

TEST(KubevirtFlowRailFailover, ARedialOfALiveChannelWhereTheTargetOfferedRailsDisplacesIt) {
  RailRedialCase c;
  ASSERT_NO_FATAL_FAILURE(c.open(true));
  EXPECT_TRUE(c.target->record().failover);
  auto plan = c.target->rdma_plan(connect_request(*c.target, 0, c.target->channel_terms(0).key));
  ASSERT_TRUE(plan.ok()) << plan.error().message;
  EXPECT_FALSE(ended_within(c.running.far.get(), 300ms));  // admitted, not yet connected: nothing moved
  auto redial = link_pair();
  plan->deliver(c.channel_over(std::move(redial.near)));
  // The running channel gave up its link for the re-dial (its failover takes it).
  EXPECT_TRUE(ended_within(c.running.far.get(), 3000ms));
}

TEST(KubevirtFlowRailFailover, ARedialIsRefusedWhereTheTargetDoesNotFailOverAndDisplacesNothing) {
  RailRedialCase c;
  ASSERT_NO_FATAL_FAILURE(c.open(false));
  EXPECT_FALSE(c.target->record().failover);
  auto plan = c.target->rdma_plan(connect_request(*c.target, 0, c.target->channel_terms(0).key));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.error().code, Errc::kAlreadyExists) << plan.error().message;
  EXPECT_FALSE(ended_within(c.running.far.get(), 500ms));
}

TEST(KubevirtFlowRailFailover, ARedialIsRefusedWhereTheTargetsPathsLeaveRailsOutAndDisplacesNothing) {
  // Failover on, but failoverPaths [tcp] here: no failoverRails in the welcome, so a connect
  // request for a running channel is no re-dial this end takes (the source re-dials over TCP).
  RailRedialCase c;
  ASSERT_NO_FATAL_FAILURE(c.open(true, {"tcp"}));
  EXPECT_TRUE(c.target->record().failover);
  auto plan = c.target->rdma_plan(connect_request(*c.target, 0, c.target->channel_terms(0).key));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.error().code, Errc::kAlreadyExists) << plan.error().message;
  EXPECT_FALSE(ended_within(c.running.far.get(), 500ms));
}

TEST(KubevirtFlowRailFailover, ARedialOnAnAlternateAddressIsTakenWhereTheTargetOfferedAddresses) {
  // failoverPaths [address] and an alternate on rail 0: failoverAddresses in the welcome, so a
  // connect request for the running channel that arrived on the alternate's listener is its re-dial.
  RailRedialCase c;
  ASSERT_NO_FATAL_FAILURE(c.open(true, {"address"}, true));
  EXPECT_TRUE(c.target->record().failover);
  auto req = connect_request(*c.target, 0, c.target->channel_terms(0).key);
  req.address = 1;  // as the data-plane server marks a request its alternate 0's listener took
  auto plan = c.target->rdma_plan(req);
  ASSERT_TRUE(plan.ok()) << plan.error().message;
  auto redial = link_pair();
  plan->deliver(c.channel_over(std::move(redial.near)));
  EXPECT_TRUE(ended_within(c.running.far.get(), 3000ms));
}

TEST(KubevirtFlowRailFailover, ARedialIsRefusedWhereTheTargetListsAddressesButHasNoAlternate) {
  // failoverPaths [address] without an alternate address here: no RDMA path to offer, nothing taken.
  RailRedialCase c;
  ASSERT_NO_FATAL_FAILURE(c.open(true, {"address"}));
  auto plan = c.target->rdma_plan(connect_request(*c.target, 0, c.target->channel_terms(0).key));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.error().code, Errc::kAlreadyExists) << plan.error().message;
  EXPECT_FALSE(ended_within(c.running.far.get(), 500ms));
}

TEST(KubevirtFlowRailFailover, ARedialWithoutTheKeyOrWithAReplayedProofIsRefusedAndDisplacesNothing) {
  RailRedialCase c;
  ASSERT_NO_FATAL_FAILURE(c.open(true));
  // Not the session's key.
  auto forged = c.target->rdma_plan(connect_request(*c.target, 0, c.target->channel_terms(0).key + "x"));
  ASSERT_FALSE(forged.ok());
  EXPECT_EQ(forged.error().code, Errc::kUnauthenticated) << forged.error().message;
  // The first connect's request again: its proof was taken once.
  auto replayed = c.target->rdma_plan(c.first);
  ASSERT_FALSE(replayed.ok());
  EXPECT_EQ(replayed.error().code, Errc::kUnauthenticated) << replayed.error().message;
  EXPECT_FALSE(ended_within(c.running.far.get(), 500ms));
}
