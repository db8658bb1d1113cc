// rdmig-controller: turns RdmaMigration objects into calls on the rdmig agents and mirrors
// their progress into .status. See docs/controller.md.
//
// Threads, all started and joined here: the informers (list+watch of RdmaMigration objects and,
// with kubevirt.enabled, of VirtualMachineInstanceMigrations),
// the leader elector (Lease renewals), the worker (every reconcile), the metrics server (HTTPS
// with TokenReview/SubjectAccessReview unless metrics.secure is false: controller/metrics_auth.h),
// the probe server (/healthz, /readyz), and main, which waits for SIGTERM/SIGINT and then stops
// them in that order: worker (no new agent calls), informer, elector (releases the lease), servers.
#include <httplib.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include "common/log.h"
#include "common/stop_signals.h"
#include "common/text.h"
#include "common/units.h"
#include "common/version.h"
#include "controller/agent_client.h"
#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/kubevirt.h"
#include "controller/kubevirt_observer.h"
#include "controller/drainplan_reconciler.h"
#include "controller/pathcheck_reconciler.h"
#include "controller/reconciler.h"
#include "controller/startup.h"
#include "controller/worker.h"
#include "k8s/cluster_config.h"
#include "k8s/events.h"
#include "k8s/http_kube_client.h"
#include "k8s/informer.h"
#include "k8s/leader_election.h"

namespace {

constexpr const char* kUsage =
    "usage: rdmig-controller [--config PATH] [--kubeconfig PATH] [--context NAME] [--ports-file PATH]\n"
    "  --config PATH      controller configuration (YAML); without it every key takes its default\n"
    "  --kubeconfig PATH  API server access from a kubeconfig (else $KUBECONFIG, else in-cluster)\n"
    "  --context NAME     kubeconfig context (default: current-context)\n"
    "  --ports-file PATH  write {\"metrics\":port,\"probes\":port} once listening (for port 0)\n"
    "       rdmig-controller --check-config PATH   validate the configuration and the token file it\n"
    "                                             names, then exit (0: valid; 2: the message names the key)\n"
    "       rdmig-controller --version             print the version and git revision, then exit\n";


int fail(const std::string& message, int code = 2) {
  std::cerr << "rdmig-controller: " << message << "\n";
  return code;
}

// 2 for a configuration error (the message names the key), 1 otherwise.
int fail(const rdmig::Error& error) { return fail(error.message, error.code == rdmig::Errc::kInvalidArgument ? 2 : 1); }

}  // namespace

