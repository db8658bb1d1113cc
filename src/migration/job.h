// One migration on this agent: its spec, its status, and the worker thread that drives it.
// The status is guarded by a mutex that REST handlers share; the data path never takes it
// (pumps keep their own atomic counters, which the worker copies into the status).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "config/agent_config.h"
#include "metrics/metrics.h"
#include "migration/postcopy_record.h"
#include "migration/types.h"
#include "qemu/qmp_client.h"
#include "session/control_link.h"
#include "session/data_plane_server.h"
#include "session/failover_channel.h"
#include "session/pump.h"
#include "session/rails.h"
#include "transport/channel.h"
#include "transport/tcp/tls_stream.h"

namespace rdmig::migration {

// The bound on one QMP command (the handshake's own bounds: session/types.h).
inline constexpr std::chrono::seconds kQmpTimeout{10};
// A QEMU's run state (query-status: "running", "paused", "postmigrate", ...).
Result<std::string> run_state(qemu::QmpClient& qmp);

// What a create answers when the VM's QEMU (the QMP socket's peer) misbehaves while it is
// checked: a QEMU that does not answer in time is a gateway timeout (kTimeout, HTTP 504), one
// that hangs up, speaks no QMP or answers nonsense cannot be migrated (kFailedPrecondition,
// 409). Never 500 (the agent's own fault) nor 503 (the agent shutting down).
Error qmp_check_failed(const std::string& socket, const std::string& what, const Error& e);

// A QEMU's version (query-version), and whether it is at least major.minor.
struct QemuVersion {
  int major = 0, minor = 0, micro = 0;
  bool at_least(int ma, int mi) const { return major > ma || (major == ma && minor >= mi); }
  std::string text() const;
};
Result<QemuVersion> qemu_version(qemu::QmpClient& qmp);

// What a job needs from the agent around it.
struct JobContext {
  const AgentConfig& config;
  Metrics& metrics;
  std::string advertise_host;  // this agent's data-plane address for peers
  uint16_t data_port = 0;
  const session::RdmaSupport& rdma;
  // Called on the job's worker thread as its last act, once the job has finished and released
  // its sockets, channels and buffers: the owner may join the worker from another thread.
  std::function<void(const std::string& id)> on_worker_done;
};

// A failed channel of a migration: its index, its error, and whether that error only echoes the
// peer agent's abort ("peer aborted": the peer decided, and says why on the control link).
struct ChannelFailure {
  uint32_t channel = 0;
  Error error;
  bool peer_abort = false;
};

bool is_peer_abort(const Error& e);

// Which of the channels' errors (by channel index; nullopt = fine) a failure report names: the
// first channel that failed by itself (a rail cut: "work completion failed"), before any that
// only carry the peer's abort, which the peer sends on every channel once one failed there;
// else the first peer abort; nullopt when no channel failed.
std::optional<ChannelFailure> channel_failure_to_report(const std::vector<std::optional<Error>>& errors);

class Job {
 public:
  Job(MigrationSpec spec, JobContext ctx);
  virtual ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  const std::string& id() const { return spec_.id; }
  Role role() const { return spec_.role; }
  const MigrationSpec& spec() const { return spec_; }
  MigrationStatus status() const EXCLUDES(status_mu_);
  bool finished() const EXCLUDES(status_mu_);
  bool wait_finished(std::chrono::milliseconds timeout) const EXCLUDES(status_mu_);

  // Asks the job to stop. The worker reacts within one progress interval: the VM stays on
  // the source (migrate_cancel) unless the source had already handed it over. Sockets the
  // handshake is blocked on are shut down at once, so no stage waits out its own timeout.
  void request_cancel(const std::string& reason) EXCLUDES(status_mu_);
  // A cancel through the API: as request_cancel, unless the migration is in post-copy or has
  // agreed to switch (agree_postcopy_switch): then false, and nothing changes (the API's 409).
  // One decision under one lock with agree_postcopy_switch(): either the cancel or the switch wins.
  bool request_cancel_before_postcopy(const std::string& reason) EXCLUDES(status_mu_);

  // Joins the worker once it has ended (after on_worker_done); a no-op when already joined.
  void join_worker();

