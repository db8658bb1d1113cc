// A QMP client over a unix socket: capabilities handshake, commands with timeouts, and the
// events QEMU sends (kept with QEMU's timestamps so downtime can be measured from them).
// One reader thread per client, stopped by close() or the destructor (shutdown wakes it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/result.h"
#include "qemu/qmp_protocol.h"

namespace rdmig::qemu {

struct QmpEvent {
  std::string name;
  nlohmann::json data;
  int64_t timestamp_us = 0;  // QEMU's wall clock
  uint64_t seq = 0;          // arrival order in this client
};

class QmpClient {
 public:
  static Result<std::unique_ptr<QmpClient>> connect(const std::string& socket_path,
                                                    std::chrono::milliseconds timeout);
  ~QmpClient();
  QmpClient(const QmpClient&) = delete;
  QmpClient& operator=(const QmpClient&) = delete;

  // Runs a command; kQemu with QEMU's class and description on an error reply, kTimeout
  // when no reply came, kUnavailable when the connection is gone.
  Result<nlohmann::json> execute(const std::string& command, const nlohmann::json& args = {},
                                 std::chrono::milliseconds timeout = std::chrono::seconds(10));

  // The first event after sequence `after` that satisfies `pred`, waiting up to `timeout`.
  std::optional<QmpEvent> wait_event(const std::function<bool(const QmpEvent&)>& pred,
                                     uint64_t after, std::chrono::milliseconds timeout);
  // Events kept so far (the last kMaxEvents).
  std::vector<QmpEvent> events() const;
  uint64_t last_event_seq() const;
  bool connected() const;
  const std::string& socket_path() const { return path_; }
  // The QEMU process serving this monitor (SO_PEERCRED at connect; 0 when not visible).
  int peer_pid() const { return peer_pid_; }
  void close();

  static constexpr size_t kMaxEvents = 1024;

 private:
  QmpClient(UniqueFd fd, std::string path);
  void reader_loop();
  Result<std::string> read_line_blocking(std::chrono::milliseconds timeout);

  UniqueFd fd_;
  std::string path_;
  int peer_pid_ = 0;
  // rx_buffer_ needs no lock: the reader's own (connect() uses it before the reader starts).
  std::string rx_buffer_;

  // Guards next_id_, pending_, events_, event_seq_, closed_ and close_reason_; cv_ signals a
  // reply, an event or the close. Taken by reader_ (each message), by callers of execute,
  // wait_event, events, last_event_seq, connected and close (job and REST threads). Never held
  // across a socket read or write. Lock order: write_mu_ -> mu_ (a failed write drops its
  // pending_ entry under both).
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::optional<QmpMessage>> pending_;
  std::deque<QmpEvent> events_;
  uint64_t event_seq_ = 0;
  bool closed_ = false;
  std::string close_reason_;
  // Guards no member: serialises writes to fd_ so two execute() calls' command lines never
  // interleave. Taken before mu_, never under it.
  std::mutex write_mu_;
  std::thread reader_;
};

}  // namespace rdmig::qemu
