// The agent's parts and their wiring (main.cpp keeps the command line only).
//
// prepare() reads and checks what the agent needs before anything starts: the config, the token
// file, the API certificate, stateDir (each error names its key; exit status 2). Agent builds the
// parts in dependency order (metrics, the data plane, the migration manager, path checks, the
// KubeVirt relay and its node hook, the REST server, the probes), start() makes them listen, and
// run() serves until a signal: draining (docs/deploy.md "Upgrades": not ready at once, no new
// work, the running work goes on for up to shutdownGraceSeconds; then, or on a second signal, the
// rest is cancelled, the VM staying on the source) and stopping in reverse order.
//
// Threads: run() serves HTTP on the calling thread; a signal thread waits for SIGTERM/SIGINT
// (blocked for every thread by block_signals(), called before any thread starts), drains and stops
// the server; the migration manager owns the data-plane listener and one worker per migration.
#pragma once

#include <signal.h>

#include <atomic>
#include <memory>
#include <string>

#include "api/probe_server.h"
#include "api/rest_server.h"
#include "common/result.h"
#include "common/token_source.h"
#include "config/agent_config.h"
#include "kubevirt/hook/hook_server.h"
#include "kubevirt/flow/relay.h"
#include "metrics/metrics.h"
#include "migration/manager.h"
#include "pathcheck/manager.h"
#include "session/data_plane_server.h"
#include "tls/server_certificate.h"

namespace rdmig::agent {

// Everything checked before the agent starts.
struct Prepared {
  AgentConfig config;
  std::shared_ptr<TokenSource> token;
  std::shared_ptr<tls::ServerCertificate> api_cert;  // null: plain HTTP
  std::string api_scheme;                            // how the API is served, for logs
};

// Loads and checks the config at `path` and what it names. `check_only`: stateDir is left alone
// (--check-config validates, it changes nothing).
Result<Prepared> prepare(const std::string& path, bool check_only);

// SIGTERM and SIGINT go to the signal thread only: block them before any thread starts. Also
// ignores SIGPIPE and raises the locked-memory limit for RDMA registrations.
sigset_t block_signals();

class Agent {
 public:
  explicit Agent(Prepared prepared);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Makes every part listen and writes `ports_file` (when not empty). 0, or the exit status after
  // printing why to stderr: 2 where the config is at fault (the message names the key), 1 otherwise.
  int start(const std::string& ports_file);
  // Serves until `signals` (from block_signals()) drained and stopped the agent.
  void run(const sigset_t& signals);

 private:
  void drain_and_stop(sigset_t signals);
  size_t running() const;

  const Prepared prepared_;
  const AgentConfig& config_;
  Metrics metrics_;
  session::DataPlaneServer data_plane_;
  migration::MigrationManager manager_;
  pathcheck::PathCheckManager pathchecks_;
  std::unique_ptr<kubevirt::KubevirtRelay> kubevirt_;  // KubeVirt mode only
  std::unique_ptr<kubevirt::HookServer> hook_;
  std::unique_ptr<api::RestServer> server_;
  std::unique_ptr<api::ProbeServer> probes_;
  std::atomic<bool> shutting_down_{false};
};

}  // namespace rdmig::agent
