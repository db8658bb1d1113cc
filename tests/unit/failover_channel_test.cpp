// FailoverChannel over real loopback TCP connections (TcpChannel underneath), the links cut with
// shutdown(2) on the live socket while streams run both ways: every byte arrives once and in
// order; a peer whose resume names a count it cannot have, a peer without the key, and a link
// that never comes back all fail the channel naming why.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <mutex>
#include <random>
#include <thread>

#include "common/net.h"
#include "metrics/metrics.h"
#include "session/failover_channel.h"
#include "session/resume.h"
#include "transport/tcp/tcp_channel.h"

using namespace rdmig;
using namespace rdmig::session;
using namespace std::chrono_literals;

namespace {

constexpr uint32_t kChunk = 64 * 1024;
constexpr uint32_t kDepth = 8;

// Two ends of one channel: A dials (as a source agent re-dials), B accepts on a listener.
// `over_channel`: the resume exchange runs over the new channel's own chunks (as a rail failover's
// does over its new RDMA channel) instead of over the connection before the channel is made.
class Ends {
 public:
  explicit Ends(std::chrono::milliseconds deadline = 5s, bool over_channel = false)
      : over_channel_(over_channel), tm_(metrics_.transport("tcp")) {
    auto l = net::tcp_listen("127.0.0.1", 0);
    EXPECT_TRUE(l.ok());
    listener_ = std::move(l.value());
    port_ = net::local_port(listener_.get()).value();
    auto c = net::tcp_connect({"127.0.0.1", port_}, 2s);
    auto s = net::accept_for(listener_.get(), 2s);
    EXPECT_TRUE(c.ok() && s.ok());
    remember(c->get());
    a = std::make_unique<FailoverChannel>(make(std::move(c.value())), kDepth, deadline,
                                          [this](uint64_t taken, const Error&, auto until, const auto& stopped) {
                                            return redial(taken, until, stopped);
                                          });
    b = std::make_unique<FailoverChannel>(make(std::move(s.value())), kDepth, deadline,
                                          [this](uint64_t taken, const Error&, auto until, const auto& stopped) {
                                            return reaccept(taken, until, stopped);
                                          });
  }

  ~Ends() {  // the channels (their watchers, their reconnects) before what they use; A's redial reads b
    a.reset();
    b.reset();
  }

  // Cuts the live connection (both ends see it fail) and returns how many links were made so far.
  int cut() {
    std::lock_guard lock(mu_);
    ::shutdown(live_, SHUT_RDWR);
    return links_;
  }
  int links() {
    std::lock_guard lock(mu_);
    return links_;
  }

  std::atomic<bool> refuse_redial{false};        // A's tries fail (no path)
  std::atomic<int64_t> b_lies_by{0};            // B tells A a count off by this much
  std::string b_key = std::string(64, 'k');       // B's idea of the key
  std::unique_ptr<FailoverChannel> a, b;

