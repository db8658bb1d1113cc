// A channel carries one QEMU connection between two agents, in both directions, as a
// sequence of chunks. Implementations: tcp/ (sockets) and rdma/ (RC queue pairs).
//
// Flow control is by credits: the receiver owns a ring of `depth` slots of `chunk_size`
// bytes; the sender may have at most `depth` chunks outstanding and gets a credit back each
// time the receiver has written a chunk to its QEMU socket and released the slot.
//
// Threading: one thread sends (acquire/send/send_eof), one thread receives
// (receive/release); abort() may be called from any thread and wakes both.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <functional>
#include <span>
#include <string>

#include "common/result.h"

namespace rdmig::transport {

struct ChunkView {
  std::span<const std::byte> data;  // valid until release()
  bool eof = false;                 // the peer finished sending on this channel
  // receive_deferred() only: payload bytes still in the channel (data is empty); deliver_to()
  // moves them.
  size_t pending = 0;
};

// What one hop between a channel and a local socket (QEMU's connection) moved.
struct LocalMove {
  size_t bytes = 0;        // payload bytes moved
  bool local_eof = false;  // the local socket is at end of stream (send side)
  int local_errno = 0;     // the local socket failed with this errno; the channel did not
};

class Channel {
 public:
  virtual ~Channel() = default;

  // Waits for a credit (a free slot on the peer) and returns a buffer of chunk_size() bytes
  // to fill. Fails when the channel is aborted.
  virtual Result<std::span<std::byte>> acquire() = 0;
  // Sends the first `n` bytes (1..chunk_size) of the acquired buffer as one chunk.
  virtual Status send(size_t n) = 0;
  // Gives back an acquired credit without sending (QEMU had nothing after all).
  virtual void unacquire() = 0;
  // No more chunks in this direction (QEMU closed its side).
  virtual Status send_eof() = 0;
  // Waits until the peer has released every chunk sent (all credits back).
  virtual Status drain() = 0;

  // Next chunk in order (blocks), or eof.
  virtual Result<ChunkView> receive() = 0;
  // Frees the slot of the last received chunk and returns its credit to the peer.
  virtual Status release() = 0;

  // Zero-copy hops between the channel and a local socket (splice(2) on TCP), used by the
  // pump when splices() is true. The copying calls above work on every channel.
  virtual bool splices() const { return false; }
  // After acquire(): moves what `fd` has ready (1..chunk_size bytes, never waiting to fill a
  // chunk) into one chunk and sends it. When nothing was moved (local_eof or local_errno),
  // the credit is still held: give it back with unacquire().
  virtual Result<LocalMove> send_from(int /*fd*/) {
    return Error{Errc::kInternal, std::string(transport()) + " channel cannot send from a socket"};
  }
  // Like receive(), but may leave the payload in the channel: ChunkView::pending bytes that
  // deliver_to() then moves.
  virtual Result<ChunkView> receive_deferred() { return receive(); }
  // Moves the pending payload of the chunk receive_deferred() returned into `fd` (all of it,
  // or fails); release() the chunk after.
  virtual Result<LocalMove> deliver_to(int /*fd*/) {
    return Error{Errc::kInternal, std::string(transport()) + " channel cannot deliver to a socket"};
  }

  // Receiving straight into a local socket, optional (false: not offered; receive() only). While
  // a sink is set, the thread that takes chunks off the wire may write one to `fd` itself,
  // without a hand-off to the receiving thread: only when nothing is queued before it, only as
  // much as `fd` takes without blocking (MSG_DONTWAIT: a slow QEMU does not hold up the channel;
  // a splicing channel may wait a bounded while, below), calling `delivered(bytes, whole_chunk)`,
  // and returning the slot's credit at once when the whole chunk went. What it could not write is
  // queued for receive() as before, from the first byte not written. Writes that fail are left
  // for receive()'s caller to meet. A splicing channel (splices()) splices deferred chunks into
  // `fd` the same way and makes `fd` non-blocking for it: the caller's own reads and writes on
  // `fd` must then wait for readiness (poll on EAGAIN); what it leaves comes out of
  // receive_deferred() as pending for deliver_to(). It may wait for room in `fd` a short while
  // (TcpChannel: 50 ms a chunk) before it leaves the rest, calling `delivered` for each part
  // written. clear_inline_sink() returns once no such write or wait runs: call it before `fd` is
  // closed.
  using Delivered = std::function<void(size_t bytes, bool whole_chunk)>;
  virtual bool set_inline_sink(int /*fd*/, Delivered /*delivered*/) { return false; }
  virtual void clear_inline_sink() {}

  // Fails all pending and later calls with `reason` and tells the peer when it can.
  // Idempotent and thread-safe.
  virtual void abort(const Error& reason) = 0;
  // After the channel failed: true when its link did (a reset, a connection closed without the
  // peer's abort, a transport error), false when either end ended it on purpose (an abort, the
  // peer's reason), on a protocol error or for lack of memory. Only a lost link may be failed over
  // (session/failover_channel.h). Channels that cannot tell say false.
  virtual bool link_failed() const { return false; }
  // When link_failed(): the failure itself (its error names the cause: "connection reset by
  // peer", the RDMA work completion's status), for the reason a failover gives. nullopt otherwise.
  virtual std::optional<Error> link_failure() const { return std::nullopt; }
  // A link that goes silent (packets dropped, no reset) fails the channel within about `within`
  // instead of the transport's own bound (TCP: net::kUserTimeoutMs). RDMA channels watch their
  // acknowledgements already (rdma/ack_watch.h): no-op there. For failover (failover_channel.h).
  virtual void notice_silent_link_within(std::chrono::milliseconds /*within*/) {}

  virtual uint32_t index() const = 0;
  virtual size_t chunk_size() const = 0;
  virtual const char* transport() const = 0;
};

}  // namespace rdmig::transport
