#include "kubevirt/flow/flow_session.h"

#include <algorithm>

#include "common/log.h"
#include "session/types.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

using nlohmann::json;

FlowSession::FlowSession(std::string id, FlowRecord record, Metrics& metrics)
    : id_(std::move(id)), metrics_(metrics), record_(std::move(record)), started_(std::chrono::steady_clock::now()),
      last_change_(started_) {
  record_.started_at_ms = session::wall_clock_ms();
}

FlowSession::~FlowSession() {
  close_legs();
  if (link_) link_->close();
}

void FlowSession::close_legs(bool let_drain) {
  std::vector<Leg> legs;
  {
    MutexLock lock(legs_mu_);
    for (auto it = legs_.begin(); it != legs_.end();) {
      if (let_drain && it->pump->draining()) {
        ++it;
      } else {
        legs.push_back(std::move(*it));
        it = legs_.erase(it);
      }
    }
  }
  for (auto& l : legs) {
    if (!l.pump->finished()) l.pump->abort(Error{Errc::kCancelled, "session closed"}, true);
  }
  legs.clear();  // joins the pumps' threads, then frees the channels
}

void FlowSession::note_tls(uint32_t index, const transport::TlsStream& tls) {
  const std::string mode = std::string("tls (") + tls.mode() + ")";
  metrics_.tls_channel(tls.label());
  LOG_INFO("kubevirt") << "session=" << id_ << " channel " << index << ": " << mode << " (kTLS send "
                       << (tls.kernel_send() ? "yes" : "no") << ", receive " << (tls.kernel_recv() ? "yes" : "no") << ")";
  MutexLock lock(mu_);
  record_.encryption = record_.encryption == "none" || record_.encryption == mode ? mode : "tls (mixed)";
}

void FlowSession::add_leg(std::unique_ptr<transport::Channel> channel, std::unique_ptr<session::ChannelPump> pump) {
  // Lock order: mu_ before legs_mu_ (record() holds mu_ while it reads the legs).
  std::string rail;
  const bool on_rail = !rails_.empty() && std::string_view(channel->transport()) == "rdma";
  if (on_rail) rail = session::rail_text(rails_[session::rail_of_channel(channel->index(), rails_.size())]);
  MutexLock rlock(mu_);
  if (on_rail) {
    session::add_channel_to_usage(rail_usage_, rails_, channel->index());
    record_.rails = rail_usage_;
  }
  MutexLock lock(legs_mu_);
  legs_.push_back(Leg{std::move(channel), std::move(pump), std::move(rail)});
  last_change_ = std::chrono::steady_clock::now();
  record_.connections = static_cast<uint32_t>(legs_.size());
  if (record_.phase == "Armed") record_.phase = "Carrying";
}

void FlowSession::enable_failover(std::string peer, std::chrono::milliseconds deadline) {
  failover_ = true;
  failover_peer_ = std::move(peer);
  failover_deadline_ = deadline;
  MutexLock lock(mu_);
  record_.failover = true;
}

std::unique_ptr<transport::Channel> FlowSession::wrap_for_failover(std::unique_ptr<transport::Channel> channel,
                                                                   uint32_t depth,
                                                                   session::FailoverChannel::Reconnect reconnect) {
  return std::make_unique<session::FailoverChannel>(std::move(channel), depth, failover_deadline_,
                                                    std::move(reconnect),
                                                    [this](const session::FailoverEvent& ev) { on_failover(ev); });
}

void FlowSession::on_failover(const session::FailoverEvent& ev) {
  const std::string what = session::failover_words(ev);
  std::string role;
  const session::RailPair* to = ev.rail ? session::find_rail(rails_, *ev.rail) : nullptr;
  const std::string now_on = to ? session::rail_text(*to) : "";  // as add_leg words it; empty over TCP
  {
    MutexLock lock(mu_);
    role = record_.role;
    ++record_.failovers;
    record_.last_failover = what;
    MutexLock llock(legs_mu_);
    for (auto& l : legs_) {
      if (l.channel->index() != ev.index) continue;
      l.rail = now_on;  // its errors name where it runs now
      // What it carried so far stays on the rail it left; from here on it counts on the rail it
      // moved to (none over TCP). Now, with its counters now: a flow's record is counted only
      // when read.
      if (ev.from != "rdma" && !ev.rail) break;  // TCP to TCP: no rail involved
      session::ChannelTraffic now;
      now.set(ev.index, l.pump->bytes_up(), l.pump->bytes_down(), l.pump->chunks_up(), l.pump->chunks_down());
      session::move_channel_off_rail(rail_usage_, rails_, ev.index, ev.rail, now);
      break;
    }
  }
  // Where it went: another rail (an RDMA path) or TCP, as a bare-QEMU job counts it.
  metrics_.failover(role, ev.from.empty() ? "tcp" : ev.from, failover_peer_, session::failover_destination(ev.path));
  LOG_WARN("kubevirt") << "session=" << id_ << " failover: " << what;
}

