// Socket helpers: TCP and unix listeners/connectors and exact reads/writes. Blocking calls
// are cancelled by shutdown(2) on the socket from another thread (wakes read/accept with
// EOF or an error); connects and accepts also take a timeout.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "common/fd.h"
#include "common/result.h"

namespace rdmig::net {

// host:port, with an IPv6 address in brackets ([fd00::1]:7471) so that what a peer, the
// controller or an operator reads back is never ambiguous; parse_endpoint() reads both forms.
inline std::string format_endpoint(const std::string& host, uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string to_string() const { return format_endpoint(host, port); }
};

Result<UniqueFd> tcp_listen(const std::string& host, uint16_t port, int backlog = 64);
Result<UniqueFd> tcp_connect(const Endpoint& ep, std::chrono::milliseconds timeout);
// The same, calling `prepare` on the socket before connect (marks, bind to a device...).
Result<UniqueFd> tcp_connect(const Endpoint& ep, std::chrono::milliseconds timeout,
                             const std::function<Status(int fd)>& prepare);
Result<uint16_t> local_port(int fd);
// Sets TCP_NODELAY and large socket buffers for bulk data.
void tune_tcp_for_bulk(int fd);
// A hop inside one node that the agent relays (a KubeVirt proxy's connection): at most about
// `window` bytes wait in its socket buffers each way (SO_RCVBUF on what is received,
// TCP_NOTSENT_LOWAT on what is sent). Autotuning would grow them to tcp_rmem/tcp_wmem's maximum
// (MiBs) behind a slow reader; bytes parked there are bytes QEMU counts as sent that the target
// has not got, and they drain inside the migration's downtime. The hop's round trip is
// microseconds, so a chunk's worth keeps it busy. `window` is clamped to 64 KiB..4 MiB.
void bound_local_hop(int fd, size_t window);

// A peer that vanished without a FIN or RST (node lost, cable pulled) is noticed in about
// kPeerDeadAfter instead of never: keepalive probes on an idle connection, TCP_USER_TIMEOUT on
// data that stays unacknowledged. Applied to every connection between agents (data channels
// via tune_tcp_for_bulk, control links). No effect on non-TCP sockets.
inline constexpr int kKeepaliveIdleSeconds = 10, kKeepaliveIntervalSeconds = 5, kKeepaliveProbes = 3;
inline constexpr int kUserTimeoutMs = 30000;
void detect_dead_peer(int fd);
// The same within about `within` (at least 2 s): a data channel that fails over
// (dataPlane.failover) wants a silent link noticed in seconds, not in kPeerDeadAfter.
void detect_dead_peer_within(int fd, std::chrono::milliseconds within);

Result<UniqueFd> unix_listen(const std::string& path, int backlog = 16);
// The pid of the process at the other end of a unix socket (SO_PEERCRED), as this process's pid
// namespace sees it: 0 when the peer is outside it (the agent runs with hostPID for that).
int peer_pid(int fd);
Result<UniqueFd> unix_connect(const std::string& path, std::chrono::milliseconds timeout);

// Waits up to `timeout` for a connection. kTimeout when none came.
Result<UniqueFd> accept_for(int listen_fd, std::chrono::milliseconds timeout);

// Reads exactly buf.size() bytes. kUnavailable "peer closed" on EOF before any byte when
// `eof_ok` is false; returns false (clean EOF at a message boundary) when `eof_ok`.
Result<bool> read_exact(int fd, std::span<std::byte> buf, bool eof_ok = false);
// read_exact() that lets each recv also take up to `ahead.size()` bytes past `buf` into `ahead`
// (one recvmsg for the rest of a frame and what follows it); `ahead_len` is set to how many it
// took (0 when `ahead` is empty).
Result<bool> read_exact_ahead(int fd, std::span<std::byte> buf, std::span<std::byte> ahead, size_t& ahead_len,
                              bool eof_ok = false);
Status write_all(int fd, std::span<const std::byte> buf);
Status writev_all(int fd, iovec* iov, int iovcnt);

// For a local socket that may have been made non-blocking (QEMU's socket once a splicing channel
// takes it as its inline sink, transport::Channel::set_inline_sink): calls that wait for readiness
// where a blocking socket's call would have waited. No timeout: shutting the socket down (an
// abort) wakes them as it woke a blocking call.
void wait_ready(int fd, short events);
// One recv of what the socket has (at least one byte, or its end: 0), or -1 with errno.
ssize_t recv_ready(int fd, void* buf, size_t len, int flags);
// All of [p, p + n) into the socket (MSG_NOSIGNAL): 0, or the errno of the send that failed.
int send_all_ready(int fd, const std::byte* p, size_t n);

// The peer's address of a connected socket, without its port ("" when unknown): what
// per-source limits count by.
std::string peer_address(int fd);

// Whether a pod address (a KubeVirt flow's destination) may be dialled on someone else's behalf:
// net::DialPolicy::pod_addresses() (common/dial_policy.h: the one rule for such dials, never
// loopback). Names the field.
Status check_unicast_literal(const std::string& host, const std::string& field);

// Parses "host:port" (IPv4 literal or name; [v6]:port). Names the field in errors.
Result<Endpoint> parse_endpoint(const std::string& text, const std::string& field);

}  // namespace rdmig::net
