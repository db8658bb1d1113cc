// rdmig-relay-cpu: what relaying costs the agents, per GiB, without QEMU's own work in the
// figure. Two ChannelPumps (the source agent's and the target agent's) joined by a loopback
// TCP channel pair, exactly as in a migration; a "QEMU" writer thread feeds the source pump
// through a unix socket pair and a "QEMU" reader thread drains the target pump through another.
// The writer's and reader's CPU (their copies into and out of the unix sockets: QEMU's share)
// is measured per thread (RUSAGE_THREAD) and taken out; what is left is both agents' CPU.
//
//   rdmig-relay-cpu [--bytes 8Gi] [--chunk 1Mi] [--depth 16] [--splice auto|on|off]
//                   [--splice-source MODE] [--splice-target MODE] [--write 512Ki] [--channels 1]
//                   [--relay rdmig|floor|floor-splice|floor-framed] [--ends unix|tcp] [--bound-floor]
//                   [--unbounded] [--no-verify] [--tls] [--reader-rate 50M]
// --relay floor: the same hops (unix socket -> one loopback TCP connection per channel -> unix
// socket) relayed by the simplest code that can do it, the benchmark's floor and not the
// product: per connection and direction one thread per "agent" that reads up to --chunk bytes
// and writes them on (floor-splice: splice through a pipe), no framing, credits or metrics.
// What rdmig spends above the floor is its own overhead; the floor is the kernel's price.
// --relay floor-framed: floor-splice with rdmig's framing (an 8-byte header before each payload,
// read apart at the target; floor.h), so that what the framing costs is told apart from the rest.
// --splice sets both agents; --splice-source/--splice-target one of them.
// --tls: rdmig's channels run TLS as with dataPlane.tls: on (transport/tcp/tls_stream.h; kernel TLS
// when the kernel takes it, else user space, named in the output's "tls").
// --ends tcp: the stand-ins reach the agents over loopback TCP connections instead of unix
// sockets, as KubeVirt's migration proxies do; with --write 16406 (a full TLS 1.3 record: 16 KiB
// of data, 5 bytes of header, 1 of content type, a 16-byte tag) the source writes the stream
// in the pieces KubeVirt's TLS proxy writes. --write may be any size. rdmig's ends are bounded
// to a chunk each way as the agents bound the proxy hops (net::bound_local_hop); the floor keeps
// autotuning unless --bound-floor (the same bound: what the bound itself costs, apart from
// rdmig's code); --unbounded leaves rdmig's ends unbounded too (not what the agents run).
// --reader-rate: the target stand-in reads at most this many bytes a second, in 32 KiB reads (the
// size of QEMU's QEMUFile buffer): a target QEMU slower than the stream, so that whatever the hops
// let wait between the two QEMUs fills up. Before each read the reader takes the bytes the source
// stand-in has written (its socket took them: QEMU counts them as sent) less those it has read:
// what waits between the QEMUs, and what a switchover must drain before the target can run.
// inflightMaxBytes is the most of it, summed over the connections' own maxima (at least the most
// at once, as far as the samples saw it); inflightSteadyBytes the mean of its samples once half
// the stream is read (every hop full), summed over the connections. The rate is over all
// connections and must be at least one byte a second for each.
// Prints one JSON line: bytes, seconds, agents' user and system CPU seconds, QEMU stand-ins', the
// chunks sent and, of them, those the target's reader wrote to QEMU itself (inlineChunks) and spliced
// (inlineSpliced).
// Every byte is checked at the reader (8-byte words carry their stream offset) unless
// --no-verify; a mismatch exits 1.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/chunk_memory.h"
#include "common/net.h"
#include "common/thread_name.h"
#include "common/units.h"
#include "floor.h"
#include "metrics/metrics.h"
#include "session/pump.h"
#include "transport/tcp/tcp_channel.h"

using namespace rdmig;
using namespace std::chrono_literals;

