// The agent's data-plane server: one TCP listener for every agent-to-agent connection and
// the RDMA (rdma_cm) listener. It knows nothing about jobs: each connection says hello
// first, and the server hands it to the handler registered for the hello's `kind` (a
// bare-QEMU job registry, the KubeVirt flow relay, ...). RDMA connect requests go to the
// registered resolvers, which recognise their own sessions.
//
// Threads: one acceptor; each accepted connection reads its hello on a short-lived thread
// of its own (at most kMaxPendingHellos at once), so silent, slow or garbage clients delay
// nobody else. A connection without a valid hello within kHelloTimeout is closed. stop()
// (or the destructor) stops accepting and joins everything.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/mutex.h"
#include "config/agent_config.h"
#include "metrics/metrics.h"
#include "transport/rdma/options.h"
#include "transport/rdma/rdma_listener.h"

namespace rdmig::session {

// One RDMA device of this agent that works (device chosen, rdma_cm listener up): a "rail".
struct RdmaRail {
  uint32_t rail = 0;    // its index in the agent config (rdma.devices[rail]; 0 for the single rdma keys)
  std::string device;
  int device_port = 0;  // the device's port number
  std::string netdev;
  std::string ip;       // rdma_cm listener address (on `netdev`); the source binds its channels here
  uint16_t port = 0;    // rdma_cm port
  int gid_index = -1;
  std::string gid;
  std::string gid_type;
  int traffic_class = -1;  // IP ToS byte set on every rdma_cm id (-1: the kernel's default)
  uint32_t mtu = 0;        // active MTU of the port in bytes (0: unknown)
  // The device's other addresses that took (rdma.devices[i].alternateAddresses, in that order;
  // one that could not be set up is left out, logged): each with its own GID and rdma_cm
  // listener, `rail` the same, no alternates of its own. Failover paths only ("address").
  std::vector<RdmaRail> alternates;
  // Of the configured alternates, the index of each entry in `alternates` (the peers match
  // alternate k with alternate k: a left-out one must not shift the rest).
  std::vector<uint32_t> alternate_slots;
  std::string endpoint() const;  // ip:port, [ip]:port for IPv6
};

// A configured rail that could not be set up at start: left out of every migration.
struct RdmaRailDown {
  uint32_t rail = 0;
  std::string reason_code;  // as RdmaSupport::reason_code
  std::string reason;
};

// This agent's RDMA capability, found once at start-up. The flat fields describe the first
// working rail (what a single-device peer, a KubeVirt flow or a path check's summary uses);
// `rails` lists every working rail in configured order.
struct RdmaSupport {
  bool available = false;
  // Why not, when unavailable: reason_code is one word (transport::rdma::kNoDevice, kNoAddress,
  // kGidNotFound, or "transport-tcp", "listener-failed"), reason says what to fix.
  std::string reason_code;
  std::string reason;
  std::string device;
  int device_port = 0;  // the device's port number
  std::string netdev;
  std::string ip;       // rdma_cm listener address (on `netdev`)
  uint16_t port = 0;    // rdma_cm port
  int gid_index = -1;
  std::string gid_type;
  int traffic_class = -1;  // IP ToS byte set on every rdma_cm id (-1: the kernel's default)
  uint32_t mtu = 0;        // active MTU of the port in bytes (0: unknown)
  std::vector<RdmaRail> rails;       // working rails; rails[0] is the rail the flat fields describe
  std::vector<RdmaRailDown> down;    // configured rails left out, and why
  // One line for logs: "rdma=rxe0 port=1 netdev=veth0 gid_index=3 gid_type=RoCE v2 address=..." or
  // "rdma=unavailable (no-address: ...)"; with more than one rail, " rails=2 (rxe0 10.99.0.1, ...)".
  std::string summary() const;
};

// One rail's config as the transport's own options; `key` is where it is in the agent's config
// ("rdma", or "rdma.devices[2]" for a rail of a list), the key its errors name.
transport::rdma::RdmaOptions rdma_options(const RdmaRailConfig& config, const std::string& key = "rdma");

inline constexpr std::chrono::seconds kHelloTimeout{5};
inline constexpr size_t kMaxPendingHellos = 64;
// Of those, at most this many from one source address: a flood from one address (a pod on the
// node's network, a compromised node) leaves room for every other peer's migrations. A real
// peer opens its connections one after another and each hello is read in milliseconds.
inline constexpr size_t kMaxPendingHellosPerSource = 16;

class DataPlaneServer {
 public:
  // Takes over a connection whose hello (already read, a JSON object with a string `kind`)
  // is `hello`; replies on it (welcome or reject) itself. Runs on the hello's thread.
  using HelloHandler = std::function<void(UniqueFd fd, const nlohmann::json& hello)>;
  // Recognises an RDMA session or answers kPermissionDenied ("not mine"); for its own session it
  // checks the request's proof (transport::rdma::check_request) before it admits anything.
  using RdmaResolver = std::function<Result<transport::rdma::AcceptPlan>(const transport::rdma::ConnectRequest& request)>;

