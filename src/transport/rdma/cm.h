// rdma_cm helpers shared by the connecting and the accepting side: waiting for one event
// with a timeout, and the private data both sides exchange when connecting.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "transport/channel_proof.h"
#include "transport/rdma/verbs.h"

namespace rdmig::transport::rdma {

// A copy of what rdmig needs from an rdma_cm_event (the event itself is acked at once).
struct CmEvent {
  rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_ERROR;
  int status = 0;
  rdma_cm_id* id = nullptr;  // for CONNECT_REQUEST: the new id, now owned by the caller
  std::vector<uint8_t> private_data;
};

// A verbs or rdma_cm call failed: errno text, code kUnavailable (fails one migration).
Error verbs_error(const std::string& what, int err);

// Waits up to `timeout` for the next event on `channel`. kTimeout when none came; kCancelled
// within 100 ms once `cancelled` (when given) returns true.
Result<CmEvent> next_cm_event(rdma_event_channel* channel, std::chrono::milliseconds timeout,
                              const std::function<bool()>& cancelled = {});
// Waits for `want`; any other event is an error that names both.
Result<CmEvent> expect_cm_event(rdma_event_channel* channel, rdma_cm_event_type want,
                                std::chrono::milliseconds timeout, const std::string& what,
                                const std::function<bool()>& cancelled = {});

inline constexpr uint32_t kPrivateMagic = 0x474d4452;  // "RDMG" little-endian
// 2: the channel proof (nonce and MAC) in the request, the acceptor's MAC in the reply.
inline constexpr uint16_t kPrivateVersion = 2;
// rdma_connect(3): "The length of the private data provided by the user is limited to 56 bytes
// for RDMA_PS_TCP" on InfiniBand and RoCE (the IB CM REQ carries 92 bytes, rdma_cm's own header
// takes 36). The request uses all 56; the reply has up to 196 (rdma_accept(3)).
inline constexpr size_t kConnectRequestBytes = 56;
inline constexpr size_t kConnectReplyBytes = 36;
// The channel proofs here are HMAC-SHA256 truncated to 16 bytes (128 bits), what fits beside the
// request's other fields. Truncation is what RFC 2104 (section 5) and NIST SP 800-107 allow for
// at least half the hash's length: a forger without the key has a 2^-128 chance per try, and
// each try costs a connect request that is rejected.
inline constexpr size_t kProofBytes = 16;
using Proof = std::array<uint8_t, kProofBytes>;

// What a source needs to connect a session's channel: the session id (16 bytes in the private
// data; no secret) and the key its channels prove (transport/channel_proof.h).
struct ChannelCredentials {
  std::array<uint8_t, 16> session{};
  std::string key;
};

// Source -> target in rdma_connect, 56 bytes, little-endian:
//   magic u32 | version u16 | index u16 | session 16 | ring_addr u64 | ring_rkey u32 | nonce u32 |
//   proof 16 = HMAC-SHA256(key, "rdmig-channel\ndial\n" session-hex "\n" index "\n" fresh)[0..16)
//   fresh = "rdma " ring_addr " " ring_rkey " " nonce (decimal): the connection's own parameters
//   (the source's freshly registered ring) and a random nonce. The target checks the proof before
//   the QP is accepted and takes each proof once (ProofLedger): a replayed request is refused.
struct ConnectRequest {
  std::array<uint8_t, 16> session{};
  uint16_t index = 0;
  uint64_t ring_addr = 0;  // the source's receive ring (for QEMU's return path)
  uint32_t ring_rkey = 0;
  uint32_t nonce = 0;
  Proof proof{};
  // Not on the wire: this agent's rail (rdma.devices index) whose rdma_cm listener took the
  // request, set by the data-plane server (a rail failover's target names it).
  uint32_t rail = 0;
  // Likewise: which of that rail's addresses (0: its own; k: alternate address k-1).
  uint32_t address = 0;
  std::vector<uint8_t> encode() const;
  // An older agent's request (another version) is refused naming both versions.
  static Result<ConnectRequest> decode(const std::vector<uint8_t>& raw);
};

// Target -> source in rdma_accept, 36 bytes: magic u32 | version u16 | 0 u16 | ring_addr u64 |
//   ring_rkey u32 | proof 16 = the acceptor's MAC ("accept") over the request's fresh part and
//   this reply's ring: the source knows the target holds the key too.
struct ConnectReply {
  uint64_t ring_addr = 0;  // the target's receive ring
  uint32_t ring_rkey = 0;
  Proof proof{};
  std::vector<uint8_t> encode() const;
  static Result<ConnectReply> decode(const std::vector<uint8_t>& raw);
};

// Fills the request's nonce (random) and proof under `key`.
void sign_request(ConnectRequest& request, const std::string& key);
// The target's check, before anything is admitted: kUnauthenticated naming the proof when it is
// wrong or was taken before (`ledger` records every good one).
Status check_request(const ConnectRequest& request, const std::string& key, ProofLedger& ledger);
// The reply's proof, and the source's check of it.
void sign_reply(ConnectReply& reply, const ConnectRequest& request, const std::string& key);
Status check_reply(const ConnectReply& reply, const ConnectRequest& request, const std::string& key);

// rdma_set_option(RDMA_OPTION_ID_TOS): the IP ToS byte of RoCE v2 packets (traffic class on IB).
// Set before rdma_resolve_route (the kernel picks the route's priority from it). tos < 0: no-op.
Status set_tos(rdma_cm_id* id, int tos);

// Session keys travel as 32 hex characters on the control connection and as 16 bytes here.
Result<std::array<uint8_t, 16>> session_from_hex(const std::string& hex);

}  // namespace rdmig::transport::rdma
