#include "pathcheck/check.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "transport/rdma/sysfs.h"
#include "session/protocol.h"

namespace rdmig::pathcheck {

using nlohmann::json;
using session::Phase;
using session::Role;
using namespace std::chrono_literals;

namespace {
std::string format_gid(const transport::rdma::GidBytes& g) {
  std::string out;
  char buf[8];
  for (size_t i = 0; i < g.size(); i += 2) {
    std::snprintf(buf, sizeof buf, "%s%02x%02x", i ? ":" : "", g[i], g[i + 1]);
    out += buf;
  }
  return out;
}
}  // namespace

uint64_t buffer_bytes(const CheckSpec& spec) {
  uint64_t n = spec.chunk_size;
  for (const uint64_t f : {uint64_t{spec.ring_depth}, uint64_t{spec.channels}, uint64_t{2}}) {
    if (__builtin_mul_overflow(n, f, &n)) return UINT64_MAX;
  }
  return n;
}

json RdmaEnd::to_json() const {
  return json{{"device", device}, {"port", port},     {"gid", gid},       {"gidIndex", gid_index},
              {"gidType", gid_type}, {"netdev", netdev}, {"mtu", mtu}};
}

RdmaEnd RdmaEnd::of(const session::RdmaSupport& rdma) {
  RdmaEnd e;
  e.device = rdma.device;
  e.port = rdma.device_port;
  if (auto g = transport::rdma::gid_of_address(rdma.ip)) e.gid = format_gid(*g);
  e.gid_index = rdma.gid_index;
  e.gid_type = rdma.gid_type;
  e.netdev = rdma.netdev;
  e.mtu = rdma.mtu;
  return e;
}

RdmaEnd RdmaEnd::of(const session::RdmaRail& rail) {
  RdmaEnd e;
  e.device = rail.device;
  e.port = rail.device_port;
  e.gid = rail.gid;
  if (e.gid.empty()) {
    if (auto g = transport::rdma::gid_of_address(rail.ip)) e.gid = format_gid(*g);
  }
  e.gid_index = rail.gid_index;
  e.gid_type = rail.gid_type;
  e.netdev = rail.netdev;
  e.mtu = rail.mtu;
  return e;
}

std::vector<CheckRail> check_rails(const std::vector<session::RailPair>& pairs, uint32_t channels) {
  std::vector<CheckRail> out;
  for (auto& usage : session::rail_usage(pairs, channels)) {
    const auto pair = std::find_if(pairs.begin(), pairs.end(), [&](const auto& p) { return p.rail == usage.rail; });
    CheckRail r;
    r.local = RdmaEnd::of(pair->local);  // rail_usage lists only rails of `pairs`
    r.usage = std::move(usage);
    out.push_back(std::move(r));
  }
  return out;
}

json rails_to_ready(const std::vector<CheckRail>& rails) {
  json a = json::array();
  for (const auto& r : rails) {
    json j = r.local.to_json();
    j["rail"] = r.usage.rail;
    a.push_back(std::move(j));
  }
  return a;
}

void peer_rails_from_ready(const json& ready, std::vector<CheckRail>& rails) {
  const auto it = ready.find("rails");
  if (it == ready.end() || !it->is_array()) return;
  size_t read = 0;
  for (const auto& item : *it) {
    if (++read > transport::kMaxRails) break;
    if (!item.is_object()) continue;
    const auto idx = item.find("rail");
    if (idx == item.end() || !idx->is_number_integer() || idx->get<int64_t>() < 0) continue;
    const auto rail = idx->get<uint64_t>();
    for (auto& r : rails) {
      if (r.usage.rail == rail && !r.peer) r.peer = RdmaEnd::parse(item);
    }
  }
}

std::optional<RdmaEnd> RdmaEnd::parse(const json& j) {
  if (!j.is_object()) return std::nullopt;
  RdmaEnd e;
  auto str = [&](const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>().substr(0, 64) : std::string();
  };
  auto num = [&](const char* key, int64_t lo, int64_t hi) -> int64_t {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer()) return lo;
    return std::clamp<int64_t>(it->get<int64_t>(), lo, hi);
  };
  e.device = str("device");
  e.gid = str("gid");
  e.gid_type = str("gidType");
  e.netdev = str("netdev");
  e.port = static_cast<int>(num("port", 0, 255));
  e.gid_index = static_cast<int>(num("gidIndex", -1, 65535));
  e.mtu = static_cast<uint32_t>(num("mtu", 0, 4096));
  return e;
}