bool FlowSession::leg_fails_over(uint32_t index) const {
  MutexLock lock(legs_mu_);
  for (const auto& l : legs_) {
    if (l.channel->index() != index) continue;
    const auto* fc = dynamic_cast<const session::FailoverChannel*>(l.channel.get());
    return fc != nullptr && !fc->failed();
  }
  return false;
}

bool FlowSession::interrupt_leg(uint32_t index, const Error& why) {
  MutexLock lock(legs_mu_);
  for (auto& l : legs_) {
    if (l.channel->index() != index) continue;
    auto* fc = dynamic_cast<session::FailoverChannel*>(l.channel.get());
    if (fc == nullptr || fc->failed()) return false;
    fc->interrupt(why);
    return true;
  }
  return false;
}

void FlowSession::set_link(std::unique_ptr<session::ControlLink> link, std::unique_ptr<FlowSigner> signer,
                           std::chrono::milliseconds peer_timeout) {
  MutexLock lock(signer_mu_);
  link_ = std::move(link);
  signer_ = std::move(signer);
  peer_timeout_ = peer_timeout;
  last_heard_ = next_heartbeat_ = std::chrono::steady_clock::now();
}

void FlowSession::fail_over_control(session::ControlLink::Reconnect reconnect) {
  control_failover_.store(true);
  link_->fail_over_with(std::move(reconnect), failover_deadline_,
                        [this](const std::string& reason, std::chrono::milliseconds took, uint64_t resent) {
                          on_control_failover(reason, took, resent);
                        });
}

void FlowSession::on_control_failover(const std::string& reason, std::chrono::milliseconds took, uint64_t resent) {
  const std::string what = "control connection: " + reason + "; resumed after " + std::to_string(took.count()) +
                           " ms, " + std::to_string(resent) + " message(s) resent";
  std::string role;
  {
    MutexLock lock(mu_);
    role = record_.role;
    ++record_.failovers;
    record_.last_failover = what;
  }
  metrics_.failover(role, "tcp", failover_peer_);
  LOG_WARN("kubevirt") << "session=" << id_ << " failover: " << what;
}

Status FlowSession::send_signed(json message) {
  MutexLock lock(signer_mu_);
  if (!link_ || !signer_) return Error{Errc::kFailedPrecondition, "no control link"};
  return link_->send(signer_->sign(std::move(message)));
}

Result<std::optional<json>> FlowSession::next_verified(std::chrono::milliseconds timeout) {
  auto m = link_->next(timeout);
  if (!m) return m.error();
  if (!m->has_value()) return std::optional<json>();
  MutexLock lock(signer_mu_);
  auto v = signer_->verify(**m);
  if (!v) return v.error();
  return std::optional<json>(std::move(v.value()));
}

