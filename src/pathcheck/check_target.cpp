// The target end of a path check: the hand-over from the data-plane server, then every byte checked.
#include "pathcheck/check.h"

#include <algorithm>

#include "common/log.h"
#include "common/units.h"
#include "pathcheck/pattern.h"
#include "pathcheck/stream.h"
#include "session/transport_choice.h"
#include "session/types.h"
#include "transport/tcp/tcp_channel.h"
#include "session/protocol.h"

namespace rdmig::pathcheck {

using nlohmann::json;
using session::Phase;
using session::Role;
using namespace std::chrono_literals;

namespace {
void reply(int fd, const json& j) { (void)transport::send_message(fd, j); }
void reject(int fd, const std::string& code, const std::string& message) { transport::send_reject(fd, code, message); }
}  // namespace

void PathCheck::on_control(UniqueFd fd, const session::Hello& hello, const std::string& nonce,
                           const std::string& proof) {
  std::lock_guard lock(mu_);
  if (!constant_time_equal(proof, transport::control_proof(token_, nonce, spec_.id, hello.nonce))) {
    ctx_.metrics.transport_error(hello.transport, "auth");
    reject(fd.get(), "permission_denied", session::kHelloRefused);
    return;
  }
  if (finished_ || cancelled_) return reject(fd.get(), "not_found", "path check " + spec_.id + " is over");
  if (token_used_) return reject(fd.get(), "already_exists", "path check " + spec_.id + " already has a source");
  if (hello.tls != ctx_.config.data_plane.tls) {
    return reject(fd.get(), "tls_mismatch", transport::tls_mismatch(hello.tls, ctx_.config.data_plane.tls));
  }
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
    auto offered = session::parse_wire_transport(hello.transport, "hello.transport");
    auto choice = offered ? session::choose_transport(session::TransportOffer{offered.value(), hello.transport_required},
                                                        spec_.transport, ctx_.rdma,
                                                        session::rail_mtus(hello, ctx_.rdma, spec_.channels))
                          : Result<session::TransportChoice>(offered.error());
    if (choice) {
      chosen = session::wire_name(choice->transport);
      reason = choice->reason;
      if (!choice->detail.empty()) {
        LOG_WARN("pathcheck") << log_prefix() << " transport tcp: " << choice->detail;
      }
    } else {
      mismatch = choice.error().message;
    }
  }
  if (!mismatch.empty()) return reject(fd.get(), "invalid_argument", mismatch);
  token_used_ = true;
  session_ = random_hex(16);  // names the session; its channels prove channel_key_
  channel_key_ = transport::channel_key(token_, hello.nonce, nonce, session_);
  status_.transport = chosen;
  status_.transport_reason = reason;
  json welcome = session::message(session::MessageKind::kWelcome, json{{"session", session_}, {"transport", chosen}, {"transportReason", reason}});
  if (hello.tls) welcome["tls"] = true;
  if (chosen == "rdma") {
    session::add_rails_to_welcome(welcome, ctx_.rdma);
    status_.rails = check_rails(session::rails_from_hello(hello, ctx_.rdma), spec_.channels);
  }
  reply(fd.get(), welcome);
  control_fd_ = std::move(fd);
  cv_.notify_all();
}

Result<transport::ChannelTerms> PathCheck::channel_terms(const std::string& session, uint32_t index) const {
  std::lock_guard lock(mu_);
  if (!token_used_ || status_.transport != "tcp" || !constant_time_equal(session, session_) || finished_) {
    return Error{Errc::kPermissionDenied, session::kHelloRefused};
  }
  return transport::ChannelTerms{channel_key_, session_, index};
}

void PathCheck::on_data(UniqueFd fd, const session::Hello& hello, const std::string& welcome_proof) {
  const bool tls = ctx_.config.data_plane.tls;
  transport::ChannelTerms terms;
  {
    std::lock_guard lock(mu_);
    if (!token_used_ || status_.transport != "tcp" || !constant_time_equal(hello.session, session_) || finished_) {
      return reject(fd.get(), "permission_denied", session::kHelloRefused);
    }
    if (hello.tls != tls) return reject(fd.get(), "tls_mismatch", transport::tls_mismatch(hello.tls, tls));
    if (hello.index >= data_fds_.size() || data_fds_[hello.index].valid() || data_admitting_.count(hello.index)) {
      return reject(fd.get(), "invalid_argument", "hello.index: channel " + std::to_string(hello.index) +
                                                      " is out of range or already connected");
    }
    reply(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}}));
    if (!tls) {
      data_fds_[hello.index] = std::move(fd);
      ++data_received_;
      cv_.notify_all();
      return;
    }
    data_admitting_.insert(hello.index);  // the index stays taken while the handshake runs unlocked
    terms = transport::ChannelTerms{channel_key_, session_, hello.index};
  }
  auto stream = transport::TlsStream::handshake(fd.get(), transport::TlsStream::Role::kAcceptor, terms,
                                                session::kHelloTimeout);
  std::lock_guard lock(mu_);
  data_admitting_.erase(hello.index);
  if (!stream) {
    ctx_.metrics.transport_error("tcp", "tls");
    LOG_WARN("pathcheck") << log_prefix() << " data channel " << hello.index << ": " << stream.error().message;
    return;
  }
  if (hello.index >= data_fds_.size() || data_fds_[hello.index].valid() || finished_) return;
  status_.encryption = std::string("tls (") + stream.value()->mode() + ")";
  ctx_.metrics.tls_channel(stream.value()->label());
  data_fds_[hello.index] = std::move(fd);
  data_tls_[hello.index] = std::move(stream.value());
  ++data_received_;
  cv_.notify_all();
}

