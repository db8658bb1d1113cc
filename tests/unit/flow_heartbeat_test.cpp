// The flow session's control link keeps itself alive: each side's control thread sends a signed
// heartbeat every kFlowHeartbeatInterval, and a side that verified nothing from its peer for the
// heartbeat timeout fails the turn (a cut link or a frozen agent, noticed in seconds). Forged or
// replayed heartbeats never count as the peer's: they fail the turn as any forged message does.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "session/resume.h"
#include "socket_pair.h"
#include "transport/wire.h"

#include "kubevirt/flow/flow_session.h"

using nlohmann::json;
using namespace rdmig;
using namespace rdmig::kubevirt;
using namespace std::chrono_literals;

namespace {
const std::string kKey = "k-0123456789abcdef";

class LinkEnd final : public FlowSession {
 public:
  LinkEnd(Metrics& m, UniqueFd fd, const std::string& own, const std::string& peer, std::chrono::milliseconds timeout)
      : FlowSession("s-" + own, FlowRecord{}, m) {
    set_link(std::make_unique<session::ControlLink>(std::move(fd)), std::make_unique<FlowSigner>(kKey, own, peer),
             timeout);
  }
  using FlowSession::control_turn;
  using FlowSession::stop_watching_peer;
  using FlowSession::control_fails_over;
  using FlowSession::interrupt_control;
  using FlowSession::send_signed;
  session::ControlLink& link() { return *link_; }
  // Failover of the control link, as both agents set it up once the welcome confirmed it.
  void fail_over(session::ControlLink::Reconnect reconnect, std::chrono::milliseconds deadline) {
    enable_failover("peer", deadline);
    fail_over_control(std::move(reconnect));
  }
};

using rdmig_test::socket_pair;  // socket_pair.h

// The source re-dials the control link (a fresh socket pair whose far end the target takes), as
// SourceSession::redial_control and TargetSession::reaccept_control do over TCP.
struct Broker {
  const transport::ChannelTerms terms{std::string(32, 'k'), std::string(32, 'a'), transport::kControlIndex};
  std::mutex mu;
  std::condition_variable cv;
  std::optional<UniqueFd> for_target;
  LinkEnd* target = nullptr;

  session::ControlLink::Reconnect dialler() {
    return [this](uint64_t received, std::chrono::steady_clock::time_point,
                  const std::function<bool()>&) -> Result<std::pair<UniqueFd, uint64_t>> {
      auto [mine, theirs] = socket_pair();
      {
        std::lock_guard lock(mu);
        for_target = std::move(theirs);
      }
      cv.notify_all();
      target->interrupt_control();  // as the target's admission of a proved re-dial does
      auto peer = session::resume_as_dialler(mine.get(), terms, received, 2s);
      if (!peer) return peer.error();
      return std::make_pair(std::move(mine), peer.value());
    };
  }
  session::ControlLink::Reconnect acceptor() {
    return [this](uint64_t received, std::chrono::steady_clock::time_point deadline,
                  const std::function<bool()>& stopped) -> Result<std::pair<UniqueFd, uint64_t>> {
      UniqueFd fd;
      {
        std::unique_lock lock(mu);
        while (!for_target.has_value()) {
          if (stopped()) return Error{Errc::kCancelled, "closed"};
          if (std::chrono::steady_clock::now() >= deadline) return Error{Errc::kTimeout, "no re-dial"};
          cv.wait_for(lock, 20ms);
        }
        fd = std::move(*for_target);
        for_target.reset();
      }
      auto peer = session::resume_as_acceptor(fd.get(), terms, received, 2s);
      if (!peer) return peer.error();
      return std::make_pair(std::move(fd), peer.value());
    };
  }
};

// Turns `end` until `stop` or an error; returns that error, if any.
std::optional<Error> turn_until(LinkEnd& end, const std::atomic<bool>& stop) {
  while (!stop.load()) {
    auto m = end.control_turn();
    if (!m) return m.error();
  }
  return std::nullopt;
}
}  // namespace

