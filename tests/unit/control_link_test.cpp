// The control connection's failover (session/control_link.h): over real unix socket pairs, a
// connection lost while messages flow is re-established, the two ends exchange (and prove) how
// many messages each received, and every message arrives once, in order.
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "session/control_link.h"
#include "session/protocol.h"
#include "session/resume.h"
#include "socket_pair.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"

namespace rdmig::session {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

using rdmig_test::socket_pair;  // socket_pair.h

// Two linked ends; `a` re-dials (as the source agent), `b` takes the re-dial (as the target).
struct Linked {
  transport::ChannelTerms terms{std::string(32, 'k'), std::string(32, 'a'), transport::kControlIndex};
  std::mutex mu;  // before the links: their readers use it until the links are gone
  std::condition_variable cv;
  std::optional<UniqueFd> for_b;
  int redials = 0;
  bool refuse = false;
  std::unique_ptr<ControlLink> a, b;

  ~Linked() {
    a->close();  // first: a then re-dials nothing while b goes
    b->close();
    a.reset();
    b.reset();
  }

  Linked() {
    auto [x, y] = socket_pair();
    a = std::make_unique<ControlLink>(std::move(x));
    b = std::make_unique<ControlLink>(std::move(y));
    a->fail_over_with(
        [this](uint64_t received, std::chrono::steady_clock::time_point,
               const std::function<bool()>&) -> Result<std::pair<UniqueFd, uint64_t>> {
          {
            std::lock_guard lock(mu);
            if (refuse) return Error{Errc::kPermissionDenied, "refused"};
          }
          auto [mine, theirs] = socket_pair();
          b->interrupt();  // before the hand-over, as the target does (RedialSlots::hand_over)
          {
            std::lock_guard lock(mu);
            for_b = std::move(theirs);
            ++redials;
          }
          cv.notify_all();
          auto peer = resume_as_dialler(mine.get(), terms, received, 2s);
          if (!peer) return peer.error();
          return std::make_pair(std::move(mine), peer.value());
        },
        2s);
    b->fail_over_with(
        [this](uint64_t received, std::chrono::steady_clock::time_point deadline,
               const std::function<bool()>& stopped) -> Result<std::pair<UniqueFd, uint64_t>> {
          UniqueFd fd;
          {
            std::unique_lock lock(mu);
            while (!for_b.has_value()) {
              if (stopped()) return Error{Errc::kCancelled, "closed"};
              if (std::chrono::steady_clock::now() >= deadline) return Error{Errc::kTimeout, "no re-dial"};
              cv.wait_for(lock, 20ms);
            }
            fd = std::move(*for_b);
            for_b.reset();
          }
          auto peer = resume_as_acceptor(fd.get(), terms, received, 2s);
          if (!peer) return peer.error();
          return std::make_pair(std::move(fd), peer.value());
        },
        2s);
  }
};

json msg(int n) { return message(MessageKind::kReady, json{{"n", n}}); }

std::vector<int> take(ControlLink& link, size_t count) {
  std::vector<int> got;
  while (got.size() < count) {
    auto m = link.next(5s);
    if (!m || !m->has_value()) break;
    got.push_back((**m).value("n", -1));
  }
  return got;
}

TEST(ControlLinkFailover, MessagesSentAcrossALossArriveOnceInOrderBothWays) {
  Linked l;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(l.a->send(msg(i)));
  ASSERT_TRUE(l.b->send(msg(100)));
  EXPECT_EQ(take(*l.b, 3), (std::vector<int>{0, 1, 2}));
  ::shutdown(l.a->fd(), SHUT_RDWR);  // the link is lost, as a reset would
  // Sent while the link is down or coming back: kept, resent after the resume.
  for (int i = 3; i < 6; ++i) ASSERT_TRUE(l.a->send(msg(i)));
  ASSERT_TRUE(l.b->send(msg(101)));
  EXPECT_EQ(take(*l.b, 3), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(take(*l.a, 2), (std::vector<int>{100, 101}));
  // Nothing twice.
  auto extra = l.b->next(200ms);
  ASSERT_TRUE(extra.ok());
  EXPECT_FALSE(extra->has_value()) << extra->value().dump();
  std::lock_guard lock(l.mu);
  EXPECT_GE(l.redials, 1);
}

TEST(ControlLinkFailover, APeerThatRefusesTheResumeEndsTheLinkNamingTheLoss) {
  Linked l;
  {
    std::lock_guard lock(l.mu);
    l.refuse = true;
  }
  ::shutdown(l.a->fd(), SHUT_RDWR);
  auto m = l.a->next(3s);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find("control connection lost"), std::string::npos) << m.error().message;
  EXPECT_NE(m.error().message.find("refused"), std::string::npos) << m.error().message;
}

TEST(ControlLinkFailover, ALinkClosedByThisEndIsNotResumed) {
  Linked l;
  l.a->close();
  auto m = l.a->next(3s);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().message.find("control connection lost"), std::string::npos) << m.error().message;
  std::lock_guard lock(l.mu);
  EXPECT_EQ(l.redials, 0);
}

