// How to reach the API server: from a kubeconfig (running outside a cluster) or from the
// pod's service account (in-cluster). Pure parsing; no network.
#pragma once

#include <map>
#include <string>

#include "common/result.h"

namespace rdmig::k8s {

struct ClusterConfig {
  std::string server;        // https://host:port or http://host:port
  std::string ca_file;       // PEM bundle path (certificate-authority, in-cluster ca.crt)
  std::string ca_data;       // PEM text (certificate-authority-data, decoded)
  bool insecure_skip_tls_verify = false;
  std::string token;         // bearer token (kubeconfig user.token)
  std::string token_file;    // re-read on use: projected service-account tokens rotate
  std::string client_cert_file, client_key_file;
  std::string client_cert_data, client_key_data;  // PEM text (decoded)
  std::string namespace_;    // in-cluster: the pod's namespace; kubeconfig: the context's
};

// Parses kubeconfig YAML text. `context` empty = current-context. Relative file paths are
// resolved against `base_dir` (the kubeconfig's directory). Errors name the key.
Result<ClusterConfig> parse_kubeconfig(const std::string& yaml_text, const std::string& base_dir,
                                       const std::string& context = "");
Result<ClusterConfig> load_kubeconfig_file(const std::string& path, const std::string& context = "");

// In-cluster: KUBERNETES_SERVICE_HOST/PORT from `env`, token/ca.crt/namespace in `sa_dir`
// (normally /var/run/secrets/kubernetes.io/serviceaccount).
Result<ClusterConfig> in_cluster_config(const std::map<std::string, std::string>& env,
                                        const std::string& sa_dir);

// RFC 4648 base64 (whitespace ignored). kInvalidArgument naming `field` on bad input.
Result<std::string> base64_decode(const std::string& text, const std::string& field);

struct ServerAddress {
  bool tls = true;
  std::string host;
  int port = 443;
  std::string base_path;  // e.g. "/k8s" when the server URL has a path
};
Result<ServerAddress> parse_server_url(const std::string& url);

}  // namespace rdmig::k8s
