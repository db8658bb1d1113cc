#include "kubevirt/flow/relay.h"

#include <sys/socket.h>

#include "common/log.h"
#include "common/units.h"
#include "kubevirt/flow/libvirt_stats.h"
#include "kubevirt/flow/relay_internal.h"
#include "transport/wire.h"

namespace rdmig::kubevirt {

using nlohmann::json;
using namespace std::chrono_literals;
using namespace relay_internal;

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
  // Who calls first (local and cheap): a process that is not virt-handler gets nothing, not
  // even a look-up in the API on its behalf.
  if (caller_pid > 0) {
    if (auto why = handlers_.refuse(caller_pid)) {
      const std::string reason = "the hook caller is not " + config_.kubevirt.handler_process + ": " + *why;
      record_not_carried(rec, reason);
      return HookDecision{false, reason};
    }
  }
  if (draining_.load()) {
    // KubeVirt's own path moves it: the migration still happens, just not through rdmig.
    const std::string reason = "agent draining: the rdmig agent on " + (node_.empty() ? node : node_) +
                               " is shutting down (an upgrade or a node drain); KubeVirt's own path";
    record_not_carried(rec, reason);
    return HookDecision{false, reason};
  }
  if (vmi_api_) {
    // The document is the caller's claim: with the API, only what KubeVirt published there is
    // armed (its node, address and ports, not the caller's). No session, no rule otherwise.
    auto confirmed = confirm_with_api(intent.value());
    if (!confirmed) {
      record_not_carried(rec, confirmed.error().message);
      return HookDecision{false, confirmed.error().message};
    }
    intent = std::move(confirmed);
    rec.source_node = intent->source_node;
  }
  const std::string here = node.empty() ? node_ : node;
  auto skip = skip_reason(intent.value(), here, config_.kubevirt.carry_post_copy);
  rec.post_copy.allowed = may_post_copy(intent.value());
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
    // A call that finds another one still arming the same migration waits for its outcome, so
    // concurrent calls make one session, never two (the check and the claim under one lock).
    MutexLock lock(mu_);
    const auto deadline = std::chrono::steady_clock::now() + kSessionOpenTimeout + 1s;
    while (arming_.contains(rec.migration_uid)) {
      if (lock.wait_until(hook_cv_, deadline) == std::cv_status::timeout) break;
    }
    if (arming_.contains(rec.migration_uid)) {
      kmetrics_.hook_call("error");
      return HookDecision{false, "another hook call is still arming migration " + rec.migration_uid};
    }
    for (auto& [k, a] : armed_) {
      if (a.session->record().migration_uid == rec.migration_uid && !a.session->ended()) {
        kmetrics_.hook_call("carried");
        return HookDecision{true, ""};
      }
    }
    if (!skip) arming_.insert(rec.migration_uid);
  }
  if (skip) {
    record_not_carried(rec, *skip);
    return HookDecision{false, *skip};
  }
  // Whatever this call decides, the claim ends with it.
  struct Unclaim {
    KubevirtRelay* relay;
    std::string uid;
    ~Unclaim() {
      {
        MutexLock lock(relay->mu_);
        relay->arming_.erase(uid);
      }
      relay->hook_cv_.notify_all();
    }
  } unclaim{this, rec.migration_uid};
  // The namespace to intercept in: the hook caller's, when it is virt-handler (by name, and by
  // its pod when the agent knows the virt-handler pods), else the only virt-handler.
  std::shared_ptr<NetNs> ns;
  if (caller_pid > 0) {
    auto n = NetNs::of_pid(caller_pid);
    if (n) ns = std::make_shared<NetNs>(std::move(n.value()));
  }
  if (!ns) {
    auto pids = handlers_.pids();
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
    // A peer that answered and declined this one migration (its API check) is not unhealthy.
    const bool declined = session.error().code == Errc::kFailedPrecondition;
    if (!declined) peers_.mark_unhealthy(peer->node, session.error().message);
    const std::string why = (declined ? "the agent on " + peer->node + " declined: "
                                      : "cannot reach the agent on " + peer->node + ": ") +
                            session.error().message;
    record_not_carried(rec, why);
    return HookDecision{false, why};
  }
  std::shared_ptr<SourceSession> s = std::move(session.value());
  if (rec.post_copy.allowed && !s->failover()) {
    // An agent from before failover, or with it off: a channel lost after the switch could not
    // be resumed, and the VM would pause on both nodes. KubeVirt's own path moves it instead.
    const std::string why = "post-copy is allowed for this migration and the agent on " + peer->node +
                            " did not confirm failover (dataPlane.failover): not carried";
    s->fail(Error{Errc::kFailedPrecondition, why});
    record_not_carried(rec, why);
    return HookDecision{false, why};
  }
  s->set_port_classes(intent->ports);
  // Arming enters virt-handler's namespace and talks to nftables there (the table when this
  // is the first migration in it, then one element per port), which can take seconds on a
  // busy node: none of it under mu_, which REST, interception, other hook calls and the
  // maintenance loop need. The claim in arming_ keeps other calls for this migration out.
  auto not_armed = [&](const Error& e) {
    s->fail(e);
    record_not_carried(rec, e.message);
    return HookDecision{false, e.message};
  };
  auto point = point_for(ns);
  if (!point) return not_armed(point.error());
  const std::shared_ptr<InterceptPoint> p = point.value();
  const std::chrono::seconds ttl(config_.kubevirt.rule_timeout_seconds);
  std::vector<uint16_t> carried;
  // From the first carry until the elements are recorded in armed_ (InterceptPoint::elements_mu):
  // an ended session's clean-up cannot remove them in between.
  MutexLock elements(p->elements_mu());
  auto uncarry_all = [&] {
    for (uint16_t port : carried) {
      bool owned = false;  // by another session of the same address and port: it keeps it
      {
        MutexLock lock(mu_);
        auto it = armed_.find(key(intent->target_address, port));
        owned = it != armed_.end() && it->second.session != s;
      }
      if (!owned) (void)p->rules().uncarry(intent->target_address, port);
    }
  };
  for (uint16_t port : carried_ports(intent.value())) {
    if (auto st = p->rules().carry(intent->target_address, port, ttl); !st) {
      uncarry_all();
      elements.unlock();
      return not_armed(st.error());
    }
    carried.push_back(port);
  }
  std::optional<Error> refused;
  {
    MutexLock lock(mu_);
    // stop() sets stopping_ before it takes what it tears down under this lock; and a point
    // pruned meanwhile (its virt-handler went away) is not armed in.
    if (stopping_.load()) {
      refused = Error{Errc::kCancelled, "agent shutting down"};
    } else if (auto it = points_.find(p->ns().inode()); it == points_.end() || it->second != p) {
      refused = Error{Errc::kUnavailable, "the network namespace of " + config_.kubevirt.handler_process +
                                              " went away while arming (" + p->ns().describe() + ")"};
    } else {
      for (uint16_t port : carried) armed_[key(intent->target_address, port)] = Armed{intent->target_address, port, s, p};
      sources_[s->id()] = Active{s, std::chrono::steady_clock::now(), false};
    }
  }
  if (refused) {
    uncarry_all();
    elements.unlock();
    return not_armed(*refused);
  }
  elements.unlock();
  kmetrics_.hook_call("carried");
  decide_multifd_on_failure(s);
  if (rec.post_copy.allowed) watch_postcopy_switch(s);
  LOG_INFO("kubevirt") << "hook: carrying migration " << rec.migration_uid << " of " << rec.vmi.key() << " to "
                       << rec.target_node << " (" << intent->target_address << ") over " << s->record().transport
                       << " session=" << s->id();
  return HookDecision{true, ""};
}

