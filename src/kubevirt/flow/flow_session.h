// The part of a carried KubeVirt migration that both agents share: its connections ("legs":
// one channel and one pump each, in the source's accept order), its control link, its record,
// and failure. A failure resets every leg at once (RST, SO_LINGER 0) and tells the peer, so
// libvirt/QEMU fail within seconds and the source keeps the VM; legs whose pump drains on
// failure (the source's multifd connections, see ChannelPump::drain_on_failure) are read to
// nowhere instead, until QEMU closes them or their limit passes.
#pragma once

#include <optional>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/result.h"
#include "kubevirt/flow/flow_protocol.h"
#include "kubevirt/flow/flow_record.h"
#include "metrics/metrics.h"
#include "session/control_link.h"
#include "session/failover_channel.h"
#include "session/pump.h"
#include "session/rails.h"
#include "transport/channel.h"
#include "transport/tcp/tls_stream.h"

namespace rdmig::kubevirt {

class FlowSession {
 public:
  virtual ~FlowSession();
  FlowSession(const FlowSession&) = delete;
  FlowSession& operator=(const FlowSession&) = delete;

  const std::string& id() const { return id_; }
  // A snapshot with the counters brought up to date.
  FlowRecord record() const EXCLUDES(mu_);
  bool ended() const EXCLUDES(mu_);
  // Idempotent: resets every leg, tells the peer unless `from_peer`, records the reason (the
  // cause set by set_cause() when there is one: what failed first here, not its echo).
  void fail(const Error& error, bool from_peer = false) EXCLUDES(mu_, legs_mu_);
  // fail() for the control link's read error: a forged message names the link (`link`), any other
  // error the peer agent gone (`peer`); the peer is told unless the link was forged or silent.
  void fail_control_link(const Error& error, const std::string& link, const std::string& peer)
      EXCLUDES(mu_, legs_mu_);
  // The first error of any leg, if one failed; while the control link fails over, prefixed with
  // that failover's state (ControlLink::recovery_state): the peer gave up on the link first and
  // aborted over a data channel, and this end's reason says what it was doing meanwhile.
  std::optional<Error> leg_error() const EXCLUDES(legs_mu_);
  // True when every leg has finished and the last one finished more than `idle` ago.
  bool idle_for(std::chrono::steady_clock::duration idle) const EXCLUDES(legs_mu_);
  size_t leg_count() const EXCLUDES(legs_mu_);
  // True while a failed session still drains legs (keep it alive until this turns false).
  bool draining() const EXCLUDES(legs_mu_);
  // Whether this session's channels fail over (both agents confirmed dataPlane.failover).
  bool failover() const { return failover_; }
  // Source, for a migration that may switch to post-copy (record().post_copy.allowed): the
  // relay's watcher saw libvirt switch it (KubeVirt's launcher called MigrateStartPostCopy).
  // Recorded once (switched, switchedAtMs), logged, counted (rdmig_postcopy_switches_total
  // {trigger="kubevirt"}); from then on a failure's reason says what it did to the VM.
  void note_postcopy_switch() EXCLUDES(mu_);

 protected:
  FlowSession(std::string id, FlowRecord record, Metrics& metrics);
  void add_leg(std::unique_ptr<transport::Channel> channel, std::unique_ptr<session::ChannelPump> pump)
      EXCLUDES(mu_, legs_mu_);
  // The RDMA rails both agents matched (once, before the first leg): an RDMA leg with index i
  // is on rail i mod n; the record lists each rail's connections and bytes, and a leg's
  // failure names its rail.
  void set_rails(std::vector<session::RailPair> rails) { rails_ = std::move(rails); }
  // The reason this session is about to fail for, set before resetting a leg from its own pump
  // (which cannot call fail(): that joins the pumps): the peer's abort that the reset provokes
  // may reach fail() first, and the record must still name the cause.
  void set_cause(const Error& e) {
    MutexLock lock(mu_);
    if (!cause_) cause_ = e;
  }
  const std::vector<session::RailPair>& rails() const { return rails_; }
  // Runs fn on the pump of the leg whose channel has `index`, under the legs' lock (never
  // with mu_ held); false when there is no such leg (not added yet, or closed).
  bool with_pump(uint32_t index, const std::function<void(session::ChannelPump&)>& fn) EXCLUDES(mu_, legs_mu_);
  // Runs fn on every leg's pump, under the legs' lock (never with mu_ held).
  void for_each_pump(const std::function<void(session::ChannelPump&)>& fn) EXCLUDES(mu_, legs_mu_);
  // A TCP channel ran TLS (dataPlane.tls): logged, counted (rdmig_tls_channels_total), and the
  // record's "encryption" says where ("tls (mixed)" should channels differ).
  void note_tls(uint32_t index, const transport::TlsStream& tls);
  // Ends the session as Succeeded (counters final); closes the legs.
  void succeed() EXCLUDES(mu_, legs_mu_);
  void refresh_counters_locked(FlowRecord& r) const REQUIRES(mu_);
  // Joins the legs; with `let_drain`, legs still draining stay (the destructor ends them).
  void close_legs(bool let_drain = false) EXCLUDES(legs_mu_);
  // Wakes whatever of the derived class waits outside the legs (called once the session ended,
  // before the legs are joined).
  virtual void wake() {}

