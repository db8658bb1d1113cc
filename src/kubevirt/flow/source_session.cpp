#include "common/log.h"
#include "common/units.h"
#include "kubevirt/flow/sessions.h"
#include "session/resume.h"
#include "session/transport_choice.h"
#include "session/types.h"
#include "transport/channel_proof.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/wire.h"
#include "session/protocol.h"
#include "session/rail_failover.h"

namespace rdmig::kubevirt {

using nlohmann::json;
using namespace std::chrono_literals;

namespace {

// This agent's flows as a source: kubevirt.ringDepth, else by migration.chunkSize.
uint32_t flow_depth(const AgentConfig& c) { return flow_ring_depth(c.kubevirt.ring_depth, c.migration.chunk_size); }

// The token (of those this agent accepts) that one of the challenge's proofs proves over `hello`
// and both nonces; empty when none does.
std::string accepted_proof(const SessionContext& ctx, const json& challenge, const session::Hello& hello,
                           const std::string& target_nonce) {
  auto proofs = challenge.find("proofs");
  if (proofs == challenge.end() || !proofs->is_array() || proofs->size() > session::kMaxChallengeProofs) return {};
  std::string token;
  for (const auto& mine : ctx.token->accepted()) {
    const std::string want = flow_proof(mine, "target", hello, target_nonce);
    for (const auto& p : *proofs) {
      if (token.empty() && p.is_string() && constant_time_equal(p.get<std::string>(), want)) token = mine;
    }
  }
  return token;
}

}  // namespace

SourceSession::SourceSession(std::string id, FlowRecord record, const SessionContext& ctx, PeerInfo peer)
    : FlowSession(std::move(id), std::move(record), ctx.metrics), ctx_(ctx), peer_(std::move(peer)) {}

Result<std::unique_ptr<SourceSession>> SourceSession::open(const SessionContext& ctx, const PeerInfo& peer,
                                                           FlowRecord record, std::chrono::milliseconds timeout) {
  auto offer = session::offer_transport(ctx.config.transport, ctx.rdma);
  if (!offer) return offer.error();
  session::Hello hello;
  hello.kind = session::HelloKind::kFlow;
  hello.session = random_hex(16);
  hello.nonce = random_hex(16);
  hello.mode = record.mode;
  hello.vmi = record.vmi;
  hello.migration_uid = record.migration_uid;
  hello.source_node = record.source_node;
  hello.target_node = record.target_node;
  hello.chunk_size = ctx.config.migration.chunk_size;
  hello.ring_depth = flow_depth(ctx.config);
  hello.transport = session::wire_name(offer->transport);
  hello.transport_required = offer->required;
  if (offer->transport == TransportKind::kRdma) hello.rdma_rails = session::rail_addresses(ctx.rdma);
  // Failover re-dials a channel over another rail or TCP (docs/failover.md, as bare-QEMU source
  // jobs do): over TCP not when RDMA is required, so with RDMA required only when another rail may
  // take it.
  const bool rdma_required = offer->transport == TransportKind::kRdma && offer->required;
  const auto& dp = ctx.config.data_plane;
  hello.failover = dp.failover && (!rdma_required || dp.fails_over_to("rail"));

  const std::string where = "peer agent " + peer.node + " (" + peer.agent.to_string() + ")";
  auto fd = net::tcp_connect(peer.agent, timeout);
  if (!fd) return fd.error().with_context(where);
  RDMIG_TRY(transport::send_message(fd->get(), hello.to_json()));
  auto challenge = transport::recv_message(fd->get(), timeout);
  if (!challenge) return challenge.error().with_context(where);
  if (!session::is(*challenge, session::MessageKind::kChallenge)) {
    return Error{Errc::kPermissionDenied, where + " refused the session: " + challenge->value("message", std::string("?"))};
  }
  auto nonce = transport::get_string(challenge.value(), "nonce", session::to_string(session::MessageKind::kChallenge), 64);
  if (!nonce) return nonce.error().with_context(where);
  // The target proves the token first, over this hello and both nonces: an agent (or a relay)
  // without it learns nothing and gets no connection carried. During a rotation each side
  // may hold the new token before the other: any token both accept will do.
  std::string token = accepted_proof(ctx, challenge.value(), hello, nonce.value());
  if (token.empty() && hello.failover) {
    // An agent from before KubeVirt-mode failover reads no "failover" in the hello, so its proofs
    // cover the hello without it: it holds the token but does not offer failover. Named, and
    // declined rather than unhealthy (docs/failover.md, "During a rolling upgrade").
    session::Hello without = hello;
    without.failover = false;
    if (auto found = accepted_proof(ctx, challenge.value(), without, nonce.value()); !found.empty()) {
      ctx.metrics.transport_error(hello.transport, "handshake_rejected");
      return Error{Errc::kFailedPrecondition,
                   where + " does not offer failover: it proved the agents' token over the hello without its "
                           "\"failover\" field, as an agent from before KubeVirt-mode failover does (flow protocol " +
                       std::to_string(kFlowProtocolVersion) +
                       " without failover there, with it here); not carried there. Turn dataPlane.failover off on "
                       "this node until every node runs an agent that has it"};
    }
  }
  if (token.empty()) {
    ctx.metrics.transport_error(hello.transport, "auth");
    return Error{Errc::kPermissionDenied, where + " did not prove the agents' token: not carried there"};
  }
  RDMIG_TRY(transport::send_message(fd->get(), session::message(session::MessageKind::kAuth, json{{"mac", flow_proof(token, "source", hello, nonce.value())}})));
  auto welcome = transport::recv_message(fd->get(), timeout);
  if (!welcome) return welcome.error().with_context(where);
  if (!session::is(*welcome, session::MessageKind::kWelcome)) {
    ctx.metrics.transport_error(hello.transport, "handshake_rejected");
    // failed_precondition: the peer is healthy but does not carry this migration (its API check).
    const bool declined = welcome->value("code", "") == "failed_precondition";
    return Error{declined ? Errc::kFailedPrecondition : Errc::kPermissionDenied,
                 where + " refused the session: " + welcome->value("message", std::string("?"))};
  }
  auto chosen = transport::get_string(welcome.value(), "transport", session::to_string(session::MessageKind::kWelcome), 16);
  if (!chosen) return chosen.error().with_context(where);
  auto kind = session::parse_wire_transport(chosen.value(), "welcome.transport");
  if (!kind) return kind.error().with_context(where);

  record.transport = chosen.value();
  const std::string transport_reason = welcome->value("transportReason", std::string());
  record.transport_reason = transport_reason;
  record.peer = peer.agent.to_string();
  record.phase = "Armed";
  record.carried = true;
  std::unique_ptr<SourceSession> s(new SourceSession(hello.session, std::move(record), ctx, peer));
  s->transport_ = chosen.value();
  s->channel_key_ = flow_channel_key(token, hello, nonce.value());
  // Failover when the target confirms it (an agent with it off says nothing): over another rail
  // when the target takes a channel's re-dial over RDMA (it says failoverRails; an agent from before
  // rail failover in KubeVirt mode does not) and this agent's paths list it; over TCP unless RDMA
  // is required. No path: no failover.
  if (hello.failover && session::says(welcome.value(), "failover")) {
    s->failover_rails_ = chosen.value() == "rdma" && dp.fails_over_to("rail") && session::says(welcome.value(), "failoverRails");
    s->failover_addresses_ = chosen.value() == "rdma" && dp.fails_over_to("address") &&
                             session::has_alternates(ctx.rdma) && session::says(welcome.value(), "failoverAddresses");
    s->failover_tcp_ = !rdma_required && dp.fails_over_to("tcp");
    if (s->failover_rails_ || s->failover_addresses_ || s->failover_tcp_) {
      s->enable_failover(peer.agent.host, std::chrono::seconds(ctx.config.data_plane.failover_deadline_seconds));
    }
  }
  if (s->transport_ == "rdma") {
    // The rails both agents have, matched by index; channel i goes on rail i mod n. None in
    // common: the first channel's connect fails with that and falls back to TCP as an
    // unreachable target does (transport auto), or the session fails naming it.
    auto rails = session::rails_from_welcome(welcome.value(), ctx.rdma, peer_dial_policy(ctx.config.data_plane));
    if (rails) {
      s->set_rails(std::move(rails.value()));
    } else if (rails.error().code == Errc::kUnavailable) {
      s->no_rail_ = rails.error();
    } else {
      return rails.error().with_context(where);
    }
  }
  // An automatic choice of RDMA is counted once it holds: at the first RDMA channel, or as
  // the TCP fallback when rdma_cm cannot reach the target (add_connection).
  if (transport_reason != "auto-both-rdma") ctx.metrics.transport_selected(s->transport_, transport_reason);
  // kubevirt.multifdOnFailure as configured; "auto" drains until the relay learnt the source
  // launcher's QEMU (hook mode; static mode knows no VMI, so no launcher: it keeps draining).
  const std::string& on_failure = ctx.config.kubevirt.multifd_on_failure;
  s->set_multifd_on_failure(on_failure != "reset", on_failure == "auto" ? "qemu unknown" : "config");
  s->set_link(std::make_unique<session::ControlLink>(std::move(fd.value())),
              std::make_unique<FlowSigner>(flow_session_key(token, hello, nonce.value()), "source", "target"),
              std::chrono::seconds(ctx.config.kubevirt.heartbeat_timeout_seconds));
  // The control link fails over too when the target says so (an agent from before it does not).
  if (s->failover() && session::says(welcome.value(), "failoverControl")) {
    s->fail_over_control([p = s.get()](uint64_t received, std::chrono::steady_clock::time_point deadline,
                                       const std::function<bool()>&) { return p->redial_control(received, deadline); });
  }
  s->reader_ = std::thread([p = s.get()] { p->reader_loop(); });
  return s;
}

SourceSession::~SourceSession() {
  close_legs();  // first: a channel's failover re-dials with this session's members
  {
    MutexLock lock(reply_mu_);
    closing_ = true;
  }
  if (link_) link_->close();
  if (reader_.joinable()) reader_.join();
}

Result<std::unique_ptr<transport::Channel>> SourceSession::connect_channel(uint32_t index) {
  auto& tm = ctx_.metrics.transport(transport_);
  const auto chunk = static_cast<uint32_t>(ctx_.config.migration.chunk_size);
  const uint32_t depth = flow_depth(ctx_.config);
  if (transport_ == "rdma") {
    auto id = transport::rdma::session_from_hex(id_);
    if (!id) return id.error();
    transport::rdma::RdmaChannelParams p{index, chunk, depth, session::return_path_chunk(chunk),
                                         session::return_path_depth(depth)};
    // Leave through the rail's device, with its traffic class (as bare-QEMU jobs do).
    if (no_rail_) return *no_rail_;
    auto ch = session::connect_on_rail(rails(), transport::rdma::ChannelCredentials{id.value(), channel_key_}, p, tm,
                                         std::chrono::seconds(ctx_.config.rdma.connect_timeout_seconds), {});
    if (!ch) {
      ctx_.metrics.transport_error("rdma", "connect");
      return ch.error();
    }
    return std::unique_ptr<transport::Channel>(std::move(ch.value()));
  }
  auto fd = net::tcp_connect(peer_.agent, 5s);
  if (!fd) return fd.error();
  // The channel proves the session's key over the target's fresh nonce; the target proves it back.
  const bool tls = ctx_.config.data_plane.tls;
  const transport::ChannelTerms terms{channel_key_, id_, index};
  RDMIG_TRY(transport::prove_channel(fd->get(), flow_data_hello(id_, index, tls, /*resume=*/false).to_json(), terms, 5s));
  std::unique_ptr<transport::TlsStream> stream;
  if (tls) {
    auto made = transport::TlsStream::handshake(fd->get(), transport::TlsStream::Role::kDialler, terms, 5s);
    if (!made) {
      ctx_.metrics.transport_error("tcp", "tls");
      return made.error();
    }
    stream = std::move(made.value());
    note_tls(index, *stream);
  }
  return std::unique_ptr<transport::Channel>(transport::TcpChannel::create(std::move(fd.value()), index, chunk, depth, tm,
                                                                           ctx_.config.tcp.splice, std::move(stream)));
}

Result<session::Resumed> SourceSession::redial(uint32_t index, std::optional<session::RailSpot>& current, uint64_t taken,
                                               std::chrono::steady_clock::time_point deadline,
                                               const std::function<bool()>& stopped) {
  // The paths of dataPlane.failoverPaths, in order, as a bare-QEMU source job tries them.
  const session::FailoverPaths paths{ctx_.config.data_plane.failover_paths, failover_rails_ ? rails().size() : 0,
                                     failover_addresses_ ? session::alternates_per_rail(rails()) : std::vector<size_t>{},
                                     failover_tcp_};
  return session::redial_over_paths(
      index, paths, current, deadline,
      [&](session::RailSpot spot, std::chrono::steady_clock::time_point until) {
        return redial_rail(index, spot, taken, until, stopped);
      },
      [&](std::chrono::steady_clock::time_point until) { return redial_tcp(index, taken, until); });
}

Result<session::Resumed> SourceSession::redial_rail(uint32_t index, session::RailSpot spot, uint64_t taken,
                                                    std::chrono::steady_clock::time_point deadline,
                                                    const std::function<bool()>& stopped) {
  // The same proved connect request as the channel's first connect (the session, the index and a
  // fresh proof of the channel key), from this agent's device on `rail` to the target's endpoint.
  auto id = transport::rdma::session_from_hex(id_);
  if (!id) return id.error();
  const auto chunk = static_cast<uint32_t>(ctx_.config.migration.chunk_size);
  const uint32_t depth = flow_depth(ctx_.config);
  const transport::rdma::RdmaChannelParams p{index, chunk, depth, session::return_path_chunk(chunk),
                                             session::return_path_depth(depth)};
  const auto& pair = rails().at(spot.rail);
  return session::redial_over_rail(spot.address == 0 ? pair : session::on_alternate(pair, spot.address - 1),
                                   transport::rdma::ChannelCredentials{id.value(), channel_key_}, p,
                                   ctx_.metrics.transport("rdma"), transport::ChannelTerms{channel_key_, id_, index},
                                   taken, deadline, stopped);
}

Result<session::Resumed> SourceSession::redial_tcp(uint32_t index, uint64_t taken,
                                                   std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  const auto left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(100),
                               milliseconds(5000));
  const std::string where = "channel " + std::to_string(index) + " re-dialled to " + peer_.agent.to_string();
  // The same endpoint as the first dial; the hello says resume, the proof is the channel's own.
  auto fd = net::tcp_connect(peer_.agent, left);
  if (!fd) return fd.error().with_context(where);
  const bool tls = ctx_.config.data_plane.tls;
  const transport::ChannelTerms terms{channel_key_, id_, index};
  if (auto st = transport::prove_channel(fd->get(), flow_data_hello(id_, index, tls, /*resume=*/true).to_json(), terms, left); !st) {
    return st.error().with_context(where);
  }
  auto peer = session::resume_as_dialler(fd->get(), terms, taken, left);
  if (!peer) return peer.error().with_context(where);
  std::unique_ptr<transport::TlsStream> stream;
  if (tls) {
    auto made = transport::TlsStream::handshake(fd->get(), transport::TlsStream::Role::kDialler, terms, left);
    if (!made) return made.error().with_context(where);
    stream = std::move(made.value());
  }
  auto ch = transport::TcpChannel::create(std::move(fd.value()), index, static_cast<uint32_t>(ctx_.config.migration.chunk_size),
                                          flow_depth(ctx_.config), ctx_.metrics.transport("tcp"), ctx_.config.tcp.splice,
                                          std::move(stream));
  return session::Resumed{std::move(ch), peer.value(), "tcp " + peer_.agent.to_string()};
}

