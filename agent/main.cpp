// rdmig-agent: per-node migration agent. Loads and validates its config, serves the REST API,
// /metrics and probes, and carries migrations between QEMU and peer agents.
//
// Threads: main serves HTTP; a signal thread waits for SIGTERM/SIGINT, drains (no new work,
// the running work ends on its own within shutdownGraceSeconds; a second signal or the end of
// that time cancels the rest, the VM staying on the source) and stops the server; the migration
// manager owns the data-plane listener and one worker per migration.
#include <malloc.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "api/probe_server.h"
#include "api/rest_server.h"
#include "tls/server_certificate.h"
#include "common/log.h"
#include "common/text.h"
#include "common/version.h"
#include "config/agent_config.h"
#include "metrics/metrics.h"
#include "kubevirt/hook_server.h"
#include "kubevirt/kubevirt_metrics.h"
#include "kubevirt/relay.h"
#include "migration/manager.h"
#include "pathcheck/manager.h"

namespace {

constexpr const char* kUsage =
    "usage: rdmig-agent [--config PATH] [--ports-file PATH]\n"
    "       rdmig-agent --check-config PATH\n"
    "       rdmig-agent --version\n"
    "  --config PATH        agent configuration (YAML); default /etc/rdmig/agent.yaml\n"
    "  --ports-file PATH    write {\"api\":port,\"dataPlane\":port,\"probe\":port} once listening (for port 0)\n"
    "  --check-config PATH  validate the configuration and the token file it names, then exit\n"
    "                       (0: valid; 2: the message names the key)\n"
    "  --version            print the version and git revision, then exit\n";


// Locked memory for RDMA registrations: raise the soft limit to the hard limit.
void raise_memlock() {
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return;
  if (rl.rlim_cur == rl.rlim_max) return;
  rlimit want{rl.rlim_max, rl.rlim_max};
  if (setrlimit(RLIMIT_MEMLOCK, &want) != 0) {
    LOG_WARN("agent") << "could not raise RLIMIT_MEMLOCK: " << std::strerror(errno);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Chunk rings (64 KiB and up per slot) are freed when a migration ends. A fixed mmap
  // threshold keeps every allocation of 64 KiB or more in its own mapping, returned to the
  // kernel on free; glibc's sliding threshold would move them into heaps that never shrink.
  ::mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  std::string config_path = "/etc/rdmig/agent.yaml";
  std::string ports_file;
  bool check_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--config" || a == "-c") && i + 1 < argc) {
      config_path = argv[++i];
    } else if (a == "--check-config" && i + 1 < argc) {
      config_path = argv[++i];
      check_only = true;
    } else if (a == "--version") {
      std::cout << rdmig::version_line("rdmig-agent") << "\n";
      return 0;
    } else if (a == "--ports-file" && i + 1 < argc) {
      ports_file = argv[++i];
    } else if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    } else {
      std::cerr << "rdmig-agent: unknown argument '" << a << "'\n" << kUsage;
      return 2;
    }
  }

  auto loaded = rdmig::load_agent_config_file(config_path);
  if (!loaded) {
    std::cerr << "rdmig-agent: " << loaded.error().message << "\n";
    return 2;
  }
  const rdmig::AgentConfig config = std::move(loaded.value());
  rdmig::log::set_level(*rdmig::log::parse_level(config.log_level));

  auto tokens = rdmig::TokenSource::open(config.api.token_file, "config key 'api.tokenFile'", 16,
                                         std::chrono::seconds(config.api.token_grace_seconds));
  if (!tokens) {
    std::cerr << "rdmig-agent: " << tokens.error().message << "\n";
    return 2;
  }
  const auto token = tokens.value();
  // HTTPS on the API port: the certificate and key are checked now (errors name the key), and
  // re-read when their files change (tls/server_certificate.h).
  std::shared_ptr<rdmig::tls::ServerCertificate> api_cert;
  std::string api_scheme = "plain HTTP (api.tls not set)";
  if (config.api.tls.enabled()) {
    auto cert = rdmig::tls::ServerCertificate::load(config.api.tls.cert_file, "api.tls.certFile",
                                                    config.api.tls.key_file, "api.tls.keyFile");
    if (!cert) {
      std::cerr << "rdmig-agent: " << cert.error().message << "\n";
      return 2;
    }
    api_cert = cert.value();
    const auto info = api_cert->info();
    api_scheme = "HTTPS with " + info.subject + " (" + (info.names.empty() ? "no DNS names" : info.names) +
                 "), valid until " + info.not_after + (info.expired ? " (EXPIRED)" : "");
  }
  if (check_only) {
    std::cout << "rdmig-agent: " << config_path << " is valid (token file '" << config.api.token_file
              << "' read, " << (config.kubevirt.enabled ? "KubeVirt mode on" : "KubeVirt mode off") << ", API over "
              << api_scheme << ")\n";
    return 0;
  }
  LOG_INFO("agent") << rdmig::version_line("rdmig-agent") << " starting, config " << config_path;
  if (config.data_plane.allow_loopback_peers) {
    LOG_WARN("agent") << "dataPlane.allowLoopbackPeers is true: a source may dial a loopback target.endpoint, "
                         "this host's own services (a lab setting, never for a node)";
  }
  if (::mkdir(config.state_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::cerr << "rdmig-agent: config key 'stateDir': cannot create '" << config.state_dir
              << "': " << std::strerror(errno) << "\n";
    return 2;
  }
  // The migration sockets live here: a real directory of ours, closed to everyone else.
  struct stat dir_st {};
  if (::lstat(config.state_dir.c_str(), &dir_st) != 0 || !S_ISDIR(dir_st.st_mode) || dir_st.st_uid != ::geteuid()) {
    std::cerr << "rdmig-agent: config key 'stateDir': '" << config.state_dir
              << "' must be a directory (not a symlink) owned by the agent's user\n";
    return 2;
  }
  if ((dir_st.st_mode & 0077) != 0 && ::chmod(config.state_dir.c_str(), 0700) != 0) {
    std::cerr << "rdmig-agent: config key 'stateDir': cannot make '" << config.state_dir
              << "' private (0700): " << std::strerror(errno) << "\n";
    return 2;
  }

  // Signals go to the signal thread only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  raise_memlock();

  rdmig::Metrics metrics("agent");
  rdmig::register_build_info(*metrics.registry());
  rdmig::session::DataPlaneServer data_plane(config, metrics);
  rdmig::migration::MigrationManager manager(config, metrics, data_plane);
  // Path checks (docs/pathcheck.md) share the data plane and migration.bufferBudget.
  rdmig::pathcheck::PathCheckManager pathchecks(config, metrics, data_plane);
  // KubeVirt mode: carries KubeVirt's own migration connections (docs/kubevirt.md).
  std::unique_ptr<rdmig::kubevirt::KubevirtRelay> kubevirt;
  std::unique_ptr<rdmig::kubevirt::HookServer> hook;
  if (config.kubevirt.enabled) {
    kubevirt = std::make_unique<rdmig::kubevirt::KubevirtRelay>(config, metrics, data_plane, token);
    // One migration.bufferBudget for both kinds of migration on this agent.
    kubevirt->count_also([&manager, &pathchecks] { return manager.buffer_bytes_in_use() + pathchecks.buffer_bytes_in_use(); });
    manager.count_also([k = kubevirt.get(), &pathchecks] { return k->flow_buffer_bytes() + pathchecks.buffer_bytes_in_use(); });
  } else {
    manager.count_also([&pathchecks] { return pathchecks.buffer_bytes_in_use(); });
  }
  // A carried KubeVirt flow holds buffers exactly while it runs: it counts as a running migration.
  pathchecks.set_neighbours(
      [&manager, k = kubevirt.get()] { return manager.active_count() + (k && k->flow_buffer_bytes() > 0 ? 1 : 0); },
      [&manager, k = kubevirt.get()] { return manager.buffer_bytes_in_use() + (k ? k->flow_buffer_bytes() : 0); });
  if (auto st = data_plane.start(); !st) {
    std::cerr << "rdmig-agent: " << st.error().message << "\n";
    return st.error().code == rdmig::Errc::kFailedPrecondition ? 2 : 1;
  }
  if (kubevirt) {
    if (auto st = kubevirt->start(); !st) {
      std::cerr << "rdmig-agent: " << st.error().message << "\n";
      return 2;
    }
    if (!config.kubevirt.hook_socket.empty()) {
      auto h = rdmig::kubevirt::start_hook_server(config.kubevirt.hook_socket, *kubevirt);
      if (!h) {
        std::cerr << "rdmig-agent: config key 'kubevirt.hookSocket': " << h.error().message << "\n";
        return 2;
      }
      hook = std::move(h.value());
    }
    // Whether KubeVirt's Plugin can reach this agent, read at each scrape (alert RdmigKubevirtHookNotServed).
    metrics.on_scrape([&gauge = rdmig::kubevirt::register_hook_serving(metrics), h = hook.get()] {
      gauge.Set(h && h->serving() ? 1 : 0);
    });
  }
  rdmig::api::RestServer server(config, token, manager, pathchecks, kubevirt.get(), metrics, api_cert);
  if (api_cert && api_cert->info().expired) {
    LOG_WARN("api") << "the API certificate has expired: " << api_scheme;
  }
  LOG_INFO("api") << "API over " << api_scheme;
  if (auto st = server.bind(); !st) {
    std::cerr << "rdmig-agent: " << st.error().message << "\n";
    return 1;
  }
  std::atomic<bool> shutting_down{false};
  server.set_ready([&] { return !shutting_down.load(); });
  // Liveness follows the KubeVirt relay's watchdog: a wedged relay gets the agent restarted.
  rdmig::api::ProbeServer probes([&] { return !shutting_down.load(); },
                                 [&] { return !kubevirt || kubevirt->responsive(); });
  if (auto st = probes.start(config.api.address, config.api.probe_port); !st) {
    std::cerr << "rdmig-agent: " << st.error().message << "\n";
    return 1;
  }

  if (!ports_file.empty()) {
    const std::string tmp = ports_file + ".tmp";
    std::ofstream out(tmp);
    out << "{\"api\":" << server.port() << ",\"dataPlane\":" << data_plane.port() << ",\"probe\":" << probes.port()
        << "}\n";
    out.close();
    std::rename(tmp.c_str(), ports_file.c_str());
  }
  LOG_INFO("agent") << "rdmig-agent ready api=" << config.api.address << ":" << server.port()
                    << " probes=" << probes.port()
                    << " dataPlane=" << data_plane.advertise_host() << ":" << data_plane.port()
                    << " transport=" << rdmig::transport_name(config.transport)
                    << " " << data_plane.rdma().summary();

  std::thread signal_thread([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    // Draining (docs/deploy.md "Upgrades"): not ready at once, no new work, the running work
    // goes on to its end for up to shutdownGraceSeconds; then, or on a second signal, the rest
    // is cancelled (the VM stays on the source).
    shutting_down = true;
    manager.begin_drain();
    pathchecks.begin_drain();
    if (kubevirt) kubevirt->begin_drain();
    auto running = [&] {
      return manager.active_count() + pathchecks.active_count() + (kubevirt ? kubevirt->active_sessions() : 0);
    };
    LOG_INFO("agent") << "signal " << sig << ": draining: no new work; " << manager.active_count()
                      << " migration(s), " << pathchecks.active_count() << " path check(s), "
                      << (kubevirt ? kubevirt->active_sessions() : 0)
                      << " KubeVirt session(s) go on for up to shutdownGraceSeconds=" << config.shutdown_grace_seconds
                      << "s (a second signal cancels them now)";
    const auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(config.shutdown_grace_seconds);
    bool cut_short = false;
    while (running() > 0) {
      const auto left = drain_until - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
      const auto step = std::min<std::chrono::steady_clock::duration>(left, std::chrono::milliseconds(200));
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(step).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      if (const int again = sigtimedwait(&signals, nullptr, &ts); again > 0) {
        LOG_INFO("agent") << "signal " << again << " while draining: cancelling what still runs now";
        cut_short = true;
        break;
      }
    }
    if (const size_t left = running(); left > 0) {
      LOG_WARN("agent") << (cut_short ? "drain cut short" : "drain time (shutdownGraceSeconds) ran out") << ": cancelling "
                        << left << " migration(s)/session(s) still running (the VM stays on the source)";
    } else {
      LOG_INFO("agent") << "drained: nothing runs any more; stopping";
    }
    pathchecks.shutdown();
    // What is left is cancelled; cancelling is quick (the pod's grace is shutdownGraceSeconds + 10 s).
    manager.shutdown(std::chrono::seconds(5));
    hook.reset();
    if (kubevirt) kubevirt->stop();  // removes the redirects: KubeVirt's own path from now on
    data_plane.stop();
    server.stop();
    probes.stop();
  });

  server.serve();
  if (!shutting_down.load()) {
    // serve() returned on its own (listener failure): stop like on a signal.
    kill(getpid(), SIGTERM);
  }
  signal_thread.join();
  LOG_INFO("agent") << "stopped";
  return 0;
}