 private:
  std::unique_ptr<transport::Channel> make(UniqueFd fd) {
    return transport::TcpChannel::create(std::move(fd), 0, kChunk, kDepth, tm_);
  }
  void remember(int fd) {
    std::lock_guard lock(mu_);
    live_ = fd;  // the socket stays open while its channel lives (retired channels too, for a while)
    ++links_;
  }
  Result<Resumed> redial(uint64_t taken, std::chrono::steady_clock::time_point, const std::function<bool()>&) {
    if (refuse_redial) return Error{Errc::kUnavailable, "connect: Connection refused (the test's path is down)"};
    auto fd = net::tcp_connect({"127.0.0.1", port_}, 2s);
    if (!fd) return fd.error();
    // As a target agent does (TargetJob::on_data): a channel that ended there is not resumed.
    if (b && b->failed()) return Error{Errc::kPermissionDenied, "channel 0 refused: it has ended at the peer"};
    const transport::ChannelTerms terms{std::string(64, 'k'), session_, 0};
    if (over_channel_) {
      const int raw = fd->get();
      auto ch = make(std::move(fd.value()));
      auto peer = resume_as_dialler(*ch, terms, taken, 2s);
      if (!peer) return peer.error();
      remember(raw);
      return Resumed{std::move(ch), peer.value(), "channel 127.0.0.1:" + std::to_string(port_)};
    }
    auto peer = resume_as_dialler(fd->get(), terms, taken, 2s);
    if (!peer) return peer.error();
    remember(fd->get());
    return Resumed{make(std::move(fd.value())), peer.value(), "tcp 127.0.0.1:" + std::to_string(port_)};
  }
  Result<Resumed> reaccept(uint64_t taken, std::chrono::steady_clock::time_point deadline,
                           const std::function<bool()>& stopped) {
    for (;;) {
      if (stopped()) return Error{Errc::kCancelled, "stopped"};
      if (std::chrono::steady_clock::now() >= deadline) return Error{Errc::kTimeout, "no redial"};
      auto fd = net::accept_for(listener_.get(), 100ms);
      if (!fd) continue;
      const int64_t lie = b_lies_by.load();
      const transport::ChannelTerms terms{b_key, session_, 0};
      const auto count = static_cast<uint64_t>(static_cast<int64_t>(taken) + lie);
      if (over_channel_) {
        auto ch = make(std::move(fd.value()));
        auto peer = resume_as_acceptor(*ch, terms, count, 2s);
        if (!peer) return peer.error();
        return Resumed{std::move(ch), peer.value(), "channel (accepted)"};
      }
      auto peer = resume_as_acceptor(fd->get(), terms, count, 2s);
      if (!peer) return peer.error();
      return Resumed{make(std::move(fd.value())), peer.value(), "tcp (accepted)"};
    }
  }

  const bool over_channel_;
  Metrics metrics_;
  TransportMetrics& tm_;
  UniqueFd listener_;
  uint16_t port_ = 0;
  const std::string session_ = std::string(32, 'a');
  std::mutex mu_;
  int live_ = -1;
  int links_ = 0;
};

// Sends `total` bytes from a seeded generator in chunks of random sizes; false on an error.
Status send_counted_stream(transport::Channel& ch, uint64_t total, uint32_t seed) {
  std::mt19937_64 gen(seed);
  std::mt19937 sizes(seed + 1);
  uint64_t sent = 0;
  while (sent < total) {
    auto buf = ch.acquire();
    if (!buf) return buf.error();
    const size_t n = std::min<uint64_t>(1 + sizes() % buf->size(), total - sent);
    for (size_t i = 0; i < n; ++i) (*buf)[i] = static_cast<std::byte>(gen() & 0xff);
    RDMIG_TRY(ch.send(n));
    sent += n;
  }
  RDMIG_TRY(ch.send_eof());
  return ch.drain();
}

// Receives until eof checking every byte against the generator: the bytes received, or the error.
Result<uint64_t> receive_stream(transport::Channel& ch, uint32_t seed, uint64_t* first_mismatch) {
  std::mt19937_64 gen(seed);
  uint64_t got = 0;
  for (;;) {
    auto c = ch.receive();
    if (!c) return c.error();
    if (c->eof) {
      RDMIG_TRY(ch.release());
      return got;
    }
    for (auto byte : c->data) {
      if (byte != static_cast<std::byte>(gen() & 0xff) && *first_mismatch == UINT64_MAX) *first_mismatch = got;
      ++got;
    }
    RDMIG_TRY(ch.release());
  }
}

struct Direction {
  std::thread sender, receiver;
  Status sent;
  Result<uint64_t> received = uint64_t{0};
  uint64_t mismatch = UINT64_MAX;
  void start(transport::Channel& from, transport::Channel& to, uint64_t total, uint32_t seed) {
    sender = std::thread([&, total, seed] { sent = send_counted_stream(from, total, seed); });
    receiver = std::thread([&, seed] { received = receive_stream(to, seed, &mismatch); });
  }
  void join() {
    sender.join();
    receiver.join();
  }
};

}  // namespace

