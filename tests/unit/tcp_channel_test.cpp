// TcpChannel over real loopback TCP connections.
#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cstring>
#include <iostream>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "common/chunk_memory.h"
#include "common/net.h"
#include "metrics/metrics.h"
#include "transport/tcp/tcp_channel.h"

using namespace rdmig;
using namespace rdmig::transport;
using namespace std::chrono_literals;

namespace {

struct Pair {
  std::unique_ptr<TcpChannel> a, b;
};

// A connected loopback TCP pair: the connecting end, then the accepted one.
std::pair<UniqueFd, UniqueFd> tcp_pair() {
  auto l = net::tcp_listen("127.0.0.1", 0);
  EXPECT_TRUE(l.ok());
  const uint16_t port = net::local_port(l->get()).value();
  auto c = net::tcp_connect({"127.0.0.1", port}, 2s);
  EXPECT_TRUE(c.ok());
  auto s = net::accept_for(l->get(), 2s);
  EXPECT_TRUE(s.ok());
  return {std::move(c.value()), std::move(s.value())};
}

Pair connect_pair(Metrics& m, uint32_t chunk, uint32_t depth) {
  auto [c, s] = tcp_pair();
  auto& tm = m.transport("tcp");
  return Pair{TcpChannel::create(std::move(c), 0, chunk, depth, tm), TcpChannel::create(std::move(s), 0, chunk, depth, tm)};
}

// Sends `total` bytes from a seeded generator in chunks of random sizes (early flushes).
void send_stream(Channel& ch, uint64_t total, uint32_t seed) {
  std::mt19937_64 gen(seed);
  std::mt19937 sizes(seed + 1);
  uint64_t sent = 0;
  while (sent < total) {
    auto buf = ch.acquire();
    ASSERT_TRUE(buf.ok()) << buf.error().message;
    size_t n = std::min<uint64_t>(1 + sizes() % buf->size(), total - sent);
    for (size_t i = 0; i < n; ++i) (*buf)[i] = static_cast<std::byte>(gen() & 0xff);
    ASSERT_TRUE(ch.send(n).ok());
    sent += n;
  }
  ASSERT_TRUE(ch.send_eof().ok());
  ASSERT_TRUE(ch.drain().ok());
}

// Receives until eof, checking every byte against the same generator.
uint64_t receive_stream(Channel& ch, uint32_t seed, bool* mismatch) {
  std::mt19937_64 gen(seed);
  uint64_t got = 0;
  for (;;) {
    auto c = ch.receive();
    if (!c.ok()) {
      ADD_FAILURE() << c.error().message;
      return got;
    }
    if (c->eof) {
      EXPECT_TRUE(ch.release().ok());
      return got;
    }
    for (auto b : c->data) {
      if (b != static_cast<std::byte>(gen() & 0xff)) *mismatch = true;
    }
    got += c->data.size();
    EXPECT_TRUE(ch.release().ok());
  }
}

}  // namespace

TEST(TcpChannel, CarriesStreamsBothWaysInOrderWithEarlyFlushedChunks) {
  Metrics m;
  auto p = connect_pair(m, 64 * 1024, 4);
  constexpr uint64_t kUp = 32ull << 20, kDown = 8ull << 20;
  bool bad_a = false, bad_b = false;
  uint64_t got_b = 0, got_a = 0;
  std::thread s1([&] { send_stream(*p.a, kUp, 7); });
  std::thread s2([&] { send_stream(*p.b, kDown, 9); });
  std::thread r1([&] { got_b = receive_stream(*p.b, 7, &bad_b); });
  std::thread r2([&] { got_a = receive_stream(*p.a, 9, &bad_a); });
  s1.join(); s2.join(); r1.join(); r2.join();
  EXPECT_EQ(got_b, kUp);
  EXPECT_EQ(got_a, kDown);
  EXPECT_FALSE(bad_a);
  EXPECT_FALSE(bad_b);
}

