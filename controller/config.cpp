#include "controller/config.h"

#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <set>

#include "common/log.h"
#include "common/text.h"
#include "config/yaml_reader.h"
#include "k8s/selectors.h"

namespace rdmig::controller {

using namespace yaml_reader;

namespace {

// A DNS name the agents' certificates carry (RFC 1123 labels, lower case; "*." not allowed:
// it is the name checked, not a pattern).
Status check_server_name(const std::string& name) {
  const std::string key = "agents.tls.serverName";
  if (name.empty() || name.size() > 253) return bad(key, "must be a DNS name of 1 to 253 characters");
  size_t label = 0;
  for (size_t i = 0; i <= name.size(); ++i) {
    const char ch = i < name.size() ? name[i] : '.';
    if (ch == '.') {
      if (label == 0 || label > 63 || name[i - 1] == '-' || name[i - label] == '-') {
        return bad(key, "'" + name + "' is not a DNS name (labels of 1 to 63 of a-z, 0-9 and '-')");
      }
      label = 0;
    } else if ((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '-') {
      ++label;
    } else {
      return bad(key, "'" + name + "' is not a DNS name (labels of 1 to 63 of a-z, 0-9 and '-')");
    }
  }
  return ok_status();
}

}  // namespace

bool is_loopback_address(const std::string& address) {
  if (address == "localhost" || address == "::1") return true;
  // 127.0.0.0/8, written as a dotted quad
  unsigned a = 0, b = 0, c = 0, d = 0;
  char tail = 0;
  return std::sscanf(address.c_str(), "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4 && a == 127 && b < 256 &&
         c < 256 && d < 256;
}

Result<ControllerConfig> parse_controller_config(const std::string& yaml_text) {
  ControllerConfig c;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return Error{Errc::kInvalidArgument, std::string("config: not valid YAML: ") + e.what()};
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  try {
    RDMIG_TRY(check_keys(root, "", {"namespace", "watchNamespace", "agents", "maxConcurrentPerNode",
                                    "pollIntervalMs", "leaderElection", "metrics", "probes", "logLevel", "qemu", "kubevirt",
                                    "ttlSecondsAfterFinished"}));
    RDMIG_TRY(read_string(root, "", "namespace", c.namespace_));
    RDMIG_TRY(read_string(root, "", "watchNamespace", c.watch_namespace));
    if (const auto a = root["agents"]) {
      const std::string p = "agents";
      RDMIG_TRY(check_keys(a, p, {"labelSelector", "port", "portName", "tokenFile", "requestTimeoutSeconds",
                                  "unreachableTimeoutSeconds", "tls"}));
      RDMIG_TRY(read_string(a, p, "labelSelector", c.agents.label_selector));
      RDMIG_TRY(read_uint(a, p, "port", c.agents.port, 1, 65535));
      RDMIG_TRY(read_string(a, p, "portName", c.agents.port_name));
      RDMIG_TRY(read_string(a, p, "tokenFile", c.agents.token_file));
      RDMIG_TRY(read_uint(a, p, "requestTimeoutSeconds", c.agents.request_timeout_seconds, 1, 300));
      RDMIG_TRY(read_uint(a, p, "unreachableTimeoutSeconds", c.agents.unreachable_timeout_seconds, 1, 3600));
      if (const auto t = a["tls"]; t && !t.IsNull()) {
        const std::string tp = "agents.tls";
        if (!t.IsMap()) return bad(tp, "must be a map with caFile and serverName");
        RDMIG_TRY(check_keys(t, tp, {"caFile", "serverName"}));
        RDMIG_TRY(read_string(t, tp, "caFile", c.agents.tls.ca_file));
        RDMIG_TRY(read_string(t, tp, "serverName", c.agents.tls.server_name));
        if (c.agents.tls.ca_file.empty()) return bad("agents.tls.caFile", "must name the CA bundle that signed the agents' certificates");
        RDMIG_TRY(check_server_name(c.agents.tls.server_name));
      }
    }
    auto labels = k8s::parse_label_selector(c.agents.label_selector, "config key 'agents.labelSelector'");
    if (!labels) return labels.error();
    if (labels->empty()) return bad("agents.labelSelector", "must not be empty");
    c.agents.labels = labels.value();
    if (c.agents.token_file.empty()) return bad("agents.tokenFile", "must not be empty");
    RDMIG_TRY(read_uint(root, "", "maxConcurrentPerNode", c.max_concurrent_per_node, 1, 1000));
    RDMIG_TRY(read_uint(root, "", "pollIntervalMs", c.poll_interval_ms, 50, 60000));
    RDMIG_TRY(read_uint(root, "", "ttlSecondsAfterFinished", c.ttl_seconds_after_finished, 0, kMaxTtlSeconds));
    if (const auto q = root["qemu"]) {
      RDMIG_TRY(check_keys(q, "qemu", {"allowedNamespaces"}));
      if (const auto list = q["allowedNamespaces"]) {
        if (!list.IsSequence()) return bad("qemu.allowedNamespaces", "must be a list of namespaces (or [\"*\"])");
        for (const auto& item : list) {
          if (!item.IsScalar() || item.as<std::string>().empty()) {
            return bad("qemu.allowedNamespaces", "every entry must be a non-empty namespace name or \"*\"");
          }
          c.qemu.allowed_namespaces.push_back(item.as<std::string>());
        }
      }
    }
    if (const auto k = root["kubevirt"]) {
      const std::string p = "kubevirt";
      RDMIG_TRY(check_keys(k, p, {"enabled", "maxReportedVmis", "figuresWaitSeconds"}));
      RDMIG_TRY(read_bool(k, p, "enabled", c.kubevirt.enabled));
      RDMIG_TRY(read_uint(k, p, "maxReportedVmis", c.kubevirt.max_reported_vmis, 1, 100000));
      RDMIG_TRY(read_uint(k, p, "figuresWaitSeconds", c.kubevirt.figures_wait_seconds, 0, 600));
    }
    if (const auto l = root["leaderElection"]) {
      const std::string p = "leaderElection";
      RDMIG_TRY(check_keys(l, p, {"enabled", "leaseName", "identity", "leaseDurationSeconds",
                                  "renewDeadlineSeconds", "retryPeriodSeconds"}));
      auto& le = c.leader_election;
      RDMIG_TRY(read_bool(l, p, "enabled", le.enabled));
      RDMIG_TRY(read_string(l, p, "leaseName", le.lease_name));
      RDMIG_TRY(read_string(l, p, "identity", le.identity));
      RDMIG_TRY(read_seconds(l, p, "leaseDurationSeconds", le.lease_duration_seconds, 1, 3600));
      RDMIG_TRY(read_seconds(l, p, "renewDeadlineSeconds", le.renew_deadline_seconds, 0.5, 3600));
      RDMIG_TRY(read_seconds(l, p, "retryPeriodSeconds", le.retry_period_seconds, 0.1, 600));
      if (le.lease_name.empty()) return bad("leaderElection.leaseName", "must not be empty");
      if (le.renew_deadline_seconds >= le.lease_duration_seconds) {
        return bad("leaderElection.renewDeadlineSeconds", "must be less than leaseDurationSeconds");
      }
      if (le.retry_period_seconds >= le.renew_deadline_seconds) {
        return bad("leaderElection.retryPeriodSeconds", "must be less than renewDeadlineSeconds");
      }
    }
    if (const auto m = root["metrics"]) {
      RDMIG_TRY(check_keys(m, "metrics", {"secure", "address", "port", "tls", "authCacheEntries"}));
      RDMIG_TRY(read_bool(m, "metrics", "secure", c.metrics.secure));
      RDMIG_TRY(read_string(m, "metrics", "address", c.metrics.address));
      RDMIG_TRY(read_uint(m, "metrics", "port", c.metrics.port, 0, 65535));
      RDMIG_TRY(read_uint(m, "metrics", "authCacheEntries", c.metrics.auth_cache_entries, 1, 100000));
      if (const auto t = m["tls"]; t && !t.IsNull()) {
        const std::string tp = "metrics.tls";
        if (!t.IsMap()) return bad(tp, "must be a map with certFile and keyFile");
        RDMIG_TRY(check_keys(t, tp, {"certFile", "keyFile"}));
        RDMIG_TRY(read_string(t, tp, "certFile", c.metrics.tls.cert_file));
        RDMIG_TRY(read_string(t, tp, "keyFile", c.metrics.tls.key_file));
      }
    }
    if (c.metrics.tls.cert_file.empty() != c.metrics.tls.key_file.empty()) {
      return bad(c.metrics.tls.cert_file.empty() ? "metrics.tls.certFile" : "metrics.tls.keyFile",
                 "certFile and keyFile go together (both empty: a self-signed certificate made at start)");
    }
    if (!c.metrics.secure && !c.metrics.tls.cert_file.empty()) {
      return bad("metrics.tls", "is for metrics.secure: true; plain-HTTP metrics (secure: false) take no certificate");
    }
    if (c.metrics.address.empty()) c.metrics.address = c.metrics.secure ? "0.0.0.0" : "127.0.0.1";
    if (!c.metrics.secure && !is_loopback_address(c.metrics.address)) {
      return bad("metrics.address", "'" + c.metrics.address +
                                        "': plain-HTTP metrics (metrics.secure: false) are served on a loopback "
                                        "address only (127.0.0.1, ::1 or localhost); set metrics.secure: true to "
                                        "serve them to other hosts, authenticated");
    }
    if (const auto p = root["probes"]) {
      RDMIG_TRY(check_keys(p, "probes", {"address", "port"}));
      RDMIG_TRY(read_string(p, "probes", "address", c.probes.address));
      RDMIG_TRY(read_uint(p, "probes", "port", c.probes.port, 0, 65535));
    }
    if (c.probes.address.empty()) return bad("probes.address", "must not be empty");
    if (c.probes.port != 0 && c.probes.port == c.metrics.port) {
      return bad("probes.port", "must differ from metrics.port (" + std::to_string(c.metrics.port) + ")");
    }
    RDMIG_TRY(read_string(root, "", "logLevel", c.log_level));
    if (!log::parse_level(c.log_level)) {
      return bad("logLevel", "expected debug, info, warn or error, got '" + c.log_level + "'");
    }
  } catch (const YAML::Exception& e) {
    return Error{Errc::kInvalidArgument, std::string("config: ") + e.what()};
  }
  return c;
}

bool ControllerConfig::Qemu::allowed(const std::string& ns) const {
  for (const auto& a : allowed_namespaces) {
    if (a == "*" || a == ns) return true;
  }
  return false;
}

Result<ControllerConfig> load_controller_config_file(const std::string& path) {
  auto text = read_text_file(path, "config");
  if (!text) return text.error();
  return parse_controller_config(text.value());
}

}  // namespace rdmig::controller
