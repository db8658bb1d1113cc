// The floor relay's one hop, shared by rdmig-relay-cpu (--relay floor*) and rdmig-floor-relay:
// the simplest code that moves a stream from one socket to another, the benchmarks' floor.
#pragma once

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <span>

#include "common/chunk_memory.h"
#include "common/net.h"
#include "common/thread_name.h"

namespace rdmig {

// The floor: copies `from` to `to` until end of stream, then ends `to`'s write side. `buf`
// bytes per read; with `pipe_splice` the bytes go through a pipe with splice(2) instead.
inline void floor_copy(const char* name, int from, int to, size_t buf, bool pipe_splice) {
  name_this_thread(name);
  if (pipe_splice) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) == 0) {
      ::fcntl(p[1], F_SETPIPE_SZ, static_cast<int>(std::min<size_t>(buf, 1u << 20)));
      for (;;) {
        const ssize_t n = ::splice(from, nullptr, p[1], nullptr, buf, SPLICE_F_MOVE);
        if (n <= 0) break;
        ssize_t left = n;
        while (left > 0) {
          const ssize_t m = ::splice(p[0], nullptr, to, nullptr, static_cast<size_t>(left), SPLICE_F_MOVE);
          if (m <= 0) {
            left = -1;
            break;
          }
          left -= m;
        }
        if (left < 0) break;
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