TEST(TcpChannel, SenderStallsWhenReceiverHoldsEverySlot) {
  Metrics m;
  auto p = connect_pair(m, 64 * 1024, 2);
  auto& tm = m.transport("tcp");
  const double stalls_before = tm.credit_stalls->Value();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(p.a->acquire().ok());
    ASSERT_TRUE(p.a->send(100).ok());
  }
  std::atomic<bool> third_sent{false};
  std::thread sender([&] {
    auto b = p.a->acquire();  // no credit until the receiver releases
    ASSERT_TRUE(b.ok());
    third_sent = true;
    ASSERT_TRUE(p.a->send(1).ok());
  });
  auto first = p.b->receive();
  ASSERT_TRUE(first.ok());
  std::this_thread::sleep_for(50ms);  // give the sender a chance to (wrongly) proceed
  EXPECT_FALSE(third_sent.load());
  ASSERT_TRUE(p.b->release().ok());
  sender.join();
  EXPECT_TRUE(third_sent.load());
  EXPECT_EQ(tm.credit_stalls->Value(), stalls_before + 1);
}

// A receiver that keeps up gets each chunk in the memory of the slot it released last (still in
// the cache), not in the next slot of the ring; chunks it holds keep their slots and their order.
TEST(TcpChannel, ReceivesIntoTheSlotReleasedLast) {
  Metrics m;
  auto p = connect_pair(m, 64 * 1024, 8);
  auto send_byte = [&](std::byte v) {
    auto b = p.a->acquire();
    ASSERT_TRUE(b.ok());
    b.value()[0] = v;
    ASSERT_TRUE(p.a->send(1).ok());
  };
  const std::byte* first = nullptr;
  for (int i = 0; i < 5; ++i) {
    send_byte(static_cast<std::byte>(i));
    auto c = p.b->receive();
    ASSERT_TRUE(c.ok());
    ASSERT_EQ(c->data.size(), 1u);
    EXPECT_EQ(c->data[0], static_cast<std::byte>(i));
    if (i == 0) first = c->data.data();
    EXPECT_EQ(c->data.data(), first) << "chunk " << i << " went into another slot";
    ASSERT_TRUE(p.b->release().ok());
  }
  // Chunks queued together come out in order, none overwriting another (six: the receiver may
  // still hold back a batch of credits, depth / 4).
  for (int i = 10; i < 16; ++i) send_byte(static_cast<std::byte>(i));
  for (int i = 10; i < 16; ++i) {
    auto c = p.b->receive();
    ASSERT_TRUE(c.ok());
    ASSERT_EQ(c->data.size(), 1u);
    EXPECT_EQ(c->data[0], static_cast<std::byte>(i));
    ASSERT_TRUE(p.b->release().ok());
  }
}

TEST(TcpChannel, TheReaderQueuesTwoChunksAndLeavesTheRestInTheSocket) {
  // A receiver that lags (a proxy's TCP socket on the KubeVirt path): of 7 chunks the credits
  // let the peer send, the reader takes two off the socket and leaves the rest to the kernel's
  // buffer, so the memory touched is two places, reused (a ring packed in arrival order walked its
  // whole capacity behind a queue that never emptied). Every chunk still arrives, in order; the
  // first place starts a huge page; a receiver that keeps up has every chunk in the same place.
  Metrics m;
  constexpr uint32_t kChunk = 256 * 1024;
  auto p = connect_pair(m, kChunk, 8);  // 8 places of 256 KiB: a 2 MiB mapping, on a huge page
  p.b->set_reader_hold_back(60s);  // however slow this machine, the receiver here counts as lagging, not stalled
  int sent = 0;
  auto send = [&] {
    auto b = p.a->acquire();
    ASSERT_TRUE(b.ok());
    std::memset(b->data(), sent + 1, 1000);
    ASSERT_TRUE(p.a->send(1000).ok());
    ++sent;
  };
  auto received = [&] { return m.transport("tcp").chunks_received->Value(); };
  std::set<uintptr_t> places;
  int taken = 0;
  auto take = [&] {
    auto c = p.b->receive();
    ASSERT_TRUE(c.ok());
    ASSERT_EQ(c->data.size(), 1000u);
    EXPECT_EQ(c->data[0], static_cast<std::byte>(taken + 1));
    EXPECT_EQ(c->data[999], static_cast<std::byte>(taken + 1));
    places.insert(reinterpret_cast<uintptr_t>(c->data.data()));
    ++taken;
    ASSERT_TRUE(p.b->release().ok());
  };
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 7; ++i) send();
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (received() < 7.0 * round + 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(50ms);
    EXPECT_EQ(received(), 7.0 * round + 2) << "round " << round << ": the reader took more than two ahead";
    for (int i = 0; i < 7; ++i) take();
  }
  EXPECT_EQ(places.size(), 2u);
  EXPECT_EQ(*places.begin() % ChunkMemory::kHugePage, 0u) << "the first place starts a huge page";
  std::set<uintptr_t> kept_up;
  for (int i = 0; i < 10; ++i) {
    send();
    auto c = p.b->receive();
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->data[0], static_cast<std::byte>(taken + 1));
    kept_up.insert(reinterpret_cast<uintptr_t>(c->data.data()));
    ASSERT_TRUE(p.b->release().ok());
    ++taken;
  }
  EXPECT_EQ(kept_up.size(), 1u);
}

