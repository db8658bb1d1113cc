#include "migration/target_job.h"

#include <algorithm>
#include <tuple>

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "migration/postcopy_recovery.h"
#include "session/transport_choice.h"
#include "transport/tcp/tcp_channel.h"
#include "session/protocol.h"
#include "session/resume.h"

namespace rdmig::migration {

// The session layer (src/session) this file stands on.
using session::add_rails_to_welcome;
using session::ChannelPump;
using session::choose_transport;
using session::ControlLink;
using session::kHandshakeTimeout;
using session::kHelloRefused;
using session::kHelloTimeout;
using session::kPeerRdmaUnreachable;
using session::parse_wire_transport;
using session::rail_mtus;
using session::wall_clock_ms;
using session::rails_from_hello;
using session::return_path_chunk;
using session::return_path_depth;
using session::TransportChoice;
using session::TransportOffer;
using session::wall_clock_us;
using session::wire_name;

using nlohmann::json;
using namespace std::chrono_literals;

namespace {
// A channel ended by the source's abort: how long the target waits for the source's reason on the
// control link (the source sends it once its QEMU has left the migration).
constexpr auto kSourceReasonWait = 10s;
void reply(int fd, const json& j) { (void)transport::send_message(fd, j); }
void reject(int fd, const std::string& code, const std::string& message) { transport::send_reject(fd, code, message); }
}  // namespace

Result<std::unique_ptr<TargetJob>> TargetJob::create(MigrationSpec spec, JobContext ctx) {
  auto qmp = qemu::QmpClient::connect(spec.qmp_socket, 5s);
  if (!qmp) return qmp_check_failed(spec.qmp_socket, "its greeting", qmp.error());
  auto st = qmp.value()->execute("query-status", {}, kQmpTimeout);
  if (!st) return qmp_check_failed(spec.qmp_socket, "query-status", st.error());
  const auto status = st->is_object() ? st->find("status") : st->end();
  const std::string state = status != st->end() && status->is_string() ? status->get<std::string>() : "?";
  if (state != "inmigrate") {
    return Error{Errc::kFailedPrecondition,
                 "qmpSocket: QEMU at '" + spec.qmp_socket + "' is '" + state +
                     "', not waiting for an incoming migration (start it with -incoming defer)"};
  }
  auto mig = qmp.value()->execute("query-migrate", {}, kQmpTimeout);
  if (!mig) return qmp_check_failed(spec.qmp_socket, "query-migrate", mig.error());
  auto info = qemu::parse_migration_info(mig.value());
  if (!info) return qmp_check_failed(spec.qmp_socket, "query-migrate", info.error());
  if (info->status != "none") {
    return Error{Errc::kFailedPrecondition, "qmpSocket: QEMU at '" + spec.qmp_socket +
                                                "' has already started an incoming migration (" + info->status + ")"};
  }
  return std::unique_ptr<TargetJob>(new TargetJob(std::move(spec), ctx, std::move(qmp.value())));
}

TargetJob::TargetJob(MigrationSpec spec, JobContext ctx, std::unique_ptr<qemu::QmpClient> qmp)
    : Job(std::move(spec), ctx), token_(random_hex(16)) {
  qmp_ = std::move(qmp);
  qemu_pid_ = qemu_pid_of(*qmp_);
  socket_path_ = ctx_.config.state_dir + "/" + spec_.id + ".dst.sock";
  data_fds_.resize(spec_.channels());
  data_tls_.resize(spec_.channels());
  rdma_channels_.resize(spec_.channels());
}

TargetJob::~TargetJob() {
  {
    MutexLock lock(order_mu_);
    order_aborted_ = true;
  }
  order_cv_.notify_all();
  stop_worker();
}

void TargetJob::start() {
  start_worker([this] { run(); });
}

void TargetJob::release_own() {
  std::vector<UniqueFd> fds;
  std::vector<std::unique_ptr<transport::TlsStream>> tls;
  std::vector<std::unique_ptr<transport::Channel>> rdma;
  std::unique_ptr<ControlLink> control;
  {
    MutexLock lock(conn_mu_);
    fds.swap(data_fds_);
    tls.swap(data_tls_);
    rdma.swap(rdma_channels_);
    control = std::move(control_);
  }
  ::unlink(socket_path_.c_str());
}

void TargetJob::on_control(UniqueFd fd, const session::Hello& hello, const std::string& nonce,
                           const std::string& proof) {
  MutexLock lock(conn_mu_);
  // The token first: only its holder learns anything about this migration.
  if (!constant_time_equal(proof, transport::control_proof(token_, nonce, spec_.id, hello.nonce))) {
    ctx_.metrics.transport_error(hello.transport, "auth");
    LOG_WARN("migration") << log_prefix() << " refused a source: token does not match";
    reject(fd.get(), "permission_denied", kHelloRefused);
    return;
  }
  if (finished() || cancel_requested()) {
    reject(fd.get(), "not_found", "migration " + spec_.id + " is over");
    return;
  }
  if (token_used_) {
    reject(fd.get(), "already_exists", "migration " + spec_.id + " already has a source (tokens are one-time)");
    return;
  }
  std::string mismatch;
  if (hello.tls != ctx_.config.data_plane.tls) {
    LOG_WARN("migration") << log_prefix() << " refused a source: "
                          << transport::tls_mismatch(hello.tls, ctx_.config.data_plane.tls);
    reject(fd.get(), "tls_mismatch", transport::tls_mismatch(hello.tls, ctx_.config.data_plane.tls));
    return;
  }
  // post-copy's preempt connection is one more channel, the last (the source asks for it).
  const uint32_t expected = spec_.channels() + (hello.post_copy_preempt ? 1 : 0);
  if (hello.channels != expected) {
    mismatch = "hello.channels: source has " + std::to_string(hello.channels) + " QEMU channels, target expects " +
               std::to_string(expected) + " (multifdChannels must match)";
  } else if (hello.chunk_size != spec_.chunk_size) {
    mismatch = "hello.chunkSize: source " + format_quantity(hello.chunk_size) + ", target " +
               format_quantity(spec_.chunk_size);
  } else if (hello.ring_depth != spec_.ring_depth) {
    mismatch = "hello.ringDepth: source " + std::to_string(hello.ring_depth) + ", target " +
               std::to_string(spec_.ring_depth);
  }
  std::string chosen, reason;
  if (mismatch.empty()) {
    auto offered = parse_wire_transport(hello.transport, "hello.transport");
    auto choice = offered ? choose_transport(TransportOffer{offered.value(), hello.transport_required},
                                             spec_.transport, ctx_.rdma, rail_mtus(hello, ctx_.rdma, expected))
                          : Result<TransportChoice>(offered.error());
    if (choice) {
      chosen = wire_name(choice->transport);
      reason = choice->reason;
      if (!choice->detail.empty()) {
        LOG_WARN("migration") << log_prefix() << " transport tcp: " << choice->detail;
      }
    } else {
      mismatch = choice.error().message;
    }
  }
  if (!mismatch.empty()) {
    reject(fd.get(), "invalid_argument", mismatch);
    return;
  }
  token_used_ = true;
  if (hello.post_copy_preempt) {
    // Before any data channel is admitted (they need token_used_): from here channels() counts it.
    spec_.post_copy.preempt = true;
    data_fds_.resize(spec_.channels());
    data_tls_.resize(spec_.channels());
    rdma_channels_.resize(spec_.channels());
    update([&](MigrationStatus& s) {
      s.channels = spec_.channels();
      s.post_copy.preempt = true;
    });
  }
  source_address_ = net::peer_address(fd.get());
  session_ = random_hex(16);  // names the session; its channels prove channel_key_
  channel_key_ = transport::channel_key(token_, hello.nonce, nonce, session_);
  transport_ = chosen;
  verify_chunks_ = hello.verify_chunks;  // the framing of every chunk: the source decides
  update([&](MigrationStatus& s) { s.verify_chunks = hello.verify_chunks; });
  transport_reason_ = reason;
  json welcome = session::message(session::MessageKind::kWelcome, json{{"session", session_}, {"transport", transport_}, {"transportReason", reason}});
  if (verify_chunks_) welcome["verifyChunks"] = true;  // the source goes on only with this confirmed
  if (hello.tls) welcome["tls"] = true;  // likewise: an agent from before dataPlane.tls would not say it
  // Failover when both agents have it on: a channel whose link fails (TCP or RDMA) is re-dialled
  // by the source over TCP (the source does not ask when it requires RDMA).
  failover_ = hello.failover && ctx_.config.data_plane.failover;
  if (failover_) {
    welcome["failover"] = true;
    failover_peer_ = net::peer_address(fd.get());
  }
  if (transport_ == "rdma") {
    add_rails_to_welcome(welcome, ctx_.rdma);
    rail_pairs_ = rails_from_hello(hello, ctx_.rdma);
    set_rails(rail_pairs_);
    // A channel may come back over another rail (its source re-dials over rdma_cm); the source
    // fails over over rails only when it reads this (an agent from before it sends it over TCP).
    failover_rails_ = failover_ && ctx_.config.data_plane.fails_over_to("rail");
    if (failover_rails_) welcome["failoverRails"] = true;
    // Likewise over another address of a rail's device: this agent's alternates (listed with
    // their rails in the welcome) take re-dials of channels of the same rail.
    failover_addresses_ = failover_ && ctx_.config.data_plane.fails_over_to("address") && session::has_alternates(ctx_.rdma);
    if (failover_addresses_) welcome["failoverAddresses"] = true;
    // RDMA required and no RDMA path to fail over to here: the source re-dials nothing (never TCP).
    if (failover_ && hello.transport_required && !failover_rails_ && !failover_addresses_) {
      failover_ = false;
      welcome.erase("failover");
    }
  }
  reply(fd.get(), welcome);
  // Read from now on: before any channel, the source may say RDMA failed (fallback) or abort.
  control_ = std::make_unique<ControlLink>(std::move(fd));
  conn_cv_.notify_all();
}

Result<transport::ChannelTerms> TargetJob::channel_terms(const std::string& session, uint32_t index) const {
  MutexLock lock(conn_mu_);
  // TCP data channels belong to a TCP session, or re-dial a channel of one that fails over.
  if (!token_used_ || (transport_ != "tcp" && !failover_ && !recovery_open_) || !constant_time_equal(session, session_)) {
    return Error{Errc::kPermissionDenied, kHelloRefused};
  }
  return transport::ChannelTerms{channel_key_, session_, index};
}

void TargetJob::on_data(UniqueFd fd, const session::Hello& hello, const std::string& welcome_proof) {
  const bool tls = ctx_.config.data_plane.tls;
  transport::ChannelTerms terms;
  {
    MutexLock lock(conn_mu_);
    if (!token_used_ || !constant_time_equal(hello.session, session_)) {
      reject(fd.get(), "permission_denied", kHelloRefused);
      return;
    }
    if (restored_ && !hello.recover) {
      // Restored after a restart (restore()): only the recovery's fresh connections belong here.
      reject(fd.get(), "permission_denied", "migration " + spec_.id +
                                                " was taken up again after this agent restarted: only a post-copy "
                                                "recovery's connections (hello.recover) are admitted");
      return;
    }
    if (hello.recover) {
      // A fresh connection of a post-copy recovery (its proof already checked): its control
      // connection, or channel 0; recover_postcopy() takes it.
      if (!recovery_open_ || finished()) {
        reject(fd.get(), "permission_denied", "hello.recover: migration " + spec_.id +
                                                  " is not in post-copy here, or is over: nothing to recover");
        return;
      }
      if (!hello.control && hello.tls != tls) {
        reject(fd.get(), "tls_mismatch", transport::tls_mismatch(hello.tls, tls));
        return;
      }
      if (const auto ok = spec_.recovery_channels();
          !hello.control && std::find(ok.begin(), ok.end(), hello.index) == ok.end()) {
        reject(fd.get(), "invalid_argument", "hello.index: a post-copy recovery resumes channel 0" +
                                                 std::string(spec_.post_copy.preempt ? " and the preempt channel " +
                                                                                           std::to_string(spec_.preempt_index())
                                                                                     : "") +
                                                 ", not " + std::to_string(hello.index));
        return;
      }
      reply(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}}));
      if (hello.control) {
        recover_control_fd_ = std::move(fd);  // a newer try replaces one not yet taken
        recover_data_fds_.clear();            // a try's channels follow its control connection
        recover_asked_ = true;                // a try begins: the source lost the link
      } else {
        recover_data_fds_[hello.index] = std::move(fd);
      }
      conn_cv_.notify_all();
      return;
    }
    if (transport_ != "tcp" && !hello.resume) {
      reject(fd.get(), "permission_denied", kHelloRefused);
      return;
    }
    if (hello.resume && hello.control) {
      // The control connection the source re-dialled (its proof already checked, over
      // kControlIndex): handed to reaccept_control(), which the link's failover runs.
      MutexLock dlock(data_mu_);
      if (!failover_ || !link_ || finished() || cancel_requested()) {
        reject(fd.get(), "permission_denied", "hello.control: migration " + spec_.id +
                                                  " has no control connection to resume");
        return;
      }
      reply(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}}));
      // A newer re-dial replaces one not yet taken.
      redials_.hand_over(transport::kControlIndex, std::move(fd), [&] { link_->interrupt(); });
      return;
    }
    if (hello.resume) {
      // A channel the source re-dialled to fail it over (its proof already checked): handed to
      // reaccept(), which the channel's failover runs; the channel learns its link is gone now.
      if (!failover_ || hello.index >= spec_.channels() || finished() || cancel_requested()) {
        reject(fd.get(), "permission_denied", "hello.resume: migration " + spec_.id + " does not fail channel " +
                                                  std::to_string(hello.index) + " over");
        return;
      }
      if (hello.tls != tls) {
        reject(fd.get(), "tls_mismatch", transport::tls_mismatch(hello.tls, tls));
        return;
      }
      MutexLock dlock(data_mu_);
      auto* fc = failover_channel(hello.index);
      // A channel this end ended (its QEMU failed, a cancel; its abort may not have reached the
      // source) is never resumed: refused at once, so the source fails now, not at its deadline.
      if (fc == nullptr || fc->failed()) {
        reject(fd.get(), "permission_denied", "hello.resume: channel " + std::to_string(hello.index) +
                                                  " of migration " + spec_.id + " has ended here");
        return;
      }
      reply(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}}));
      redials_.hand_over(hello.index, std::move(fd), [&] {  // a newer re-dial replaces one not yet taken
        fc->interrupt(Error{Errc::kUnavailable, "the source agent re-dialled channel " + std::to_string(hello.index)});
      });
      return;
    }
    if (hello.tls != tls) {
      reject(fd.get(), "tls_mismatch", transport::tls_mismatch(hello.tls, tls));
      LOG_WARN("migration") << log_prefix() << " refused data channel " << hello.index << ": "
                            << transport::tls_mismatch(hello.tls, tls);
      return;
    }
    if (hello.index >= data_fds_.size() || data_fds_[hello.index].valid() || data_admitting_.count(hello.index)) {
      reject(fd.get(), "invalid_argument", "hello.index: channel " + std::to_string(hello.index) +
                                               " is out of range or already connected");
      return;
    }
    reply(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}}));
    if (!tls) {
      data_fds_[hello.index] = std::move(fd);
      ++data_received_;
      conn_cv_.notify_all();
      return;
    }
    data_admitting_.insert(hello.index);  // holds the index while the TLS handshake runs unlocked
    terms = transport::ChannelTerms{channel_key_, session_, hello.index};
  }
  auto stream = channel_tls(fd.get(), transport::TlsStream::Role::kAcceptor, terms, kHelloTimeout);
  MutexLock lock(conn_mu_);
  data_admitting_.erase(hello.index);
  if (!stream) {
    LOG_WARN("migration") << log_prefix() << " data channel " << hello.index << ": " << stream.error().message;
    return;
  }
  if (hello.index >= data_fds_.size() || data_fds_[hello.index].valid()) return;  // reset meanwhile
  data_fds_[hello.index] = std::move(fd);
  data_tls_[hello.index] = std::move(stream.value());
  ++data_received_;
  conn_cv_.notify_all();
}

