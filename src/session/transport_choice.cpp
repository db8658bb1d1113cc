#include "session/transport_choice.h"

#include <algorithm>

namespace rdmig::session {

const char* wire_name(TransportKind kind) { return kind == TransportKind::kRdma ? "rdma" : "tcp"; }

Result<TransportKind> parse_wire_transport(const std::string& text, const std::string& field) {
  if (text == "rdma") return TransportKind::kRdma;
  if (text == "tcp") return TransportKind::kTcp;
  return Error{Errc::kInvalidArgument, field + ": must be tcp or rdma, got '" + text + "'"};
}

std::string with_rdma_reason(const std::string& reason, const RdmaSupport& rdma) {
  return rdma.available || rdma.reason_code.empty() ? reason : reason + ":" + rdma.reason_code;
}

Result<TransportOffer> offer_transport(TransportKind requested, const RdmaSupport& rdma) {
  if (requested == TransportKind::kRdma && !rdma.available) {
    return Error{Errc::kFailedPrecondition,
                 "transport: rdma was requested but this agent has no usable RDMA device (" + rdma.reason_code + ": " +
                     rdma.reason + ")"};
  }
  TransportOffer offer;
  offer.transport = (requested != TransportKind::kTcp && rdma.available) ? TransportKind::kRdma : TransportKind::kTcp;
  offer.required = requested != TransportKind::kAuto;
  return offer;
}

Result<TransportChoice> choose_transport(const TransportOffer& offer, TransportKind requested,
                                         const RdmaSupport& rdma, const std::vector<RailMtu>& rail_mtus) {
  TransportChoice choice;
  if (offer.transport == TransportKind::kRdma) {
    const auto mismatch = std::find_if(rail_mtus.begin(), rail_mtus.end(), [](const RailMtu& m) {
      return m.source != 0 && m.target != 0 && m.source != m.target;
    });
    if (rdma.available && mismatch != rail_mtus.end() && requested != TransportKind::kTcp) {
      const std::string rail = "rail " + std::to_string(mismatch->rail);
      const std::string what = "the RDMA ports' active MTUs differ on " + rail + " (target device " +
                               mismatch->device + "): source " + std::to_string(mismatch->source) + ", target " +
                               std::to_string(mismatch->target) + " bytes: give both RDMA interfaces of " + rail +
                               " the same MTU";
      if (offer.required || requested == TransportKind::kRdma) {
        return Error{Errc::kInvalidArgument, "hello.rdmaMtu: rdma is required but " + what};
      }
      choice.reason = "auto-no-peer-rdma:mtu-mismatch";
      choice.detail = what;
      return choice;
    }
    if (rdma.available && requested != TransportKind::kTcp) {
      choice.transport = TransportKind::kRdma;
      choice.reason = offer.required || requested == TransportKind::kRdma ? "requested" : "auto-both-rdma";
      return choice;
    }
    if (offer.required) {
      return Error{Errc::kInvalidArgument,
                   "hello.transport: the source requires rdma but " +
                       (rdma.available ? std::string("this target was asked for tcp")
                                       : "the target agent has no usable RDMA device (" + rdma.reason + ")")};
    }
    // The target's own reason code rides along: auto-no-peer-rdma:no-address.
    choice.reason = rdma.available ? "target-requested-tcp" : with_rdma_reason("auto-no-peer-rdma", rdma);
    return choice;
  }
  if (requested == TransportKind::kRdma) {
    return Error{Errc::kInvalidArgument, "hello.transport: the target requires rdma, the source offered tcp"};
  }
  choice.reason = offer.required ? "requested" : "auto-no-source-rdma";
  return choice;
}

}  // namespace rdmig::session
