// Control messages between agents: a u32 little-endian length then a JSON object, at most
// kMaxMessageBytes. Used on the control connection and to open each TCP data channel.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/result.h"

namespace rdmig::transport {

// 2: the control hello carries no token; the target challenges and the source proves it
// (control_proof), so the one-time token never crosses the data-plane network.
// 3: the control hello carries the source's nonce (covered by its proof), and every data channel
// proves the session's channel key (transport/channel_proof.h): the session id in the welcome
// names the session and is no secret.
inline constexpr uint32_t kProtocolVersion = 3;
inline constexpr uint32_t kMaxMessageBytes = 64 * 1024;
inline constexpr uint32_t kMaxChannels = 65;  // main + 64 multifd
// The index a re-dialled control connection's proof names (Hello::control): none of a data channel.
inline constexpr uint32_t kControlIndex = kMaxChannels;

Status send_message(int fd, const nlohmann::json& message);
// A refusal on a data-plane or control connection ({"type":"reject","code","message"}), best
// effort: the peer may already be gone, and the caller closes the connection anyway.
void send_reject(int fd, const std::string& code, const std::string& message);
// Waits up to `timeout` for a whole message. kUnavailable when the peer closed.
Result<nlohmann::json> recv_message(int fd, std::chrono::milliseconds timeout);

// One RDMA rail of an agent as the other agent sees it: its index in that agent's config
// (rdma.devices[rail]) and where it is: the source's hello gives the address its channels leave
// from, the target's welcome the rdma_cm endpoint (ip:port) they connect to.
struct RailAddress {
  uint32_t rail = 0;
  std::string address;
  uint32_t mtu = 0;  // "mtu", optional: the active MTU (bytes) of the agent's port on this rail; 0 = not given
};
inline constexpr uint32_t kMaxRails = 16;
nlohmann::json rails_to_json(const std::vector<RailAddress>& rails);
// `j[key]` (optional: an empty list when absent) as a list of rails; errors name `where.key[i]`.
Result<std::vector<RailAddress>> parse_rails(const nlohmann::json& j, const char* key, const std::string& where);

// First message on every connection to an agent's data-plane port.
struct Hello {
  uint32_t protocol = kProtocolVersion;
  std::string kind;          // "control" or "data"
  std::string migration_id;  // the target agent's migration id
  std::string session;       // data: the session id from the welcome (no secret)
  // control: the source's nonce, its half of the channel key; data: the dialler's fresh nonce
  // (transport/channel_proof.h). 32 lowercase hex characters.
  std::string nonce;
  uint32_t index = 0;        // data: channel index (0 = QEMU's main channel)
  uint32_t channels = 0;     // control: QEMU connections (1 + multifd channels)
  uint64_t chunk_size = 0;   // control
  uint32_t ring_depth = 0;   // control
  std::string transport;     // control: preferred transport, "tcp" or "rdma"
  bool transport_required = false;  // control: fail rather than fall back to TCP
  // control, optional: active MTU (bytes) of the source's RDMA port; 0 = not offered. The two
  // ports must agree: rdma_cm takes the connecting side's MTU for both ends.
  uint32_t rdma_mtu = 0;
  // control, optional: the source's working RDMA rails ("rdmaRails"); empty from a one-device peer.
  std::vector<RailAddress> rdma_rails;
  // control, optional ("verifyChunks"): every chunk of every channel, both ways, ends in the
  // CRC32C of its payload, checked before a byte reaches QEMU (session/pump.h).
  bool verify_chunks = false;
  // optional ("tls"), control and data: the source has dataPlane.tls on, so every TCP data
  // channel runs TLS after its proof (transport/tcp/tls_stream.h). The target refuses a hello
  // whose wish is not its own config, naming dataPlane.tls: never a silent fallback to clear.
  bool tls = false;
  // control, optional ("failover"): the source fails its TCP data channels over (docs/failover.md);
  // the target's welcome confirms it ("failover": true) when it does too.
  bool failover = false;
  // data, optional ("resume"): this connection re-establishes channel `index` of a session that
  // fails over; the resume exchange (session/resume.h) follows its proof.
  bool resume = false;
  // data, optional ("control", with "resume" or "recover", and index 0): this connection
  // re-establishes the session's control connection instead; its proof's terms name kControlIndex.
  bool control = false;
  // data, optional ("recover", not with "resume"): a fresh connection for a post-copy recovery
  // (docs/api.md): both QEMUs are postcopy-paused and the channel starts a new stream (QEMU's
  // resume), so no resume exchange follows; with "control" the recovery's control connection.
  bool recover = false;

  nlohmann::json to_json() const;
  // Validates every field; errors name the field ("hello.chunkSize").
  static Result<Hello> parse(const nlohmann::json& j);
};

// What both ends of a session must agree on, as every kind of hello offers it:
// chunkSize, ringDepth, transport (tcp|rdma), transportRequired (optional). Errors name
// `where.field`.
// The source's answer to the target's challenge on a control connection: proves the one-time
// token of `migration_id` without sending it, over the target's nonce and the source's own (the
// hello's): HMAC-SHA256(token, "rdmig-control\n" target nonce "\n" migration id "\n" source nonce).
// The refusal both ends give when one has dataPlane.tls on and the other off ("tls_mismatch").
std::string tls_mismatch(bool source_on, bool target_on);

std::string control_proof(const std::string& token, const std::string& nonce, const std::string& migration_id,
                          const std::string& source_nonce);

struct SessionTerms {
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  std::string transport;
  bool transport_required = false;
};
Result<SessionTerms> parse_session_terms(const nlohmann::json& j, const std::string& where);

// Reads a required field of a given JSON type; the error names `where.key`.
Result<std::string> get_string(const nlohmann::json& j, const char* key, const std::string& where,
                               size_t max_len = 256);
Result<uint64_t> get_uint(const nlohmann::json& j, const char* key, const std::string& where,
                          uint64_t min, uint64_t max);

}  // namespace rdmig::transport
