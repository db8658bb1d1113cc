// The source job's session handshake (docs/protocol.md, "Migration and path check"): the control
// connection (hello, challenge, proof, welcome, the transport's choice), the data channels over
// TCP or RDMA, and the re-dials of a session that fails over. Split from source_job.cpp along
// that seam; the job's run, monitor, completion and failure handling stay there. Runs on the
// job's worker thread (connect_data_plane, connect_rdma_channels) and on the failover
// channels' redial threads (redial, redial_control), as the job's header says.
#include "migration/source_job.h"

#include <sys/socket.h>

#include <algorithm>

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "session/protocol.h"
#include "session/rail_failover.h"
#include "session/resume.h"
#include "session/transport_choice.h"
#include "transport/channel_proof.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/wire.h"

namespace rdmig::migration {

// The session layer (src/session) this file stands on.
using session::connect_on_rail;
using session::ControlLink;
using session::kHandshakeTimeout;
using session::kPeerRdmaUnreachable;
using session::offer_transport;
using session::rail_addresses;
using session::rails_from_welcome;
using session::return_path_chunk;
using session::return_path_depth;
using session::wall_clock_us;
using session::wire_name;
using session::with_rdma_reason;

using nlohmann::json;
using namespace std::chrono_literals;

Status SourceJob::connect_data_plane() {
  // What to offer: RDMA when this agent has a device (required when the spec says rdma).
  auto offer = offer_transport(spec_.transport, ctx_.rdma);
  if (!offer) return offer.error();
  const bool local_rdma = ctx_.rdma.available;
  session::Hello hello;
  hello.transport = wire_name(offer->transport);
  hello.transport_required = offer->required;
  if (offer->transport == TransportKind::kRdma) {
    hello.rdma_mtu = ctx_.rdma.mtu;
    hello.rdma_rails = rail_addresses(ctx_.rdma);
  }

  const net::Endpoint ep{spec_.target.host, spec_.target.port};
  // Every blocking step below watches its socket: a cancel shuts it down and the step ends.
  std::optional<CancelWatch> watch;
  auto watched = [&](int sfd) {
    watch.reset();
    watch.emplace(*this, sfd);
    return ok_status();
  };
  // The endpoint a REST client named: the dial policy stands here too, not only on the request.
  auto fd = peer_dial_policy(ctx_.config.data_plane).connect(ep, "target.endpoint", 10s, watched);
  if (!fd) return cancel_or(fd.error().with_context("target agent data plane " + ep.to_string()));
  hello.kind = session::HelloKind::kControl;
  hello.migration_id = spec_.target.migration_id;
  hello.channels = spec_.channels();
  hello.chunk_size = spec_.chunk_size;
  hello.ring_depth = spec_.ring_depth;
  hello.verify_chunks = spec_.verify_chunks;
  hello.post_copy_preempt = spec_.post_copy.preempt;
  hello.tls = ctx_.config.data_plane.tls;
  // Failover re-dials a channel over another rail or TCP (docs/failover.md): over TCP not when
  // RDMA is required, so with RDMA required only when another rail may take it.
  const bool rdma_required = offer->transport == TransportKind::kRdma && offer->required;
  const auto& dp = ctx_.config.data_plane;
  hello.failover = dp.failover && (!rdma_required || dp.fails_over_to("rail"));
  hello.nonce = random_hex(16);  // this side's half of the channel key
  RDMIG_TRY(transport::send_message(fd->get(), hello.to_json()));
  // The target challenges; the answer proves the one-time token without sending it.
  auto challenge = transport::recv_message(fd->get(), kHandshakeTimeout);
  if (!challenge) return cancel_or(challenge.error().with_context("hello to target agent " + ep.to_string()));
  std::string target_nonce;
  if (session::is(*challenge, session::MessageKind::kChallenge)) {
    auto nonce = transport::get_string(challenge.value(), "nonce", session::to_string(session::MessageKind::kChallenge), 64);
    if (!nonce) return nonce.error().with_context("target agent " + ep.to_string());
    target_nonce = nonce.value();
    RDMIG_TRY(transport::send_message(
        fd->get(), session::message(session::MessageKind::kAuth, json{{"proof", transport::control_proof(spec_.target.token, target_nonce, spec_.target.migration_id,
                                                           hello.nonce)}})));
  }
  auto reply = session::is(*challenge, session::MessageKind::kChallenge) ? transport::recv_message(fd->get(), kHandshakeTimeout)
                                                           : Result<json>(challenge.value());
  if (!reply) return cancel_or(reply.error().with_context("hello to target agent " + ep.to_string()));
  const auto type = session::kind_of(*reply);
  if (type == session::MessageKind::kReject) {
    ctx_.metrics.transport_error(hello.transport, "handshake_rejected");
    if (reply->value("code", "") == "tls_mismatch") {
      return Error{Errc::kFailedPrecondition,
                   "target agent " + ep.to_string() + " refused the migration: " + reply->value("message", std::string("?"))};
    }
    return Error{Errc::kPermissionDenied,
                 "target agent " + ep.to_string() + " refused the migration: " + reply->value("message", std::string("?"))};
  }
  auto session = transport::get_string(reply.value(), "session", session::to_string(session::MessageKind::kWelcome), 128);
  auto chosen = transport::get_string(reply.value(), "transport", session::to_string(session::MessageKind::kWelcome), 16);
  if (type != session::MessageKind::kWelcome || !session || !chosen || (chosen.value() != "tcp" && chosen.value() != "rdma")) {
    return Error{Errc::kProtocol, "target agent sent no valid welcome"};
  }
  // The chunks' framing must be the same on both ends: an agent that does not know
  // verifyChunks ignores the field and would pass the CRC trailers on to its QEMU as data.
  const auto confirmed = reply->find("verifyChunks");
  if (spec_.verify_chunks && (confirmed == reply->end() || !confirmed->is_boolean() || !confirmed->get<bool>())) {
    return Error{Errc::kFailedPrecondition, "target agent " + ep.to_string() +
                                                " did not confirm verifyChunks (an rdmig agent from before it?): "
                                                "upgrade it, or migrate without verifyChunks"};
  }
  const auto tls_confirmed = reply->find("tls");
  if (hello.tls && (tls_confirmed == reply->end() || !tls_confirmed->is_boolean() || !tls_confirmed->get<bool>())) {
    return Error{Errc::kFailedPrecondition, "target agent " + ep.to_string() + " did not confirm dataPlane.tls (an rdmig "
                                            "agent from before it?): upgrade it; no channel is carried in clear instead"};
  }
  session_ = session.value();
  channel_key_ = transport::channel_key(spec_.target.token, hello.nonce, target_nonce, session_);
  transport_ = chosen.value();
  // Failover when the target confirms it (an agent without it, or with it off, says nothing).
  failover_ = hello.failover && session::says(reply.value(), "failover");
  // Another rail when the target takes a channel's re-dial over RDMA (an agent from before rail
  // failover does not say so) and this agent's paths list it; TCP unless RDMA is required.
  failover_rails_ = failover_ && chosen.value() == "rdma" && dp.fails_over_to("rail") &&
                    session::says(reply.value(), "failoverRails");
  // Another address of a rail's device likewise, when the target says failoverAddresses (it lists
  // its alternates in the welcome's rails; connect_rdma_channels matches them with this agent's).
  failover_addresses_ = failover_ && chosen.value() == "rdma" && dp.fails_over_to("address") &&
                        session::has_alternates(ctx_.rdma) && session::says(reply.value(), "failoverAddresses");
  failover_tcp_ = failover_ && !rdma_required && dp.fails_over_to("tcp");
  if (!failover_rails_ && !failover_addresses_ && !failover_tcp_) failover_ = false;  // no path to fail over to
  failover_peer_ = spec_.target.host;
  std::string reason = reply->value("transportReason", std::string());
  if (reason.empty()) {
    reason = spec_.transport == TransportKind::kAuto ? (local_rdma ? "auto" : "auto-no-local-rdma") : "requested";
  }
  // The target cannot know why this agent offered TCP: name it (auto-no-source-rdma:no-device).
  if (reason == "auto-no-source-rdma" || reason == "auto-no-local-rdma") reason = with_rdma_reason(reason, ctx_.rdma);

  if (transport_ == "rdma") {
    auto st = connect_rdma_channels(reply.value());
    if (!st) {
      if (cancel_requested()) return Error{Errc::kCancelled, cancel_reason()};
      ctx_.metrics.transport_error("rdma", "connect");
      MutexLock lock(data_mu_);
      channels_.clear();
    }
    // Only a choice made automatically is undone automatically.
    if (!st && reason != "auto-both-rdma") {
      const std::string why = "the target agent's RDMA is unreachable from here (" + std::string(kPeerRdmaUnreachable) +
                              ") and transport: rdma is required, so no fallback to TCP: " + st.error().message;
      (void)transport::send_message(fd->get(), session::message(session::MessageKind::kAbort, json{{"reason", why}}));
      return Error{st.error().code, why};
    }
    if (!st) {
      // Before QEMU is touched: tell the target, then carry every channel over TCP.
      LOG_WARN("migration") << log_prefix() << " " << st.error().message << ": falling back to TCP ("
                            << kPeerRdmaUnreachable << ")";
      RDMIG_TRY(transport::send_message(
          fd->get(), session::message(session::MessageKind::kFallback, json{{"transport", "tcp"}, {"error", st.error().message}})));
      auto ok = transport::recv_message(fd->get(), kHandshakeTimeout);
      if (!ok) return cancel_or(ok.error().with_context("falling back to TCP with target agent " + ep.to_string()));
      if (!session::is(*ok, session::MessageKind::kFallbackOk)) {
        return Error{Errc::kUnavailable, "the target agent's RDMA is unreachable from here (" + st.error().message +
                                             ") and the target refused to fall back to TCP: " +
                                             ok->value("message", std::string("?"))};
      }
      transport_ = "tcp";
      reason = kPeerRdmaUnreachable;
      failover_rails_ = failover_addresses_ = false;  // no channel runs over a rail
      if (!failover_tcp_) failover_ = false;
    }
  }
  ctx_.metrics.transport_selected(transport_, reason);
  LOG_INFO("migration") << log_prefix() << " transport=" << transport_ << " reason=" << reason;
  update([&](MigrationStatus& s) {
    s.transport = transport_;
    s.transport_reason = reason;
  });

  auto& tm = ctx_.metrics.transport(transport_);
  if (transport_ == "rdma") {
    // connected above
  } else {
    std::optional<CancelWatch> dwatch;
    for (uint32_t i = 0; i < spec_.channels(); ++i) {
      auto dfd = net::tcp_connect(ep, 10s, [&](int sfd) {
        dwatch.reset();
        dwatch.emplace(*this, sfd);
        return ok_status();
      });
      if (!dfd) return cancel_or(dfd.error().with_context("data channel " + std::to_string(i)));
      const session::Hello dh = data_hello(i, /*resume=*/false);
      const transport::ChannelTerms terms{channel_key_, session_, i};
      // The channel proves the session's key over the target's fresh nonce, and the target
      // proves it back in its welcome.
      auto proved = transport::prove_channel(dfd->get(), dh.to_json(), terms, kHandshakeTimeout);
      if (!proved) return cancel_or(proved.error().with_context("data channel " + std::to_string(i)));
      std::unique_ptr<transport::TlsStream> tls;
      if (dh.tls) {
        auto stream = channel_tls(dfd->get(), transport::TlsStream::Role::kDialler, terms, kHandshakeTimeout);
        if (!stream) return cancel_or(stream.error().with_context("data channel " + std::to_string(i)));
        tls = std::move(stream.value());
        report_tls(i, *tls);
      }
      dwatch.reset();
      MutexLock lock(data_mu_);
      channels_.push_back(transport::TcpChannel::create(std::move(dfd.value()), i,
                                                        static_cast<uint32_t>(spec_.chunk_size),
                                                        spec_.ring_depth, tm, ctx_.config.tcp.splice, std::move(tls)));
    }
  }
  if (failover_) {
    // Over TCP or RDMA, a channel whose link fails is re-dialled over TCP.
    wrap_for_failover([this](uint32_t index) -> session::FailoverChannel::Reconnect {
      return [this, index](uint64_t taken, const Error&, std::chrono::steady_clock::time_point deadline,
                           const std::function<bool()>&) { return redial(index, taken, deadline); };
    });
  }
  {
    MutexLock lock(data_mu_);
    link_ = std::make_unique<ControlLink>(std::move(fd.value()));
    if (failover_) {
      link_->fail_over_with(
          [this](uint64_t received, std::chrono::steady_clock::time_point deadline, const std::function<bool()>&) {
            return redial_control(received, deadline);
          },
          std::chrono::seconds(ctx_.config.data_plane.failover_deadline_seconds),
          [this](const std::string& why, std::chrono::milliseconds took, uint64_t resent) {
            on_control_failover(why, took, resent);
          });
    }
  }
  // 'start' and 'ready' also measure the two hosts' clock offset (the switchover compares the
  // source QEMU's STOP with the target QEMU's RESUME, each stamped by its own host).
  const int64_t t0 = wall_clock_us();
  json start{{"clockUs", t0}};
  const bool post_copy = spec_.post_copy.mode != PostCopyMode::kNever;
  if (post_copy) {
    start["postCopy"] = true;  // the target enables postcopy-ram on its QEMU too
    start[session::kPostcopySwitchAgreementField] = true;  // and this end asks before it switches
    if (spec_.post_copy.preempt) start["postCopyPreempt"] = true;  // and postcopy-preempt
  }
  RDMIG_TRY(link_->send(session::message(session::MessageKind::kStart, start)));
  auto ready = link_->expect(session::to_string(session::MessageKind::kReady), kHandshakeTimeout);
  const int64_t t3 = wall_clock_us();
  watch.reset();
  if (!ready) return cancel_or(ready.error().with_context("waiting for the target QEMU to listen"));
  const auto stamp = [&](const char* key) {
    auto it = ready->find(key);
    return it != ready->end() && it->is_number_integer() ? it->get<int64_t>() : int64_t{0};
  };
  clock_ = estimate_clock_offset(t0, stamp("receivedClockUs"), stamp("clockUs"), t3);
  if (post_copy) {
    // An agent from before postCopy ignores the field: its QEMU would refuse the switch late.
    const auto pc = ready->find("postCopy");
    if (pc == ready->end() || !pc->is_boolean() || !pc->get<bool>()) {
      return Error{Errc::kFailedPrecondition, "target agent " + ep.to_string() +
                                                  " did not confirm postCopy (an rdmig agent from before it?): "
                                                  "upgrade it, or migrate with postCopy 'never'"};
    }
    if (spec_.post_copy.preempt && !session::says(ready.value(), "postCopyPreempt")) {
      return Error{Errc::kFailedPrecondition, "target agent " + ep.to_string() +
                                                  " did not confirm postCopyPreempt: upgrade it, or migrate with "
                                                  "postCopyPreempt false"};
    }
    target_agrees_ = session::offers_postcopy_switch_agreement(ready.value());
  }
  if (clock_) {
    LOG_DEBUG("migration") << log_prefix() << " target clock offset " << clock_->offset_us << " us (+/- "
                           << clock_->uncertainty_us << " us)";
  }
  return ok_status();
}

session::Hello SourceJob::data_hello(uint32_t index, bool resume) const {
  return session::channel_hello(session::HelloKind::kData, spec_.target.migration_id, session_, index,
                               ctx_.config.data_plane.tls, resume);
}

Result<session::Resumed> SourceJob::redial(uint32_t index, uint64_t taken, std::chrono::steady_clock::time_point deadline) {
  // A channel that ran over TCP from the start (transport tcp, or a fallback) has no rail.
  std::optional<session::RailSpot> current;
  {
    MutexLock lock(rail_mu_);
    if (index < channel_rail_.size()) current = channel_rail_[index];
  }
  const session::FailoverPaths paths{ctx_.config.data_plane.failover_paths, failover_rails_ ? rail_pairs_.size() : 0,
                                     failover_addresses_ ? session::alternates_per_rail(rail_pairs_)
                                                         : std::vector<size_t>{},
                                     failover_tcp_};
  auto r = session::redial_over_paths(
      index, paths, current, deadline,
      [&](session::RailSpot spot, std::chrono::steady_clock::time_point until) {
        return redial_rail(index, spot, taken, until);
      },
      [&](std::chrono::steady_clock::time_point until) { return redial_tcp(index, taken, until); });
  if (r) {
    MutexLock lock(rail_mu_);
    if (index < channel_rail_.size()) channel_rail_[index] = current;
  }
  return r;
}

Result<session::Resumed> SourceJob::redial_rail(uint32_t index, session::RailSpot spot, uint64_t taken,
                                                std::chrono::steady_clock::time_point deadline) {
  auto id = transport::rdma::session_from_hex(session_);
  if (!id) return id.error();
  const transport::rdma::ChannelCredentials key{id.value(), channel_key_};
  const transport::rdma::RdmaChannelParams p{index, static_cast<uint32_t>(spec_.chunk_size), spec_.ring_depth,
                                             return_path_chunk(spec_.chunk_size), return_path_depth(spec_.ring_depth)};
  const auto& pair = rail_pairs_.at(spot.rail);
  return session::redial_over_rail(spot.address == 0 ? pair : session::on_alternate(pair, spot.address - 1), key, p,
                                   ctx_.metrics.transport("rdma"),
                                   transport::ChannelTerms{channel_key_, session_, index}, taken, deadline,
                                   [this] { return cancel_requested(); });
}

Result<session::Resumed> SourceJob::redial_tcp(uint32_t index, uint64_t taken,
                                               std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  const auto left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(100),
                               duration_cast<milliseconds>(kHandshakeTimeout));
  const net::Endpoint ep{spec_.target.host, spec_.target.port};
  const std::string where = "channel " + std::to_string(index) + " re-dialled to " + ep.to_string();
  // The same endpoint and the same rule as the first dial.
  auto fd = peer_dial_policy(ctx_.config.data_plane).connect(ep, "target.endpoint", left, [](int) { return ok_status(); });
  if (!fd) return fd.error().with_context(where);
  const session::Hello dh = data_hello(index, /*resume=*/true);
  const transport::ChannelTerms terms{channel_key_, session_, index};
  if (auto st = transport::prove_channel(fd->get(), dh.to_json(), terms, left); !st) return st.error().with_context(where);
  auto peer = session::resume_as_dialler(fd->get(), terms, taken, left);
  if (!peer) return peer.error().with_context(where);
  std::unique_ptr<transport::TlsStream> tls;
  if (dh.tls) {
    auto stream = channel_tls(fd->get(), transport::TlsStream::Role::kDialler, terms, left);
    if (!stream) return stream.error().with_context(where);
    tls = std::move(stream.value());
  }
  auto ch = transport::TcpChannel::create(std::move(fd.value()), index, static_cast<uint32_t>(spec_.chunk_size),
                                          spec_.ring_depth, ctx_.metrics.transport("tcp"), ctx_.config.tcp.splice,
                                          std::move(tls));
  return session::Resumed{std::move(ch), peer.value(), "tcp " + ep.to_string()};
}

