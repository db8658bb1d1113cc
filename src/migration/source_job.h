// The source side of a migration: drives the running QEMU (capabilities, parameters,
// migrate, query-migrate), accepts QEMU's connections on a unix socket and pumps each into
// a data-plane channel to the target agent. Keeps the VM safe: any failure before the
// target confirms it has the VM ends in migrate_cancel (or cont) here.
#pragma once

#include <optional>

#include "common/fd.h"
#include "migration/job.h"
#include "migration/passes.h"
#include "session/rail_failover.h"

namespace rdmig::migration {

class SourceJob final : public Job {
 public:
  // Connects to QMP and checks the VM can be migrated; errors are the caller's (REST 4xx).
  static Result<std::unique_ptr<SourceJob>> create(MigrationSpec spec, JobContext ctx);
  // The job of a post-copy migration this agent ran before it restarted, from its record
  // (postcopy_record.h): connected to its QEMU's monitor, with the session's name and channel key,
  // switched. start_restored() then checks the QEMU is postcopy-paused and recovers (or reports
  // what it sees and touches nothing). An error when the QEMU's monitor cannot be reached.
  static Result<std::unique_ptr<SourceJob>> restore(const PostcopyRecord& record, JobContext ctx);
  ~SourceJob() override;
  void start();
  void start_restored();

 private:
  SourceJob(MigrationSpec spec, JobContext ctx, std::unique_ptr<qemu::QmpClient> qmp,
            bool was_running);
  void run();
  void run_restored();
  // From the migration's start (or its recovery) to its end: monitor(), recovered past the switch
  // where a lost link can be, then complete() or the failure.
  void monitor_to_end();
  PostcopyRecord make_record() const;
  // The session handshake and the dials (source_dial.cpp): control connection, welcome, channels.
  Status connect_data_plane();
  // One RDMA channel per QEMU connection to the target's rdmaEndpoint (from its welcome), each
  // within rdma.connectTimeoutSeconds; the first failure ends it (the caller falls back or fails).
  Status connect_rdma_channels(const nlohmann::json& welcome);
  // Failover (docs/failover.md): channel `index` re-dialled to the target agent over each path of
  // dataPlane.failoverPaths this migration allows, in order, until one resumes (this end's count
  // `taken`); one try, within `deadline`.
  Result<session::Resumed> redial(uint32_t index, uint64_t taken, std::chrono::steady_clock::time_point deadline);
  // Over TCP: re-dialled to the target's data port, proved, resumed and its TLS run again.
  Result<session::Resumed> redial_tcp(uint32_t index, uint64_t taken, std::chrono::steady_clock::time_point deadline);
  // Over a matched rail's address `spot` (rdma_cm to the target's address on it: its own, or an
  // alternate; proved in the connect request), resumed over the new channel itself (session/resume.h).
  Result<session::Resumed> redial_rail(uint32_t index, session::RailSpot spot, uint64_t taken,
                                       std::chrono::steady_clock::time_point deadline);
  // Failover of the control connection: re-dialled, proved (kControlIndex) and resumed (this end's
  // count of the target's messages `received`); one try, within `deadline`.
  Result<std::pair<UniqueFd, uint64_t>> redial_control(uint64_t received, std::chrono::steady_clock::time_point deadline);
  // The hello of TCP data channel `index` (resume: re-dialled to fail over).
  session::Hello data_hello(uint32_t index, bool resume) const;
  Status configure_qemu();
  Status start_migration();
  void accept_loop();
  // Polls QEMU until completed/failed/cancelled/timeout; returns the final info or an error.
  Result<qemu::MigrationInfo> monitor();
  // The source has (or may have) handed the VM over: only the target's verdict decides.
  // `unsure` says why the source cannot tell (its failure reasons then carry it).
  void complete(const qemu::MigrationInfo& info, const std::string& unsure = "");
  // The target's "result", waiting up to kVerdictTimeout, or kVerdictAfterMonitorLost once the
  // source QEMU's monitor is gone.
  Result<nlohmann::json> wait_for_verdict();
  // The target's reason on the control link ("abort", or a failed "result"), waiting up to
  // `wait`; nullopt when none came (or the target reported success: then left on the link).
  std::optional<Error> target_reason(std::chrono::milliseconds wait);
  // A message from the target during the migration: its "abort", or a failed "result", as the
  // error it is; a "result" is kept as the verdict (complete() reads it); nullopt otherwise.
  std::optional<Error> take_target_message(const nlohmann::json& msg);
  void fail_and_protect_vm(const Error& error, bool cancelled);
  // A failure after the switch to post-copy: the VM's state is split between the two QEMUs.
  void fail_in_postcopy(const Error& error);
  // After migrate-start-postcopy, whether the switch never took effect, so that the failure is a
  // pre-copy one (fail_and_protect_vm's usual path: the VM stays here, running): QEMU is still
  // in pre-copy ("active": its migration thread had not acted on the switch), or QEMU failed the
  // switch itself and runs the guest again ("failed" or "cancelled" with run state "running":
  // QEMU 10 does so when its stream breaks before the target QEMU has loaded the switch, seen in
  // cold run P). Waits up to 10 s while QEMU is in "device" (the switch's stop-and-copy). Returns
  // the state it saw for the reason. Anything else (post-copy, unreadable): nullopt.
  std::optional<std::string> postcopy_fell_through();
  // Post-copy recovery (migration/postcopy_recovery.h) after `why` ended monitor() past the switch:
  // kResumed (the migration goes on over a fresh channel: monitor again), kFinished (the job
  // ended: failed at the deadline, naming each QEMU's state), or kNotRecoverable (recovery off,
  // the target decided, or QEMU cannot be resumed: fail_in_postcopy as before).
  enum class Recovery { kResumed, kFinished, kNotRecoverable };
  Recovery recover_postcopy(const Error& why);
  // One try (`attempt`): a fresh control connection and channel 0 to the target agent
  // (hello.recover, proved with the session's keys), its "recover-ready" once its QEMU runs
  // migrate-recover, then migrate with resume: true on this QEMU through a fresh unix socket.
  // kPermissionDenied when the target refused (it no longer knows the session, or its QEMU cannot
  // be recovered): no further try.
  Status try_recovery(uint32_t attempt, std::chrono::steady_clock::time_point deadline);
  // A recovery's fresh connection: its control connection, or channel `index` (0, and with
  // postcopy-preempt the preempt channel).
  Result<UniqueFd> dial_recovery(bool control, uint32_t index, std::chrono::milliseconds left);
  void apply_progress(const qemu::MigrationInfo& info);
  // postCopy: issues migrate-start-postcopy once the spec's condition holds (pre-copy running for
  // `elapsed`); an error only when QEMU refuses the switch.
  Status maybe_switch_to_postcopy(const qemu::MigrationInfo& info, std::chrono::steady_clock::duration elapsed);
  // The switch agreement (docs/protocol.md): asks the target agent before the switch and waits for
  // its yes; its verdict (a cancel accepted there first) or silence is an error, and no switch.
  Status agree_switch_with_target(const std::string& trigger, int64_t pass);
  // The figures of a migration that switched, once it completed (phase length, page requests).
  void record_postcopy_end(const qemu::MigrationInfo& info);
  void stop_accepting();
  void release_own() override;
  void on_exception(const Error& error) override { fail_and_protect_vm(error, false); }

