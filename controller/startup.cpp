#include "controller/startup.h"

#include <unistd.h>

#include <cstdlib>

#include "common/log.h"
#include "common/text.h"
#include "common/units.h"
#include "tls/pem_files.h"

namespace rdmig::controller {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

void send_json_error(httplib::Response& res, int status, const std::string& message) {
  const Errc code = status == 401   ? Errc::kUnauthenticated
                    : status == 403 ? Errc::kPermissionDenied
                    : status == 404 ? Errc::kNotFound
                    : status == 503 ? Errc::kUnavailable
                                    : Errc::kInternal;
  res.status = status;
  if (status == 401) res.set_header("WWW-Authenticate", "Bearer");
  const nlohmann::json body = {{"error", {{"code", errc_name(code)}, {"message", message}}}};
  res.set_content(body.dump() + "\n", "application/json");
}

// A configuration error: main exits 2 for these, 1 for the others.
Error config_error(const Error& e) { return Error{Errc::kInvalidArgument, e.message}; }

}  // namespace

int bind_server(httplib::Server& server, const std::string& address, uint16_t port) {
  if (port == 0) return server.bind_to_any_port(address);
  return server.bind_to_port(address, port) ? port : -1;
}

std::string collection(const std::string& watch_namespace, const std::string& plural) {
  return watch_namespace.empty() ? "/apis/rdmig.io/v1alpha1/" + plural
                                 : "/apis/rdmig.io/v1alpha1/namespaces/" + watch_namespace + "/" + plural;
}

Result<std::unique_ptr<ProbeServer>> ProbeServer::create(const ControllerConfig& config, std::function<bool()> ready) {
  std::unique_ptr<ProbeServer> p(new ProbeServer());
  p->server_.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"status\":\"ok\"}\n", "application/json");
  });
  p->server_.Get("/readyz", [ready = std::move(ready)](const httplib::Request&, httplib::Response& res) {
    const bool ok = ready();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "{\"status\":\"ready\"}\n" : "{\"status\":\"not synced\"}\n", "application/json");
  });
  p->port_ = bind_server(p->server_, config.probes.address, config.probes.port);
  if (p->port_ <= 0) {
    return Error{Errc::kInternal, "config key 'probes.port': cannot listen on " + config.probes.address + ":" +
                                      std::to_string(config.probes.port)};
  }
  return p;
}

Result<Checked> check_config(const std::string& config_path) {
  auto loaded = config_path.empty() ? parse_controller_config("") : load_controller_config_file(config_path);
  if (!loaded) return config_error(loaded.error());
  Checked c;
  c.config = std::move(loaded.value());
  log::set_level(*log::parse_level(c.config.log_level));
  // After a rotation the previous token is kept for 10 minutes (the agents' default
  // api.tokenGraceSeconds): an agent that has not seen the new Secret yet is asked with it.
  auto token = TokenSource::open(c.config.agents.token_file, "config key 'agents.tokenFile'", 1, std::chrono::seconds(600));
  if (!token) return config_error(token.error());
  c.agent_token = token.value();
  int agent_cas = 0;
  if (c.config.agents.tls.enabled()) {
    auto cas = tls::check_ca_bundle(c.config.agents.tls.ca_file, "agents.tls.caFile");
    if (!cas) return config_error(cas.error());
    agent_cas = cas.value();
  }
  c.agents_over = c.config.agents.tls.enabled()
                      ? "HTTPS, " + std::to_string(agent_cas) + " CA certificate(s) from '" + c.config.agents.tls.ca_file +
                            "', server name '" + c.config.agents.tls.server_name + "'"
                      : "plain HTTP (agents.tls not set)";
  c.metrics_over = "plain HTTP on " + c.config.metrics.address + " (metrics.secure false: local only)";
  if (c.config.metrics.secure) {
    c.metrics_over = "HTTPS with TokenReview and SubjectAccessReview, a self-signed certificate made at start";
    if (!c.config.metrics.tls.cert_file.empty()) {
      auto info = tls::check_cert_and_key(c.config.metrics.tls.cert_file, "metrics.tls.certFile",
                                          c.config.metrics.tls.key_file, "metrics.tls.keyFile");
      if (!info) return config_error(info.error());
      c.metrics_over = "HTTPS with TokenReview and SubjectAccessReview, certificate " + info->subject +
                       (info->names.empty() ? "" : " (" + info->names + ")") + " until " + info->not_after;
    }
  }
  return c;
}