Result<std::optional<json>> FlowSession::control_turn() {
  using std::chrono::steady_clock;
  auto now = steady_clock::now();
  if (now >= next_heartbeat_) {
    next_heartbeat_ = now + kFlowHeartbeatInterval;
    json heartbeat = session::message(session::MessageKind::kHeartbeat);
    // With the control link failing over: how many of the peer's messages this end has, so that
    // the peer keeps only the rest for a resend.
    if (control_failover_.load()) heartbeat["received"] = link_->received();
    // A send that fails shows as the link's loss on the next read (or is kept for the resend).
    (void)send_signed(std::move(heartbeat));
  }
  const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_heartbeat_ - now);
  auto m = next_verified(std::clamp(wait, std::chrono::milliseconds(1), kFlowHeartbeatInterval));
  if (!m) return m.error();
  now = steady_clock::now();
  if (m->has_value()) {
    last_heard_ = now;
    silence_failed_over_ = false;
    if (!session::is(**m, session::MessageKind::kHeartbeat)) return m;
    if (control_failover_.load()) {
      const auto got = (**m).find("received");
      if (got != (**m).end() && got->is_number_unsigned()) {
        link_->acknowledged(got->get<uint64_t>());
      } else if (!peer_heartbeat_seen_) {
        // The peer's heartbeats say nothing: it does not fail the link over (an agent from
        // before it, which confirmed failover of the data channels only). Nothing kept, then.
        control_failover_.store(false);
        link_->stop_failing_over();
        LOG_INFO("kubevirt") << "session=" << id_
                             << " the peer agent does not fail the control link over: a lost link fails the session";
      }
    }
    peer_heartbeat_seen_ = true;
    return std::optional<json>();
  }
  if (control_failover_.load()) {
    // While the link is re-established (bounded by the failover deadline: past it next() fails
    // naming the link) and once it is back, the peer's silence counts from its return.
    const uint64_t failovers = link_->failovers();
    if (link_->recovering() || failovers != link_failovers_seen_) {
      link_failovers_seen_ = failovers;
      last_heard_ = now;
    }
  }
  if (watching_peer_.load() && now - last_heard_ > peer_timeout_) {
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_heard_).count();
    const std::string how_long = std::to_string(silent / 1000) + "." + std::to_string(silent % 1000 / 100) + " s";
    if (control_failover_.load() && !silence_failed_over_) {
      // A link that went silent without an error (packets dropped): failed over like a lost one.
      // Once only until the peer is heard again: a peer that stays silent on a fresh link is frozen.
      silence_failed_over_ = true;
      last_heard_ = now;
      LOG_WARN("kubevirt") << "session=" << id_ << " nothing on the control link for " << how_long
                           << " (no heartbeat): failing it over";
      link_->interrupt();
      return std::optional<json>();
    }
    return Error{Errc::kTimeout, "nothing on the control link for " + how_long + " (no heartbeat" +
                                     (silence_failed_over_ ? ", not even after failing the link over)" : ")")};
  }
  return m;
}

bool FlowSession::with_pump(uint32_t index, const std::function<void(session::ChannelPump&)>& fn) {
  MutexLock lock(legs_mu_);
  for (auto& l : legs_) {
    if (l.channel->index() == index) {
      fn(*l.pump);
      return true;
    }
  }
  return false;
}

void FlowSession::for_each_pump(const std::function<void(session::ChannelPump&)>& fn) {
  MutexLock lock(legs_mu_);
  for (auto& l : legs_) fn(*l.pump);
}

bool FlowSession::draining() const {
  MutexLock lock(legs_mu_);
  for (const auto& l : legs_) {
    if (l.pump->draining()) return true;
  }
  return false;
}

size_t FlowSession::leg_count() const {
  MutexLock lock(legs_mu_);
  return legs_.size();
}

void FlowSession::refresh_counters_locked(FlowRecord& r) const {
  MutexLock lock(legs_mu_);
  uint64_t up = 0, down = 0, cu = 0, cd = 0;
  session::ChannelTraffic by_channel;
  for (const auto& l : legs_) {
    // Each counter read once: the rails and the totals count the same bytes.
    const uint64_t lu = l.pump->bytes_up(), ld = l.pump->bytes_down(), lcu = l.pump->chunks_up(),
                   lcd = l.pump->chunks_down();
    up += lu;
    down += ld;
    cu += lcu;
    cd += lcd;
    // Every leg (the rails count only the channels they list; a moved one's totals at its move).
    by_channel.set(l.channel->index(), lu, ld, lcu, lcd);
  }
  if (legs_.empty()) return;  // keep the final figures once the legs are gone
  if (!rail_usage_.empty()) {
    session::account_rail_traffic(rail_usage_, by_channel, metrics_, "migration");
    r.rails = rail_usage_;
  }
  r.bytes_sent = up;
  r.bytes_received = down;
  r.chunks_sent = cu;
  r.chunks_received = cd;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  if (secs > 0) r.throughput_bytes_per_second = static_cast<double>(up + down) / secs;
}

FlowRecord FlowSession::record() const {
  MutexLock lock(mu_);
  FlowRecord r = record_;
  if (!ended_) refresh_counters_locked(r);
  return r;
}

bool FlowSession::ended() const {
  MutexLock lock(mu_);
  return ended_;
}

std::optional<Error> FlowSession::leg_error() const {
  std::optional<Error> first;
  {
    MutexLock lock(legs_mu_);
    for (const auto& l : legs_) {
      if (auto e = l.pump->error()) {
        first = l.rail.empty() ? *e : e->with_context("data plane (" + l.rail + ")");
        break;
      }
    }
  }
  if (!first || !link_) return first;
  if (auto state = link_->recovery_state()) return Error{first->code, *state + "; meanwhile " + first->message};
  return first;
}

