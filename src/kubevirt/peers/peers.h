// The other nodes' agents, as KubeVirt mode needs them: by node name (hook mode: the VMI's
// targetNode) and by virt-handler address (static mode: the connection's destination), and
// whether the path to each is healthy. A transport failure marks a peer unhealthy; no new
// migration is intercepted towards it until a probe (a "probe" hello answered by the peer's
// data plane) succeeds. Thread-safe.
#pragma once

#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/net.h"
#include "config/agent_config.h"

namespace rdmig::kubevirt {

struct PeerInfo {
  std::string node;
  net::Endpoint agent;
  bool healthy = true;
  std::string unhealthy_reason;
};

class PeerDirectory {
 public:
  static Result<PeerDirectory> from_config(const KubevirtConfig& config);
  static Result<PeerDirectory> from_peers(const std::vector<KubevirtPeer>& peers, const std::string& where);

  std::optional<PeerInfo> by_node(const std::string& node) const;
  std::optional<PeerInfo> by_handler_address(const std::string& ip) const;
  std::vector<std::string> handler_addresses() const;  // static mode redirect set

  // Replaces the peers (discovery), keeping the health of nodes already known.
  Status replace(const std::vector<KubevirtPeer>& peers);
  void mark_unhealthy(const std::string& node, const std::string& reason);
  void mark_healthy(const std::string& node);
  std::vector<PeerInfo> unhealthy() const;

  PeerDirectory(const PeerDirectory& other);
  PeerDirectory& operator=(const PeerDirectory& other);
  PeerDirectory() = default;

 private:
  struct Entry {
    PeerInfo info;
    std::vector<std::string> handler_addresses;
  };
  // Guards peers_ (the entries and their health). Taken by every member function: discovery
  // (replace), the relay's maintenance loop (mark_healthy/mark_unhealthy, unhealthy), hook and
  // interception threads and REST (by_node, by_handler_address, handler_addresses). Copying
  // takes the other directory's too (operator= both at once, with std::scoped_lock). No
  // other lock is taken under it.
  mutable std::mutex mu_;
  std::vector<Entry> peers_;
};

// Asks a peer's data plane whether it serves (hello kind "probe"), within `timeout`.
Status probe_peer(const net::Endpoint& agent, std::chrono::milliseconds timeout);

}  // namespace rdmig::kubevirt