Result<std::pair<UniqueFd, uint64_t>> SourceSession::redial_control(uint64_t received,
                                                                     std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  const auto left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(100),
                               milliseconds(5000));
  const std::string where = "control link re-dialled to " + peer_.agent.to_string();
  // The same endpoint as the session's first connection; the proof is the channel key's, over the
  // control link's own index (no data channel has it); no TLS, as on the first connection (every
  // message on the link is signed).
  auto fd = net::tcp_connect(peer_.agent, left);
  if (!fd) return fd.error().with_context(where);
  const transport::ChannelTerms terms{channel_key_, id_, transport::kControlIndex};
  if (auto st = transport::prove_channel(fd->get(), flow_control_hello(id_).to_json(), terms, left); !st) {
    return st.error().with_context(where);
  }
  auto peer = session::resume_as_dialler(fd->get(), terms, received, left);
  if (!peer) return peer.error().with_context(where);
  return std::make_pair(std::move(fd.value()), peer.value());
}

Status SourceSession::add_connection(UniqueFd fd, const net::Endpoint& destination) {
  // Whatever fails before the pump owns the connection: the proxy sees a RST, not a clean close.
  auto refuse = [&](Error e) {
    arm_reset(fd.get());
    return e;
  };
  if (ended()) return refuse(Error{Errc::kFailedPrecondition, "session " + id_ + " has ended"});
  const uint32_t index = next_index_++;
  if (index >= transport::kMaxChannels) {
    return refuse(Error{Errc::kResourceExhausted, "more than " + std::to_string(transport::kMaxChannels) + " connections"});
  }
  if (auto st = send_signed(session::message(session::MessageKind::kOpen, json{{"index", index}, {"host", destination.host}, {"port", destination.port}}));
      !st) {
    return refuse(st.error().with_context("carrying to the agent on " + peer_.node));
  }
  auto buffers = ctx_.take_buffers(flow_channel_buffers(ctx_.config.migration.chunk_size, flow_depth(ctx_.config), failover()),
                                   "channel " + std::to_string(index) + " to " + peer_.node);
  if (!buffers) return refuse(buffers.error());
  buffers_.push_back(std::move(buffers.value()));
  const bool tried_rdma = transport_ == "rdma";
  auto ch = connect_channel(index);
  if (!ch && tried_rdma) {
    if (auto st = fall_back_to_tcp(ch.error()); !st) {
      return refuse(st.error().with_context("channel " + std::to_string(index) + " to " + peer_.node));
    }
    ch = connect_channel(index);
  }
  if (!ch) return refuse(ch.error().with_context("channel " + std::to_string(index) + " to " + peer_.node));
  if (tried_rdma && !rdma_settled_) {
    rdma_settled_ = true;
    if (record().transport_reason == "auto-both-rdma") ctx_.metrics.transport_selected("rdma", "auto-both-rdma");
  }
  std::unique_ptr<transport::Channel> channel = std::move(ch.value());
  if (failover()) {
    // A channel whose link fails is re-dialled over the paths dataPlane.failoverPaths lists (another
    // rail, TCP) and resumed (docs/failover.md). `on` is the rail it runs over (none: TCP), this
    // channel's own: its failovers run one at a time.
    std::optional<session::RailSpot> on;
    if (std::string_view(channel->transport()) == "rdma" && !rails().empty()) {
      on = session::RailSpot{session::rail_of_channel(index, rails().size()), 0};
    }
    channel = wrap_for_failover(
        std::move(channel), flow_depth(ctx_.config),
        [this, index, on](uint64_t taken, const Error&, std::chrono::steady_clock::time_point deadline,
                          const std::function<bool()>& stopped) mutable {
          return redial(index, on, taken, deadline, stopped);
        });
  }
  auto pump = std::make_unique<session::ChannelPump>(*channel, std::move(fd));
  const int kind = port_class(destination.port);
  bool drains = false;
  if (kind != kBlockPort) {
    bool first_memory = false;
    {
      MutexLock lock(mu_);
      if (record_.main_connection < 0 && record_.main_connection_by.empty()) {
        record_.main_connection = static_cast<int>(index);
        record_.main_connection_by = "order";
        first_memory = true;
      }
      drains = drain_multifd_;
    }
    if (!first_memory && drains) pump->drain_on_failure(kMultifdDrainLimit);
    auto* self = pump.get();  // the callback runs on this pump's own thread
    pump->on_first_bytes([this, index, self](std::span<const std::byte> head) { saw_first_bytes(index, *self, head); });
  }
  pump->start();
  add_leg(std::move(channel), std::move(pump));
  if (drains) {
    // set_multifd_on_failure(false) may have run between the read above and add_leg.
    MutexLock lock(mu_);
    if (!drain_multifd_) {
      lock.unlock();
      with_pump(index, [](session::ChannelPump& p) { p.set_drain_on_failure(false, kMultifdDrainLimit); });
    }
  }
  LOG_DEBUG("kubevirt") << "session=" << id_ << " connection " << index << " to " << destination.to_string()
                        << (kind == kBlockPort ? " (block)" : " (memory)") << " carried over " << transport_;
  return ok_status();
}

