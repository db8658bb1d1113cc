// The floor relay's one hop, shared by rdmig-relay-cpu (--relay floor*) and rdmig-floor-relay:
// the simplest code that moves a stream from one socket to another, the benchmarks' floor.
#pragma once

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <span>

#include "common/chunk_memory.h"
#include "common/net.h"
#include "common/thread_name.h"

namespace rdmig {

// Moves `n` bytes from pipe `r` to `to` (splice); false on an error or the end.
inline bool floor_drain_pipe(int r, int to, size_t n) {
  while (n > 0) {
    const ssize_t m = ::splice(r, nullptr, to, nullptr, n, SPLICE_F_MOVE);
    if (m <= 0) return false;
    n -= static_cast<size_t>(m);
  }
  return true;
}

// The framed floor's two ends (floor_copy with `framing`): the splice floor with rdmig's framing
// and nothing else of rdmig. The sending end writes an 8-byte header (the payload's length,
// MSG_MORE) before each payload, what one splice took (up to `buf` and the pipe), as rdmig's
// TcpChannel::send_from does; the receiving end reads the header apart (recv) and splices exactly
// that many bytes on through its pipe. No credits, no window, no threads beyond the floor's.
enum class FloorFraming { kNone, kSend, kReceive };

// The floor: copies `from` to `to` until end of stream, then ends `to`'s write side. `buf`
// bytes per read; with `pipe_splice` the bytes go through a pipe with splice(2) instead, and with
// `framing` (splice only) framed as above.
inline void floor_copy(const char* name, int from, int to, size_t buf, bool pipe_splice,
                       FloorFraming framing = FloorFraming::kNone) {
  name_this_thread(name);
  if (pipe_splice) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) == 0) {
      ::fcntl(p[1], F_SETPIPE_SZ, static_cast<int>(std::min<size_t>(buf, 1u << 20)));
      // Each splice into the pipe takes at most what the pipe holds; the pipe is empty at each.
      for (;;) {
        if (framing == FloorFraming::kReceive) {
          uint64_t len = 0;
          if (::recv(from, &len, sizeof len, MSG_WAITALL) != static_cast<ssize_t>(sizeof len)) break;
          bool ok = true;
          while (ok && len > 0) {
            const ssize_t n = ::splice(from, nullptr, p[1], nullptr, static_cast<size_t>(std::min<uint64_t>(len, buf)), SPLICE_F_MOVE);
            ok = n > 0 && floor_drain_pipe(p[0], to, static_cast<size_t>(n));
            if (ok) len -= static_cast<uint64_t>(n);
          }
          if (!ok) break;
          continue;
        }
        const ssize_t n = ::splice(from, nullptr, p[1], nullptr, buf, SPLICE_F_MOVE);
        if (n <= 0) break;
        if (framing == FloorFraming::kSend) {
          const auto len = static_cast<uint64_t>(n);
          if (::send(to, &len, sizeof len, MSG_MORE | MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof len)) break;
        }
        if (!floor_drain_pipe(p[0], to, static_cast<size_t>(n))) break;
      }
      ::close(p[0]);
      ::close(p[1]);
    }
  } else {
    // The same memory as rdmig's chunk buffers (ChunkMemory: not zero-filled, on huge pages; a
    // buffer under 2 MiB on a 2 MiB page, as rdmig's receive ring is one mapping), so that the
    // ratio counts the relays' own work and not how their buffers were allocated. (A zero-filled 4 MiB vector per
    // thread once cost the floor 4 MiB of memset and page faults each.)
    ChunkMemory b = ChunkMemory::map(std::max(buf, ChunkMemory::kHugePage));
    for (;;) {
      const ssize_t n = b ? ::read(from, b.data(), buf) : -1;
      if (n <= 0) break;
      if (!net::write_all(to, std::span(b.data(), static_cast<size_t>(n))).ok()) break;
    }
  }
  ::shutdown(to, SHUT_WR);
}

}  // namespace rdmig
