// The agent's HTTP endpoint (cpp-httplib): REST API v1 under /v1 (bearer token), probes
// (/healthz, /readyz) and Prometheus metrics (/metrics), all on one port. One HTTP stack per
// port keeps one thread model and lets probes and scrapes share the REST port that the
// DaemonSet already exposes; /metrics and the probes need no token.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "api/http_front.h"
#include "common/result.h"
#include "common/token_source.h"
#include "config/agent_config.h"
#include "metrics/metrics.h"
#include "kubevirt/flow/relay.h"
#include "migration/manager.h"
#include "pathcheck/manager.h"
#include "tls/server_certificate.h"

namespace httplib {
class Server;
}

namespace rdmig::api {

class RestServer {
 public:
  // `kubevirt` is null when KubeVirt mode is off. With `cert` the port serves HTTPS only (a
  // plain-HTTP client gets no answer); null: plain HTTP.
  RestServer(const AgentConfig& config, std::shared_ptr<TokenSource> token, migration::MigrationManager& manager,
             pathcheck::PathCheckManager& pathchecks, kubevirt::KubevirtRelay* kubevirt, Metrics& metrics,
             std::shared_ptr<tls::ServerCertificate> cert = nullptr);
  ~RestServer();
  RestServer(const RestServer&) = delete;
  RestServer& operator=(const RestServer&) = delete;

  // Binds address:port (port 0 = any free port).
  Status bind();
  uint16_t port() const { return port_; }
  // Serves until stop(); call from the thread that owns the server.
  void serve();
  void stop();
  void set_ready(std::function<bool()> ready) { ready_ = std::move(ready); }

 private:
  void routes();

  const AgentConfig& config_;
  std::shared_ptr<TokenSource> token_;  // follows api.tokenFile
  migration::MigrationManager& manager_;
  pathcheck::PathCheckManager& pathchecks_;
  kubevirt::KubevirtRelay* kubevirt_;
  Metrics& metrics_;
  std::function<bool()> ready_;
  struct TlsContextFree {
    void operator()(SSL_CTX* ctx) const;
  };
  std::shared_ptr<tls::ServerCertificate> cert_;  // before tls_: the context points at it
  std::unique_ptr<SSL_CTX, TlsContextFree> tls_;  // null: plain HTTP
  std::unique_ptr<httplib::Server> server_;       // routes and handlers
  std::unique_ptr<HttpFront> front_;              // accepts, TLS, deadlines, workers
  uint16_t port_ = 0;
  // Guards client_requests_ alone: the pre- and post-routing handlers on HttpFront's worker
  // threads count a request in and out under it. Held only for the map update; no other lock
  // is taken under it.
  std::mutex clients_mu_;
  // Under clients_mu_: requests of one client address served at once (at most
  // kMaxRequestsPerClient).
  std::map<std::string, int> client_requests_;
  // POST /v1/dirtyrate measurements in progress (each holds an API worker for its calcSeconds).
  std::atomic<int> dirty_rate_running_{0};
};

// POST /v1/dirtyrate measurements at once; more get 429.
inline constexpr int kMaxDirtyRateMeasurements = 2;

// One client address may have this many requests in handling at once (headers read, answer not
// yet written); more get 429 at once, so one client cannot hold the API's workers.
inline constexpr int kMaxRequestsPerClient = 16;

}  // namespace rdmig::api
