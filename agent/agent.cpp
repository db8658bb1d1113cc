#include "agent.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <thread>

#include "common/log.h"
#include "common/stop_signals.h"
#include "kubevirt/flow/kubevirt_metrics.h"

namespace rdmig::agent {
namespace {

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

// The migration sockets live in stateDir: a real directory of ours, closed to everyone else.
Status make_state_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Error{Errc::kInvalidArgument,
                 "config key 'stateDir': cannot create '" + dir + "': " + std::strerror(errno)};
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
    return Error{Errc::kInvalidArgument,
                 "config key 'stateDir': '" + dir + "' must be a directory (not a symlink) owned by the agent's user"};
  }
  if ((st.st_mode & 0077) != 0 && ::chmod(dir.c_str(), 0700) != 0) {
    return Error{Errc::kInvalidArgument,
                 "config key 'stateDir': cannot make '" + dir + "' private (0700): " + std::strerror(errno)};
  }
  return ok_status();
}

// The build's info series first, as before any other family is registered.
Metrics& with_build_info(Metrics& metrics) {
  register_build_info(*metrics.registry());
  return metrics;
}

int fail(const std::string& message, int status) {
  std::cerr << "rdmig-agent: " << message << "\n";
  return status;
}

}  // namespace

Result<Prepared> prepare(const std::string& path, bool check_only) {
  auto loaded = load_agent_config_file(path);
  if (!loaded) return loaded.error();
  Prepared p;
  p.config = std::move(loaded.value());
  log::set_level(*log::parse_level(p.config.log_level));
  auto tokens = TokenSource::open(p.config.api.token_file, "config key 'api.tokenFile'", 16,
                                  std::chrono::seconds(p.config.api.token_grace_seconds));
  if (!tokens) return tokens.error();
  p.token = tokens.value();
  // HTTPS on the API port: the certificate and key are checked now (errors name the key), and
  // re-read when their files change (tls/server_certificate.h).
  p.api_scheme = "plain HTTP (api.tls not set)";
  if (p.config.api.tls.enabled()) {
    auto cert = tls::ServerCertificate::load(p.config.api.tls.cert_file, "api.tls.certFile",
                                             p.config.api.tls.key_file, "api.tls.keyFile");
    if (!cert) return cert.error();
    p.api_cert = cert.value();
    const auto info = p.api_cert->info();
    p.api_scheme = "HTTPS with " + info.subject + " (" + (info.names.empty() ? "no DNS names" : info.names) +
                   "), valid until " + info.not_after + (info.expired ? " (EXPIRED)" : "");
  }
  if (!check_only) {
    if (auto st = make_state_dir(p.config.state_dir); !st) return st.error();
  }
  return p;
}

sigset_t block_signals() {
  const sigset_t signals = block_stop_signals();
  raise_memlock();
  return signals;
}

Agent::Agent(Prepared prepared)
    : prepared_(std::move(prepared)),
      config_(prepared_.config),
      metrics_("agent"),
      data_plane_(config_, with_build_info(metrics_)),
      manager_(config_, metrics_, data_plane_),
      // Path checks (docs/pathcheck.md) share the data plane and migration.bufferBudget.
      pathchecks_(config_, metrics_, data_plane_) {
  // KubeVirt mode: carries KubeVirt's own migration connections (docs/kubevirt.md).
  if (config_.kubevirt.enabled) {
    kubevirt_ = std::make_unique<kubevirt::KubevirtRelay>(config_, metrics_, data_plane_, prepared_.token);
    // One migration.bufferBudget for both kinds of migration on this agent.
    kubevirt_->count_also([this] { return manager_.buffer_bytes_in_use() + pathchecks_.buffer_bytes_in_use(); });
    manager_.count_also([this] { return kubevirt_->flow_buffer_bytes() + pathchecks_.buffer_bytes_in_use(); });
  } else {
    manager_.count_also([this] { return pathchecks_.buffer_bytes_in_use(); });
  }
  // A carried KubeVirt flow holds buffers exactly while it runs: it counts as a running migration.
  pathchecks_.set_neighbours(
      [this] { return manager_.active_count() + (kubevirt_ && kubevirt_->flow_buffer_bytes() > 0 ? 1 : 0); },
      [this] { return manager_.buffer_bytes_in_use() + (kubevirt_ ? kubevirt_->flow_buffer_bytes() : 0); });
}

Agent::~Agent() = default;

