// Whether the peer still acknowledges a channel's RDMA writes, judged from the completions of
// the writes that asked for one. Pure: the channel's poller feeds it under the send-queue lock.
//
// Why: a path that silently stops carrying RoCE (a cut cable or rail, a switch port, a VLAN or
// PFC misconfiguration, a filter on UDP 4791) fails a queue pair only when its hardware retries
// run out, and Soft-RoCE (rdma_rxe) was not seen to run them out at all (tests/rdma/README.md).
// Until then the migration just stalls, and the first error is some timeout that names no
// NIC. RC completes writes in order, so "the oldest signalled write has waited longer than
// `stall`, and no other write completed meanwhile" means the peer's NIC acknowledged nothing
// since: the channel fails naming itself (its
// rail and device are added by the data plane). Unsignalled writes (every write but one in
// signal_every) produce no completion, so while only they are outstanding the poller is asked
// to post one zero-length signalled write (a probe: no immediate, so it takes no receive at the
// peer and changes no byte there) once nothing was posted for `probe_after`.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace rdmig::transport::rdma {

// A write the peer's NIC has not acknowledged for this long fails the channel. Far above any
// healthy completion (microseconds; a retransmission after a lost packet takes one ack timeout,
// about 0.1-1 s) and below the 10 s a target agent waits for its stalled QEMU's monitor, so the
// channel's error, naming the rail, comes first.
inline constexpr std::chrono::milliseconds kAckStall{5000};
inline constexpr std::chrono::milliseconds kAckProbeAfter{1000};

class AckWatch {
 public:
  enum class Verdict { kFine, kProbe, kStalled };

  explicit AckWatch(std::chrono::microseconds stall = kAckStall, std::chrono::microseconds probe_after = kAckProbeAfter)
      : posted_us_(1), stall_us_(stall.count()), probe_after_us_(probe_after.count()) {}
  // `capacity`: the most signalled writes outstanding at once (the send queue's size). Before
  // the first write; forgets what was posted.
  void reserve(size_t capacity) {
    posted_us_.assign(capacity == 0 ? 1 : capacity, 0);
    head_ = count_ = 0;
  }

  // A write was posted at `now_us`; `signaled`: it asked for a completion.
  void posted(uint64_t now_us, bool signaled) {
    last_post_us_ = now_us;
    if (!signaled) return;
    if (count_ == posted_us_.size()) return;  // cannot happen: the send queue holds no more
    posted_us_[(head_ + count_) % posted_us_.size()] = now_us;
    ++count_;
  }
  // The oldest signalled write completed at `now_us`. A write queued behind others starts
  // moving only when they are done (16 MiB chunks on a slow link take seconds each), so the
  // wait of the next one counts from this completion, not from its own post.
  void completed(uint64_t now_us) {
    last_completion_us_ = now_us;
    if (count_ == 0) return;
    head_ = (head_ + 1) % posted_us_.size();
    --count_;
  }
  // `outstanding`: writes posted and not yet covered by a completion (signalled or not).
  Verdict check(uint64_t now_us, uint32_t outstanding) const {
    if (outstanding == 0) return Verdict::kFine;
    if (count_ > 0) return oldest_wait_us(now_us) >= stall_us_ ? Verdict::kStalled : Verdict::kFine;
    return age(now_us, last_post_us_) >= probe_after_us_ ? Verdict::kProbe : Verdict::kFine;
  }
  // How long the oldest signalled write has waited since it was posted or since the last
  // completion, whichever came later (0 if none is outstanding).
  int64_t oldest_wait_us(uint64_t now_us) const {
    return count_ > 0 ? age(now_us, std::max(posted_us_[head_], last_completion_us_)) : 0;
  }
  size_t signaled_outstanding() const { return count_; }

 private:
  static int64_t age(uint64_t now_us, uint64_t then_us) {
    return now_us > then_us ? static_cast<int64_t>(now_us - then_us) : 0;
  }
  std::vector<uint64_t> posted_us_;  // a ring: post times of the signalled writes outstanding
  size_t head_ = 0;
  size_t count_ = 0;
  uint64_t last_post_us_ = 0;
  uint64_t last_completion_us_ = 0;
  int64_t stall_us_;
  int64_t probe_after_us_;
};

}  // namespace rdmig::transport::rdma