void streams_both_ways_survive_repeated_cuts(bool over_channel) {
  Ends e(5s, over_channel);
  constexpr uint64_t kTotal = 96ull << 20;
  Direction ab, ba;
  std::atomic<int> done{0};
  ab.start(*e.a, *e.b, kTotal, 11);
  ba.start(*e.b, *e.a, kTotal, 29);
  // Cut the link again and again while the streams run, each time once the last cut's link is back
  // and has carried for a moment.
  std::thread cutter([&] {
    int cuts = 0;
    while (done.load() == 0 && cuts < 40) {
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (e.links() != cuts + 1 && std::chrono::steady_clock::now() < until && done.load() == 0) {
        std::this_thread::sleep_for(1ms);
      }
      std::this_thread::sleep_for(10ms);
      if (done.load() != 0) break;
      e.cut();
      ++cuts;
    }
  });
  ab.join();
  ba.join();
  done = 1;
  cutter.join();
  ASSERT_TRUE(ab.sent.ok()) << ab.sent.error().message;
  ASSERT_TRUE(ba.sent.ok()) << ba.sent.error().message;
  ASSERT_TRUE(ab.received.ok()) << ab.received.error().message;
  ASSERT_TRUE(ba.received.ok()) << ba.received.error().message;
  EXPECT_EQ(ab.received.value(), kTotal);
  EXPECT_EQ(ba.received.value(), kTotal);
  EXPECT_EQ(ab.mismatch, UINT64_MAX) << "first wrong byte at offset " << ab.mismatch;
  EXPECT_EQ(ba.mismatch, UINT64_MAX) << "first wrong byte at offset " << ba.mismatch;
  // The cuts were failed over by both ends.
  EXPECT_GE(e.a->failovers(), 3u);
  EXPECT_GE(e.b->failovers(), 3u);
  EXPECT_EQ(e.a->sent(), e.b->taken());
  EXPECT_EQ(e.b->sent(), e.a->taken());
  ASSERT_TRUE(e.a->last_failover().has_value());
}

TEST(FailoverChannel, StreamsBothWaysSurviveRepeatedCutsByteExact) { streams_both_ways_survive_repeated_cuts(false); }

// A rail failover's resume runs over the new channel's chunks (session/resume.h): the same stream
// survives, and the exchange's chunks never reach the pumps.
TEST(FailoverChannel, StreamsSurviveRepeatedCutsWhenEachResumeRunsOverTheNewChannel) {
  streams_both_ways_survive_repeated_cuts(true);
}

TEST(FailoverChannel, ALinkThatNeverComesBackFailsAtTheDeadlineNamingEveryTry) {
  Ends e(400ms);
  e.refuse_redial = true;
  Direction ab;
  ab.start(*e.a, *e.b, 1ull << 40, 5);  // endless: only the failure ends it
  while (e.a->sent() < 20) std::this_thread::sleep_for(1ms);
  const auto cut_at = std::chrono::steady_clock::now();
  e.cut();
  ab.sender.join();
  const auto took = std::chrono::steady_clock::now() - cut_at;
  e.b->abort(Error{Errc::kCancelled, "test over"});
  ab.receiver.join();
  ASSERT_FALSE(ab.sent.ok());
  EXPECT_EQ(ab.sent.error().code, Errc::kUnavailable);
  EXPECT_NE(ab.sent.error().message.find("no path came back within 400 ms"), std::string::npos) << ab.sent.error().message;
  EXPECT_NE(ab.sent.error().message.find("the test's path is down"), std::string::npos) << ab.sent.error().message;
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(e.a->failovers(), 0u);
}

TEST(FailoverChannel, APeerResumingWithACountItCannotHaveIsRefused) {
  for (const auto& [lie, over_channel] : std::vector<std::pair<int64_t, bool>>{{1000, false}, {-100, false},
                                                                               {1000, true}, {-100, true}}) {
    SCOPED_TRACE(over_channel ? "resumed over the new channel" : "resumed over the connection");
    Ends e(5s, over_channel);
    e.b_lies_by = lie;  // beyond what A sent, or older than what A keeps
    Direction ab;
    ab.start(*e.a, *e.b, 1ull << 40, 7);
    while (e.a->sent() < 200) std::this_thread::sleep_for(1ms);
    e.cut();
    ab.sender.join();
    e.b->abort(Error{Errc::kCancelled, "test over"});
    ab.receiver.join();
    ASSERT_FALSE(ab.sent.ok());
    EXPECT_EQ(ab.sent.error().code, Errc::kProtocol) << ab.sent.error().message;
    EXPECT_NE(ab.sent.error().message.find("the peer's resume says it took"), std::string::npos) << ab.sent.error().message;
    EXPECT_NE(ab.sent.error().message.find("never resumed"), std::string::npos);
  }
}

