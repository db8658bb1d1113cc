#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "kubevirt/flow/sessions.h"
#include "session/failover_channel.h"
#include "session/transport_choice.h"
#include "session/types.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

using nlohmann::json;
using namespace std::chrono_literals;

namespace {
void reject(int fd, const std::string& code, const std::string& message) { transport::send_reject(fd, code, message); }
}  // namespace

TargetSession::TargetSession(std::string id, FlowRecord record, const SessionContext& ctx, session::Hello hello,
                             NetnsLocator locate, StatsReader stats)
    : FlowSession(std::move(id), std::move(record), ctx.metrics), ctx_(ctx), hello_(std::move(hello)),
      locate_(std::move(locate)), stats_(std::move(stats)) {}

TargetSession::~TargetSession() {
  close_legs();  // first: a channel's failover waits for its re-dial with this session's members
  {
    MutexLock lock(conn_mu_);
    stopping_ = true;
  }
  conn_cv_.notify_all();
  if (link_) link_->close();
  if (reader_.joinable()) reader_.join();
}

Result<std::shared_ptr<TargetSession>> TargetSession::accept(const SessionContext& ctx, UniqueFd fd,
                                                             const session::Hello& hello, const Admission& admit,
                                                             StatsReader stats, const Publish& publish) {
  // This side proves the token first (one proof per token it accepts: the current one and,
  // during a rotation, the one before it), over the whole hello and both nonces.
  const std::string nonce = random_hex(16);
  const auto tokens = ctx.token->accepted();
  json proofs = json::array();
  for (const auto& t : tokens) proofs.push_back(flow_proof(t, "target", hello, nonce));
  RDMIG_TRY(transport::send_message(fd.get(), session::message(session::MessageKind::kChallenge, json{{"nonce", nonce}, {"proofs", proofs}})));
  auto auth = transport::recv_message(fd.get(), session::kHelloTimeout);
  if (!auth) return auth.error().with_context("waiting for the session's auth");
  auto mac = transport::get_string(auth.value(), "mac", session::to_string(session::MessageKind::kAuth), 64);
  std::string token;
  if (session::is(*auth, session::MessageKind::kAuth) && mac) {
    for (const auto& t : tokens) {
      if (constant_time_equal(mac.value(), flow_proof(t, "source", hello, nonce)) && token.empty()) token = t;
    }
  }
  if (token.empty()) {
    ctx.metrics.transport_error(hello.transport, "auth");
    reject(fd.get(), "permission_denied", "the session's proof of the agents' token does not match");
    return Error{Errc::kPermissionDenied, "a flow session failed the token challenge"};
  }
  // Only now (the source proved the token): an API look-up is no one's for the asking.
  auto locate = admit(hello);
  if (!locate) {
    // The details stay in this agent's log: the peer learns no UID or node from them.
    LOG_WARN("kubevirt") << "refused session " << hello.session << " (migration " << hello.migration_uid << " of "
                         << hello.vmi.key() << " from " << hello.source_node << "): " << locate.error().message;
    // A refusal for one of the hello's own fields names that field (not the value this side has).
    const std::string& why = locate.error().message;
    const std::string field = why.rfind("hello.", 0) == 0 ? why.substr(0, why.find(':')) + ": " : std::string();
    // A draining agent says so (nothing in it is the API's): the source records why.
    reject(fd.get(), "failed_precondition",
           why.starts_with("agent draining: ")
               ? why
               : field + "the agent on this node does not carry migration " + hello.migration_uid + " (its log says why)");
    return locate.error();
  }
  auto offered = session::parse_wire_transport(hello.transport, "hello.transport");
  if (!offered) return offered.error();
  // KubeVirt's connections arrive one by one, so every rail both agents have may carry one:
  // their MTUs are compared on each.
  auto choice = session::choose_transport(session::TransportOffer{offered.value(), hello.transport_required},
                                            ctx.config.transport, ctx.rdma,
                                            session::rail_mtus(hello.rdma_rails, 0, ctx.rdma, transport::kMaxChannels));
  if (!choice) {
    reject(fd.get(), "invalid_argument", choice.error().message);
    return choice.error();
  }
  FlowRecord rec;
  rec.migration_uid = hello.migration_uid;
  rec.vmi = hello.vmi;
  rec.role = "target";
  rec.source_node = hello.source_node;
  rec.target_node = hello.target_node;
  rec.mode = hello.mode;
  rec.carried = true;
  rec.phase = "Armed";
  rec.transport = session::wire_name(choice->transport);
  rec.transport_reason = choice->reason;
  std::shared_ptr<TargetSession> s(
      new TargetSession(hello.session, std::move(rec), ctx, hello, std::move(locate.value()), std::move(stats)));
  const std::string transport = session::wire_name(choice->transport);
  {
    MutexLock lock(s->conn_mu_);  // no other thread sees the session yet
    s->transport_ = transport;
  }
  s->channel_key_ = flow_channel_key(token, hello, nonce);
  json welcome = session::message(session::MessageKind::kWelcome, json{{"transport", transport}, {"transportReason", choice->reason}});
  // Failover when both agents have it on: the source re-dials a channel whose link fails.
  bool fails_over = hello.failover && ctx.config.data_plane.failover;
  if (fails_over && transport == "rdma") {
    // A channel may come back over another rail (its source re-dials over rdma_cm): taken only
    // when this agent's failoverPaths list "rail", and the source does so only when it reads
    // failoverRails (an agent from before it re-dials over TCP). RDMA required and no rail to
    // fail over to here: no failover (never TCP), as a bare-QEMU target job decides.
    s->failover_rails_ = ctx.config.data_plane.fails_over_to("rail");
    s->failover_addresses_ = ctx.config.data_plane.fails_over_to("address") && session::has_alternates(ctx.rdma);
    if (hello.transport_required && !s->failover_rails_ && !s->failover_addresses_) fails_over = false;
  }
  if (fails_over) {
    welcome["failover"] = true;
    welcome["failoverControl"] = true;  // the control link too (a source from before it ignores this)
    if (s->failover_rails_) welcome["failoverRails"] = true;
    if (s->failover_addresses_) welcome["failoverAddresses"] = true;
    s->enable_failover(net::peer_address(fd.get()), std::chrono::seconds(ctx.config.data_plane.failover_deadline_seconds));
  }
  if (transport == "rdma") {
    session::add_rails_to_welcome(welcome, ctx.rdma);
    s->set_rails(session::rails_from_source(hello.rdma_rails, ctx.rdma));
  }
  if (publish) {
    if (auto st = publish(s); !st) {
      reject(fd.get(), st.error().code == Errc::kAlreadyExists ? "already_exists" : "resource_exhausted",
             st.error().message);
      return st.error();
    }
  }
  if (auto st = transport::send_message(fd.get(), welcome); !st) {
    s->fail(st.error().with_context("sending the welcome"), true);
    return st.error();
  }
  // An automatic choice of RDMA is counted once it holds: at the first RDMA channel, or as
  // the TCP fallback the source asks for when rdma_cm cannot reach this agent.
  if (choice->reason != "auto-both-rdma") ctx.metrics.transport_selected(transport, choice->reason);
  s->set_link(std::make_unique<session::ControlLink>(std::move(fd)),
              std::make_unique<FlowSigner>(flow_session_key(token, hello, nonce), "target", "source"),
              std::chrono::seconds(ctx.config.kubevirt.heartbeat_timeout_seconds));
  if (s->failover()) {
    // Undone at the source's first heartbeat when that says nothing of it (a source from before it).
    s->fail_over_control([p = s.get()](uint64_t received, std::chrono::steady_clock::time_point deadline,
                                       const std::function<bool()>& stopped) {
      return p->reaccept_control(received, deadline, stopped);
    });
  }
  return s;
}