int Agent::start(const std::string& ports_file) {
  // Post-copy migrations this agent ran when it died are taken up before any peer can reach it:
  // the other agent's recovery dials must find them (docs/api.md "Post-copy recovery").
  manager_.restore_postcopy_records();
  if (auto st = data_plane_.start(); !st) {
    return fail(st.error().message, st.error().code == Errc::kFailedPrecondition ? 2 : 1);
  }
  if (kubevirt_) {
    if (auto st = kubevirt_->start(); !st) return fail(st.error().message, 2);
    if (!config_.kubevirt.hook_socket.empty()) {
      auto h = kubevirt::start_hook_server(config_.kubevirt.hook_socket, *kubevirt_);
      if (!h) return fail("config key 'kubevirt.hookSocket': " + h.error().message, 2);
      hook_ = std::move(h.value());
    }
    // Whether KubeVirt's Plugin can reach this agent, read at each scrape (alert RdmigKubevirtHookNotServed).
    metrics_.on_scrape([&gauge = kubevirt::register_hook_serving(metrics_), h = hook_.get()] {
      gauge.Set(h && h->serving() ? 1 : 0);
    });
  }
  server_ = std::make_unique<api::RestServer>(config_, prepared_.token, manager_, pathchecks_, kubevirt_.get(),
                                              metrics_, prepared_.api_cert);
  if (prepared_.api_cert && prepared_.api_cert->info().expired) {
    LOG_WARN("api") << "the API certificate has expired: " << prepared_.api_scheme;
  }
  LOG_INFO("api") << "API over " << prepared_.api_scheme;
  if (auto st = server_->bind(); !st) return fail(st.error().message, 1);
  server_->set_ready([this] { return !shutting_down_.load(); });
  // Liveness follows the KubeVirt relay's watchdog: a wedged relay gets the agent restarted.
  probes_ = std::make_unique<api::ProbeServer>([this] { return !shutting_down_.load(); },
                                               [this] { return !kubevirt_ || kubevirt_->responsive(); });
  if (auto st = probes_->start(config_.api.address, config_.api.probe_port); !st) return fail(st.error().message, 1);

  if (!ports_file.empty()) {
    const std::string tmp = ports_file + ".tmp";
    std::ofstream out(tmp);
    out << "{\"api\":" << server_->port() << ",\"dataPlane\":" << data_plane_.port() << ",\"probe\":" << probes_->port()
        << "}\n";
    out.close();
    std::rename(tmp.c_str(), ports_file.c_str());
  }
  LOG_INFO("agent") << "rdmig-agent ready api=" << config_.api.address << ":" << server_->port()
                    << " probes=" << probes_->port() << " dataPlane=" << data_plane_.advertise_host() << ":"
                    << data_plane_.port() << " transport=" << transport_name(config_.transport) << " "
                    << data_plane_.rdma().summary();
  return 0;
}

size_t Agent::running() const {
  return manager_.active_count() + pathchecks_.active_count() + (kubevirt_ ? kubevirt_->active_sessions() : 0);
}

void Agent::run(const sigset_t& signals) {
  std::thread signal_thread([this, signals] { drain_and_stop(signals); });
  server_->serve();
  if (!shutting_down_.load()) {
    // serve() returned on its own (listener failure): stop like on a signal.
    kill(getpid(), SIGTERM);
  }
  signal_thread.join();
}

void Agent::drain_and_stop(sigset_t signals) {
  int sig = 0;
  sigwait(&signals, &sig);
  shutting_down_ = true;
  manager_.begin_drain();
  pathchecks_.begin_drain();
  if (kubevirt_) kubevirt_->begin_drain();
  LOG_INFO("agent") << "signal " << sig << ": draining: no new work; " << manager_.active_count()
                    << " migration(s), " << pathchecks_.active_count() << " path check(s), "
                    << (kubevirt_ ? kubevirt_->active_sessions() : 0)
                    << " KubeVirt session(s) go on for up to shutdownGraceSeconds=" << config_.shutdown_grace_seconds
                    << "s (a second signal cancels them now)";
  const auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(config_.shutdown_grace_seconds);
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
  pathchecks_.shutdown();
  // What is left is cancelled; cancelling is quick (the pod's grace is shutdownGraceSeconds + 10 s).
  manager_.shutdown(std::chrono::seconds(5));
  hook_.reset();
  if (kubevirt_) kubevirt_->stop();  // removes the redirects: KubeVirt's own path from now on
  data_plane_.stop();
  server_->stop();
  probes_->stop();
}

}  // namespace rdmig::agent