json to_json(const CheckStatus& s) {
  json j{{"id", s.id},
         {"role", session::role_name(s.role)},
         {"phase", session::phase_name(s.phase)},
         {"transport", s.transport},
         {"transportReason", s.transport_reason},
         {"encryption", s.encryption},
         {"bytes", s.bytes},
         {s.role == Role::kSource ? "bytesSent" : "bytesVerified", s.bytes_done},
         {"channels", s.channels},
         {"chunkSize", s.chunk_size},
         {"throughputBytesPerSecond", s.throughput_bytes_per_second},
         {"durationMs", s.duration_ms}};
  if (s.rtt_us) j["rttMicroseconds"] = *s.rtt_us;
  if (s.local_rdma) j["localRdma"] = s.local_rdma->to_json();
  if (s.peer_rdma) j["peerRdma"] = s.peer_rdma->to_json();
  if (!s.rails.empty()) {
    j["rails"] = json::array();
    for (const auto& r : s.rails) {
      json rail = session::to_json(r.usage);
      rail["localRdma"] = r.local.to_json();
      if (r.peer) rail["peerRdma"] = r.peer->to_json();
      j["rails"].push_back(std::move(rail));
    }
  }
  if (!s.peer.empty()) j["peer"] = s.peer;
  if (!s.error.empty()) j["error"] = s.error;
  return j;
}

PathCheck::PathCheck(CheckSpec spec, CheckContext ctx)
    : spec_(std::move(spec)),
      ctx_(ctx),
      token_(random_hex(16)),
      deadline_(std::chrono::steady_clock::now() + std::chrono::seconds(spec_.timeout_seconds)),
      channel_chunks_(std::make_unique<std::atomic<uint64_t>[]>(spec_.channels)) {
  status_.id = spec_.id;
  status_.role = spec_.role;
  status_.bytes = spec_.bytes;
  status_.channels = spec_.channels;
  status_.chunk_size = spec_.chunk_size;
  if (spec_.role == Role::kSource) {
    status_.peer = net::format_endpoint(spec_.target.host, spec_.target.port);
    seed_ = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  } else {
    data_fds_.resize(spec_.channels);
    data_tls_.resize(spec_.channels);
    rdma_channels_.resize(spec_.channels);
  }
}

PathCheck::~PathCheck() {
  cancel("the agent forgets the check");
  if (worker_.joinable()) worker_.join();
}

void PathCheck::start() {
  ctx_.metrics.pathcheck_started(session::role_name(spec_.role));
  worker_ = std::thread([this] { run(); });
}

CheckStatus PathCheck::status() const {
  std::lock_guard lock(mu_);
  CheckStatus s = status_;
  if (!finished_) s.bytes_done = bytes_done_.load(std::memory_order_relaxed);
  return s;
}

bool PathCheck::finished() const {
  std::lock_guard lock(mu_);
  return finished_;
}

bool PathCheck::wait_finished(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return finished_; });
}

std::string PathCheck::log_prefix() const {
  return "pathcheck=" + spec_.id + " role=" + session::role_name(spec_.role);
}

std::chrono::milliseconds PathCheck::remaining() const {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now());
  return std::max(left, 1ms);
}

Error PathCheck::cancel_or(Error e) const {
  std::lock_guard lock(mu_);
  if (cancelled_) return Error{Errc::kCancelled, cancel_reason_};
  return e;
}

void PathCheck::cancel(const std::string& reason) {
  std::lock_guard lock(mu_);
  if (finished_ || cancelled_) return;
  cancelled_ = true;
  cancel_reason_ = reason;
  const Error why{Errc::kCancelled, reason};
  // The peer hears why on the control link before its channels break.
  if (link_) (void)link_->send(session::message(session::MessageKind::kAbort, json{{"reason", "the peer agent cancelled the check: " + reason}}));
  for (auto& ch : channels_) ch->abort(why);
  if (link_) link_->close();
  if (control_watch_ >= 0) ::shutdown(control_watch_, SHUT_RDWR);
  cv_.notify_all();
}

void PathCheck::abort_all(const Error& reason) {
  std::lock_guard lock(mu_);
  for (auto& ch : channels_) ch->abort(reason);
}

Error PathCheck::on_rail(const Error& e, uint32_t channel) const {
  std::vector<session::RailUsage> usage;
  {
    std::lock_guard lock(mu_);
    for (const auto& r : status_.rails) usage.push_back(r.usage);
  }
  const std::string rail = session::rail_of_channel_text(usage, channel);
  return rail.empty() ? e : e.with_context(rail);
}

void PathCheck::set_phase(Phase phase) {
  update([&](CheckStatus& s) { s.phase = phase; });
}

void PathCheck::update(const std::function<void(CheckStatus&)>& fn) {
  std::lock_guard lock(mu_);
  fn(status_);
}

void PathCheck::run() {
  const auto started = std::chrono::steady_clock::now();
  Status result = ok_status();
  try {
    result = spec_.role == Role::kSource ? run_source() : run_target();
  } catch (const std::exception& e) {
    result = Error{Errc::kInternal, std::string("path check worker: ") + e.what()};
  }
  update([&](CheckStatus& s) {
    s.duration_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count();
  });
  finish(result);
}

