#include "api/listener.h"

#include <fcntl.h>
#include <sys/eventfd.h>

#include <cerrno>

#include "common/net.h"

namespace rdmig::api {

Result<Listener> open_listener(const std::string& address, uint16_t port, int backlog) {
  auto l = net::tcp_listen(address, port, backlog);
  if (!l) return l.error();
  auto p = net::local_port(l->get());
  if (!p) return p.error();
  ::fcntl(l->get(), F_SETFL, ::fcntl(l->get(), F_GETFL) | O_NONBLOCK);
  Listener out;
  out.wake = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!out.wake.valid()) return errno_error("eventfd", errno);
  out.fd = std::move(l.value());
  out.port = p.value();
  return out;
}

}  // namespace rdmig::api
