#include "pathcheck/check.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "migration/handshake.h"
#include "migration/job.h"
#include "pathcheck/pattern.h"
#include "pathcheck/stream.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/rdma/sysfs.h"
#include "transport/tcp/tcp_channel.h"

namespace rdmig::pathcheck {

using nlohmann::json;
using migration::Phase;
using migration::Role;
using namespace std::chrono_literals;

namespace {
void reply(int fd, const json& j) { (void)transport::send_message(fd, j); }
void reject(int fd, const std::string& code, const std::string& message) {
  reply(fd, json{{"type", "reject"}, {"code", code}, {"message", message}});
}
std::string format_gid(const transport::rdma::GidBytes& g) {
  std::string out;
  char buf[8];
  for (size_t i = 0; i < g.size(); i += 2) {
    std::snprintf(buf, sizeof buf, "%s%02x%02x", i ? ":" : "", g[i], g[i + 1]);
    out += buf;
  }
  return out;
}
// The share of the stream channel `index` carries (channel 0 takes the remainder).
uint64_t channel_bytes(uint64_t bytes, uint32_t channels, uint32_t index) {
  return bytes / channels + (index == 0 ? bytes % channels : 0);
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
  return json{{"device", device}, {"port", port}, {"gid", gid}, {"gidIndex", gid_index}, {"mtu", mtu}};
}

RdmaEnd RdmaEnd::of(const migration::RdmaSupport& rdma) {
  RdmaEnd e;
  e.device = rdma.device;
  e.port = rdma.device_port;
  if (auto g = transport::rdma::gid_of_address(rdma.ip)) e.gid = format_gid(*g);
  e.gid_index = rdma.gid_index;
  e.mtu = rdma.mtu;
  return e;
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
  e.port = static_cast<int>(num("port", 0, 255));
  e.gid_index = static_cast<int>(num("gidIndex", -1, 65535));
  e.mtu = static_cast<uint32_t>(num("mtu", 0, 4096));
  return e;
}

json to_json(const CheckStatus& s) {
  json j{{"id", s.id},
         {"role", migration::role_name(s.role)},
         {"phase", migration::phase_name(s.phase)},
         {"transport", s.transport},
         {"transportReason", s.transport_reason},
         {"bytes", s.bytes},
         {s.role == Role::kSource ? "bytesSent" : "bytesVerified", s.bytes_done},
         {"channels", s.channels},
         {"chunkSize", s.chunk_size},
         {"throughputBytesPerSecond", s.throughput_bytes_per_second},
         {"durationMs", s.duration_ms}};
  if (s.rtt_us) j["rttMicroseconds"] = *s.rtt_us;
  if (s.local_rdma) j["localRdma"] = s.local_rdma->to_json();
  if (s.peer_rdma) j["peerRdma"] = s.peer_rdma->to_json();
  if (!s.peer.empty()) j["peer"] = s.peer;
  if (!s.error.empty()) j["error"] = s.error;
  return j;
}

PathCheck::PathCheck(CheckSpec spec, CheckContext ctx)
    : spec_(std::move(spec)),
      ctx_(ctx),
      token_(random_hex(16)),
      deadline_(std::chrono::steady_clock::now() + std::chrono::seconds(spec_.timeout_seconds)) {
  status_.id = spec_.id;
  status_.role = spec_.role;
  status_.bytes = spec_.bytes;
  status_.channels = spec_.channels;
  status_.chunk_size = spec_.chunk_size;
  if (spec_.role == Role::kSource) {
    status_.peer = spec_.target.host + ":" + std::to_string(spec_.target.port);
    seed_ = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  } else {
    data_fds_.resize(spec_.channels);
    rdma_channels_.resize(spec_.channels);
  }
}

PathCheck::~PathCheck() {
  cancel("the agent forgets the check");
  if (worker_.joinable()) worker_.join();
}

void PathCheck::start() {
  ctx_.metrics.pathcheck_started(migration::role_name(spec_.role));
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
  return "pathcheck=" + spec_.id + " role=" + migration::role_name(spec_.role);
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
  if (link_) (void)link_->send(json{{"type", "abort"}, {"reason", "the peer agent cancelled the check: " + reason}});
  for (auto& ch : channels_) ch->abort(why);
  if (link_) link_->close();
  if (control_watch_ >= 0) ::shutdown(control_watch_, SHUT_RDWR);
  cv_.notify_all();
}

void PathCheck::abort_all(const Error& reason) {
  std::lock_guard lock(mu_);
  for (auto& ch : channels_) ch->abort(reason);
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
  std::unique_ptr<migration::ControlLink> link;
  std::string phase;
  {
    std::lock_guard lock(mu_);
    if (result.ok()) {
      status_.phase = Phase::kSucceeded;
    } else if (cancelled_ || result.error().code == Errc::kCancelled) {
      status_.phase = Phase::kCancelled;
      status_.error = cancelled_ ? cancel_reason_ : result.error().message;
    } else {
      status_.phase = Phase::kFailed;
      status_.error = result.error().message;
    }
    status_.bytes_done = bytes_done_.load();
    phase = migration::phase_name(status_.phase);
    channels.swap(channels_);
    link.swap(link_);
    for (auto& ch : rdma_channels_) ch.reset();
    data_fds_.clear();
    control_fd_.reset();
  }
  // Released before the check reports itself finished: a finished check holds no buffers.
  channels.clear();
  link.reset();
  ctx_.metrics.pathcheck_finished(migration::role_name(spec_.role), phase);
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
        {
          std::lock_guard l(emu);
          if (!first) first = st.error();
        }
        abort_all(st.error());
      }
      done.fetch_add(1);
      cv_.notify_all();
    });
  }
  {
    std::unique_lock lock(mu_);
    while (done.load() < threads.size()) {
      if (std::chrono::steady_clock::now() >= deadline_) {
        const Error late{Errc::kTimeout, "the stream did not finish within the check's deadline (" +
                                             std::to_string(spec_.timeout_seconds) + " s)"};
        {
          std::lock_guard l(emu);
          if (!first) first = late;
        }
        for (auto& ch : channels_) ch->abort(late);
      }
      cv_.wait_for(lock, 100ms);
    }
  }
  for (auto& t : threads) t.join();
  if (first) return cancel_or(*first);
  return ok_status();
}

