// TargetJob and its source agent after the start: a channel or the control connection re-dialled
// by the source (failover, docs/failover.md: over TCP, which on_data puts in redials_, or over
// another rail, rdma_redial_plan), taken by the channel's failover and resumed; and the source's
// abort or loss, read when this end fails. The rest of the job: target_job.cpp.
#include "migration/target_job.h"

#include <thread>

#include "common/log.h"
#include "session/protocol.h"

namespace rdmig::migration {

using session::kHelloTimeout;
using namespace std::chrono_literals;

Result<session::RedialSlots::Redialled> TargetJob::take_redial(uint32_t index, uint64_t count,
                                                               std::chrono::steady_clock::time_point deadline,
                                                               const std::function<bool()>& stopped) {
  return redials_.take(index, channel_terms(index), count, deadline, [&] { return stopped() || cancel_requested(); },
                       std::chrono::duration_cast<std::chrono::milliseconds>(kHelloTimeout));
}

transport::ChannelTerms TargetJob::channel_terms(uint32_t index) {
  MutexLock lock(conn_mu_);
  return transport::ChannelTerms{channel_key_, session_, index};
}

Result<session::Resumed> TargetJob::reaccept(uint32_t index, uint64_t taken,
                                             std::chrono::steady_clock::time_point deadline,
                                             const std::function<bool()>& stopped) {
  auto r = take_redial(index, taken, deadline, stopped);
  if (!r) return r.error();
  session::RedialTls tls;
  if (ctx_.config.data_plane.tls) {
    tls = [this, index](int fd, std::chrono::milliseconds left) {
      return channel_tls(fd, transport::TlsStream::Role::kAcceptor, channel_terms(index), left);
    };
  }
  return session::resumed_redial(std::move(r.value()), index,
                                 session::TcpGeometry{static_cast<uint32_t>(spec_.chunk_size), spec_.ring_depth,
                                                      &ctx_.metrics.transport("tcp"), ctx_.config.tcp.splice},
                                 tls);
}

Result<std::pair<UniqueFd, uint64_t>> TargetJob::reaccept_control(uint64_t received,
                                                                   std::chrono::steady_clock::time_point deadline,
                                                                   const std::function<bool()>& stopped) {
  auto r = take_redial(transport::kControlIndex, received, deadline, stopped);
  if (!r) return r.error();
  return std::make_pair(std::move(r->fd), r->peer_count);
}

Result<transport::rdma::AcceptPlan> TargetJob::rdma_redial_plan(const transport::rdma::ConnectRequest& request) {
  const uint32_t index = request.index;
  {
    MutexLock dlock(data_mu_);
    auto* fc = failover_channel(index);
    // As a TCP re-dial (on_data): only a live channel of a migration that fails over over rails;
    // one this end ended is refused at once, so the source fails now, not at its deadline.
    if (!(failover_rails_ || failover_addresses_) || finished() || cancel_requested() || fc == nullptr || fc->failed()) {
      return Error{Errc::kPermissionDenied, "channel " + std::to_string(index) + " of migration " + spec_.id +
                                                " is already connected and is not failed over here"};
    }
  }
  auto plan = channel_plan(index);
  // The rail it came over (this agent's listener on it), for the failover's words on this end.
  plan.deliver = [this, index, rail = request.rail,
                  via = session::arrival_rail_text(rail_pairs_, request.rail, request.address)](
                     Result<std::unique_ptr<transport::Channel>> ch) mutable {
    if (!ch) {
      LOG_WARN("migration") << log_prefix() << " channel " << index << " re-dialled over RDMA (" << via
                            << "): " << ch.error().message;
      return;  // the source tries again, or another path
    }
    MutexLock dlock(data_mu_);
    auto* fc = failover_channel(index);
    if (fc == nullptr || fc->failed()) return;  // ended meanwhile: the new channel just closes
    redials_.hand_over(index, std::move(ch.value()), std::move(via), rail, [&] {  // a newer one replaces one not taken
      fc->interrupt(Error{Errc::kUnavailable, "the source agent re-dialled channel " + std::to_string(index) + " over RDMA"});
    });
  };
  return plan;
}

std::optional<Error> TargetJob::source_reason(std::chrono::milliseconds wait) {
  if (!link_) return std::nullopt;
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    auto m = link_->next(std::min<std::chrono::milliseconds>(left, 250ms));
    if (!m) return std::nullopt;  // the source agent closed the link without a reason
    if (m->has_value() && session::is(**m, session::MessageKind::kAbort)) {
      source_decided_ = true;
      return Error{Errc::kUnavailable, "source agent aborted: " + (**m).value("reason", std::string("?"))};
    }
  }
}

std::optional<std::string> TargetJob::source_gone(std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    if (link_) {
      auto m = link_->next(0ms);
      if (!m) return "the source agent went away (" + m.error().message + ")";
      if (m->has_value() && session::is(**m, session::MessageKind::kAbort)) {
        return "source agent aborted: " + (**m).value("reason", std::string("?"));
      }
    }
    // A channel's peer lost: the one that failed by itself first, named with its rail (a cut
    // rail fails its channels with "work completion failed", the others only echo the abort).
    if (auto f = channel_failure(Errc::kUnavailable)) {
      return "the source agent went away (" + data_plane_error(f->error, f->channel).message + ")";
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(50ms);
  }
}

}  // namespace rdmig::migration