Status SourceSession::fall_back_to_tcp(const Error& rdma_error) {
  // Only before any channel went over RDMA (then it is reachable, and this is a failure of its
  // own), and only a choice made automatically: with rdma required on either side the reason
  // is "requested" and the session fails naming why.
  const std::string reason = record().transport_reason;
  if (rdma_settled_) return rdma_error;
  if (reason != "auto-both-rdma") {
    return Error{rdma_error.code, "the target agent's RDMA is unreachable from here (" +
                                      std::string(session::kPeerRdmaUnreachable) +
                                      ") and transport: rdma is required, so no fallback to TCP: " + rdma_error.message};
  }
  LOG_WARN("kubevirt") << "session=" << id_ << " " << rdma_error.message << ": falling back to TCP ("
                       << session::kPeerRdmaUnreachable << ")";
  RDMIG_TRY(send_signed(session::message(session::MessageKind::kFallback, json{{"transport", "tcp"}, {"error", rdma_error.message}})));
  transport_ = "tcp";
  failover_rails_ = false;  // no channel runs over a rail
  failover_addresses_ = false;
  {
    MutexLock lock(mu_);
    record_.transport = "tcp";
    record_.transport_reason = session::kPeerRdmaUnreachable;
  }
  ctx_.metrics.transport_selected("tcp", session::kPeerRdmaUnreachable);
  return ok_status();
}

