// The transport agreement of one agent-to-agent session, shared by every kind of relay (a
// QMP-driven bare-QEMU job, an intercepted KubeVirt flow): what the source offers and what
// the target chooses, with the reason that ends up in status and metrics.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "common/result.h"
#include "common/transport_kind.h"
#include "session/data_plane_server.h"

namespace rdmig::session {

// The reason when both agents chose RDMA but the source's rdma_cm could not reach the target's
// listener (address or route resolution failed, the connect timed out or was refused): with
// transport auto the migration falls back to TCP under this reason; with rdma required it
// fails naming it.
inline constexpr const char* kPeerRdmaUnreachable = "auto-no-peer-rdma:unreachable";
// The most a failover re-dial tries one RDMA channel (resolution and connect together); a first
// connect tries rdma.connectTimeoutSeconds (default 15) before the peer counts as unreachable.
inline constexpr std::chrono::seconds kRdmaConnectTimeout{15};

struct TransportOffer {
  TransportKind transport = TransportKind::kTcp;  // kRdma or kTcp
  bool required = false;                          // fail rather than fall back
};

struct TransportChoice {
  TransportKind transport = TransportKind::kTcp;
  std::string reason;  // e.g. auto-both-rdma, auto-no-peer-rdma, requested
  std::string detail;  // a fallback's cause in words, for the log (the rail whose MTUs differ)
};

// The active MTUs (bytes; 0: unknown) of the two ports of one matched rail that carries a
// channel (session/rails.h rail_mtus).
struct RailMtu {
  uint32_t rail = 0;
  std::string device;   // the target's device on the rail
  uint32_t source = 0;
  uint32_t target = 0;
};

// Source side: RDMA when this agent can and the request allows it. kFailedPrecondition
// (naming `transport`) when RDMA is required and unusable here.
Result<TransportOffer> offer_transport(TransportKind requested, const RdmaSupport& rdma);

// Target side: RDMA when both ends can and neither insists on TCP. kInvalidArgument naming
// `hello.transport` when the two requirements cannot both be met. `rail_mtus` are the two ports'
// MTUs on every rail the session's channels will use: rdma_cm would run both ends of a channel at
// the connecting side's MTU, so a port with a smaller one would drop the larger packets until the
// QP fails. A rail whose two MTUs differ (both known) makes the session TCP
// (auto-no-peer-rdma:mtu-mismatch, `detail` naming the rail) or, when RDMA is required, an error
// naming the rail, its device and both MTUs.
Result<TransportChoice> choose_transport(const TransportOffer& offer, TransportKind requested,
                                         const RdmaSupport& rdma, const std::vector<RailMtu>& rail_mtus = {});

// `reason` with this agent's RDMA reason code appended when it has no RDMA ("auto-no-peer-rdma"
// becomes "auto-no-peer-rdma:no-address"); the part before ':' is the metric label.
std::string with_rdma_reason(const std::string& reason, const RdmaSupport& rdma);

// Wire names ("tcp", "rdma") of the two concrete transports.
const char* wire_name(TransportKind kind);
Result<TransportKind> parse_wire_transport(const std::string& text, const std::string& field);

}  // namespace rdmig::session
