// rdmig-controller: turns RdmaMigration objects into calls on the rdmig agents and mirrors
// their progress into .status. See docs/controller.md.
//
// Threads, all started and joined here: the informers (list+watch of RdmaMigration objects and,
// with kubevirt.enabled, of VirtualMachineInstanceMigrations),
// the leader elector (Lease renewals), the worker (every reconcile), the metrics/probe HTTP
// server, and main, which waits for SIGTERM/SIGINT and then stops them in that order: worker
// (no new agent calls), informer, elector (releases the lease), server.
#include <httplib.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <thread>

#include "common/log.h"
#include "common/text.h"
#include "common/units.h"
#include "common/version.h"
#include "controller/agent_client.h"
#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/kubevirt.h"
#include "controller/kubevirt_observer.h"
#include "controller/pathcheck_reconciler.h"
#include "controller/reconciler.h"
#include "controller/worker.h"
#include "k8s/cluster_config.h"
#include "k8s/events.h"
#include "k8s/http_kube_client.h"
#include "k8s/informer.h"
#include "k8s/leader_election.h"
#include "tls/pem_files.h"

namespace {

constexpr const char* kUsage =
    "usage: rdmig-controller [--config PATH] [--kubeconfig PATH] [--context NAME] [--ports-file PATH]\n"
    "  --config PATH      controller configuration (YAML); without it every key takes its default\n"
    "  --kubeconfig PATH  API server access from a kubeconfig (else $KUBECONFIG, else in-cluster)\n"
    "  --context NAME     kubeconfig context (default: current-context)\n"
    "  --ports-file PATH  write {\"metrics\":port} once listening (for metrics.port 0)\n"
    "       rdmig-controller --check-config PATH   validate the configuration and the token file it\n"
    "                                             names, then exit (0: valid; 2: the message names the key)\n"
    "       rdmig-controller --version             print the version and git revision, then exit\n";


std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

int fail(const std::string& message, int code = 2) {
  std::cerr << "rdmig-controller: " << message << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace rdmig;
  std::string config_path, kubeconfig_path = env("KUBECONFIG"), context, ports_file;
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
  auto loaded = config_path.empty() ? controller::parse_controller_config("")
                                    : controller::load_controller_config_file(config_path);
  if (!loaded) return fail(loaded.error().message);
  controller::ControllerConfig config = std::move(loaded.value());
  log::set_level(*log::parse_level(config.log_level));

  // After a rotation the previous token is kept for 10 minutes (the agents' default
  // api.tokenGraceSeconds): an agent that has not seen the new Secret yet is asked with it.
  auto agent_token = TokenSource::open(config.agents.token_file, "config key 'agents.tokenFile'", 1, std::chrono::seconds(600));
  if (!agent_token) return fail(agent_token.error().message);
  int agent_cas = 0;
  if (config.agents.tls.enabled()) {
    auto cas = tls::check_ca_bundle(config.agents.tls.ca_file, "agents.tls.caFile");
    if (!cas) return fail(cas.error().message);
    agent_cas = cas.value();
  }
  const std::string agents_over =
      config.agents.tls.enabled()
          ? "HTTPS, " + std::to_string(agent_cas) + " CA certificate(s) from '" + config.agents.tls.ca_file +
                "', server name '" + config.agents.tls.server_name + "'"
          : "plain HTTP (agents.tls not set)";
  if (check_only) {
    std::cout << "rdmig-controller: " << config_path << " is valid (token file '" << config.agents.token_file
              << "' read; agents over " << agents_over << ")\n";
    return 0;
  }
  LOG_INFO("controller") << rdmig::version_line("rdmig-controller") << " starting" << (config_path.empty() ? "" : ", config " + config_path);

  std::map<std::string, std::string> environment;
  for (const char* k : {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}) environment[k] = env(k);
  auto cluster = kubeconfig_path.empty()
                     ? k8s::in_cluster_config(environment, "/var/run/secrets/kubernetes.io/serviceaccount")
                     : k8s::load_kubeconfig_file(kubeconfig_path, context);
  if (!cluster) return fail(cluster.error().message);
  if (config.namespace_.empty()) config.namespace_ = env("POD_NAMESPACE");
  if (config.namespace_.empty()) config.namespace_ = cluster->namespace_;
  if (config.namespace_.empty()) config.namespace_ = "rdmig-system";
  std::string identity = config.leader_election.identity;
  if (identity.empty()) identity = env("POD_NAME");
  if (identity.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    identity = host;
  }
  identity += "_" + random_hex(4);

  k8s::HttpOptions http_options;
  http_options.user_agent = "rdmig-controller/" + identity;
  auto kube_made = k8s::HttpKubeClient::create(cluster.value(), http_options);
  if (!kube_made) return fail(kube_made.error().message);
  k8s::HttpKubeClient& kube = *kube_made.value();

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  controller::ControllerMetrics metrics;
  LOG_INFO("controller") << "agents over " << agents_over;
  controller::AgentClient agents(agent_token.value(), static_cast<int>(config.agents.request_timeout_seconds),
                                 [&metrics](const std::string& code) { metrics.agent_request(code); },
                                 controller::AgentTls{config.agents.tls.ca_file, config.agents.tls.server_name});
  k8s::EventRecorder events(kube, "rdmig-controller", identity);

  controller::Worker* worker_ptr = nullptr;
  const std::string collection = config.watch_namespace.empty()
                                     ? "/apis/rdmig.io/v1alpha1/rdmamigrations"
                                     : "/apis/rdmig.io/v1alpha1/namespaces/" + config.watch_namespace + "/rdmamigrations";
  k8s::Informer informer(kube, collection, "", [&worker_ptr](const std::string&, const std::string& key) {
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
          std::string owner;
          if (auto o = vmims->get(key)) {
            for (const auto& ref : o->value("metadata", nlohmann::json::object()).value("ownerReferences",
                                                                                       nlohmann::json::array())) {
              if (ref.value("kind", "") == "RdmaMigration") {
                owner = o->value("metadata", nlohmann::json::object()).value("namespace", "") + "/" + ref.value("name", "");
              }
            }
          }
          worker_ptr->enqueue(owner);  // "" only wakes the worker for the observer
        });
  }
  controller::Reconciler reconciler(config, config.namespace_, kube, informer, agents, events, vmims.get());
  // RdmaPathCheck objects (docs/pathcheck.md): their own cache, reconciler and worker thread,
  // so a long check never delays a migration's reconcile.
  controller::Worker* pathcheck_worker_ptr = nullptr;
  const std::string pathcheck_collection =
      config.watch_namespace.empty()
          ? "/apis/rdmig.io/v1alpha1/rdmapathchecks"
          : "/apis/rdmig.io/v1alpha1/namespaces/" + config.watch_namespace + "/rdmapathchecks";
  k8s::Informer pathcheck_informer(kube, pathcheck_collection, "",
                                   [&pathcheck_worker_ptr](const std::string&, const std::string& key) {
                                     if (pathcheck_worker_ptr) pathcheck_worker_ptr->enqueue(key);
                                   });
  controller::PathCheckReconciler pathcheck_reconciler(config, config.namespace_, kube, pathcheck_informer, agents,
                                                       events, metrics);
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
  k8s::LeaderElector elector(kube, le, [&metrics, &wake, &pathcheck_wake](bool leading) {
    metrics.set_leader(leading);
    if (leading && wake) wake->enqueue("");  // reconcile everything now, not at the next poll
    if (leading && pathcheck_wake) pathcheck_wake->enqueue("");
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

  httplib::Server server;
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"status\":\"ok\"}\n", "application/json");
  });
  server.Get("/readyz", [&](const httplib::Request&, httplib::Response& res) {
    const bool ready = informer.synced() && pathcheck_informer.synced();
    res.status = ready ? 200 : 503;
    res.set_content(ready ? "{\"status\":\"ready\"}\n" : "{\"status\":\"not synced\"}\n", "application/json");
  });
  const int port = config.metrics.port == 0
                       ? server.bind_to_any_port(config.metrics.address)
                       : (server.bind_to_port(config.metrics.address, config.metrics.port) ? config.metrics.port : -1);
  if (port <= 0) {
    return fail("config key 'metrics.port': cannot listen on " + config.metrics.address + ":" +
                    std::to_string(config.metrics.port), 1);
  }
  if (!ports_file.empty()) {
    const std::string tmp = ports_file + ".tmp";
    std::ofstream(tmp) << "{\"metrics\":" << port << "}\n";
    std::rename(tmp.c_str(), ports_file.c_str());
  }
  LOG_INFO("controller") << "rdmig-controller " << identity << " starting: server=" << cluster->server
                         << " namespace=" << config.namespace_ << " watch="
                         << (config.watch_namespace.empty() ? "<all>" : config.watch_namespace)
                         << " metrics=" << config.metrics.address << ":" << port
                         << " kubevirt=" << (config.kubevirt.enabled ? "on" : "off")
                         << " leaderElection=" << (elect ? "on" : "off");

  std::thread server_thread([&] { server.listen_after_bind(); });
  std::thread informer_thread([&] { informer.run(); });
  std::thread pathcheck_informer_thread([&] { pathcheck_informer.run(); });
  std::thread vmim_thread;
  if (vmims) vmim_thread = std::thread([&] { vmims->run(); });
  std::thread elector_thread;
  if (elect) elector_thread = std::thread([&] { elector.run(); });
  std::thread worker_thread([&] { worker.run(); });
  std::thread pathcheck_worker_thread([&] { pathcheck_worker.run(); });

  int sig = 0;
  sigwait(&signals, &sig);
  LOG_INFO("controller") << "signal " << sig << ": stopping";
  worker.stop();
  worker_thread.join();
  pathcheck_worker.stop();
  pathcheck_worker_thread.join();
  informer.stop();
  pathcheck_informer.stop();
  if (vmims) vmims->stop();
  kube.stop_watches();
  informer_thread.join();
  pathcheck_informer_thread.join();
  if (vmims) vmim_thread.join();
  if (elect) {
    elector.stop();
    elector_thread.join();
  }
  server.stop();
  server_thread.join();
  LOG_INFO("controller") << "stopped";
  return 0;
}
