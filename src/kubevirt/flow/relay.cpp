#include "kubevirt/flow/relay.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "common/log.h"
#include "common/units.h"
#include "kubevirt/flow/libvirt_stats.h"
#include "kubevirt/flow/relay_internal.h"
#include "session/types.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

using nlohmann::json;
using namespace std::chrono_literals;
using namespace relay_internal;

KubevirtRelay::KubevirtRelay(const AgentConfig& config, Metrics& metrics, session::DataPlaneServer& server,
                             std::shared_ptr<TokenSource> token)
    : config_(config), metrics_(metrics), server_(server),
      ctx_{config, metrics, server.rdma(), std::move(token),
           [this](uint64_t bytes, const std::string& what) { return take_buffers(bytes, what); }},
      kmetrics_(metrics),
      handlers_(config.kubevirt.handler_process, config.kubevirt.discovery == "kubernetes"),
      launchers_(config.kubevirt.discovery == "kubernetes") {
  node_ = config.kubevirt.node_name;
  if (node_.empty()) {
    if (const char* n = std::getenv("NODE_NAME"); n && *n) node_ = n;
  }
  server_.add_handler(session::to_string(session::HelloKind::kProbe), [](UniqueFd fd, const json&) {
    (void)transport::send_message(fd.get(), session::message(session::MessageKind::kPong));
  });
  server_.add_handler(session::to_string(session::HelloKind::kFlow), [this](UniqueFd fd, const json& hello) { on_flow_hello(std::move(fd), hello); });
  server_.add_handler(session::to_string(session::HelloKind::kFlowData), [this](UniqueFd fd, const json& hello) { on_flow_data(std::move(fd), hello); });
  server_.add_rdma_resolver([this](const transport::rdma::ConnectRequest& r) { return resolve_rdma(r); });
}

KubevirtRelay::~KubevirtRelay() { stop(); }

Status KubevirtRelay::start() {
  auto peers = PeerDirectory::from_config(config_.kubevirt);
  if (!peers) return peers.error();
  peers_ = peers.value();
  if (config_.kubevirt.discovery == "kubernetes") {
    auto d = PeerDiscovery::start(config_, node_, peers_, handlers_, launchers_);
    if (!d) return d.error();
    discovery_ = std::move(d.value());
    auto api = VmiApi::create(config_.kubevirt, node_);
    if (!api) return api.error();
    vmi_api_ = std::move(api.value());
  }
  sweep_leftover_tables();
  last_turn_.store(std::chrono::steady_clock::now().time_since_epoch().count());
  maintenance_ = std::thread([this] { maintenance_loop(); });
  LOG_INFO("kubevirt") << "KubeVirt mode on node '" << node_ << "', peers from " << config_.kubevirt.discovery << (config_.kubevirt.static_mode ? ", static interception" : "");
  return ok_status();
}

namespace {
std::string armed_record_path(const AgentConfig& config) { return config.state_dir + "/kubevirt-armed-netns"; }
}  // namespace

void KubevirtRelay::sweep_leftover_tables() {
  // The namespaces an earlier agent on this node armed (stateDir, a hostPath, survives the
  // pod): a killed agent's table would redirect KubeVirt's connections to a listener that is
  // gone until its elements time out. Only those, and only while a virt-handler still lives in
  // them: another agent's namespaces (two nodes' agents on one test host) are never touched.
  std::set<uint64_t> recorded;
  {
    std::ifstream in(armed_record_path(config_));
    for (uint64_t inode = 0; in >> inode;) recorded.insert(inode);
  }
  std::set<uint64_t> seen;
  for (pid_t pid : handlers_.pids()) {
    const uint64_t inode = netns_inode(pid);
    if (!recorded.contains(inode) || !seen.insert(inode).second) continue;
    auto ns = NetNs::of_pid(pid);
    if (!ns) continue;
    auto removed = NftRules::remove_leftover(ns.value());
    if (!removed) {
      LOG_WARN("kubevirt") << "start-up sweep in " << ns->describe() << ": " << removed.error().message;
    } else if (removed.value()) {
      LOG_INFO("kubevirt") << "removed the redirect table an earlier agent left in " << ns->describe();
    }
  }
  std::ofstream(armed_record_path(config_), std::ios::trunc);  // this agent's own record starts empty
}

