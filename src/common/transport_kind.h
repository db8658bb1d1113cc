// The data plane's transport as a request or the agent config names it: auto (RDMA when both
// agents can, else TCP), rdma or tcp. A domain word every layer uses, so it lives here and not
// in the agent config.
#pragma once

#include <string>

#include "common/result.h"

namespace rdmig {

enum class TransportKind { kAuto, kRdma, kTcp };
const char* transport_name(TransportKind kind);
// Parses "auto" | "rdma" | "tcp"; names `field` in the error.
Result<TransportKind> parse_transport(const std::string& text, const std::string& field);

}  // namespace rdmig