Result<transport::rdma::AcceptPlan> TargetJob::rdma_plan(const transport::rdma::ConnectRequest& request) {
  MutexLock lock(conn_mu_);
  const std::string session = to_hex(request.session.data(), request.session.size());
  const uint32_t index = request.index;
  if (!token_used_ || transport_ != "rdma" || !constant_time_equal(session, session_)) {
    return Error{Errc::kPermissionDenied, "unknown session"};
  }
  // The proof first: a request that does not prove the key takes no index.
  if (auto st = transport::rdma::check_request(request, channel_key_, rdma_proofs_); !st) {
    ctx_.metrics.transport_error("rdma", "auth");
    return st.error();
  }
  if (index >= rdma_channels_.size()) {
    return Error{Errc::kInvalidArgument, "channel " + std::to_string(index) + " out of range or already connected"};
  }
  if (rdma_started_) return rdma_redial_plan(request);  // the channels run: a rail failover's re-dial
  if (rdma_channels_[index]) {
    return Error{Errc::kInvalidArgument, "channel " + std::to_string(index) + " out of range or already connected"};
  }
  auto plan = channel_plan(index);
  plan.deliver = [this, index](Result<std::unique_ptr<transport::Channel>> ch) {
    MutexLock l(conn_mu_);
    if (index >= rdma_channels_.size() || transport_ != "rdma") {
      return;  // the job ended, or fell back to TCP, meanwhile: the new channel just closes
    }
    if (ch) {
      rdma_channels_[index] = std::move(ch.value());
      ++data_received_;
    } else if (!rdma_error_) {
      rdma_error_ = ch.error();
    }
    conn_cv_.notify_all();
  };
  return plan;
}

