// The relay core over TCP channels with and without splice(2): two ChannelPumps joined by a
// loopback TCP connection, each with a unix socket pair standing in for its QEMU. Streams go
// both ways at once and are compared byte for byte, so a framing slip on the splice path
// (a header written inside a payload, a payload cut short, chunks out of order) fails.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "common/crc32c.h"
#include "common/net.h"
#include "metrics/metrics.h"
#include "session/pump.h"
#include "socket_pair.h"
#include "transport/tcp/tcp_channel.h"

using namespace rdmig;
using namespace rdmig::transport;
using namespace std::chrono_literals;

namespace {

struct SocketPair {
  UniqueFd qemu;   // what QEMU would hold
  UniqueFd agent;  // what the agent's pump holds
};

SocketPair qemu_agent_pair() {
  auto [qemu, agent] = rdmig_test::socket_pair();
  return {std::move(qemu), std::move(agent)};
}

struct Link {
  Metrics metrics;
  std::unique_ptr<TcpChannel> source, target;
};

std::unique_ptr<Link> connect_link(uint32_t chunk, uint32_t depth, SpliceMode source_mode, SpliceMode target_mode) {
  auto link = std::make_unique<Link>();
  auto l = net::tcp_listen("127.0.0.1", 0);
  EXPECT_TRUE(l.ok());
  const uint16_t port = net::local_port(l->get()).value();
  auto c = net::tcp_connect({"127.0.0.1", port}, 2s);
  EXPECT_TRUE(c.ok());
  auto s = net::accept_for(l->get(), 2s);
  EXPECT_TRUE(s.ok());
  auto& tm = link->metrics.transport("tcp");
  link->source = TcpChannel::create(std::move(c.value()), 0, chunk, depth, tm, source_mode);
  link->target = TcpChannel::create(std::move(s.value()), 0, chunk, depth, tm, target_mode);
  return link;
}

// Writes `total` seeded bytes in writes of random sizes (1 byte .. 3 MiB), then closes the
// write side: QEMU's stream, with its bursts and quiet moments.
void write_stream(int fd, uint64_t total, uint32_t seed) {
  std::mt19937_64 gen(seed);
  std::mt19937 sizes(seed + 1);
  std::vector<std::byte> buf(3 << 20);
  uint64_t done = 0;
  while (done < total) {
    const size_t n = std::min<uint64_t>(1 + sizes() % buf.size(), total - done);
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<std::byte>(gen() & 0xff);
    if (!net::write_all(fd, std::span(buf.data(), n)).ok()) return;
    done += n;
  }
  ::shutdown(fd, SHUT_WR);
}

struct Received {
  uint64_t bytes = 0;
  uint64_t first_mismatch = UINT64_MAX;
  // The next `n` bytes read, checked against write_stream's bytes (`gen`, seeded alike).
  void take(std::mt19937_64& gen, const std::byte* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (data[i] != static_cast<std::byte>(gen() & 0xff) && first_mismatch == UINT64_MAX) first_mismatch = bytes + i;
    }
    bytes += n;
  }
};

// With `slow`, a QEMU that reads in small pieces and now and then pauses, so its socket fills
// and chunks meet it whole, in part and not at all (the cases set the target's inline wait to 0,
// so that what a full socket leaves goes through the pump's thread at once).
Received read_stream(int fd, uint32_t seed, bool slow = false) {
  std::mt19937_64 gen(seed);
  std::mt19937 pace(seed + 2);
  std::vector<std::byte> buf(1 << 20);
  Received r;
  for (;;) {
    size_t want = buf.size();
    if (slow) {
      want = 1 + pace() % (96 << 10);
      if (pace() % 16 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1 + pace() % 4));
    }
    const ssize_t n = ::recv(fd, buf.data(), want, 0);
    if (n <= 0) return r;
    r.take(gen, buf.data(), static_cast<size_t>(n));
  }
}

struct Case {
  const char* name;
  uint32_t chunk;
  uint32_t depth;
  SpliceMode source, target;
  bool verify = false;  // both pumps verify_chunks(): every chunk ends in its CRC32C
  bool slow_target = false;  // the target's QEMU reads slowly (read_stream's `slow`)
};

class PumpOverTcp : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { std::signal(SIGPIPE, SIG_IGN); }  // as the agent does
};

