// Moves bytes between one QEMU connection (a unix socket) and one data-plane channel, in
// both directions, with two threads:
//   up:   QEMU -> channel. Waits for QEMU to have bytes, takes a credit, reads straight
//         into the channel's send buffer everything QEMU has ready (up to a chunk), sends.
//         It never waits to fill a chunk: a short read is sent at once (early flush).
//   down: channel -> QEMU. Writes each received chunk to QEMU, then releases its slot. A
//         channel that offers it writes chunks to QEMU itself when nothing is queued and QEMU's
//         socket takes them at once (no hand-off between threads per chunk); this thread then
//         writes only what QEMU could not take at once, in order.
// The QEMU socket is given up front (source) or opened lazily by `open_qemu` when the
// first chunk arrives (target: connections must reach QEMU in channel order).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>

#include "common/fd.h"
#include "common/mutex.h"
#include "common/result.h"
#include "transport/channel.h"

namespace rdmig::session {

// How long a failed source pump set to drain_on_failure() reads QEMU's connection to nowhere
// at most (QEMU closes it itself well before, once its migration cleanup has run).
inline constexpr std::chrono::milliseconds kMultifdDrainLimit{10000};
// ...and how long QEMU may leave it silent before the drain ends early. A QEMU that has not
// failed on its main channel's reset and moves nothing on a drained connection is not ending
// by itself: its migration thread waits for a multifd channel that is stuck (on QEMU 10 here:
// channels whose TLS handshake, carried by the agents, the link cut left half done, so KubeVirt's
// proxy never read their QEMU side). Such a QEMU failed only when the drained connections were
// reset, at kMultifdDrainLimit (1 in 30 link cuts on QEMU 10, 7 in 20 faults on QEMU 7.2), and
// never wedged then (bench/results/kubevirt-failures); the reset after this much silence ends
// the same state about 9 s sooner.
inline constexpr std::chrono::milliseconds kMultifdDrainIdle{1000};
// What verify_chunks() appends to each chunk.
inline constexpr size_t kVerifyTrailer = 4;

class ChannelPump {
 public:
  using Opener = std::function<Result<UniqueFd>()>;

  // Source side: QEMU's connection is already there.
  ChannelPump(transport::Channel& channel, UniqueFd qemu_fd);
  // Target side: `open_qemu` connects to QEMU when the first chunk (or eof) arrives, or at
  // once when `open_first` (an intercepted flow must reach its destination in order even
  // if the other side speaks first).
  ChannelPump(transport::Channel& channel, Opener open_qemu, bool open_first = false);
  ~ChannelPump();
  ChannelPump(const ChannelPump&) = delete;
  ChannelPump& operator=(const ChannelPump&) = delete;

  void start();
  // Both directions finished cleanly, or one failed.
  bool finished() const EXCLUDES(mu_);
  // The first error of either direction, if any.
  std::optional<Error> error() const EXCLUDES(mu_);
  // Fails both directions (shuts the QEMU socket down, aborts the channel). With `reset`,
  // the local connection is closed with a RST (SO_LINGER 0) so its peer fails at once.
  // A pump set to drain_on_failure() keeps its QEMU socket open on an abort without `reset`.
  void abort(const Error& reason, bool reset = false) EXCLUDES(mu_);
  // For a source-side QEMU connection that is not the migration's main channel; call before
  // start(). When this pump fails (its channel breaks, or abort() without reset), the QEMU
  // socket is not shut down: it is read to nowhere until QEMU closes it or `limit` passes,
  // and only then reset. Why: QEMU 7.2 can hang its outgoing migration for good when a
  // multifd channel's write fails while the migration thread waits in a multifd sync (a
  // channel thread that wakes to find the exit flag set leaves without posting the sync the
  // migration thread waits for), and its VM can then never migrate again ("duplicate yank
  // instance"). Failing QEMU through its main channel while the other channels drain lets
  // QEMU's own cleanup end its multifd threads. The drain also ends once QEMU has moved no
  // byte on the connection for kMultifdDrainIdle, also when the pump still waited
  // in a read when the failure came (a QEMU thread blocked elsewhere on this connection, e.g.
  // behind a TLS handshake the failure left half done, ends only with the reset).
  void drain_on_failure(std::chrono::milliseconds limit) EXCLUDES(mu_);
  // Turns draining on or off again until the pump has failed (a connection found to be QEMU's
  // main channel after it started stops draining; the one taken for it before starts).
  void set_drain_on_failure(bool on, std::chrono::milliseconds limit) EXCLUDES(mu_);
  // Source side: called once, from the pump's QEMU-reading thread, with the first bytes QEMU
  // sent on this connection (up to 8, peeked before they are carried). Call before start().
  using FirstBytes = std::function<void(std::span<const std::byte>)>;
  // Both ends of a channel, before start(): every chunk sent ends in a CRC32C (kVerifyTrailer
  // bytes, little-endian) of its sequence number in that direction followed by its payload, and
  // every chunk received is checked before a byte of it reaches QEMU: a damaged chunk fails the
  // channel naming it, and so does one that is not the chunk due (lost, repeated, replayed or
  // reordered), whose own CRC would otherwise still match. No splice then (the
  // payload has to pass through user space to be summed).
  void verify_chunks() { verify_ = true; }
  uint64_t chunks_verified() const { return chunks_verified_.load(std::memory_order_relaxed); }
  void on_first_bytes(FirstBytes fn) { first_bytes_ = std::move(fn); }
  // True while a failed pump still reads its QEMU socket to nowhere (or is about to).
  bool draining() const EXCLUDES(mu_);
  bool drains_on_failure() const EXCLUDES(mu_);
  uint64_t bytes_drained() const { return bytes_drained_.load(std::memory_order_relaxed); }
  // Waits up to `timeout` for both directions to end. True when they did.
  bool wait(std::chrono::milliseconds timeout) EXCLUDES(mu_);