transport::rdma::AcceptPlan TargetJob::channel_plan(uint32_t index) {
  transport::rdma::AcceptPlan plan;
  plan.key = channel_key_;
  plan.params = transport::rdma::RdmaChannelParams{index, return_path_chunk(spec_.chunk_size),
                                                   return_path_depth(spec_.ring_depth),
                                                   static_cast<uint32_t>(spec_.chunk_size), spec_.ring_depth};
  plan.metrics = &ctx_.metrics.transport("rdma");
  return plan;
}

Status TargetJob::on_early_message(const json& message) {
  const auto type = session::kind_of(message);
  if (type == session::MessageKind::kAbort) {
    return Error{Errc::kUnavailable, "source agent aborted: " + message.value("reason", std::string("?"))};
  }
  if (type != session::MessageKind::kFallback) return ok_status();  // nothing else is sent before "start"
  const std::string why = message.value("error", std::string("?"));
  // Only a choice made automatically is undone automatically: with rdma required on either
  // side the reason was "requested", and the migration fails instead.
  if (transport_ != "rdma" || transport_reason_ != "auto-both-rdma") {
    (void)control_->send(session::message(session::MessageKind::kReject, json{{"message", "rdma is required here"}}));
    return Error{Errc::kUnavailable, "the source agent could not reach this agent over RDMA (" + why + ") and " +
                                         "transport: rdma is required, so no fallback to TCP (" +
                                         std::string(kPeerRdmaUnreachable) + ")"};
  }
  LOG_WARN("migration") << log_prefix() << " the source agent cannot reach this agent over RDMA (" << why
                        << "): falling back to TCP (" << kPeerRdmaUnreachable << ")";
  // RDMA channels that did connect are dropped; the source connects every channel again over TCP.
  for (auto& ch : rdma_channels_) ch.reset();
  rdma_error_.reset();
  data_received_ = 0;
  update([](MigrationStatus& s) { s.rails.clear(); });
  transport_ = "tcp";
  transport_reason_ = kPeerRdmaUnreachable;
  return control_->send(session::message(session::MessageKind::kFallbackOk));
}