void KubevirtRelay::record_armed(uint64_t netns_inode) {
  std::ofstream out(armed_record_path(config_), std::ios::app);
  out << netns_inode << "\n";
  if (!out) {
    LOG_WARN("kubevirt") << "cannot record an armed namespace in " << armed_record_path(config_);
  }
}

void KubevirtRelay::stop() {
  if (stopping_.exchange(true)) return;
  // A worker between its predicate check and its wait holds stop_mu_: taking it once orders
  // stopping_ before that wait, so the wake-up is not lost (it would sleep out kAbortGrace).
  { MutexLock lock(stop_mu_); }
  stop_cv_.notify_all();
  discovery_.reset();
  if (maintenance_.joinable()) maintenance_.join();
  std::map<std::string, Active> sources;
  std::map<std::string, std::shared_ptr<TargetSession>> targets;
  std::map<uint64_t, std::shared_ptr<InterceptPoint>> points;
  std::map<std::string, Armed> armed;
  std::map<std::string, std::shared_ptr<SourceSession>> static_sessions;
  std::vector<Worker> workers;
  {
    // A hook call still arming sees stopping_ when it takes this lock and undoes its own work.
    MutexLock lock(mu_);
    sources.swap(sources_);
    targets.swap(targets_);
    armed.swap(armed_);
    static_sessions.swap(static_sessions_);
    points.swap(points_);
    workers.swap(workers_);
  }
  for (auto& [id, a] : sources) a.session->fail(Error{Errc::kCancelled, "agent shutting down"});
  for (auto& [id, t] : targets) t->fail(Error{Errc::kCancelled, "agent shutting down"});
  armed.clear();
  static_sessions.clear();
  points.clear();  // removes the redirect tables: KubeVirt's own path from now on
  for (auto& w : workers) {
    if (w.thread.joinable()) w.thread.join();
  }
}

Result<BufferTicket> KubevirtRelay::take_buffers(uint64_t bytes, const std::string& what) {
  MutexLock lock(budget_mu_);
  const uint64_t budget = config_.migration.buffer_budget;
  const uint64_t flows = flow_buffers_.load();
  const uint64_t others = others_ ? others_() : 0;
  if (bytes > budget || flows + others + bytes > budget) {
    return Error{Errc::kResourceExhausted,
                 "buffers: " + what + " needs " + format_quantity(bytes) + " with " + format_quantity(flows) +
                     " held by carried KubeVirt migrations and " + format_quantity(others) +
                     " by bare-QEMU ones, budget " + format_quantity(budget) + " (migration.bufferBudget)"};
  }
  flow_buffers_ += bytes;
  return BufferTicket(static_cast<void*>(this), [this, bytes](void*) { flow_buffers_ -= bytes; });
}

void KubevirtRelay::run_worker(std::function<void()> fn) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  MutexLock lock(mu_);
  // stop() sets stopping_ before it takes the workers under this lock: a worker started after
  // that would never be joined (std::terminate at exit). Whatever fn holds is released here.
  if (stopping_.load()) return;
  workers_.push_back(Worker{std::thread([fn = std::move(fn), done] {
                              fn();
                              done->store(true);
                            }),
                            done});
}

void KubevirtRelay::reap_workers() {
  std::vector<Worker> finished;
  {
    MutexLock lock(mu_);
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->done->load()) {
        finished.push_back(std::move(*it));
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& w : finished) w.thread.join();
}

// ---- records and maintenance ----

void KubevirtRelay::record_not_carried(FlowRecord record, const std::string& reason) {
  record.carried = false;
  record.phase = "NotCarried";
  record.reason = reason;
  record.started_at_ms = record.finished_at_ms = session::wall_clock_ms();
  kmetrics_.hook_call("skipped");
  kmetrics_.hook_not_carried(reason);
  LOG_INFO("kubevirt") << "hook: not carrying migration " << record.migration_uid << " of " << record.vmi.key() << ": "
                       << reason;
  MutexLock lock(mu_);
  remember_locked(record);
}

