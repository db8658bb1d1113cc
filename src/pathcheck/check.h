// One path check on this agent: one end of a synthetic stream between two agents over the
// migration data plane (the same hello, challenge and one-time token, transport choice,
// channels, chunking and credits as a migration; no QEMU). The source connects, measures the
// control link's round trip, sends `bytes` pattern bytes over `channels` channels and reports
// the throughput; the target checks every byte and sends its verdict back.
//
// Threads: a worker per check (owned here, joined by the destructor) and, while the stream
// runs, one thread per channel that the worker joins. cancel() and the deadline abort the
// channels and the control link, which ends every blocking wait.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "config/agent_config.h"
#include "metrics/metrics.h"
#include "session/control_link.h"
#include "session/data_plane_server.h"
#include "session/rails.h"
#include "session/types.h"
#include "transport/channel.h"
#include "transport/tcp/tls_stream.h"
#include "transport/rdma/rdma_listener.h"
#include "transport/wire.h"

namespace rdmig::pathcheck {

// The bounds an agent applies to every check are its config's `pathCheck` keys
// (config::PathCheckConfig, docs/pathcheck.md).

struct CheckSpec {
  session::Role role = session::Role::kSource;
  std::string id;
  uint64_t bytes = PathCheckConfig{}.default_bytes;
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  uint32_t channels = 1;
  TransportKind transport = TransportKind::kAuto;
  bool allow_during_migrations = false;
  uint32_t timeout_seconds = PathCheckConfig{}.default_timeout_seconds;
  session::TargetRef target;  // source only: the target agent's endpoint, check id and token
};

// The share of the stream channel `index` carries (channel 0 takes the remainder).
inline uint64_t channel_bytes(uint64_t bytes, uint32_t channels, uint32_t index) {
  return bytes / channels + (index == 0 ? bytes % channels : 0);
}

// Chunk buffers a check holds on this agent (counted against migration.bufferBudget).
uint64_t buffer_bytes(const CheckSpec& spec);

// The RDMA port of one end, when the check runs over RDMA.
struct RdmaEnd {
  std::string device;
  int port = 0;
  std::string gid;
  int gid_index = -1;
  std::string gid_type;  // "RoCE v2" (rdma-core's name, as sysfs gives it)
  std::string netdev;    // the interface the GID belongs to (a VF, a VLAN, a macvlan over them)
  uint32_t mtu = 0;
  nlohmann::json to_json() const;
  static RdmaEnd of(const session::RdmaSupport& rdma);  // the first rail
  static RdmaEnd of(const session::RdmaRail& rail);
  // From a peer's message: strings cut to 64 characters, numbers clamped; nullopt unless an object.
  static std::optional<RdmaEnd> parse(const nlohmann::json& j);
};

// One rail a check's channels were striped across (RDMA only): what session::RailUsage says
// (channels, bytes once verified) and both ends' ports on it.
struct CheckRail {
  session::RailUsage usage;
  RdmaEnd local;
  std::optional<RdmaEnd> peer;  // source: the target's port on this rail, from its "ready"
};
// The rails of `pairs` that carry one of `channels` channels, with this agent's port on each.
std::vector<CheckRail> check_rails(const std::vector<session::RailPair>& pairs, uint32_t channels);
// The target's "ready" lists its port on each rail ({"rail": i, ...RdmaEnd}); the source files
// each under its own rail. At most transport::kMaxRails entries are read, unknown rails ignored.
nlohmann::json rails_to_ready(const std::vector<CheckRail>& rails);
void peer_rails_from_ready(const nlohmann::json& ready, std::vector<CheckRail>& rails);

struct CheckStatus {
  std::string id;
  session::Role role = session::Role::kSource;
  session::Phase phase = session::Phase::kPending;
  std::string transport;
  std::string transport_reason;
  // "none", or "tls (kernel)" | "tls (kernel send)" | "tls (user space)" (dataPlane.tls: on, TCP).
  std::string encryption = "none";
  uint64_t bytes = 0;           // asked for
  uint64_t bytes_done = 0;      // source: sent; target: verified
  uint32_t channels = 1;
  uint64_t chunk_size = 0;
  double throughput_bytes_per_second = 0;
  std::optional<int64_t> rtt_us;  // source: the median of pathCheck.rttSamples control-link round trips
  std::optional<RdmaEnd> local_rdma;
  std::optional<RdmaEnd> peer_rdma;
  // RDMA only: the rails the channels were striped across (session/rails.h); bytes once verified.
  std::vector<CheckRail> rails;
  std::string peer;
  std::string error;  // why it failed or was cancelled
  int64_t duration_ms = 0;
};
nlohmann::json to_json(const CheckStatus& s);

struct CheckContext {
  const AgentConfig& config;
  Metrics& metrics;
  const session::RdmaSupport& rdma;
};

class PathCheck {
 public:
  PathCheck(CheckSpec spec, CheckContext ctx);
  ~PathCheck();
  PathCheck(const PathCheck&) = delete;
  PathCheck& operator=(const PathCheck&) = delete;