  uint64_t bytes_up() const { return bytes_up_.load(std::memory_order_relaxed); }
  uint64_t bytes_down() const { return bytes_down_.load(std::memory_order_relaxed); }
  uint64_t chunks_up() const { return chunks_up_.load(std::memory_order_relaxed); }
  uint64_t chunks_down() const { return chunks_down_.load(std::memory_order_relaxed); }

 private:
  void up_loop();
  void down_loop();
  void record_error(const Error& e);
  void direction_done(bool up = false);
  // Down thread, once its direction ended: for a pump that drains after a failure, resets the
  // QEMU socket when QEMU moved no byte for kMultifdDrainIdle or drain_limit_ passed since the
  // failure (also when the up thread still waits in a read QEMU will never answer).
  void watch_drain();
  int qemu_fd_wait();  // blocks until the QEMU socket is open; -1 when aborted
  int open_local();    // runs the opener once; -1 (error recorded) when it fails
  void drain_local(int fd);  // drain_on_failure: reads QEMU's socket to nowhere until it closes or is reset
  // Lets the channel write chunks straight to QEMU's socket `fd` from its receiving thread when
  // nothing waits before them (see Channel::set_inline_sink); the down thread takes the rest.
  void inline_sink(int fd);

  transport::Channel& channel_;
  Opener opener_;
  bool open_first_ = false;
  FirstBytes first_bytes_;
  bool verify_ = false;
  uint64_t verify_seq_ = 0;  // down thread only: chunks received
  uint64_t send_seq_ = 0;    // up thread only: chunks sent
  std::atomic<uint64_t> chunks_verified_{0};

  // Guards qemu_fd_ (its opening and the shutdown/reset of it), qemu_ready_, aborted_, drain_,
  // hard_, up_done_, aborted_at_, drain_limit_, directions_done_ and error_; cv_ signals any
  // change of them. Taken by up_ and down_ (also in watch_drain and drain_local), and by the
  // owner's threads (abort, wait, finished, error, the drain setters). Never held across a
  // read, a write or a call into channel_: abort() shuts the socket under it and aborts the
  // channel after releasing it. (The destructor reads drain_ unlocked; nothing else writes it
  // by then.)
  mutable Mutex mu_;
  std::condition_variable cv_;
  UniqueFd qemu_fd_ GUARDED_BY(mu_);
  bool qemu_ready_ GUARDED_BY(mu_) = false;
  bool aborted_ GUARDED_BY(mu_) = false;
  bool drain_ GUARDED_BY(mu_) = false;  // drain_on_failure() was set
  bool hard_ GUARDED_BY(mu_) = false;   // the QEMU socket was shut down (a drain ends)
  bool up_done_ GUARDED_BY(mu_) = false;  // the up direction ended
  std::chrono::steady_clock::time_point aborted_at_ GUARDED_BY(mu_) = {};
  std::chrono::milliseconds drain_limit_ GUARDED_BY(mu_) = std::chrono::milliseconds{0};
  int directions_done_ GUARDED_BY(mu_) = 0;
  std::optional<Error> error_ GUARDED_BY(mu_);

  std::atomic<uint64_t> bytes_up_{0};
  std::atomic<uint64_t> bytes_down_{0};
  std::atomic<uint64_t> chunks_up_{0};
  std::atomic<uint64_t> chunks_down_{0};
  std::atomic<uint64_t> bytes_drained_{0};

  std::thread up_;
  std::thread down_;
};

}  // namespace rdmig::session
