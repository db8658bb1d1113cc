// rdmig-stream: moves a generated stream through rdmig's data-plane channels (TCP or RDMA)
// and checks it end to end. Used by the Soft-RoCE tests and by the benchmarks.
//
//   rdmig-stream --transport rdma|tcp --ip ADDR [--bytes 256Mi] [--channels 4]
//                [--chunk 1Mi] [--depth 16] [--reverse 8Mi] [--role both|server|client]
//                [--port N] [--seed N] [--json] [--no-verify]
// --no-verify: no data generation or digests (pure transport throughput, like iperf3).
//
// role both (default): server and client in one process (an rxe device talks to itself).
// role server/client: two processes; killing one mid-stream must end the other with an error.
// Every channel carries bytes/channels forward and reverse/channels backward; each side
// computes a 64-bit digest of the bytes it sent and received; they must match.
#include <arpa/inet.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <condition_variable>
#include <string>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "metrics/metrics.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/rdma/rdma_listener.h"
#include "transport/tcp/tcp_channel.h"

using namespace rdmig;
using namespace rdmig::transport;
using namespace std::chrono_literals;

namespace {

struct Options {
  std::string transport = "tcp";
  std::string ip = "127.0.0.1";
  uint16_t port = 0;
  uint64_t bytes = 256 * kMiB;
  uint64_t reverse = 0;
  uint32_t channels = 1;
  uint64_t chunk = kMiB;
  uint32_t depth = 16;
  std::string role = "both";
  uint64_t seed = 1;
  bool json = false;
  int timeout_s = 300;
  int traffic_class = -1;  // IP ToS byte on RDMA connections (the transport's RdmaOptions::traffic_class)
};

// Deterministic generator of the stream (xorshift64*), 8 bytes at a time.
struct Generator {
  uint64_t s;
  explicit Generator(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  void fill(std::byte* p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const uint64_t v = next();
      std::memcpy(p + i, &v, 8);
    }
    if (i < n) {
      const uint64_t v = next();
      std::memcpy(p + i, &v, n - i);
    }
  }
};

// 64-bit digest of a chunk sequence: 8-byte words mixed per chunk, chunks chained in order.
// Both transports keep chunk boundaries, so sender and receiver see the same sequence.
bool g_verify = true;
struct Digest {
  uint64_t h = 0xcbf29ce484222325ull;
  uint64_t n = 0;
  void update(const std::byte* p, size_t len) {
    n += len;
    if (!g_verify) return;
    uint64_t c = 0x9E3779B97F4A7C15ull ^ len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      c = (c ^ w) * 0xff51afd7ed558ccdull;
      c ^= c >> 32;
    }
    for (; i < len; ++i) c = (c ^ static_cast<uint64_t>(p[i])) * 0x100000001b3ull;
    h = (h ^ c) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
  }
};

struct Side {
  Digest sent, received;
  std::string error;
};

void run_sender(Channel& ch, uint64_t total, uint64_t seed, Digest& d, std::string& err) {
  Generator gen(seed);
  uint64_t done = 0;
  while (done < total) {
    auto buf = ch.acquire();
    if (!buf) { err = buf.error().message; return; }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf->size(), total - done));
    if (g_verify) gen.fill(buf->data(), n);
    d.update(buf->data(), n);
    if (auto st = ch.send(n); !st) { err = st.error().message; return; }
    done += n;
  }
  if (auto st = ch.send_eof(); !st) { err = st.error().message; return; }
  if (auto st = ch.drain(); !st) err = st.error().message;
}

void run_receiver(Channel& ch, Digest& d, std::string& err) {
  for (;;) {
    auto c = ch.receive();
    if (!c) { err = c.error().message; return; }
    const bool eof = c->eof;
    if (!eof) d.update(c->data.data(), c->data.size());
    if (auto st = ch.release(); !st) { err = st.error().message; return; }
    if (eof) return;
  }
}

// Runs both directions of every channel; returns false if any failed.
bool pump(std::vector<std::unique_ptr<Channel>>& chans, uint64_t per_channel, uint64_t seed_base,
          std::vector<Side>& sides) {
  std::vector<std::thread> threads;
  sides.resize(chans.size());
  for (size_t i = 0; i < chans.size(); ++i) {
    threads.emplace_back([&, i] { run_sender(*chans[i], per_channel, seed_base + i, sides[i].sent, sides[i].error); });
    threads.emplace_back([&, i] {
      std::string e;
      run_receiver(*chans[i], sides[i].received, e);
      if (!e.empty() && sides[i].error.empty()) sides[i].error = e;
    });
  }
  for (auto& t : threads) t.join();
  bool ok = true;
  for (auto& s : sides) ok = ok && s.error.empty();
  return ok;
}

