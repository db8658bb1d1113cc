#include "session/rail_failover.h"

#include <algorithm>

#include "session/resume.h"
#include "session/transport_choice.h"
#include "session/types.h"

namespace rdmig::session {

Result<Resumed> redial_over_paths(uint32_t index, const FailoverPaths& paths, std::optional<size_t>& current,
                                  std::chrono::steady_clock::time_point deadline, const RedialOverRail& over_rail,
                                  const RedialOverTcp& over_tcp) {
  std::string tried;
  std::optional<Error> last;
  const auto note = [&](const Error& e) {
    tried += (tried.empty() ? "" : "; ") + e.message;
    last = e;
  };
  // A peer that answered and refused ends the tries (the FailoverChannel stops on these).
  const auto refused = [](const Error& e) { return e.code == Errc::kPermissionDenied || e.code == Errc::kProtocol; };
  for (const auto& path : paths.order) {
    if (path == "rail" && paths.rails > 0) {
      const auto rails = failover_rails(paths.rails, current);
      for (size_t k = 0; k < rails.size(); ++k) {
        const auto now = std::chrono::steady_clock::now();
        const size_t shares = rails.size() - k + (paths.tcp ? 1 : 0);
        const auto until = now + (deadline - now) / static_cast<int>(shares);
        auto r = over_rail(rails[k], until);
        if (r) {
          current = rails[k];
          return r;
        }
        if (refused(r.error())) return r.error();
        note(r.error());
      }
    } else if (path == "tcp" && paths.tcp) {
      auto r = over_tcp(deadline);
      if (r) {
        current.reset();
        return r;
      }
      if (refused(r.error())) return r.error();
      note(r.error());
    }
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