  const bool was_running_;
  std::string session_;      // the target's name for the session (no secret)
  std::string channel_key_;  // what every data channel proves (transport/channel_proof.h)
  std::string transport_;
  bool failover_ = false;  // both agents have dataPlane.failover on (the welcome confirmed it)
  // Where a failed channel may go (dataPlane.failoverPaths, as this migration allows): another
  // rail (RDMA, the target confirmed "failoverRails"), TCP (not when RDMA is required). Set before
  // any channel can fail over, read by the channels' failovers after.
  bool failover_rails_ = false;
  // Another address of the same rail's device (the target confirmed "failoverAddresses").
  bool failover_addresses_ = false;
  bool failover_tcp_ = false;
  std::vector<session::RailPair> rail_pairs_;  // the matched rails, RDMA only
  // The matched rail each channel runs over now (nullopt: TCP), changed by its failovers (each
  // channel's failover runs on one thread at a time; the lock for the status reader).
  Mutex rail_mu_;
  std::vector<std::optional<session::RailSpot>> channel_rail_ GUARDED_BY(rail_mu_);
  std::string socket_path_;
  UniqueFd listener_;
  std::thread acceptor_;
  std::atomic<bool> accepting_{false};
  uint64_t events_before_migrate_ = 0;
  std::optional<ClockOffset> clock_;  // the target host's clock minus this one's
  std::optional<nlohmann::json> verdict_;  // the target's result, when it came early
  // Set once migrate-start-postcopy succeeded: from then on the target runs the VM, and neither
  // QEMU can be resumed alone (no migrate_cancel, no cont; docs/api.md), unless QEMU shows that
  // the switch never took effect (postcopy_fell_through).
  bool postcopy_switched_ = false;
  // Passes over memory (migration/passes.h), from apply_progress(): what the post-copy switch acts on.
  PassCounter pass_counter_;
  uint64_t passes_ = 0;
  bool target_agrees_ = false;  // the target's ready offered the post-copy switch agreement
  std::chrono::steady_clock::time_point postcopy_at_{};
  bool target_decided_ = false;  // the target aborted or failed on purpose: never recovered (worker thread)
  std::optional<std::chrono::steady_clock::time_point> monitor_started_;
  std::chrono::steady_clock::duration paused_total_{};  // recovering, in all: not counted against completion
};

}  // namespace rdmig::migration
