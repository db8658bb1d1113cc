// The agent's probe port (api.probePort): /healthz and /readyz for the kubelet, answered by one
// thread from state, never behind the REST server's workers or a lock a migration holds.
//
// Why a port of its own: REST clients (the controller, operators, scrapers, anyone who can reach
// the node) share the REST server's worker threads; a dozen clients that send a request slowly
// could hold them all, and a kubelet whose probes time out restarts the agent mid-migration.
// Here every connection has a whole-request deadline (kRequestDeadline from accept to answer),
// the request is at most kMaxRequestBytes, at most kMaxClients are open at once and nothing
// blocks: one poll loop serves them all. A new connection is read at once (a probe's request
// is answered on the spot); when the table is full, an address that holds kMaxClientsPerSource
// already loses its own oldest connection, otherwise the oldest unfinished request goes, so a
// flood of silent connections never pushes out the kubelet's probes.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/result.h"

namespace rdmig::api {

class ProbeServer {
 public:
  static constexpr auto kRequestDeadline = std::chrono::seconds(2);
  static constexpr size_t kMaxRequestBytes = 4096;
  static constexpr size_t kMaxClients = 64;
  static constexpr size_t kMaxClientsPerSource = 16;

  // `ready`: the /readyz answer; `live`: the /healthz answer (none: always live). Neither may
  // block (read an atomic).
  explicit ProbeServer(std::function<bool()> ready, std::function<bool()> live = nullptr);
  ~ProbeServer();
  ProbeServer(const ProbeServer&) = delete;
  ProbeServer& operator=(const ProbeServer&) = delete;

  // Binds address:port (0 = any free port) and starts the serving thread.
  Status start(const std::string& address, uint16_t port);
  uint16_t port() const { return port_; }
  void stop();

 private:
  void run();

  std::function<bool()> ready_;
  std::function<bool()> live_;
  UniqueFd listener_;
  UniqueFd wake_;  // eventfd: stop() wakes the poll loop
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// The probe answer for one request head ("GET /healthz HTTP/1.1\r\n..."): a whole HTTP/1.1
// response with a JSON body and Connection: close. Exposed for the unit tests.
std::string probe_response(std::string_view request_head, bool ready, bool live = true);

}  // namespace rdmig::api