// ---- source ----

Status PathCheck::connect_source() {
  auto offer = migration::offer_transport(spec_.transport, ctx_.rdma);
  if (!offer) return offer.error();
  transport::Hello hello;
  hello.kind = "control";  // sent as "pathcheck-control": the same fields, another registry
  hello.migration_id = spec_.target.migration_id;
  hello.channels = spec_.channels;
  hello.chunk_size = spec_.chunk_size;
  hello.ring_depth = spec_.ring_depth;
  hello.transport = migration::wire_name(offer->transport);
  hello.transport_required = offer->required;
  if (offer->transport == TransportKind::kRdma) hello.rdma_mtu = ctx_.rdma.mtu;

  const net::Endpoint ep{spec_.target.host, spec_.target.port};
  auto watch = [this](int sfd) {
    std::lock_guard lock(mu_);
    if (cancelled_) return Status(Error{Errc::kCancelled, cancel_reason_});
    control_watch_ = sfd;
    return ok_status();
  };
  auto unwatch = [this] {
    std::lock_guard lock(mu_);
    control_watch_ = -1;
  };
  const auto step = [&] { return std::min<std::chrono::milliseconds>(remaining(), migration::kHandshakeTimeout); };
  auto fd = net::tcp_connect(ep, std::min<std::chrono::milliseconds>(remaining(), 10s), watch);
  if (!fd) {
    unwatch();
    return cancel_or(fd.error().with_context("target agent data plane " + ep.to_string()));
  }
  json hello_json = hello.to_json();
  hello_json["kind"] = "pathcheck-control";
  RDMIG_TRY(transport::send_message(fd->get(), hello_json));
  auto challenge = transport::recv_message(fd->get(), step());
  if (!challenge || challenge->value("type", "") != "challenge") {
    unwatch();
    if (!challenge) return cancel_or(challenge.error().with_context("hello to target agent " + ep.to_string()));
    return Error{Errc::kProtocol, "target agent " + ep.to_string() + " refused the check: " +
                                      challenge->value("message", std::string("no challenge"))};
  }
  auto nonce = transport::get_string(challenge.value(), "nonce", "challenge", 64);
  if (!nonce) return nonce.error().with_context("target agent " + ep.to_string());
  RDMIG_TRY(transport::send_message(
      fd->get(), json{{"type", "auth"},
                      {"proof", transport::control_proof(spec_.target.token, nonce.value(), spec_.target.migration_id)}}));
  auto reply = transport::recv_message(fd->get(), step());
  unwatch();
  if (!reply) return cancel_or(reply.error().with_context("hello to target agent " + ep.to_string()));
  if (reply->value("type", "") == "reject") {
    ctx_.metrics.transport_error(hello.transport, "handshake_rejected");
    return Error{Errc::kPermissionDenied, "target agent " + ep.to_string() + " refused the check: " +
                                              reply->value("message", std::string("?"))};
  }
  auto session = transport::get_string(reply.value(), "session", "welcome", 128);
  auto chosen = transport::get_string(reply.value(), "transport", "welcome", 16);
  if (reply->value("type", "") != "welcome" || !session || !chosen ||
      (chosen.value() != "tcp" && chosen.value() != "rdma")) {
    return Error{Errc::kProtocol, "target agent sent no valid welcome"};
  }
  session_ = session.value();
  const std::string transport = chosen.value();
  std::string reason = reply->value("transportReason", std::string());
  if (reason.empty()) reason = spec_.transport == TransportKind::kAuto ? "auto" : "requested";
  if (reason == "auto-no-source-rdma" || reason == "auto-no-local-rdma") reason = migration::with_rdma_reason(reason, ctx_.rdma);
  update([&](CheckStatus& s) {
    s.transport = transport;
    s.transport_reason = reason;
    if (transport == "rdma") s.local_rdma = RdmaEnd::of(ctx_.rdma);
  });
  LOG_INFO("pathcheck") << log_prefix() << " transport=" << transport << " reason=" << reason;

  auto& tm = ctx_.metrics.transport(transport, "pathcheck");
  for (uint32_t i = 0; i < spec_.channels; ++i) {
    std::unique_ptr<transport::Channel> ch;
    if (transport == "rdma") {
      auto rdma_ep_text = transport::get_string(reply.value(), "rdmaEndpoint", "welcome", 300);
      if (!rdma_ep_text) return rdma_ep_text.error();
      auto rdma_ep = net::parse_endpoint(rdma_ep_text.value(), "welcome.rdmaEndpoint");
      if (!rdma_ep) return rdma_ep.error();
      auto key = transport::rdma::session_from_hex(session_);
      if (!key) return key.error();
      transport::rdma::RdmaChannelParams p{i, static_cast<uint32_t>(spec_.chunk_size), spec_.ring_depth,
                                           migration::return_path_chunk(spec_.chunk_size),
                                           migration::return_path_depth(spec_.ring_depth)};
      auto c = transport::rdma::RdmaChannel::connect(
          rdma_ep.value(), key.value(), p, tm, std::min<std::chrono::milliseconds>(remaining(), 15s),
          [this] {
            std::lock_guard lock(mu_);
            return cancelled_;
          },
          {ctx_.rdma.ip, ctx_.rdma.traffic_class});
      if (!c) {
        ctx_.metrics.transport_error("rdma", "connect");
        return cancel_or(c.error().with_context("RDMA channel " + std::to_string(i) + " to " + rdma_ep_text.value()));
      }
      ch = std::move(c.value());
    } else {
      auto dfd = net::tcp_connect(ep, std::min<std::chrono::milliseconds>(remaining(), 10s), watch);
      if (!dfd) {
        unwatch();
        return cancel_or(dfd.error().with_context("data channel " + std::to_string(i)));
      }
      transport::Hello dh;
      dh.kind = "data";
      dh.migration_id = spec_.target.migration_id;
      dh.session = session_;
      dh.index = i;
      json dh_json = dh.to_json();
      dh_json["kind"] = "pathcheck-data";
      RDMIG_TRY(transport::send_message(dfd->get(), dh_json));
      auto r = transport::recv_message(dfd->get(), step());
      unwatch();
      if (!r) return cancel_or(r.error().with_context("data channel " + std::to_string(i)));
      if (r->value("type", "") != "welcome") {
        return Error{Errc::kProtocol, "data channel " + std::to_string(i) + " refused: " +
                                          r->value("message", std::string("?"))};
      }
      ch = transport::TcpChannel::create(std::move(dfd.value()), i, static_cast<uint32_t>(spec_.chunk_size),
                                         spec_.ring_depth, tm, ctx_.config.tcp.splice);
    }
    std::lock_guard lock(mu_);
    if (cancelled_) return Error{Errc::kCancelled, cancel_reason_};
    channels_.push_back(std::move(ch));
  }
  std::lock_guard lock(mu_);
  if (cancelled_) return Error{Errc::kCancelled, cancel_reason_};
  link_ = std::make_unique<migration::ControlLink>(std::move(fd.value()));
  return ok_status();
}