TEST(TcpChannel, AReceiverThatTakesNothingIsLeftBehindAfterTheHoldBack) {
  // A receiver that takes nothing (its QEMU stopped reading) does not hold the connection: after
  // the hold-back the reader reads on as far as the credits go, so frames behind the data
  // (credits for the other direction) get through.
  Metrics m;
  auto p = connect_pair(m, 64 * 1024, 7);
  p.b->set_reader_hold_back(100ms);
  for (int i = 0; i < 7; ++i) {
    auto b = p.a->acquire();
    ASSERT_TRUE(b.ok());
    std::memset(b->data(), i + 1, 500);
    ASSERT_TRUE(p.a->send(500).ok());
  }
  // A credit for b's own direction, behind the seven chunks: b may send once more after it.
  for (int i = 0; i < 7; ++i) {
    ASSERT_TRUE(p.b->acquire().ok());
    ASSERT_TRUE(p.b->send(10).ok());
  }
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (m.transport("tcp").chunks_received->Value() < 14 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  // a took b's 7 (a's receiver takes them now and returns their credits)...
  for (int i = 0; i < 7; ++i) {
    auto c = p.a->receive();
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(p.a->release().ok());
  }
  // ...and b's reader, though b's receiver took none of its 7, reads past them to those credits.
  auto more = p.b->acquire();
  ASSERT_TRUE(more.ok()) << more.error().message;
  ASSERT_TRUE(p.b->send(10).ok());
  for (int i = 0; i < 7; ++i) {
    auto c = p.b->receive();
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->data[0], static_cast<std::byte>(i + 1));
    ASSERT_TRUE(p.b->release().ok());
  }
}

TEST(TcpChannel, APeerBeyondItsCreditsFailsTheChannel) {
  // Overruns are counted against the credits given, not read off a full queue (the reader now
  // takes only two chunks ahead): with depth 2 and no credit back, a third DATA frame fails the
  // channel naming it; what arrived within the credits is still delivered first.
  Metrics m;
  constexpr uint32_t kDepth = 2;
  auto [raw, accepted] = tcp_pair();
  auto ch = TcpChannel::create(std::move(accepted), 0, 64 * 1024, kDepth, m.transport("tcp"));
  std::array<std::byte, 100> payload{};
  for (uint32_t i = 0; i < kDepth + 1; ++i) {
    auto h = encode_frame_header(FrameHeader{FrameType::kData, static_cast<uint32_t>(payload.size())});
    iovec iov[2] = {{h.data(), h.size()}, {payload.data(), payload.size()}};
    ASSERT_TRUE(net::writev_all(raw.get(), iov, 2).ok());
  }
  // No release (no credit) until the reader has met the third frame.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (m.transport("tcp").chunks_received->Value() < kDepth && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  std::this_thread::sleep_for(100ms);
  int chunks = 0;
  for (;;) {
    auto r = ch->receive();
    if (!r.ok()) {
      EXPECT_EQ(r.error().code, Errc::kProtocol) << r.error().message;
      EXPECT_NE(r.error().message.find("beyond its credits"), std::string::npos) << r.error().message;
      break;
    }
    ASSERT_LE(++chunks, int{kDepth}) << "a chunk beyond the credits was delivered";
    (void)ch->release();  // the credit goes to a failed channel
  }
  EXPECT_EQ(chunks, int{kDepth});
}

