// The flow session's control link keeps itself alive: each side's control thread sends a signed
// heartbeat every kFlowHeartbeatInterval, and a side that verified nothing from its peer for the
// heartbeat timeout fails the turn (a cut link or a frozen agent, noticed in seconds). Forged or
// replayed heartbeats never count as the peer's: they fail the turn as any forged message does.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>

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
  session::ControlLink& link() { return *link_; }
};

std::pair<UniqueFd, UniqueFd> socket_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

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
