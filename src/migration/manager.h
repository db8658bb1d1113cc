// The registry of this agent's bare-QEMU migration jobs. REST handlers call create/list/
// get/cancel; the data-plane server hands source agents' connections (hello kinds
// "control" and "data", RDMA sessions) to the target jobs registered here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "migration/job.h"
#include "session/data_plane_server.h"

namespace rdmig::migration {

// The QMP socket the agent may open for `path` (migrations, POST /v1/dirtyrate): every symlink
// resolved, under one of `roots` (migration.qmpSocketRoots, also resolved), never under /proc;
// kPermissionDenied or kFailedPrecondition naming qmpSocket otherwise.
Result<std::string> resolve_qmp_socket(const std::string& path, const std::vector<std::string>& roots);

class MigrationManager {
 public:
  // Registers its hello handlers and RDMA resolver with `server` (before server.start()).
  MigrationManager(const AgentConfig& config, Metrics& metrics, session::DataPlaneServer& server);
  ~MigrationManager();
  MigrationManager(const MigrationManager&) = delete;
  MigrationManager& operator=(const MigrationManager&) = delete;

  // At start-up, before the data plane serves: takes up the post-copy migrations whose records
  // (postcopy_record.h) this agent left in stateDir when it died. A record that is unreadable,
  // refused by its checks, older than its recovery deadline, or whose QEMU is gone is named in the
  // log and removed, never acted on; every other becomes a job again that checks its QEMU is
  // postcopy-paused and takes part in the recovery (docs/api.md "Post-copy recovery").
  void restore_postcopy_records();

  // Starts a migration; answers the REST body for 201 (target: endpoint and token).
  Result<nlohmann::json> create(MigrationSpec spec);
  std::vector<MigrationStatus> list() const;
  Result<MigrationStatus> get(const std::string& id) const;
  Result<MigrationStatus> cancel(const std::string& id);

  // The chunk buffers the bare-QEMU jobs hold or have reserved now (migration.bufferBudget).
  uint64_t buffer_bytes_in_use() const;
  // Buffers held by others on this agent (KubeVirt flows) that count against the same budget.
  void count_also(std::function<uint64_t()> others) { others_ = std::move(others); }

  // The first SIGTERM: no new migration from now on (create answers 503, "agent draining"),
  // the running ones go on to their end.
  void begin_drain() { draining_ = true; }
  // Cancels every active migration and waits up to `grace` for them to end (the drain's
  // time ran out, or a second signal).
  void shutdown(std::chrono::milliseconds grace);
  size_t active_count() const;

 private:
  void handle_hello(UniqueFd fd, const nlohmann::json& raw);
  JobContext job_context();
  std::shared_ptr<Job> find(const std::string& id) const EXCLUDES(mu_);
  // Drops the oldest finished jobs past the history size into `graveyard`, which the caller
  // destroys after releasing mu_ (destroying a job joins its worker).
  void evict_finished_locked(std::vector<std::shared_ptr<Job>>& graveyard) REQUIRES(mu_);
  // An id a job or a reservation has.
  bool taken_locked(const std::string& id) const REQUIRES(mu_);
  // Joins the workers of jobs that ended, as soon as they end (their sockets, channels and
  // buffers are already released by then): nothing but the status stays behind.
  void reaper_loop();
  Result<transport::rdma::AcceptPlan> rdma_lookup(const transport::rdma::ConnectRequest& request);

  const AgentConfig& config_;
  Metrics& metrics_;
  session::DataPlaneServer& server_;

  // Guards jobs_, order_, reserved_, reap_queue_ and reaper_stop_; reap_cv_ wakes the reaper.
  // Taken by REST (create, list, get, cancel, the counts), the data-plane accept threads and
  // the RDMA CM thread (find, rdma_lookup), each job's worker as it ends (on_worker_done),
  // reaper_ and shutdown. Released for create()'s QMP checks and for joining a worker.
  // Lock order: KubevirtRelay::budget_mu_ -> mu_ (others_ there is buffer_bytes_in_use) ->
  // PathCheckManager::mu_ -> PathCheck::mu_ (create() calls others_ under it), and mu_ ->
  // Job::status_mu_ (finished(), spec()).
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ GUARDED_BY(mu_);
  std::deque<std::string> order_ GUARDED_BY(mu_);  // creation order, for history eviction
  // Admitted migrations whose job is still being set up (QMP checks, outside the lock): they
  // count against maxConcurrent, the buffer budget, ids and QMP sockets like running ones.
  struct Reservation {
    std::string qmp_socket;
    uint64_t buffer_bytes = 0;
  };
  std::map<std::string, Reservation> reserved_ GUARDED_BY(mu_);
  std::function<uint64_t()> others_;  // set before serving
  std::atomic<bool> stopping_{false};
  std::atomic<bool> draining_{false};  // begin_drain(): create refuses, running jobs go on

  std::condition_variable reap_cv_;
  std::deque<std::string> reap_queue_ GUARDED_BY(mu_);  // ids whose worker has ended
  bool reaper_stop_ GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace rdmig::migration
