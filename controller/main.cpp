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
#include "common/text.h"
#include "common/units.h"
#include "common/version.h"
#include "controller/agent_client.h"
#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/kubevirt.h"
#include "controller/kubevirt_observer.h"
#include "controller/metrics_auth.h"
#include "controller/drainplan_reconciler.h"
#include "controller/pathcheck_reconciler.h"
#include "controller/reconciler.h"
#include "controller/worker.h"
#include "k8s/cluster_config.h"
#include "k8s/events.h"
#include "k8s/http_kube_client.h"
#include "k8s/informer.h"
#include "k8s/leader_election.h"
#include "tls/pem_files.h"
#include "tls/self_signed.h"
#include "tls/server_certificate.h"

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


std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

int fail(const std::string& message, int code = 2) {
  std::cerr << "rdmig-controller: " << message << "\n";
  return code;
}

// Binds `server` to address:port (0 = any free port); the port, or -1.
int bind_server(httplib::Server& server, const std::string& address, uint16_t port) {
  if (port == 0) return server.bind_to_any_port(address);
  return server.bind_to_port(address, port) ? port : -1;
}

void send_json_error(httplib::Response& res, int status, const std::string& message) {
  const rdmig::Errc code = status == 401   ? rdmig::Errc::kUnauthenticated
                           : status == 403 ? rdmig::Errc::kPermissionDenied
                           : status == 404 ? rdmig::Errc::kNotFound
                           : status == 503 ? rdmig::Errc::kUnavailable
                                           : rdmig::Errc::kInternal;
  res.status = status;
  if (status == 401) res.set_header("WWW-Authenticate", "Bearer");
  const nlohmann::json body = {{"error", {{"code", rdmig::errc_name(code)}, {"message", message}}}};
  res.set_content(body.dump() + "\n", "application/json");
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
  std::string metrics_over = "plain HTTP on " + config.metrics.address + " (metrics.secure false: local only)";
  if (config.metrics.secure) {
    metrics_over = "HTTPS with TokenReview and SubjectAccessReview, a self-signed certificate made at start";
    if (!config.metrics.tls.cert_file.empty()) {
      auto info = tls::check_cert_and_key(config.metrics.tls.cert_file, "metrics.tls.certFile",
                                          config.metrics.tls.key_file, "metrics.tls.keyFile");
      if (!info) return fail(info.error().message);
      metrics_over = "HTTPS with TokenReview and SubjectAccessReview, certificate " + info->subject +
                     (info->names.empty() ? "" : " (" + info->names + ")") + " until " + info->not_after;
    }
  }
  if (check_only) {
    std::cout << "rdmig-controller: " << config_path << " is valid (token file '" << config.agents.token_file
              << "' read; agents over " << agents_over << "; /metrics over " << metrics_over << ")\n";
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
  // RdmaDrainPlan objects (docs/drain.md): forecasts read the path checks' cache.
  controller::Worker* drainplan_worker_ptr = nullptr;
  k8s::Informer drainplan_informer(kube,
                                   config.watch_namespace.empty()
                                       ? "/apis/rdmig.io/v1alpha1/rdmadrainplans"
                                       : "/apis/rdmig.io/v1alpha1/namespaces/" + config.watch_namespace + "/rdmadrainplans",
                                   "", [&drainplan_worker_ptr](const std::string&, const std::string& key) {
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

  // Probes: plain HTTP, no authentication (the kubelet sends no token), apart from /metrics.
  httplib::Server probe_server;
  probe_server.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"status\":\"ok\"}\n", "application/json");
  });
  probe_server.Get("/readyz", [&](const httplib::Request&, httplib::Response& res) {
    const bool ready = informer.synced() && pathcheck_informer.synced() && drainplan_informer.synced();
    res.status = ready ? 200 : 503;
    res.set_content(ready ? "{\"status\":\"ready\"}\n" : "{\"status\":\"not synced\"}\n", "application/json");
  });

  // /metrics: HTTPS, every request's token reviewed by the API server (metrics_auth.h); or, with
  // metrics.secure false, plain HTTP on a loopback address (config.cpp refuses any other).
  std::shared_ptr<tls::ServerCertificate> metrics_cert;
  std::optional<tls::SelfSigned> self_signed;
  std::unique_ptr<k8s::HttpKubeClient> review_kube;
  std::unique_ptr<controller::MetricsAuth> metrics_auth;
  std::unique_ptr<httplib::Server> metrics_server;
  if (config.metrics.secure) {
    if (!config.metrics.tls.cert_file.empty()) {
      auto cert = tls::ServerCertificate::load(config.metrics.tls.cert_file, "metrics.tls.certFile",
                                               config.metrics.tls.key_file, "metrics.tls.keyFile");
      if (!cert) return fail(cert.error().message);
      metrics_cert = cert.value();
      metrics_server = std::make_unique<httplib::SSLServer>([&](SSL_CTX& ctx) { return metrics_cert->configure(ctx); });
    } else {
      auto made = tls::make_self_signed("rdmig-controller", {"localhost", "127.0.0.1", "::1"}, 365);
      if (!made) return fail(made.error().message, 1);
      self_signed = std::move(made.value());
      LOG_INFO("controller") << "metrics: self-signed certificate made at start, SHA-256 " << self_signed->fingerprint;
      metrics_server = std::make_unique<httplib::SSLServer>([&](SSL_CTX& ctx) { return self_signed->configure(ctx); });
    }
    if (!metrics_server->is_valid()) return fail("config key 'metrics.tls': cannot set up HTTPS with it", 1);
    // Reviews get a client of their own with a 10 s bound on each call (controller-runtime's
    // TokenAccessReviewTimeout), so a slow API server answers a scrape with 503, not a hang.
    k8s::HttpOptions review_options = http_options;
    review_options.call_timeout = std::chrono::seconds(10);
    auto made_kube = k8s::HttpKubeClient::create(cluster.value(), review_options);
    if (!made_kube) return fail(made_kube.error().message);
    review_kube = std::move(made_kube.value());
    metrics_auth = std::make_unique<controller::MetricsAuth>(*review_kube, config.metrics.auth_cache_entries);
    metrics_server->set_pre_routing_handler([&](const httplib::Request& req, httplib::Response& res) {
      if (req.path != "/metrics") {
        send_json_error(res, 404, "this port serves GET /metrics only (probes: probes.port)");
        return httplib::Server::HandlerResponse::Handled;
      }
      const auto d = metrics_auth->check(req.get_header_value("Authorization"), req.path);
      if (d.status == 200) return httplib::Server::HandlerResponse::Unhandled;
      if (d.status >= 500) {
        LOG_WARN("controller") << "metrics: scrape from " << req.remote_addr << " answered " << d.status << ": " << d.message;
      } else {
        LOG_DEBUG("controller") << "metrics: scrape from " << req.remote_addr << " answered " << d.status << ": " << d.message;
      }
      send_json_error(res, d.status, d.message);
      return httplib::Server::HandlerResponse::Handled;
    });
  } else {
    metrics_server = std::make_unique<httplib::Server>();
  }
  metrics_server->Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  const int port = bind_server(*metrics_server, config.metrics.address, config.metrics.port);
  if (port <= 0) {
    return fail("config key 'metrics.port': cannot listen on " + config.metrics.address + ":" +
                    std::to_string(config.metrics.port), 1);
  }
  const int probe_port = bind_server(probe_server, config.probes.address, config.probes.port);
  if (probe_port <= 0) {
    return fail("config key 'probes.port': cannot listen on " + config.probes.address + ":" +
                    std::to_string(config.probes.port), 1);
  }
  if (!ports_file.empty()) {
    const std::string tmp = ports_file + ".tmp";
    std::ofstream(tmp) << "{\"metrics\":" << port << ",\"probes\":" << probe_port << "}\n";
    std::rename(tmp.c_str(), ports_file.c_str());
  }
  LOG_INFO("controller") << "rdmig-controller " << identity << " starting: server=" << cluster->server
                         << " namespace=" << config.namespace_ << " watch="
                         << (config.watch_namespace.empty() ? "<all>" : config.watch_namespace)
                         << " metrics=" << config.metrics.address << ":" << port << " (" << metrics_over << ")"
                         << " probes=" << config.probes.address << ":" << probe_port
                         << " kubevirt=" << (config.kubevirt.enabled ? "on" : "off")
                         << " leaderElection=" << (elect ? "on" : "off");

  std::thread server_thread([&] { metrics_server->listen_after_bind(); });
  std::thread probe_thread([&] { probe_server.listen_after_bind(); });
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
  metrics_server->stop();
  server_thread.join();
  probe_server.stop();
  probe_thread.join();
  LOG_INFO("controller") << "stopped";
  return 0;
}