int main(int argc, char** argv) {
  using namespace rdmig;
  const char* kubeconfig_env = std::getenv("KUBECONFIG");
  std::string config_path, kubeconfig_path = kubeconfig_env ? kubeconfig_env : "", context, ports_file;
  bool check_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) config_path = argv[++i];
    else if (a == "--check-config" && i + 1 < argc) config_path = argv[++i], check_only = true;
    else if (a == "--version") {
      std::cout << rdmig::version_line("rdmig-controller") << "\n";
      return 0;
    }
    else if (a == "--kubeconfig" && i + 1 < argc) kubeconfig_path = argv[++i];
    else if (a == "--context" && i + 1 < argc) context = argv[++i];
    else if (a == "--ports-file" && i + 1 < argc) ports_file = argv[++i];
    else if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    } else {
      std::cerr << "rdmig-controller: unknown argument '" << a << "'\n" << kUsage;
      return 2;
    }
  }
  auto checked = controller::check_config(config_path);
  if (!checked) return fail(checked.error());
  controller::ControllerConfig config = std::move(checked->config);
  const std::string agents_over = checked->agents_over, metrics_over = checked->metrics_over;
  if (check_only) {
    std::cout << "rdmig-controller: " << config_path << " is valid (token file '" << config.agents.token_file
              << "' read; agents over " << agents_over << "; /metrics over " << metrics_over << ")\n";
    return 0;
  }
  LOG_INFO("controller") << rdmig::version_line("rdmig-controller") << " starting" << (config_path.empty() ? "" : ", config " + config_path);

  auto placed = controller::place(config, kubeconfig_path, context);
  if (!placed) return fail(placed.error());
  const k8s::ClusterConfig& cluster = placed->cluster;
  const std::string identity = placed->identity;

  k8s::HttpOptions http_options;
  http_options.user_agent = "rdmig-controller/" + identity;
  auto kube_made = k8s::HttpKubeClient::create(cluster, http_options);
  if (!kube_made) return fail(kube_made.error().message);
  k8s::HttpKubeClient& kube = *kube_made.value();

  sigset_t signals = block_stop_signals();  // before any thread starts

  controller::ControllerMetrics metrics;
  LOG_INFO("controller") << "agents over " << agents_over;
  controller::AgentClient agents(checked->agent_token, static_cast<int>(config.agents.request_timeout_seconds),
                                 [&metrics](const std::string& code) { metrics.agent_request(code); },
                                 controller::AgentTls{config.agents.tls.ca_file, config.agents.tls.server_name});
  k8s::EventRecorder events(kube, "rdmig-controller", identity);

  controller::Worker* worker_ptr = nullptr;
  k8s::Informer informer(kube, controller::collection(config.watch_namespace, "rdmamigrations"), "",
                         [&worker_ptr](const std::string&, const std::string& key) {
    if (worker_ptr) worker_ptr->enqueue(key);
  });
  // KubeVirt: every VirtualMachineInstanceMigration (ours wake their RdmaMigration; the
  // others are reported by the observer).
  std::unique_ptr<k8s::Informer> vmims;
  if (config.kubevirt.enabled) {
    vmims = std::make_unique<k8s::Informer>(
        kube, controller::vmim_collection(config.watch_namespace), "",
        [&worker_ptr, &vmims](const std::string&, const std::string& key) {
          if (!worker_ptr) return;
          const auto o = vmims->get(key);
          worker_ptr->enqueue(o ? controller::rdma_migration_key_of(*o) : "");  // "" wakes it for the observer
        });
  }
  controller::Reconciler reconciler(config, config.namespace_, kube, informer, agents, events, vmims.get());
  // RdmaPathCheck objects (docs/pathcheck.md): their own cache, reconciler and worker thread,
  // so a long check never delays a migration's reconcile.
  controller::Worker* pathcheck_worker_ptr = nullptr;
  k8s::Informer pathcheck_informer(kube, controller::collection(config.watch_namespace, "rdmapathchecks"), "",
                                   [&pathcheck_worker_ptr](const std::string&, const std::string& key) {
                                     if (pathcheck_worker_ptr) pathcheck_worker_ptr->enqueue(key);
                                   });
  controller::PathCheckReconciler pathcheck_reconciler(config, config.namespace_, kube, pathcheck_informer, agents,
                                                       events, metrics);
  // RdmaDrainPlan objects (docs/drain.md): forecasts read the path checks' cache.
  controller::Worker* drainplan_worker_ptr = nullptr;
  k8s::Informer drainplan_informer(kube, controller::collection(config.watch_namespace, "rdmadrainplans"), "",
                                   [&drainplan_worker_ptr](const std::string&, const std::string& key) {
                                     if (drainplan_worker_ptr) drainplan_worker_ptr->enqueue(key);
                                   });
  controller::DrainPlanReconciler drainplan_reconciler(config, config.namespace_, kube, drainplan_informer,
                                                       pathcheck_informer, events, metrics);
  std::unique_ptr<controller::KubevirtObserver> observer;
  if (vmims) {
    observer = std::make_unique<controller::KubevirtObserver>(config, config.namespace_, kube, *vmims, agents, events,
                                                               metrics);
  }

  using ms = std::chrono::milliseconds;
  auto secs = [](double s) { return ms(static_cast<long long>(s * 1000)); };
  k8s::LeaderElectionConfig le{config.namespace_, config.leader_election.lease_name, identity,
                               secs(config.leader_election.lease_duration_seconds),
                               secs(config.leader_election.renew_deadline_seconds),
                               secs(config.leader_election.retry_period_seconds)};
  controller::Worker* wake = nullptr;
  controller::Worker* pathcheck_wake = nullptr;
  controller::Worker* drainplan_wake = nullptr;
  k8s::LeaderElector elector(kube, le, [&metrics, &wake, &pathcheck_wake, &drainplan_wake](bool leading) {
    metrics.set_leader(leading);
    if (leading && wake) wake->enqueue("");  // reconcile everything now, not at the next poll
    if (leading && pathcheck_wake) pathcheck_wake->enqueue("");
    if (leading && drainplan_wake) drainplan_wake->enqueue("");
  });
  const bool elect = config.leader_election.enabled;
  metrics.set_leader(!elect);
  controller::Worker worker(reconciler, informer, metrics, ms(config.poll_interval_ms),
                            [&] { return !elect || elector.leading(); }, observer.get());
  worker_ptr = &worker;
  wake = &worker;
  controller::Worker pathcheck_worker(pathcheck_reconciler, pathcheck_informer, metrics, ms(config.poll_interval_ms),
                                      [&] { return !elect || elector.leading(); }, nullptr, /*phase_gauge=*/false);
  pathcheck_worker_ptr = &pathcheck_worker;
  pathcheck_wake = &pathcheck_worker;
  controller::Worker drainplan_worker(drainplan_reconciler, drainplan_informer, metrics, ms(config.poll_interval_ms),
                                      [&] { return !elect || elector.leading(); }, nullptr, /*phase_gauge=*/false);
  drainplan_worker_ptr = &drainplan_worker;
  drainplan_wake = &drainplan_worker;

  // /metrics: HTTPS, every request's token reviewed by the API server (startup.h).
  auto metrics_server = controller::MetricsServer::create(config, cluster, http_options, metrics);
  if (!metrics_server) return fail(metrics_server.error());
  const int port = metrics_server.value()->port();
  // Probes: plain HTTP, no authentication (the kubelet sends no token), apart from /metrics.
  auto probes = controller::ProbeServer::create(config, [&] {
    return informer.synced() && pathcheck_informer.synced() && drainplan_informer.synced();
  });
  if (!probes) return fail(probes.error());
  const int probe_port = probes.value()->port();
  if (!ports_file.empty()) {
    const std::string tmp = ports_file + ".tmp";
    std::ofstream(tmp) << "{\"metrics\":" << port << ",\"probes\":" << probe_port << "}\n";
    std::rename(tmp.c_str(), ports_file.c_str());
  }
  LOG_INFO("controller") << "rdmig-controller " << identity << " starting: server=" << cluster.server
                         << " namespace=" << config.namespace_ << " watch="
                         << (config.watch_namespace.empty() ? "<all>" : config.watch_namespace)
                         << " metrics=" << config.metrics.address << ":" << port << " (" << metrics_over << ")"
                         << " probes=" << config.probes.address << ":" << probe_port
                         << " kubevirt=" << (config.kubevirt.enabled ? "on" : "off")
                         << " leaderElection=" << (elect ? "on" : "off");

  std::thread server_thread([&] { metrics_server.value()->serve(); });
  std::thread probe_thread([&] { probes.value()->serve(); });
  std::thread informer_thread([&] { informer.run(); });
  std::thread pathcheck_informer_thread([&] { pathcheck_informer.run(); });
  std::thread drainplan_informer_thread([&] { drainplan_informer.run(); });
  std::thread vmim_thread;
  if (vmims) vmim_thread = std::thread([&] { vmims->run(); });
  std::thread elector_thread;
  if (elect) elector_thread = std::thread([&] { elector.run(); });
  std::thread worker_thread([&] { worker.run(); });
  std::thread pathcheck_worker_thread([&] { pathcheck_worker.run(); });
  std::thread drainplan_worker_thread([&] { drainplan_worker.run(); });

  int sig = 0;
  sigwait(&signals, &sig);
  LOG_INFO("controller") << "signal " << sig << ": stopping";
  worker.stop();
  worker_thread.join();
  pathcheck_worker.stop();
  pathcheck_worker_thread.join();
  drainplan_worker.stop();
  drainplan_worker_thread.join();
  informer.stop();
  pathcheck_informer.stop();
  drainplan_informer.stop();
  if (vmims) vmims->stop();
  kube.stop_watches();
  informer_thread.join();
  pathcheck_informer_thread.join();
  drainplan_informer_thread.join();
  if (vmims) vmim_thread.join();
  if (elect) {
    elector.stop();
    elector_thread.join();
  }
  metrics_server.value()->stop();
  server_thread.join();
  probes.value()->stop();
  probe_thread.join();
  LOG_INFO("controller") << "stopped";
  return 0;
}