 protected:
  void set_phase(Phase phase) EXCLUDES(status_mu_);
  void update(const std::function<void(MigrationStatus&)>& fn) EXCLUDES(status_mu_);
  // Ends the job once; records metrics; closes QMP so others may use the monitor.
  // `failure`: the reason label of rdmig_migration_failures_total for a failed phase (one of
  // timeout, peer_lost, qemu, protocol, io, target_failed, vm_paused_on_source, other).
  void finish(Phase phase, const std::string& reason, const char* failure = nullptr) EXCLUDES(status_mu_, data_mu_);
  static const char* failure_of(Errc code);
  bool cancel_requested() const { return cancel_requested_.load(); }
  // The post-copy switch is agreed here (the source: it is about to issue migrate-start-postcopy;
  // the target: it told the source it may): from now on the API's cancel is refused. False, and
  // nothing agreed, when a cancel was accepted first (docs/protocol.md, the switch agreement).
  bool agree_postcopy_switch() EXCLUDES(status_mu_);
  bool postcopy_agreed() const EXCLUDES(status_mu_);
  std::string cancel_reason() const EXCLUDES(status_mu_);
  // A handshake step's error, or the cancel that caused it (a cancelled step fails with EPIPE-like errors).
  Error cancel_or(Error e) const {
    return cancel_requested() ? Error{Errc::kCancelled, cancel_reason()} : std::move(e);
  }
  // Copies the pumps' counters into the status. `retiring` (retire_data_plane, the pumps joined):
  // also takes every channel off the rail it ran on, its totals staying counted there, so that a
  // recovery's fresh channel 0 (over TCP) counts on no rail.
  void refresh_data_counters(bool retiring = false) EXCLUDES(data_mu_, status_mu_);
  // The rails this job's RDMA channels are striped across: into status (and the log).
  void set_rails(const std::vector<session::RailPair>& rails) EXCLUDES(status_mu_);
  // A data-plane failure of channel `channel`, named with the rail that carried it (over RDMA):
  // "data plane (rail 1: mlx5_1 10.10.1.1 to 10.10.1.2:7472): channel 1: work completion failed ...".
  Error data_plane_error(const Error& e, uint32_t channel) const EXCLUDES(status_mu_);
  // QEMU said the migration failed (`what`: "source QEMU: migration failed", its text after a
  // colon): when a channel failed too (`failed`) the channel is the cause (QEMU only saw its
  // connection break in the same poll), so its error, named with its rail, comes first.
  Error qemu_failure(const std::string& what, const std::string& error_desc,
                     const std::optional<ChannelFailure>& failed) const;
  // The channel failure a report names (channel_failure_to_report over the pumps' errors;
  // with `only`, over the errors of that code alone).
  std::optional<ChannelFailure> channel_failure(std::optional<Errc> only = std::nullopt) const;
  // Fails pumps and channels; also shuts the control link unless `keep_link` (a verdict still
  // has to reach the peer).
  void abort_data_plane(const Error& reason, bool keep_link = false);
  // Post-copy recovery: ends the data plane for good without an abort frame to the peer (the link
  // is gone; the peer recovers too): every pump and channel is aborted (QEMU's side reset, so QEMU
  // pauses at once), joined and dropped, their counts kept for the status (and on the rails they
  // ran on, which list them no more); the control link is closed and dropped. The recovery's
  // fresh channel and link go in afterwards (adopt_channel).
  void retire_data_plane(const std::string& why);
  // Post-copy recovery: `channel` becomes the next channel (0, then the preempt channel) with its
  // pump, and `link`, when given, the control link.
  void adopt_channel(std::unique_ptr<transport::Channel> channel, std::unique_ptr<session::ChannelPump> pump,
                     std::unique_ptr<session::ControlLink> link);
  std::string log_prefix() const;
  // Failover (dataPlane.failover, confirmed by both agents): wraps every channel in channels_ in a
  // session::FailoverChannel whose link `reconnect_for(index)` re-establishes (docs/failover.md).
  // Call before the pumps start.
  void wrap_for_failover(const std::function<session::FailoverChannel::Reconnect(uint32_t)>& reconnect_for);
  // The other agent's data-plane address (rdmig_failovers_total's peer): set before any channel
  // can fail over (before wrap_for_failover), read by the channels' threads after.
  std::string failover_peer_;
  // One channel failed over: counted (rdmig_failovers_total), logged, put in the status.
  void on_failover(const session::FailoverEvent& ev) EXCLUDES(status_mu_);
  // The control connection failed over (session::ControlLink::fail_over_with): the same.
  void on_control_failover(const std::string& reason, std::chrono::milliseconds took, uint64_t resent);
  // Channel `index`'s FailoverChannel (nullptr when the job does not fail over); under data_mu_.
  session::FailoverChannel* failover_channel(uint32_t index) const REQUIRES(data_mu_);
  // A TCP data channel's TLS handshake (dataPlane.tls: on) as `role`, over the channel's terms; a
  // failure is counted (rdmig_transport_errors_total{transport="tcp",kind="tls"}).
  Result<std::unique_ptr<transport::TlsStream>> channel_tls(int fd, transport::TlsStream::Role role,
                                                            const transport::ChannelTerms& terms,
                                                            std::chrono::milliseconds timeout);
  // A TCP data channel's TLS (dataPlane.tls: on): logged, counted (rdmig_tls_channels_total) and
  // put in the status ("encryption"; "tls (mixed)" should channels differ).
  void report_tls(uint32_t index, const transport::TlsStream& tls);
  // Cancels and joins the worker; derived destructors call it first, while they still exist.
  void stop_worker();
  // Starts the worker: runs `body`, then releases what the job holds and reports it done.
  void start_worker(std::function<void()> body);
  // Frees pumps, channels, the control link and the QMP connection right after the job ends;
  // the status stays. Derived jobs free their own handshake state in release_own().
  void release_resources();
  virtual void release_own() {}
  // The worker's body threw `error`: leave QEMU as safely as the job can (the caller then
  // finishes the job Failed if this did not).
  virtual void on_exception(const Error& error) { (void)error; }

