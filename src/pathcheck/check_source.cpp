// The source end of a path check: connect, round trips, the stream, the target's verdict.
#include "pathcheck/check.h"

#include <algorithm>

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "pathcheck/pattern.h"
#include "pathcheck/stream.h"
#include "session/transport_choice.h"
#include "session/types.h"
#include "transport/channel_proof.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/tcp/tcp_channel.h"
#include "session/protocol.h"

namespace rdmig::pathcheck {

using nlohmann::json;
using session::Phase;
using session::Role;
using namespace std::chrono_literals;

Status PathCheck::connect_source() {
  auto offer = session::offer_transport(spec_.transport, ctx_.rdma);
  if (!offer) return offer.error();
  session::Hello hello;
  hello.kind = session::HelloKind::kPathcheckControl;  // a migration's control fields, another registry
  hello.migration_id = spec_.target.migration_id;
  hello.channels = spec_.channels;
  hello.chunk_size = spec_.chunk_size;
  hello.ring_depth = spec_.ring_depth;
  hello.transport = session::wire_name(offer->transport);
  hello.transport_required = offer->required;
  if (offer->transport == TransportKind::kRdma) {
    hello.rdma_mtu = ctx_.rdma.mtu;
    hello.rdma_rails = session::rail_addresses(ctx_.rdma);
  }

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
  const auto step = [&] { return std::min<std::chrono::milliseconds>(remaining(), session::kHandshakeTimeout); };
  // The endpoint a REST client named: the dial policy stands here too, not only on the request.
  auto fd = peer_dial_policy(ctx_.config.data_plane)
                .connect(ep, "target.endpoint", std::min<std::chrono::milliseconds>(remaining(), 10s), watch);
  if (!fd) {
    unwatch();
    return cancel_or(fd.error().with_context("target agent data plane " + ep.to_string()));
  }
  hello.nonce = random_hex(16);  // this side's half of the channel key
  hello.tls = ctx_.config.data_plane.tls;
  RDMIG_TRY(transport::send_message(fd->get(), hello.to_json()));
  auto challenge = transport::recv_message(fd->get(), step());
  if (!challenge || !session::is(*challenge, session::MessageKind::kChallenge)) {
    unwatch();
    if (!challenge) return cancel_or(challenge.error().with_context("hello to target agent " + ep.to_string()));
    return Error{Errc::kProtocol, "target agent " + ep.to_string() + " refused the check: " +
                                      challenge->value("message", std::string("no challenge"))};
  }
  auto nonce = transport::get_string(challenge.value(), "nonce", session::to_string(session::MessageKind::kChallenge), 64);
  if (!nonce) return nonce.error().with_context("target agent " + ep.to_string());
  RDMIG_TRY(transport::send_message(
      fd->get(), session::message(session::MessageKind::kAuth, json{{"proof", transport::control_proof(spec_.target.token, nonce.value(), spec_.target.migration_id,
                                                         hello.nonce)}})));
  auto reply = transport::recv_message(fd->get(), step());
  unwatch();
  if (!reply) return cancel_or(reply.error().with_context("hello to target agent " + ep.to_string()));
  if (session::is(*reply, session::MessageKind::kReject)) {
    ctx_.metrics.transport_error(hello.transport, "handshake_rejected");
    return Error{reply->value("code", "") == "tls_mismatch" ? Errc::kFailedPrecondition : Errc::kPermissionDenied,
                 "target agent " + ep.to_string() + " refused the check: " + reply->value("message", std::string("?"))};
  }
  const auto tls_confirmed = reply->find("tls");
  if (hello.tls && (tls_confirmed == reply->end() || !tls_confirmed->is_boolean() || !tls_confirmed->get<bool>())) {
    return Error{Errc::kFailedPrecondition, "target agent " + ep.to_string() + " did not confirm dataPlane.tls (an rdmig "
                                            "agent from before it?): upgrade it; no channel is carried in clear instead"};
  }
  auto session = transport::get_string(reply.value(), "session", session::to_string(session::MessageKind::kWelcome), 128);
  auto chosen = transport::get_string(reply.value(), "transport", session::to_string(session::MessageKind::kWelcome), 16);
  if (!session::is(*reply, session::MessageKind::kWelcome) || !session || !chosen ||
      (chosen.value() != "tcp" && chosen.value() != "rdma")) {
    return Error{Errc::kProtocol, "target agent sent no valid welcome"};
  }
  session_ = session.value();
  channel_key_ = transport::channel_key(spec_.target.token, hello.nonce, nonce.value(), session_);
  const std::string transport = chosen.value();
  std::string reason = reply->value("transportReason", std::string());
  if (reason.empty()) reason = spec_.transport == TransportKind::kAuto ? "auto" : "requested";
  if (reason == "auto-no-source-rdma" || reason == "auto-no-local-rdma") reason = session::with_rdma_reason(reason, ctx_.rdma);
  update([&](CheckStatus& s) {
    s.transport = transport;
    s.transport_reason = reason;
    if (transport == "rdma") s.local_rdma = RdmaEnd::of(ctx_.rdma);
  });
  LOG_INFO("pathcheck") << log_prefix() << " transport=" << transport << " reason=" << reason;

  std::vector<session::RailPair> rails;
  if (transport == "rdma") {
    auto matched = session::rails_from_welcome(reply.value(), ctx_.rdma, peer_dial_policy(ctx_.config.data_plane));
    if (!matched) return matched.error();
    rails = std::move(matched.value());
    update([&](CheckStatus& s) { s.rails = check_rails(rails, spec_.channels); });
  }
  auto& tm = ctx_.metrics.transport(transport, "pathcheck");
  for (uint32_t i = 0; i < spec_.channels; ++i) {
    std::unique_ptr<transport::Channel> ch;
    if (transport == "rdma") {
      auto id = transport::rdma::session_from_hex(session_);
      if (!id) return id.error();
      transport::rdma::RdmaChannelParams p{i, static_cast<uint32_t>(spec_.chunk_size), spec_.ring_depth,
                                           session::return_path_chunk(spec_.chunk_size),
                                           session::return_path_depth(spec_.ring_depth)};
      // rdma.connectTimeoutSeconds bounds a check's RDMA connect as it bounds a migration's (it was a
      // fixed 15 s here: a check over a broken fabric ignored the operator's shorter bound).
      const std::chrono::milliseconds connect_bound = std::chrono::seconds(ctx_.config.rdma.connect_timeout_seconds);
      auto c = session::connect_on_rail(rails, transport::rdma::ChannelCredentials{id.value(), channel_key_}, p, tm,
                                          std::min(remaining(), connect_bound), [this] {
                                            std::lock_guard lock(mu_);
                                            return cancelled_;
                                          });
      if (!c) {
        ctx_.metrics.transport_error("rdma", "connect");
        return cancel_or(c.error());
      }
      ch = std::move(c.value());
    } else {
      auto dfd = net::tcp_connect(ep, std::min<std::chrono::milliseconds>(remaining(), 10s), watch);
      if (!dfd) {
        unwatch();
        return cancel_or(dfd.error().with_context("data channel " + std::to_string(i)));
      }
      const auto dh = session::channel_hello(session::HelloKind::kPathcheckData, spec_.target.migration_id, session_,
                                             i, ctx_.config.data_plane.tls, false);
      auto proved = transport::prove_channel(dfd->get(), dh.to_json(), transport::ChannelTerms{channel_key_, session_, i}, step());
      unwatch();
      if (!proved) return cancel_or(proved.error().with_context("data channel " + std::to_string(i)));
      std::unique_ptr<transport::TlsStream> tls;
      if (dh.tls) {
        auto stream = transport::TlsStream::handshake(dfd->get(), transport::TlsStream::Role::kDialler,
                                                      transport::ChannelTerms{channel_key_, session_, i}, step());
        if (!stream) {
          ctx_.metrics.transport_error("tcp", "tls");
          return cancel_or(stream.error().with_context("data channel " + std::to_string(i)));
        }
        tls = std::move(stream.value());
        ctx_.metrics.tls_channel(tls->label());
        const std::string mode = std::string("tls (") + tls->mode() + ")";
        update([&](CheckStatus& s) { s.encryption = mode; });
      }
      ch = transport::TcpChannel::create(std::move(dfd.value()), i, static_cast<uint32_t>(spec_.chunk_size),
                                         spec_.ring_depth, tm, ctx_.config.tcp.splice, std::move(tls));
    }
    std::lock_guard lock(mu_);
    if (cancelled_) return Error{Errc::kCancelled, cancel_reason_};
    channels_.push_back(std::move(ch));
  }
  std::lock_guard lock(mu_);
  if (cancelled_) return Error{Errc::kCancelled, cancel_reason_};
  link_ = std::make_unique<session::ControlLink>(std::move(fd.value()));
  return ok_status();
}

Status PathCheck::run_source() {
  set_phase(Phase::kConnecting);
  RDMIG_TRY(connect_source());
  json start = session::message(session::MessageKind::kStart, json{{"seed", seed_}, {"bytes", spec_.bytes}});
  RDMIG_TRY(link_->send(start));
  auto ready = link_->expect(session::to_string(session::MessageKind::kReady), remaining());
  if (!ready) return cancel_or(ready.error().with_context("waiting for the target agent's ready"));
  if (auto it = ready->find("rdma"); it != ready->end()) {
    auto end = RdmaEnd::parse(*it);
    update([&](CheckStatus& s) {
      s.peer_rdma = end;
      peer_rails_from_ready(ready.value(), s.rails);
    });
  }
  // Round trips on the control link, before the stream loads the path.
  std::vector<int64_t> rtts;
  for (uint32_t i = 0; i < ctx_.config.path_check.rtt_samples; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    RDMIG_TRY(link_->send(session::message(session::MessageKind::kPing, json{{"seq", i}})));
    auto pong = link_->expect(session::to_string(session::MessageKind::kPong), remaining());
    if (!pong) return cancel_or(pong.error().with_context("round trip " + std::to_string(i)));
    rtts.push_back(std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(rtts.begin(), rtts.end());
  LOG_INFO("pathcheck") << log_prefix() << " rtt_us=" << rtts[rtts.size() / 2] << " rtt_samples=" << rtts.size();
  update([&](CheckStatus& s) {
    s.rtt_us = rtts[rtts.size() / 2];
    s.phase = Phase::kMigrating;
  });
  RDMIG_TRY(link_->send(session::message(session::MessageKind::kStream)));
  const auto t0 = std::chrono::steady_clock::now();
  auto sent = run_channels([this](transport::Channel& ch, uint32_t i) {
    return send_stream(ch, channel_seed(seed_, i), channel_bytes(spec_.bytes, spec_.channels, i), bytes_done_,
                       channel_chunks_[i]);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The target's verdict names the cause when it stopped the stream (a corrupted byte); after
  // a local failure it is awaited only briefly.
  auto verdict = link_->expect(session::to_string(session::MessageKind::kResult), sent ? remaining() : std::min<std::chrono::milliseconds>(remaining(), 5s));
  if (!sent) {
    if (verdict && !verdict->value("ok", false)) {
      return Error{Errc::kProtocol, "target agent: " + verdict->value("error", std::string("?"))};
    }
    return sent.error();
  }
  if (!verdict) return cancel_or(verdict.error().with_context("waiting for the target agent's verdict"));
  (void)link_->send(session::message(session::MessageKind::kGoodbye));
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

}  // namespace rdmig::pathcheck
