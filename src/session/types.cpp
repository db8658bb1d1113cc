#include "session/types.h"

#include <chrono>

namespace rdmig::session {

const char* role_name(Role role) { return role == Role::kSource ? "source" : "target"; }

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kPending: return "Pending";
    case Phase::kConnecting: return "Connecting";
    case Phase::kMigrating: return "Migrating";
    case Phase::kCompleting: return "Completing";
    case Phase::kSucceeded: return "Succeeded";
    case Phase::kFailed: return "Failed";
    case Phase::kCancelled: return "Cancelled";
    case Phase::kRecovering: return "Recovering";
  }
  return "?";
}

bool phase_terminal(Phase phase) {
  return phase == Phase::kSucceeded || phase == Phase::kFailed || phase == Phase::kCancelled;
}

int64_t wall_clock_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

int64_t wall_clock_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

nlohmann::json to_json(const RailUsage& u) {
  return nlohmann::json{{"rail", u.rail},         {"device", u.device},       {"gid", u.gid},
              {"address", u.address},   {"peerAddress", u.peer_address}, {"channels", u.channels},
              {"bytesSent", u.bytes_sent}, {"bytesReceived", u.bytes_received}, {"chunksSent", u.chunks_sent},
              {"chunksReceived", u.chunks_received}, {"throughputBytesPerSecond", u.throughput_bytes_per_second}};
}

}  // namespace rdmig::session