std::array<uint8_t, 16> kSession{'r', 'd', 'm', 'i', 'g', '-', 's', 't', 'r', 'e', 'a', 'm'};
// The channel key both ends of the benchmark prove (the agents derive theirs from the token).
const std::string kStreamKey = "rdmig-stream-bench-key";

Result<std::vector<std::unique_ptr<Channel>>> serve(const Options& o, Metrics& m, std::function<void(uint16_t)> ready) {
  std::vector<std::unique_ptr<Channel>> out(o.channels);
  auto& tm = m.transport(o.transport);
  if (o.transport == "tcp") {
    auto l = net::tcp_listen(o.ip, o.port);
    if (!l) return l.error();
    ready(net::local_port(l->get()).value());
    for (uint32_t i = 0; i < o.channels; ++i) {
      auto fd = net::accept_for(l->get(), 60s);
      if (!fd) return fd.error();
      out[i] = TcpChannel::create(std::move(fd.value()), i, static_cast<uint32_t>(o.chunk), o.depth, tm);
    }
    return out;
  }
  std::mutex mu;
  std::condition_variable cv;
  uint32_t got = 0;
  std::string err;
  transport::ProofLedger proofs;
  auto listener = rdma::RdmaListener::create(o.ip, o.port, [&](const rdma::ConnectRequest& r) -> Result<rdma::AcceptPlan> {
    const uint32_t index = r.index;
    if (r.session != kSession || index >= o.channels) return Error{Errc::kPermissionDenied, "unknown stream"};
    RDMIG_TRY(rdma::check_request(r, kStreamKey, proofs));  // as the agents do, before accepting
    rdma::AcceptPlan plan;
    plan.key = kStreamKey;
    plan.params = rdma::RdmaChannelParams{index, static_cast<uint32_t>(o.chunk), o.depth, static_cast<uint32_t>(o.chunk), o.depth};
    plan.metrics = &tm;
    plan.deliver = [&, index](Result<std::unique_ptr<Channel>> ch) {
      std::lock_guard lock(mu);
      if (ch) out[index] = std::move(ch.value()); else err = ch.error().message;
      ++got;
      cv.notify_all();
    };
    return plan;
  }, o.traffic_class);
  if (!listener) return listener.error();
  ready(listener.value()->port());
  std::unique_lock lock(mu);
  if (!cv.wait_for(lock, 60s, [&] { return got == o.channels; })) return Error{Errc::kTimeout, "clients did not connect"};
  if (!err.empty()) return Error{Errc::kUnavailable, err};
  return out;
}

Result<std::vector<std::unique_ptr<Channel>>> dial(const Options& o, uint16_t port, Metrics& m) {
  std::vector<std::unique_ptr<Channel>> out;
  auto& tm = m.transport(o.transport);
  for (uint32_t i = 0; i < o.channels; ++i) {
    if (o.transport == "tcp") {
      auto fd = net::tcp_connect({o.ip, port}, 10s);
      if (!fd) return fd.error();
      out.push_back(TcpChannel::create(std::move(fd.value()), i, static_cast<uint32_t>(o.chunk), o.depth, tm));
    } else {
      rdma::RdmaChannelParams p{i, static_cast<uint32_t>(o.chunk), o.depth, static_cast<uint32_t>(o.chunk), o.depth};
      auto ch = rdma::RdmaChannel::connect({o.ip, port}, rdma::ChannelCredentials{kSession, kStreamKey}, p, tm, 10s, {},
                                           {"", o.traffic_class});
      if (!ch) return ch.error();
      out.push_back(std::move(ch.value()));
    }
  }
  return out;
}