TEST(KubevirtFlowHeartbeat, HeartbeatsKeepASlowButLivePeerAndSilenceFailsWithinTheTimeout) {
  Metrics m;
  auto [a_fd, b_fd] = socket_pair();
  const auto timeout = 1500ms;
  LinkEnd source(m, std::move(a_fd), "source", "target", timeout);
  LinkEnd target(m, std::move(b_fd), "target", "source", timeout);
  // Both sides turn for three timeouts, sending nothing but heartbeats: neither fails.
  std::atomic<bool> stop_target{false}, stop_source{false};
  std::optional<Error> target_error;
  std::thread t([&] { target_error = turn_until(target, stop_target); });
  std::thread s([&] {
    const auto until = std::chrono::steady_clock::now() + 3 * timeout;
    while (std::chrono::steady_clock::now() < until) {
      auto r = source.control_turn();
      ASSERT_TRUE(r) << r.error().message;
      EXPECT_FALSE(r->has_value()) << "heartbeats are taken by the turn, not handed on";
    }
  });
  s.join();
  EXPECT_FALSE(target_error) << target_error->message;
  // The target freezes (its thread stops, the connection stays open, as behind a cut link):
  // the source's turn fails after the timeout, not before, and says why.
  stop_target = true;
  t.join();
  ASSERT_FALSE(target_error) << target_error->message;
  const auto frozen_at = std::chrono::steady_clock::now();
  std::optional<Error> e = turn_until(source, stop_source);
  const auto after = std::chrono::steady_clock::now() - frozen_at;
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, Errc::kTimeout) << e->message;
  EXPECT_NE(e->message.find("no heartbeat"), std::string::npos) << e->message;
  // It heard the target's last heartbeat at most two intervals before the freeze (one between
  // heartbeats, one for the target's last turn to end).
  EXPECT_GE(after, timeout - 2 * kFlowHeartbeatInterval);
  EXPECT_LT(after, timeout + 2 * kFlowHeartbeatInterval);
}

TEST(KubevirtFlowHeartbeat, AfterEndTheSilentPeerIsNotWatched) {
  Metrics m;
  auto [a_fd, b_fd] = socket_pair();
  LinkEnd source(m, std::move(a_fd), "source", "target", 1000ms);
  LinkEnd target(m, std::move(b_fd), "target", "source", 1000ms);
  source.stop_watching_peer();  // "end" sent: the target reads libvirt's figures, no heartbeats
  for (const auto until = std::chrono::steady_clock::now() + 2500ms; std::chrono::steady_clock::now() < until;) {
    auto r = source.control_turn();
    ASSERT_TRUE(r) << r.error().message;
  }
}

TEST(KubevirtFlowHeartbeat, ForgedAndReplayedHeartbeatsFailTheTurnAndNeverCountAsThePeers) {
  Metrics m;
  {
    auto [a_fd, b_fd] = socket_pair();
    LinkEnd source(m, std::move(a_fd), "source", "target", 1000ms);
    session::ControlLink raw(std::move(b_fd));
    FlowSigner peer(kKey, "target", "source");
    const json first = peer.sign(json{{"type", "heartbeat"}});
    ASSERT_TRUE(raw.send(first));
    auto r = source.control_turn();
    ASSERT_TRUE(r) << r.error().message;
    // The same heartbeat again (a replay by something on the path): out of sequence.
    ASSERT_TRUE(raw.send(first));
    std::optional<Error> e;
    for (int i = 0; i < 10 && !e; ++i) {
      auto t = source.control_turn();
      if (!t) e = t.error();
    }
    ASSERT_TRUE(e);
    EXPECT_EQ(e->code, Errc::kPermissionDenied) << e->message;
    EXPECT_NE(e->message.find("out of sequence"), std::string::npos) << e->message;
  }
  {
    // Signed without the session key, and one of the source's own signed back at it.
    for (const json& forged : {FlowSigner("other-key-0123456", "target", "source").sign(json{{"type", "heartbeat"}}),
                               FlowSigner(kKey, "source", "target").sign(json{{"type", "heartbeat"}})}) {
      auto [c_fd, d_fd] = socket_pair();
      LinkEnd victim(m, std::move(c_fd), "source", "target", 1000ms);
      session::ControlLink attacker(std::move(d_fd));
      ASSERT_TRUE(attacker.send(forged));
      std::optional<Error> e;
      for (int i = 0; i < 10 && !e; ++i) {
        auto t = victim.control_turn();
        if (!t) e = t.error();
      }
      ASSERT_TRUE(e);
      EXPECT_EQ(e->code, Errc::kPermissionDenied) << e->message;
      EXPECT_NE(e->message.find("MAC does not match"), std::string::npos) << e->message;
    }
  }
}