  // A socket a blocking handshake step uses: request_cancel() shuts it down, which ends the
  // step's wait at once with an error. Scoped: unregisters on destruction.
  class CancelWatch {
   public:
    CancelWatch(Job& job, int fd);
    ~CancelWatch();
    CancelWatch(const CancelWatch&) = delete;
    CancelWatch& operator=(const CancelWatch&) = delete;

   private:
    Job& job_;
    int fd_;
  };

  MigrationSpec spec_;
  JobContext ctx_;
  const std::chrono::steady_clock::time_point created_;
  MigrationGauges gauges_;

  // A migration unix socket's peer must be the QEMU behind this job's QMP socket (SO_PEERCRED):
  // anything else that reached the socket is refused, naming both pids. No check when the
  // QMP peer's pid is not visible (0: the agent is not in the host's pid namespace).
  Status check_qemu_peer(int fd, const std::string& what) const;
  // The QEMU process behind `qmp`: the thread group of its first vCPU thread (query-cpus-fast
  // thread-id), which holds through a QMP proxy; else the QMP socket's peer (SO_PEERCRED).
  static int qemu_pid_of(qemu::QmpClient& qmp);
  // This job's QEMU as status and messages name it (postcopy_recovery.h describe_qemu: its migration
  // status and run state, "unreadable" for either it cannot read), and its migration status alone.
  std::pair<std::string, std::string> qemu_state();
  int qemu_pid_ = 0;  // set by derived constructors from the QMP connection

