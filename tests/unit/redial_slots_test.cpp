// session::RedialSlots over real loopback connections: the accepting end of a failover waits for
// the peer's re-dial, takes it and runs the proved resume exchange; a newer re-dial replaces one
// not taken; no re-dial ends at the deadline naming what was awaited; a stop ends the wait.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "common/net.h"
#include "session/redial_slots.h"
#include "session/resume.h"
#include "transport/wire.h"

using namespace rdmig;
using namespace rdmig::session;
using namespace std::chrono_literals;

namespace {

const transport::ChannelTerms kTerms{std::string(64, 'k'), std::string(32, 'a'), 2};

// A connected pair on loopback: first the dialler's end, second the acceptor's.
std::pair<UniqueFd, UniqueFd> connected() {
  auto l = net::tcp_listen("127.0.0.1", 0);
  EXPECT_TRUE(l.ok());
  auto c = net::tcp_connect({"127.0.0.1", net::local_port(l->get()).value()}, 2s);
  auto s = net::accept_for(l->get(), 2s);
  EXPECT_TRUE(c.ok() && s.ok());
  return {std::move(c.value()), std::move(s.value())};
}

}  // namespace

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
