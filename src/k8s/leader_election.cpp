#include "k8s/leader_election.h"

#include "common/log.h"
#include "k8s/time_format.h"

namespace rdmig::k8s {

using nlohmann::json;
using steady = std::chrono::steady_clock;

LeaderElector::LeaderElector(KubeClient& client, LeaderElectionConfig config, std::function<void(bool)> on_change)
    : client_(client), config_(std::move(config)), on_change_(std::move(on_change)) {}

std::string LeaderElector::lease_path() const {
  return "/apis/coordination.k8s.io/v1/namespaces/" + config_.namespace_ + "/leases/" + config_.lease_name;
}

void LeaderElector::set_leading(bool v) {
  if (leading_.exchange(v) != v) {
    LOG_INFO("leader") << config_.identity << (v ? " became the leader" : " stopped leading")
                       << " (lease " << config_.namespace_ << "/" << config_.lease_name << ")";
    if (on_change_) on_change_(v);
  }
}

bool LeaderElector::try_acquire_or_renew() {
  const auto now_wall = Clock::now();
  const long duration_s =
      std::max<long>(1, static_cast<long>(std::chrono::duration_cast<std::chrono::seconds>(config_.lease_duration).count()));
  auto current = client_.get(lease_path());
  if (!current) {
    if (current.error().code != Errc::kNotFound) {
      LOG_WARN("leader") << "get lease: " << current.error().message;
      return false;
    }
    json lease{{"apiVersion", "coordination.k8s.io/v1"},
               {"kind", "Lease"},
               {"metadata", {{"name", config_.lease_name}, {"namespace", config_.namespace_}}},
               {"spec",
                {{"holderIdentity", config_.identity},
                 {"leaseDurationSeconds", duration_s},
                 {"acquireTime", format_micro_time(now_wall)},
                 {"renewTime", format_micro_time(now_wall)},
                 {"leaseTransitions", 0}}}};
    auto created = client_.create("/apis/coordination.k8s.io/v1/namespaces/" + config_.namespace_ + "/leases", lease);
    if (!created) {
      LOG_DEBUG("leader") << "create lease: " << created.error().message;
      return false;
    }
    return true;
  }
  json lease = current.value();
  json& spec = lease["spec"];
  if (!spec.is_object()) spec = json::object();
  const std::string holder = spec.value("holderIdentity", "");
  if (holder != config_.identity) {
    // Someone else's (or nobody's) lease: wait until it has not changed for its duration.
    const std::string record = spec.dump();
    if (record != observed_record_) {
      observed_record_ = record;
      observed_at_ = steady::now();
    }
    const long their_s = spec.value("leaseDurationSeconds", duration_s);
    const bool expired = holder.empty() || steady::now() - observed_at_ > std::chrono::seconds(their_s);
    if (!expired) return false;
    spec["leaseTransitions"] = spec.value("leaseTransitions", 0) + 1;
    spec["acquireTime"] = format_micro_time(now_wall);
  }
  spec["holderIdentity"] = config_.identity;
  spec["leaseDurationSeconds"] = duration_s;
  spec["renewTime"] = format_micro_time(now_wall);
  auto updated = client_.replace(lease_path(), lease);  // carries metadata.resourceVersion: 409 if raced
  if (!updated) {
    LOG_DEBUG("leader") << "update lease: " << updated.error().message;
    return false;
  }
  return true;
}

void LeaderElector::tick() {
  const bool ok = try_acquire_or_renew();
  if (ok) {
    last_renew_ = steady::now();
    set_leading(true);
  } else if (leading_.load() && steady::now() - last_renew_ > config_.renew_deadline) {
    set_leading(false);
  }
}

void LeaderElector::run() {
  while (!stopping_.load()) {
    tick();
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, config_.retry_period, [this] { return stopping_.load(); });
  }
  if (leading_.load()) {
    set_leading(false);
    release();
  }
}

void LeaderElector::release() {
  auto current = client_.get(lease_path());
  if (!current) return;
  json lease = current.value();
  if (lease["spec"].value("holderIdentity", "") != config_.identity) return;
  lease["spec"]["holderIdentity"] = "";
  lease["spec"]["leaseDurationSeconds"] = 1;
  lease["spec"]["renewTime"] = format_micro_time(Clock::now());
  if (auto r = client_.replace(lease_path(), lease); !r) {
    LOG_WARN("leader") << "release lease: " << r.error().message;
  } else {
    LOG_INFO("leader") << config_.identity << " released the lease";
  }
}

void LeaderElector::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

}  // namespace rdmig::k8s
