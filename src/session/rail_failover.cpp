#include "session/rail_failover.h"

#include <algorithm>

#include "session/resume.h"
#include "session/transport_choice.h"
#include "session/types.h"

namespace rdmig::session {

std::vector<std::optional<RailSpot>> failover_tries(const FailoverPaths& paths, std::optional<RailSpot> current) {
  std::vector<std::optional<RailSpot>> tries;
  for (const auto& path : paths.order) {
    if (path == "rail") {
      const auto from = current ? std::optional<size_t>(current->rail) : std::nullopt;
      for (const size_t r : failover_rails(paths.rails, from)) tries.push_back(RailSpot{r, 0});
    } else if (path == "address" && current && current->rail < paths.alternates.size()) {
      // The rail's own address and its alternates, as one ring of addresses of its device.
      const size_t addresses = paths.alternates[current->rail] + 1;
      if (addresses < 2 || current->address >= addresses) continue;
      for (const size_t a : failover_rails(addresses, current->address)) tries.push_back(RailSpot{current->rail, a});
    } else if (path == "tcp" && paths.tcp) {
      tries.push_back(std::nullopt);
    }
  }
  return tries;
}

Result<Resumed> redial_over_paths(uint32_t index, const FailoverPaths& paths, std::optional<RailSpot>& current,
                                  std::chrono::steady_clock::time_point deadline, const RedialOverRail& over_rail,
                                  const RedialOverTcp& over_tcp) {
  std::string tried;
  std::optional<Error> last;
  // A peer that answered and refused ends the tries (the FailoverChannel stops on these).
  const auto refused = [](const Error& e) { return e.code == Errc::kPermissionDenied || e.code == Errc::kProtocol; };
  const auto tries = failover_tries(paths, current);
  for (size_t k = 0; k < tries.size(); ++k) {
    const auto now = std::chrono::steady_clock::now();
    const auto until = now + (deadline - now) / static_cast<int>(tries.size() - k);
    auto r = tries[k] ? over_rail(*tries[k], until) : over_tcp(deadline);
    if (r) {
      current = tries[k];
      r->passed_over = tried;
      return r;
    }
    if (refused(r.error())) return r.error();
    tried += (tried.empty() ? "" : "; ") + r.error().message;
    last = r.error();
  }
  if (!last) return Error{Errc::kUnavailable, "channel " + std::to_string(index) + ": no failover path (dataPlane.failoverPaths)"};
  return Error{last->code, tried};
}

Result<Resumed> redial_over_rail(const RailPair& rail, const transport::rdma::ChannelCredentials& credentials,
                                 const transport::rdma::RdmaChannelParams& params, TransportMetrics& metrics,
                                 const transport::ChannelTerms& terms, uint64_t taken,
                                 std::chrono::steady_clock::time_point deadline, const std::function<bool()>& cancelled) {
  using namespace std::chrono;
  const auto left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(100),
                               duration_cast<milliseconds>(kRdmaConnectTimeout));
  auto ch = connect_over(rail, credentials, params, metrics, left, cancelled);
  if (!ch) return ch.error();
  const std::string path = "rdma " + rail_text(rail);
  const auto rest = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(100),
                               duration_cast<milliseconds>(kHandshakeTimeout));
  auto peer = resume_as_dialler(*ch.value(), terms, taken, rest);
  if (!peer) return peer.error().with_context("channel " + std::to_string(params.index) + " re-dialled over " + path);
  return Resumed{std::move(ch.value()), peer.value(), path, rail.rail};
}

}  // namespace rdmig::session
