// Wire framing of data channels and the credit gate both transports share.
//
// TCP data channels carry frames: an 8-byte header (type u32 LE, length u32 LE) then, for
// DATA, `length` payload bytes; for CREDIT, `length` is the number of slots freed; for
// ABORT, `length` bytes of UTF-8 reason follow; EOF has no payload.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

#include "common/result.h"

namespace rdmig::transport {

enum class FrameType : uint32_t { kData = 1, kCredit = 2, kEof = 3, kAbort = 4 };

inline constexpr size_t kFrameHeaderSize = 8;
inline constexpr uint32_t kMaxAbortReason = 4096;

struct FrameHeader {
  FrameType type = FrameType::kData;
  uint32_t length = 0;
};

std::array<std::byte, kFrameHeaderSize> encode_frame_header(FrameHeader h);
// Validates the type and the length against the channel's chunk size (DATA: 1..chunk_size,
// CREDIT: 1..depth, EOF: 0, ABORT: <= kMaxAbortReason).
Result<FrameHeader> decode_frame_header(const std::array<std::byte, kFrameHeaderSize>& raw,
                                        uint32_t chunk_size, uint32_t depth);

// Counts the sender's credits (free slots on the receiver). Starts at `depth`.
class CreditGate {
 public:
  explicit CreditGate(uint32_t depth) : depth_(depth), state_(depth) {}

  // Takes one credit, waiting while none is free. Returns true if it had to wait (a credit
  // stall). Fails with the abort reason once aborted.
  Result<bool> take();
  // Returns `n` credits. A peer returning more than it was given is a protocol error.
  Status give(uint32_t n);
  void untake();
  // Waits until every credit is back.
  Status wait_all();
  void abort(const Error& reason);
  uint32_t available() const;
  uint32_t in_flight() const { return depth_ - available(); }
  uint32_t depth() const { return depth_; }
  // Threads waiting in take() or wait_all() now.
  uint32_t waiters() const;

 private:
  // The credits free, and kAborted once aborted: one word, so a waiting sender (a futex on it,
  // C++20 atomic wait) is woken by a credit or an abort alike, and taking a credit is one
  // compare-and-swap (no lock per chunk).
  static constexpr uint32_t kAborted = 0x80000000u;
  void wake();
  Error abort_error() const;
  const uint32_t depth_;
  std::atomic<uint32_t> state_;
  std::atomic<uint32_t> waiters_{0};
  // Guards aborted_ alone (the credits themselves are state_, lock-free). Taken by abort()
  // (any thread that fails the channel) and abort_error() (a sender or drainer that saw
  // kAborted); held only for the optional, no other lock under it.
  mutable std::mutex abort_mu_;
  std::optional<Error> aborted_;  // set before kAborted (under abort_mu_)
};

// The receiver's side of credits: one credit message per quarter ring rather than per chunk.
// Receiver thread only. Holding fewer than a batch never stalls the sender for good: a sender
// that waits for a credit has every slot outstanding, so with fewer than a batch held here the
// rest (at least three quarters of the ring) is queued or on its way, and releasing it fills the
// batch. The peer's eof flushes what is held (the sender's drain waits for every credit).
class CreditBatcher {
 public:
  explicit CreditBatcher(uint32_t depth) : batch_(depth / 4 > 0 ? depth / 4 : 1) {}
  // Called for each released chunk (or eof marker). Returns how many credits to send now
  // (0: keep them): when a batch is full, and at the eof.
  uint32_t on_release(bool eof) {
    if (!eof) ++pending_;
    if (pending_ == 0) return 0;
    if (!eof && pending_ < batch_) return 0;
    const uint32_t n = pending_;
    pending_ = 0;
    return n;
  }
  uint32_t batch() const { return batch_; }

 private:
  const uint32_t batch_;
  uint32_t pending_ = 0;
};

}  // namespace rdmig::transport