TEST(TcpChannel, ChunksQueuedBehindASlowReceiverArriveIntact) {
  // Random chunk sizes, a receiver that lags at random: chunks queue in their places and are
  // reused; every byte arrives in order and every chunk lies in the receive mapping.
  Metrics m;
  constexpr uint32_t kChunk = 64 * 1024;
  constexpr uint32_t kDepth = 4;
  auto p = connect_pair(m, kChunk, kDepth);
  constexpr uint64_t kTotal = 16ull << 20;
  std::thread sender([&] { send_stream(*p.a, kTotal, 7); });
  std::mt19937_64 gen(7);
  std::mt19937 lag(11);
  uint64_t got = 0;
  bool mismatch = false;
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (;;) {
    auto c = p.b->receive();
    ASSERT_TRUE(c.ok()) << c.error().message;
    if (c->eof) {
      ASSERT_TRUE(p.b->release().ok());
      break;
    }
    const auto at = reinterpret_cast<uintptr_t>(c->data.data());
    lo = std::min(lo, at);
    hi = std::max(hi, at + c->data.size());
    for (auto b : c->data) {
      if (b != static_cast<std::byte>(gen() & 0xff)) mismatch = true;
    }
    got += c->data.size();
    if (lag() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(lag() % 300));
    ASSERT_TRUE(p.b->release().ok());
  }
  sender.join();
  EXPECT_EQ(got, kTotal);
  EXPECT_FALSE(mismatch);
  // Within the receive mapping: a place of a chunk for each of the depth chunks the credits allow.
  EXPECT_LE(hi - lo, kDepth * size_t{kChunk});
}

TEST(TcpChannel, PeerAbortEndsWithItsReason) {
  Metrics m;
  auto p = connect_pair(m, 64 * 1024, 4);
  p.a->abort(Error{Errc::kQemu, "target QEMU died"});
  auto r = p.b->receive();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("target QEMU died"), std::string::npos) << r.error().message;
  EXPECT_FALSE(p.b->acquire().ok() && p.b->send(1).ok() && p.b->drain().ok());
}

TEST(TcpChannel, PeerVanishingMidStreamIsAnErrorNotEof) {
  Metrics m;
  auto p = connect_pair(m, 64 * 1024, 4);
  ASSERT_TRUE(p.a->acquire().ok());
  ASSERT_TRUE(p.a->send(10).ok());
  p.a.reset();  // closes the socket without an eof frame
  auto first = p.b->receive();
  ASSERT_TRUE(first.ok());  // data that arrived is still delivered
  EXPECT_FALSE(first->eof);
  // Returning the slot sends a credit to a peer that is gone: whether that write still succeeds
  // depends on the socket, so its result is not checked; the next receive must fail.
  (void)p.b->release();
  auto r = p.b->receive();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::kUnavailable) << r.error().message;
}

namespace {

// Bytes waiting in `fd`'s receive queue, and in its send queue not yet sent.
size_t queued_in(int fd) {
  int n = 0;
  EXPECT_EQ(::ioctl(fd, SIOCINQ, &n), 0);
  return static_cast<size_t>(n);
}
size_t unsent_in(int fd) {
  int n = 0;
  EXPECT_EQ(::ioctl(fd, SIOCOUTQNSD, &n), 0);
  return static_cast<size_t>(n);
}

// Writes 64 KiB pieces without blocking until the socket takes no more (the reader stopped).
size_t write_until_full(int fd) {
  std::vector<char> piece(64 * 1024, 'x');
  size_t total = 0;
  for (int idle = 0; idle < 20;) {
    const ssize_t k = ::send(fd, piece.data(), piece.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k > 0) {
      total += static_cast<size_t>(k);
      idle = 0;
    } else {
      ++idle;  // the window may still open a little as acknowledgements come back
      std::this_thread::sleep_for(5ms);
    }
  }
  return total;
}

}  // namespace

