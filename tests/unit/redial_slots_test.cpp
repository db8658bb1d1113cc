// session::RedialSlots over real loopback connections: the accepting end of a failover waits for
// the peer's re-dial, takes it and runs the proved resume exchange; a newer re-dial replaces one
// not taken; no re-dial ends at the deadline naming what was awaited; a stop ends the wait. And
// hand_over's order: a re-dial announced while this end's own failover of the same loss runs is
// taken by that failover, and the announcement never gives up the link it brought.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "common/net.h"
#include "metrics/metrics.h"
#include "session/control_link.h"
#include "session/failover_channel.h"
#include "session/redial_slots.h"
#include "session/resume.h"
#include "transport/wire.h"

using namespace rdmig;
using namespace rdmig::session;
using namespace std::chrono_literals;

namespace {

const transport::ChannelTerms kTerms{std::string(64, 'k'), std::string(32, 'a'), 2};

// A loopback listener and a first connection through it: the dialler's end, the acceptor's, and
// the listener with its port (where re-dials come).
struct FirstLink {
  UniqueFd listener;
  uint16_t port = 0;
  UniqueFd dialled, accepted;
};
FirstLink first_link() {
  FirstLink f;
  auto l = net::tcp_listen("127.0.0.1", 0);
  EXPECT_TRUE(l.ok());
  f.listener = std::move(l.value());
  f.port = net::local_port(f.listener.get()).value();
  auto c = net::tcp_connect({"127.0.0.1", f.port}, 2s);
  auto s = net::accept_for(f.listener.get(), 2s);
  EXPECT_TRUE(c.ok() && s.ok());
  f.dialled = std::move(c.value());
  f.accepted = std::move(s.value());
  return f;
}

// A connected pair on loopback: first the dialler's end, second the acceptor's.
std::pair<UniqueFd, UniqueFd> connected() {
  auto f = first_link();
  return {std::move(f.dialled), std::move(f.accepted)};
}

// The accepting agent's side of a re-dial, as TargetJob::on_data runs it: accepts on `listener`
// and hands each connection over to the failover of `index` with `give_up_live`, which first waits
// (up to 500 ms) for `resumed` to turn true. A hand-over that put the re-dial first would let this
// end's own failover of the same loss take it and resume before the give-up runs, which would then
// give up the new link: the wait makes that order fail every time, not once in thirty runs.
class Acceptor {
 public:
  Acceptor(RedialSlots& slots, int listener, uint32_t index, std::function<bool()> resumed,
           std::function<void()> give_up)
      : thread_([this, &slots, listener, index, resumed = std::move(resumed), give_up = std::move(give_up)] {
          while (!stop_.load()) {
            auto fd = net::accept_for(listener, 50ms);
            if (!fd) continue;
            slots.hand_over(index, std::move(fd.value()), [&] {
              const auto until = std::chrono::steady_clock::now() + 500ms;
              while (!resumed() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
              give_up();
            });
          }
        }) {}
  ~Acceptor() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Waits up to 5 s for `done`; then 500 ms more (five of the watcher's periods) for anything late.
bool settles(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(500ms);
  return done();
}

}  // namespace

TEST(RedialSlots, ARedialAnnouncedWhileTheSameLossIsFailedOverHereIsTakenOnceAndItsLinkKept) {
  // A data channel: both ends lose the link; A (the source) re-dials, B (the target) fails over on
  // its own and takes the re-dial; the announcement of the re-dial finds B's failover under way.
  constexpr uint32_t kChunk = 64 * 1024, kDepth = 8;
  Metrics metrics;
  auto& tm = metrics.transport("tcp");
  auto link = first_link();
  ASSERT_TRUE(link.dialled.valid() && link.accepted.valid());
  const uint16_t port = link.port;
  const int b_first = link.accepted.get();
  const transport::ChannelTerms terms{kTerms.key, kTerms.session, 0};
  RedialSlots slots;
  auto make = [&](UniqueFd fd) { return transport::TcpChannel::create(std::move(fd), 0, kChunk, kDepth, tm); };
  auto a = std::make_unique<FailoverChannel>(
      make(std::move(link.dialled)), kDepth, 5s, [&](uint64_t taken, const Error&, auto, const auto&) -> Result<Resumed> {
        auto fd = net::tcp_connect({"127.0.0.1", port}, 2s);
        if (!fd) return fd.error();
        auto peer = resume_as_dialler(fd->get(), terms, taken, 2s);
        if (!peer) return peer.error();
        return Resumed{make(std::move(fd.value())), peer.value(), "tcp (re-dialled)"};
      });
  std::unique_ptr<FailoverChannel> b;
  b = std::make_unique<FailoverChannel>(
      make(std::move(link.accepted)), kDepth, 5s,
      [&](uint64_t taken, const Error&, auto deadline, const auto& stopped) -> Result<Resumed> {
        auto r = slots.take(0, terms, taken, deadline, stopped, 2000ms);
        if (!r) return r.error();
        return resumed_redial(std::move(r.value()), 0, TcpGeometry{kChunk, kDepth, &tm}, nullptr);
      });
  {
    Acceptor acceptor(slots, link.listener.get(), 0, [&] { return b->failovers() >= 1; },
                      [&] { b->interrupt(Error{Errc::kUnavailable, "the source agent re-dialled channel 0"}); });
    ::shutdown(b_first, SHUT_RDWR);  // both ends see the link fail
    EXPECT_TRUE(settles([&] { return a->failovers() == 1 && b->failovers() == 1; }))
        << "failovers: A " << a->failovers() << ", B " << b->failovers() << "; A's last: "
        << a->last_failover().value_or("none") << "; B's last: " << b->last_failover().value_or("none");
  }
  // The link B resumed on is the one A carries on: a chunk each way arrives.
  for (auto [from, to] : {std::pair{a.get(), b.get()}, std::pair{b.get(), a.get()}}) {
    auto buf = from->acquire();
    ASSERT_TRUE(buf.ok()) << buf.error().message;
    (*buf)[0] = std::byte{42};
    ASSERT_TRUE(from->send(1).ok());
    auto got = to->receive();
    ASSERT_TRUE(got.ok()) << got.error().message;
    ASSERT_EQ(got->data.size(), 1u);
    EXPECT_EQ(got->data[0], std::byte{42});
    ASSERT_TRUE(to->release().ok());
  }
  EXPECT_EQ(a->failovers(), 1u);
  EXPECT_EQ(b->failovers(), 1u);
  a.reset();
  b.reset();
}

TEST(RedialSlots, AControlConnectionRedialAnnouncedWhileItsLossIsFailedOverHereIsTakenOnceAndKept) {
  auto link = first_link();
  ASSERT_TRUE(link.dialled.valid() && link.accepted.valid());
  const uint16_t port = link.port;
  const int b_first = link.accepted.get();
  const transport::ChannelTerms terms{kTerms.key, kTerms.session, transport::kControlIndex};
  RedialSlots slots;
  ControlLink a(std::move(link.dialled));
  ControlLink b(std::move(link.accepted));
  a.fail_over_with(
      [&](uint64_t received, auto, const auto&) -> Result<std::pair<UniqueFd, uint64_t>> {
        auto fd = net::tcp_connect({"127.0.0.1", port}, 2s);
        if (!fd) return fd.error();
        auto peer = resume_as_dialler(fd->get(), terms, received, 2s);
        if (!peer) return peer.error();
        return std::make_pair(std::move(fd.value()), peer.value());
      },
      5s);
  b.fail_over_with(
      [&](uint64_t received, auto deadline, const auto& stopped) -> Result<std::pair<UniqueFd, uint64_t>> {
        auto r = slots.take(transport::kControlIndex, terms, received, deadline, stopped, 2000ms);
        if (!r) return r.error();
        return std::make_pair(std::move(r->fd), r->peer_count);
      },
      5s);
  {
    Acceptor acceptor(slots, link.listener.get(), transport::kControlIndex, [&] { return b.failovers() >= 1; },
                      [&] { b.interrupt(); });
    ::shutdown(b_first, SHUT_RDWR);
    EXPECT_TRUE(settles([&] { return a.failovers() == 1 && b.failovers() == 1; }))
        << "failovers: A " << a.failovers() << ", B " << b.failovers();
  }
  ASSERT_TRUE(a.send(nlohmann::json{{"type", "ping"}}).ok());
  ASSERT_TRUE(b.send(nlohmann::json{{"type", "pong"}}).ok());
  for (auto [end, type] : {std::pair{&b, "ping"}, std::pair{&a, "pong"}}) {
    auto m = end->next(2s);
    ASSERT_TRUE(m.ok()) << m.error().message;
    ASSERT_TRUE(m->has_value()) << "nothing arrived within 2 s";
    EXPECT_EQ((**m).value("type", ""), type);
  }
  EXPECT_EQ(a.failovers(), 1u);
  EXPECT_EQ(b.failovers(), 1u);
  a.close();  // first: A then re-dials nothing while B goes
  b.close();
}

TEST(RedialSlots, TakesTheRedialPutLaterAndResumesItProved) {
  RedialSlots slots;
  auto [dial, accept] = connected();
  Result<uint64_t> dialler_got = Error{Errc::kInternal, "not run"};
  std::thread peer([&, d = dial.get()] { dialler_got = resume_as_dialler(d, kTerms, 11, 2s); });
  std::thread putter([&, fd = std::move(accept)]() mutable {
    std::this_thread::sleep_for(50ms);  // the take waits first
    slots.put(2, std::move(fd));
  });
  auto r = slots.take(2, kTerms, 7, std::chrono::steady_clock::now() + 3s, [] { return false; }, 2000ms);
  putter.join();
  peer.join();
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->peer_count, 11u);  // the dialler's count, proved
  ASSERT_TRUE(dialler_got.ok()) << dialler_got.error().message;
  EXPECT_EQ(dialler_got.value(), 7u);  // this end's count, proved
  EXPECT_EQ(r->where, "channel 2 re-dialled by the source");
  EXPECT_TRUE(r->fd.valid());
}

TEST(RedialSlots, ARedialForAnotherIndexOrWithoutTheKeyIsNotTaken) {
  RedialSlots slots;
  auto [dial, accept] = connected();
  slots.put(3, std::move(accept));  // another channel's
  auto none = slots.take(2, kTerms, 0, std::chrono::steady_clock::now() + 200ms, [] { return false; }, 2000ms);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, Errc::kTimeout);
  EXPECT_EQ(none.error().message, "no re-dial of channel 2 from the source agent arrived");
  // Channel 3's re-dial proves another key: the resume fails, no count is taken from it.
  const transport::ChannelTerms other{std::string(64, 'x'), kTerms.session, 3};
  std::thread peer([d = dial.get(), other] { (void)resume_as_dialler(d, other, 5, 2s); });
  const transport::ChannelTerms three{kTerms.key, kTerms.session, 3};
  auto bad = slots.take(3, three, 0, std::chrono::steady_clock::now() + 2s, [] { return false; }, 2000ms);
  peer.join();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("channel 3 re-dialled by the source"), std::string::npos) << bad.error().message;
}

TEST(RedialSlots, AStopEndsTheWaitAtOnce) {
  RedialSlots slots;
  std::atomic<bool> stop{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    stop = true;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto r = slots.take(transport::kControlIndex, kTerms, 0, t0 + 10s, [&] { return stop.load(); }, 2000ms);
  stopper.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::kCancelled);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
}
