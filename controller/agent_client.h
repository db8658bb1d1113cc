// The controller's side of the agents' REST API (/v1/migrations), and finding the agent pod
// on a node. Every response (or connection failure) is reported to `on_response` for the
// rdmig_controller_agent_requests_total{code} metric.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "common/result.h"
#include "common/token_source.h"

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
// container port named `port_name`, else `default_port`. kNotFound naming the node otherwise.
Result<AgentAddress> select_agent_pod(const nlohmann::json& pod_list, const std::string& node,
                                      const std::string& port_name, uint16_t default_port);

// Errors: kUnavailable when no connection was made (nothing reached the agent), kTimeout when
// the request went out but no answer came (the agent may have acted on it), else by HTTP status
// (404 kNotFound, ...) with the agent's error message; a 2xx reply that is not a JSON object is
// kProtocol.
class AgentClient {
 public:
  // `code` is the HTTP status as text, or "error" when no response came.
  AgentClient(std::string token, int timeout_seconds, std::function<void(const std::string& code)> on_response);
  // The token follows its file (agents.tokenFile): a rotated Secret is used without a restart.
  AgentClient(std::shared_ptr<TokenSource> token, int timeout_seconds,
              std::function<void(const std::string& code)> on_response);

  Result<nlohmann::json> create(const AgentAddress& agent, const nlohmann::json& body);
  Result<nlohmann::json> get(const AgentAddress& agent, const std::string& id);
  Result<nlohmann::json> cancel(const AgentAddress& agent, const std::string& id);
  // GET /v1/kubevirt/migrations?migrationUid=<uid>: the agent's records of one KubeVirt
  // migration (the "items" array). An agent without the endpoint (404) has none: empty array.
  Result<nlohmann::json> kubevirt_migrations(const AgentAddress& agent, const std::string& migration_uid);

 private:
  Result<nlohmann::json> call(const AgentAddress& agent, const std::string& method, const std::string& path,
                              const nlohmann::json* body);
  std::shared_ptr<TokenSource> token_;
  int timeout_seconds_;
  std::function<void(const std::string&)> on_response_;
};

}  // namespace rdmig::controller
