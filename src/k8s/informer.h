// Informer: keeps a cache of one resource collection in step with the API server by list +
// watch. Watches resume from the last resourceVersion seen; a stream the server closes is
// re-opened; 410 Gone (the version is too old) triggers a fresh list, and objects that
// vanished meanwhile are reported as DELETED. Errors back off exponentially.
//
// Threads: run() blocks in the caller's thread until stop() is called; the cache is read
// from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "k8s/kube_client.h"

namespace rdmig::k8s {

class Informer {
 public:
  // Called after the cache changed: type is ADDED, MODIFIED or DELETED; key "ns/name".
  using Handler = std::function<void(const std::string& type, const std::string& key)>;

  // `collection_path`: e.g. "/apis/rdmig.io/v1alpha1/rdmamigrations"; `query`: extra list
  // parameters ("labelSelector=..."), may be empty.
  Informer(KubeClient& client, std::string collection_path, std::string query, Handler handler);

  void run();
  void stop();

  bool synced() const { return synced_.load(); }
  std::optional<nlohmann::json> get(const std::string& key) const;
  std::vector<nlohmann::json> list() const;
  // Refreshes a cached object with one we just wrote, unless the cache holds a newer version
  // or no longer holds the object (deleted meanwhile).
  void observe(const nlohmann::json& object);
  void forget(const std::string& key);

  uint64_t list_count() const { return lists_.load(); }
  uint64_t expired_count() const { return expired_.load(); }

  static std::string key_of(const nlohmann::json& object);

 private:
  Status relist();
  void apply(const std::string& type, const nlohmann::json& object);
  bool sleep_for(std::chrono::milliseconds d);

  KubeClient& client_;
  const std::string path_;
  const std::string query_;
  Handler handler_;
  // Guards cache_ and resource_version_. Taken by run()'s thread (relist, apply, the watch
  // loop) and by any caller of get/list/observe/forget (reconcilers, REST); never held while
  // handler_ runs or across a request to the API server. Not taken together with stop_mu_.
  mutable std::mutex mu_;
  std::map<std::string, nlohmann::json> cache_;
  // Under mu_; written only by run()'s thread, which also reads it unlocked for a log line.
  std::string resource_version_;
  std::atomic<bool> synced_{false};
  std::atomic<bool> stopping_{false};
  // Guards nothing but the stop hand-shake: sleep_for() (run()'s thread) waits on stop_cv_
  // under it, stop() sets stopping_ under it before notifying.
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  std::atomic<uint64_t> lists_{0}, expired_{0};
};

// Numeric comparison of two resourceVersions when both are integers (etcd revisions); false
// when either is not (then they are opaque and the newer one cannot be told).
bool resource_version_newer(const std::string& a, const std::string& b);

}  // namespace rdmig::k8s