  // Failover (dataPlane.failover on both agents, docs/failover.md): set once, before the first
  // channel, with the other agent's address (rdmig_failovers_total's peer) and the deadline
  // (dataPlane.failoverDeadlineSeconds); the record says so.
  void enable_failover(std::string peer, std::chrono::milliseconds deadline) EXCLUDES(mu_);
  // Wraps a channel of this session in a session::FailoverChannel whose link `reconnect`
  // re-establishes; each failover is counted (metric, record) and logged.
  std::unique_ptr<transport::Channel> wrap_for_failover(std::unique_ptr<transport::Channel> channel,
                                                        uint32_t depth, session::FailoverChannel::Reconnect reconnect);
  // The peer re-dialled channel `index` (its proof checked): the leg's FailoverChannel gives up its
  // link now and fails over (taking the re-dial). False when no leg with that index fails over
  // (none, not a failover channel, or failed for good): the re-dial is then refused.
  bool interrupt_leg(uint32_t index, const Error& why) EXCLUDES(legs_mu_);
  // Whether a leg with index `index` runs a FailoverChannel that has not failed for good (a re-dial
  // of it may be admitted; nothing is interrupted by asking).
  bool leg_fails_over(uint32_t index) const EXCLUDES(legs_mu_);

  // The control link with its signer (set together by the derived class after the hello), and
  // how long the peer may send nothing (kubevirt.heartbeatTimeoutSeconds).
  void set_link(std::unique_ptr<session::ControlLink> link, std::unique_ptr<FlowSigner> signer,
                std::chrono::milliseconds peer_timeout);
  // Failover of the control link (docs/failover.md; with failover on, both agents confirmed it:
  // the welcome's "failoverControl"). Call after set_link(), before the control thread starts. A
  // lost link is re-established through `reconnect` within the failover deadline
  // (session::ControlLink: each end resends what the other did not receive, signed as it was, so
  // the signers' sequences go on); each heartbeat carries how many messages this end received, so
  // each end keeps only what the peer does not have yet; the peer's silence for the heartbeat
  // timeout fails the link over once (the session fails when it stays silent after that).
  void fail_over_control(session::ControlLink::Reconnect reconnect);
  bool control_fails_over() const { return control_failover_.load(); }
  // The peer re-dialled the control link (its proof checked): the link gives up its connection,
  // maybe half-open, and takes the re-dial.
  void interrupt_control() {
    if (link_) link_->interrupt();
  }
  // Signs and sends one control message (any thread).
  Status send_signed(nlohmann::json message);
  // The next control message, verified (seq and MAC removed); nullopt on timeout; an error when
  // the link is gone or the message is not the peer's (a forged, replayed or reordered one).
  Result<std::optional<nlohmann::json>> next_verified(std::chrono::milliseconds timeout);
  // One turn of the control link's own thread (each side runs one, and only that thread calls
  // it; no data path ever blocks it): sends a heartbeat when one is due, then waits, at most
  // until the next is due, for the peer's next message and verifies it. Returns that message
  // (a heartbeat is taken here: nullopt), nullopt when none came, or an error: the link is gone,
  // a message is not the peer's (kPermissionDenied: forged, replayed or reordered), or, while
  // the peer is watched, nothing verified came from it for the timeout (kTimeout).
  Result<std::optional<nlohmann::json>> control_turn();
  // Stops the timeout: once the source sent "end", the target reads libvirt's figures and
  // sends no heartbeats, and the source bounds its wait for them itself.
  void stop_watching_peer() { watching_peer_.store(false); }

