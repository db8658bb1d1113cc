// Worker: the controller's one reconcile thread. Wakes on cache changes (from the informer)
// and every poll interval; while this replica leads, reconciles the changed objects and
// every object that Reconciler::needs_poll names (running, being deleted, finished with work
// left: the finalizer, or deletion after its time-to-live), then lets the KubeVirt observer look
// at the VirtualMachineInstanceMigrations. Stops when stop() is called. enqueue("") only wakes it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <string>

#include "controller/controller_metrics.h"
#include "controller/kubevirt_observer.h"
#include "controller/reconciler.h"

namespace rdmig::controller {

class Worker {
 public:
  // `phase_gauge`: this worker's objects are RdmaMigrations, whose phases it counts in
  // rdmig_controller_migrations (the RdmaPathCheck worker passes false).
  Worker(ObjectReconciler& reconciler, k8s::Informer& informer, ControllerMetrics& metrics,
         std::chrono::milliseconds poll_interval, std::function<bool()> leading,
         KubevirtObserver* observer = nullptr, bool phase_gauge = true);

  void enqueue(const std::string& key);
  void run();
  void stop();

 private:
  ObjectReconciler& reconciler_;
  k8s::Informer& informer_;
  ControllerMetrics& metrics_;
  std::chrono::milliseconds poll_interval_;
  std::function<bool()> leading_;
  KubevirtObserver* observer_;
  bool phase_gauge_;
  // Guards dirty_ and stopping_; cv_ wakes run() for either. Taken by enqueue() (the
  // informer's thread through its handler, and run() requeueing), stop() (main) and run()
  // (this worker's thread), which swaps dirty_ out and reconciles with it released. No other
  // lock is taken under it.
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<std::string> dirty_;
  bool stopping_ = false;
};

}  // namespace rdmig::controller