Result<std::pair<UniqueFd, uint64_t>> SourceJob::redial_control(uint64_t received,
                                                                 std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  const auto left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(100),
                               duration_cast<milliseconds>(kHandshakeTimeout));
  const net::Endpoint ep{spec_.target.host, spec_.target.port};
  const std::string where = "control connection re-dialled to " + ep.to_string();
  auto fd = peer_dial_policy(ctx_.config.data_plane).connect(ep, "target.endpoint", left, [](int) { return ok_status(); });
  if (!fd) return fd.error().with_context(where);
  session::Hello dh = data_hello(0, /*resume=*/true);
  dh.control = true;
  dh.tls = false;  // the control connection runs no TLS
  const transport::ChannelTerms terms{channel_key_, session_, transport::kControlIndex};
  if (auto st = transport::prove_channel(fd->get(), dh.to_json(), terms, left); !st) return st.error().with_context(where);
  auto peer = session::resume_as_dialler(fd->get(), terms, received, left);
  if (!peer) return peer.error().with_context(where);
  return std::make_pair(std::move(fd.value()), peer.value());
}

Status SourceJob::connect_rdma_channels(const json& welcome) {
  auto rails = rails_from_welcome(welcome, ctx_.rdma, peer_dial_policy(ctx_.config.data_plane));
  if (!rails) return rails.error();
  auto id = transport::rdma::session_from_hex(session_);
  if (!id) return id.error();
  const transport::rdma::ChannelCredentials key{id.value(), channel_key_};
  auto& tm = ctx_.metrics.transport("rdma");
  for (uint32_t i = 0; i < spec_.channels(); ++i) {
    transport::rdma::RdmaChannelParams p{i, static_cast<uint32_t>(spec_.chunk_size), spec_.ring_depth,
                                         return_path_chunk(spec_.chunk_size), return_path_depth(spec_.ring_depth)};
    auto ch = connect_on_rail(rails.value(), key, p, tm, std::chrono::seconds(ctx_.config.rdma.connect_timeout_seconds),
                              [this] { return cancel_requested(); });
    if (!ch) return ch.error();
    MutexLock lock(data_mu_);
    channels_.push_back(std::move(ch.value()));
  }
  rail_pairs_ = rails.value();
  {
    MutexLock lock(rail_mu_);
    channel_rail_.clear();
    for (uint32_t i = 0; i < spec_.channels(); ++i) {
      channel_rail_.push_back(session::RailSpot{session::rail_of_channel(i, rail_pairs_.size()), 0});
    }
  }
  set_rails(rails.value());
  return ok_status();
}

}  // namespace rdmig::migration
