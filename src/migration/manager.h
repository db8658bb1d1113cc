// Owns this agent's migrations and its data-plane listener. REST handlers call create/list/
// get/cancel; the listener thread hands source agents' connections to target jobs.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "migration/job.h"
#include "transport/rdma/rdma_listener.h"

namespace rdmig::migration {

class MigrationManager {
 public:
  MigrationManager(const AgentConfig& config, Metrics& metrics);
  ~MigrationManager();
  MigrationManager(const MigrationManager&) = delete;
  MigrationManager& operator=(const MigrationManager&) = delete;

  // Binds the data-plane port (0 = any) and starts accepting; finds the RDMA device and
  // starts the rdma_cm listener unless the transport is tcp.
  Status start_data_plane();
  uint16_t data_port() const { return data_port_; }
  const RdmaSupport& rdma() const { return rdma_; }
  const std::string& advertise_host() const { return advertise_host_; }

  // Starts a migration; answers the REST body for 201 (target: endpoint and token).
  Result<nlohmann::json> create(MigrationSpec spec);
  std::vector<MigrationStatus> list() const;
  Result<MigrationStatus> get(const std::string& id) const;
  Result<MigrationStatus> cancel(const std::string& id);

  // Cancels every active migration and waits up to `grace` for them to end (SIGTERM).
  void shutdown(std::chrono::milliseconds grace);
  size_t active_count() const;

 private:
  void accept_loop();
  void handle_connection(UniqueFd fd);
  std::shared_ptr<Job> find(const std::string& id) const;
  void evict_finished_locked();
  void init_rdma();
  Result<transport::rdma::AcceptPlan> rdma_lookup(const std::array<uint8_t, 16>& session, uint32_t index);

  const AgentConfig& config_;
  Metrics& metrics_;
  std::string advertise_host_;
  uint16_t data_port_ = 0;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_;
  std::deque<std::string> order_;  // creation order, for history eviction

  RdmaSupport rdma_;

  UniqueFd listener_;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::unique_ptr<transport::rdma::RdmaListener> rdma_listener_;  // stopped first
};

// Chooses the address peers should dial: config, then $NODE_IP, then the listen address.
std::string choose_advertise_host(const AgentConfig& config);

}  // namespace rdmig::migration