Result<transport::rdma::AcceptPlan> PathCheck::rdma_plan(const transport::rdma::ConnectRequest& request) {
  std::lock_guard lock(mu_);
  const std::string session = to_hex(request.session.data(), request.session.size());
  const uint32_t index = request.index;
  if (!token_used_ || status_.transport != "rdma" || !constant_time_equal(session, session_) || finished_) {
    return Error{Errc::kPermissionDenied, "unknown session"};
  }
  // The proof first: a request that does not prove the key takes no index.
  if (auto st = transport::rdma::check_request(request, channel_key_, rdma_proofs_); !st) {
    ctx_.metrics.transport_error("rdma", "auth");
    return st.error();
  }
  if (index >= rdma_channels_.size() || rdma_channels_[index]) {
    return Error{Errc::kInvalidArgument, "channel " + std::to_string(index) + " out of range or already connected"};
  }
  transport::rdma::AcceptPlan plan;
  plan.key = channel_key_;
  plan.params = transport::rdma::RdmaChannelParams{index, session::return_path_chunk(spec_.chunk_size),
                                                   session::return_path_depth(spec_.ring_depth),
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
                                                        spec_.ring_depth, tm, ctx_.config.tcp.splice,
                                                        std::move(data_tls_[i])));
    }
  }
  link_ = std::make_unique<session::ControlLink>(std::move(control_fd_));
  return ok_status();
}

Status PathCheck::run_target() {
  RDMIG_TRY(wait_for_source());
  auto start = link_->expect(session::to_string(session::MessageKind::kStart), remaining());
  if (!start) return cancel_or(start.error().with_context("waiting for the source agent's start"));
  const uint64_t seed = start->value("seed", uint64_t{0});
  const uint64_t bytes = start->value("bytes", uint64_t{0});
  if (bytes != spec_.bytes) {
    const Error e{Errc::kInvalidArgument, "start.bytes: source sends " + std::to_string(bytes) + ", target expects " +
                                              std::to_string(spec_.bytes)};
    (void)link_->send(session::message(session::MessageKind::kAbort, json{{"reason", e.message}}));
    return e;
  }
  json ready = session::message(session::MessageKind::kReady);
  if (const auto st = status(); st.transport == "rdma") {
    ready["rdma"] = RdmaEnd::of(ctx_.rdma).to_json();
    ready["rails"] = rails_to_ready(st.rails);
  }
  RDMIG_TRY(link_->send(ready));
  // Answer the source's round trips until it starts the stream.
  for (;;) {
    auto msg = link_->next(remaining());
    if (!msg) return cancel_or(msg.error().with_context("control connection to the source agent"));
    if (!msg->has_value()) return Error{Errc::kTimeout, "the source agent never started the stream"};
    const auto type = session::kind_of(**msg);
    if (type == session::MessageKind::kPing) {
      RDMIG_TRY(link_->send(session::message(session::MessageKind::kPong, json{{"seq", (*msg)->value("seq", 0)}})));
    } else if (type == session::MessageKind::kStream) {
      break;
    } else if (type == session::MessageKind::kAbort) {
      return cancel_or(Error{Errc::kCancelled, (*msg)->value("reason", std::string("the source agent aborted"))});
    }
  }
  set_phase(Phase::kMigrating);
  const auto t0 = std::chrono::steady_clock::now();
  auto received = run_channels([&](transport::Channel& ch, uint32_t i) {
    return receive_stream(ch, channel_seed(seed, i), channel_bytes(spec_.bytes, spec_.channels, i), bytes_done_,
                          channel_chunks_[i]);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!received) {
    // A source that cancelled says so on the control link as its channels break: that, not
    // the broken channel, is the cause.
    auto why = link_->expect(session::to_string(session::MessageKind::kGoodbye), std::min<std::chrono::milliseconds>(remaining(), 500ms));
    if (!why && why.error().code == Errc::kCancelled) return why.error();
  }
  json verdict = session::message(session::MessageKind::kResult, json{{"ok", received.ok()}, {"bytesVerified", bytes_done_.load()}});
  if (!received) verdict["error"] = received.error().message;
  (void)link_->send(verdict);
  if (!received) return received.error();
  update([&](CheckStatus& s) {
    s.throughput_bytes_per_second = secs > 0 ? static_cast<double>(spec_.bytes) / secs : 0;
  });
  // The source's goodbye (or its hang-up) ends the check.
  (void)link_->expect(session::to_string(session::MessageKind::kGoodbye), std::min<std::chrono::milliseconds>(remaining(), 5s));
  return ok_status();
}

}  // namespace rdmig::pathcheck
