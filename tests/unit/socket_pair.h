// A connected pair of Unix stream sockets for the unit tests that stand a socket in for a peer,
// QEMU or a data channel (control links, flows, heartbeats, protocol readers, splice pumps).
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <utility>

#include "common/fd.h"

namespace rdmig_test {

inline std::pair<rdmig::UniqueFd, rdmig::UniqueFd> socket_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  return {rdmig::UniqueFd(fds[0]), rdmig::UniqueFd(fds[1])};
}

}  // namespace rdmig_test