void KubevirtRelay::remember_locked(const FlowRecord& record) {
  kmetrics_.finished(record);
  history_.push_back(record);
  while (history_.size() > config_.migration.history_size) {
    FlowRecord old = std::move(history_.front());
    history_.pop_front();
    const bool newer = std::any_of(history_.begin(), history_.end(), [&](const FlowRecord& r) {
      return r.vmi.key() == old.vmi.key() && r.role == old.role;
    });
    if (!newer) kmetrics_.forget(old);
  }
}

std::vector<FlowRecord> KubevirtRelay::list(const RecordFilter& f) const {
  std::vector<FlowRecord> all;
  {
    MutexLock lock(mu_);
    all.assign(history_.begin(), history_.end());
    for (const auto& [id, a] : sources_) all.push_back(a.session->record());
    for (const auto& [id, t] : targets_) all.push_back(t->record());
  }
  std::vector<FlowRecord> out;
  for (auto& r : all) {
    if (!f.migration_uid.empty() && r.migration_uid != f.migration_uid) continue;
    if (!f.namespace_.empty() && r.vmi.namespace_ != f.namespace_) continue;
    if (!f.name.empty() && r.vmi.name != f.name) continue;
    out.push_back(std::move(r));
  }
  return out;
}

void KubevirtRelay::maintenance_loop() {
  while (!stopping_.load()) {
    maintain();
    MutexLock lock(stop_mu_);
    lock.wait_for(stop_cv_, 200ms, [&] { return stopping_.load(); });
  }
}

