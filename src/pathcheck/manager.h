// The registry of this agent's path checks. REST handlers call create/list/get/cancel; the
// data-plane server hands source agents' connections (hello kinds "pathcheck-control" and
// "pathcheck-data", and RDMA sessions) to the target checks registered here.
//
// Bounds: at most pathCheck.maxConcurrent running checks (both roles), buffers counted against
// migration.bufferBudget together with migrations and KubeVirt flows, and no check beside a
// running migration unless the request allows it.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>

#include "pathcheck/check.h"

namespace rdmig::pathcheck {

class PathCheckManager {
 public:
  // Registers its hello handlers and RDMA resolver with `server` (before server.start()).
  PathCheckManager(const AgentConfig& config, Metrics& metrics, session::DataPlaneServer& server);
  ~PathCheckManager();
  PathCheckManager(const PathCheckManager&) = delete;
  PathCheckManager& operator=(const PathCheckManager&) = delete;

  // What else runs on this agent: migrations (bare QEMU and KubeVirt flows) now, and the
  // buffers they hold. Set before serving.
  void set_neighbours(std::function<size_t()> running_migrations, std::function<uint64_t()> migration_buffers) {
    running_migrations_ = std::move(running_migrations);
    migration_buffers_ = std::move(migration_buffers);
  }

  // Starts a check; answers the REST body for 201 (target: endpoint, check id and token).
  Result<nlohmann::json> create(CheckSpec spec);
  // Both first forget the oldest finished checks beyond pathCheck.historySize (a check that
  // finished since the last create would otherwise be one too many).
  std::vector<CheckStatus> list();
  Result<CheckStatus> get(const std::string& id);
  Result<CheckStatus> cancel(const std::string& id);
  uint64_t buffer_bytes_in_use() const;
  size_t active_count() const;
  // The first SIGTERM: new path checks are refused (503, "agent draining"); running ones end.
  void begin_drain() { draining_ = true; }
  void shutdown();

 private:
  void handle_hello(UniqueFd fd, const nlohmann::json& raw);
  std::shared_ptr<PathCheck> find(const std::string& id) const;
  void evict_finished_locked(std::vector<std::shared_ptr<PathCheck>>& graveyard);

  const AgentConfig& config_;
  Metrics& metrics_;
  session::DataPlaneServer& server_;
  std::function<size_t()> running_migrations_;
  std::function<uint64_t()> migration_buffers_;

  // Guards checks_, order_ and stopping_. Taken by REST (create, list, get, cancel, the buffer
  // and count figures), the data-plane server's accept threads (handle_hello, the RDMA
  // resolver) and shutdown(). Lock order: mu_ -> PathCheck::mu_ (finished() under it); never
  // held while calling running_migrations_/migration_buffers_ (the migration registries'
  // locks) nor while an evicted check is joined (the graveyard is dropped after unlocking).
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<PathCheck>> checks_;
  std::deque<std::string> order_;
  bool stopping_ = false;
  std::atomic<bool> draining_{false};  // begin_drain()
};

}  // namespace rdmig::pathcheck
