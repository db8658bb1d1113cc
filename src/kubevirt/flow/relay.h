// KubeVirt mode of the agent: rdmig as the transport under KubeVirt's own migration.
//   Source node: the node hook (PreMigrationSource) arms interception for one migration —
//     redirect rules in the source virt-handler's network namespace, a session with the
//     target node's agent — and each connection the proxy makes for it is carried as one
//     channel. In static mode (no hook) connections to peer virt-handlers are carried too.
//   Target node: sessions from peer agents dial the original destinations from inside the
//     target virt-handler's namespace, in the source's order, and read libvirt's figures.
// Owns: the interception points (one per virt-handler namespace), the sessions, the records
// (REST, metrics), and one maintenance thread that refreshes rule timeouts, ends idle
// sessions, fails broken ones and probes unhealthy peers. stop() tears everything down.
// Code: relay.cpp (life cycle, records, maintenance), relay_source.cpp (hook, interception,
// static mode), relay_target.cpp (sessions from peer agents).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <thread>

#include "kubevirt/hook/handler_identity.h"
#include "kubevirt/intercept/intercept.h"
#include "kubevirt/flow/kubevirt_metrics.h"
#include "kubevirt/peers/peer_discovery.h"
#include "kubevirt/peers/peers.h"
#include "kubevirt/flow/sessions.h"
#include "kubevirt/hook/vmi_api.h"
#include "session/data_plane_server.h"

namespace rdmig::kubevirt {

struct HookDecision {
  bool carried = false;
  std::string reason;  // why not, when not carried
};

struct RecordFilter {
  std::string migration_uid;
  std::string namespace_;
  std::string name;
};

class KubevirtRelay {
 public:
  // Registers the "flow", "flow-data" and "probe" hellos and the RDMA resolver with `server`.
  KubevirtRelay(const AgentConfig& config, Metrics& metrics, session::DataPlaneServer& server,
                std::shared_ptr<TokenSource> token);
  ~KubevirtRelay();
  KubevirtRelay(const KubevirtRelay&) = delete;
  KubevirtRelay& operator=(const KubevirtRelay&) = delete;

  // Peers from the config, static-mode interception, the maintenance thread. Call after the
  // data-plane server started (sessions need its RDMA support).
  Status start();
  void stop();

  // The hook's decision for one VMI; arms interception when it carries. `caller_pid` is the
  // hook caller's pid (SO_PEERCRED), whose network namespace is intercepted; 0 = unknown.
  HookDecision pre_migration_source(const nlohmann::json& vmi, const std::string& node, pid_t caller_pid);

  std::vector<FlowRecord> list(const RecordFilter& filter) const EXCLUDES(mu_);
  // Buffers held by others on this agent (the bare-QEMU jobs) that count against the same
  // migration.bufferBudget as the flows' channels; and the flows' own.
  void count_also(std::function<uint64_t()> others) { others_ = std::move(others); }
  uint64_t flow_buffer_bytes() const { return flow_buffers_.load(); }
  // Liveness: false when the maintenance loop has not finished a turn within `limit` (it
  // refreshes the redirect rules and fails broken sessions, every 200 ms). The probe port's
  // /healthz says so, and the kubelet restarts a wedged agent instead of calling it healthy.
  static constexpr std::chrono::seconds kWatchdogLimit{30};
  bool responsive(std::chrono::steady_clock::duration limit = kWatchdogLimit) const;
  const std::string& node_name() const { return node_; }
  // The first SIGTERM: the hook answers "not carried: agent draining" and a peer's new session
  // is declined (its source leaves the migration to KubeVirt's path); sessions already armed
  // or running go on to their end, their redirects in place until stop().
  void begin_drain() { draining_ = true; }
  bool draining() const { return draining_.load(); }
  // Sessions armed or running, both roles (what a drain waits for).
  size_t active_sessions() const EXCLUDES(mu_);

 private:
  void on_connection(UniqueFd fd, const net::Endpoint& dst, const NetNs& ns);
  void on_flow_hello(UniqueFd fd, const nlohmann::json& hello);
  void on_flow_data(UniqueFd fd, const nlohmann::json& hello);
  Result<transport::rdma::AcceptPlan> resolve_rdma(const transport::rdma::ConnectRequest& request);
  // The interception point of `ns`, created when there is none. Slow (a listener and the
  // nftables table inside the namespace): call it without mu_.
  Result<std::shared_ptr<InterceptPoint>> point_for(std::shared_ptr<NetNs> ns) EXCLUDES(mu_);
  void prune_points();
  std::shared_ptr<NetNs> handler_netns_owning(const std::string& ip);
  Result<std::shared_ptr<NetNs>> dial_namespace(const net::Endpoint& dst);
  // Target: where a session for `hello` may dial, checked against the API's VMI when there is
  // an API (one GET, at the hello); an error refuses the session before anything is dialled.
  Result<NetnsLocator> admit_session(const session::Hello& hello);
  // Source: the hook document as the API has it (discovery kubernetes), or why not carried.
  Result<MigrationIntent> confirm_with_api(const MigrationIntent& caller);
  void pass_through(UniqueFd fd, const net::Endpoint& dst, const NetNs& ns);
  PassMark pass_mark() const { return PassMark{config_.kubevirt.socket_mark, config_.kubevirt.socket_mark_mask}; }
  void record_not_carried(FlowRecord record, const std::string& reason) EXCLUDES(mu_);
  void remember_locked(const FlowRecord& record) REQUIRES(mu_);
  void maintenance_loop();
  void maintain();
  void refresh_rules();
  void setup_static_mode();
  void sweep_leftover_tables();
  void record_armed(uint64_t netns_inode);  // stateDir: what the start-up sweep looks at
  void run_worker(std::function<void()> fn) EXCLUDES(mu_);
  // kubevirt.multifdOnFailure "auto": asks the source launcher's libvirt for its QEMU version
  // (a worker) and sets what a failure of `s` does to its multifd connections.
  void decide_multifd_on_failure(const std::shared_ptr<SourceSession>& s);
  // A carried migration that may switch to post-copy (kubevirt.carryPostCopy): a worker asks the
  // source launcher's libvirt every kPostCopyWatchInterval whether the domain is paused for
  // post-copy, and marks the session switched once it is (FlowSession::note_postcopy_switch).
  static constexpr std::chrono::milliseconds kPostCopyWatchInterval{100};
  void watch_postcopy_switch(const std::shared_ptr<SourceSession>& s);
  Result<BufferTicket> take_buffers(uint64_t bytes, const std::string& what) EXCLUDES(mu_, budget_mu_);
  void reap_workers();