void TargetSession::wake() {
  {
    MutexLock lock(conn_mu_);
    stopping_ = true;
  }
  conn_cv_.notify_all();
}

void TargetSession::start() {
  reader_ = std::thread([this] { reader_loop(); });
}

void TargetSession::reader_loop() {
  // This thread is the control link's: it sends this side's heartbeats and watches the
  // source's (control_turn); opening a channel never waits on the data path.
  while (!ended()) {
    auto m = control_turn();
    if (!m) {
      fail_control_link(m.error(), "control link from the source agent on " + hello_.source_node,
                        "source agent on " + hello_.source_node);
      return;
    }
    if (!m->has_value()) continue;
    const json& msg = **m;
    const auto type = session::kind_of(msg);
    if (type == session::MessageKind::kOpen) {
      auto index = transport::get_uint(msg, "index", session::to_string(session::MessageKind::kOpen), 0, transport::kMaxChannels - 1);
      auto host = transport::get_string(msg, "host", session::to_string(session::MessageKind::kOpen), 64);
      auto port = transport::get_uint(msg, "port", session::to_string(session::MessageKind::kOpen), 1, 65535);
      if (!index || !host || !port) {
        fail(Error{Errc::kProtocol, "bad open message from the source agent"});
        return;
      }
      // Only a pod address (a virt-handler's, checked when dialling) is ever dialled for a peer.
      if (auto st = net::check_unicast_literal(host.value(), "open.host"); !st) {
        fail(st.error().with_context("refused an open from the source agent on " + hello_.source_node));
        return;
      }
      MutexLock lock(conn_mu_);
      const auto i = static_cast<uint32_t>(index.value());
      if (destinations_.size() <= i) {
        destinations_.resize(i + 1);
        channels_.resize(i + 1);
        started_.resize(i + 1, false);
      }
      destinations_[i] = net::Endpoint{host.value(), static_cast<uint16_t>(port.value())};
      try_start_locked(i);
    } else if (type == session::MessageKind::kFallback) {
      if (auto st = fall_back_to_tcp(msg.value("error", std::string("?"))); !st) {
        fail(st.error());
        return;
      }
    } else if (type == session::MessageKind::kEnd) {
      stop_watching_peer();
      report_and_succeed();
      return;
    } else if (type == session::MessageKind::kAbort) {
      fail(Error{Errc::kUnavailable, "source agent aborted: " + msg.value("reason", std::string("?"))}, true);
      return;
    }
  }
}

