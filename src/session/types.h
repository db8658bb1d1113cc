// What every agent-to-agent session shares, whatever it carries (a bare-QEMU job, a KubeVirt
// flow, a path check): the two roles, the phases, where the target is, what one rail carried,
// and the bounds both ends of a handshake use.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace rdmig::session {

enum class Role { kSource, kTarget };
const char* role_name(Role role);

// Agent-side phases. Terminal: Succeeded, Failed, Cancelled. Recovering: a bare-QEMU post-copy
// migration whose link was lost beyond failover, both QEMUs postcopy-paused, while the agents try
// a fresh channel (docs/api.md, post-copy recovery).
enum class Phase { kPending, kConnecting, kMigrating, kCompleting, kSucceeded, kFailed, kCancelled, kRecovering };
const char* phase_name(Phase phase);
bool phase_terminal(Phase phase);

struct TargetRef {
  std::string host;
  uint16_t port = 0;
  std::string migration_id;
  std::string token;
};

// What one rail carried in a session, for status and records.
struct RailUsage {
  uint32_t rail = 0;
  std::string device;
  std::string gid;
  std::string address;       // this agent's address on the rail
  std::string peer_address;
  std::vector<uint32_t> channels;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t chunks_sent = 0;
  uint64_t chunks_received = 0;
  // Payload bytes per second both ways, averaged since the rail's channels were first counted
  // (account_rail_traffic); 0 until a second count.
  uint64_t throughput_bytes_per_second = 0;
  std::chrono::steady_clock::time_point counted_since{};  // not reported
  // Channels that failed over between rails (move_channel_off_rail; not reported): what each
  // channel that arrived here had counted before it came (subtracted), and what the channels that
  // left carried here until they left (bytes sent, received, chunks sent, received).
  std::map<uint32_t, std::array<uint64_t, 4>> arrived_at{};
  std::array<uint64_t, 4> departed{};
};
nlohmann::json to_json(const RailUsage& usage);

int64_t wall_clock_ms();
int64_t wall_clock_us();

// The one answer to a data-plane hello with an unknown migration id, a wrong token or an unknown
// session: refusals do not tell a client which migration ids exist.
inline constexpr const char* kHelloRefused = "unknown migration, or its token does not match";
inline constexpr std::chrono::seconds kHandshakeTimeout{30};  // one step of the agents' handshake

// Receive-direction geometry for QEMU's return path: it carries little, so its ring is small.
inline uint32_t return_path_chunk(uint64_t chunk) { return static_cast<uint32_t>(std::min<uint64_t>(chunk, 256 * 1024)); }
inline uint32_t return_path_depth(uint32_t depth) { return std::min<uint32_t>(depth, 8); }

}  // namespace rdmig::session