Status TargetJob::wait_for_source() {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::seconds(spec_.completion_timeout_seconds);
  MutexLock lock(conn_mu_);
  bool start_seen = false;  // the source's "start" can overtake the last RDMA channel's delivery
  for (;;) {
    if (control_ && data_received_ == spec_.channels()) break;
    if (cancel_requested()) return Error{Errc::kCancelled, cancel_reason()};
    if (control_ && !start_seen) {
      auto m = control_->next(0ms);
      if (!m) {
        return Error{Errc::kUnavailable, "the source agent closed the control connection before its data channels "
                                         "were connected (" + m.error().message + ")"};
      }
      if (m->has_value()) {
        if (session::is(**m, session::MessageKind::kStart)) {
          control_->unread(std::move(**m));  // start_incoming() takes it
          start_seen = true;
        } else {
          RDMIG_TRY(on_early_message(**m));
        }
        continue;
      }
    }
    if (rdma_error_) return *rdma_error_;
    if (std::chrono::steady_clock::now() > deadline) {
      return Error{Errc::kTimeout, "no source agent connected within " +
                                       std::to_string(spec_.completion_timeout_seconds) + " s"};
    }
    if (control_) set_phase(Phase::kConnecting);
    lock.wait_for(conn_cv_, 200ms);
  }
  // Read here, under conn_mu_: the lambda is checked as a function of its own.
  const std::string chosen = transport_, chosen_reason = transport_reason_;
  update([&](MigrationStatus& s) { s.transport = chosen; s.transport_reason = chosen_reason; });
  for (uint32_t i = 0; transport_ == "tcp" && i < data_tls_.size(); ++i) {
    if (data_tls_[i]) report_tls(i, *data_tls_[i]);
  }
  auto& tm = ctx_.metrics.transport(transport_);
  MutexLock dlock(data_mu_);
  for (uint32_t i = 0; i < spec_.channels(); ++i) {
    if (transport_ == "rdma") {
      channels_.push_back(std::move(rdma_channels_[i]));
      rdma_started_ = true;
    } else {
      channels_.push_back(transport::TcpChannel::create(std::move(data_fds_[i]), i,
                                                        static_cast<uint32_t>(spec_.chunk_size),
                                                        spec_.ring_depth, tm, ctx_.config.tcp.splice,
                                                        std::move(data_tls_[i])));
    }
  }
  link_ = std::move(control_);
  if (failover_) {
    link_->fail_over_with(
        [this](uint64_t received, std::chrono::steady_clock::time_point until, const std::function<bool()>& stopped) {
          return reaccept_control(received, until, stopped);
        },
        std::chrono::seconds(ctx_.config.data_plane.failover_deadline_seconds),
        [this](const std::string& reason, std::chrono::milliseconds took, uint64_t resent) {
          on_control_failover(reason, took, resent);
        });
  }
  dlock.unlock();
  if (failover_) {
    wrap_for_failover([this](uint32_t index) -> session::FailoverChannel::Reconnect {
      return [this, index](uint64_t taken, const Error&, std::chrono::steady_clock::time_point until,
                           const std::function<bool()>& stopped) { return reaccept(index, taken, until, stopped); };
    });
  }
  return ok_status();
}

