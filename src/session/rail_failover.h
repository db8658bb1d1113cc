// The dialling end of a channel's failover over the paths dataPlane.failoverPaths lists
// (docs/failover.md): another matched rail first (the rails after the one whose link failed), then
// TCP, in the configured order. Shared by bare-QEMU source jobs (migration/source_dial.cpp) and
// KubeVirt source sessions (kubevirt/flow/source_session.cpp); each supplies its own TCP re-dial
// (their hellos differ) and the rail re-dial's terms.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "metrics/metrics.h"
#include "session/failover_channel.h"
#include "session/rails.h"
#include "transport/channel_proof.h"
#include "transport/rdma/rdma_channel.h"

namespace rdmig::session {

struct FailoverPaths {
  std::vector<std::string> order;  // dataPlane.failoverPaths: "rail", "tcp"
  size_t rails = 0;   // matched rails a channel may move to (0: none; the target did not offer failoverRails)
  bool tcp = false;   // TCP allowed (listed, and RDMA not required)
};

// One try over one rail (an index into the matched rails) until `until`; one over TCP until the deadline.
using RedialOverRail = std::function<Result<Resumed>(size_t rail, std::chrono::steady_clock::time_point until)>;
using RedialOverTcp = std::function<Result<Resumed>(std::chrono::steady_clock::time_point deadline)>;

// One try of channel `index`'s failover (a FailoverChannel::Reconnect) until `deadline`: the paths in
// order, each rail of failover_rails(paths.rails, current) with an equal share of what is left
// (TCP, when it follows, the last share: a rail that is down too must not eat the whole deadline).
// `current`: the rail the channel ran over (nullopt: TCP); set to where it resumed. A peer that
// answered and refused (kPermissionDenied, kProtocol) ends the tries at once; otherwise the error
// names every path tried.
Result<Resumed> redial_over_paths(uint32_t index, const FailoverPaths& paths, std::optional<size_t>& current,
                                  std::chrono::steady_clock::time_point deadline, const RedialOverRail& over_rail,
                                  const RedialOverTcp& over_tcp);

// A rail re-dial: channel `params.index` connected from this agent's device on `rail` to the
// peer's rdma_cm endpoint on it (connect_over, the same proved connect request as a first connect:
// `credentials`, a fresh proof), within what is left of `deadline` (at most kRdmaConnectTimeout),
// then the resume exchange run over the new channel as its dialler (`terms`, this end's `taken`;
// at most kHandshakeTimeout). The path reads "rdma rail 0: mlx5_0 10.10.0.1 to 10.10.0.2:7472".
Result<Resumed> redial_over_rail(const RailPair& rail, const transport::rdma::ChannelCredentials& credentials,
                                 const transport::rdma::RdmaChannelParams& params, TransportMetrics& metrics,
                                 const transport::ChannelTerms& terms, uint64_t taken,
                                 std::chrono::steady_clock::time_point deadline, const std::function<bool()>& cancelled);

}  // namespace rdmig::session