std::unique_ptr<transport::Channel> TargetSession::for_failover(std::unique_ptr<transport::Channel> channel) {
  if (!failover()) return channel;
  const uint32_t index = channel->index();
  return wrap_for_failover(std::move(channel), hello_.ring_depth,
                           [this, index](uint64_t taken, const Error&, std::chrono::steady_clock::time_point deadline,
                                         const std::function<bool()>& stopped) {
                             return reaccept(index, taken, deadline, stopped);
                           });
}

Result<session::Resumed> TargetSession::reaccept(uint32_t index, uint64_t taken,
                                                 std::chrono::steady_clock::time_point deadline,
                                                 const std::function<bool()>& stopped) {
  auto r = redials_.take(index, channel_terms(index), taken, deadline, [&] { return stopped() || ended(); },
                         std::chrono::duration_cast<std::chrono::milliseconds>(session::kHelloTimeout));
  if (!r) return r.error();
  session::RedialTls tls;
  if (ctx_.config.data_plane.tls) {
    tls = [this, index](int fd, std::chrono::milliseconds left) {
      return transport::TlsStream::handshake(fd, transport::TlsStream::Role::kAcceptor, channel_terms(index), left);
    };
  }
  return session::resumed_redial(std::move(r.value()), index,
                                 session::TcpGeometry{static_cast<uint32_t>(hello_.chunk_size), hello_.ring_depth,
                                                      &ctx_.metrics.transport("tcp"), ctx_.config.tcp.splice},
                                 tls);
}