Status TargetJob::start_incoming() {
  std::optional<CancelWatch> watch(std::in_place, *this, link_->fd());  // a cancel ends the wait
  auto start = link_->expect(session::to_string(session::MessageKind::kStart), kHandshakeTimeout);
  const int64_t received_us = wall_clock_us();  // for the source's clock offset estimate
  watch.reset();
  if (!start) return cancel_or(start.error());
  const bool multifd = spec_.multifd_channels > 0;
  json caps = json::array({json{{"capability", "events"}, {"state", true}},
                           json{{"capability", "multifd"}, {"state", multifd}}});
  bool preempt = false;
  {
    MutexLock lock(conn_mu_);
    preempt = spec_.post_copy.preempt;  // set by the source's hello, before any channel
  }
  if (preempt != session::says(start.value(), "postCopyPreempt") || (preempt && !session::says(start.value(), "postCopy"))) {
    return Error{Errc::kProtocol, "start.postCopyPreempt: the source's hello and start disagree"};
  }
  if (preempt) {
    auto v = qemu_version(*qmp_);
    if (!v) return v.error().with_context("target QEMU's query-version");
    if (!v->at_least(8, 0)) {
      return Error{Errc::kFailedPrecondition, "postCopyPreempt: needs QEMU 8.0 or later on both nodes; the target QEMU is " +
                                                  v->text() + " (migrate with postCopyPreempt false)"};
    }
  }
  if (session::says(start.value(), "postCopy")) {
    // As the source: postcopy-ram, postcopy-preempt as the source asks (its connection is the last
    // channel), and postcopy-blocktime for the figure of how long the vCPUs waited on pages.
    post_copy_ = true;
    source_asks_ = session::offers_postcopy_switch_agreement(start.value());
    caps.push_back(json{{"capability", "postcopy-ram"}, {"state", true}});
    caps.push_back(json{{"capability", "postcopy-preempt"}, {"state", preempt}});
    caps.push_back(json{{"capability", "postcopy-blocktime"}, {"state", true}});
    update([](MigrationStatus& s) { s.post_copy.mode = "requested"; });
  }
  auto r = qmp_->execute("migrate-set-capabilities", json{{"capabilities", caps}}, kQmpTimeout);
  if (!r) return r.error().with_context(post_copy_ ? "postCopy: target QEMU" : "target QEMU");
  if (multifd) {
    r = qmp_->execute("migrate-set-parameters", json{{"multifd-channels", spec_.multifd_channels}}, kQmpTimeout);
    if (!r) return r.error().with_context("target QEMU");
  }
  ::unlink(socket_path_.c_str());
  events_before_incoming_ = qmp_->last_event_seq();
  incoming_started_ = true;  // from here on, QEMU may end up with the VM
  r = qmp_->execute("migrate-incoming", json{{"uri", "unix:" + socket_path_}}, kQmpTimeout);
  if (!r) return r.error().with_context("target QEMU");
  if (post_copy_) {
    MutexLock lock(conn_mu_);
    recovery_open_ = true;
  }
  json ready{{"receivedClockUs", received_us}, {"clockUs", wall_clock_us()}};
  if (post_copy_) {
    ready["postCopy"] = true;  // the source switches only with this confirmed
    ready[session::kPostcopySwitchAgreementField] = true;  // and asks this end first, if it offered to
    if (preempt) ready["postCopyPreempt"] = true;
  }
  return link_->send(session::message(session::MessageKind::kReady, ready));
}