Status PathCheck::run_source() {
  set_phase(Phase::kConnecting);
  RDMIG_TRY(connect_source());
  json start{{"type", "start"}, {"seed", seed_}, {"bytes", spec_.bytes}};
  RDMIG_TRY(link_->send(start));
  auto ready = link_->expect("ready", remaining());
  if (!ready) return cancel_or(ready.error().with_context("waiting for the target agent's ready"));
  if (auto it = ready->find("rdma"); it != ready->end()) {
    auto end = RdmaEnd::parse(*it);
    update([&](CheckStatus& s) { s.peer_rdma = end; });
  }
  // Round trips on the control link, before the stream loads the path.
  std::vector<int64_t> rtts;
  for (int i = 0; i < kRttSamples; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    RDMIG_TRY(link_->send(json{{"type", "ping"}, {"seq", i}}));
    auto pong = link_->expect("pong", remaining());
    if (!pong) return cancel_or(pong.error().with_context("round trip " + std::to_string(i)));
    rtts.push_back(std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(rtts.begin(), rtts.end());
  update([&](CheckStatus& s) {
    s.rtt_us = rtts[rtts.size() / 2];
    s.phase = Phase::kMigrating;
  });
  RDMIG_TRY(link_->send(json{{"type", "stream"}}));
  const auto t0 = std::chrono::steady_clock::now();
  auto sent = run_channels([this](transport::Channel& ch, uint32_t i) {
    return send_stream(ch, channel_seed(seed_, i), channel_bytes(spec_.bytes, spec_.channels, i), bytes_done_);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The target's verdict names the cause when it stopped the stream (a corrupted byte); after
  // a local failure it is awaited only briefly.
  auto verdict = link_->expect("result", sent ? remaining() : std::min<std::chrono::milliseconds>(remaining(), 5s));
  if (!sent) {
    if (verdict && !verdict->value("ok", false)) {
      return Error{Errc::kProtocol, "target agent: " + verdict->value("error", std::string("?"))};
    }
    return sent.error();
  }
  if (!verdict) return cancel_or(verdict.error().with_context("waiting for the target agent's verdict"));
  (void)link_->send(json{{"type", "goodbye"}});
  if (!verdict->value("ok", false)) {
    return Error{Errc::kProtocol, "target agent: " + verdict->value("error", std::string("?"))};
  }
  const uint64_t verified = verdict->value("bytesVerified", uint64_t{0});
  if (verified != spec_.bytes) {
    return Error{Errc::kProtocol, "target agent verified " + std::to_string(verified) + " of " +
                                      std::to_string(spec_.bytes) + " bytes"};
  }
  update([&](CheckStatus& s) {
    s.phase = Phase::kCompleting;
    s.throughput_bytes_per_second = secs > 0 ? static_cast<double>(spec_.bytes) / secs : 0;
  });
  return ok_status();
}

// ---- target ----

void PathCheck::on_control(UniqueFd fd, const transport::Hello& hello, const std::string& nonce,
                           const std::string& proof) {
  std::lock_guard lock(mu_);
  if (!constant_time_equal(proof, transport::control_proof(token_, nonce, spec_.id))) {
    ctx_.metrics.transport_error(hello.transport, "auth");
    reject(fd.get(), "permission_denied", migration::kHelloRefused);
    return;
  }
  if (finished_ || cancelled_) return reject(fd.get(), "not_found", "path check " + spec_.id + " is over");
  if (token_used_) return reject(fd.get(), "already_exists", "path check " + spec_.id + " already has a source");
  std::string mismatch;
  if (hello.channels != spec_.channels) {
    mismatch = "hello.channels: source " + std::to_string(hello.channels) + ", target " + std::to_string(spec_.channels);
  } else if (hello.chunk_size != spec_.chunk_size) {
    mismatch = "hello.chunkSize: source " + format_quantity(hello.chunk_size) + ", target " + format_quantity(spec_.chunk_size);
  } else if (hello.ring_depth != spec_.ring_depth) {
    mismatch = "hello.ringDepth: source " + std::to_string(hello.ring_depth) + ", target " + std::to_string(spec_.ring_depth);
  }
  std::string chosen, reason;
  if (mismatch.empty()) {
    auto offered = migration::parse_wire_transport(hello.transport, "hello.transport");
    auto choice = offered ? migration::choose_transport(migration::TransportOffer{offered.value(), hello.transport_required},
                                                        spec_.transport, ctx_.rdma, hello.rdma_mtu)
                          : Result<migration::TransportChoice>(offered.error());
    if (choice) {
      chosen = migration::wire_name(choice->transport);
      reason = choice->reason;
    } else {
      mismatch = choice.error().message;
    }
  }
  if (!mismatch.empty()) return reject(fd.get(), "invalid_argument", mismatch);
  token_used_ = true;
  session_ = random_hex(16);
  status_.transport = chosen;
  status_.transport_reason = reason;
  json welcome{{"type", "welcome"}, {"session", session_}, {"transport", chosen}, {"transportReason", reason}};
  if (chosen == "rdma") welcome["rdmaEndpoint"] = ctx_.rdma.ip + ":" + std::to_string(ctx_.rdma.port);
  reply(fd.get(), welcome);
  control_fd_ = std::move(fd);
  cv_.notify_all();
}

void PathCheck::on_data(UniqueFd fd, const transport::Hello& hello) {
  std::lock_guard lock(mu_);
  if (!token_used_ || status_.transport != "tcp" || !constant_time_equal(hello.session, session_) || finished_) {
    return reject(fd.get(), "permission_denied", migration::kHelloRefused);
  }
  if (hello.index >= data_fds_.size() || data_fds_[hello.index].valid()) {
    return reject(fd.get(), "invalid_argument", "hello.index: channel " + std::to_string(hello.index) +
                                                    " is out of range or already connected");
  }
  reply(fd.get(), json{{"type", "welcome"}});
  data_fds_[hello.index] = std::move(fd);
  ++data_received_;
  cv_.notify_all();
}

Result<transport::rdma::AcceptPlan> PathCheck::rdma_plan(const std::string& session, uint32_t index) {
  std::lock_guard lock(mu_);
  if (!token_used_ || status_.transport != "rdma" || !constant_time_equal(session, session_) || finished_) {
    return Error{Errc::kPermissionDenied, "unknown session"};
  }
  if (index >= rdma_channels_.size() || rdma_channels_[index]) {
    return Error{Errc::kInvalidArgument, "channel " + std::to_string(index) + " out of range or already connected"};
  }
  transport::rdma::AcceptPlan plan;
  plan.params = transport::rdma::RdmaChannelParams{index, migration::return_path_chunk(spec_.chunk_size),
                                                   migration::return_path_depth(spec_.ring_depth),
                                                   static_cast<uint32_t>(spec_.chunk_size), spec_.ring_depth};
  plan.metrics = &ctx_.metrics.transport("rdma", "pathcheck");
  plan.deliver = [this, index](Result<std::unique_ptr<transport::Channel>> ch) {
    std::lock_guard l(mu_);
    if (finished_ || index >= rdma_channels_.size()) return;  // the check ended meanwhile
    if (ch) {
      rdma_channels_[index] = std::move(ch.value());
      ++data_received_;
    } else if (!rdma_error_) {
      rdma_error_ = ch.error();
    }
    cv_.notify_all();
  };
  return plan;
}

Status PathCheck::wait_for_source() {
  std::unique_lock lock(mu_);
  for (;;) {
    if (control_fd_.valid() && data_received_ == spec_.channels) break;
    if (cancelled_) return Error{Errc::kCancelled, cancel_reason_};
    if (rdma_error_) return *rdma_error_;
    if (std::chrono::steady_clock::now() >= deadline_) {
      return Error{Errc::kTimeout, token_used_ ? "the source agent connected but not all its channels arrived within " +
                                                     std::to_string(spec_.timeout_seconds) + " s"
                                               : "no source agent connected within " +
                                                     std::to_string(spec_.timeout_seconds) + " s"};
    }
    if (control_fd_.valid()) status_.phase = Phase::kConnecting;
    cv_.wait_for(lock, 200ms);
  }
  const std::string transport = status_.transport;
  if (transport == "rdma") status_.local_rdma = RdmaEnd::of(ctx_.rdma);
  auto& tm = ctx_.metrics.transport(transport, "pathcheck");
  for (uint32_t i = 0; i < spec_.channels; ++i) {
    if (transport == "rdma") {
      channels_.push_back(std::move(rdma_channels_[i]));
    } else {
      channels_.push_back(transport::TcpChannel::create(std::move(data_fds_[i]), i, static_cast<uint32_t>(spec_.chunk_size),
                                                        spec_.ring_depth, tm, ctx_.config.tcp.splice));
    }
  }
  link_ = std::make_unique<migration::ControlLink>(std::move(control_fd_));
  return ok_status();
}

Status PathCheck::run_target() {
  RDMIG_TRY(wait_for_source());
  auto start = link_->expect("start", remaining());
  if (!start) return cancel_or(start.error().with_context("waiting for the source agent's start"));
  const uint64_t seed = start->value("seed", uint64_t{0});
  const uint64_t bytes = start->value("bytes", uint64_t{0});
  if (bytes != spec_.bytes) {
    const Error e{Errc::kInvalidArgument, "start.bytes: source sends " + std::to_string(bytes) + ", target expects " +
                                              std::to_string(spec_.bytes)};
    (void)link_->send(json{{"type", "abort"}, {"reason", e.message}});
    return e;
  }
  json ready{{"type", "ready"}};
  if (status().transport == "rdma") ready["rdma"] = RdmaEnd::of(ctx_.rdma).to_json();
  RDMIG_TRY(link_->send(ready));
  // Answer the source's round trips until it starts the stream.
  for (;;) {
    auto msg = link_->next(remaining());
    if (!msg) return cancel_or(msg.error().with_context("control connection to the source agent"));
    if (!msg->has_value()) return Error{Errc::kTimeout, "the source agent never started the stream"};
    const std::string type = (*msg)->value("type", "");
    if (type == "ping") {
      RDMIG_TRY(link_->send(json{{"type", "pong"}, {"seq", (*msg)->value("seq", 0)}}));
    } else if (type == "stream") {
      break;
    } else if (type == "abort") {
      return cancel_or(Error{Errc::kCancelled, (*msg)->value("reason", std::string("the source agent aborted"))});
    }
  }
  set_phase(Phase::kMigrating);
  const auto t0 = std::chrono::steady_clock::now();
  auto received = run_channels([&](transport::Channel& ch, uint32_t i) {
    return receive_stream(ch, channel_seed(seed, i), channel_bytes(spec_.bytes, spec_.channels, i), bytes_done_);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!received) {
    // A source that cancelled says so on the control link as its channels break: that, not
    // the broken channel, is the cause.
    auto why = link_->expect("goodbye", std::min<std::chrono::milliseconds>(remaining(), 500ms));
    if (!why && why.error().code == Errc::kCancelled) return why.error();
  }
  json verdict{{"type", "result"}, {"ok", received.ok()}, {"bytesVerified", bytes_done_.load()}};
  if (!received) verdict["error"] = received.error().message;
  (void)link_->send(verdict);
  if (!received) return received.error();
  update([&](CheckStatus& s) {
    s.throughput_bytes_per_second = secs > 0 ? static_cast<double>(spec_.bytes) / secs : 0;
  });
  // The source's goodbye (or its hang-up) ends the check.
  (void)link_->expect("goodbye", std::min<std::chrono::milliseconds>(remaining(), 5s));
  return ok_status();
}

}  // namespace rdmig::pathcheck
