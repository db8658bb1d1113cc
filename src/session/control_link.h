// The control connection between the two agents of one migration, after the hello:
// JSON messages (start, ready, result, abort) in both directions. A reader thread queues
// what arrives; the job's worker thread takes it with next(). Closed by the destructor.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "common/fd.h"
#include "common/mutex.h"
#include "common/result.h"

namespace rdmig::session {

class ControlLink {
 public:
  explicit ControlLink(UniqueFd fd);
  ~ControlLink();
  ControlLink(const ControlLink&) = delete;
  ControlLink& operator=(const ControlLink&) = delete;

  Status send(const nlohmann::json& message) EXCLUDES(write_mu_);
  // Next message, waiting up to `timeout`: nullopt on timeout, an error once the peer is gone.
  Result<std::optional<nlohmann::json>> next(std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // Waits for a message of `type` (other messages: an "abort" fails, the rest are skipped).
  Result<nlohmann::json> expect(const std::string& type, std::chrono::milliseconds timeout);
  // Puts a message taken with next() back in front, for a later next() or expect().
  void unread(nlohmann::json message) EXCLUDES(mu_);
  void close();
  int fd() const { return fd_.get(); }

 private:
  void reader_loop();

  UniqueFd fd_;
  // fd_ needs no lock (set at construction; close() only shuts it down).
  // write_mu_ guards no member: serialises send() so two threads' messages (the worker's,
  // and an abort sent from a REST or cancel thread) never interleave on fd_. Held across
  // the socket write.
  // Callers may hold their own lock around send() (PathCheck::mu_, the jobs' locks); never
  // taken together with mu_.
  Mutex write_mu_;
  // Guards queue_ and closed_; cv_ signals either changing. Taken by reader_ (queueing each
  // message, or the close) and by next()/unread() (the owner's worker thread). Never held
  // across a socket read.
  Mutex mu_;
  std::condition_variable cv_;
  std::deque<nlohmann::json> queue_ GUARDED_BY(mu_);
  std::optional<Error> closed_ GUARDED_BY(mu_);
  std::thread reader_;
};

}  // namespace rdmig::session