Result<UniqueFd> TargetJob::open_qemu_connection(uint32_t index) {
  MutexLock lock(order_mu_);
  while (next_qemu_index_ != index && !order_aborted_) {
    lock.wait_for(order_cv_, std::chrono::milliseconds(200));
    if (next_qemu_index_ != index && finished()) return Error{Errc::kCancelled, "migration ended"};
  }
  if (order_aborted_) return Error{Errc::kCancelled, "migration stopped"};
  auto fd = net::unix_connect(socket_path_, 10s);
  if (!fd) return fd.error().with_context("connecting channel " + std::to_string(index) + " to the target QEMU");
  RDMIG_TRY(check_qemu_peer(fd->get(), "channel " + std::to_string(index) + ": " + socket_path_));
  ++next_qemu_index_;
  order_cv_.notify_all();
  return fd;
}

Status TargetJob::monitor() {
  const auto interval = std::chrono::milliseconds(ctx_.config.migration.progress_interval_ms);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(spec_.completion_timeout_seconds);
  // A source agent that stops moving bytes (frozen: SIGSTOP, a stuck node; or its path
  // stalled) is noticed here too, not only after completionTimeoutSeconds. Failing ends the
  // incoming side; the source, when it runs again, learns the verdict and keeps its VM.
  const auto no_progress = std::chrono::seconds(spec_.no_progress_timeout_seconds);
  uint64_t last_bytes = 0;
  auto last_progress = std::chrono::steady_clock::now();
  for (;;) {
    if (cancel_requested() && !post_copy_) return Error{Errc::kCancelled, cancel_reason()};
    auto raw = qmp_->execute("query-migrate", {}, kQmpTimeout);
    if (!raw) {
      // A target QEMU exits when its incoming stream breaks: when the source side went away
      // first, say so rather than blame the target QEMU.
      if (auto gone = source_gone(500ms)) {
        return Error{Errc::kUnavailable, *gone + "; then the target QEMU: " + raw.error().message};
      }
      return raw.error().with_context("target QEMU");
    }
    auto info = qemu::parse_migration_info(raw.value());
    if (!info) return info.error();
    refresh_data_counters();
    update([&](MigrationStatus& s) {
      s.progress.qemu_status = info->status;
      s.progress.transferred_bytes = s.progress.data_bytes_received;
    });
    const uint64_t received = status().progress.data_bytes_received;
    gauges_.transferred->Set(static_cast<double>(received));
    if (post_copy_) {
      record_postcopy(info.value());
      if (status().post_copy.switched) {
        if (!record_) {  // a source that switched without asking first
          record_ = make_record();
          save_record("postcopy");
        } else if (record_->switched_at_ms == 0) {
          record_->switched_at_ms = status().post_copy.switched_at_ms;
          save_record(record_->state);
        }
        keep_record_alive();
      }
      // In post-copy this QEMU runs the VM with pages still on the source: a cancel (the agent
      // shutting down) would lose them, so post-copy runs to its end (docs/api.md). Checked
      // after this poll's look at QEMU; with the switch agreement (source_asks_) a cancel accepted
      // here is never acted on after this end agreed to the switch.
      if (cancel_requested() && !status().post_copy.switched && !postcopy_agreed()) {
        return Error{Errc::kCancelled, cancel_reason()};
      }
    }
    if (info->status == "completed") return ok_status();
    const bool switched = post_copy_ && status().post_copy.switched;
    if (switched && recover_asked_) {
      return Error{Errc::kUnavailable, "the source agent began a post-copy recovery (it lost the link)"};
    }
    if (received != last_bytes) {
      last_bytes = received;
      last_progress = std::chrono::steady_clock::now();
    } else if (no_progress.count() > 0 && std::chrono::steady_clock::now() - last_progress > no_progress) {
      return Error{Errc::kTimeout, "no bytes from the source agent for " +
                                       std::to_string(spec_.no_progress_timeout_seconds) +
                                       " s (noProgressTimeoutSeconds): it is frozen or its path stalled"};
    }
    // As on the source: a channel that failed here is the cause of a QEMU failure seen in the
    // same poll, and one that only carries the source's abort defers to the source's reason.
    auto failed = channel_failure();
    if (failed && failed->peer_abort) {
      if (auto why = source_reason(kSourceReasonWait)) return *why;
    }
    if (info->status == "failed") {
      return qemu_failure("target QEMU: incoming migration failed", info->error_desc, failed);
    }
    if (failed) return data_plane_error(failed->error, failed->channel);
    if (switched && info->status == kPostcopyPaused) {
      return Error{Errc::kUnavailable, "the target QEMU paused post-copy (postcopy-paused): its stream from the source broke"};
    }
    if (std::chrono::steady_clock::now() > deadline + paused_total_) {
      return Error{Errc::kTimeout, "incoming migration not completed within " +
                                       std::to_string(spec_.completion_timeout_seconds) + " s"};
    }
    const auto wait_for_qemu = [&] {
      qmp_->wait_event(
          [](const qemu::QmpEvent& e) {
            return e.name == "MIGRATION" && qemu::migration_status_terminal(e.data.value("status", ""));
          },
          events_before_incoming_, interval);
    };
    // Until the switch is agreed, the source's question is answered as it comes, not one poll later.
    const bool switch_question = source_asks_ && !postcopy_agreed();
    if (!switch_question) wait_for_qemu();
    auto m = link_->next(switch_question ? interval : 0ms);
    if (!m) {
      // The source agent closed the control connection; QEMU may still finish loading.
      if (switch_question) wait_for_qemu();
      continue;
    }
    if (m->has_value() && session::is(**m, session::MessageKind::kPostcopySwitch)) {
      // One decision with the API's cancel (Job::agree_postcopy_switch): a cancel accepted first
      // wins, and its verdict (result ok:false) tells the source not to switch.
      if (!agree_postcopy_switch()) return Error{Errc::kCancelled, cancel_reason()};
      LOG_INFO("migration") << log_prefix() << " agreed to the source's post-copy switch: cancels are refused from now on";
      // On disk before the source switches: an agent that dies right after can still recover.
      record_ = make_record();
      save_record("postcopy");
      RDMIG_TRY(link_->send(session::message(session::MessageKind::kPostcopySwitchOk)));
      continue;
    }
    if (m->has_value() && session::is(**m, session::MessageKind::kAbort)) {
      source_decided_ = true;
      return Error{Errc::kUnavailable, "source agent aborted: " + (**m).value("reason", std::string("?"))};
    }
  }
}