  // Post-copy's record on disk (postcopy_record.h), so that this agent can take part in a recovery
  // after it restarted: set by the derived job at the switch (record_), written with `state`
  // ("postcopy", "recovering") by save_record, refreshed at most every 5 s by keep_record_alive,
  // removed by finish(). Not kept when recovery is off (migration.postCopyRecoverySeconds 0) or
  // with multifd (not recovered). A write that fails is logged, never fails the migration. Worker
  // thread only.
  void save_record(const std::string& state);
  void keep_record_alive();
  std::optional<PostcopyRecord> record_;
  std::chrono::steady_clock::time_point record_saved_{};
  // This job was restored from its record after the agent restarted (SourceJob/TargetJob::restore).
  bool restored_ = false;
  // What both roles' restore() share: the spec a record gives (`role`'s; the channel a recovery
  // makes runs over TCP), and marking the job restored: record_ and restored_ set, cancels refused
  // as before the restart (agree_postcopy_switch), the status switched with the record's switch
  // time and recoveries, afterRestart. run_restored()'s reason and log line: restored_why().
  static MigrationSpec spec_from_record(const PostcopyRecord& record, Role role);
  void mark_restored(const PostcopyRecord& record) EXCLUDES(status_mu_);
  Error restored_why(const std::string& qemu_role, const std::string& next);

  // Owned by the worker thread (and torn down in this order: pumps, channels, link, qmp).
  std::unique_ptr<qemu::QmpClient> qmp_;
  std::unique_ptr<session::ControlLink> link_;
  std::vector<std::unique_ptr<transport::Channel>> channels_ GUARDED_BY(data_mu_);
  std::vector<std::unique_ptr<session::ChannelPump>> pumps_ GUARDED_BY(data_mu_);
  // Guards channels_, pumps_ and link_ (the pointers; qmp_ is the worker's alone, its client
  // thread-safe). Taken today by the worker thread (set-up of channels, pumps and link,
  // refresh_data_counters, channel_failure, abort_data_plane, release_resources) and by the
  // source's accept thread (its pumps), and the worker also reads link_ unlocked between
  // those points as its only writer (so link_ carries no GUARDED_BY: the analysis cannot
  // state "written under the lock by the one thread that reads it without"). Calls into the
  // pumps and channels (their own locks) under it, including the final p->wait(5s) of each
  // pump. Lock order: TargetJob::conn_mu_ -> data_mu_; released before status_mu_ is taken.
  mutable Mutex data_mu_;  // guards channels_/pumps_ growth against abort from other threads
  // channels_ as FailoverChannels (the same objects), once wrap_for_failover() ran.
  std::vector<session::FailoverChannel*> failover_channels_ GUARDED_BY(data_mu_);
  // What retired pumps carried (bytes up, down, chunks up, down), counted on in the status.
  std::array<uint64_t, 4> retired_counts_ GUARDED_BY(data_mu_){};

  std::thread worker_;
  // Guards worker_'s join alone (no other member): the manager's reaper thread and the
  // destructor (stop_worker) may both join. Nothing else is taken under it.
  Mutex join_mu_;  // the owner's reaper and the destructor may both join

 private:
  // Guards status_, cancel_reason_, postcopy_agreed_, metrics_finished_ and watched_fds_ (cancel_requested_ is
  // atomic, set under it); status_cv_ signals a phase change. Taken by REST threads (status,
  // finished, wait_finished, request_cancel), the worker (update, set_phase, finish), the
  // data-plane threads through update() and CancelWatch. Lock order: TargetJob::conn_mu_ ->
  // status_mu_; request_cancel shuts the watched sockets down under it; never held with
  // data_mu_.
  mutable Mutex status_mu_;
  mutable std::condition_variable status_cv_;
  MigrationStatus status_ GUARDED_BY(status_mu_);
  std::atomic<bool> cancel_requested_{false};
  std::string cancel_reason_ GUARDED_BY(status_mu_);
  bool postcopy_agreed_ GUARDED_BY(status_mu_) = false;
  bool metrics_finished_ GUARDED_BY(status_mu_) = false;
  std::vector<int> watched_fds_ GUARDED_BY(status_mu_);
  // Channels that failed over off their RDMA rail, to another rail (its number) or to TCP
  // (nullopt), in order, not yet applied: the next refresh_data_counters moves each in
  // status_.rails (session::move_channel_off_rail) with its totals then (within a second of the
  // failover). The matched rails set_rails() was given, for that.
  std::vector<std::pair<uint32_t, std::optional<uint32_t>>> rail_moves_ GUARDED_BY(status_mu_);
  std::vector<session::RailPair> rail_pairs_for_status_ GUARDED_BY(status_mu_);
};

}  // namespace rdmig::migration