TEST(FailoverChannel, APeerWithoutTheSessionKeyCannotResumeTheChannel) {
  for (const bool over_channel : {false, true}) {
    SCOPED_TRACE(over_channel ? "resumed over the new channel" : "resumed over the connection");
    Ends e(1s, over_channel);
    e.b_key = std::string(64, 'x');  // B (or whoever answers A's redial) does not hold the key
    Direction ab;
    ab.start(*e.a, *e.b, 1ull << 40, 9);
    while (e.a->sent() < 20) std::this_thread::sleep_for(1ms);
    e.cut();
    ab.sender.join();
    e.b->abort(Error{Errc::kCancelled, "test over"});
    ab.receiver.join();
    ASSERT_FALSE(ab.sent.ok());
    EXPECT_EQ(ab.sent.error().code, Errc::kPermissionDenied) << ab.sent.error().message;
    EXPECT_NE(ab.sent.error().message.find("the peer refused to resume it"), std::string::npos) << ab.sent.error().message;
  }
}

// A resume over a channel whose peer never answers ends at its timeout (the channel is aborted:
// its calls have no timeout of their own), never hangs the failover.
TEST(FailoverChannel, AResumeOverAChannelWhosePeerNeverAnswersEndsAtItsTimeout) {
  Metrics metrics;
  auto& tm = metrics.transport("tcp");
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  auto mine = transport::TcpChannel::create(UniqueFd(sv[0]), 0, kChunk, kDepth, tm);
  auto silent = transport::TcpChannel::create(UniqueFd(sv[1]), 0, kChunk, kDepth, tm);  // never reads
  const auto t0 = std::chrono::steady_clock::now();
  auto r = resume_as_dialler(*mine, transport::ChannelTerms{std::string(64, 'k'), std::string(32, 'a'), 0}, 5, 300ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r.ok());
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 3s);
}

TEST(FailoverChannel, ADeliberateAbortIsNotFailedOver) {
  Ends e;
  Direction ab;
  ab.start(*e.a, *e.b, 1ull << 40, 3);
  while (e.a->sent() < 20) std::this_thread::sleep_for(1ms);
  const auto t0 = std::chrono::steady_clock::now();
  e.b->abort(Error{Errc::kUnavailable, "target QEMU failed"});  // the peer ends the channel on purpose
  ab.sender.join();
  ab.receiver.join();
  ASSERT_FALSE(ab.sent.ok());
  // Its abort frame names why; when its writer was busy and no frame went, the re-dial is refused:
  // either way at once, never after the deadline, and never resumed.
  const std::string& why = ab.sent.error().message;
  EXPECT_TRUE(why.find("peer aborted: target QEMU failed") != std::string::npos ||
              why.find("the peer refused to resume it") != std::string::npos)
      << why;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_EQ(e.a->failovers(), 0u);
}

TEST(FailoverChannel, ALinkLostWhileIdleIsFailedOverNamingTheLinksOwnError) {
  // Neither end is in a call: the watcher finds the failed link, fails it over, and its reason
  // carries what the link itself reported, not only that it failed.
  Ends e;
  ASSERT_EQ(e.cut(), 1);
  const auto until = std::chrono::steady_clock::now() + 5s;
  while ((e.a->failovers() == 0 || e.b->failovers() == 0) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GE(e.a->failovers(), 1u);
  const auto last = e.a->last_failover();
  ASSERT_TRUE(last.has_value());
  EXPECT_NE((*last).find("the link failed while the channel was idle: "), std::string::npos) << (*last);
  // The cause after the colon is the TCP channel's own error, non-empty.
  const auto cause = (*last).substr((*last).find("idle: ") + 6);
  EXPECT_FALSE(cause.empty()) << (*last);
  // And the channel still carries both ways.
  Direction ab;
  ab.start(*e.a, *e.b, 1 << 20, 5);
  ab.join();
  ASSERT_TRUE(ab.sent.ok()) << ab.sent.error().message;
  ASSERT_TRUE(ab.received.ok()) << ab.received.error().message;
  EXPECT_EQ(ab.received.value(), 1u << 20);
  EXPECT_EQ(ab.mismatch, UINT64_MAX);
}
