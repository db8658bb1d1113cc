// The target side of a migration: holds the QEMU waiting with `-incoming defer`, accepts the
// source agent's control and data connections (token checked once), starts QEMU's incoming
// migration when the source says so, connects to QEMU in channel order, and reports the
// verdict (running, paused or failed) back to the source.
#pragma once

#include <condition_variable>
#include <map>
#include <set>

#include "common/fd.h"
#include "migration/job.h"
#include "session/redial_slots.h"
#include "transport/rdma/rdma_listener.h"
#include "transport/wire.h"

namespace rdmig::migration {

class TargetJob final : public Job {
 public:
  static Result<std::unique_ptr<TargetJob>> create(MigrationSpec spec, JobContext ctx);
  // The job of a post-copy migration this agent ran before it restarted, from its record
  // (postcopy_record.h): connected to its QEMU's monitor and admitting the session's recovery
  // connections (proved with the record's channel key). start_restored() then waits for the source
  // agent's recovery as recover_postcopy() does, or reports its QEMU's state and touches nothing
  // when that QEMU is not postcopy-paused. An error when the QEMU's monitor cannot be reached.
  static Result<std::unique_ptr<TargetJob>> restore(const PostcopyRecord& record, JobContext ctx);
  ~TargetJob() override;
  void start();
  void start_restored();

  const std::string& token() const { return token_; }
  // Called by the data-plane server's thread with a connection that said hello. Replies
  // (welcome or reject) on the connection; takes it over on success.
  // `proof`: the source's answer to `nonce` (transport::control_proof of this job's token).
  void on_control(UniqueFd fd, const session::Hello& hello, const std::string& nonce, const std::string& proof);
  // What TCP channel `index` of `session` must prove (transport/channel_proof.h);
  // kPermissionDenied when this job has no such TCP session.
  Result<transport::ChannelTerms> channel_terms(const std::string& session, uint32_t index) const;
  // A TCP channel whose proof was checked (`welcome_proof`: the acceptor's answer): admitted
  // when its index is free, refused otherwise.
  void on_data(UniqueFd fd, const session::Hello& hello, const std::string& welcome_proof);
  // For the agent's RDMA listener: checks the request's proof, then says how to build its
  // channel and where it goes.
  Result<transport::rdma::AcceptPlan> rdma_plan(const transport::rdma::ConnectRequest& request);