namespace {

struct Cpu {
  double user = 0, sys = 0;
};

Cpu usage(int who) {
  rusage ru{};
  getrusage(who, &ru);
  return {static_cast<double>(ru.ru_utime.tv_sec) + static_cast<double>(ru.ru_utime.tv_usec) / 1e6,
          static_cast<double>(ru.ru_stime.tv_sec) + static_cast<double>(ru.ru_stime.tv_usec) / 1e6};
}

struct Options {
  uint64_t bytes = 8ull << 30;
  uint64_t chunk = kMiB;
  uint32_t depth = 16;
  uint64_t write = 512 * kKiB;
  uint32_t channels = 1;
  transport::SpliceMode splice = transport::SpliceMode::kAuto;         // source agent's
  transport::SpliceMode splice_target = transport::SpliceMode::kAuto;  // target agent's
  std::string relay = "rdmig";                                         // or floor, floor-splice
  bool tls = false;
  bool tcp_ends = false;                                               // --ends tcp
  bool bound_floor = false;                                            // --bound-floor
  bool unbounded = false;                                              // --unbounded
  bool verify = true;
  uint64_t reader_rate = 0;  // bytes a second over all connections; 0: as fast as it can
};

struct Stream {
  UniqueFd src_qemu, dst_qemu;
  UniqueFd src_agent, dst_agent, src_tcp, dst_tcp;  // --relay floor*: the relay's own ends
  std::unique_ptr<transport::TcpChannel> src_ch, dst_ch;
  std::unique_ptr<session::ChannelPump> src_pump, dst_pump;
  Cpu writer, reader;
  bool mismatch = false;
  uint64_t received = 0;
  std::atomic<uint64_t> written{0};  // bytes the source stand-in's socket took
  uint64_t inflight_max = 0;         // the reader's samples of written - received
  double inflight_steady_sum = 0;
  uint64_t inflight_steady_n = 0;
};

// Writes `total` bytes whose 8-byte words hold their offset, in writes of `write` bytes (any
// size: a write may start and end inside a word).
void writer(Stream& s, uint64_t total, uint64_t write, bool verify) {
  name_this_thread("qemu-writer");
  const Cpu c0 = usage(RUSAGE_THREAD);
  std::vector<uint64_t> buf(write / 8 + 2);
  uint64_t off = 0;
  bool failed = false;  // the relay failed: the main thread reports the bytes missing
  while (off < total && !failed) {
    const uint64_t n = std::min<uint64_t>(write, total - off);
    if (verify) {
      for (uint64_t i = 0; i < (off % 8 + n + 7) / 8; ++i) buf[i] = off / 8 + i;
    }
    const auto* from = reinterpret_cast<const char*>(buf.data()) + (verify ? off % 8 : 0);
    // Counted as the socket takes them, a part at a time: a writer blocked in the middle of a
    // write has written what the socket took (what QEMU counts as sent).
    for (uint64_t done = 0; done < n;) {
      const ssize_t k = ::send(s.src_qemu.get(), from + done, n - done, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        failed = true;
        break;
      }
      done += static_cast<uint64_t>(k);
      s.written.store(off + done, std::memory_order_release);
    }
    off += n;
  }
  ::shutdown(s.src_qemu.get(), SHUT_WR);
  const Cpu c1 = usage(RUSAGE_THREAD);
  s.writer = {c1.user - c0.user, c1.sys - c0.sys};
}

void reader(Stream& s, bool verify, uint64_t total, uint64_t rate) {
  name_this_thread("qemu-reader");
  const Cpu c0 = usage(RUSAGE_THREAD);
  std::vector<uint64_t> buf((1u << 20) / 8);
  // Paced, it reads as QEMU's QEMUFile does, 32 KiB at a time.
  const size_t want = rate ? size_t{32} << 10 : size_t{1} << 20;
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t off = 0;
  size_t carry = 0;  // bytes of a partial word at the start of buf
  for (;;) {
    if (rate) {
      // On schedule: `received` bytes at `rate` a second from t0.
      std::this_thread::sleep_until(t0 + std::chrono::nanoseconds(
                                             static_cast<int64_t>(static_cast<double>(s.received) * 1e9 / static_cast<double>(rate))));
      const uint64_t w = s.written.load(std::memory_order_acquire);
      const uint64_t waiting = w > s.received ? w - s.received : 0;
      s.inflight_max = std::max(s.inflight_max, waiting);
      if (s.received >= total / 2) {
        s.inflight_steady_sum += static_cast<double>(waiting);
        ++s.inflight_steady_n;
      }
    }
    const ssize_t n = ::recv(s.dst_qemu.get(), reinterpret_cast<char*>(buf.data()) + carry, want - carry, 0);
    if (n <= 0) break;
    const size_t have = carry + static_cast<size_t>(n);
    if (verify) {
      for (size_t i = 0; i < have / 8; ++i) {
        if (buf[i] != off / 8 + i) s.mismatch = true;
      }
    }
    off += have / 8 * 8;
    carry = have % 8;
    if (carry) std::memmove(buf.data(), reinterpret_cast<char*>(buf.data()) + have - carry, carry);
    s.received += static_cast<uint64_t>(n);
  }
  ::shutdown(s.dst_qemu.get(), SHUT_WR);  // the return path ends too
  const Cpu c1 = usage(RUSAGE_THREAD);
  s.reader = {c1.user - c0.user, c1.sys - c0.sys};
}

int usage_error(const std::string& m) {
  std::cerr << "rdmig-relay-cpu: " << m << "\n"
            << "usage: rdmig-relay-cpu [--bytes 8Gi] [--chunk 1Mi] [--depth 16] [--splice auto|on|off]\n"
               "                       [--splice-source MODE] [--splice-target MODE] [--write 512Ki]\n"
               "                       [--channels 1] [--relay rdmig|floor|floor-splice|floor-framed]\n"
               "                       [--ends unix|tcp] [--no-verify] [--tls] [--bound-floor] [--unbounded]\n"
               "                       [--reader-rate 50M]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // as the agent does
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    auto size = [&](const char* name) {
      auto v = parse_bytes(val(), name);
      if (!v) std::exit(usage_error(v.error().message));
      return v.value();
    };
    if (a == "--bytes") o.bytes = size("--bytes");
    else if (a == "--chunk") o.chunk = size("--chunk");
    else if (a == "--write") o.write = size("--write");
    else if (a == "--depth") o.depth = static_cast<uint32_t>(std::stoul(val()));
    else if (a == "--channels") o.channels = static_cast<uint32_t>(std::stoul(val()));
    else if (a == "--no-verify") o.verify = false;
    else if (a == "--tls") o.tls = true;
    else if (a == "--reader-rate") o.reader_rate = size("--reader-rate");
    else if (a == "--bound-floor") o.bound_floor = true;
    else if (a == "--unbounded") o.unbounded = true;
    else if (a == "--relay") o.relay = val();
    else if (a == "--ends") {
      const std::string e = val();
      if (e != "unix" && e != "tcp") return usage_error("--ends must be unix or tcp");
      o.tcp_ends = e == "tcp";
    }
    else if (a == "--splice" || a == "--splice-source" || a == "--splice-target") {
      auto m = transport::parse_splice_mode(val());
      if (!m) return usage_error(a + " must be auto, on or off");
      if (a != "--splice-target") o.splice = *m;
      if (a != "--splice-source") o.splice_target = *m;
    } else return usage_error("unknown argument " + a);
  }
  if (auto st = validate_chunk_size(o.chunk, "--chunk"); !st) return usage_error(st.error().message);
  const bool floor = o.relay != "rdmig";
  if (floor && o.relay != "floor" && o.relay != "floor-splice" && o.relay != "floor-framed") {
    return usage_error("--relay must be rdmig, floor, floor-splice or floor-framed");
  }
  if (o.write < 1 || o.channels < 1 || o.channels > 64 || o.depth < 2) {
    return usage_error("bad --write, --channels or --depth");
  }
  if (o.reader_rate > 0 && o.reader_rate < o.channels) return usage_error("--reader-rate below one byte a second a connection");