TEST_P(PumpOverTcp, CarriesBothDirectionsByteExact) {
  const Case& c = GetParam();
  auto link = connect_link(c.chunk, c.depth, c.source, c.target);
  // A slow QEMU's full socket hands a chunk's rest to the pump's thread at once (no wait for room):
  // the leftover paths (pipe, slot, both) on many chunks. The wait has its own cases below.
  if (c.slow_target) link->target->set_inline_wait(0ms);
  auto src = qemu_agent_pair();
  auto dst = qemu_agent_pair();
  session::ChannelPump source_pump(*link->source, std::move(src.agent));
  UniqueFd dst_agent = std::move(dst.agent);
  session::ChannelPump target_pump(*link->target, [&]() -> Result<UniqueFd> { return std::move(dst_agent); });
  if (c.verify) {
    source_pump.verify_chunks();
    target_pump.verify_chunks();
  }
  source_pump.start();
  target_pump.start();

  constexpr uint64_t kUp = 48ull << 20, kDown = 4ull << 20;  // migration stream, return path
  Received at_target, at_source;
  std::thread w1([&] { write_stream(src.qemu.get(), kUp, 11); });
  std::thread r1([&] { at_target = read_stream(dst.qemu.get(), 11, c.slow_target); });
  // The return path starts once the target side is open (it is opened by the first chunk).
  std::thread w2([&] { write_stream(dst.qemu.get(), kDown, 23); });
  std::thread r2([&] { at_source = read_stream(src.qemu.get(), 23); });
  w1.join(); r1.join(); w2.join(); r2.join();
  ASSERT_TRUE(source_pump.wait(20s));
  ASSERT_TRUE(target_pump.wait(20s));

  EXPECT_FALSE(source_pump.error()) << source_pump.error()->message;
  EXPECT_FALSE(target_pump.error()) << target_pump.error()->message;
  EXPECT_EQ(at_target.bytes, kUp);
  EXPECT_EQ(at_target.first_mismatch, UINT64_MAX) << "first wrong byte at " << at_target.first_mismatch;
  EXPECT_EQ(at_source.bytes, kDown);
  EXPECT_EQ(at_source.first_mismatch, UINT64_MAX) << "first wrong byte at " << at_source.first_mismatch;
  EXPECT_EQ(source_pump.bytes_up(), kUp);
  EXPECT_EQ(target_pump.bytes_down(), kUp);
  EXPECT_EQ(target_pump.bytes_up(), kDown);
  EXPECT_EQ(source_pump.bytes_down(), kDown);
  // Chunks carry at most a chunk: 48 MiB cannot fit in fewer.
  EXPECT_GE(source_pump.chunks_up(), kUp / c.chunk);
  EXPECT_EQ(target_pump.chunks_down(), source_pump.chunks_up());
  if (c.verify) {
    // Every chunk of both directions was checked; none could be spliced past the check.
    EXPECT_EQ(target_pump.chunks_verified(), source_pump.chunks_up());
    EXPECT_EQ(source_pump.chunks_verified(), target_pump.chunks_up());
    EXPECT_EQ(link->source->spliced_sent(), 0u);
    EXPECT_EQ(link->target->spliced_received(), 0u);
    return;
  }
  EXPECT_EQ(target_pump.chunks_verified(), 0u);
  if (c.target == SpliceMode::kOff) {
    // Copying receivers write chunks to QEMU from their reader when nothing waits before them:
    // most chunks here; a slow QEMU sends chunks (or their rest) through the pump's thread too.
    const uint64_t inline_chunks = link->target->inline_chunks();
    EXPECT_GT(inline_chunks, 0u);
    if (c.slow_target) {
      EXPECT_LT(inline_chunks, target_pump.chunks_down()) << "a slow QEMU never made a chunk wait";
    }
  }
  // "on" never falls back to copying: the splice path is what carried the bytes.
  if (c.source == SpliceMode::kOn) {
    EXPECT_TRUE(link->source->splices());
    EXPECT_EQ(link->source->spliced_sent(), kUp);
  }
  if (c.target == SpliceMode::kOn) {
    EXPECT_TRUE(link->target->splices());
    // A receiver slow to come for a payload (over 200 ms) gets it copied; here it keeps up.
    EXPECT_GT(link->target->spliced_received(), kUp / 2);
    // The reader splices chunks through to QEMU itself when nothing waits before them (no
    // hand-off); a slow QEMU leaves chunks, or what its socket did not take of them, to the
    // pump's thread, in order.
    const uint64_t spliced_inline = link->target->inline_spliced();
    EXPECT_GT(spliced_inline, 0u);
    EXPECT_LE(spliced_inline, link->target->inline_chunks());
    if (c.slow_target) {
      EXPECT_LT(spliced_inline, target_pump.chunks_down()) << "a slow QEMU never made a chunk wait";
    }
  }
  if (c.source == SpliceMode::kOff) {
    EXPECT_FALSE(link->source->splices());
    EXPECT_EQ(link->source->spliced_sent(), 0u);
  }
  if (c.target == SpliceMode::kOff) {
    EXPECT_EQ(link->target->spliced_received(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    SpliceModes, PumpOverTcp,
    ::testing::Values(Case{"SpliceBothSides", 1 << 20, 16, SpliceMode::kOn, SpliceMode::kOn},
                      Case{"CopyBothSides", 1 << 20, 16, SpliceMode::kOff, SpliceMode::kOff},
                      // A slow target QEMU: chunks written inline whole, in part (the rest by the
                      // pump's thread) and not at all, in order; with a short ring, credits from
                      // both threads.
                      Case{"CopySlowTargetQemu", 1 << 20, 16, SpliceMode::kOff, SpliceMode::kOff, false, true},
                      Case{"CopySlowTargetQemuSmallChunksShallowRing", 64 << 10, 2, SpliceMode::kOff,
                           SpliceMode::kOff, false, true},
                      Case{"AutoBothSides", 1 << 20, 16, SpliceMode::kAuto, SpliceMode::kAuto},
                      // One side splices, the other copies: the wire is the same.
                      Case{"SpliceSenderCopyReceiver", 1 << 20, 16, SpliceMode::kOn, SpliceMode::kOff},
                      Case{"CopySenderSpliceReceiver", 1 << 20, 16, SpliceMode::kOff, SpliceMode::kOn},
                      // Small chunks and a short ring: many credits, many headers.
                      Case{"SpliceSmallChunksShallowRing", 64 << 10, 2, SpliceMode::kOn, SpliceMode::kOn},
                      // A slow target QEMU under splice: chunks spliced through by the reader
                      // whole, in part (the rest left in the pipe and the slot for the pump's
                      // thread) and not at all, in order.
                      Case{"SpliceSlowTargetQemu", 1 << 20, 16, SpliceMode::kOn, SpliceMode::kOn, false, true},
                      Case{"SpliceSlowTargetQemuSmallChunksShallowRing", 64 << 10, 2, SpliceMode::kOn,
                           SpliceMode::kOn, false, true},
                      // Chunks larger than the pipe (1 MiB): a payload takes several splices.
                      Case{"SpliceChunksLargerThanThePipe", 4 << 20, 4, SpliceMode::kOn, SpliceMode::kOn},
                      // verifyChunks: a CRC32C per chunk, both ways; on splice channels too
                      // (the pumps copy then), and with small chunks and a short ring.
                      Case{"VerifyChunks", 1 << 20, 16, SpliceMode::kOff, SpliceMode::kOff, true},
                      Case{"VerifyChunksOnSpliceChannels", 1 << 20, 16, SpliceMode::kOn, SpliceMode::kOn, true},
                      Case{"VerifyChunksSmallChunksShallowRing", 64 << 10, 2, SpliceMode::kOff, SpliceMode::kOff, true}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// A source QEMU's stream through two splicing pumps (1 MiB chunks, 16 deep) to a target QEMU
// that reads 32 KiB at a time, as QEMU's QEMUFile does; before_read(bytes read so far) runs
// before each read, to pace the target or stop it. Checks that every byte arrived, in order, and
// that both pumps ended without an error.
struct SplicedStream {
  std::unique_ptr<Link> link = connect_link(1 << 20, 16, SpliceMode::kOn, SpliceMode::kOn);
  SocketPair src = qemu_agent_pair();
  SocketPair dst = qemu_agent_pair();
  UniqueFd dst_agent = std::move(dst.agent);
  session::ChannelPump source_pump{*link->source, std::move(src.agent)};
  session::ChannelPump target_pump{*link->target, [this]() -> Result<UniqueFd> { return std::move(dst_agent); }};

  void carry(uint64_t total, uint32_t seed, const std::function<void(uint64_t)>& before_read) {
    std::signal(SIGPIPE, SIG_IGN);
    source_pump.start();
    target_pump.start();
    std::thread w([&] { write_stream(src.qemu.get(), total, seed); });
    Received at_target;
    std::mt19937_64 gen(seed);
    std::vector<std::byte> buf(32 << 10);
    for (;;) {
      before_read(at_target.bytes);
      const ssize_t n = ::recv(dst.qemu.get(), buf.data(), buf.size(), 0);
      if (n <= 0) break;
      at_target.take(gen, buf.data(), static_cast<size_t>(n));
    }
    w.join();
    ::shutdown(dst.qemu.get(), SHUT_WR);  // the return path ends too
    EXPECT_TRUE(source_pump.wait(20s));
    EXPECT_TRUE(target_pump.wait(20s));
    EXPECT_FALSE(source_pump.error()) << source_pump.error()->message;
    EXPECT_FALSE(target_pump.error()) << target_pump.error()->message;
    EXPECT_EQ(at_target.bytes, total);
    EXPECT_EQ(at_target.first_mismatch, UINT64_MAX) << "first wrong byte at " << at_target.first_mismatch;
    EXPECT_EQ(target_pump.bytes_down(), total);
    EXPECT_EQ(target_pump.chunks_down(), source_pump.chunks_up());
  }
};

// A target QEMU slower than the link, at a steady pace: its socket is full whenever a chunk
// arrives, and the target's reader waits for room and splices the chunk through itself rather
// than handing it to the pump's thread (two thread switches a chunk, and the next payloads copied
// through memory while the pump is busy; bench/results/relay-floor-slow-target: 0.78-1.04 of the
// agents' CPU before, paired per row).
TEST(PumpOverTcpSplice, SteadySlowTargetQemuIsSplicedInline) {
  SplicedStream s;
  constexpr uint64_t kTotal = 48ull << 20;
  constexpr double kRate = 192.0 * (1 << 20);  // bytes a second
  const auto t0 = std::chrono::steady_clock::now();
  s.carry(kTotal, 31, [&](uint64_t read) {
    std::this_thread::sleep_until(t0 + std::chrono::nanoseconds(static_cast<int64_t>(static_cast<double>(read) * 1e9 / kRate)));
  });
  // Chunks met a full socket (QEMU reads 32 KiB, a chunk is about 200 KiB), yet the reader spliced
  // nearly all of them through (100% of 209 when quiet): a stall of the machine over 50 ms may
  // hand one off, and the chunks queued behind it. With the hand-off at the first full socket, as
  // before (set_inline_wait(0ms)), 53-67% here.
  EXPECT_GT(s.link->target->spliced_received(), kTotal / 2);
  EXPECT_GE(s.link->target->inline_spliced() * 10, s.target_pump.chunks_down() * 8)
      << s.link->target->inline_spliced() << " of " << s.target_pump.chunks_down() << " chunks spliced through inline";
}

// Writes `n` chunks of `chunk` seeded bytes to `sock` as a peer TcpChannel frames them, each payload
// in pieces of 1 KiB taken from every other KiB of a buffer (vmsplice, then splice): no two pieces
// share a page edge, so none merges with the next on the way and each takes a slot of the
// receiver's pipe. `scratch` holds the pages until the receiver has read them.
bool send_chunks_in_pieces(int sock, uint32_t chunk, int n, uint32_t seed, std::vector<std::byte>& scratch) {
  constexpr size_t kPiece = 1024;
  std::mt19937_64 gen(seed);
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return false;
  UniqueFd r(p[0]), w(p[1]);
  (void)::fcntl(w.get(), F_SETPIPE_SZ, 1 << 20);
  const size_t slots = static_cast<size_t>(::fcntl(w.get(), F_GETPIPE_SZ)) / 4096;
  scratch.assign(2 * static_cast<size_t>(chunk) * static_cast<size_t>(n), std::byte{0});
  for (int c = 0; c < n; ++c) {
    std::byte* base = scratch.data() + 2 * static_cast<size_t>(chunk) * static_cast<size_t>(c);
    for (size_t i = 0; i < chunk; ++i) base[2 * kPiece * (i / kPiece) + i % kPiece] = static_cast<std::byte>(gen() & 0xff);
    const auto header = encode_frame_header(FrameHeader{FrameType::kData, chunk});
    if (::send(sock, header.data(), header.size(), MSG_MORE | MSG_NOSIGNAL) != static_cast<ssize_t>(header.size())) return false;
    for (size_t off = 0; off < chunk;) {
      std::vector<iovec> iov;
      size_t batch = 0;
      while (off + batch < chunk && iov.size() < slots) {
        iov.push_back({base + 2 * (off + batch), kPiece});
        batch += kPiece;
      }
      for (size_t k = 0; k < iov.size();) {
        const ssize_t m = ::vmsplice(w.get(), iov.data() + k, iov.size() - k, 0);
        if (m <= 0) return false;
        for (size_t got = static_cast<size_t>(m); got > 0; ++k) {
          if (got < iov[k].iov_len) return false;  // whole pieces only (the pipe has a slot for each)
          got -= iov[k].iov_len;
        }
      }
      for (size_t left = batch; left > 0;) {
        const ssize_t m = ::splice(r.get(), nullptr, sock, nullptr, left, SPLICE_F_MOVE | SPLICE_F_MORE);
        if (m <= 0) return false;
        left -= static_cast<size_t>(m);
      }
      off += batch;
    }
  }
  return true;
}

// A payload whose pages come in pieces smaller than a page (a stream relayed from a TCP socket,
// KubeVirt's path) needs more slots than the target's pipe has (256 for 1 MiB): the reader used to
// copy what did not fit through the slot's memory and send it on (4-6% of the bytes in
// bench/relay_floor.py --path kubevirt, a recv and a send each). Now it empties the pipe into
// QEMU's socket and splices on. Here every payload is 1024 pieces of 1 KiB: four pipes' worth. Only
// a chunk read before the pump asked for deferred payloads is copied (given the reader's wait of
// 10 s, a loaded machine cannot make a chunk wait past it). Byte-exact.
TEST(PumpOverTcpSplice, APayloadInPiecesSmallerThanAPageIsSplicedThroughNotCopied) {
  std::signal(SIGPIPE, SIG_IGN);
  constexpr uint32_t kChunk = 1 << 20;
  constexpr int kChunks = 12;
  auto l = net::tcp_listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  auto peer = net::tcp_connect({"127.0.0.1", net::local_port(l->get()).value()}, 2s);
  ASSERT_TRUE(peer.ok());
  auto a = net::accept_for(l->get(), 2s);
  ASSERT_TRUE(a.ok());
  Metrics metrics;
  auto target = TcpChannel::create(std::move(a.value()), 0, kChunk, 16, metrics.transport("tcp"), SpliceMode::kOn);
  target->set_inline_wait(10s);
  SocketPair dst = qemu_agent_pair();
  auto dst_agent = std::make_shared<UniqueFd>(std::move(dst.agent));
  session::ChannelPump pump(*target, [dst_agent]() -> Result<UniqueFd> { return std::move(*dst_agent); }, true);
  pump.start();
  std::vector<std::byte> scratch;
  bool sent = false;
  std::thread w([&] { sent = send_chunks_in_pieces(peer->get(), kChunk, kChunks, 61, scratch); });
  Received at_qemu;
  std::mt19937_64 gen(61);
  std::vector<std::byte> buf(1 << 20);
  constexpr uint64_t kTotal = uint64_t{kChunk} * kChunks;
  while (at_qemu.bytes < kTotal) {
    const ssize_t n = ::recv(dst.qemu.get(), buf.data(), buf.size(), 0);
    if (n <= 0) break;
    at_qemu.take(gen, buf.data(), static_cast<size_t>(n));
  }
  w.join();
  EXPECT_TRUE(sent);
  EXPECT_EQ(at_qemu.bytes, kTotal);
  EXPECT_EQ(at_qemu.first_mismatch, UINT64_MAX) << "first wrong byte at " << at_qemu.first_mismatch;
  const uint64_t copied = kTotal - target->spliced_received();
  EXPECT_LE(copied, uint64_t{kChunk}) << copied << " of " << kTotal << " bytes copied at the target";
  EXPECT_GE(target->inline_spliced(), static_cast<uint64_t>(kChunks - 1));
  EXPECT_FALSE(pump.error()) << pump.error()->message;
  pump.abort(Error{Errc::kCancelled, "test over"});
  EXPECT_TRUE(pump.wait(5s));
}

// A target QEMU that stops reading for longer than the reader waits for room (50 ms) at a quarter,
// half and three quarters of the stream: the chunk then in hand goes to the pump's thread with
// what is left of it (in the pipe, in the slot), the chunks behind it follow in order, and the
// reader splices chunks through itself again once the queue is empty. Byte-exact throughout.
TEST(PumpOverTcpSplice, AChunkThatWaitsTooLongGoesToThePumpsThreadInOrder) {
  SplicedStream s;
  constexpr uint64_t kTotal = 48ull << 20;
  uint64_t next_pause = kTotal / 4;
  uint64_t inline_before_last_pause = 0;
  s.carry(kTotal, 41, [&](uint64_t read) {
    if (read < next_pause || next_pause >= kTotal) return;
    std::this_thread::sleep_for(200ms);  // four times the reader's wait
    next_pause += kTotal / 4;
    if (next_pause >= kTotal) inline_before_last_pause = s.link->target->inline_spliced();
  });
  // Three pauses, each handing at least the chunk in hand to the pump's thread ...
  EXPECT_LE(s.link->target->inline_spliced() + 3, s.target_pump.chunks_down());
  // ... and the reader splicing through again after the last one.
  EXPECT_GT(s.link->target->inline_spliced(), inline_before_last_pause);
}

// A target QEMU that goes away mid-stream fails the pump with the QEMU side named, and the
// source side learns of it; nothing hangs.
TEST(PumpOverTcpSplice, TargetQemuGoneIsAWriteToQemuError) {
  std::signal(SIGPIPE, SIG_IGN);
  auto link = connect_link(1 << 20, 16, SpliceMode::kOn, SpliceMode::kOn);
  auto src = qemu_agent_pair();
  auto dst = qemu_agent_pair();
  session::ChannelPump source_pump(*link->source, std::move(src.agent));
  UniqueFd dst_agent = std::move(dst.agent);
  session::ChannelPump target_pump(*link->target, [&]() -> Result<UniqueFd> { return std::move(dst_agent); });
  source_pump.start();
  target_pump.start();
  std::thread w([&] { write_stream(src.qemu.get(), 256ull << 20, 5); });
  // Read a little, then stop reading for good: the target agent's next splice into it fails
  // (EPIPE), while QEMU's own sending side stays open.
  std::vector<std::byte> buf(64 << 10);
  ASSERT_GT(::recv(dst.qemu.get(), buf.data(), buf.size(), 0), 0);
  ::shutdown(dst.qemu.get(), SHUT_RD);
  ASSERT_TRUE(target_pump.wait(10s));
  ASSERT_TRUE(target_pump.error());
  EXPECT_NE(target_pump.error()->message.find("write to QEMU"), std::string::npos) << target_pump.error()->message;
  ASSERT_TRUE(source_pump.wait(10s));
  EXPECT_TRUE(source_pump.error());
  ::shutdown(src.qemu.get(), SHUT_RDWR);  // lets the writer finish
  w.join();
}

// An abort reaches a receiver whose reader waits behind a payload left on the socket, and a
// sender blocked splicing from a quiet QEMU.
TEST(PumpOverTcpSplice, AbortEndsPumpsBlockedOnSplice) {
  std::signal(SIGPIPE, SIG_IGN);
  auto link = connect_link(1 << 20, 16, SpliceMode::kOn, SpliceMode::kOn);
  auto src = qemu_agent_pair();
  auto dst = qemu_agent_pair();
  session::ChannelPump source_pump(*link->source, std::move(src.agent));
  UniqueFd dst_agent = std::move(dst.agent);
  session::ChannelPump target_pump(*link->target, [&]() -> Result<UniqueFd> { return std::move(dst_agent); });
  source_pump.start();
  target_pump.start();
  // A stream towards a target QEMU that never reads: the target's splice into it blocks with
  // a payload pending; the source QEMU's writer blocks too.
  std::thread w([&] { write_stream(src.qemu.get(), 64ull << 20, 3); });
  // Bounds, not speeds: generous, so a loaded machine (a build beside the tests) does not fail it.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (source_pump.bytes_up() < (512u << 10) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_GE(source_pump.bytes_up(), 512u << 10);  // more than QEMU's socket holds (EXPECT: threads to join)
  EXPECT_FALSE(target_pump.wait(0ms));
  target_pump.abort(Error{Errc::kCancelled, "cancelled by test"});
  EXPECT_TRUE(target_pump.wait(30s));
  EXPECT_TRUE(source_pump.wait(30s)) << "source pump still blocked after the target aborted";
  ::shutdown(src.qemu.get(), SHUT_RDWR);  // lets the writer finish
  w.join();
}

// A target QEMU that stops reading must not stall the connection: the target's reader takes
// payloads left for splicing into its ring after a while, so credits for the other direction
// still get through and the return path keeps flowing (without that, it stopped after a
// ring's worth of chunks behind one payload waiting on the socket).
class StalledTargetQemu : public ::testing::TestWithParam<SpliceMode> {};

TEST_P(StalledTargetQemu, DoesNotBlockTheReturnPath) {
  std::signal(SIGPIPE, SIG_IGN);
  const SpliceMode mode = GetParam();
  auto link = connect_link(256 << 10, 4, mode, mode);
  auto src = qemu_agent_pair();
  auto dst = qemu_agent_pair();
  session::ChannelPump source_pump(*link->source, std::move(src.agent));
  UniqueFd dst_agent = std::move(dst.agent);
  session::ChannelPump target_pump(*link->target, [&]() -> Result<UniqueFd> { return std::move(dst_agent); });
  source_pump.start();
  target_pump.start();
  // Forward: more than the ring and the socket buffers hold, towards a QEMU that reads nothing.
  // Wait until the forward direction has stalled (the source sent what its credits allow and no
  // more for 300 ms). How much that is depends on how much QEMU had ready per splice: a chunk
  // takes what is there (up to 256 KiB here), so a fixed byte count is not a stall.
  std::thread w1([&] { write_stream(src.qemu.get(), 256ull << 20, 31); });
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  uint64_t last = 0;
  auto last_change = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() < deadline) {
    const uint64_t now_up = source_pump.bytes_up();
    if (now_up != last) {
      last = now_up;
      last_change = std::chrono::steady_clock::now();
    } else if (now_up >= (128u << 10) && std::chrono::steady_clock::now() - last_change > 300ms) {
      break;
    }
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_GE(source_pump.bytes_up(), 128u << 10);  // EXPECT: the threads below must still be joined
  // Return path: 16 MiB (many rings' worth of chunks) from the stalled QEMU to the source QEMU.
  constexpr uint64_t kDown = 16ull << 20;
  Received at_source;
  std::thread r2([&] { at_source = read_stream(src.qemu.get(), 37); });
  std::thread w2([&] {
    std::mt19937_64 gen(37);
    std::vector<std::byte> buf(256 << 10);
    for (uint64_t done = 0; done < kDown; done += buf.size()) {
      for (auto& b : buf) b = static_cast<std::byte>(gen() & 0xff);
      if (!net::write_all(dst.qemu.get(), buf).ok()) return;
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  while (target_pump.bytes_up() < kDown && std::chrono::steady_clock::now() - t0 < 20s) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(target_pump.bytes_up(), kDown) << "return path stalled behind the stalled forward direction";
  w2.join();
  ::shutdown(dst.qemu.get(), SHUT_WR);
  // The payloads the reader took back were copied: not everything forward was spliced in.
  if (mode == SpliceMode::kOn) {
    EXPECT_LT(link->target->spliced_received(), target_pump.bytes_down() + (256u << 10));
  }
  source_pump.abort(Error{Errc::kCancelled, "test over"});
  target_pump.abort(Error{Errc::kCancelled, "test over"});
  ::shutdown(src.qemu.get(), SHUT_RDWR);
  EXPECT_TRUE(source_pump.wait(5s));
  EXPECT_TRUE(target_pump.wait(5s));
  w1.join();
  r2.join();
  EXPECT_EQ(at_source.first_mismatch, UINT64_MAX);
}

// Splice (the reader leaves payloads on the socket) and copy (the reader writes chunks to QEMU
// itself while nothing waits): a QEMU that reads nothing holds up neither the connection nor the
// return path.
INSTANTIATE_TEST_SUITE_P(SpliceAndCopy, StalledTargetQemu, ::testing::Values(SpliceMode::kOn, SpliceMode::kOff),
                         [](const ::testing::TestParamInfo<SpliceMode>& i) {
                           return std::string(i.param == SpliceMode::kOn ? "Splice" : "Copy");
                         });

// ---- drain_on_failure: a source multifd connection is never what fails QEMU ----

// Writes to `fd` until `stop` or a write fails; returns the errno of the failure (0: none).
int write_until(int fd, const std::atomic<bool>& stop, std::atomic<uint64_t>& written) {
  std::vector<char> buf(64 << 10, 'x');
  while (!stop.load()) {
    const ssize_t n = ::send(fd, buf.data(), buf.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    written += static_cast<uint64_t>(n);
  }
  return 0;
}

// True when a one-byte write to `fd` fails within about half a second (its peer reset it).
bool write_fails_soon(int fd) {
  const char b = 'x';
  for (int i = 0; i < 100; ++i) {
    if (::send(fd, &b, 1, MSG_NOSIGNAL) < 0) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

struct DrainCase {
  std::unique_ptr<Link> link;
  SocketPair src, dst;
  UniqueFd dst_agent;
  std::unique_ptr<session::ChannelPump> source_pump, target_pump;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> written{0};
  int write_errno = -1;
  std::thread writer;

  // A source pump (draining on failure when `drain` > 0) carrying a QEMU that writes without
  // pause (or `write_limit` bytes, then nothing, its connection open); its channel breaks once
  // bytes flow (the peer agent's side is aborted).
  explicit DrainCase(std::chrono::milliseconds drain, uint64_t write_limit = 0) {
    std::signal(SIGPIPE, SIG_IGN);
    link = connect_link(256 << 10, 4, SpliceMode::kOff, SpliceMode::kOff);
    src = qemu_agent_pair();
    dst = qemu_agent_pair();
    source_pump = std::make_unique<session::ChannelPump>(*link->source, std::move(src.agent));
    if (drain.count() > 0) source_pump->drain_on_failure(drain);
    dst_agent = std::move(dst.agent);
    target_pump = std::make_unique<session::ChannelPump>(*link->target,
                                                           [this]() -> Result<UniqueFd> { return std::move(dst_agent); });
    source_pump->start();
    target_pump->start();
    if (write_limit > 0) {
      std::vector<char> buf(write_limit, 'x');
      EXPECT_TRUE(net::write_all(src.qemu.get(), std::as_bytes(std::span(buf))));
      written = write_limit;
      write_errno = 0;
    } else {
      writer = std::thread([this] { write_errno = write_until(src.qemu.get(), stop, written); });
    }
    const uint64_t want = write_limit > 0 ? write_limit : 256u << 10;
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    // The target QEMU reads nothing: the flow stalls after about a megabyte (socket buffers).
    while (source_pump->bytes_up() < want && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(2ms);
    }
    EXPECT_GE(source_pump->bytes_up(), want);
    target_pump->abort(Error{Errc::kUnavailable, "peer agent gone"}, true);
    target_pump->wait(5s);
  }
  ~DrainCase() {
    stop = true;
    ::shutdown(src.qemu.get(), SHUT_RDWR);
    if (writer.joinable()) writer.join();
  }
  // Waits until the source pump reports its channel's failure.
  void wait_failed() {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!source_pump->error() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(2ms);
    ASSERT_TRUE(source_pump->error().has_value());
  }
};

// Without drain the channel's failure reaches QEMU as a failed write (what makes a QEMU 7.2
// multifd thread quit); with drain, QEMU keeps writing into nowhere and sees nothing.
TEST(PumpDrainOnFailure, QemuKeepsWritingWithoutAnErrorWhileTheFailedPumpDrains) {
  DrainCase plain(0ms);
  plain.wait_failed();
  plain.writer.join();
  EXPECT_TRUE(plain.write_errno == EPIPE || plain.write_errno == ECONNRESET) << plain.write_errno;

  DrainCase drained(10s);
  drained.wait_failed();
  EXPECT_TRUE(drained.source_pump->draining());
  const uint64_t at_failure = drained.written.load();
  std::this_thread::sleep_for(300ms);
  EXPECT_GT(drained.written.load(), at_failure + (1u << 20)) << "QEMU's writes stalled while the pump drained";
  EXPECT_GT(drained.source_pump->bytes_drained(), 1u << 20);
  EXPECT_FALSE(drained.source_pump->finished());
  // QEMU closes its connection (its own cleanup after the main channel failed): the drain
  // ends at once.
  drained.stop = true;
  drained.writer.join();
  EXPECT_EQ(drained.write_errno, 0);
  ::shutdown(drained.src.qemu.get(), SHUT_WR);
  EXPECT_TRUE(drained.source_pump->wait(2s)) << "the drain outlived QEMU's close";
  EXPECT_FALSE(drained.source_pump->draining());
}

// A QEMU that never closes is cut off at the limit; an abort with reset ends a drain at once.
TEST(PumpDrainOnFailure, EndsAtItsLimitOrOnAReset) {
  DrainCase limited(400ms);
  limited.wait_failed();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(limited.source_pump->wait(3s)) << "the drain outlived its limit";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  limited.writer.join();  // its write fails once the pump shut the connection down
  EXPECT_TRUE(limited.write_errno == EPIPE || limited.write_errno == ECONNRESET) << limited.write_errno;

  DrainCase reset(60s);
  reset.wait_failed();
  EXPECT_TRUE(reset.source_pump->draining());
  const auto t1 = std::chrono::steady_clock::now();
  reset.source_pump->abort(Error{Errc::kCancelled, "session closed"}, true);
  EXPECT_TRUE(reset.source_pump->wait(2s));
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 1s);
  reset.writer.join();
  EXPECT_NE(reset.write_errno, 0);
}

// A QEMU that neither fails nor writes keeps its connection open: the drain ends after
// kMultifdDrainIdle of silence, not at its 10 s limit (what ended such a QEMU's migration in
// the slow tries of bench/results/kubevirt-failures was that reset).
TEST(PumpDrainOnFailure, EndsWhenQemuFallsSilentWithItsConnectionOpen) {
  DrainCase silent(10s);
  silent.wait_failed();
  EXPECT_TRUE(silent.source_pump->draining());
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(silent.source_pump->finished()) << "the drain ended while QEMU still wrote";
  silent.stop = true;  // QEMU's thread stops writing; its socket stays open
  silent.writer.join();
  EXPECT_EQ(silent.write_errno, 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(silent.source_pump->wait(5s)) << "the drain outlived QEMU's silence";
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, session::kMultifdDrainIdle - 150ms);
  EXPECT_LT(took, session::kMultifdDrainIdle + 1500ms);
  EXPECT_FALSE(silent.source_pump->draining());
  // The connection was reset: QEMU's next write fails.
  EXPECT_TRUE(write_fails_soon(silent.src.qemu.get())) << "QEMU's connection still takes writes after the drain ended";
}

// The hole that kept a QEMU 10 migration alive 14 s after a link cut: QEMU had gone quiet on
// the connection before the failure, so the pump sat in its read and never began to drain. The
// reset still comes after kMultifdDrainIdle, not at the session's end.
TEST(PumpDrainOnFailure, EndsWhenQemuWasSilentBeforeTheFailure) {
  DrainCase quiet(10s, 64u << 10);
  quiet.wait_failed();
  // Without the watch the pump waits in its read until the session ends it (never, here).
  EXPECT_TRUE(quiet.source_pump->wait(session::kMultifdDrainIdle + 2s)) << "the pump outlived QEMU's silence";
  EXPECT_EQ(quiet.source_pump->bytes_drained(), 0u);
  EXPECT_TRUE(write_fails_soon(quiet.src.qemu.get())) << "QEMU's connection still takes writes after the drain ended";
}

}  // namespace

// CRC32C: the check values of RFC 3720 (iSCSI) and the common "123456789" one; the SSE4.2 path
// equals the table for every length and alignment around the 8-byte steps, and continues.
TEST(Crc32c, KnownValuesAndTheFastPathMatchesTheTable) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(std::as_bytes(std::span(digits.data(), digits.size()))), 0xe3069283u);
  std::vector<std::byte> zeros(32, std::byte{0}), ones(32, std::byte{0xff});
  EXPECT_EQ(crc32c(zeros), 0x8a9136aau);
  EXPECT_EQ(crc32c(ones), 0x62a8ab43u);
  std::vector<std::byte> data(4096 + 64);
  std::mt19937 gen(7);
  for (auto& b : data) b = static_cast<std::byte>(gen() & 0xff);
  for (size_t off = 0; off < 9; ++off) {
    for (size_t len : {0ul, 1ul, 7ul, 8ul, 9ul, 15ul, 16ul, 17ul, 100ul, 4096ul}) {
      const auto s = std::span(data).subspan(off, len);
      EXPECT_EQ(crc32c(s), crc32c_portable(s)) << "offset " << off << " length " << len;
    }
  }
  const auto all = std::span(data);
  EXPECT_EQ(crc32c(all.subspan(1000), crc32c(all.first(1000))), crc32c(all));
}

// source channel <-> [forwarder: fwd_a <-> fwd_b] <-> target channel: two loopback TCP
// connections whose middle ends a test's forwarder joins (and may tamper with).
struct ForwardedPath {
  UniqueFd source, fwd_a, fwd_b, target;
};

std::optional<ForwardedPath> forwarded_path() {
  auto l1 = net::tcp_listen("127.0.0.1", 0);
  auto l2 = net::tcp_listen("127.0.0.1", 0);
  if (!l1.ok() || !l2.ok()) return std::nullopt;
  auto src_end = net::tcp_connect({"127.0.0.1", net::local_port(l1->get()).value()}, 2s);
  auto fwd_a = net::accept_for(l1->get(), 2s);
  auto fwd_b = net::tcp_connect({"127.0.0.1", net::local_port(l2->get()).value()}, 2s);
  auto dst_end = net::accept_for(l2->get(), 2s);
  if (!src_end.ok() || !fwd_a.ok() || !fwd_b.ok() || !dst_end.ok()) return std::nullopt;
  return ForwardedPath{std::move(src_end.value()), std::move(fwd_a.value()), std::move(fwd_b.value()),
                       std::move(dst_end.value())};
}

// verifyChunks end to end: a forwarder between the two agents' TCP connection flips one bit of
// the first chunk's payload in the source-to-target direction (the transport corrupting data:
// an RDMA device's bug, a bad NIC, memory). The target's pump fails naming the chunk's CRC32C,
// and not one byte of that chunk, nor any after it, reaches the target QEMU: what reached it
// is a prefix of the stream, all of it right.
TEST(PumpVerifyChunks, ACorruptedChunkFailsTheChannelAndNothingOfItReachesQemu) {
  std::signal(SIGPIPE, SIG_IGN);
  Metrics metrics;
  auto& tm = metrics.transport("tcp");
  auto path = forwarded_path();
  ASSERT_TRUE(path.has_value());
  constexpr uint64_t kFlipAt = kFrameHeaderSize + 100;  // inside the first DATA frame's payload
  auto forward = [](int from, int to, uint64_t flip_at) {
    std::vector<std::byte> buf(256 << 10);
    uint64_t seen = 0;
    for (;;) {
      const ssize_t n = ::recv(from, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      if (flip_at >= seen && flip_at < seen + static_cast<uint64_t>(n)) buf[flip_at - seen] ^= std::byte{0x10};
      seen += static_cast<uint64_t>(n);
      if (!net::write_all(to, std::span(buf.data(), static_cast<size_t>(n))).ok()) break;
    }
    ::shutdown(to, SHUT_WR);
  };
  std::thread f1(forward, path->fwd_a.get(), path->fwd_b.get(), kFlipAt);
  std::thread f2(forward, path->fwd_b.get(), path->fwd_a.get(), UINT64_MAX);

  auto source = TcpChannel::create(std::move(path->source), 0, 1 << 20, 8, tm, SpliceMode::kOff);
  auto target = TcpChannel::create(std::move(path->target), 0, 1 << 20, 8, tm, SpliceMode::kOff);
  auto src = qemu_agent_pair();
  auto dst = qemu_agent_pair();
  session::ChannelPump source_pump(*source, std::move(src.agent));
  UniqueFd dst_agent = std::move(dst.agent);
  session::ChannelPump target_pump(*target, [&]() -> Result<UniqueFd> { return std::move(dst_agent); });
  source_pump.verify_chunks();
  target_pump.verify_chunks();
  source_pump.start();
  target_pump.start();

  // QEMU's first write is whole in the socket before the pump's first read: the first chunk
  // holds more than kFlipAt bytes.
  std::vector<std::byte> first(64 << 10, std::byte{0x5a});
  ASSERT_TRUE(net::write_all(src.qemu.get(), first).ok());
  std::thread w([&] { write_stream(src.qemu.get(), 16ull << 20, 5); });
  ASSERT_TRUE(target_pump.wait(10s));
  ASSERT_TRUE(target_pump.error());
  const std::string why = target_pump.error()->message;
  EXPECT_NE(why.find("chunk 0 "), std::string::npos) << why;
  EXPECT_NE(why.find("failed its CRC32C check"), std::string::npos) << why;
  EXPECT_NE(why.find("nothing of it reached QEMU"), std::string::npos) << why;
  EXPECT_EQ(target_pump.bytes_down(), 0u);
  EXPECT_EQ(target_pump.chunks_verified(), 0u);
  // Nothing was written to the target QEMU's connection.
  ::shutdown(dst.qemu.get(), SHUT_WR);
  std::vector<std::byte> got(1 << 20);
  pollfd p{dst.qemu.get(), POLLIN, 0};
  if (::poll(&p, 1, 200) > 0) {
    const ssize_t n = ::recv(dst.qemu.get(), got.data(), got.size(), MSG_DONTWAIT);
    EXPECT_LE(n, 0) << n << " bytes reached the target QEMU";
  }
  // The source learns of it through the channel and ends too.
  ASSERT_TRUE(source_pump.wait(10s));
  EXPECT_TRUE(source_pump.error());
  ::shutdown(src.qemu.get(), SHUT_RDWR);
  w.join();
  source.reset();
  target.reset();
  ::shutdown(path->fwd_a.get(), SHUT_RDWR);
  ::shutdown(path->fwd_b.get(), SHUT_RDWR);
  f1.join();
  f2.join();
}

// A whole chunk lost on the way keeps its own valid CRC32C: what catches it is the sequence
// number each chunk's CRC covers. A forwarder parses the TCP channel's frames (8-byte header:
// type, length; DATA = 1) source to target and drops the second DATA frame: the target passes
// chunk 0 to its QEMU, then fails on the next chunk naming it as chunk 2 arriving where chunk 1
// was due; its QEMU got exactly chunk 0, nothing after.
TEST(PumpVerifyChunks, ALostChunkIsNamedAndNothingAfterItReachesQemu) {
  std::signal(SIGPIPE, SIG_IGN);
  Metrics metrics;
  auto& tm = metrics.transport("tcp");
  auto path = forwarded_path();
  ASSERT_TRUE(path.has_value());
  std::atomic<uint32_t> first_payload{0};
  auto drop_second_data_frame = [&](int from, int to) {
    auto read_exact = [&](std::byte* p, size_t n) {
      while (n > 0) {
        const ssize_t r = ::recv(from, p, n, 0);
        if (r <= 0) return false;
        p += r;
        n -= static_cast<size_t>(r);
      }
      return true;
    };
    uint32_t data_frames = 0;
    std::vector<std::byte> payload;
    for (;;) {
      std::array<std::byte, kFrameHeaderSize> head{};
      if (!read_exact(head.data(), head.size())) break;
      uint32_t type = 0, length = 0;
      std::memcpy(&type, head.data(), 4);
      std::memcpy(&length, head.data() + 4, 4);
      const bool data = type == static_cast<uint32_t>(FrameType::kData);
      const size_t body = data || type == static_cast<uint32_t>(FrameType::kAbort) ? length : 0;
      payload.resize(body);
      if (body > 0 && !read_exact(payload.data(), body)) break;
      if (data && data_frames++ == 1) continue;  // the second DATA frame never arrives
      if (data && data_frames == 1) first_payload = length - static_cast<uint32_t>(session::kVerifyTrailer);
      if (!net::write_all(to, head).ok() || !net::write_all(to, payload).ok()) break;
    }
    ::shutdown(to, SHUT_WR);
  };
  auto forward = [](int from, int to) {
    std::vector<std::byte> buf(64 << 10);
    for (;;) {
      const ssize_t n = ::recv(from, buf.data(), buf.size(), 0);
      if (n <= 0 || !net::write_all(to, std::span(buf.data(), static_cast<size_t>(n))).ok()) break;
    }
    ::shutdown(to, SHUT_WR);
  };
  std::thread f1(drop_second_data_frame, path->fwd_a.get(), path->fwd_b.get());
  std::thread f2(forward, path->fwd_b.get(), path->fwd_a.get());

  auto source = TcpChannel::create(std::move(path->source), 0, 1 << 20, 8, tm, SpliceMode::kOff);
  auto target = TcpChannel::create(std::move(path->target), 0, 1 << 20, 8, tm, SpliceMode::kOff);
  auto src = qemu_agent_pair();
  auto dst = qemu_agent_pair();
  session::ChannelPump source_pump(*source, std::move(src.agent));
  UniqueFd dst_agent = std::move(dst.agent);
  session::ChannelPump target_pump(*target, [&]() -> Result<UniqueFd> { return std::move(dst_agent); });
  source_pump.verify_chunks();
  target_pump.verify_chunks();
  source_pump.start();
  target_pump.start();
  std::thread w([&] { write_stream(src.qemu.get(), 16ull << 20, 9); });
  Received at_target;
  std::thread r([&] { at_target = read_stream(dst.qemu.get(), 9); });
  ASSERT_TRUE(target_pump.wait(10s));
  ASSERT_TRUE(target_pump.error());
  const std::string why = target_pump.error()->message;
  EXPECT_NE(why.find("chunk 1 "), std::string::npos) << why;
  EXPECT_NE(why.find("it is chunk 2: the transport lost, repeated or reordered chunks"), std::string::npos) << why;
  EXPECT_EQ(target_pump.chunks_verified(), 1u);
  ASSERT_TRUE(source_pump.wait(10s));
  ::shutdown(src.qemu.get(), SHUT_RDWR);
  w.join();
  r.join();  // the target pump shut its QEMU socket down
  EXPECT_EQ(at_target.bytes, first_payload.load());  // chunk 0's payload exactly
  EXPECT_EQ(at_target.first_mismatch, UINT64_MAX);
  source.reset();
  target.reset();
  ::shutdown(path->fwd_a.get(), SHUT_RDWR);
  ::shutdown(path->fwd_b.get(), SHUT_RDWR);
  f1.join();
  f2.join();
}