void KubevirtRelay::maintain() {
  const auto now = std::chrono::steady_clock::now();
  const auto idle = std::chrono::seconds(config_.kubevirt.session_idle_seconds);
  std::vector<std::shared_ptr<SourceSession>> to_finish;
  std::vector<std::shared_ptr<SourceSession>> draining;  // failed, multifd legs still draining
  struct Abort {
    VmiRef vmi;
    int64_t armed_at_ms;
    int64_t failed_at_ms;
  };
  std::vector<Abort> aborts;  // migrations that failed after carrying bytes
  std::vector<Armed> unarmed;  // elements of ended sessions: removed from nftables without the lock
  // 1. Snapshot under the lock, then look at each session without it: failing a session
  // resets and joins its legs, which must never hold up hook calls, interception or REST.
  std::vector<Active> sources;
  std::vector<std::shared_ptr<TargetSession>> targets;
  {
    MutexLock lock(mu_);
    for (const auto& [id, a] : sources_) sources.push_back(a);
    for (const auto& [id, t] : targets_) targets.push_back(t);
  }
  for (auto& a : sources) {
    auto& s = *a.session;
    if (s.ended() || a.finishing) continue;
    if (auto e = s.leg_error(); e && !s.ended()) {
      // Name the peer: over RDMA a dead agent is often seen first as a channel's disconnect.
      const Error named = e->with_context("carrying to the agent on " + s.peer_node());
      peers_.mark_unhealthy(s.peer_node(), named.message);
      s.fail(named);
    } else if (s.idle_for(idle)) {
      to_finish.push_back(a.session);
    } else if (s.leg_count() == 0 && now - a.armed_at > kArmedTtl) {
      s.fail(Error{Errc::kTimeout, "KubeVirt never connected within " +
                                       std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kArmedTtl).count()) +
                                       " s"});
    }
  }
  for (auto& t : targets) {
    if (auto e = t->leg_error(); e && !t->ended()) t->fail(e->with_context("carrying from the agent on " + t->record().source_node));
  }
  // 2. Book-keeping under the lock: nothing here waits for a session.
  {
    MutexLock lock(mu_);
    for (const auto& s : to_finish) {
      if (auto it = sources_.find(s->id()); it != sources_.end()) it->second.finishing = true;
    }
    for (auto it = sources_.begin(); it != sources_.end();) {
      auto& a = it->second;
      auto& s = *a.session;
      if (!s.ended()) {
        ++it;
        continue;
      }
      const FlowRecord r = s.record();
      if (r.phase == "Failed" && !stopping_.load()) {
        peers_.mark_unhealthy(s.peer_node(), r.reason);
        // Only a job this session carried bytes for: a session that expired or failed
        // before KubeVirt dialled broke nothing, and a later job of the VMI is not its own.
        if (!r.vmi.uid.empty() && r.bytes_sent + r.bytes_received > 0) {
          aborts.push_back(Abort{r.vmi, r.started_at_ms, r.finished_at_ms});
        }
      }
      for (auto ar = armed_.begin(); ar != armed_.end();) {
        if (ar->second.session == a.session) {
          unarmed.push_back(std::move(ar->second));
          ar = armed_.erase(ar);
        } else {
          ++ar;
        }
      }
      for (auto st = static_sessions_.begin(); st != static_sessions_.end();) {
        st = st->second == a.session ? static_sessions_.erase(st) : std::next(st);
      }
      remember_locked(r);
      if (s.draining()) draining.push_back(a.session);
      it = sources_.erase(it);
    }
    for (auto it = targets_.begin(); it != targets_.end();) {
      if (it->second->ended()) {
        remember_locked(it->second->record());
        it = targets_.erase(it);
      } else {
        ++it;
      }
    }
    kmetrics_.set_active(static_cast<double>(sources_.size() + targets_.size()));
  }
  // An ended session's elements go, unless a newer migration armed the same address and port
  // meanwhile (it owns the element now: InterceptPoint::elements_mu).
  for (const auto& a : unarmed) {
    MutexLock elements(a.point->elements_mu());
    bool rearmed = false;
    {
      MutexLock lock(mu_);
      rearmed = armed_.contains(key(a.ip, a.port));
    }
    if (!rearmed) (void)a.point->rules().uncarry(a.ip, a.port);
  }
  // The last references of ended sessions (and of pruned points) go here, outside the lock:
  // their destructors join threads and remove tables.
  unarmed.clear();
  sources.clear();
  targets.clear();
  for (auto& s : to_finish) {
    run_worker([this, s] {
      s->finish([this, vmi = s->record().vmi]() { return read_outgoing_completed_job(config_.kubevirt, launchers_, vmi); });
    });
  }
  for (auto& s : draining) {
    // Keeps the session (and its draining legs) alive off the maintenance thread; the
    // session's destructor then resets whatever is left.
    run_worker([this, s] {
      const auto until = std::chrono::steady_clock::now() + SourceSession::kMultifdDrainLimit + 1s;
      MutexLock lock(stop_mu_);
      while (s->draining() && std::chrono::steady_clock::now() < until) {
        if (lock.wait_for(stop_cv_, 100ms, [&] { return stopping_.load(); })) break;
      }
    });
  }
  for (auto& a : aborts) {
    run_worker([this, a] {
      {
        MutexLock lock(stop_mu_);
        if (lock.wait_for(stop_cv_, kAbortGrace, [&] { return stopping_.load(); })) return;
      }
      auto done = abort_outgoing_job(config_.kubevirt, launchers_, a.vmi, a.armed_at_ms, a.failed_at_ms);
      LOG_INFO("kubevirt") << "carrying " << a.vmi.key() << " failed: "
                           << (done ? done.value() : "nothing aborted: " + done.error().message);
    });
  }
  reap_workers();
  if (now - last_refresh_ >= std::chrono::seconds(std::max<uint32_t>(1, config_.kubevirt.rule_timeout_seconds / 3))) {
    last_refresh_ = now;
    refresh_rules();
    prune_points();
  }
  if (now - last_probe_ >= std::chrono::seconds(config_.kubevirt.probe_interval_seconds)) {
    last_probe_ = now;
    for (const auto& p : peers_.unhealthy()) {
      if (probe_peer(p.agent, 1s)) {
        peers_.mark_healthy(p.node);
        LOG_INFO("kubevirt") << "agent on " << p.node << " answers again: carrying migrations to it again";
      }
    }
  }
  last_turn_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

