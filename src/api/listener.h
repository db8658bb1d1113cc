// The listening socket both of the agent's HTTP fronts serve from (the REST port's HttpFront and
// the probe port's ProbeServer): bound, non-blocking, with an eventfd that wakes their poll loop.
#pragma once

#include <cstdint>
#include <string>

#include "common/fd.h"
#include "common/result.h"

namespace rdmig::api {

struct Listener {
  UniqueFd fd;    // non-blocking
  UniqueFd wake;  // eventfd, non-blocking: stop() writes it
  uint16_t port = 0;
};

// Binds address:port (0 = any free port) with `backlog`.
Result<Listener> open_listener(const std::string& address, uint16_t port, int backlog);

}  // namespace rdmig::api
