// What rdmig-controller checks and works out before anything starts (main.cpp wires the parts):
// the configuration and the files it names, the cluster to talk to, the namespace and identity,
// and the /metrics server (HTTPS with TokenReview and SubjectAccessReview: metrics_auth.h).
#pragma once

#include <httplib.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/result.h"
#include "common/token_source.h"
#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/metrics_auth.h"
#include "k8s/cluster_config.h"
#include "k8s/http_kube_client.h"
#include "tls/self_signed.h"
#include "tls/server_certificate.h"

namespace rdmig::controller {

// The configuration (empty path: every key's default) and what it names, checked: the agents'
// token file and CA bundle, the metrics certificate. Errors name the key (exit status 2).
struct Checked {
  ControllerConfig config;
  std::shared_ptr<TokenSource> agent_token;
  std::string agents_over;   // how the agents are called, for logs
  std::string metrics_over;  // how /metrics is served, for logs
};
Result<Checked> check_config(const std::string& config_path);

// The cluster (a kubeconfig file when `kubeconfig_path` is set, else in-cluster), and from it and
// the environment the namespace (config, $POD_NAMESPACE, the cluster's, rdmig-system) and this
// replica's identity for leader election (config, $POD_NAME, the host name; plus a random suffix).
struct Placement {
  k8s::ClusterConfig cluster;
  std::string identity;
};
Result<Placement> place(ControllerConfig& config, const std::string& kubeconfig_path, const std::string& context);

// The /metrics server, bound to metrics.address:port (the port, for port 0), serving `metrics`:
// HTTPS with every request's token reviewed by the API server; or, with metrics.secure false,
// plain HTTP on a loopback address (config.cpp refuses any other). Owns what it needs.
class MetricsServer {
 public:
  static Result<std::unique_ptr<MetricsServer>> create(const ControllerConfig& config, const k8s::ClusterConfig& cluster,
                                                       const k8s::HttpOptions& http_options, ControllerMetrics& metrics);
  int port() const { return port_; }
  void serve() { server_->listen_after_bind(); }
  void stop() { server_->stop(); }

 private:
  MetricsServer() = default;
  std::shared_ptr<tls::ServerCertificate> cert_;
  std::optional<tls::SelfSigned> self_signed_;
  std::unique_ptr<k8s::HttpKubeClient> review_kube_;
  std::unique_ptr<MetricsAuth> auth_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = -1;
};

// The probes (/healthz, /readyz: `ready`), plain HTTP without authentication (the kubelet sends
// no token), bound to probes.address:port.
class ProbeServer {
 public:
  static Result<std::unique_ptr<ProbeServer>> create(const ControllerConfig& config, std::function<bool()> ready);
  int port() const { return port_; }
  void serve() { server_.listen_after_bind(); }
  void stop() { server_.stop(); }

 private:
  ProbeServer() = default;
  httplib::Server server_;
  int port_ = -1;
};

// Binds `server` to address:port (0 = any free port); the port, or -1.
int bind_server(httplib::Server& server, const std::string& address, uint16_t port);

// The API path of a custom resource's objects of rdmig.io/v1alpha1 (`plural`), in every namespace
// or in `watch_namespace` alone.
std::string collection(const std::string& watch_namespace, const std::string& plural);

}  // namespace rdmig::controller