Result<std::pair<UniqueFd, uint64_t>> TargetSession::reaccept_control(uint64_t received,
                                                                       std::chrono::steady_clock::time_point deadline,
                                                                       const std::function<bool()>& stopped) {
  auto r = redials_.take(transport::kControlIndex, channel_terms(transport::kControlIndex), received, deadline,
                         [&] { return stopped() || ended(); },
                         std::chrono::duration_cast<std::chrono::milliseconds>(session::kHelloTimeout));
  if (!r) return r.error();
  return std::make_pair(std::move(r->fd), r->peer_count);
}

Status TargetSession::resume_control_link(UniqueFd fd, const std::string& welcome_proof) {
  // Only the live control link of a session that fails it over: anything else is refused and
  // displaces nothing (the link keeps its connection).
  if (!control_fails_over() || ended()) {
    const std::string why = "hello.control: session " + id() + " does not fail its control link over";
    reject(fd.get(), "permission_denied", why);
    LOG_WARN("kubevirt") << "session=" << id() << " refused a re-dial of the control link: " << why;
    return Error{Errc::kPermissionDenied, why};
  }
  RDMIG_TRY(transport::send_message(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}})));
  // The link's failover takes it (a newer one replaces it).
  redials_.hand_over(transport::kControlIndex, std::move(fd), [this] { interrupt_control(); });
  return ok_status();
}

Status TargetSession::resume_tcp_channel(UniqueFd fd, uint32_t index, const std::string& welcome_proof, bool tls) {
  // Only a live channel of a session that fails over: anything else is refused and displaces nothing.
  const auto refuse = [&](const std::string& code, const std::string& why) -> Status {
    reject(fd.get(), code, why);
    LOG_WARN("kubevirt") << "session=" << id() << " refused a re-dial of channel " << index << ": " << why;
    return Error{Errc::kPermissionDenied, why};
  };
  if (!failover() || ended()) {
    return refuse("permission_denied", "hello.resume: session " + id() + " does not fail channel " +
                                           std::to_string(index) + " over");
  }
  if (tls != ctx_.config.data_plane.tls) return refuse("tls_mismatch", transport::tls_mismatch(tls, ctx_.config.data_plane.tls));
  const Error why{Errc::kUnavailable, "the source agent re-dialled channel " + std::to_string(index)};
  bool live = interrupt_leg(index, why);
  if (!live) {
    // Not started yet (its destination not known): the channel waits in channels_.
    MutexLock lock(conn_mu_);
    auto* fc = index < channels_.size() ? dynamic_cast<session::FailoverChannel*>(channels_[index].get()) : nullptr;
    if (fc != nullptr && !fc->failed()) {
      fc->interrupt(why);
      live = true;
    }
  }
  if (!live) {
    return refuse("permission_denied", "hello.resume: channel " + std::to_string(index) + " of session " + id() +
                                           " is not live here");
  }
  RDMIG_TRY(transport::send_message(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}})));
  // The channel's failover takes it (a newer re-dial replaces it); its link was given up first, as
  // RedialSlots::hand_over does it.
  redials_.put(index, std::move(fd));
  return ok_status();
}

void TargetSession::try_start_locked(uint32_t i) {
  if (i >= destinations_.size() || !destinations_[i] || !channels_[i] || started_[i]) return;
  started_[i] = true;
  auto channel = std::move(channels_[i]);
  auto pump = std::make_unique<session::ChannelPump>(*channel, [this, i] { return dial_in_order(i); }, true);
  pump->start();
  add_leg(std::move(channel), std::move(pump));
}

