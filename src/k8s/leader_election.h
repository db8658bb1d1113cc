// Leader election on a coordination.k8s.io/v1 Lease, the way client-go does it: the holder
// renews spec.renewTime every retry period; another replica takes the lease over when it has
// seen the same lease record unchanged for leaseDurationSeconds (measured on its own clock,
// so clock skew between nodes does not matter). A leader that cannot renew within the renew
// deadline stops leading. release() empties holderIdentity so a successor need not wait.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>

#include "k8s/kube_client.h"

namespace rdmig::k8s {

struct LeaderElectionConfig {
  std::string namespace_;
  std::string lease_name = "rdmig-controller";
  std::string identity;
  std::chrono::milliseconds lease_duration{15000};
  std::chrono::milliseconds renew_deadline{10000};
  std::chrono::milliseconds retry_period{2000};
};

class LeaderElector {
 public:
  LeaderElector(KubeClient& client, LeaderElectionConfig config, std::function<void(bool leading)> on_change);

  void run();   // blocks until stop(); then releases the lease when leading
  void stop();
  bool leading() const { return leading_.load(); }

 private:
  void tick();
  bool try_acquire_or_renew();
  void set_leading(bool v);
  void release();
  std::string lease_path() const;

  KubeClient& client_;
  LeaderElectionConfig config_;
  std::function<void(bool)> on_change_;
  std::atomic<bool> leading_{false};
  std::atomic<bool> stopping_{false};
  // Guards nothing but the stop hand-shake: run() waits on cv_ under it between ticks and
  // stop() sets stopping_ under it before notifying, so the wake-up is not lost. The fields
  // below are the run() thread's own (tick(), try_acquire_or_renew()) and need no lock.
  std::mutex mu_;
  std::condition_variable cv_;
  // What we last saw of someone else's lease, and when (our monotonic clock).
  std::string observed_record_;
  std::chrono::steady_clock::time_point observed_at_{};
  std::chrono::steady_clock::time_point last_renew_{};
};

}  // namespace rdmig::k8s