  Metrics metrics;
  auto& tm = metrics.transport("tcp");
  auto listener = net::tcp_listen("127.0.0.1", 0);
  if (!listener) return usage_error(listener.error().message);
  const uint16_t port = net::local_port(listener->get()).value();
  // A stand-in's end and the agent's end of one QEMU (or proxy) connection.
  auto qemu_end = [&]() -> std::optional<std::pair<UniqueFd, UniqueFd>> {
    if (o.tcp_ends) {
      auto c = net::tcp_connect({"127.0.0.1", port}, 5s);
      auto a = c ? net::accept_for(listener->get(), 5s) : Result<UniqueFd>(c.error());
      if (!c || !a) return std::nullopt;
      net::tune_tcp_for_bulk(a->get());  // as the agents tune the connections they intercept and dial
      // and bound them to a chunk each way (net::bound_local_hop); the floor keeps autotuning.
      if ((o.relay == "rdmig" && !o.unbounded) || o.bound_floor) net::bound_local_hop(a->get(), o.chunk);
      return std::pair{std::move(c.value()), std::move(a.value())};
    }
    int sp[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) != 0) return std::nullopt;
    return std::pair{UniqueFd(sp[0]), UniqueFd(sp[1])};
  };
  std::vector<std::unique_ptr<Stream>> streams;
  std::string tls_mode = "off";
  for (uint32_t i = 0; i < o.channels; ++i) {
    auto s = std::make_unique<Stream>();
    auto c = net::tcp_connect({"127.0.0.1", port}, 5s);
    auto a = c ? net::accept_for(listener->get(), 5s) : Result<UniqueFd>(c.error());
    if (!c || !a) return usage_error("loopback connect failed");
    if (floor) {
      auto sp = qemu_end(), dp = qemu_end();
      if (!sp || !dp) return usage_error("connecting a stand-in failed");
      s->src_qemu = std::move(sp->first);
      s->src_agent = std::move(sp->second);
      s->dst_qemu = std::move(dp->first);
      s->dst_agent = std::move(dp->second);
      s->src_tcp = std::move(c.value());
      s->dst_tcp = std::move(a.value());
      streams.push_back(std::move(s));
      continue;
    }
    std::unique_ptr<transport::TlsStream> src_tls, dst_tls;
    if (o.tls) {
      const transport::ChannelTerms terms{"bench-key", "0123456789abcdef0123456789abcdef", i};
      Result<std::unique_ptr<transport::TlsStream>> acc = Error{Errc::kInternal, "not run"};
      std::thread t([&] { acc = transport::TlsStream::handshake(a->get(), transport::TlsStream::Role::kAcceptor, terms, 5s); });
      auto dial = transport::TlsStream::handshake(c->get(), transport::TlsStream::Role::kDialler, terms, 5s);
      t.join();
      if (!dial || !acc) return usage_error("TLS handshake failed: " + (dial ? acc.error() : dial.error()).message);
      tls_mode = dial.value()->mode();
      src_tls = std::move(dial.value());
      dst_tls = std::move(acc.value());
    }
    s->src_ch = transport::TcpChannel::create(std::move(c.value()), i, static_cast<uint32_t>(o.chunk), o.depth, tm, o.splice,
                                              std::move(src_tls));
    s->dst_ch = transport::TcpChannel::create(std::move(a.value()), i, static_cast<uint32_t>(o.chunk), o.depth, tm,
                                              o.splice_target, std::move(dst_tls));
    auto sp = qemu_end(), dp = qemu_end();
    if (!sp || !dp) return usage_error("connecting a stand-in failed");
    s->src_qemu = std::move(sp->first);
    s->dst_qemu = std::move(dp->first);
    s->src_pump = std::make_unique<session::ChannelPump>(*s->src_ch, std::move(sp->second));
    auto dst_agent = std::make_shared<UniqueFd>(std::move(dp->second));
    s->dst_pump = std::make_unique<session::ChannelPump>(
        *s->dst_ch, [dst_agent]() -> Result<UniqueFd> { return std::move(*dst_agent); });
    streams.push_back(std::move(s));
  }

  const Cpu p0 = usage(RUSAGE_SELF);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  std::vector<std::thread> relays;  // --relay floor*: one per connection, direction and agent
  for (auto& s : streams) {
    if (floor) {
      const bool framed = o.relay == "floor-framed";
      const bool sp = o.relay == "floor-splice" || framed;
      const size_t buf = static_cast<size_t>(o.chunk);
      relays.emplace_back(floor_copy, "floor-src-fwd", s->src_agent.get(), s->src_tcp.get(), buf, sp,
                          framed ? FloorFraming::kSend : FloorFraming::kNone);
      relays.emplace_back(floor_copy, "floor-dst-fwd", s->dst_tcp.get(), s->dst_agent.get(), buf, sp,
                          framed ? FloorFraming::kReceive : FloorFraming::kNone);
      relays.emplace_back(floor_copy, "floor-dst-ret", s->dst_agent.get(), s->dst_tcp.get(), buf, sp, FloorFraming::kNone);
      relays.emplace_back(floor_copy, "floor-src-ret", s->src_tcp.get(), s->src_agent.get(), buf, sp, FloorFraming::kNone);
    } else {
      s->src_pump->start();
      s->dst_pump->start();
    }
    threads.emplace_back(writer, std::ref(*s), o.bytes / o.channels, o.write, o.verify);
    threads.emplace_back(reader, std::ref(*s), o.verify, o.bytes / o.channels, o.reader_rate / o.channels);
  }
  for (auto& t : threads) t.join();
  bool ok = true;
  for (auto& s : streams) {
    if (floor) ::shutdown(s->src_qemu.get(), SHUT_RD);
  }
  for (auto& t : relays) t.join();
  for (auto& s : streams) {
    if (floor) continue;
    // Both directions end: the return path closed by the reader, the forward one by eof.
    ::shutdown(s->src_qemu.get(), SHUT_RD);
    if (!s->src_pump->wait(30s) || !s->dst_pump->wait(30s)) ok = false;
    if (s->src_pump->error() || s->dst_pump->error()) {
      std::cerr << "pump failed: " << (s->src_pump->error() ? s->src_pump->error()->message : s->dst_pump->error()->message) << "\n";
      ok = false;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const Cpu p1 = usage(RUSAGE_SELF);
  Cpu qemu_writer, qemu_reader;
  uint64_t received = 0;
  bool mismatch = false;
  uint64_t spliced_sent = 0, spliced_received = 0, chunks = 0, inline_chunks = 0, inline_spliced = 0;
  uint64_t inflight_max = 0;
  double inflight_steady = 0;
  for (auto& s : streams) {
    inflight_max += s->inflight_max;
    if (s->inflight_steady_n) inflight_steady += s->inflight_steady_sum / static_cast<double>(s->inflight_steady_n);
    qemu_writer.user += s->writer.user;
    qemu_writer.sys += s->writer.sys;
    qemu_reader.user += s->reader.user;
    qemu_reader.sys += s->reader.sys;
    received += s->received;
    mismatch = mismatch || s->mismatch;
    if (floor) continue;
    spliced_sent += s->src_ch->spliced_sent();
    chunks += s->src_pump->chunks_up();
    spliced_received += s->dst_ch->spliced_received();
    inline_chunks += s->dst_ch->inline_chunks();
    inline_spliced += s->dst_ch->inline_spliced();
  }
  const Cpu qemu{qemu_writer.user + qemu_reader.user, qemu_writer.sys + qemu_reader.sys};
  const double agents_user = (p1.user - p0.user) - qemu.user;
  const double agents_sys = (p1.sys - p0.sys) - qemu.sys;
  const double gib = static_cast<double>(received) / static_cast<double>(1ull << 30);
  std::printf("{\"relay\":\"%s\",\"ends\":\"%s\",\"write\":%llu,\"chunk\":%llu,\"channels\":%u,\"splice\":\"%s\",\"spliceTarget\":\"%s\",\"bytes\":%llu,\"seconds\":%.3f,\"bytesPerSecond\":%.1f,"
              "\"agentsUserSeconds\":%.3f,\"agentsSystemSeconds\":%.3f,"
              "\"agentsCpuSecondsPerGiB\":%.4f,\"agentsUserPerGiB\":%.4f,\"agentsSystemPerGiB\":%.4f,"
              "\"qemuUserSeconds\":%.3f,\"qemuSystemSeconds\":%.3f,"
              "\"qemuWriterSeconds\":%.3f,\"qemuReaderSeconds\":%.3f,"
              "\"splicedSent\":%llu,\"splicedReceived\":%llu,\"chunks\":%llu,\"inlineChunks\":%llu,\"inlineSpliced\":%llu,"
              "\"readerRate\":%llu,\"inflightMaxBytes\":%llu,\"inflightSteadyBytes\":%.0f,"
              "\"tls\":\"%s\",\"verified\":%s}\n",
              o.relay.c_str(), o.tcp_ends ? "tcp" : "unix", static_cast<unsigned long long>(o.write),
              static_cast<unsigned long long>(o.chunk), o.channels,
              transport::splice_mode_name(o.splice), transport::splice_mode_name(o.splice_target), static_cast<unsigned long long>(received), secs,
              secs > 0 ? static_cast<double>(received) / secs : 0.0, agents_user, agents_sys,
              gib > 0 ? (agents_user + agents_sys) / gib : 0.0, gib > 0 ? agents_user / gib : 0.0,
              gib > 0 ? agents_sys / gib : 0.0, qemu.user, qemu.sys,
              qemu_writer.user + qemu_writer.sys, qemu_reader.user + qemu_reader.sys,
              static_cast<unsigned long long>(spliced_sent), static_cast<unsigned long long>(spliced_received),
              static_cast<unsigned long long>(chunks), static_cast<unsigned long long>(inline_chunks),
              static_cast<unsigned long long>(inline_spliced), static_cast<unsigned long long>(o.reader_rate),
              static_cast<unsigned long long>(inflight_max), inflight_steady, tls_mode.c_str(),
              o.verify ? "true" : "false");
  if (received != o.bytes / o.channels * o.channels) {
    std::cerr << "received " << received << " of " << o.bytes << " bytes\n";
    ok = false;
  }
  if (mismatch) {
    std::cerr << "stream corrupted\n";
    ok = false;
  }
  return ok ? 0 : 1;
}