void KubevirtRelay::prune_points() {
  // A point whose namespace no virt-handler lives in any more (its pod was deleted, or
  // virt-handler restarted into a new pod: the next hook call makes a point there) holds that
  // namespace open through its fd, and its table and listener stay in it. Once nothing is
  // armed in it, it goes: its destructor stops the listener and removes the table (harmless
  // where the namespace has no process left; it is freed when the fd closes). Only points
  // that existed before the scan below are candidates: one made meanwhile is never taken for
  // stale.
  std::map<uint64_t, std::shared_ptr<InterceptPoint>> before;
  {
    MutexLock lock(mu_);
    if (points_.empty() && handler_ns_cache_.empty()) return;  // nothing to scan /proc for
    before = points_;
  }
  std::set<uint64_t> live;
  for (pid_t pid : handlers_.pids()) {
    if (const uint64_t inode = netns_inode(pid); inode != 0) live.insert(inode);
  }
  std::vector<std::shared_ptr<InterceptPoint>> stale;
  std::vector<uint64_t> removing;
  std::vector<std::shared_ptr<NetNs>> cached;
  {
    MutexLock lock(mu_);
    for (auto it = points_.begin(); it != points_.end();) {
      const auto was = before.find(it->first);
      const bool armed = std::any_of(armed_.begin(), armed_.end(), [&](const auto& a) { return a.second.point == it->second; });
      if (was == before.end() || was->second != it->second || live.contains(it->first) || armed ||
          ns_busy_.contains(it->first)) {
        ++it;
        continue;
      }
      // Busy until its table is gone: a hook call for this namespace waits for that, never
      // installs a table the removal would take with it.
      ns_busy_.insert(it->first);
      removing.push_back(it->first);
      stale.push_back(std::move(it->second));
      it = points_.erase(it);
    }
    // The target side's namespaces by address: the same, for the fd it holds.
    for (auto it = handler_ns_cache_.begin(); it != handler_ns_cache_.end();) {
      if (live.contains(it->second->inode())) {
        ++it;
      } else {
        cached.push_back(std::move(it->second));
        it = handler_ns_cache_.erase(it);
      }
    }
  }
  // This thread's references go now, so the worker below holds the last ones and the slow
  // removal runs there, not here.
  before.clear();
  if (stale.empty()) return;
  for (const auto& p : stale) {
    LOG_INFO("kubevirt") << "no " << config_.kubevirt.handler_process << " lives in " << p->ns().describe()
                         << " any more: removing its interception point and table";
  }
  // Removing a table is nftables work, which can take seconds: on a worker, so neither this
  // loop nor a hook call for another namespace waits for it.
  auto remove = [this, stale = std::move(stale), removing]() mutable {
    // The tables go now, while the namespaces are busy: a reference still held elsewhere (an
    // entry being unarmed, a refresh's snapshot) would otherwise remove the table later, under
    // a newer point made in the same namespace meanwhile (seen: a hook call's redirect gone, its
    // connections straight to the destination, kubevirt_relay in a suite run).
    for (const auto& p : stale) p->retire();
    stale.clear();
    {
      MutexLock lock(mu_);
      for (uint64_t inode : removing) ns_busy_.erase(inode);
    }
    ns_cv_.notify_all();
  };
  if (stopping_.load()) {
    remove();
  } else {
    run_worker(std::move(remove));
  }
}

size_t KubevirtRelay::active_sessions() const {
  MutexLock lock(mu_);
  size_t n = 0;
  for (const auto& [id, a] : sources_) n += a.session->ended() ? 0 : 1;
  for (const auto& [id, t] : targets_) n += t->ended() ? 0 : 1;
  return n;
}

bool KubevirtRelay::responsive(std::chrono::steady_clock::duration limit) const {
  const std::chrono::steady_clock::time_point last{std::chrono::steady_clock::duration(last_turn_.load())};
  return std::chrono::steady_clock::now() - last < limit;
}

}  // namespace rdmig::kubevirt