void TargetJob::report_failure(const Error& error, bool cancelled, bool incoming_started) {
  {
    MutexLock lock(order_mu_);
    order_aborted_ = true;
  }
  order_cv_.notify_all();
  // Cut QEMU's input first: an incomplete stream makes its load fail. The control link stays
  // open: the verdict below must reach the source (closing it here lost every failure verdict).
  abort_data_plane(error, /*keep_link=*/true);
  // The source may resume its VM only if this QEMU certainly never ran it: the incoming
  // migration never started, or QEMU itself reported it failed (and no RESUME was seen).
  bool safe = !incoming_started;
  std::string known = incoming_started ? "unknown" : "never started";
  if (incoming_started && qmp_->connected()) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < deadline) {
      auto raw = qmp_->execute("query-migrate", {}, kQmpTimeout);
      auto info = raw ? qemu::parse_migration_info(raw.value()) : Result<qemu::MigrationInfo>(raw.error());
      if (!info) {
        known = "unknown: " + info.error().message;  // why it is not known, for whoever reads the reason
        break;
      }
      if (info->status == "completed") {
        // Everything had arrived: QEMU has the VM after all.
        report_success();
        return;
      }
      if (info->status == "failed" || info->status == "none") {
        known = "QEMU's incoming migration " + info->status + (info->error_desc.empty() ? "" : ": " + info->error_desc);
        safe = true;
        break;
      }
      std::this_thread::sleep_for(50ms);
    }
  }
  const bool resumed = qmp_->wait_event([](const qemu::QmpEvent& e) { return e.name == "RESUME"; },
                                        events_before_incoming_, 0ms).has_value();
  if (resumed) safe = false;
  if (link_) {
    (void)link_->send(session::message(session::MessageKind::kResult, json{{"ok", false}, {"reason", error.message},
                           {"safeToResumeSource", safe}, {"targetQemu", known}}));
  }
  finish(cancelled ? Phase::kCancelled : Phase::kFailed,
         error.message + (incoming_started ? " (target QEMU: " + known + ")" : ""), failure_of(error.code));
}