int SourceSession::port_class(uint16_t port) const {
  for (const auto& p : port_classes_) {
    if (p.port == port) return p.kind;
  }
  return kMemoryPort;
}

void SourceSession::saw_first_bytes(uint32_t index, session::ChannelPump& self, std::span<const std::byte> head) {
  // QEMU's migration stream starts with QEMU_VM_FILE_MAGIC, a multifd channel with its own.
  static constexpr std::array<std::byte, 4> kStreamMagic{std::byte{'Q'}, std::byte{'E'}, std::byte{'V'}, std::byte{'M'}};
  static constexpr std::array<std::byte, 4> kMultifdMagic{std::byte{0x11}, std::byte{0x22}, std::byte{0x33},
                                                          std::byte{0x44}};
  if (head.size() < 4) return;
  const bool is_main = std::equal(kStreamMagic.begin(), kStreamMagic.end(), head.begin());
  const bool is_multifd = std::equal(kMultifdMagic.begin(), kMultifdMagic.end(), head.begin());
  // A TLS record (handshake, TLS 1.0..1.3 framing) starts 0x16 0x03: KubeVirt's own TLS is on.
  const bool is_tls = head[0] == std::byte{0x16} && head[1] == std::byte{0x03};
  if (is_tls || is_main || is_multifd) {
    const bool plaintext = !is_tls;
    const bool refuse = plaintext && ctx_.config.kubevirt.plaintext_migrations == "refuse";
    bool first = false;
    std::string vmi;
    {
      MutexLock lock(mu_);
      first = record_.kubevirt_tls.empty();
      if (first) record_.kubevirt_tls = plaintext ? "off" : "on";
      if (plaintext && record_.plaintext.empty()) record_.plaintext = refuse ? "refused" : "carried";
      vmi = record_.vmi.name.empty() ? std::string("(static mode: VMI unknown)") : record_.vmi.key();
    }
    if (refuse) {
      // Not carried: this connection is reset before a byte of it left, and the session fails with
      // it (libvirt fails the migration at once; the VM stays on the source).
      const Error e{Errc::kFailedPrecondition,
                    "kubevirt.plaintextMigrations is refuse and KubeVirt's migration TLS is off (disableTLS) for " +
                        vmi + ": not carried"};
      if (first) {
        LOG_WARN("kubevirt") << "session=" << id_ << " " << e.message;
      }
      set_cause(e);  // before the reset: the target's abort that it provokes must not name the failure
      self.abort(e, true);
      return;
    }
    if (plaintext && first) {
      LOG_WARN("kubevirt") << "session=" << id_ << " migration of " << vmi
                           << " is in clear (KubeVirt's migration TLS is off: disableTLS); carried "
                           << (ctx_.config.data_plane.tls ? "with TLS between the agents (dataPlane.tls: on)"
                                                          : "in clear between the agents too (dataPlane.tls: off)");
    }
  }
  if (!is_main && !is_multifd) return;  // TLS (or something else): the order stands
  int previous = -1;
  bool drains = true;
  {
    MutexLock lock(mu_);
    drains = drain_multifd_;
    const int me = static_cast<int>(index);
    if (is_main) {
      previous = record_.main_connection == me ? -1 : record_.main_connection;
      record_.main_connection = me;
      record_.main_connection_by = "magic";
    } else if (record_.main_connection == me) {
      record_.main_connection = -1;  // taken by order, but it is a multifd channel
      record_.main_connection_by = "magic";
    } else {
      return;
    }
  }
  self.set_drain_on_failure(!is_main && drains, kMultifdDrainLimit);
  if (previous >= 0 && drains) {
    with_pump(static_cast<uint32_t>(previous),
              [](session::ChannelPump& p) { p.set_drain_on_failure(true, kMultifdDrainLimit); });
  }
  LOG_DEBUG("kubevirt") << "session=" << id_ << " connection " << index << " is "
                        << (is_main ? "QEMU's main channel" : "a multifd channel") << " (by its first bytes)";
}