Status TargetSession::fall_back_to_tcp(const std::string& why) {
  MutexLock lock(conn_mu_);
  const std::string reason = record().transport_reason;
  bool any_rdma = rdma_settled_;
  for (const auto& ch : channels_) any_rdma = any_rdma || ch != nullptr;
  for (bool started : started_) any_rdma = any_rdma || started;
  if (transport_ != "rdma" || reason != "auto-both-rdma" || any_rdma) {
    return Error{Errc::kUnavailable, "the source agent on " + hello_.source_node + " cannot reach this agent over RDMA (" +
                                         why + ") and " +
                                         (any_rdma ? std::string("RDMA channels of this session are connected already")
                                                   : std::string("transport: rdma is required")) +
                                         ", so no fallback to TCP (" + session::kPeerRdmaUnreachable + ")"};
  }
  LOG_WARN("kubevirt") << "session=" << id_ << " the source agent cannot reach this agent over RDMA (" << why
                       << "): falling back to TCP (" << session::kPeerRdmaUnreachable << ")";
  transport_ = "tcp";
  {
    MutexLock rlock(mu_);
    record_.transport = "tcp";
    record_.transport_reason = session::kPeerRdmaUnreachable;
  }
  ctx_.metrics.transport_selected("tcp", session::kPeerRdmaUnreachable);
  conn_cv_.notify_all();
  return ok_status();
}

Status TargetSession::add_tcp_channel(UniqueFd fd, uint32_t index, const std::string& welcome_proof, bool tls) {
  MutexLock lock(conn_mu_);
  // A TCP channel can overtake the source's "fallback" on the control link: wait for it, bounded.
  if (transport_ == "rdma") {
    const auto deadline = std::chrono::steady_clock::now() + kFallbackWait;
    while (transport_ == "rdma" && !stopping_ && !ended()) {
      if (lock.wait_until(conn_cv_, deadline) == std::cv_status::timeout) break;
    }
  }
  if (transport_ != "tcp" || index >= transport::kMaxChannels || ended()) {
    reject(fd.get(), "invalid_argument", "channel index out of range or session not on tcp");
    return Error{Errc::kInvalidArgument, "bad flow-data channel"};
  }
  if (tls != ctx_.config.data_plane.tls) {
    const std::string why = transport::tls_mismatch(tls, ctx_.config.data_plane.tls);
    reject(fd.get(), "tls_mismatch", why);
    LOG_WARN("kubevirt") << "session=" << id() << " refused channel " << index << ": " << why;
    return Error{Errc::kFailedPrecondition, why};
  }
  if (channels_.size() <= index) {
    destinations_.resize(index + 1);
    channels_.resize(index + 1);
    started_.resize(index + 1, false);
  }
  if (channels_[index] || started_[index] || admitting_.count(index)) {
    reject(fd.get(), "already_exists", "channel " + std::to_string(index) + " is already connected");
    return Error{Errc::kAlreadyExists, "duplicate flow-data channel"};
  }
  auto buffers = ctx_.take_buffers(flow_channel_buffers(hello_.chunk_size, hello_.ring_depth, failover()),
                                   "channel " + std::to_string(index) + " of this carried migration");
  if (!buffers) {
    reject(fd.get(), "resource_exhausted", buffers.error().message);
    return buffers.error();
  }
  RDMIG_TRY(transport::send_message(fd.get(), session::message(session::MessageKind::kWelcome, json{{"proof", welcome_proof}})));
  std::unique_ptr<transport::TlsStream> stream;
  if (tls) {
    // The handshake runs without the lock; the index stays taken meanwhile.
    admitting_.insert(index);
    lock.unlock();
    auto made = transport::TlsStream::handshake(fd.get(), transport::TlsStream::Role::kAcceptor, channel_terms(index),
                                                session::kHelloTimeout);
    lock.lock();
    admitting_.erase(index);
    if (!made) {
      ctx_.metrics.transport_error("tcp", "tls");
      LOG_WARN("kubevirt") << "session=" << id() << " channel " << index << ": " << made.error().message;
      return made.error();
    }
    if (ended()) return Error{Errc::kFailedPrecondition, "session ended during the TLS handshake"};
    stream = std::move(made.value());
    note_tls(index, *stream);
  }
  buffers_.push_back(std::move(buffers.value()));
  channels_[index] = for_failover(transport::TcpChannel::create(std::move(fd), index,
                                                                 static_cast<uint32_t>(hello_.chunk_size), hello_.ring_depth,
                                                                 ctx_.metrics.transport("tcp"), ctx_.config.tcp.splice,
                                                                 std::move(stream)));
  try_start_locked(index);
  return ok_status();
}