 private:
  // The key, the sizes and the metrics of channel `index` over RDMA (its deliver left to the caller).
  transport::rdma::AcceptPlan channel_plan(uint32_t index) REQUIRES(conn_mu_);
  // rdma_plan for a channel already running (its proof checked): a rail failover's re-dial, handed
  // to the channel's failover (redials_) once connected; refused unless the channel fails over.
  Result<transport::rdma::AcceptPlan> rdma_redial_plan(const transport::rdma::ConnectRequest& request)
      REQUIRES(conn_mu_);
  TargetJob(MigrationSpec spec, JobContext ctx, std::unique_ptr<qemu::QmpClient> qmp);
  void run();
  void run_restored();
  // From the pumps' start (or a recovery) to the migration's end: monitor(), recovered past the
  // switch where a lost link can be, then the verdict to the source.
  void monitor_to_end();
  PostcopyRecord make_record();
  Status wait_for_source();
  // While waiting for the channels: the source's "fallback" (RDMA to this agent failed: carry
  // the migration over TCP instead) or "abort". Called with conn_mu_ held.
  Status on_early_message(const nlohmann::json& message) REQUIRES(conn_mu_);
  Status start_incoming();
  Result<UniqueFd> open_qemu_connection(uint32_t index);
  // Failover (docs/failover.md): waits until `deadline` for the source to re-dial channel `index`
  // (on_data with hello.resume puts the connection in redials_), then resumes it (this end's
  // count `taken`) and runs its TLS again.
  Result<session::Resumed> reaccept(uint32_t index, uint64_t taken, std::chrono::steady_clock::time_point deadline,
                                    const std::function<bool()>& stopped);
  // What reaccept() and reaccept_control() share: waits until `deadline` for the connection the
  // source re-dialled for `index` (a channel's, or transport::kControlIndex for the control
  // connection; on_data puts it in redials_), takes it, and runs the resume exchange over that
  // index's terms with this end's `count` (session::RedialSlots::take).
  Result<session::RedialSlots::Redialled> take_redial(uint32_t index, uint64_t count,
                                                      std::chrono::steady_clock::time_point deadline,
                                                      const std::function<bool()>& stopped);
  // Channel `index`'s terms (its proof and TLS identity) in this job's session.
  transport::ChannelTerms channel_terms(uint32_t index) EXCLUDES(conn_mu_);
  // Failover of the control connection: waits until `deadline` for the source to re-dial it
  // (on_data puts it in redials_), then resumes it (this end's count `received`).
  Result<std::pair<UniqueFd, uint64_t>> reaccept_control(uint64_t received, std::chrono::steady_clock::time_point deadline,
                                                         const std::function<bool()>& stopped);
  Status monitor();
  // Tells the source the verdict; on failure whether resuming the source is safe.
  void report_failure(const Error& error, bool cancelled, bool incoming_started);
  void report_success();
  // Why the source side is gone, if it is (control link closed or aborted, a channel's peer
  // lost), waiting up to `wait` for the news to arrive.
  std::optional<std::string> source_gone(std::chrono::milliseconds wait);
  // The source agent's "abort" on the control link, waiting up to `wait`; nullopt when none came.
  std::optional<Error> source_reason(std::chrono::milliseconds wait);
  void release_own() override;
  // Post-copy recovery (migration/postcopy_recovery.h) after `why` ended monitor() past the switch:
  // retires the data plane, waits for this QEMU to pause, then for the source's fresh control
  // connection and "recover": runs migrate-recover on a fresh unix socket, attaches the source's
  // fresh channel 0 to it and answers "recover-ready"; again for each try until
  // migration.postCopyRecoverySeconds. As SourceJob::recover_postcopy.
  enum class Recovery { kResumed, kFinished, kNotRecoverable };
  Recovery recover_postcopy(const Error& why);
  // One try on the control connection `link` (the source's "recover" is next on it).
  Status try_recovery(std::unique_ptr<session::ControlLink> link, uint32_t attempt,
                      std::chrono::steady_clock::time_point deadline);
  // The post-copy figures this QEMU gives (status, and the source through the result).
  void record_postcopy(const qemu::MigrationInfo& info);
  void on_exception(const Error& error) override { report_failure(error, false, incoming_started_); }

  std::string token_;
  std::string session_ GUARDED_BY(conn_mu_);      // names the session (in clear on the wire)
  std::string channel_key_ GUARDED_BY(conn_mu_);  // what its channels prove, from the token and both nonces
  transport::ProofLedger rdma_proofs_;
  std::string socket_path_;
  std::string transport_ GUARDED_BY(conn_mu_);
  std::string transport_reason_ GUARDED_BY(conn_mu_);
  std::string source_address_ GUARDED_BY(conn_mu_);  // the source agent's control connection came from here
  bool verify_chunks_ GUARDED_BY(conn_mu_) = false;  // from the source's hello, set with transport_
  bool failover_ GUARDED_BY(conn_mu_) = false;  // confirmed in the welcome (both agents have dataPlane.failover on)
  // Confirmed in the welcome too ("failoverRails"): a channel's re-dial may come over another rail
  // (an rdma_cm connect request for a live channel, rdma_plan). With the rail each came over.
  bool failover_rails_ GUARDED_BY(conn_mu_) = false;
  // And "failoverAddresses": over another address of a rail's device (this agent's alternates).
  bool failover_addresses_ GUARDED_BY(conn_mu_) = false;
  std::vector<session::RailPair> rail_pairs_ GUARDED_BY(conn_mu_);  // the matched rails (RDMA), from the hello
  // The RDMA channels were handed to the pumps (wait_for_source): from then on a connect request
  // for a channel is a re-dial.
  bool rdma_started_ GUARDED_BY(conn_mu_) = false;

