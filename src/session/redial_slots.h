// The accepting end of a failover (docs/failover.md): the connections the peer re-dialled to fail
// over a channel (or the control connection, transport::kControlIndex) of one session, from the
// data-plane accept thread that checked their proof (put()) to the failover that waits for one
// (take(): the FailoverChannel's or ControlLink's Reconnect on this end). Shared by bare-QEMU
// target jobs (migration/target_job.cpp) and KubeVirt target sessions (kubevirt/flow/target_session.cpp).
// A rail failover's re-dial is an RDMA channel instead (accepted by the rdma_cm listener): its
// resume exchange runs over the channel itself (resume.h).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "common/fd.h"
#include "common/mutex.h"
#include "common/result.h"
#include "session/failover_channel.h"
#include "transport/channel.h"
#include "transport/channel_proof.h"
#include "transport/tcp/tcp_channel.h"

namespace rdmig::session {

class RedialSlots {
 public:
  struct Redialled {
    UniqueFd fd;                                   // a TCP re-dial, or
    std::unique_ptr<transport::Channel> channel;  // an RDMA one (a rail failover)
    uint64_t peer_count = 0;            // the peer's count from the resume exchange
    std::chrono::milliseconds left{0};  // what is left of the deadline for the next step (TLS)
    std::string where;                  // "channel 3 re-dialled by the source", for errors
    std::string via;                    // an RDMA re-dial: the rail it came over, as put() named it
    std::optional<uint32_t> rail{};     // and that rail's number
  };
  // A re-dialled connection for `index`, its proof checked and its welcome sent; a newer re-dial
  // replaces one not yet taken. Wakes the take() that waits for it.
  void put(uint32_t index, UniqueFd fd) EXCLUDES(mu_);
  // The same for a channel re-dialled over RDMA (connected, its proof checked by the listener);
  // `via` names the rail it came over ("rail 1: mlx5_1 ..."), `rail` its number, handed on to the take.
  void put(uint32_t index, std::unique_ptr<transport::Channel> channel, std::string via = {},
           std::optional<uint32_t> rail = std::nullopt) EXCLUDES(mu_);
  // put(), after `give_up_live` told the live link of `index` that it is gone (a FailoverChannel's
  // or ControlLink's interrupt()). In that order: a re-dial put first can be taken, resumed on and
  // made the live link by a failover already under way before the interrupt runs, which then gives
  // up that new link, and the peer fails over again for nothing (whole run W38: three failovers for
  // one lost link). Called without this object's lock held.
  void hand_over(uint32_t index, UniqueFd fd, const std::function<void()>& give_up_live) EXCLUDES(mu_);
  void hand_over(uint32_t index, std::unique_ptr<transport::Channel> channel, std::string via,
                 std::optional<uint32_t> rail, const std::function<void()>& give_up_live) EXCLUDES(mu_);
  // Waits until `deadline` for the re-dial of `index` (polling `stopped` every 50 ms: kCancelled
  // once it turns true), takes it and runs the resume exchange as its acceptor over `terms` with
  // this end's `count`, bounded by the deadline (at least 100 ms, at most `max_step`). `peer`
  // names who re-dials ("the source") in errors.
  Result<Redialled> take(uint32_t index, const transport::ChannelTerms& terms, uint64_t count,
                         std::chrono::steady_clock::time_point deadline, const std::function<bool()>& stopped,
                         std::chrono::milliseconds max_step, const std::string& peer = "the source") EXCLUDES(mu_);

 private:
  // Guards slots_; cv_ signals a put. Taken by the accept threads (put) and the failovers (take),
  // never across a socket call. Innermost: callers may hold their own lock around put().
  Mutex mu_;
  std::condition_variable cv_;
  struct Slot {
    UniqueFd fd;
    std::unique_ptr<transport::Channel> channel;
    std::string via;
    std::optional<uint32_t> rail{};
  };
  std::map<uint32_t, Slot> slots_ GUARDED_BY(mu_);
};

// A session's TCP channel geometry, for the channel a TCP re-dial becomes (resumed_redial).
struct TcpGeometry {
  uint32_t chunk_size = 0;
  uint32_t ring_depth = 0;
  TransportMetrics* metrics = nullptr;
  transport::SpliceMode splice = transport::SpliceMode::kOff;
};
using RedialTls = std::function<Result<std::unique_ptr<transport::TlsStream>>(int fd, std::chrono::milliseconds left)>;
// What the waiting end of a failover makes of the re-dial it took: an RDMA re-dial is the channel,
// resumed already ("rdma rail 1: ... (re-dialled by the source)"); a TCP one becomes channel
// `index` again (a TcpChannel of the session's `geometry`), its TLS run again first by `tls`
// (given the fd and what is left of the deadline; null: the data plane has no TLS), "tcp
// (re-dialled by the source)". Shared by TargetJob::reaccept and TargetSession::reaccept.
Result<Resumed> resumed_redial(RedialSlots::Redialled r, uint32_t index, const TcpGeometry& geometry,
                               const RedialTls& tls);

}  // namespace rdmig::session