// A KubeVirt proxy's connection that the agent relays (intercepted on the source, dialled on the
// target) holds at most about a window each way, even after a fast reader let autotuning grow it:
// what waits there when QEMU stops the guest drains inside the downtime.
TEST(LocalHop, BoundedHopHoldsAboutAWindowEachWay) {
  constexpr size_t kWindow = 256 * 1024;
  auto [writer, reader] = tcp_pair();
  net::bound_local_hop(reader.get(), kWindow);  // the intercepted connection: what the agent receives
  net::bound_local_hop(writer.get(), kWindow);  // the dialled one: what the agent sends
  // A fast reader first (autotuning would grow an unbounded socket's buffer now), then none: the
  // writer fills what the pair will hold.
  auto read_fast_then_stop = [](int wfd, int rfd) {
    std::thread w([wfd] {
      std::vector<char> piece(1 << 20, 'x');
      for (int i = 0; i < 64; ++i) ASSERT_TRUE(net::write_all(wfd, std::as_bytes(std::span(piece))).ok());
    });
    std::vector<std::byte> sink(1 << 20);
    size_t got = 0;
    while (got < 64u << 20) {
      const ssize_t k = ::read(rfd, sink.data(), sink.size());
      if (k <= 0) break;
      got += static_cast<size_t>(k);
    }
    w.join();
    EXPECT_EQ(got, 64u << 20);
    return write_until_full(wfd);
  };
  EXPECT_GT(read_fast_then_stop(writer.get(), reader.get()), 0u);
  // SO_RCVBUF is doubled by the kernel, half of it for its own overhead: at most 2 x the window.
  EXPECT_LE(queued_in(reader.get()), 2 * kWindow);
  // TCP_NOTSENT_LOWAT: a write starts only below the window, so at most the window and a write.
  EXPECT_LE(unsent_in(writer.get()), kWindow + 64 * 1024);

  // The same pair unbounded keeps what autotuning grew to (tcp_rmem's maximum: MiBs), which is
  // what the bound is for; only reported, since a kernel's maximum may itself be small.
  auto [w2, r2] = tcp_pair();
  (void)read_fast_then_stop(w2.get(), r2.get());
  std::cout << "bounded: " << queued_in(reader.get()) << " received + " << unsent_in(writer.get())
            << " unsent bytes; unbounded: " << queued_in(r2.get()) << " + " << unsent_in(w2.get()) << "\n";
}

namespace {

// Both ends' TLS handshakes on a connected pair, run at once (each waits for the other).
struct TlsPair {
  Result<std::unique_ptr<TlsStream>> dialler = Error{Errc::kInternal, "not run"};
  Result<std::unique_ptr<TlsStream>> acceptor = Error{Errc::kInternal, "not run"};
};
TlsPair tls_handshakes(int c, int s, const ChannelTerms& dial_terms, const ChannelTerms& accept_terms) {
  TlsPair r;
  std::thread t([&] { r.acceptor = TlsStream::handshake(s, TlsStream::Role::kAcceptor, accept_terms, 5s); });
  r.dialler = TlsStream::handshake(c, TlsStream::Role::kDialler, dial_terms, 5s);
  t.join();
  return r;
}

}  // namespace

