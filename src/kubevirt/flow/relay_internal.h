// Helpers shared by the three parts of KubevirtRelay (relay.cpp, relay_source.cpp,
// relay_target.cpp).
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "common/net.h"

namespace rdmig::kubevirt::relay_internal {

using namespace std::chrono_literals;

inline constexpr auto kSessionOpenTimeout = 800ms;  // the hook must answer within a second
// After a carried migration failed and its legs were reset, QEMU sees the resets and libvirt
// fails the job by itself (0.1-0.4 s measured). Only a job still running after this grace is
// aborted: an abortJob that lands first turns libvirt's clean failure into a cancel racing its
// own error handling (seen: the source guest stopped advancing afterwards).
inline constexpr auto kAbortGrace = 5s;
// A hook call whose namespace is busy (another call making its point, a stale point's table
// being removed) waits this long for it; nftables wedged longer: KubeVirt's own path carries.
inline constexpr auto kNamespaceBusyWait = 10s;
inline constexpr auto kArmedTtl = 10min;            // armed but never dialled: KubeVirt gave up or retried
inline constexpr size_t kMaxTargetSessions = 64;

inline std::string key(const std::string& ip, uint16_t port) { return ip + "|" + std::to_string(port); }

// Copies one direction until EOF, then passes the EOF on.
inline void copy_stream(int from, int to) {
  std::vector<char> buf(256 * 1024);
  for (;;) {
    const ssize_t n = ::recv(from, buf.data(), buf.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (!net::write_all(to, std::as_bytes(std::span(buf.data(), static_cast<size_t>(n))))) break;
  }
  ::shutdown(to, SHUT_WR);
}

}  // namespace rdmig::kubevirt::relay_internal
