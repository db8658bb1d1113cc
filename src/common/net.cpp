#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/dial_policy.h"

namespace rdmig::net {
namespace {

Result<addrinfo*> resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    return Error{Errc::kUnavailable, "resolving '" + host + "': " + gai_strerror(rc)};
  }
  return res;
}

Status wait_fd(int fd, short events, std::chrono::milliseconds timeout) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
    if (rc > 0) return ok_status();
    if (rc == 0) return Error{Errc::kTimeout, "timed out after " + std::to_string(timeout.count()) + " ms"};
    if (errno != EINTR) return errno_error("poll", errno);
  }
}

}  // namespace

Result<UniqueFd> tcp_listen(const std::string& host, uint16_t port, int backlog) {
  auto res = resolve(host, port, true);
  if (!res) return res.error();
  addrinfo* ai = res.value();
  UniqueFd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    ::freeaddrinfo(ai);
    return errno_error("socket", errno);
  }
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const int brc = ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen);
  const int err = errno;
  ::freeaddrinfo(ai);
  if (brc != 0) return errno_error("bind " + host + ":" + std::to_string(port), err);
  if (::listen(fd.get(), backlog) != 0) return errno_error("listen", errno);
  return fd;
}

Result<UniqueFd> tcp_connect(const Endpoint& ep, std::chrono::milliseconds timeout) {
  return tcp_connect(ep, timeout, nullptr);
}

Result<UniqueFd> tcp_connect(const Endpoint& ep, std::chrono::milliseconds timeout,
                             const std::function<Status(int fd)>& prepare) {
  auto res = resolve(ep.host, ep.port, false);
  if (!res) return res.error();
  addrinfo* ai = res.value();
  UniqueFd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    ::freeaddrinfo(ai);
    return errno_error("socket", errno);
  }
  if (prepare) {
    if (auto st = prepare(fd.get()); !st) {
      ::freeaddrinfo(ai);
      return st.error();
    }
  }
  int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
  const int err = errno;
  ::freeaddrinfo(ai);
  if (rc != 0 && err != EINPROGRESS) return errno_error("connect " + ep.to_string(), err);
  if (rc != 0) {
    if (auto w = wait_fd(fd.get(), POLLOUT, timeout); !w) {
      return w.error().with_context("connect " + ep.to_string());
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
      auto e = errno_error("connect " + ep.to_string(), soerr);
      e.code = Errc::kUnavailable;
      return e;
    }
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

int peer_pid(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return 0;
  return cred.pid;
}

Result<uint16_t> local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
    return errno_error("getsockname", errno);
  }
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return Error{Errc::kInternal, "not an IP socket"};
}

void tune_tcp_for_bulk(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  detect_dead_peer(fd);
}

void bound_local_hop(int fd, size_t window) {
  // SO_RCVBUF, not TCP_WINDOW_CLAMP: receive autotuning rewrites the clamp as it grows the
  // buffer, while a set SO_RCVBUF stops autotuning. The kernel doubles the value (half of it
  // for its own overhead); SO_RCVBUFFORCE passes net.core.rmem_max (208 KiB on a stock kernel,
  // which would split every chunk) with CAP_NET_ADMIN (KubeVirt mode); refused, SO_RCVBUF caps at it.
  // At most 4 MiB, what autotuning gives a stock kernel's socket anyway (tcp_wmem's maximum): a
  // peer's hello may name chunks of up to 1 GiB, and this is kernel memory outside the budget.
  const int w = static_cast<int>(std::clamp<size_t>(window, 64 * 1024, 4 * 1024 * 1024));
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &w, sizeof w) != 0) {
    (void)::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &w, sizeof w);
  }
  ::setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &w, sizeof w);
}

void detect_dead_peer(int fd) {
  int one = 1, idle = kKeepaliveIdleSeconds, interval = kKeepaliveIntervalSeconds, probes = kKeepaliveProbes;
  unsigned int user_timeout = kUserTimeoutMs;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout);
}

void detect_dead_peer_within(int fd, std::chrono::milliseconds within) {
  // Keepalive: idle 40%, then 3 probes 20% apart (an idle direction); unacknowledged data: the
  // whole span (a direction that sends).
  const int total_s = std::max(2, static_cast<int>(within.count() / 1000));
  int one = 1, idle = std::max(1, total_s * 2 / 5), interval = std::max(1, total_s / 5), probes = 3;
  unsigned int user_timeout = static_cast<unsigned int>(total_s) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout);
}

Result<UniqueFd> unix_listen(const std::string& path, int backlog) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) {
    return Error{Errc::kInvalidArgument, "unix socket path too long: " + path};
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return errno_error("socket", errno);
  ::unlink(path.c_str());
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return errno_error("bind " + path, errno);
  }
  if (::listen(fd.get(), backlog) != 0) return errno_error("listen " + path, errno);
  return fd;
}