  const std::string id_;
  Metrics& metrics_;
  std::unique_ptr<session::ControlLink> link_;  // closed last

  // Guards record_, rail_usage_ and ended_ (and SourceSession::drain_multifd_). Taken by the
  // relay's REST, hook and maintenance threads (record, ended), the control thread (fail,
  // succeed, the session's messages), the interception thread (add_leg, the source's
  // connections) and the pumps' first-bytes callbacks. Lock order: TargetSession::conn_mu_ ->
  // mu_ -> legs_mu_ -> each pump's own lock (refresh_counters_locked reads the legs under
  // both). fail() copies record_.migration_uid under it for its log line.
  mutable Mutex mu_;
  FlowRecord record_ GUARDED_BY(mu_);
  // Per-rail usage as counted into rdmig_rdma_rail_bytes_total so far (under mu_; brought up to
  // date by refresh_counters_locked, which only adds what grew).
  mutable std::vector<session::RailUsage> rail_usage_ GUARDED_BY(mu_);
  bool ended_ GUARDED_BY(mu_) = false;
  std::optional<Error> cause_ GUARDED_BY(mu_);  // set_cause()
  std::chrono::steady_clock::time_point started_;

 private:
  struct Leg {
    std::unique_ptr<transport::Channel> channel;  // declared first: destroyed after its pump
    std::unique_ptr<session::ChannelPump> pump;
    std::string rail;  // "rail 1: mlx5_1 10.0.1.1 to 10.0.1.2:7472" for an RDMA leg; empty over TCP
  };
  std::vector<session::RailPair> rails_;  // set before the first leg, read-only after
  // Guards signer_ (its send sequence and the peer's, so signing and sending happen as one and
  // verifying is ordered), and link_/signer_/peer_timeout_/last_heard_/next_heartbeat_ when
  // set_link() sets them (before the control thread starts: afterwards link_ is read
  // unlocked). Taken by send_signed (any thread that sends: control thread, fail(), finish())
  // and next_verified (the control thread). Lock order: signer_mu_ -> ControlLink's
  // write_mu_; never taken with mu_ or legs_mu_ held.
  Mutex signer_mu_;  // serialises signing with sending, and verifying
  std::unique_ptr<FlowSigner> signer_ GUARDED_BY(signer_mu_);
  // Liveness of the peer (the control thread only, after set_link).
  std::chrono::milliseconds peer_timeout_{0};
  std::chrono::steady_clock::time_point last_heard_, next_heartbeat_;
  std::atomic<bool> watching_peer_{true};
  // Control link failover: set by fail_over_control(); turned off by the control thread when the
  // peer's first heartbeat shows that it does not fail the link over (an agent from before it).
  std::atomic<bool> control_failover_{false};
  // The control thread only: the link's failovers seen, whether the peer's first heartbeat was
  // looked at, and whether its silence failed the link over already (until it is heard again).
  uint64_t link_failovers_seen_ = 0;
  bool peer_heartbeat_seen_ = false;
  bool silence_failed_over_ = false;
  void on_control_failover(const std::string& reason, std::chrono::milliseconds took, uint64_t resent) EXCLUDES(mu_);
  // Failover: set by enable_failover() before any channel exists, read-only after.
  bool failover_ = false;
  std::string failover_peer_;
  std::chrono::milliseconds failover_deadline_{0};
  void on_failover(const session::FailoverEvent& ev) EXCLUDES(mu_, legs_mu_);
  // Guards legs_, finished_seen_ and last_change_. Taken by add_leg (after mu_), close_legs,
  // fail, with_pump/for_each_pump, idle_for, draining, leg_count, leg_error (relay and control
  // threads, pumps' first-bytes callbacks) and by refresh_counters_locked under mu_. Calls into
  // the pumps (their own lock) under it; the pumps are joined only after it is released.
  mutable Mutex legs_mu_;
  std::vector<Leg> legs_ GUARDED_BY(legs_mu_);
  mutable size_t finished_seen_ GUARDED_BY(legs_mu_) = 0;
  mutable std::chrono::steady_clock::time_point last_change_ GUARDED_BY(legs_mu_);
};

}  // namespace rdmig::kubevirt