Result<Placement> place(ControllerConfig& config, const std::string& kubeconfig_path, const std::string& context) {
  std::map<std::string, std::string> environment;
  for (const char* k : {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}) environment[k] = env(k);
  auto cluster = kubeconfig_path.empty()
                     ? k8s::in_cluster_config(environment, "/var/run/secrets/kubernetes.io/serviceaccount")
                     : k8s::load_kubeconfig_file(kubeconfig_path, context);
  if (!cluster) return config_error(cluster.error());
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
  return Placement{std::move(cluster.value()), identity + "_" + random_hex(4)};
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::create(const ControllerConfig& config,
                                                             const k8s::ClusterConfig& cluster,
                                                             const k8s::HttpOptions& http_options,
                                                             ControllerMetrics& metrics) {
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  if (config.metrics.secure) {
    if (!config.metrics.tls.cert_file.empty()) {
      auto cert = tls::ServerCertificate::load(config.metrics.tls.cert_file, "metrics.tls.certFile",
                                               config.metrics.tls.key_file, "metrics.tls.keyFile");
      if (!cert) return config_error(cert.error());
      m->cert_ = cert.value();
      m->server_ = std::make_unique<httplib::SSLServer>([c = m->cert_](SSL_CTX& ctx) { return c->configure(ctx); });
    } else {
      auto made = tls::make_self_signed("rdmig-controller", {"localhost", "127.0.0.1", "::1"}, 365);
      if (!made) return Error{Errc::kInternal, made.error().message};
      m->self_signed_ = std::move(made.value());
      LOG_INFO("controller") << "metrics: self-signed certificate made at start, SHA-256 " << m->self_signed_->fingerprint;
      m->server_ = std::make_unique<httplib::SSLServer>([s = &*m->self_signed_](SSL_CTX& ctx) { return s->configure(ctx); });
    }
    if (!m->server_->is_valid()) return Error{Errc::kInternal, "config key 'metrics.tls': cannot set up HTTPS with it"};
    // Reviews get a client of their own with a 10 s bound on each call (controller-runtime's
    // TokenAccessReviewTimeout), so a slow API server answers a scrape with 503, not a hang.
    k8s::HttpOptions review_options = http_options;
    review_options.call_timeout = std::chrono::seconds(10);
    auto made_kube = k8s::HttpKubeClient::create(cluster, review_options);
    if (!made_kube) return config_error(made_kube.error());
    m->review_kube_ = std::move(made_kube.value());
    m->auth_ = std::make_unique<MetricsAuth>(*m->review_kube_, config.metrics.auth_cache_entries);
    m->server_->set_pre_routing_handler([auth = m->auth_.get()](const httplib::Request& req, httplib::Response& res) {
      if (req.path != "/metrics") {
        send_json_error(res, 404, "this port serves GET /metrics only (probes: probes.port)");
        return httplib::Server::HandlerResponse::Handled;
      }
      const auto d = auth->check(req.get_header_value("Authorization"), req.path);
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
    m->server_ = std::make_unique<httplib::Server>();
  }
  m->server_->Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  m->port_ = bind_server(*m->server_, config.metrics.address, config.metrics.port);
  if (m->port_ <= 0) {
    return Error{Errc::kInternal, "config key 'metrics.port': cannot listen on " + config.metrics.address + ":" +
                                      std::to_string(config.metrics.port)};
  }
  return m;
}

}  // namespace rdmig::controller