  // Guards the fields the data-plane server hands over: token_used_, control_, data_fds_,
  // data_tls_, data_admitting_, rdma_channels_, rdma_error_, data_received_, and session_,
  // channel_key_, transport_, transport_reason_, verify_chunks_ and failover_ (set in on_control; the
  // worker reads them under it too, nothing writes them once wait_for_source() returned).
  // rdma_proofs_ has its own lock. conn_cv_ signals a hand-over. Taken by the
  // data-plane accept threads (on_control, on_data, channel_terms), the RDMA CM thread
  // (rdma_plan and its deliver) and the worker (wait_for_source, on_early_message,
  // release_own). Lock order: conn_mu_ -> data_mu_ (wait_for_source), conn_mu_ ->
  // status_mu_ (update, set_phase), conn_mu_ -> ControlLink's locks (control_ under it).
  mutable Mutex conn_mu_;  // guards the fields the data-plane server hands over
  std::condition_variable conn_cv_;
  bool token_used_ GUARDED_BY(conn_mu_) = false;
  std::unique_ptr<session::ControlLink> control_ GUARDED_BY(conn_mu_);  // from the source's hello until the channels are there
  std::vector<UniqueFd> data_fds_ GUARDED_BY(conn_mu_);
  // dataPlane.tls: each channel's TLS stream (made on data_fds_[i]); an index is in
  // data_admitting_ while its handshake runs without the lock.
  std::vector<std::unique_ptr<transport::TlsStream>> data_tls_ GUARDED_BY(conn_mu_);
  std::set<uint32_t> data_admitting_ GUARDED_BY(conn_mu_);
  std::vector<std::unique_ptr<transport::Channel>> rdma_channels_ GUARDED_BY(conn_mu_);
  std::optional<Error> rdma_error_ GUARDED_BY(conn_mu_);
  uint32_t data_received_ GUARDED_BY(conn_mu_) = 0;
  // Failover: a proved connection per channel (or the control connection) the source re-dialled,
  // until reaccept() or reaccept_control() takes it. Its own lock (after conn_mu_ in on_data).
  session::RedialSlots redials_;
  // Post-copy recovery: admitted once this QEMU's incoming post-copy migration started; the fresh
  // connections (hello.recover) the source dialled, until recover_postcopy() takes them.
  bool recovery_open_ GUARDED_BY(conn_mu_) = false;
  UniqueFd recover_control_fd_ GUARDED_BY(conn_mu_);
  // The try's channels by index: 0, and with postcopy-preempt the preempt channel.
  std::map<uint32_t, UniqueFd> recover_data_fds_ GUARDED_BY(conn_mu_);
  std::atomic<bool> recover_asked_{false};  // a recovery connection came: the source lost the link
  bool source_decided_ = false;  // the source aborted on purpose: never recovered (worker thread)
  std::chrono::steady_clock::duration paused_total_{};  // recovering, in all (worker thread)

  // Guards next_qemu_index_ and order_aborted_; order_cv_ signals the next turn. Each pump's
  // opener (open_qemu_connection, on the pumps' threads) waits for its turn under it and
  // connects to QEMU's socket holding it (QEMU connections in channel order); the worker sets
  // order_aborted_ under it. Only status_mu_ (finished(): a turn that never comes once the job
  // ended, e.g. the preempt channel's eager opener when channel 0 never opened) is taken under it.
  Mutex order_mu_;  // QEMU connections in channel order
  std::condition_variable order_cv_;
  uint32_t next_qemu_index_ GUARDED_BY(order_mu_) = 0;
  bool order_aborted_ GUARDED_BY(order_mu_) = false;
  uint64_t events_before_incoming_ = 0;
  bool incoming_started_ = false;
  bool post_copy_ = false;  // the source's start asked for postcopy-ram (worker thread only)
  bool source_asks_ = false;  // and offered the switch agreement: it asks before it switches
};

}  // namespace rdmig::migration
