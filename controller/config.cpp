#include "controller/config.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <set>
#include <sstream>

#include "common/log.h"
#include "k8s/selectors.h"

namespace rdmig::controller {

namespace {

Error bad(const std::string& key, const std::string& what) {
  return Error{Errc::kInvalidArgument, "config key '" + key + "': " + what};
}

std::string join(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

Status check_keys(const YAML::Node& node, const std::string& prefix, const std::set<std::string>& allowed) {
  if (!node.IsMap()) return bad(prefix.empty() ? "<root>" : prefix, "expected a mapping");
  for (const auto& kv : node) {
    const auto key = kv.first.as<std::string>();
    if (!allowed.contains(key)) {
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      return bad(join(prefix, key), "unknown key (known here: " + list + ")");
    }
  }
  return ok_status();
}

Status read_string(const YAML::Node& parent, const std::string& prefix, const char* key, std::string& out) {
  const auto n = parent[key];
  if (!n || n.IsNull()) return ok_status();
  if (!n.IsScalar()) return bad(join(prefix, key), "expected a string");
  out = n.as<std::string>();
  return ok_status();
}

template <typename T>
Status read_uint(const YAML::Node& parent, const std::string& prefix, const char* key, T& out, uint64_t min,
                 uint64_t max) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string k = join(prefix, key);
  const std::string text = n.IsScalar() ? n.as<std::string>() : "";
  if (text.empty() || text.size() > 12 || text.find_first_not_of("0123456789") != std::string::npos) {
    return bad(k, "expected a non-negative integer, got '" + text + "'");
  }
  const uint64_t v = std::stoull(text);
  if (v < min || v > max) {
    return bad(k, "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got " + text);
  }
  out = static_cast<T>(v);
  return ok_status();
}

Status read_seconds(const YAML::Node& parent, const std::string& prefix, const char* key, double& out, double min,
                    double max) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string k = join(prefix, key);
  double v = 0;
  try {
    v = n.as<double>();
  } catch (const YAML::Exception&) {
    return bad(k, "expected a number of seconds");
  }
  if (!(v >= min && v <= max)) {
    return bad(k, "must be between " + std::to_string(min) + " and " + std::to_string(max));
  }
  out = v;
  return ok_status();
}

Status read_bool(const YAML::Node& parent, const std::string& prefix, const char* key, bool& out) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string text = n.IsScalar() ? n.as<std::string>() : "";
  if (text == "true") out = true;
  else if (text == "false") out = false;
  else return bad(join(prefix, key), "expected true or false, got '" + text + "'");
  return ok_status();
}

}  // namespace

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
                                    "pollIntervalMs", "leaderElection", "metrics", "logLevel"}));
    RDMIG_TRY(read_string(root, "", "namespace", c.namespace_));
    RDMIG_TRY(read_string(root, "", "watchNamespace", c.watch_namespace));
    if (const auto a = root["agents"]) {
      const std::string p = "agents";
      RDMIG_TRY(check_keys(a, p, {"labelSelector", "port", "portName", "tokenFile", "requestTimeoutSeconds",
                                  "unreachableTimeoutSeconds"}));
      RDMIG_TRY(read_string(a, p, "labelSelector", c.agents.label_selector));
      RDMIG_TRY(read_uint(a, p, "port", c.agents.port, 1, 65535));
      RDMIG_TRY(read_string(a, p, "portName", c.agents.port_name));
      RDMIG_TRY(read_string(a, p, "tokenFile", c.agents.token_file));
      RDMIG_TRY(read_uint(a, p, "requestTimeoutSeconds", c.agents.request_timeout_seconds, 1, 300));
      RDMIG_TRY(read_uint(a, p, "unreachableTimeoutSeconds", c.agents.unreachable_timeout_seconds, 1, 3600));
    }
    auto labels = k8s::parse_label_selector(c.agents.label_selector, "config key 'agents.labelSelector'");
    if (!labels) return labels.error();
    if (labels->empty()) return bad("agents.labelSelector", "must not be empty");
    c.agents.labels = labels.value();
    if (c.agents.token_file.empty()) return bad("agents.tokenFile", "must not be empty");
    RDMIG_TRY(read_uint(root, "", "maxConcurrentPerNode", c.max_concurrent_per_node, 1, 1000));
    RDMIG_TRY(read_uint(root, "", "pollIntervalMs", c.poll_interval_ms, 50, 60000));
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
      RDMIG_TRY(check_keys(m, "metrics", {"address", "port"}));
      RDMIG_TRY(read_string(m, "metrics", "address", c.metrics.address));
      RDMIG_TRY(read_uint(m, "metrics", "port", c.metrics.port, 0, 65535));
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

Result<ControllerConfig> load_controller_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Error{Errc::kNotFound, "config: cannot read '" + path + "'"};
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_controller_config(ss.str());
}

}  // namespace rdmig::controller
