#include "session/redial_slots.h"

#include <algorithm>
#include <utility>

#include "session/resume.h"
#include "transport/wire.h"

namespace rdmig::session {

void RedialSlots::put(uint32_t index, UniqueFd fd) {
  {
    MutexLock lock(mu_);
    slots_[index] = Slot{std::move(fd), nullptr, {}};
  }
  cv_.notify_all();
}

void RedialSlots::put(uint32_t index, std::unique_ptr<transport::Channel> channel, std::string via,
                      std::optional<uint32_t> rail) {
  Slot older;  // a re-dial not yet taken: closed once the lock is released (a channel joins a thread)
  {
    MutexLock lock(mu_);
    older = std::exchange(slots_[index], Slot{UniqueFd(), std::move(channel), std::move(via), rail});
  }
  cv_.notify_all();
}

void RedialSlots::hand_over(uint32_t index, UniqueFd fd, const std::function<void()>& give_up_live) {
  give_up_live();
  put(index, std::move(fd));
}

void RedialSlots::hand_over(uint32_t index, std::unique_ptr<transport::Channel> channel, std::string via,
                            std::optional<uint32_t> rail, const std::function<void()>& give_up_live) {
  give_up_live();
  put(index, std::move(channel), std::move(via), rail);
}

Result<RedialSlots::Redialled> RedialSlots::take(uint32_t index, const transport::ChannelTerms& terms, uint64_t count,
                                                 std::chrono::steady_clock::time_point deadline,
                                                 const std::function<bool()>& stopped,
                                                 std::chrono::milliseconds max_step, const std::string& peer) {
  using namespace std::chrono;
  const std::string what =
      index == transport::kControlIndex ? std::string("the control connection") : "channel " + std::to_string(index);
  Redialled r;
  {
    MutexLock lock(mu_);
    for (;;) {
      auto it = slots_.find(index);
      if (it != slots_.end() && (it->second.fd.valid() || it->second.channel)) {
        r.fd = std::move(it->second.fd);
        r.channel = std::move(it->second.channel);
        r.via = std::move(it->second.via);
        r.rail = it->second.rail;
        slots_.erase(it);
        break;
      }
      if (stopped()) return Error{Errc::kCancelled, "cancelled"};
      if (steady_clock::now() >= deadline) return Error{Errc::kTimeout, "no re-dial of " + what + " from " + peer + " agent arrived"};
      lock.wait_for(cv_, 50ms);
    }
  }
  r.left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(100), max_step);
  r.where = what + " re-dialled by " + peer;
  auto got = r.channel ? resume_as_acceptor(*r.channel, terms, count, r.left)
                       : resume_as_acceptor(r.fd.get(), terms, count, r.left);
  if (!got) return got.error().with_context(r.where);
  r.peer_count = got.value();
  return r;
}

Result<Resumed> resumed_redial(RedialSlots::Redialled r, uint32_t index, const TcpGeometry& geometry,
                               const RedialTls& tls) {
  // Over another rail (a connect request for the live channel): resumed already.
  if (r.channel) {
    return Resumed{std::move(r.channel), r.peer_count,
                   "rdma " + (r.via.empty() ? std::string("rail ?") : r.via) + " (re-dialled by the source)", r.rail};
  }
  std::unique_ptr<transport::TlsStream> stream;
  if (tls) {
    auto made = tls(r.fd.get(), r.left);
    if (!made) return made.error().with_context(r.where);
    stream = std::move(made.value());
  }
  auto ch = transport::TcpChannel::create(std::move(r.fd), index, geometry.chunk_size, geometry.ring_depth,
                                          *geometry.metrics, geometry.splice, std::move(stream));
  return Resumed{std::move(ch), r.peer_count, "tcp (re-dialled by the source)"};
}

}  // namespace rdmig::session