  const AgentConfig& config_;
  Metrics& metrics_;
  session::DataPlaneServer& server_;
  SessionContext ctx_;
  KubevirtMetrics kmetrics_;
  std::string node_;
  PeerDirectory peers_;
  HandlerIdentity handlers_;    // which processes are virt-handler (declared before discovery_)
  LauncherIdentity launchers_;  // which processes are a VMI's launcher (declared before discovery_)

  // Held only for book-keeping, never across nftables, namespace entry or a session's
  // teardown: hook calls, interception, REST (records) and the maintenance loop take it.
  // Guards ns_busy_, points_, armed_, arming_, static_sessions_, sources_, targets_,
  // handler_ns_cache_, history_ and workers_ (ns_cv_ and hook_cv_ wait on it). last_refresh_
  // and last_probe_ are the maintenance thread's own. Lock order: mu_ -> FlowSession::mu_ ->
  // legs_mu_ (record(), ended(), draining() of sessions under it), mu_ -> KubevirtMetrics::mu_
  // (remember_locked) and mu_ -> PeerDirectory::mu_ (mark_unhealthy); never taken under a
  // session's lock, budget_mu_ or stop_mu_.
  mutable Mutex mu_;
  // Namespaces (netns inodes) where a point is being made or a stale one's table removed, under
  // mu_: one at a time per namespace (a second install there would replace the first's table),
  // while work in one namespace never waits for nftables in another.
  std::set<uint64_t> ns_busy_ GUARDED_BY(mu_);
  std::condition_variable ns_cv_;  // an ns_busy_ entry went away
  // By netns inode. A point lives until stop(), or until no virt-handler lives in its
  // namespace and nothing is armed in it (prune_points); the last reference may be an Armed
  // entry or a hook call's, so it is never dropped under mu_.
  std::map<uint64_t, std::shared_ptr<InterceptPoint>> points_ GUARDED_BY(mu_);
  struct Armed {
    std::string ip;
    uint16_t port = 0;
    std::shared_ptr<SourceSession> session;
    std::shared_ptr<InterceptPoint> point;
  };
  std::map<std::string, Armed> armed_ GUARDED_BY(mu_);  // "ip|port"
  std::set<std::string> arming_ GUARDED_BY(mu_);        // migration uids a hook call is arming now
  std::condition_variable hook_cv_;     // an arming_ entry went away
  std::map<std::string, std::shared_ptr<SourceSession>> static_sessions_ GUARDED_BY(mu_);  // by destination ip
  struct Active {
    std::shared_ptr<SourceSession> session;
    std::chrono::steady_clock::time_point armed_at;
    bool finishing = false;
  };
  std::map<std::string, Active> sources_ GUARDED_BY(mu_);  // by session id
  std::map<std::string, std::shared_ptr<TargetSession>> targets_ GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<NetNs>> handler_ns_cache_ GUARDED_BY(mu_);  // target side, by address
  std::deque<FlowRecord> history_ GUARDED_BY(mu_);
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Worker> workers_ GUARDED_BY(mu_);  // finishing sessions, pass-through relays; reaped when done
  std::chrono::steady_clock::time_point last_refresh_{};
  std::chrono::steady_clock::time_point last_probe_{};

  std::unique_ptr<PeerDiscovery> discovery_;
  // discovery kubernetes: the API's VMI, against which hook documents and dialled ports are
  // checked (relay_source.cpp, relay_target.cpp); null with discovery static.
  std::unique_ptr<VmiApi> vmi_api_;
  std::function<uint64_t()> others_;  // set before serving
  // Serialises take_buffers' check and take of flow_buffers_ (the release, a ticket's
  // destructor, only subtracts, without it). Taken by sessions admitting a channel (data-plane
  // accept threads, the RDMA CM thread, the interception thread), often under a
  // TargetSession's conn_mu_; calls others_ (the migration and path-check managers' locks)
  // under it. Never held with mu_.
  Mutex budget_mu_;             // serialises take_buffers' check and take
  std::atomic<uint64_t> flow_buffers_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> draining_{false};  // begin_drain()
  std::atomic<std::chrono::steady_clock::rep> last_turn_{0};  // end of the last maintain()
  // Guards no member: the maintenance loop and the draining/abort workers wait on stop_cv_
  // under it for stopping_; stop() takes it once after setting stopping_, so no waiter misses
  // the wake-up (it would sleep out 200 ms, 100 ms, or kAbortGrace = 5 s for an abort worker,
  // which stop() then joins). The draining worker calls s->draining() (legs_mu_) under it.
  Mutex stop_mu_;
  std::condition_variable stop_cv_;
  std::thread maintenance_;
};

}  // namespace rdmig::kubevirt
