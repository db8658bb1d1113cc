#include "controller/worker.h"

#include "common/log.h"

namespace rdmig::controller {

using nlohmann::json;

Worker::Worker(ObjectReconciler& reconciler, k8s::Informer& informer, ControllerMetrics& metrics,
               std::chrono::milliseconds poll_interval, std::function<bool()> leading,
               KubevirtObserver* observer, bool phase_gauge)
    : reconciler_(reconciler),
      informer_(informer),
      metrics_(metrics),
      poll_interval_(poll_interval),
      leading_(std::move(leading)),
      observer_(observer),
      phase_gauge_(phase_gauge) {}

void Worker::enqueue(const std::string& key) {
  {
    std::lock_guard lock(mu_);
    dirty_.insert(key);
  }
  cv_.notify_all();
}

void Worker::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

void Worker::run() {
  auto next_poll = std::chrono::steady_clock::now();
  for (;;) {
    std::set<std::string> keys;
    bool poll = false;
    {
      std::unique_lock lock(mu_);
      cv_.wait_until(lock, next_poll, [this] { return stopping_ || !dirty_.empty(); });
      if (stopping_) return;
      keys.swap(dirty_);
      poll = std::chrono::steady_clock::now() >= next_poll;
    }
    // Phase gauge from the cache, leader or not.
    std::map<std::string, int> counts;
    const auto objects = informer_.list();
    for (const auto& o : objects) {
      std::string phase = o.value("status", json::object()).value("phase", "");
      counts[phase.empty() ? "Pending" : phase]++;
    }
    if (phase_gauge_) metrics_.set_phase_counts(counts);
    if (poll) {
      next_poll = std::chrono::steady_clock::now() + poll_interval_;
      for (const auto& o : objects) {
        if (reconciler_.needs_poll(o)) keys.insert(k8s::Informer::key_of(o));
      }
    }
    if (!leading_() || !informer_.synced()) continue;
    for (const auto& key : keys) {
      if (key.empty()) continue;
      Result<Next> r = Next::kDone;
      try {
        r = reconciler_.reconcile(key);
      } catch (const std::exception& e) {
        // Input of an unexpected shape that slipped past the checks: fail this pass, not the controller.
        r = Error{Errc::kInternal, std::string("unexpected: ") + e.what()};
      }
      if (!r) {
        metrics_.reconciled("error");
        LOG_WARN("reconcile") << key << ": " << r.error().message << " (retrying)";
        continue;
      }
      metrics_.reconciled("success");
      if (r.value() == Next::kRequeueNow) enqueue(key);
    }
    if (observer_) {
      try {
        observer_->observe_all();
      } catch (const std::exception& e) {
        LOG_WARN("kubevirt") << "observing VirtualMachineInstanceMigrations: unexpected: " << e.what();
      }
    }
  }
}

}  // namespace rdmig::controller
