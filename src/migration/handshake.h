// The transport agreement of one agent-to-agent session, shared by every kind of relay (a
// QMP-driven bare-QEMU job, an intercepted KubeVirt flow): what the source offers and what
// the target chooses, with the reason that ends up in status and metrics.
#pragma once

#include <string>

#include "common/result.h"
#include "config/agent_config.h"
#include "migration/data_plane_server.h"

namespace rdmig::migration {

struct TransportOffer {
  TransportKind transport = TransportKind::kTcp;  // kRdma or kTcp
  bool required = false;                          // fail rather than fall back
};

struct TransportChoice {
  TransportKind transport = TransportKind::kTcp;
  std::string reason;  // e.g. auto-both-rdma, auto-no-peer-rdma, requested
};

// Source side: RDMA when this agent can and the request allows it. kFailedPrecondition
// (naming `transport`) when RDMA is required and unusable here.
Result<TransportOffer> offer_transport(TransportKind requested, const RdmaSupport& rdma);

// Target side: RDMA when both ends can and neither insists on TCP. kInvalidArgument naming
// `hello.transport` when the two requirements cannot both be met.
Result<TransportChoice> choose_transport(const TransportOffer& offer, TransportKind requested,
                                         const RdmaSupport& rdma);

// Wire names ("tcp", "rdma") of the two concrete transports.
const char* wire_name(TransportKind kind);
Result<TransportKind> parse_wire_transport(const std::string& text, const std::string& field);

}  // namespace rdmig::migration
