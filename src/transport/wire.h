// Control messages between agents (their kinds and the hello: session/protocol.h): a u32 little-endian length then a JSON object, at most
// kMaxMessageBytes. Used on the control connection and to open each TCP data channel.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/result.h"
#include "session/protocol.h"

namespace rdmig::transport {

// 2: the control hello carries no token; the target challenges and the source proves it
// (control_proof), so the one-time token never crosses the data-plane network.
// 3: the control hello carries the source's nonce (covered by its proof), and every data channel
// proves the session's channel key (transport/channel_proof.h): the session id in the welcome
// names the session and is no secret.
inline constexpr uint32_t kProtocolVersion = 3;
inline constexpr uint32_t kMaxMessageBytes = 64 * 1024;
// The limits are the codec's (session/protocol.h); this header keeps their names for its callers.
inline constexpr uint32_t kMaxChannels = session::kMaxChannels;  // main + 64 multifd
inline constexpr uint32_t kControlIndex = session::kControlIndex;
inline constexpr uint32_t kMaxRails = session::kMaxRails;

Status send_message(int fd, const nlohmann::json& message);
// A refusal on a data-plane or control connection ({"type":"reject","code","message"}), best
// effort: the peer may already be gone, and the caller closes the connection anyway.
void send_reject(int fd, const std::string& code, const std::string& message);
// Waits up to `timeout` for a whole message. kUnavailable when the peer closed.
Result<nlohmann::json> recv_message(int fd, std::chrono::milliseconds timeout);

// The refusal both ends give when one has dataPlane.tls on and the other off ("tls_mismatch").
std::string tls_mismatch(bool source_on, bool target_on);

// The source's answer to the target's challenge on a control connection: proves the one-time
// token of `migration_id` without sending it, over the target's nonce and the source's own (the
// hello's): HMAC-SHA256(token, "rdmig-control\n" target nonce "\n" migration id "\n" source nonce).
std::string control_proof(const std::string& token, const std::string& nonce, const std::string& migration_id,
                          const std::string& source_nonce);

// Reads a required field of a given JSON type; the error names `where.key`.
Result<std::string> get_string(const nlohmann::json& j, const char* key, const std::string& where,
                               size_t max_len = 256);
Result<uint64_t> get_uint(const nlohmann::json& j, const char* key, const std::string& where,
                          uint64_t min, uint64_t max);

}  // namespace rdmig::transport