TEST(TlsChannel, CarriesStreamsBothWaysThroughTlsAndReportsWhereItEncrypts) {
  Metrics m;
  auto [c, s] = tcp_pair();
  const ChannelTerms terms{"k3y", "0123456789abcdef0123456789abcdef", 2};
  auto hs = tls_handshakes(c.get(), s.get(), terms, terms);
  ASSERT_TRUE(hs.dialler.ok()) << hs.dialler.error().message;
  ASSERT_TRUE(hs.acceptor.ok()) << hs.acceptor.error().message;
  // This host's kernel has no TLS ULP: user space (the Soft-RoCE VM's kernel has tls.ko).
  const std::string mode = hs.dialler.value()->mode();
  std::cerr << "[tls] mode " << mode << "\n";
  EXPECT_TRUE(mode == "user space" || mode == "kernel" || mode == "kernel send") << mode;
  auto& tm = m.transport("tcp");
  auto a = TcpChannel::create(std::move(c), 2, 64 * 1024, 4, tm, SpliceMode::kAuto, std::move(hs.dialler.value()));
  auto b = TcpChannel::create(std::move(s), 2, 64 * 1024, 4, tm, SpliceMode::kAuto, std::move(hs.acceptor.value()));
  EXPECT_STREQ(a->tls_mode(), mode.c_str());
  // Splice moves bytes around user space, so not through user-space TLS: off unless the kernel does both.
  EXPECT_EQ(a->splices(), mode == "kernel");
  constexpr uint64_t kUp = 16ull << 20, kDown = 4ull << 20;
  bool bad_a = false, bad_b = false;
  uint64_t got_b = 0, got_a = 0;
  std::thread s1([&] { send_stream(*a, kUp, 17); });
  std::thread s2([&] { send_stream(*b, kDown, 19); });
  std::thread r1([&] { got_b = receive_stream(*b, 17, &bad_b); });
  std::thread r2([&] { got_a = receive_stream(*a, 19, &bad_a); });
  s1.join(); s2.join(); r1.join(); r2.join();
  EXPECT_EQ(got_b, kUp);
  EXPECT_EQ(got_a, kDown);
  EXPECT_FALSE(bad_a);
  EXPECT_FALSE(bad_b);
}

TEST(TlsChannel, APeerWithAnotherKeyOrAnotherChannelFailsTheHandshake) {
  const ChannelTerms mine{"k3y", "0123456789abcdef0123456789abcdef", 0};
  for (const ChannelTerms& theirs : {ChannelTerms{"other", mine.session, 0}, ChannelTerms{mine.key, mine.session, 1},
                                     ChannelTerms{mine.key, "fedcba9876543210fedcba9876543210", 0}}) {
    auto [c, s] = tcp_pair();
    auto hs = tls_handshakes(c.get(), s.get(), theirs, mine);
    ASSERT_FALSE(hs.acceptor.ok());
    EXPECT_EQ(hs.acceptor.error().code, Errc::kPermissionDenied) << hs.acceptor.error().message;
    EXPECT_NE(hs.acceptor.error().message.find("channel 0 (TLS): handshake failed"), std::string::npos)
        << hs.acceptor.error().message;
    EXPECT_FALSE(hs.dialler.ok());
  }
}

TEST(TlsChannel, APeerThatSpeaksNoTlsTimesOutNamingTheChannel) {
  auto [c, s] = tcp_pair();
  const ChannelTerms terms{"k3y", "0123456789abcdef0123456789abcdef", 3};
  auto r = TlsStream::handshake(s.get(), TlsStream::Role::kAcceptor, terms, 300ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::kTimeout);
  EXPECT_NE(r.error().message.find("channel 3 (TLS)"), std::string::npos) << r.error().message;
}

TEST(TlsChannel, PeerAbortThroughTlsEndsWithItsReason) {
  Metrics m;
  auto [c, s] = tcp_pair();
  const ChannelTerms terms{"k3y", "0123456789abcdef0123456789abcdef", 0};
  auto hs = tls_handshakes(c.get(), s.get(), terms, terms);
  ASSERT_TRUE(hs.dialler.ok() && hs.acceptor.ok());
  auto& tm = m.transport("tcp");
  auto a = TcpChannel::create(std::move(c), 0, 64 * 1024, 4, tm, SpliceMode::kOff, std::move(hs.dialler.value()));
  auto b = TcpChannel::create(std::move(s), 0, 64 * 1024, 4, tm, SpliceMode::kOff, std::move(hs.acceptor.value()));
  a->abort(Error{Errc::kQemu, "target QEMU died"});
  auto r = b->receive();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("target QEMU died"), std::string::npos) << r.error().message;
}