bool FlowSession::idle_for(std::chrono::steady_clock::duration idle) const {
  MutexLock lock(legs_mu_);
  size_t finished = 0;
  for (const auto& l : legs_) finished += l.pump->finished() ? 1 : 0;
  const auto now = std::chrono::steady_clock::now();
  if (finished != finished_seen_) {
    finished_seen_ = finished;
    last_change_ = now;
  }
  return !legs_.empty() && finished == legs_.size() && now - last_change_ >= idle;
}

void FlowSession::fail_control_link(const Error& error, const std::string& link, const std::string& peer) {
  const bool forged = error.code == Errc::kPermissionDenied;
  const bool silent = error.code == Errc::kTimeout;
  fail(Error{Errc::kUnavailable, (forged ? link + ": " : peer + " is gone: ") + error.message}, !forged && !silent);
}

void FlowSession::fail(const Error& reported, bool from_peer) {
  Error error = reported;
  std::string migration_uid;
  {
    MutexLock lock(mu_);
    if (ended_) return;
    migration_uid = record_.migration_uid;
    ended_ = true;
    if (cause_) {
      error = *cause_;
      from_peer = false;  // the peer only echoed what this side did: it gets the cause
    }
    refresh_counters_locked(record_);
    record_.phase = "Failed";
    record_.reason = error.message;
    if (record_.post_copy.switched) {
      // What the reset below does once the guest runs on the target (docs/kubevirt.md "Post-copy").
      record_.reason += " (after the switch to post-copy: QEMU pauses the migration on both nodes, postcopy-paused; "
                        "KubeVirt has no post-copy recovery and fails the VMI)";
      error = Error{error.code, record_.reason};
    }
    record_.finished_at_ms = session::wall_clock_ms();
  }
  LOG_WARN("kubevirt") << "session=" << id_ << " migration=" << migration_uid << " failed: " << error.message;
  // Reset the local connections first: the proxies and QEMU see the failure at once. Legs
  // that drain on failure stay open and are read to nowhere (QEMU fails on its main channel).
  {
    MutexLock lock(legs_mu_);
    for (auto& l : legs_) l.pump->abort(error, !l.pump->drains_on_failure());
  }
  if (link_ && !from_peer) (void)send_signed(session::message(session::MessageKind::kAbort, json{{"reason", error.message}}));
  wake();
  close_legs(true);
  if (link_) link_->close();
}

void FlowSession::note_postcopy_switch() {
  std::string transport;
  std::string migration_uid;
  {
    MutexLock lock(mu_);
    if (ended_ || !record_.post_copy.allowed || record_.post_copy.switched) return;
    record_.post_copy.switched = true;
    record_.post_copy.switched_at_ms = session::wall_clock_ms();
    transport = record_.transport;
    migration_uid = record_.migration_uid;
  }
  metrics_.postcopy_switched(transport.empty() ? "tcp" : transport, "kubevirt");
  LOG_INFO("kubevirt") << "session=" << id_ << " migration=" << migration_uid
                       << " switched to post-copy (libvirt, KubeVirt's launcher): the guest runs on the target node "
                          "from now on and pulls its missing pages through this session";
}

void FlowSession::succeed() {
  std::optional<std::pair<std::string, double>> postcopy;  // transport, phase seconds
  uint64_t page_requests = 0;
  {
    MutexLock lock(mu_);
    if (ended_) return;
    refresh_counters_locked(record_);
    ended_ = true;
    record_.phase = "Succeeded";
    record_.finished_at_ms = session::wall_clock_ms();
    if (record_.post_copy.switched) {
      postcopy.emplace(record_.transport.empty() ? "tcp" : record_.transport,
                       static_cast<double>(std::max<int64_t>(0, record_.finished_at_ms - record_.post_copy.switched_at_ms)) /
                           1000.0);
      if (record_.libvirt && record_.libvirt->postcopy_requests > 0) {
        page_requests = static_cast<uint64_t>(record_.libvirt->postcopy_requests);
      }
    }
  }
  if (postcopy) metrics_.postcopy_ended(postcopy->first, postcopy->second, page_requests);
  wake();
  close_legs();
}

}  // namespace rdmig::kubevirt