Result<transport::rdma::AcceptPlan> TargetSession::rdma_plan(const transport::rdma::ConnectRequest& request) {
  // The proof first: a request that does not prove the session's key takes no index and no budget.
  if (auto st = transport::rdma::check_request(request, channel_key_, rdma_proofs_); !st) {
    ctx_.metrics.transport_error("rdma", "auth");
    return st.error();
  }
  const uint32_t index = request.index;
  MutexLock lock(conn_mu_);
  if (transport_ != "rdma" || index >= transport::kMaxChannels || ended()) {
    return Error{Errc::kInvalidArgument, "channel index out of range or session not on rdma"};
  }
  if (index < channels_.size() && (channels_[index] || started_[index])) {
    // A connect request for a channel that runs: a rail failover's re-dial, taken only where this
    // end offered it (failoverRails in the welcome) and only for a live channel (one that has not
    // failed for good); refused otherwise, displacing nothing.
    if (!failover_rails_ && !failover_addresses_) return Error{Errc::kAlreadyExists, "channel " + std::to_string(index) + " is already connected"};
    const auto* waiting = dynamic_cast<const session::FailoverChannel*>(channels_[index].get());
    const bool live = started_[index] ? leg_fails_over(index) : waiting != nullptr && !waiting->failed();
    if (!live) {
      return Error{Errc::kPermissionDenied, "channel " + std::to_string(index) + " of session " + id_ +
                                                " is already connected and is not failed over here"};
    }
    return rail_redial_plan(index, request.rail, request.address);
  }
  auto buffers = ctx_.take_buffers(flow_channel_buffers(hello_.chunk_size, hello_.ring_depth, failover()),
                                   "channel " + std::to_string(index) + " of this carried migration");
  if (!buffers) return buffers.error();
  buffers_.push_back(std::move(buffers.value()));
  auto plan = accept_plan(index);
  plan.deliver = [this, index](Result<std::unique_ptr<transport::Channel>> ch) {
    if (!ch) {
      fail(ch.error().with_context("RDMA channel " + std::to_string(index)));
      return;
    }
    MutexLock l(conn_mu_);
    if (transport_ != "rdma") return;  // fell back to TCP meanwhile: this channel just closes
    if (!rdma_settled_) {
      rdma_settled_ = true;
      if (record().transport_reason == "auto-both-rdma") ctx_.metrics.transport_selected("rdma", "auto-both-rdma");
    }
    if (channels_.size() <= index) {
      destinations_.resize(index + 1);
      channels_.resize(index + 1);
      started_.resize(index + 1, false);
    }
    channels_[index] = for_failover(std::move(ch.value()));
    try_start_locked(index);
  };
  return plan;
}

transport::rdma::AcceptPlan TargetSession::accept_plan(uint32_t index) {
  const auto chunk = static_cast<uint32_t>(hello_.chunk_size);
  transport::rdma::AcceptPlan plan;
  plan.key = channel_key_;
  plan.params = transport::rdma::RdmaChannelParams{index, session::return_path_chunk(chunk),
                                                   session::return_path_depth(hello_.ring_depth), chunk,
                                                   hello_.ring_depth};
  plan.metrics = &ctx_.metrics.transport("rdma");
  return plan;
}

