// The dialling end of a channel's failover over the paths dataPlane.failoverPaths lists
// (docs/failover.md): another matched rail (the rails after the one whose link failed), another
// address of the same rail's device, TCP, in the configured order. Shared by bare-QEMU source jobs (migration/source_dial.cpp) and
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

// Where a channel runs over RDMA: a matched rail (an index into the matched rails) and which of its
// addresses (0: the rail's own; k: its alternate k-1, RailPair::alternates[k - 1]).
struct RailSpot {
  size_t rail = 0;
  size_t address = 0;
  bool operator==(const RailSpot&) const = default;
};

struct FailoverPaths {
  std::vector<std::string> order;  // dataPlane.failoverPaths: "rail", "address", "tcp"
  size_t rails = 0;   // matched rails a channel may move to (0: none; the target did not offer failoverRails)
  // Per matched rail, how many alternate addresses a channel may move to (empty: none; the target
  // did not offer failoverAddresses, or "address" is not this agent's to use).
  std::vector<size_t> alternates;
  bool tcp = false;   // TCP allowed (listed, and RDMA not required)
};

// The tries of one failover of a channel running on `current` (nullopt: TCP), in order, each an
// RDMA spot or TCP (nullopt): per path of paths.order, "rail": the other matched rails' own
// addresses (failover_rails), "address": the current rail's other addresses (its alternates, and
// its own address when the channel runs on an alternate), after the current one, wrapping around;
// "tcp": TCP. Never `current` itself.
std::vector<std::optional<RailSpot>> failover_tries(const FailoverPaths& paths, std::optional<RailSpot> current);

// One try over one spot until `until`; one over TCP until the deadline.
using RedialOverRail = std::function<Result<Resumed>(RailSpot spot, std::chrono::steady_clock::time_point until)>;
using RedialOverTcp = std::function<Result<Resumed>(std::chrono::steady_clock::time_point deadline)>;

// One try of channel `index`'s failover (a FailoverChannel::Reconnect) until `deadline`: the tries
// of failover_tries in order, each with an equal share of what is left (a path that is down too
// must not eat the whole deadline). `current`: where the channel ran (nullopt: TCP); set to where
// it resumed. A peer that answered and refused (kPermissionDenied, kProtocol) ends the tries at
// once; otherwise the error names every path tried.
Result<Resumed> redial_over_paths(uint32_t index, const FailoverPaths& paths, std::optional<RailSpot>& current,
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