void SourceSession::set_multifd_on_failure(bool drain, const std::string& by) {
  {
    MutexLock lock(mu_);
    if (ended_) return;  // decided already (fail() aborted the legs): the record says what was done
    drain_multifd_ = drain;
    record_.on_failure = drain ? "drain" : "reset";
    record_.on_failure_by = by;
  }
  // A pump that failed already keeps what it was doing (set_drain_on_failure decides no more).
  if (!drain) for_each_pump([](session::ChannelPump& p) { p.set_drain_on_failure(false, kMultifdDrainLimit); });
  if (by == "qemu unknown") return;  // the placeholder until the launcher's QEMU is known
  LOG_INFO("kubevirt") << "session=" << id_ << " on a failure: " << (drain ? "multifd connections drain (up to "
                                                                             : "every connection is reset (")
                       << (drain ? std::to_string(kMultifdDrainLimit.count() / 1000) + " s" : std::string("no drain"))
                       << "), by " << by;
}

void SourceSession::reader_loop() {
  // Until finish() sent "end", an abort, the link's loss or the target's silence fails the
  // session; after it, they are the answer finish() waits for.
  auto answer = [this](Result<json> r) {
    MutexLock lock(reply_mu_);
    if (!finishing_) return false;
    reply_ = std::move(r);
    reply_cv_.notify_all();
    return true;
  };
  while (!ended()) {
    auto m = control_turn();
    if (!m) {
      if (answer(m.error())) return;
      {
        MutexLock lock(reply_mu_);
        if (closing_) return;
      }
      fail_control_link(m.error(), "control link to the target agent on " + peer_.node,
                        "target agent on " + peer_.node);
      return;
    }
    if (!m->has_value()) continue;
    const auto type = session::kind_of(**m);
    if (type == session::MessageKind::kStats) {
      answer(std::move(**m));
      return;
    }
    if (type == session::MessageKind::kAbort) {
      if (answer(**m)) return;  // finish() decides: the target found the VM not running there
      const std::string why = "target agent aborted: " + (**m).value("reason", std::string("?"));
      fail(Error{Errc::kUnavailable, why}, true);
      return;
    }
  }
  answer(Error{Errc::kCancelled, "the session ended"});
}