void TargetJob::report_success() {
  set_phase(Phase::kCompleting);
  // QEMU has the VM. Running (RESUME event) or paused (started with -S)?
  std::string state = "running";
  int64_t resume_us = 0;
  auto resume = qmp_->wait_event([](const qemu::QmpEvent& e) { return e.name == "RESUME"; },
                                 events_before_incoming_, 0ms);
  auto qs = qmp_->execute("query-status", {}, kQmpTimeout);
  if (qs) state = qs->value("status", std::string("running"));
  if (state == "running" && !resume) {
    resume = qmp_->wait_event([](const qemu::QmpEvent& e) { return e.name == "RESUME"; },
                              events_before_incoming_, 2s);
  }
  if (resume) resume_us = resume->timestamp_us;
  if (state == "prelaunch") state = "paused";
  update([&](MigrationStatus& s) { s.target_state = state; });
  json result{{"ok", true}, {"state", state}, {"resumeTimestampUs", resume_us}};
  if (post_copy_) {
    // The page-fault figures only this QEMU has, for the source's status.
    const auto pc = status().post_copy;
    if (pc.blocktime_ms) result["postCopyBlocktimeMs"] = *pc.blocktime_ms;
    if (pc.page_latency_us) result["postCopyPageLatencyUs"] = *pc.page_latency_us;
    if (pc.page_latency_p50_us) result["postCopyPageLatencyP50Us"] = *pc.page_latency_p50_us;
    if (pc.page_latency_p99_us) result["postCopyPageLatencyP99Us"] = *pc.page_latency_p99_us;
    if (pc.blocktime_ms) ctx_.metrics.set_postcopy_blocktime(spec_.vm, static_cast<double>(*pc.blocktime_ms) / 1000.0);
  }
  if (link_) (void)link_->send(session::message(session::MessageKind::kResult, result));
  bool failover = false;
  {
    MutexLock lock(conn_mu_);
    failover = failover_;
  }
  if (failover && link_) {
    // The result must reach the source: while its goodbye has not come, a lost control connection
    // is still resumed (and the result resent). Bounded by the failover deadline.
    (void)link_->expect(session::to_string(session::MessageKind::kGoodbye),
                        std::chrono::seconds(ctx_.config.data_plane.failover_deadline_seconds) + 1s);
  }
  {
    MutexLock lock(data_mu_);
    // Without a switch the source QEMU never opened its preempt connection: that channel carried
    // nothing and ends with no eof from the source, so it is not waited for.
    if (spec_.post_copy.preempt && !status().post_copy.switched && pumps_.size() > spec_.preempt_index()) {
      pumps_[spec_.preempt_index()]->abort(Error{Errc::kCancelled, "the migration completed in pre-copy: no preempt connection"});
    }
    for (auto& p : pumps_) p->wait(5s);
  }
  finish(Phase::kSucceeded, "");
  abort_data_plane(Error{Errc::kCancelled, "migration finished"});
}

void TargetJob::run() {
  auto st = wait_for_source();
  if (!st) {
    report_failure(st.error(), st.error().code == Errc::kCancelled, false);
    return;
  }
  set_phase(Phase::kConnecting);
  st = start_incoming();
  if (!st) {
    report_failure(st.error(), cancel_requested(), incoming_started_);
    return;
  }
  bool verify_chunks = false;
  {
    MutexLock lock(conn_mu_);  // set in on_control, before wait_for_source() returned
    verify_chunks = verify_chunks_;
  }
  {
    MutexLock lock(data_mu_);
    for (uint32_t i = 0; i < channels_.size(); ++i) {
      // The preempt connection opens as soon as the main one has (open_qemu_connection keeps the
      // order): the target QEMU waits for it before it loads the switch, while the source QEMU
      // sends nothing on it until a page is urgent.
      const bool eager = spec_.post_copy.preempt && i == spec_.preempt_index();
      auto pump = std::make_unique<ChannelPump>(*channels_[i], [this, i] { return open_qemu_connection(i); }, eager);
      if (verify_chunks) pump->verify_chunks();
      pump->start();
      pumps_.push_back(std::move(pump));
    }
  }
  set_phase(Phase::kMigrating);
  monitor_to_end();
}

void TargetJob::monitor_to_end() {
  Status st = monitor();
  while (!st && post_copy_ && status().post_copy.switched) {
    // Past the switch a lost link is recovered over a fresh channel where it can be.
    const auto r = recover_postcopy(st.error());
    if (r == Recovery::kFinished) return;
    if (r == Recovery::kNotRecoverable) break;
    st = monitor();
  }
  if (!st) {
    report_failure(st.error(), st.error().code == Errc::kCancelled && cancel_requested(), true);
    return;
  }
  report_success();
}

}  // namespace rdmig::migration