Result<MigrationIntent> KubevirtRelay::confirm_with_api(const MigrationIntent& caller) {
  auto api = vmi_api_->get(caller.vmi);
  if (!api && api.error().code == Errc::kNotFound) {
    return Error{Errc::kFailedPrecondition, "the API has no VMI " + caller.vmi.key() + " (deleted?): " + api.error().message};
  }
  if (!api) {
    return Error{Errc::kUnavailable, "cannot check the hook's VMI document against the API, KubeVirt's own path carries: " +
                                         api.error().message};
  }
  return confirm_hook_document(caller, api.value());
}

void KubevirtRelay::decide_multifd_on_failure(const std::shared_ptr<SourceSession>& s) {
  if (config_.kubevirt.multifd_on_failure != "auto") return;
  // Off the hook's thread (the hook answers within a second): libvirt is asked while KubeVirt
  // starts the job; the connections carried by then are switched over.
  run_worker([this, s, vmi = s->record().vmi] {
    auto v = launcher_qemu_version(config_.kubevirt, launchers_, vmi);
    if (!v) {
      LOG_INFO("kubevirt") << "session=" << s->id() << " QEMU version of " << vmi.key()
                           << "'s launcher unknown, its multifd connections drain on a failure: " << v.error().message;
      return;
    }
    s->set_multifd_on_failure(drain_multifd_for_qemu(v.value()), "qemu " + qemu_version_string(v.value()));
  });
}

void KubevirtRelay::watch_postcopy_switch(const std::shared_ptr<SourceSession>& s) {
  // libvirt is asked every kPostCopyWatchInterval until it shows the switch or the session ends:
  // the switch is KubeVirt's launcher's (MigrateStartPostCopy), never the agent's, and nothing
  // on the carried bytes says it (they are KubeVirt's TLS).
  run_worker([this, s, vmi = s->record().vmi] {
    std::string last_error;
    while (!s->ended() && !stopping_.load()) {
      auto switched = outgoing_switched_to_postcopy(config_.kubevirt, launchers_, vmi);
      if (switched && switched.value()) {
        s->note_postcopy_switch();
        return;
      }
      if (!switched && switched.error().message != last_error) {
        // Named once per distinct error: without libvirt's answer the record cannot show the switch.
        last_error = switched.error().message;
        LOG_INFO("kubevirt") << "session=" << s->id() << " post-copy watch of " << vmi.key()
                             << ": cannot read the domain's state: " << last_error;
      }
      MutexLock lock(stop_mu_);
      lock.wait_for(stop_cv_, kPostCopyWatchInterval, [&] { return stopping_.load(); });
    }
  });
}