transport::rdma::AcceptPlan TargetSession::rail_redial_plan(uint32_t index, uint32_t rail, uint32_t address) {
  auto plan = accept_plan(index);
  // The rail it came over (this agent's listener on it), for the failover's words on this end.
  plan.deliver = [this, index, rail, via = session::arrival_rail_text(rails(), rail, address)](
                     Result<std::unique_ptr<transport::Channel>> ch) mutable {
    if (!ch) {
      LOG_WARN("kubevirt") << "session=" << id_ << " channel " << index << " re-dialled over RDMA (" << via
                           << "): " << ch.error().message;
      return;  // the source tries again, or another path
    }
    // As a TCP re-dial (resume_tcp_channel): the live channel gives up its link and takes this one.
    const Error why{Errc::kUnavailable, "the source agent re-dialled channel " + std::to_string(index) + " over RDMA"};
    bool live = interrupt_leg(index, why);
    if (!live) {
      MutexLock lock(conn_mu_);  // not started yet: the channel waits in channels_
      auto* fc = index < channels_.size() ? dynamic_cast<session::FailoverChannel*>(channels_[index].get()) : nullptr;
      if (fc != nullptr && !fc->failed()) {
        fc->interrupt(why);
        live = true;
      }
    }
    if (!live) return;  // ended meanwhile: the new channel just closes
    // A newer re-dial replaces one not yet taken; the link was given up first (RedialSlots::hand_over).
    redials_.put(index, std::move(ch.value()), std::move(via), rail);
  };
  return plan;
}

Result<UniqueFd> TargetSession::dial_in_order(uint32_t index) {
  net::Endpoint dst;
  {
    MutexLock lock(conn_mu_);
    // QEMU takes the first memory connection as its main channel: dial in the source's order.
    while (next_dial_ != index && !stopping_) lock.wait(conn_cv_);
    if (stopping_) return Error{Errc::kCancelled, "session stopped"};
    dst = *destinations_[index];
  }
  // Only from inside the virt-handler's network namespace that owns the address and only to a
  // port virt-handler listens on there, never from the agent's own (the node's host network):
  // a peer or a token holder must not get a connection to the node's own services, its
  // metadata address, another container of the pod, or past NetworkPolicy.
  auto located = locate_(dst);
  if (!located) return located.error().with_context("refusing to dial " + dst.to_string());
  const std::shared_ptr<NetNs> ns = located.value();
  const PassMark mark{ctx_.config.kubevirt.socket_mark, ctx_.config.kubevirt.socket_mark_mask};
  auto fd = ns->make_socket([&]() -> Result<UniqueFd> {
    // A same-node hop, bounded before the handshake (net::bound_local_hop).
    return net::tcp_connect(dst, 10s, [mark, window = hello_.chunk_size](int s) {
      net::bound_local_hop(s, window);
      return set_pass_mark(s, mark);
    });
  });
  if (!fd) return fd.error().with_context("dialling " + dst.to_string() + " in " + ns->describe());
  {
    MutexLock lock(conn_mu_);
    ++next_dial_;
  }
  conn_cv_.notify_all();
  return fd;
}

void TargetSession::report_and_succeed() {
  json reply = session::message(session::MessageKind::kStats);
  if (!hello_.vmi.uid.empty() && stats_) {
    auto stats = stats_(hello_.vmi);
    if (!stats && stats.error().code == Errc::kFailedPrecondition) {
      // Every byte arrived but the VM does not run here: the source must not call it a success
      // (the abort is the source's answer to its "end").
      fail(stats.error().with_context("after the stream ended"));
      return;
    }
    if (stats) {
      MutexLock lock(mu_);
      record_.libvirt = stats.value();
      reply["libvirt"] = to_json(stats.value());
    } else {
      reply["libvirtError"] = stats.error().message;
      LOG_INFO("kubevirt") << "session=" << id_ << " libvirt figures unavailable: " << stats.error().message;
    }
  }
  (void)send_signed(reply);
  succeed();
}

}  // namespace rdmig::kubevirt