TEST(ControlLinkFailover, OnlyWhatThePeerHasNotAcknowledgedIsKeptAndResent) {
  // A KubeVirt flow's heartbeats carry how many messages their sender received (acknowledged()):
  // the rest alone is kept, resent after a resume, and a peer that claims less than that is refused.
  auto [x, y] = socket_pair();
  ControlLink a(std::move(x));
  std::mutex mu;
  std::vector<UniqueFd> peers;  // the re-dials' far ends
  uint64_t claim = 0;
  std::optional<uint64_t> resent;
  a.fail_over_with(
      [&](uint64_t, std::chrono::steady_clock::time_point,
          const std::function<bool()>&) -> Result<std::pair<UniqueFd, uint64_t>> {
        auto [mine, theirs] = socket_pair();
        std::lock_guard lock(mu);
        peers.push_back(std::move(theirs));
        return std::make_pair(std::move(mine), claim);
      },
      1s, [&](const std::string&, std::chrono::milliseconds, uint64_t n) {
        std::lock_guard lock(mu);
        resent = n;
      });
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(a.send(msg(i)));
  a.acknowledged(3);
  a.acknowledged(9);  // more than was sent: not this end's doing, ignored
  {
    std::lock_guard lock(mu);
    claim = 3;
  }
  EXPECT_EQ(a.failovers(), 0u);
  ::shutdown(a.fd(), SHUT_RDWR);
  const auto until = std::chrono::steady_clock::now() + 3s;
  while (a.failovers() < 1 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(a.failovers(), 1u);
  EXPECT_FALSE(a.recovering());
  int far = -1;
  {
    std::lock_guard lock(mu);
    ASSERT_EQ(resent, std::optional<uint64_t>(2));
    far = peers.at(0).get();
  }
  for (int want : {3, 4}) {
    auto m = transport::recv_message(far, 2s);
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_EQ(m->value("n", -1), want);
  }
  // Messages 0..2 are no longer kept: a peer that says it has only 2 cannot be served.
  {
    std::lock_guard lock(mu);
    claim = 2;
  }
  ::shutdown(a.fd(), SHUT_RDWR);
  auto m = a.next(3s);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find("received 2 of this end's 5 messages: refused"), std::string::npos)
      << m.error().message;
}

TEST(ControlLinkFailover, ALinkThatStoppedFailingOverIsLostWithoutARedial) {
  Linked l;
  l.a->stop_failing_over();  // the peer turned out not to fail the link over
  ::shutdown(l.a->fd(), SHUT_RDWR);
  auto m = l.a->next(3s);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().message.find("control connection lost"), std::string::npos) << m.error().message;
  std::lock_guard lock(l.mu);
  EXPECT_EQ(l.redials, 0);
}

// While the link fails over, its state names the loss and the tries (a KubeVirt flow whose peer
// gave up first puts it in its reason, FlowSession::leg_error); once the failover ends, none.
TEST(ControlLinkFailover, WhileFailingOverItsStateNamesTheLossAndTheTries) {
  auto [x, y] = socket_pair();
  ControlLink a(std::move(x));
  std::atomic<bool> release{false};
  std::atomic<int> tries{0};
  a.fail_over_with(
      [&](uint64_t, std::chrono::steady_clock::time_point, const std::function<bool()>& stopped)
          -> Result<std::pair<UniqueFd, uint64_t>> {
        if (tries.fetch_add(1) == 0) {
          while (!release.load() && !stopped()) std::this_thread::sleep_for(5ms);  // a dial into a dropped link
        }
        return Error{Errc::kUnavailable, "control link re-dialled to 10.0.0.2:7472: connect: timed out"};
      },
      1500ms);
  EXPECT_FALSE(a.recovery_state().has_value());
  y.reset();  // the peer's end is gone: the reader fails over
  auto state_with = [&](const std::string& needle) {
    for (int i = 0; i < 400; ++i) {
      if (auto st = a.recovery_state(); st && st->find(needle) != std::string::npos) return *st;
      std::this_thread::sleep_for(5ms);
    }
    return std::string("(never: ") + needle + ")";
  };
  const std::string first = state_with("its first try under way");
  EXPECT_NE(first.find("control connection lost ("), std::string::npos) << first;
  EXPECT_NE(first.find("), failing over for "), std::string::npos) << first;
  release.store(true);
  const std::string later = state_with("the last: control link re-dialled to 10.0.0.2:7472");
  EXPECT_NE(later.find(" tr"), std::string::npos) << later;
  auto m = a.next(5s);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find("not back within 1500 ms"), std::string::npos) << m.error().message;
  EXPECT_FALSE(a.recovery_state().has_value());
  EXPECT_GE(tries.load(), 2);
}

}  // namespace
}  // namespace rdmig::session