  DataPlaneServer(const AgentConfig& config, Metrics& metrics);
  ~DataPlaneServer();
  DataPlaneServer(const DataPlaneServer&) = delete;
  DataPlaneServer& operator=(const DataPlaneServer&) = delete;

  // Register before start().
  void add_handler(const std::string& kind, HelloHandler handler);
  void add_rdma_resolver(RdmaResolver resolver);

  // Binds the data-plane port (0 = any) and starts accepting; finds each rail's RDMA device
  // and starts its rdma_cm listener unless the transport is tcp.
  Status start();
  void stop();

  uint16_t port() const { return port_; }
  const RdmaSupport& rdma() const { return rdma_; }
  const std::string& advertise_host() const { return advertise_host_; }

 private:
  void accept_loop();
  void handle(UniqueFd fd);
  void init_rdma();
  // Sets up rail `index`; the reason code and message when it cannot be used.
  // A rail with `network` first waits, until `network_deadline`, for its network-status entry.
  Result<RdmaRail> init_rail(uint32_t index, const RdmaRailConfig& config,
                             std::chrono::steady_clock::time_point network_deadline);
  // The rail's alternate addresses that can be used (rail.alternates), each listening.
  void init_alternates(RdmaRail& rail, const RdmaRailConfig& config, const std::string& key);
  // An rdma_cm listener on `ip` whose requests are rail `index`'s (arriving on its address `slot`: 0
  // its own, k its alternate k-1).
  Result<std::unique_ptr<transport::rdma::RdmaListener>> rail_listener(const std::string& ip, uint32_t index,
                                                                      uint32_t slot, int traffic_class);
  Result<transport::rdma::AcceptPlan> resolve_rdma(const transport::rdma::ConnectRequest& request);

  const AgentConfig& config_;
  Metrics& metrics_;
  std::string advertise_host_;
  uint16_t port_ = 0;
  RdmaSupport rdma_;
  std::map<std::string, HelloHandler> handlers_;
  std::vector<RdmaResolver> resolvers_;

  UniqueFd listener_;
  std::atomic<bool> stopping_{false};
  // Guards pending_ and pending_by_source_; pending_cv_ signals a hello thread's end. Taken by
  // acceptor_ (counting a connection in), each detached hello thread (counting itself out) and
  // stop() (waiting for pending_ == 0). Held only for the counts; no other lock under it.
  // handlers_ and resolvers_ need none: filled before start(), only read after.
  Mutex pending_mu_;
  std::condition_variable pending_cv_;
  size_t pending_ GUARDED_BY(pending_mu_) = 0;  // hello threads running (detached; counted so stop() can wait)
  std::map<std::string, size_t> pending_by_source_ GUARDED_BY(pending_mu_);  // the same, by the peer's address
  std::thread acceptor_;
  std::vector<std::unique_ptr<transport::rdma::RdmaListener>> rdma_listeners_;  // one per rail; stopped first
};

// Chooses the address peers should dial: config, then $POD_IP, then $NODE_IP, then the listen address.
std::string choose_advertise_host(const AgentConfig& config);

}  // namespace rdmig::session
