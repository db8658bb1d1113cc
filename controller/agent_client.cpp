#include "controller/agent_client.h"

#include <httplib.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>

#include <memory>

#include "common/text.h"
#include "tls/pem_files.h"

namespace rdmig::controller {

using nlohmann::json;

std::string AgentAddress::address() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

json AgentAddress::to_json() const { return json{{"node", node}, {"pod", pod}, {"address", address()}}; }

AgentAddress AgentAddress::from_json(const json& j) {
  AgentAddress a;
  a.node = j.value("node", "");
  a.pod = j.value("pod", "");
  const std::string addr = j.value("address", "");
  const auto colon = addr.rfind(':');
  if (colon != std::string::npos) {
    a.host = addr.substr(0, colon);
    if (a.host.size() >= 2 && a.host.front() == '[') a.host = a.host.substr(1, a.host.size() - 2);
    a.port = static_cast<uint16_t>(std::atoi(addr.substr(colon + 1).c_str()));
  }
  return a;
}

Result<AgentAddress> select_agent_pod(const json& pod_list, const std::string& node, const std::string& port_name,
                                      uint16_t default_port, bool draining_ok) {
  std::string seen;
  std::string draining;  // a Running agent pod being deleted: it drains
  if (pod_list.contains("items") && pod_list["items"].is_array()) {
    for (const auto& pod : pod_list["items"]) {
      const auto& md = pod.value("metadata", json::object());
      const auto& spec = pod.value("spec", json::object());
      const auto& st = pod.value("status", json::object());
      if (spec.value("nodeName", "") != node) continue;
      const std::string name = md.value("name", "");
      bool ready = false;
      for (const auto& c : st.value("conditions", json::array())) {
        if (c.value("type", "") == "Ready" && c.value("status", "") == "True") ready = true;
      }
      const std::string ip = st.value("podIP", "");
      const bool terminating = md.contains("deletionTimestamp");
      const bool running = st.value("phase", "") == "Running" && !ip.empty();
      if (terminating && running && draining.empty()) draining = name;
      if (!(running && (draining_ok ? (ready || terminating) : (ready && !terminating)))) {
        seen += (seen.empty() ? "" : ", ") + name + " (" + st.value("phase", "?") + (terminating ? ", terminating" : "") +
                (ready ? "" : ", not ready") + ")";
        continue;
      }
      AgentAddress a{node, name, ip, default_port};
      for (const auto& c : spec.value("containers", json::array())) {
        for (const auto& p : c.value("ports", json::array())) {
          if (p.value("name", "") == port_name && p.contains("containerPort") && p["containerPort"].is_number_integer()) {
            a.port = static_cast<uint16_t>(p["containerPort"].get<int>());
          }
        }
      }
      return a;
    }
  }
  if (!draining.empty()) {
    return Error{Errc::kUnavailable, "the rdmig-agent pod " + draining + " on node '" + node +
                                         "' is terminating: it drains (its running migrations finish) and takes no new "
                                         "work; waiting for its replacement"};
  }
  return Error{Errc::kNotFound, "no Running and Ready rdmig-agent pod on node '" + node + "'" +
                                    (seen.empty() ? "" : " (found: " + seen + ")")};
}

bool agent_draining(const Error& e) {
  return e.code == Errc::kUnavailable && e.message.starts_with("the rdmig-agent pod ") &&
         e.message.find(" is terminating: it drains") != std::string::npos;
}

AgentClient::AgentClient(std::string token, int timeout_seconds, std::function<void(const std::string&)> on_response)
    : AgentClient(TokenSource::fixed(std::move(token)), timeout_seconds, std::move(on_response)) {}

AgentClient::AgentClient(std::shared_ptr<TokenSource> token, int timeout_seconds,
                         std::function<void(const std::string&)> on_response, AgentTls tls)
    : token_(std::move(token)), timeout_seconds_(timeout_seconds), tls_(std::move(tls)),
      on_response_(std::move(on_response)) {}

namespace {
constexpr const char* kTlsMarker = ": TLS: ";
}  // namespace

bool AgentClient::is_tls_failure(const Error& e) {
  return e.code == Errc::kUnavailable && e.message.find(kTlsMarker) != std::string::npos;
}

Result<json> AgentClient::call(const AgentAddress& agent, const std::string& method, const std::string& path,
                               const json* body, std::string* reason) {
  std::unique_ptr<httplib::ClientImpl> made;
  httplib::SSLClient* ssl = nullptr;
  if (tls_.ca_file.empty()) {
    made = std::make_unique<httplib::ClientImpl>(agent.host, agent.port);
  } else {
    // Connect to the pod IP but speak to `server_name`: SNI and httplib's own name check use
    // the host name, the address map says where it is. OpenSSL checks the name as well
    // (X509_VERIFY_PARAM_set1_host), so a mismatch shows in the verify result.
    auto c = std::make_unique<httplib::SSLClient>(tls_.server_name, agent.port);
    c->set_hostname_addr_map({{tls_.server_name, agent.host}});
    c->set_ca_cert_path(tls_.ca_file.c_str());
    c->enable_server_certificate_verification(true);
    if (SSL_CTX* ctx = c->ssl_context()) {
      SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
      X509_VERIFY_PARAM* param = SSL_CTX_get0_param(ctx);
      X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
      X509_VERIFY_PARAM_set1_host(param, tls_.server_name.c_str(), 0);
    }
    ssl = c.get();
    made = std::move(c);
  }
  httplib::ClientImpl& client = *made;
  client.set_connection_timeout(std::chrono::seconds(std::min(timeout_seconds_, 5)));
  client.set_read_timeout(std::chrono::seconds(timeout_seconds_));
  client.set_write_timeout(std::chrono::seconds(timeout_seconds_));
  const std::string what = method + " " + path + " on agent " + agent.pod + " (" + agent.address() + ", node " +
                           agent.node + ")";
  auto send = [&](const std::string& token) {
    httplib::Headers headers{{"Authorization", "Bearer " + token}, {"Accept", "application/json"}};
    return method == "POST"  ? client.Post(path, headers, body->dump(-1, ' ', false, json::error_handler_t::replace),
                                           "application/json")
           : method == "GET" ? client.Get(path, headers)
                             : client.Delete(path, headers);
  };
  // Token rotation: this controller may see the new Secret before an agent does. An agent that
  // refuses the current token (401/403: it acted on nothing) is asked once more with the
  // previous one while that is within its grace period.
  const auto tokens = token_->accepted();
  httplib::Result res = send(tokens.front());
  if (res && (res->status == 401 || res->status == 403) && tokens.size() > 1) {
    on_response_(std::to_string(res->status));
    res = send(tokens[1]);
  }
  if (!res) {
    on_response_("error");
    // A failed handshake or certificate check: the request was never sent.
    if (auto tls_failure = tls_error(res.error(), ssl)) return Error{Errc::kUnavailable, what + kTlsMarker + *tls_failure};
    // Not connected: nothing reached the agent. Any other failure (read timeout, reset) came
    // after the request was sent: the agent may have acted on it (kTimeout).
    const Errc code = res.error() == httplib::Error::Connection ? Errc::kUnavailable : Errc::kTimeout;
    const bool maybe_https = ssl == nullptr && res.error() == httplib::Error::Read;
    return Error{code, what + ": " + httplib::to_string(res.error()) +
                           (maybe_https ? " (no HTTP answer: an agent serving HTTPS (api.tls) needs agents.tls here)" : "")};
  }
  on_response_(std::to_string(res->status));
  json parsed = json::parse(res->body, nullptr, false);
  if (res->status >= 200 && res->status < 300) {
    if (parsed.is_discarded() || !parsed.is_object()) return Error{Errc::kProtocol, what + ": reply is not a JSON object"};
    return parsed;
  }
  std::string message = "HTTP " + std::to_string(res->status);
  // A stable word for programs (bounded): {"error":{"reason":..}} (api::error_body).
  if (reason != nullptr && !parsed.is_discarded() && parsed.is_object() && parsed.contains("error") &&
      parsed["error"].is_object() && parsed["error"].contains("reason") && parsed["error"]["reason"].is_string()) {
    *reason = utf8_prefix(parsed["error"]["reason"].get<std::string>(), 64);
  }
  // The agent's own words (bounded): {"error":{"message":..}}, else the start of whatever it sent.
  if (!parsed.is_discarded() && parsed.is_object() && parsed.contains("error") && parsed["error"].is_object() &&
      parsed["error"].contains("message") && parsed["error"]["message"].is_string()) {
    message += ": " + utf8_prefix(parsed["error"]["message"].get<std::string>(), 1024);
  } else if (!trim(res->body).empty()) {
    message += " (body: " + utf8_prefix(trim(res->body), 256) + ")";
  }
  Errc code = Errc::kInternal;
  switch (res->status) {
    case 400: code = Errc::kInvalidArgument; break;
    case 401: code = Errc::kUnauthenticated; break;
    case 403: code = Errc::kPermissionDenied; break;
    case 404: code = Errc::kNotFound; break;
    case 409: code = Errc::kAlreadyExists; break;
    case 422: code = Errc::kUnprocessable; break;
    case 429: code = Errc::kResourceExhausted; break;
    case 503: code = Errc::kUnavailable; break;
    default: break;
  }
  return Error{code, what + ": " + message};
}

std::optional<std::string> AgentClient::tls_error(httplib::Error error, const httplib::SSLClient* ssl) const {
  if (ssl == nullptr) return std::nullopt;
  const std::string ca = "agents.tls.caFile '" + tls_.ca_file + "'";
  const std::string name = "agents.tls.serverName '" + tls_.server_name + "'";
  switch (error) {
    case httplib::Error::SSLLoadingCerts:
      return "cannot load the CA bundle " + ca;
    case httplib::Error::SSLConnection:
      return "handshake failed (is the agent serving HTTPS? its api.tls must be set when " + ca + " is)";
    case httplib::Error::SSLServerVerification: {
      const long v = ssl->get_openssl_verify_result();
      if (v == 0 || tls::is_hostname_mismatch(v)) {
        return "the agent's certificate does not carry the name " + name;
      }
      return "the agent's certificate is not trusted: " + tls::verify_error_text(v) + " (checked against " + ca + ")";
    }
    default:
      return std::nullopt;
  }
}

Result<json> AgentClient::create(const AgentAddress& agent, const json& body) {
  return call(agent, "POST", "/v1/migrations", &body);
}
Result<json> AgentClient::get(const AgentAddress& agent, const std::string& id) {
  return call(agent, "GET", "/v1/migrations/" + id, nullptr);
}
Result<json> AgentClient::cancel(const AgentAddress& agent, const std::string& id) {
  return call(agent, "DELETE", "/v1/migrations/" + id, nullptr);
}

Result<json> AgentClient::create_pathcheck(const AgentAddress& agent, const json& body) {
  return call(agent, "POST", "/v1/pathchecks", &body);
}
Result<json> AgentClient::get_pathcheck(const AgentAddress& agent, const std::string& id) {
  return call(agent, "GET", "/v1/pathchecks/" + id, nullptr);
}
Result<json> AgentClient::cancel_pathcheck(const AgentAddress& agent, const std::string& id) {
  return call(agent, "DELETE", "/v1/pathchecks/" + id, nullptr);
}

Result<json> AgentClient::kubevirt_migrations(const AgentAddress& agent, const std::string& migration_uid) {
  std::string q;
  for (char c : migration_uid) {  // a UID is [0-9a-f-]; keep anything else out of the URL
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-') q.push_back(c);
  }
  std::string reason;
  auto r = call(agent, "GET", "/v1/kubevirt/migrations?migrationUid=" + q, nullptr, &reason);
  if (!r) {
    if (r.error().code == Errc::kNotFound) {
      // The agent answers 404 with reason KubevirtModeOff when its KubeVirt mode is off
      // (src/api/rest_server.cpp); agents from before that field said so only in the message
      // "KubeVirt mode is off on this agent (kubevirt.enabled)", still read for an upgrade that
      // replaces agents node by node. Any other 404 is an agent older than the endpoint.
      if (reason == "KubevirtModeOff" || r.error().message.find("KubeVirt mode is off") != std::string::npos) {
        return Error{Errc::kFailedPrecondition, "agent " + agent.pod + ": KubeVirt mode is off"};
      }
      return json::array();
    }
    return r.error();
  }
  const json& items = r.value().value("items", json());
  if (!items.is_array()) return Error{Errc::kProtocol, "agent " + agent.pod + ": /v1/kubevirt/migrations: no items array"};
  return items;
}

}  // namespace rdmig::controller
