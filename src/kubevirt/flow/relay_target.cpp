#include "kubevirt/flow/relay.h"

#include <sys/socket.h>

#include "common/log.h"
#include "common/units.h"
#include "kubevirt/flow/libvirt_stats.h"
#include "kubevirt/flow/relay_internal.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"

namespace rdmig::kubevirt {

using nlohmann::json;
using namespace std::chrono_literals;
using namespace relay_internal;

// ---- target side ----

void KubevirtRelay::on_flow_hello(UniqueFd fd, const json& raw) {
  auto reject = [&](const std::string& code, const std::string& msg) {
    transport::send_reject(fd.get(), code, msg);
  };
  if (!config_.kubevirt.enabled) return reject("failed_precondition", "KubeVirt mode is off on this agent");
  auto hello = session::Hello::parse(raw, session::Purpose::kFlow);
  if (!hello) return reject("invalid_argument", hello.error().message);
  // The source chooses chunkSize and ringDepth: one channel that can never fit this agent's
  // budget is refused here (the channels are then admitted one by one as they come).
  if (const uint64_t one = flow_channel_buffers(hello->chunk_size, hello->ring_depth,
                                               hello->failover && config_.data_plane.failover);
      one > config_.migration.buffer_budget) {
    return reject("unprocessable", "buffers: one channel of chunkSize " + format_quantity(hello->chunk_size) +
                                       " x ringDepth " + std::to_string(hello->ring_depth) + " x " +
                                       (hello->failover && config_.data_plane.failover ? "3" : "2") + " = " +
                                       format_quantity(one) + ", budget " +
                                       format_quantity(config_.migration.buffer_budget) + " (migration.bufferBudget)");
  }
  {
    MutexLock lock(mu_);
    if (targets_.size() >= kMaxTargetSessions) return reject("resource_exhausted", "too many KubeVirt sessions");
    if (targets_.contains(hello->session)) return reject("already_exists", "session exists");
  }
  // In the table before the welcome goes out (the source may dial its first channel as soon as
  // it reads it); the check and the insert under one lock (two hellos of one session: one wins).
  auto publish = [this](const std::shared_ptr<TargetSession>& t) -> Status {
    MutexLock lock(mu_);
    if (targets_.size() >= kMaxTargetSessions) return Error{Errc::kResourceExhausted, "too many KubeVirt sessions"};
    if (!targets_.emplace(t->id(), t).second) return Error{Errc::kAlreadyExists, "session exists"};
    return ok_status();
  };
  // The target launcher runs before KubeVirt starts the source (TargetReady): seen now, its
  // absence after the last byte means the target pod went away.
  const bool launcher_here = !hello->vmi.uid.empty() && launcher_present(config_.kubevirt, launchers_, hello->vmi);
  auto session = TargetSession::accept(
      ctx_, std::move(fd), hello.value(), [this](const session::Hello& h) { return admit_session(h); },
      [this, launcher_here](const VmiRef& vmi) {
        return read_completed_job(config_.kubevirt, launchers_, vmi, 10s, launcher_here);
      },
      publish);
  if (!session) {
    LOG_WARN("kubevirt") << "refused a session from a peer agent: " << session.error().message;
    return;
  }
  std::shared_ptr<TargetSession> s = session.value();
  s->start();
  LOG_INFO("kubevirt") << "target: session=" << s->id() << " migration " << hello->migration_uid << " of "
                       << (hello->vmi.name.empty() ? std::string("(static)") : hello->vmi.key()) << " from "
                       << hello->source_node << " over " << s->record().transport;
}

void KubevirtRelay::on_flow_data(UniqueFd fd, const json& raw) {
  auto hello = session::Hello::parse(raw, session::Purpose::kFlow);
  if (!hello) {
    transport::send_reject(fd.get(), "invalid_argument", hello.error().message);
    return;
  }
  std::shared_ptr<TargetSession> s;
  {
    MutexLock lock(mu_);
    auto it = targets_.find(hello->session);
    if (it != targets_.end()) s = it->second;
  }
  if (!s) {
    transport::send_reject(fd.get(), "permission_denied", "unknown data-plane session");
    return;
  }
  // The session id travels in clear: the channel proves the session's key (known only to the two
  // agents that proved the token) before it takes an index or any of the buffer budget.
  // A re-dialled control link proves the key over its own index (no data channel has it).
  const uint32_t proved = hello->control ? transport::kControlIndex : hello->index;
  auto welcome_proof = transport::check_channel(fd.get(), s->channel_terms(proved), hello->nonce,
                                                session::kHelloTimeout);
  if (!welcome_proof) {
    metrics_.transport_error("tcp", "auth");
    LOG_WARN("kubevirt") << "session=" << s->id() << " refused a channel from " << net::peer_address(fd.get())
                         << ": " << welcome_proof.error().message;
    return;
  }
  if (hello->control) {
    (void)s->resume_control_link(std::move(fd), welcome_proof.value());
    return;
  }
  if (hello->resume) {
    (void)s->resume_tcp_channel(std::move(fd), hello->index, welcome_proof.value(), hello->tls);
    return;
  }
  (void)s->add_tcp_channel(std::move(fd), hello->index, welcome_proof.value(), hello->tls);
}

Result<transport::rdma::AcceptPlan> KubevirtRelay::resolve_rdma(const transport::rdma::ConnectRequest& request) {
  const std::string id = to_hex(request.session.data(), request.session.size());
  std::shared_ptr<TargetSession> s;
  {
    MutexLock lock(mu_);
    auto it = targets_.find(id);
    if (it == targets_.end()) return Error{Errc::kPermissionDenied, "not a KubeVirt session"};
    s = it->second;
  }
  auto plan = s->rdma_plan(request);
  if (plan) {
    plan->deliver = [s, inner = std::move(plan->deliver)](Result<std::unique_ptr<transport::Channel>> ch) {
      inner(std::move(ch));
    };
  }
  return plan;
}

Result<NetnsLocator> KubevirtRelay::admit_session(const session::Hello& hello) {
  // Declined, not unhealthy: the source leaves this migration to KubeVirt's path.
  if (draining_.load()) {
    return Error{Errc::kFailedPrecondition, "agent draining: the rdmig agent on " + node_ +
                                                " is shutting down (an upgrade or a node drain) and takes no new session"};
  }
  NetnsLocator local = [this](const net::Endpoint& dst) { return dial_namespace(dst); };
  // A session for a migration to another node is not this agent's to carry, whoever proved
  // the token (errors that start with the hello's field name it to the peer too).
  if (!node_.empty() && hello.target_node != node_) {
    return Error{Errc::kFailedPrecondition,
                 "hello.targetNode: the session names node '" + hello.target_node + "', this agent runs on '" + node_ + "'"};
  }
  if (!vmi_api_) return local;  // discovery static: a virt-handler's address and listening port
  if (hello.mode != "hook") {
    // Static interception names no VMI: nothing to check against the API. Carried only where
    // this agent runs static mode too (then as without the API; docs/security.md).
    if (config_.kubevirt.static_mode) return local;
    return Error{Errc::kFailedPrecondition, "a static-mode session, and kubevirt.staticMode is off here: with "
                                            "discovery kubernetes only a migration the API confirms is carried"};
  }
  if (hello.vmi.name.empty() || hello.vmi.namespace_.empty() || hello.vmi.uid.empty()) {
    return Error{Errc::kFailedPrecondition, "a hook session that names no VMI"};
  }
  // One GET per session, at its hello: every channel's dial is checked against this answer.
  auto api = vmi_api_->get(hello.vmi);
  if (!api) return Error{Errc::kFailedPrecondition, api.error().message};
  auto published = published_target(api.value(), hello.vmi, hello.migration_uid, node_, hello.source_node);
  if (!published) return published.error();
  return NetnsLocator([this, pub = published.value(), mig = hello.migration_uid](
                          const net::Endpoint& dst) -> Result<std::shared_ptr<NetNs>> {
    if (!pub.allows(dst.host, dst.port)) {
      return Error{Errc::kPermissionDenied, dst.to_string() + " is not what the API published for migration " + mig +
                                                " (" + pub.describe() + ")"};
    }
    return dial_namespace(dst);
  });
}

Result<std::shared_ptr<NetNs>> KubevirtRelay::dial_namespace(const net::Endpoint& dst) {
  auto ns = handler_netns_owning(dst.host);
  if (!ns) {
    return Error{Errc::kPermissionDenied,
                 "no " + config_.kubevirt.handler_process + " on this node owns " + dst.host};
  }
  // Only a port virt-handler itself listens on there: its migration proxy's published ports
  // (not a port of another container in the pod, nor a sidecar's).
  if (!listens_on(handlers_.pids(), *ns, dst.port)) {
    return Error{Errc::kPermissionDenied, config_.kubevirt.handler_process + " does not listen on port " +
                                              std::to_string(dst.port) + " in " + ns->describe()};
  }
  return ns;
}

std::shared_ptr<NetNs> KubevirtRelay::handler_netns_owning(const std::string& ip) {
  {
    MutexLock lock(mu_);
    if (auto it = handler_ns_cache_.find(ip); it != handler_ns_cache_.end()) {
      if (netns_inode(it->second->pid()) == it->second->inode()) return it->second;
      handler_ns_cache_.erase(it);  // that virt-handler is gone
    }
  }
  for (pid_t pid : handlers_.pids()) {
    auto n = NetNs::of_pid(pid);
    if (!n) continue;
    auto ns = std::make_shared<NetNs>(std::move(n.value()));
    if (address_is_local(*ns, ip)) {
      MutexLock lock(mu_);
      handler_ns_cache_[ip] = ns;
      return ns;
    }
  }
  LOG_WARN("kubevirt") << "no " << config_.kubevirt.handler_process << " on this node owns " << ip;
  return nullptr;
}

}  // namespace rdmig::kubevirt