int usage(const std::string& why) {
  std::cerr << "rdmig-stream: " << why << "\n"
            << "usage: rdmig-stream --transport rdma|tcp --ip ADDR [--bytes 256Mi] [--channels 4] [--chunk 1Mi]\n"
               "                    [--depth 16] [--reverse 0] [--role both|server|client] [--port N] [--json]\n"
               "                    [--traffic-class TOS]  (rdma: IP ToS byte, DSCP x 4, as the agent's rdma.trafficClass)\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&](const char* name) -> std::string {
      if (i + 1 >= argc) { std::cerr << name << " needs a value\n"; std::exit(2); }
      return argv[++i];
    };
    auto size = [&](const char* name) -> uint64_t {
      auto r = parse_bytes(val(name), name);
      if (!r) { std::cerr << r.error().message << "\n"; std::exit(2); }
      return r.value();
    };
    if (a == "--transport") o.transport = val("--transport");
    else if (a == "--ip") o.ip = val("--ip");
    else if (a == "--port") o.port = static_cast<uint16_t>(std::stoul(val("--port")));
    else if (a == "--bytes") o.bytes = size("--bytes");
    else if (a == "--reverse") o.reverse = size("--reverse");
    else if (a == "--channels") o.channels = static_cast<uint32_t>(std::stoul(val("--channels")));
    else if (a == "--chunk") o.chunk = size("--chunk");
    else if (a == "--depth") o.depth = static_cast<uint32_t>(std::stoul(val("--depth")));
    else if (a == "--role") o.role = val("--role");
    else if (a == "--seed") o.seed = std::stoull(val("--seed"));
    else if (a == "--json") o.json = true;
    else if (a == "--no-verify") g_verify = false;
    else if (a == "--timeout") o.timeout_s = std::stoi(val("--timeout"));
    else if (a == "--debug") log::set_level(log::Level::kDebug);
    else if (a == "--traffic-class") o.traffic_class = std::stoi(val("--traffic-class"));
    else return usage("unknown argument " + a);
  }
  if (o.transport != "tcp" && o.transport != "rdma") return usage("--transport must be tcp or rdma");
  if (auto st = validate_chunk_size(o.chunk, "--chunk"); !st) return usage(st.error().message);
  if (o.channels < 1 || o.channels > 64 || o.depth < 2 || o.depth > 1024) return usage("bad --channels or --depth");
  if (o.traffic_class != -1 && (o.traffic_class < 0 || o.traffic_class > 252 || o.traffic_class % 4 != 0)) {
    return usage("--traffic-class: an IP ToS byte 0..252 whose two ECN bits are 0 (DSCP x 4)");
  }
  // Never hang a test: give up loudly after --timeout seconds.
  std::thread([t = o.timeout_s] {
    std::this_thread::sleep_for(std::chrono::seconds(t));
    std::fprintf(stderr, "rdmig-stream: timed out after %d s\n", t);
    std::_Exit(3);
  }).detach();
  Metrics metrics("stream");
  const uint64_t per_fwd = o.bytes / o.channels;
  const uint64_t per_rev = o.reverse / o.channels;

  // Forward: client -> server uses seeds seed*1000+i; reverse: server -> client seed*2000+i.
  // CPU time of this whole process (all threads: with --role both, sender and receiver).
  // User and system apart: with rxe the "NIC" is kernel code on the posting thread, so only
  // user time says what a hardware RNIC would leave to the agents.
  auto cpu_times = [] {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return std::make_pair(static_cast<double>(ru.ru_utime.tv_sec) + static_cast<double>(ru.ru_utime.tv_usec) / 1e6,
                          static_cast<double>(ru.ru_stime.tv_sec) + static_cast<double>(ru.ru_stime.tv_usec) / 1e6);
  };
  auto cpu_seconds = [&] {
    const auto [u, s] = cpu_times();
    return u + s;
  };
  const auto cpu_start_times = cpu_times();
  const double cpu_start = cpu_start_times.first + cpu_start_times.second;
  auto report = [&](const char* side, const std::vector<Side>& sides, double secs, uint64_t moved) {
    Digest s, r;
    for (const auto& x : sides) { s.h ^= x.sent.h; s.n += x.sent.n; r.h ^= x.received.h; r.n += x.received.n; }
    if (o.json) {
      std::printf("{\"side\":\"%s\",\"transport\":\"%s\",\"channels\":%u,\"chunk\":%llu,\"depth\":%u,\"sentBytes\":%llu,"
                  "\"sentDigest\":\"%016llx\",\"receivedBytes\":%llu,\"receivedDigest\":\"%016llx\",\"seconds\":%.6f,"
                  "\"bytesPerSecond\":%.1f,\"cpuSeconds\":%.3f,\"cpuUserSeconds\":%.3f,\"cpuSystemSeconds\":%.3f}\n",
                  side, o.transport.c_str(), o.channels, static_cast<unsigned long long>(o.chunk), o.depth,
                  static_cast<unsigned long long>(s.n), static_cast<unsigned long long>(s.h),
                  static_cast<unsigned long long>(r.n), static_cast<unsigned long long>(r.h), secs,
                  secs > 0 ? static_cast<double>(moved) / secs : 0.0, cpu_seconds() - cpu_start,
                  cpu_times().first - cpu_start_times.first, cpu_times().second - cpu_start_times.second);
    } else {
      std::printf("%s: sent %llu bytes digest %016llx, received %llu bytes digest %016llx, %.3f s, %.1f MiB/s\n", side,
                  static_cast<unsigned long long>(s.n), static_cast<unsigned long long>(s.h),
                  static_cast<unsigned long long>(r.n), static_cast<unsigned long long>(r.h), secs,
                  secs > 0 ? static_cast<double>(moved) / secs / kMiB : 0.0);
    }
    std::fflush(stdout);
    return std::make_pair(s, r);
  };

  if (o.role == "server") {
    auto chans = serve(o, metrics, [](uint16_t p) { std::printf("listening %u\n", p); std::fflush(stdout); });
    if (!chans) { std::fprintf(stderr, "rdmig-stream server: %s\n", chans.error().message.c_str()); return 1; }
    std::vector<Side> sides;
    const auto t0 = std::chrono::steady_clock::now();
    const bool ok = pump(chans.value(), per_rev, o.seed * 2000, sides);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    report("server", sides, secs, per_fwd * o.channels);
    for (auto& s : sides) if (!s.error.empty()) std::fprintf(stderr, "rdmig-stream server: %s\n", s.error.c_str());
    return ok ? 0 : 1;
  }
  if (o.role == "client") {
    if (o.port == 0) return usage("--role client needs --port");
    auto chans = dial(o, o.port, metrics);
    if (!chans) { std::fprintf(stderr, "rdmig-stream client: %s\n", chans.error().message.c_str()); return 1; }
    std::vector<Side> sides;
    const auto t0 = std::chrono::steady_clock::now();
    const bool ok = pump(chans.value(), per_fwd, o.seed * 1000, sides);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    report("client", sides, secs, per_fwd * o.channels);
    for (auto& s : sides) if (!s.error.empty()) std::fprintf(stderr, "rdmig-stream client: %s\n", s.error.c_str());
    return ok ? 0 : 1;
  }
  // both: server in a thread, client here.
  std::mutex mu;
  std::condition_variable cv;
  uint16_t port = 0;
  Result<std::vector<std::unique_ptr<Channel>>> server_chans = Error{Errc::kInternal, "not started"};
  bool server_done = false;
  std::thread server([&] {
    auto r = serve(o, metrics, [&](uint16_t p) { std::lock_guard l(mu); port = p; cv.notify_all(); });
    std::lock_guard l(mu);
    server_chans = std::move(r);
    server_done = true;
    cv.notify_all();
  });
  {
    std::unique_lock l(mu);
    cv.wait(l, [&] { return port != 0 || server_done; });
  }
  if (port == 0) {
    server.join();
    std::fprintf(stderr, "rdmig-stream: %s\n", server_chans.error().message.c_str());
    return 1;
  }
  auto client_chans = dial(o, port, metrics);
  server.join();
  if (!client_chans || !server_chans) {
    std::fprintf(stderr, "rdmig-stream: %s\n", (!client_chans ? client_chans.error() : server_chans.error()).message.c_str());
    return 1;
  }
  std::vector<Side> cs, ss;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread st([&] { pump(server_chans.value(), per_rev, o.seed * 2000, ss); });
  pump(client_chans.value(), per_fwd, o.seed * 1000, cs);
  st.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto [c_sent, c_recv] = report("client", cs, secs, per_fwd * o.channels);
  auto [s_sent, s_recv] = report("server", ss, secs, per_fwd * o.channels);
  bool ok = true;
  for (auto* v : {&cs, &ss}) for (auto& s : *v) if (!s.error.empty()) { ok = false; std::fprintf(stderr, "rdmig-stream: %s\n", s.error.c_str()); }
  if (c_sent.n != s_recv.n || c_sent.h != s_recv.h || s_sent.n != c_recv.n || s_sent.h != c_recv.h) {
    std::fprintf(stderr, "rdmig-stream: DIGEST MISMATCH\n");
    ok = false;
  } else if (!o.json) {
    std::printf("digests match\n");
  }
  return ok ? 0 : 1;
}
