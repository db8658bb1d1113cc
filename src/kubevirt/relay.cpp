#include "kubevirt/relay.h"

#include <sys/socket.h>

#include <cstdlib>

#include "common/log.h"
#include "kubevirt/libvirt_stats.h"
#include "migration/types.h"
#include "common/units.h"
#include "transport/wire.h"

namespace rdmig::kubevirt {

using nlohmann::json;
using namespace std::chrono_literals;

namespace {
constexpr auto kSessionOpenTimeout = 800ms;  // the hook must answer within a second
constexpr auto kArmedTtl = 10min;            // armed but never dialled: KubeVirt gave up or retried
constexpr size_t kMaxTargetSessions = 64;

std::string key(const std::string& ip, uint16_t port) { return ip + "|" + std::to_string(port); }

// Copies one direction until EOF, then passes the EOF on.
void copy_stream(int from, int to) {
  std::vector<char> buf(256 * 1024);
  for (;;) {
    const ssize_t n = ::recv(from, buf.data(), buf.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (!net::write_all(to, std::as_bytes(std::span(buf.data(), static_cast<size_t>(n))))) break;
  }
  ::shutdown(to, SHUT_WR);
}
}  // namespace

KubevirtRelay::KubevirtRelay(const AgentConfig& config, Metrics& metrics, migration::DataPlaneServer& server,
                             std::string token)
    : config_(config), metrics_(metrics), server_(server),
      ctx_{config, metrics, server.rdma(), std::move(token)}, kmetrics_(metrics) {
  node_ = config.kubevirt.node_name;
  if (node_.empty()) {
    if (const char* n = std::getenv("NODE_NAME"); n && *n) node_ = n;
  }
  server_.add_handler("probe", [](UniqueFd fd, const json&) {
    (void)transport::send_message(fd.get(), json{{"type", "pong"}});
  });
  server_.add_handler("flow", [this](UniqueFd fd, const json& hello) { on_flow_hello(std::move(fd), hello); });
  server_.add_handler("flow-data", [this](UniqueFd fd, const json& hello) { on_flow_data(std::move(fd), hello); });
  server_.add_rdma_resolver([this](const std::array<uint8_t, 16>& s, uint32_t i) { return resolve_rdma(s, i); });
}

KubevirtRelay::~KubevirtRelay() { stop(); }

Status KubevirtRelay::start() {
  auto peers = PeerDirectory::from_config(config_.kubevirt);
  if (!peers) return peers.error();
  peers_ = peers.value();
  if (config_.kubevirt.discovery == "kubernetes") {
    auto d = PeerDiscovery::start(config_, node_, peers_);
    if (!d) return d.error();
    discovery_ = std::move(d.value());
  }
  maintenance_ = std::thread([this] { maintenance_loop(); });
  LOG_INFO("kubevirt") << "KubeVirt mode on node '" << node_ << "', peers from " << config_.kubevirt.discovery << (config_.kubevirt.static_mode ? ", static interception" : "");
  return ok_status();
}

void KubevirtRelay::stop() {
  if (stopping_.exchange(true)) return;
  stop_cv_.notify_all();
  discovery_.reset();
  if (maintenance_.joinable()) maintenance_.join();
  std::map<std::string, Active> sources;
  std::map<std::string, std::shared_ptr<TargetSession>> targets;
  std::map<uint64_t, std::unique_ptr<InterceptPoint>> points;
  std::vector<Worker> workers;
  {
    std::lock_guard lock(mu_);
    sources.swap(sources_);
    targets.swap(targets_);
    armed_.clear();
    static_sessions_.clear();
    points.swap(points_);
    workers.swap(workers_);
  }
  for (auto& [id, a] : sources) a.session->fail(Error{Errc::kCancelled, "agent shutting down"});
  for (auto& [id, t] : targets) t->fail(Error{Errc::kCancelled, "agent shutting down"});
  points.clear();  // removes the redirect tables: KubeVirt's own path from now on
  for (auto& w : workers) {
    if (w.thread.joinable()) w.thread.join();
  }
}

void KubevirtRelay::run_worker(std::function<void()> fn) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::lock_guard lock(mu_);
  workers_.push_back(Worker{std::thread([fn = std::move(fn), done] {
                              fn();
                              done->store(true);
                            }),
                            done});
}

void KubevirtRelay::reap_workers() {
  std::vector<Worker> finished;
  {
    std::lock_guard lock(mu_);
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

// ---- source side: the hook and intercepted connections ----

HookDecision KubevirtRelay::pre_migration_source(const json& vmi, const std::string& node, pid_t caller_pid) {
  auto intent = parse_vmi(vmi);
  if (!intent) {
    kmetrics_.hook_call("error");
    LOG_WARN("kubevirt") << "hook: not carried: " << intent.error().message;
    return HookDecision{false, intent.error().message};
  }
  FlowRecord rec;
  rec.migration_uid = intent->migration_uid;
  rec.vmi = intent->vmi;
  rec.role = "source";
  rec.source_node = intent->source_node;
  rec.target_node = intent->target_node;
  rec.mode = "hook";
  const std::string here = node.empty() ? node_ : node;
  auto skip = skip_reason(intent.value(), here);
  std::optional<PeerInfo> peer;
  if (!skip) {
    peer = peers_.by_node(intent->target_node);
    if (!peer) {
      skip = "no rdmig agent known for node " + intent->target_node;
    } else if (!peer->healthy) {
      skip = "the path to the agent on " + peer->node + " is unhealthy (" + peer->unhealthy_reason +
             "): KubeVirt's own path until a probe succeeds";
    }
  }
  {
    // Idempotent: KubeVirt may call again for the same migration (retries of the same attempt).
    std::lock_guard lock(mu_);
    for (auto& [k, a] : armed_) {
      if (a.session->record().migration_uid == rec.migration_uid && !a.session->ended()) {
        kmetrics_.hook_call("carried");
        return HookDecision{true, ""};
      }
    }
  }
  if (skip) {
    record_not_carried(rec, *skip);
    return HookDecision{false, *skip};
  }
  // The namespace to intercept in: the hook caller's (virt-handler), else the only virt-handler.
  std::shared_ptr<NetNs> ns;
  if (caller_pid > 0) {
    auto n = NetNs::of_pid(caller_pid);
    if (n) ns = std::make_shared<NetNs>(std::move(n.value()));
  }
  if (!ns) {
    auto pids = processes_named(config_.kubevirt.handler_process);
    if (pids.size() == 1) {
      auto n = NetNs::of_pid(pids.front());
      if (n) ns = std::make_shared<NetNs>(std::move(n.value()));
    }
  }
  if (!ns) {
    const std::string why = "cannot find the network namespace of " + config_.kubevirt.handler_process +
                            " (hook caller pid " + std::to_string(caller_pid) + ")";
    record_not_carried(rec, why);
    return HookDecision{false, why};
  }
  auto session = SourceSession::open(ctx_, *peer, rec, kSessionOpenTimeout);
  if (!session) {
    peers_.mark_unhealthy(peer->node, session.error().message);
    const std::string why = "cannot reach the agent on " + peer->node + ": " + session.error().message;
    record_not_carried(rec, why);
    return HookDecision{false, why};
  }
  std::shared_ptr<SourceSession> s = std::move(session.value());
  std::lock_guard lock(mu_);
  auto point = point_for(ns);
  if (!point) {
    s->fail(point.error());
    record_not_carried(rec, point.error().message);
    return HookDecision{false, point.error().message};
  }
  const std::chrono::seconds ttl(config_.kubevirt.rule_timeout_seconds);
  for (uint16_t port : carried_ports(intent.value())) {
    if (auto st = point.value()->rules().carry(intent->target_address, port, ttl); !st) {
      s->fail(st.error());
      for (auto it = armed_.begin(); it != armed_.end();) it = it->second.session == s ? armed_.erase(it) : std::next(it);
      record_not_carried(rec, st.error().message);
      return HookDecision{false, st.error().message};
    }
    armed_[key(intent->target_address, port)] = Armed{intent->target_address, port, s, point.value()};
  }
  sources_[s->id()] = Active{s, std::chrono::steady_clock::now(), false};
  kmetrics_.hook_call("carried");
  LOG_INFO("kubevirt") << "hook: carrying migration " << rec.migration_uid << " of " << rec.vmi.key() << " to "
                       << rec.target_node << " (" << intent->target_address << ") over " << s->record().transport
                       << " session=" << s->id();
  return HookDecision{true, ""};
}

Result<InterceptPoint*> KubevirtRelay::point_for(std::shared_ptr<NetNs> ns) {
  auto it = points_.find(ns->inode());
  if (it != points_.end()) return it->second.get();
  auto p = InterceptPoint::create(ns, [this](UniqueFd fd, const net::Endpoint& dst, const NetNs& n) {
    on_connection(std::move(fd), dst, n);
  });
  if (!p) return p.error();
  auto* raw = p.value().get();
  points_[ns->inode()] = std::move(p.value());
  return raw;
}

void KubevirtRelay::on_connection(UniqueFd fd, const net::Endpoint& dst, const NetNs& ns) {
  std::shared_ptr<SourceSession> session;
  {
    std::lock_guard lock(mu_);
    if (auto it = armed_.find(key(dst.host, dst.port)); it != armed_.end() && !it->second.session->ended()) {
      session = it->second.session;
    } else if (auto st = static_sessions_.find(dst.host); st != static_sessions_.end() && !st->second->ended()) {
      session = st->second;
    }
  }
  if (!session && config_.kubevirt.static_mode) {
    auto peer = peers_.by_handler_address(dst.host);
    if (peer && peer->healthy) {
      FlowRecord rec;
      rec.role = "source";
      rec.mode = "static";
      rec.source_node = node_;
      rec.target_node = peer->node;
      rec.migration_uid = "static-" + random_hex(6);
      auto s = SourceSession::open(ctx_, *peer, rec, 2s);
      if (s) {
        session = std::move(s.value());
        std::lock_guard lock(mu_);
        static_sessions_[dst.host] = session;
        sources_[session->id()] = Active{session, std::chrono::steady_clock::now(), false};
      } else {
        peers_.mark_unhealthy(peer->node, s.error().message);
        LOG_WARN("kubevirt") << "static mode: agent on " << peer->node << " unreachable, passing through: "
                             << s.error().message;
      }
    }
  }
  if (!session) {
    pass_through(std::move(fd), dst, ns);
    return;
  }
  if (auto st = session->add_connection(std::move(fd), dst); !st) {
    peers_.mark_unhealthy(session->peer_node(), st.error().message);
    session->fail(st.error());
  }
}

void KubevirtRelay::pass_through(UniqueFd fd, const net::Endpoint& dst, const NetNs& ns) {
  auto out = ns.make_socket([&] { return net::tcp_connect(dst, 5s, [](int s) { return set_pass_mark(s); }); });
  if (!out) {
    LOG_WARN("kubevirt") << "pass-through to " << dst.to_string() << " failed: " << out.error().message;
    arm_reset(fd.get());
    return;
  }
  LOG_INFO("kubevirt") << "passing a connection to " << dst.to_string() << " through unchanged";
  auto a = std::make_shared<UniqueFd>(std::move(fd));
  auto b = std::make_shared<UniqueFd>(std::move(out.value()));
  run_worker([a, b] {
    std::thread back([a, b] { copy_stream(b->get(), a->get()); });
    copy_stream(a->get(), b->get());
    back.join();
  });
}

void KubevirtRelay::setup_static_mode() {
  // Our own virt-handler: a handler process whose namespace holds none of the peers' addresses.
  // Run on every refresh, so a restarted virt-handler (a new namespace) is intercepted too.
  const auto peer_addresses = peers_.handler_addresses();
  for (pid_t pid : processes_named(config_.kubevirt.handler_process)) {
    const uint64_t inode = netns_inode(pid);
    {
      std::lock_guard lock(mu_);
      if (inode == 0 || points_.contains(inode)) continue;
    }
    auto n = NetNs::of_pid(pid);
    if (!n) continue;
    auto ns = std::make_shared<NetNs>(std::move(n.value()));
    bool is_peer = false;
    for (const auto& a : peer_addresses) is_peer = is_peer || address_is_local(*ns, a);
    if (is_peer) continue;
    std::lock_guard lock(mu_);
    if (auto p = point_for(ns); !p) {
      LOG_WARN("kubevirt") << "static mode: " << p.error().message;
    }
  }
}

void KubevirtRelay::refresh_rules() {
  const std::chrono::seconds ttl(config_.kubevirt.rule_timeout_seconds);
  if (config_.kubevirt.static_mode) setup_static_mode();
  std::lock_guard lock(mu_);
  for (auto& [k, a] : armed_) {
    if (auto st = a.point->rules().carry(a.ip, a.port, ttl); !st) {
      LOG_WARN("kubevirt") << st.error().message;
    }
  }
  if (!config_.kubevirt.static_mode) return;
  for (const auto& peer_ip : peers_.handler_addresses()) {
    auto peer = peers_.by_handler_address(peer_ip);
    if (!peer || !peer->healthy) continue;  // unhealthy: let the element expire, KubeVirt's path resumes
    for (auto& [inode, p] : points_) {
      if (auto st = p->rules().peer(peer_ip, ttl); !st) {
        LOG_WARN("kubevirt") << st.error().message;
      }
    }
  }
}

// ---- target side ----

void KubevirtRelay::on_flow_hello(UniqueFd fd, const json& raw) {
  auto reject = [&](const std::string& code, const std::string& msg) {
    (void)transport::send_message(fd.get(), json{{"type", "reject"}, {"code", code}, {"message", msg}});
  };
  if (!config_.kubevirt.enabled) return reject("failed_precondition", "KubeVirt mode is off on this agent");
  auto hello = FlowHello::parse(raw);
  if (!hello) return reject("invalid_argument", hello.error().message);
  {
    std::lock_guard lock(mu_);
    if (targets_.size() >= kMaxTargetSessions) return reject("resource_exhausted", "too many KubeVirt sessions");
    if (targets_.contains(hello->session)) return reject("already_exists", "session exists");
  }
  auto session = TargetSession::accept(
      ctx_, std::move(fd), hello.value(), [this](const std::string& ip) { return handler_netns_owning(ip); },
      [this](const VmiRef& vmi) { return read_completed_job(config_.kubevirt, vmi, 10s); });
  if (!session) {
    LOG_WARN("kubevirt") << "refused a session from a peer agent: " << session.error().message;
    return;
  }
  std::shared_ptr<TargetSession> s = session.value();
  {
    std::lock_guard lock(mu_);
    targets_[s->id()] = s;
  }
  s->start();
  LOG_INFO("kubevirt") << "target: session=" << s->id() << " migration " << hello->migration_uid << " of "
                       << (hello->vmi.name.empty() ? std::string("(static)") : hello->vmi.key()) << " from "
                       << hello->source_node << " over " << s->record().transport;
}

void KubevirtRelay::on_flow_data(UniqueFd fd, const json& raw) {
  auto session = transport::get_string(raw, "session", "hello", 32);
  auto index = transport::get_uint(raw, "index", "hello", 0, transport::kMaxChannels - 1);
  std::shared_ptr<TargetSession> s;
  if (session && index) {
    std::lock_guard lock(mu_);
    auto it = targets_.find(session.value());
    if (it != targets_.end()) s = it->second;
  }
  if (!s) {
    (void)transport::send_message(fd.get(), json{{"type", "reject"}, {"code", "permission_denied"},
                                                 {"message", "unknown data-plane session"}});
    return;
  }
  (void)s->add_tcp_channel(std::move(fd), static_cast<uint32_t>(index.value()));
}

Result<transport::rdma::AcceptPlan> KubevirtRelay::resolve_rdma(const std::array<uint8_t, 16>& session, uint32_t index) {
  const std::string id = to_hex(session.data(), session.size());
  std::shared_ptr<TargetSession> s;
  {
    std::lock_guard lock(mu_);
    auto it = targets_.find(id);
    if (it == targets_.end()) return Error{Errc::kPermissionDenied, "not a KubeVirt session"};
    s = it->second;
  }
  auto plan = s->rdma_plan(index);
  if (plan) {
    plan->deliver = [s, inner = std::move(plan->deliver)](Result<std::unique_ptr<transport::Channel>> ch) {
      inner(std::move(ch));
    };
  }
  return plan;
}

std::shared_ptr<NetNs> KubevirtRelay::handler_netns_owning(const std::string& ip) {
  {
    std::lock_guard lock(mu_);
    if (auto it = handler_ns_cache_.find(ip); it != handler_ns_cache_.end()) {
      if (netns_inode(it->second->pid()) == it->second->inode()) return it->second;
      handler_ns_cache_.erase(it);  // that virt-handler is gone
    }
  }
  for (pid_t pid : processes_named(config_.kubevirt.handler_process)) {
    auto n = NetNs::of_pid(pid);
    if (!n) continue;
    auto ns = std::make_shared<NetNs>(std::move(n.value()));
    if (address_is_local(*ns, ip)) {
      std::lock_guard lock(mu_);
      handler_ns_cache_[ip] = ns;
      return ns;
    }
  }
  LOG_INFO("kubevirt") << "no " << config_.kubevirt.handler_process << " owns " << ip
                       << ": dialling it from the agent's own network namespace";
  return nullptr;
}

// ---- records and maintenance ----

void KubevirtRelay::record_not_carried(FlowRecord record, const std::string& reason) {
  record.carried = false;
  record.phase = "NotCarried";
  record.reason = reason;
  record.started_at_ms = record.finished_at_ms = migration::wall_clock_ms();
  kmetrics_.hook_call("skipped");
  LOG_INFO("kubevirt") << "hook: not carrying migration " << record.migration_uid << " of " << record.vmi.key() << ": "
                       << reason;
  std::lock_guard lock(mu_);
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
    std::lock_guard lock(mu_);
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
    std::unique_lock lock(stop_mu_);
    stop_cv_.wait_for(lock, 200ms, [&] { return stopping_.load(); });
  }
}

void KubevirtRelay::maintain() {
  const auto now = std::chrono::steady_clock::now();
  const auto idle = std::chrono::seconds(config_.kubevirt.session_idle_seconds);
  std::vector<std::shared_ptr<SourceSession>> to_finish;
  std::vector<VmiRef> aborts;  // carried migrations that failed: make libvirt fail now
  {
    std::lock_guard lock(mu_);
    for (auto it = sources_.begin(); it != sources_.end();) {
      auto& a = it->second;
      auto& s = *a.session;
      if (!s.ended() && !a.finishing) {
        s.poll();
        if (auto e = s.leg_error(); e && !s.ended()) {
          peers_.mark_unhealthy(s.peer_node(), e->message);
          s.fail(*e);
        } else if (s.idle_for(idle)) {
          a.finishing = true;
          to_finish.push_back(a.session);
        } else if (s.leg_count() == 0 && now - a.armed_at > kArmedTtl) {
          s.fail(Error{Errc::kTimeout, "KubeVirt never connected within " +
                                           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kArmedTtl).count()) + " s"});
        }
      }
      if (s.ended()) {
        const FlowRecord r = s.record();
        if (r.phase == "Failed" && !stopping_.load()) {
          peers_.mark_unhealthy(s.peer_node(), r.reason);
          if (!r.vmi.uid.empty()) aborts.push_back(r.vmi);
        }
        for (auto ar = armed_.begin(); ar != armed_.end();) {
          if (ar->second.session == a.session) {
            (void)ar->second.point->rules().uncarry(ar->second.ip, ar->second.port);
            ar = armed_.erase(ar);
          } else {
            ++ar;
          }
        }
        for (auto st = static_sessions_.begin(); st != static_sessions_.end();) {
          st = st->second == a.session ? static_sessions_.erase(st) : std::next(st);
        }
        remember_locked(r);
        it = sources_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = targets_.begin(); it != targets_.end();) {
      auto& t = *it->second;
      if (auto e = t.leg_error(); e && !t.ended()) t.fail(*e);
      if (t.ended()) {
        remember_locked(t.record());
        it = targets_.erase(it);
      } else {
        ++it;
      }
    }
    kmetrics_.set_active(static_cast<double>(sources_.size() + targets_.size()));
  }
  for (auto& s : to_finish) run_worker([s] { s->finish(); });
  for (auto& vmi : aborts) {
    run_worker([this, vmi] {
      auto done = abort_outgoing_job(config_.kubevirt, vmi);
      LOG_INFO("kubevirt") << "carrying " << vmi.key() << " failed: "
                           << (done ? done.value() : "nothing aborted: " + done.error().message);
    });
  }
  reap_workers();
  if (now - last_refresh_ >= std::chrono::seconds(std::max<uint32_t>(1, config_.kubevirt.rule_timeout_seconds / 3))) {
    last_refresh_ = now;
    refresh_rules();
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
}

}  // namespace rdmig::kubevirt
