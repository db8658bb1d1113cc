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
inline constexpr uint16_t kPrivateVersion = 1;

// Source -> target in rdma_connect (fits the 56 bytes rdma_cm allows on InfiniBand/RoCE).
struct ConnectRequest {
  std::array<uint8_t, 16> session{};
  uint16_t index = 0;
  uint64_t ring_addr = 0;  // the source's receive ring (for QEMU's return path)
  uint32_t ring_rkey = 0;
  std::vector<uint8_t> encode() const;
  static Result<ConnectRequest> decode(const std::vector<uint8_t>& raw);
};

// Target -> source in rdma_accept.
struct ConnectReply {
  uint64_t ring_addr = 0;  // the target's receive ring
  uint32_t ring_rkey = 0;
  std::vector<uint8_t> encode() const;
  static Result<ConnectReply> decode(const std::vector<uint8_t>& raw);
};

// rdma_set_option(RDMA_OPTION_ID_TOS): the IP ToS byte of RoCE v2 packets (traffic class on IB).
// Set before rdma_resolve_route (the kernel picks the route's priority from it). tos < 0: no-op.
Status set_tos(rdma_cm_id* id, int tos);

// Session keys travel as 32 hex characters on the control connection and as 16 bytes here.
Result<std::array<uint8_t, 16>> session_from_hex(const std::string& hex);

}  // namespace rdmig::transport::rdma