Result<std::shared_ptr<InterceptPoint>> KubevirtRelay::point_for(std::shared_ptr<NetNs> ns) {
  const uint64_t inode = ns->inode();
  {
    MutexLock lock(mu_);
    const auto deadline = std::chrono::steady_clock::now() + kNamespaceBusyWait;
    // Another call making this namespace's point, or a stale point's table being removed
    // there: wait for that (bounded: nftables may be wedged), never for other namespaces.
    while (ns_busy_.contains(inode)) {
      if (lock.wait_until(ns_cv_, deadline) == std::cv_status::timeout) break;
    }
    if (ns_busy_.contains(inode)) {
      return Error{Errc::kUnavailable, "nftables in " + ns->describe() + " is still busy after " +
                                           std::to_string(kNamespaceBusyWait.count()) + " s"};
    }
    if (auto it = points_.find(inode); it != points_.end()) return it->second;
    ns_busy_.insert(inode);
  }
  struct Release {
    KubevirtRelay* relay;
    uint64_t inode;
    ~Release() {
      {
        MutexLock lock(relay->mu_);
        relay->ns_busy_.erase(inode);
      }
      relay->ns_cv_.notify_all();
    }
  } release{this, inode};
  auto made = InterceptPoint::create(ns, pass_mark(), config_.migration.chunk_size, [this](UniqueFd fd, const net::Endpoint& dst, const NetNs& n) {
    on_connection(std::move(fd), dst, n);
  });
  if (!made) return made.error();
  std::shared_ptr<InterceptPoint> point = std::move(made.value());
  bool kept = false;
  {
    MutexLock lock(mu_);
    if (!stopping_.load()) {
      points_[inode] = point;
      kept = true;
    }
  }
  // stop() already took the points: this one goes with the call (its table with it).
  if (!kept) return Error{Errc::kCancelled, "agent shutting down"};
  record_armed(inode);
  return point;
}

void KubevirtRelay::on_connection(UniqueFd fd, const net::Endpoint& dst, const NetNs& ns) {
  std::shared_ptr<SourceSession> session;
  {
    MutexLock lock(mu_);
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
        MutexLock lock(mu_);
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
  const PassMark mark = pass_mark();
  auto out = ns.make_socket([&] { return net::tcp_connect(dst, 5s, [mark](int s) { return set_pass_mark(s, mark); }); });
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
  for (pid_t pid : handlers_.pids()) {
    const uint64_t inode = netns_inode(pid);
    {
      MutexLock lock(mu_);
      if (inode == 0 || points_.contains(inode)) continue;
    }
    auto n = NetNs::of_pid(pid);
    if (!n) continue;
    auto ns = std::make_shared<NetNs>(std::move(n.value()));
    bool is_peer = false;
    for (const auto& a : peer_addresses) is_peer = is_peer || address_is_local(*ns, a);
    if (is_peer) continue;
    if (auto p = point_for(ns); !p) {
      LOG_WARN("kubevirt") << "static mode: " << p.error().message;
    }
  }
}

void KubevirtRelay::refresh_rules() {
  const std::chrono::seconds ttl(config_.kubevirt.rule_timeout_seconds);
  if (config_.kubevirt.static_mode) setup_static_mode();
  // Snapshot under the lock, then talk to nftables without it (hook calls, interception and
  // REST need the lock; the snapshot holds the points it names).
  std::vector<std::tuple<std::shared_ptr<InterceptPoint>, std::string, uint16_t>> elements;
  std::vector<std::shared_ptr<InterceptPoint>> points;
  {
    MutexLock lock(mu_);
    for (auto& [k, a] : armed_) elements.emplace_back(a.point, a.ip, a.port);
    for (auto& [inode, p] : points_) points.push_back(p);
  }
  for (auto& [point, ip, port] : elements) {
    auto st = point->rules().carry(ip, port, ttl);
    if (!st) {
      // The table is gone (someone flushed the namespace's ruleset): put it back, then the element.
      LOG_WARN("kubevirt") << st.error().message << ": reinstalling the redirect table in " << point->ns().describe();
      if (auto r = point->reinstall(); !r) {
        LOG_WARN("kubevirt") << r.error().message;
      } else if (auto again = point->rules().carry(ip, port, ttl); !again) {
        LOG_WARN("kubevirt") << again.error().message;
      }
    }
  }
  if (!config_.kubevirt.static_mode) return;
  for (const auto& peer_ip : peers_.handler_addresses()) {
    auto peer = peers_.by_handler_address(peer_ip);
    if (!peer || !peer->healthy) continue;  // unhealthy: let the element expire, KubeVirt's path resumes
    for (auto& p : points) {
      if (auto st = p->rules().peer(peer_ip, ttl); !st) {
        LOG_WARN("kubevirt") << st.error().message;
      }
    }
  }
}

}  // namespace rdmig::kubevirt
