#include "common/transport_kind.h"

namespace rdmig {

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto: return "auto";
    case TransportKind::kRdma: return "rdma";
    case TransportKind::kTcp: return "tcp";
  }
  return "?";
}

Result<TransportKind> parse_transport(const std::string& text, const std::string& field) {
  if (text == "auto") return TransportKind::kAuto;
  if (text == "rdma") return TransportKind::kRdma;
  if (text == "tcp") return TransportKind::kTcp;
  return Error{Errc::kInvalidArgument,
               field + ": unknown transport '" + text + "' (expected auto, rdma or tcp)"};
}

}  // namespace rdmig