void SourceSession::finish(const OwnFigures& own_figures) {
  if (ended()) return;
  const auto r = record();
  stop_watching_peer();  // the target reads libvirt's figures now, without heartbeats
  {
    MutexLock lock(reply_mu_);
    finishing_ = true;
  }
  (void)send_signed(session::message(session::MessageKind::kEnd, json{{"bytesSent", r.bytes_sent}, {"bytesReceived", r.bytes_received}}));
  Result<json> stats = Error{Errc::kTimeout, "no stats within 20 s"};
  {
    MutexLock lock(reply_mu_);
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!reply_.has_value()) {
      if (lock.wait_until(reply_cv_, deadline) == std::cv_status::timeout) break;
    }
    if (reply_.has_value()) stats = std::move(*reply_);
  }
  if (stats && session::is(*stats, session::MessageKind::kAbort)) {
    fail(Error{Errc::kUnavailable, "target agent aborted: " + stats->value("reason", std::string("?"))}, true);
    return;
  }
  if (stats) {
    auto it = stats->find("libvirt");
    if (it != stats->end() && it->is_object()) {
      MutexLock lock(mu_);
      record_.libvirt = libvirt_stats_from_json(*it);
    } else if (auto why = stats->find("libvirtError"); why != stats->end() && why->is_string()) {
      LOG_INFO("kubevirt") << "session=" << id_ << " no libvirt figures from the target: " << why->get<std::string>();
    }
  } else {
    LOG_WARN("kubevirt") << "session=" << id_ << " no figures from the target: " << stats.error().message;
  }
  bool switched = false;
  bool have_figures = false;
  {
    MutexLock lock(mu_);
    switched = record_.post_copy.switched;
    have_figures = record_.libvirt.has_value() && record_.libvirt->total_time_ms >= 0;
  }
  if (switched && !have_figures && own_figures) {
    // libvirt keeps no completed job on the target after post-copy; the source's has the figures.
    auto own = own_figures();
    if (own) {
      LOG_INFO("kubevirt") << "session=" << id_ << " libvirt's figures from the source's completed job (post-copy): "
                           << own->downtime_ms << " ms downtime, " << own->total_time_ms << " ms, "
                           << own->postcopy_requests << " page requests";
      MutexLock lock(mu_);
      record_.libvirt = own.value();
    } else {
      LOG_INFO("kubevirt") << "session=" << id_ << " no libvirt figures on either node: " << own.error().message;
    }
  }
  succeed();
  link_->close();
}

}  // namespace rdmig::kubevirt
