// net::unix_connect against a real listener whose backlog is full, as a target QEMU's is when the
// agent opens post-copy's preempt connection on top of the main and the multifd ones before QEMU
// accepted any: QEMU listens with a backlog of its multifd channel count (8), and Linux queues at
// most backlog + 1 connections not yet accepted. A non-blocking connect then fails with EAGAIN and
// leaves the socket unconnected (its SO_PEERCRED pid 0): the connect must wait for room instead.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common/net.h"

using namespace rdmig;
using namespace std::chrono_literals;

namespace {

// A listener like a target QEMU's with 8 multifd channels, and the 9 connections its backlog
// holds before any is accepted (the main one and the 8 multifd ones).
struct FullListener {
  std::string dir, path;
  UniqueFd listener;
  std::vector<UniqueFd> queued;
  FullListener() {
    char tmpl[] = "/tmp/rdmig-unix-connect-XXXXXX";
    dir = ::mkdtemp(tmpl);
    path = dir + "/incoming.sock";
    auto l = net::unix_listen(path, 8);
    EXPECT_TRUE(l.ok());
    listener = std::move(l.value());
    for (int i = 0; i < 9; ++i) {
      auto c = net::unix_connect(path, 1s);
      EXPECT_TRUE(c.ok()) << "connection " << i + 1 << ": " << c.error().message;
      if (c.ok()) queued.push_back(std::move(c.value()));
    }
  }
  ~FullListener() {
    ::unlink(path.c_str());
    ::rmdir(dir.c_str());
  }
};

}  // namespace

TEST(UnixConnect, AConnectionBeyondAFullBacklogWaitsForRoomAndReachesTheListener) {
  FullListener full;
  ASSERT_EQ(full.queued.size(), 9u);
  Result<UniqueFd> tenth = Error{Errc::kInternal, "not run"};
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration took{};
  std::thread dialler([&] {
    tenth = net::unix_connect(full.path, 5s);
    took = std::chrono::steady_clock::now() - t0;
  });
  std::this_thread::sleep_for(300ms);  // the dialler waits on the full backlog meanwhile
  auto first = net::accept_for(full.listener.get(), 1s);  // the listener takes one: room for one more
  ASSERT_TRUE(first.ok()) << first.error().message;
  dialler.join();
  ASSERT_TRUE(tenth.ok()) << tenth.error().message;
  EXPECT_GE(took, 250ms) << "returned before the listener made room: not a connection at all";
  // Connected to the listener: the kernel names its process (this one), where an unconnected
  // socket gives pid 0.
  EXPECT_EQ(net::peer_pid(tenth->get()), ::getpid());
  // And it is the connection the listener takes next but nine: bytes written on it arrive there.
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(net::accept_for(full.listener.get(), 1s).ok());
  auto tenth_there = net::accept_for(full.listener.get(), 1s);
  ASSERT_TRUE(tenth_there.ok()) << tenth_there.error().message;
  ASSERT_EQ(::write(tenth->get(), "x", 1), 1);
  char got = 0;
  ASSERT_EQ(::read(tenth_there->get(), &got, 1), 1);
  EXPECT_EQ(got, 'x');
  // The bound was for the connect only: its sends block as any socket's (no SO_SNDTIMEO left).
  timeval tv{1, 1};
  socklen_t len = sizeof tv;
  ASSERT_EQ(::getsockopt(tenth->get(), SOL_SOCKET, SO_SNDTIMEO, &tv, &len), 0);
  EXPECT_EQ(tv.tv_sec, 0);
  EXPECT_EQ(tv.tv_usec, 0);
}

TEST(UnixConnect, ABacklogThatStaysFullFailsAtTheTimeoutNamingIt) {
  FullListener full;
  ASSERT_EQ(full.queued.size(), 9u);
  const auto t0 = std::chrono::steady_clock::now();
  auto tenth = net::unix_connect(full.path, 300ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(tenth.ok()) << "an unconnected socket was returned as a connection";
  EXPECT_EQ(tenth.error().code, Errc::kUnavailable);
  EXPECT_NE(tenth.error().message.find("backlog stayed full for 300 ms"), std::string::npos) << tenth.error().message;
  EXPECT_NE(tenth.error().message.find(full.path), std::string::npos) << tenth.error().message;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 3s);
}

TEST(UnixConnect, NoListenerIsRefusedAtOnce) {
  char tmpl[] = "/tmp/rdmig-unix-connect-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const auto t0 = std::chrono::steady_clock::now();
  auto c = net::unix_connect(dir + "/none.sock", 5s);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, Errc::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  ::rmdir(dir.c_str());
}
