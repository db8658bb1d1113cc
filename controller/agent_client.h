// The controller's side of the agents' REST API (/v1/migrations), and finding the agent pod
// on a node. Every response (or connection failure) is reported to `on_response` for the
// rdmig_controller_agent_requests_total{code} metric.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/result.h"
#include "common/token_source.h"

namespace httplib {
class SSLClient;
enum class Error;
}  // namespace httplib

namespace rdmig::controller {

struct AgentAddress {
  std::string node;
  std::string pod;
  std::string host;  // pod IP (agents run with hostNetwork)
  uint16_t port = 0;
  std::string address() const;  // host:port ([v6]:port)
  nlohmann::json to_json() const;
  static AgentAddress from_json(const nlohmann::json& j);
};

// Picks a Running, Ready, not-deleting pod on `node` from a PodList; the port is the
// container port named `port_name`, else `default_port`. When the node's only Running agent pod
// is terminating (it drains after SIGTERM: its running work finishes, it takes no new work),
// kUnavailable naming it (new work waits for its replacement); kNotFound naming the node when
// there is none. `draining_ok`: a terminating Running pod is picked too (reading what it carries).
Result<AgentAddress> select_agent_pod(const nlohmann::json& pod_list, const std::string& node,
                                      const std::string& port_name, uint16_t default_port,
                                      bool draining_ok = false);
// True for select_agent_pod's "the node's agent drains" answer (not an API server outage,
// which is kUnavailable too).
bool agent_draining(const Error& e);

// HTTPS to the agents: the chain is checked against the CA bundle in `ca_file` (read on every
// call, so a renewed bundle is picked up) and the certificate must carry `server_name`; the
// agent's IP is only where to connect. Empty `ca_file`: plain HTTP.
struct AgentTls {
  std::string ca_file;
  std::string server_name;
};

// Errors: kUnavailable when no connection was made (nothing reached the agent; this includes a
// TLS handshake or certificate check that failed, whose message says "TLS: " and names the
// config key to look at), kTimeout when the request went out but no answer came (the agent may
// have acted on it), else by HTTP status (404 kNotFound, ...) with the agent's error message; a
// 2xx reply that is not a JSON object is kProtocol.
class AgentClient {
 public:
  // `code` is the HTTP status as text, or "error" when no response came.
  AgentClient(std::string token, int timeout_seconds, std::function<void(const std::string& code)> on_response);
  // The token follows its file (agents.tokenFile): a rotated Secret is used without a restart.
  AgentClient(std::shared_ptr<TokenSource> token, int timeout_seconds,
              std::function<void(const std::string& code)> on_response, AgentTls tls = {});

  // True for the errors of a failed TLS handshake or certificate check (the reconciler names
  // them AgentTLSFailed rather than AgentUnreachable).
  static bool is_tls_failure(const Error& e);

  Result<nlohmann::json> create(const AgentAddress& agent, const nlohmann::json& body);
  Result<nlohmann::json> get(const AgentAddress& agent, const std::string& id);
  Result<nlohmann::json> cancel(const AgentAddress& agent, const std::string& id);
  // /v1/pathchecks (docs/pathcheck.md): the same agents, token and TLS.
  Result<nlohmann::json> create_pathcheck(const AgentAddress& agent, const nlohmann::json& body);
  Result<nlohmann::json> get_pathcheck(const AgentAddress& agent, const std::string& id);
  Result<nlohmann::json> cancel_pathcheck(const AgentAddress& agent, const std::string& id);
  // GET /v1/kubevirt/migrations?migrationUid=<uid>: the agent's records of one KubeVirt
  // migration (the "items" array). An agent without the endpoint (404) has none: empty array.
  Result<nlohmann::json> kubevirt_migrations(const AgentAddress& agent, const std::string& migration_uid);

 private:
  // `reason` (optional) gets the agent's error.reason of a refused call, "" when it sent none.
  Result<nlohmann::json> call(const AgentAddress& agent, const std::string& method, const std::string& path,
                              const nlohmann::json* body, std::string* reason = nullptr);
  // The message of a TLS failure of a call made with `ssl`; nullopt for other failures.
  std::optional<std::string> tls_error(httplib::Error error, const httplib::SSLClient* ssl) const;
  std::shared_ptr<TokenSource> token_;
  int timeout_seconds_;
  AgentTls tls_;
  std::function<void(const std::string&)> on_response_;
};

}  // namespace rdmig::controller
