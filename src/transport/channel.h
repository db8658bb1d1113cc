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

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "common/result.h"

namespace rdmig::transport {

struct ChunkView {
  std::span<const std::byte> data;  // valid until release()
  bool eof = false;                 // the peer finished sending on this channel
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

  // Fails all pending and later calls with `reason` and tells the peer when it can.
  // Idempotent and thread-safe.
  virtual void abort(const Error& reason) = 0;

  virtual uint32_t index() const = 0;
  virtual size_t chunk_size() const = 0;
  virtual const char* transport() const = 0;
};

}  // namespace rdmig::transport
