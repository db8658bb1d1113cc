// The two ends of a carried KubeVirt migration.
//   SourceSession: made when the hook arms a migration (or, in static mode, when the first
//     connection to a peer handler arrives); each intercepted connection becomes one channel,
//     in accept order.
//   TargetSession: made by the data-plane server for a "flow" hello; dials each channel's
//     original destination from inside the target virt-handler's network namespace, in the
//     source's order, and reports libvirt's figures at the end.
#pragma once

#include <condition_variable>
#include <functional>
#include <thread>

#include "common/net.h"
#include "config/agent_config.h"
#include "kubevirt/flow_protocol.h"
#include "kubevirt/flow_session.h"
#include "kubevirt/netns.h"
#include "kubevirt/peers.h"
#include "common/token_source.h"
#include "migration/data_plane_server.h"
#include "transport/rdma/rdma_listener.h"

namespace rdmig::kubevirt {

struct SessionContext {
  const AgentConfig& config;
  Metrics& metrics;
  const migration::RdmaSupport& rdma;
  // The agents' shared API token (HMAC key of the session challenge); follows its file.
  std::shared_ptr<TokenSource> token;
};

class SourceSession final : public FlowSession {
 public:
  // On a failure every carried connection but the first (QEMU's main channel) is drained for
  // up to this long instead of reset (ChannelPump::drain_on_failure): QEMU 7.2 fails on its
  // main channel and ends its multifd threads itself. KubeVirt's proxy never passes QEMU's
  // close on to this side, so a drain normally lasts the whole limit.
  static constexpr std::chrono::milliseconds kMultifdDrainLimit = migration::kMultifdDrainLimit;
  // Connects to the peer agent, proves the shared token and agrees on the transport.
  static Result<std::unique_ptr<SourceSession>> open(const SessionContext& ctx, const PeerInfo& peer, FlowRecord record,
                                                     std::chrono::milliseconds timeout);
  // Carries one intercepted connection as the next channel.
  Status add_connection(UniqueFd fd, const net::Endpoint& destination);
  // Reads the control link without waiting: an abort from the peer or its loss fails the session.
  void poll();
  // Tells the target the migration is over; waits (bounded) for libvirt's figures.
  void finish();
  const std::string& peer_node() const { return peer_.node; }

 private:
  SourceSession(std::string id, FlowRecord record, const SessionContext& ctx, PeerInfo peer);
  Result<std::unique_ptr<transport::Channel>> connect_channel(uint32_t index);

  SessionContext ctx_;
  PeerInfo peer_;
  std::string transport_;
  net::Endpoint rdma_endpoint_;
  uint32_t next_index_ = 0;  // the interception thread only
};

// Finds the network namespace that owns `ip` (the target virt-handler's); null: dial from
// the agent's own namespace.
using NetnsLocator = std::function<std::shared_ptr<NetNs>(const std::string& ip)>;
// Reads libvirt's completed-job figures of the migrated VMI on this node.
using StatsReader = std::function<Result<LibvirtJobStats>(const VmiRef& vmi)>;

class TargetSession final : public FlowSession {
 public:
  static Result<std::shared_ptr<TargetSession>> accept(const SessionContext& ctx, UniqueFd fd, const FlowHello& hello,
                                                       NetnsLocator locate, StatsReader stats);
  ~TargetSession() override;
  void start();
  const std::string& session_key() const { return hello_.session; }
  Status add_tcp_channel(UniqueFd fd, uint32_t index);
  Result<transport::rdma::AcceptPlan> rdma_plan(uint32_t index);

 private:
  TargetSession(std::string id, FlowRecord record, const SessionContext& ctx, FlowHello hello, NetnsLocator locate,
                StatsReader stats);
  void reader_loop();
  void try_start_locked(uint32_t index);
  Result<UniqueFd> dial_in_order(uint32_t index);
  void report_and_succeed();
  void wake() override;

  SessionContext ctx_;
  FlowHello hello_;
  NetnsLocator locate_;
  StatsReader stats_;
  std::string transport_;

  std::mutex conn_mu_;
  std::condition_variable conn_cv_;
  std::vector<std::unique_ptr<transport::Channel>> channels_;  // by index, until started
  std::vector<std::optional<net::Endpoint>> destinations_;
  std::vector<bool> started_;
  uint32_t next_dial_ = 0;
  bool stopping_ = false;
  std::thread reader_;
};

}  // namespace rdmig::kubevirt