  void start();
  const CheckSpec& spec() const { return spec_; }
  const std::string& id() const { return spec_.id; }
  const std::string& token() const { return token_; }
  CheckStatus status() const;
  bool finished() const;
  bool wait_finished(std::chrono::milliseconds timeout) const;
  void cancel(const std::string& reason);

  // Target side, from the data-plane server's hello threads (see session::TargetJob).
  void on_control(UniqueFd fd, const session::Hello& hello, const std::string& nonce, const std::string& proof);
  // What TCP channel `index` of `session` must prove; kPermissionDenied when there is no such session.
  Result<transport::ChannelTerms> channel_terms(const std::string& session, uint32_t index) const;
  // A TCP channel whose proof was checked (`welcome_proof`: the acceptor's answer).
  void on_data(UniqueFd fd, const session::Hello& hello, const std::string& welcome_proof);
  // Checks the request's proof, then admits the channel.
  Result<transport::rdma::AcceptPlan> rdma_plan(const transport::rdma::ConnectRequest& request);

 private:
  void run();
  Status run_source();
  Status run_target();
  Status connect_source();
  Status wait_for_source();
  // Runs `body(channel)` on one thread per channel, aborting all channels when one fails, on
  // cancel, at the deadline and when no byte moved for pathCheck.stallTimeoutSeconds. The first
  // error, if any.
  Status run_channels(const std::function<Status(transport::Channel&, uint32_t)>& body);
  void abort_all(const Error& reason);
  // `e`, a failure of channel `channel`, named with the rail that carried it (over RDMA).
  Error on_rail(const Error& e, uint32_t channel) const;
  void finish(const Status& result);
  void set_phase(session::Phase phase);
  void update(const std::function<void(CheckStatus&)>& fn);
  std::chrono::milliseconds remaining() const;
  Error cancel_or(Error e) const;
  std::string log_prefix() const;

  CheckSpec spec_;
  CheckContext ctx_;
  std::string token_;
  const std::chrono::steady_clock::time_point deadline_;
  uint64_t seed_ = 0;
  std::atomic<uint64_t> bytes_done_{0};
  std::unique_ptr<std::atomic<uint64_t>[]> channel_chunks_;  // spec_.channels of them

  // Guards status_, finished_, cancelled_, cancel_reason_, control_watch_, the target's
  // hand-over fields below (token_used_ .. data_received_) and the pointers link_ and channels_.
  // Taken by REST (status, cancel), the worker and its per-channel threads (update, on_rail,
  // abort_all, run_channels' stall watch), the data-plane server's accept threads (on_control,
  // on_data, channel_terms, rdma_plan) and the RDMA CM thread (rdma_plan's deliver). Lock
  // order: PathCheckManager::mu_ -> mu_ -> ControlLink's and the channels' own locks (cancel()
  // sends the abort and aborts the channels under it).
  mutable std::mutex mu_;  // status, cancel, connection hand-over
  mutable std::condition_variable cv_;
  CheckStatus status_;
  bool finished_ = false;
  bool cancelled_ = false;
  std::string cancel_reason_;
  int control_watch_ = -1;  // a socket the worker blocks on: shut down by cancel()

  // Target: what the data-plane server hands over (under mu_). On the source, session_ and
  // channel_key_ are written and read by the worker alone (connect_source), without mu_.
  bool token_used_ = false;
  std::string session_;      // names the session (source side: from the welcome); no secret
  std::string channel_key_;  // what its channels prove (transport/channel_proof.h)
  transport::ProofLedger rdma_proofs_;
  UniqueFd control_fd_;
  std::vector<UniqueFd> data_fds_;
  // dataPlane.tls: each channel's stream; an index is in data_admitting_ while its handshake runs.
  std::vector<std::unique_ptr<transport::TlsStream>> data_tls_;
  std::set<uint32_t> data_admitting_;
  std::vector<std::unique_ptr<transport::Channel>> rdma_channels_;
  std::optional<Error> rdma_error_;
  uint32_t data_received_ = 0;

  // The worker's: set and swapped out under mu_ (aborted from other threads under it), used
  // unlocked by the worker between those points (it is their only writer).
  std::unique_ptr<session::ControlLink> link_;
  std::vector<std::unique_ptr<transport::Channel>> channels_;
  std::thread worker_;
};

}  // namespace rdmig::pathcheck