TEST(KubevirtFlowHeartbeat, AControlLinkCutWithFailoverResumesEverySignedMessageOnceAndCountsTheFailover) {
  // docs/failover.md: the link lost mid-flow (a reset) is re-dialled by the source and resumed; the
  // signed messages sent across the loss (the source's, heartbeats both ways) arrive once and in
  // order (a repeat or a gap would fail the signer's sequence), neither side fails, both count it.
  Metrics m;
  auto [a_fd, b_fd] = socket_pair();
  const auto timeout = 1500ms;
  Broker broker;  // declared before the ends: their links' readers use it until they are gone
  // The target first: the source (whose link re-dials into the target) goes first.
  LinkEnd target(m, std::move(b_fd), "target", "source", timeout);
  LinkEnd source(m, std::move(a_fd), "source", "target", timeout);
  broker.target = &target;
  source.fail_over(broker.dialler(), 3000ms);
  target.fail_over(broker.acceptor(), 3000ms);
  std::atomic<bool> stop{false};
  std::optional<Error> source_error, target_error;
  std::vector<int> got;  // the target's thread only, until it is joined
  std::atomic<size_t> count{0};
  std::thread t([&] {
    while (!stop.load()) {
      auto r = target.control_turn();
      if (!r) {
        target_error = r.error();
        return;
      }
      if (r->has_value()) {
        got.push_back((**r).value("n", -1));
        ++count;
      }
    }
  });
  std::thread s([&] { source_error = turn_until(source, stop); });
  for (int i = 0; i < 10; ++i) {
    if (i == 4) ::shutdown(source.link().fd(), SHUT_RDWR);  // the link is lost, as a reset would
    ASSERT_TRUE(source.send_signed(json{{"type", "open"}, {"n", i}}));
    std::this_thread::sleep_for(100ms);
  }
  // Both keep turning past a heartbeat timeout after the cut: neither fails.
  const auto until = std::chrono::steady_clock::now() + timeout + 1s;
  while (std::chrono::steady_clock::now() < until && count.load() < 10) std::this_thread::sleep_for(50ms);
  std::this_thread::sleep_for(timeout);
  stop = true;
  s.join();
  t.join();
  EXPECT_FALSE(source_error) << source_error->message;
  EXPECT_FALSE(target_error) << target_error->message;
  EXPECT_EQ(got, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_TRUE(source.control_fails_over() && target.control_fails_over());
  for (const LinkEnd* end : {&source, &target}) {
    const auto r = end->record();
    EXPECT_EQ(r.failovers, 1u) << end->id();
    EXPECT_EQ(r.last_failover.rfind("control connection: ", 0), 0u) << r.last_failover;
  }
}

TEST(KubevirtFlowHeartbeat, APeerSilentOnAFreshLinkTooFailsTheTurnAfterOneFailover) {
  // Silence (packets dropped, no error) fails the link over once; a peer still silent on the
  // re-dialled link is frozen, not cut off: the turn fails as without failover, saying so.
  Metrics m;
  auto [a_fd, b_fd] = socket_pair();
  const auto timeout = 1000ms;
  Broker broker;
  // The target first: the source (whose link re-dials into the target) goes first.
  LinkEnd target(m, std::move(b_fd), "target", "source", timeout);
  LinkEnd source(m, std::move(a_fd), "source", "target", timeout);
  broker.target = &target;
  source.fail_over(broker.dialler(), 2000ms);
  target.fail_over(broker.acceptor(), 2000ms);
  {
    // One heartbeat each way, so each knows the other fails the link over; then the target freezes
    // (its control thread stops; its link's reader still takes a re-dial).
    std::atomic<bool> stop{false};
    std::thread t([&] { (void)turn_until(target, stop); });
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(source.control_turn());
    stop = true;
    t.join();
  }
  const auto frozen_at = std::chrono::steady_clock::now();
  std::atomic<bool> never{false};
  std::optional<Error> e = turn_until(source, never);
  const auto after = std::chrono::steady_clock::now() - frozen_at;
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, Errc::kTimeout) << e->message;
  EXPECT_NE(e->message.find("not even after failing the link over"), std::string::npos) << e->message;
  EXPECT_EQ(source.record().failovers, 1u);
  EXPECT_GE(after, 2 * timeout - 2 * kFlowHeartbeatInterval);
  EXPECT_LT(after, 2 * timeout + 2000ms);
}

TEST(KubevirtFlowHeartbeat, APeerWhoseHeartbeatsCountNothingDoesNotFailTheControlLinkOver) {
  // A target that confirmed control failover, and a source from before it: the source's first
  // heartbeat carries no count, so the target keeps nothing and a lost link fails as before.
  Metrics m;
  auto [a_fd, b_fd] = socket_pair();
  Broker broker;
  LinkEnd target(m, std::move(b_fd), "target", "source", 1000ms);
  LinkEnd source(m, std::move(a_fd), "source", "target", 1000ms);
  broker.target = &target;
  target.fail_over(broker.acceptor(), 2000ms);
  ASSERT_TRUE(target.control_fails_over());
  ASSERT_TRUE(source.control_turn());  // its heartbeat, without "received"
  for (int i = 0; i < 4 && target.control_fails_over(); ++i) ASSERT_TRUE(target.control_turn());
  EXPECT_FALSE(target.control_fails_over());
}