Result<UniqueFd> unix_connect(const std::string& path, std::chrono::milliseconds timeout) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) {
    return Error{Errc::kInvalidArgument, "unix socket path too long: " + path};
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  // Blocking, bounded by SO_SNDTIMEO. A unix socket's connect never runs in the background: a
  // non-blocking one whose listener's backlog is full fails with EAGAIN and leaves the socket
  // unconnected (poll then says POLLOUT all the same, and SO_PEERCRED pid 0), while a blocking
  // one waits for the listener to make room, as long as SO_SNDTIMEO lets it. A target QEMU listens
  // with a backlog of its multifd channel count, and post-copy's preempt connection comes on top
  // of the main and the multifd ones: under load it found the backlog full.
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return errno_error("socket", errno);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto set_timeout = [&](std::chrono::microseconds t) {
    const timeval tv{static_cast<time_t>(t.count() / 1000000), static_cast<suseconds_t>(t.count() % 1000000)};
    return ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) == 0;
  };
  for (;;) {
    // At least 1 ms: a zero SO_SNDTIMEO waits for ever.
    const auto left = std::max(std::chrono::duration_cast<std::chrono::microseconds>(
                                   deadline - std::chrono::steady_clock::now()),
                               std::chrono::microseconds(1000));
    if (!set_timeout(left)) return errno_error("setsockopt SO_SNDTIMEO", errno);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    if (errno == EINTR && std::chrono::steady_clock::now() < deadline) continue;
    if (errno == EAGAIN) {
      return Error{Errc::kUnavailable, "connect " + path + ": its listener's backlog stayed full for " +
                                           std::to_string(timeout.count()) + " ms"};
    }
    auto e = errno_error("connect " + path, errno);
    e.code = Errc::kUnavailable;
    return e;
  }
  if (!set_timeout(std::chrono::microseconds(0))) return errno_error("setsockopt SO_SNDTIMEO", errno);  // sends block as before
  return fd;
}

Result<UniqueFd> accept_for(int listen_fd, std::chrono::milliseconds timeout) {
  if (auto w = wait_fd(listen_fd, POLLIN, timeout); !w) return w.error();
  UniqueFd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd.valid()) return errno_error("accept", errno);
  return fd;
}

Result<bool> read_exact(int fd, std::span<std::byte> buf, bool eof_ok) {
  size_t ahead_len = 0;
  return read_exact_ahead(fd, buf, {}, ahead_len, eof_ok);
}

Result<bool> read_exact_ahead(int fd, std::span<std::byte> buf, std::span<std::byte> ahead, size_t& ahead_len,
                              bool eof_ok) {
  ahead_len = 0;
  size_t got = 0;
  while (got < buf.size()) {
    iovec iov[2] = {{buf.data() + got, buf.size() - got}, {ahead.data(), ahead.size()}};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = ahead.empty() ? 1 : 2;
    const ssize_t n = ::recvmsg(fd, &m, 0);
    if (n > 0) {
      const size_t want = buf.size() - got;
      if (static_cast<size_t>(n) > want) ahead_len = static_cast<size_t>(n) - want;
      got += std::min(static_cast<size_t>(n), want);
      continue;
    }
    if (n == 0) {
      if (got == 0 && eof_ok) return false;
      return Error{Errc::kUnavailable, "peer closed the connection"};
    }
    if (errno == EINTR) continue;
    auto e = errno_error("recv", errno);
    if (errno == ECONNRESET || errno == EPIPE) e.code = Errc::kUnavailable;
    return e;
  }
  return true;
}

void wait_ready(int fd, short events) {
  pollfd p{fd, events, 0};
  while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
  }
}

ssize_t recv_ready(int fd, void* buf, size_t len, int flags) {
  for (;;) {
    const ssize_t n = ::recv(fd, buf, len, flags);
    if (n >= 0) return n;
    if (errno == EAGAIN) {
      wait_ready(fd, POLLIN);
    } else if (errno != EINTR) {
      return n;
    }
  }
}

int send_all_ready(int fd, const std::byte* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        wait_ready(fd, POLLOUT);
        continue;
      }
      return errno;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return 0;
}

Status write_all(int fd, std::span<const std::byte> buf) {
  iovec iov{const_cast<std::byte*>(buf.data()), buf.size()};
  return writev_all(fd, &iov, 1);
}

Status writev_all(int fd, iovec* iov, int iovcnt) {
  msghdr msg{};
  while (iovcnt > 0) {
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      auto e = errno_error("send", errno);
      if (errno == ECONNRESET || errno == EPIPE) e.code = Errc::kUnavailable;
      return e;
    }
    auto left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return ok_status();
}

Result<Endpoint> parse_endpoint(const std::string& text, const std::string& field) {
  std::string host;
  std::string port_text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return Error{Errc::kInvalidArgument, field + ": expected [ipv6]:port, got '" + text + "'"};
    }
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      return Error{Errc::kInvalidArgument, field + ": expected host:port, got '" + text + "'"};
    }
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  if (port_text.empty() || port_text.size() > 5 ||
      port_text.find_first_not_of("0123456789") != std::string::npos) {
    return Error{Errc::kInvalidArgument, field + ": bad port in '" + text + "'"};
  }
  const long port = std::stol(port_text);
  if (port < 1 || port > 65535) {
    return Error{Errc::kInvalidArgument, field + ": port out of range in '" + text + "'"};
  }
  return Endpoint{host, static_cast<uint16_t>(port)};
}

std::string peer_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, text, sizeof text);
  } else if (ss.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, text, sizeof text);
  }
  return text;
}

Status check_unicast_literal(const std::string& host, const std::string& field) {
  return DialPolicy::pod_addresses().check(host, field);
}

}  // namespace rdmig::net