void PathCheck::finish(const Status& result) {
  std::vector<std::unique_ptr<transport::Channel>> channels;
  std::unique_ptr<session::ControlLink> link;
  std::string phase;
  {
    std::lock_guard lock(mu_);
    if (result.ok()) {
      status_.phase = Phase::kSucceeded;
      // Every channel carried, and the target verified, its share of the stream.
      std::vector<uint64_t> carried, chunks;
      for (uint32_t i = 0; i < spec_.channels; ++i) {
        carried.push_back(channel_bytes(spec_.bytes, spec_.channels, i));
        chunks.push_back(channel_chunks_[i].load());
      }
      const bool source = spec_.role == Role::kSource;
      std::vector<session::RailUsage> usage;
      for (const auto& r : status_.rails) usage.push_back(r.usage);
      session::ChannelTraffic traffic;
      (source ? traffic.bytes_sent : traffic.bytes_received) = carried;
      (source ? traffic.chunks_sent : traffic.chunks_received) = chunks;
      session::account_rail_traffic(usage, traffic, ctx_.metrics, "pathcheck");
      for (size_t i = 0; i < usage.size(); ++i) status_.rails[i].usage = std::move(usage[i]);
    } else if (cancelled_ || result.error().code == Errc::kCancelled) {
      status_.phase = Phase::kCancelled;
      status_.error = cancelled_ ? cancel_reason_ : result.error().message;
    } else {
      status_.phase = Phase::kFailed;
      status_.error = result.error().message;
    }
    status_.bytes_done = bytes_done_.load();
    phase = session::phase_name(status_.phase);
    channels.swap(channels_);
    link.swap(link_);
    for (auto& ch : rdma_channels_) ch.reset();
    data_tls_.clear();  // before their sockets
    data_fds_.clear();
    control_fd_.reset();
  }
  // Released before the check reports itself finished: a finished check holds no buffers.
  channels.clear();
  link.reset();
  ctx_.metrics.pathcheck_finished(session::role_name(spec_.role), phase);
  const auto st = status();
  if (result.ok()) {
    LOG_INFO("pathcheck") << log_prefix() << " succeeded transport=" << st.transport << " bytes=" << st.bytes_done
                          << " throughput=" << format_bytes_human(st.throughput_bytes_per_second) << "/s";
  } else {
    LOG_WARN("pathcheck") << log_prefix() << " " << phase << ": " << st.error;
  }
  {
    std::lock_guard lock(mu_);
    finished_ = true;
  }
  cv_.notify_all();
}

Status PathCheck::run_channels(const std::function<Status(transport::Channel&, uint32_t)>& body) {
  std::vector<transport::Channel*> chans;
  {
    std::lock_guard lock(mu_);
    for (auto& ch : channels_) chans.push_back(ch.get());
  }
  std::mutex emu;
  std::optional<Error> first;
  std::atomic<size_t> done{0};
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < chans.size(); ++i) {
    threads.emplace_back([&, i] {
      auto st = body(*chans[i], i);
      if (!st) {
        const Error e = on_rail(st.error(), i);
        {
          std::lock_guard l(emu);
          if (!first) first = e;
        }
        abort_all(e);
      }
      done.fetch_add(1);
      cv_.notify_all();
    });
  }
  const std::chrono::seconds stall_limit{ctx_.config.path_check.stall_timeout_seconds};
  {
    std::unique_lock lock(mu_);
    uint64_t last_bytes = bytes_done_.load();
    auto last_move = std::chrono::steady_clock::now();
    bool stopped = false;
    while (done.load() < threads.size()) {
      const auto now = std::chrono::steady_clock::now();
      if (const uint64_t b = bytes_done_.load(); b != last_bytes) {
        last_bytes = b;
        last_move = now;
      }
      std::optional<Error> why;
      if (now >= deadline_) {
        why = Error{Errc::kTimeout, "the stream did not finish within the check's deadline (" +
                                        std::to_string(spec_.timeout_seconds) + " s)"};
      } else if (now - last_move >= stall_limit) {
        why = Error{Errc::kTimeout,
                    "the " + status_.transport + " path " +
                        (spec_.role == Role::kSource ? "to " + status_.peer : std::string("from the source agent")) +
                        " stalled: no byte " +
                        (spec_.role == Role::kSource ? "sent" : "verified") + " for " +
                        std::to_string(stall_limit.count()) + " s (" + std::to_string(last_bytes) + " of " +
                        std::to_string(spec_.bytes) + " bytes done)"};
      }
      if (why && !stopped) {
        stopped = true;
        {
          std::lock_guard l(emu);
          if (!first) first = *why;
        }
        for (auto& ch : channels_) ch->abort(*why);
      }
      cv_.wait_for(lock, 100ms);
    }
  }
  for (auto& t : threads) t.join();
  if (first) return cancel_or(*first);
  return ok_status();
}

}  // namespace rdmig::pathcheck
