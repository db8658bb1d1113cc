#include "config/agent_config.h"

#include <yaml-cpp/yaml.h>

#include <limits>
#include <set>

#include "common/log.h"
#include "common/text.h"
#include "common/units.h"
#include "config/yaml_reader.h"

namespace rdmig {

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto: return "auto";
    case TransportKind::kRdma: return "rdma";
    case TransportKind::kTcp: return "tcp";
  }
  return "?";
}

Result<TransportKind> parse_transport(const std::string& text, const std::string& field) {
  if (text == "auto") return TransportKind::kAuto;
  if (text == "rdma") return TransportKind::kRdma;
  if (text == "tcp") return TransportKind::kTcp;
  return Error{Errc::kInvalidArgument,
               field + ": unknown transport '" + text + "' (expected auto, rdma or tcp)"};
}

namespace {

using namespace yaml_reader;

Status parse_into(const YAML::Node& root, AgentConfig& c) {
  RDMIG_TRY(check_keys(root, "", {"api", "dataPlane", "transport", "migration", "rdma",
                                  "stateDir", "logLevel"}));
  if (const auto api = root["api"]) {
    RDMIG_TRY(check_keys(api, "api", {"address", "port", "tokenFile", "maxBodyBytes"}));
    RDMIG_TRY(read_string(api, "api", "address", c.api.address));
    RDMIG_TRY(read_uint(api, "api", "port", c.api.port, 0, 65535));
    RDMIG_TRY(read_string(api, "api", "tokenFile", c.api.token_file));
    RDMIG_TRY(read_uint(api, "api", "maxBodyBytes", c.api.max_body_bytes, 1024, 16 * kMiB));
    if (c.api.token_file.empty()) return bad("api.tokenFile", "must name the file holding the API token");
  }
  if (const auto dp = root["dataPlane"]) {
    RDMIG_TRY(check_keys(dp, "dataPlane", {"address", "port", "rdmaPort", "advertiseAddress"}));
    RDMIG_TRY(read_uint(dp, "dataPlane", "rdmaPort", c.data_plane.rdma_port, 0, 65535));
    RDMIG_TRY(read_string(dp, "dataPlane", "address", c.data_plane.address));
    RDMIG_TRY(read_uint(dp, "dataPlane", "port", c.data_plane.port, 0, 65535));
    RDMIG_TRY(read_string(dp, "dataPlane", "advertiseAddress", c.data_plane.advertise_address));
  }
  if (const auto t = root["transport"]) {
    if (!t.IsScalar()) return bad("transport", "expected auto, rdma or tcp");
    auto kind = parse_transport(t.as<std::string>(), "config key 'transport'");
    if (!kind) return kind.error();
    c.transport = kind.value();
  }
  if (const auto m = root["migration"]) {
    RDMIG_TRY(check_keys(m, "migration",
                         {"chunkSize", "ringDepth", "progressIntervalMs", "noProgressTimeoutSeconds",
                          "completionTimeoutSeconds", "maxConcurrent", "historySize"}));
    if (const auto cs = m["chunkSize"]) {
      if (!cs.IsScalar()) return bad("migration.chunkSize", "expected a size like 4Mi");
      auto v = parse_bytes(cs.as<std::string>(), "config key 'migration.chunkSize'");
      if (!v) return v.error();
      RDMIG_TRY(validate_chunk_size(v.value(), "config key 'migration.chunkSize'"));
      c.migration.chunk_size = v.value();
    }
    RDMIG_TRY(read_uint(m, "migration", "ringDepth", c.migration.ring_depth, 2, 1024));
    RDMIG_TRY(read_uint(m, "migration", "progressIntervalMs", c.migration.progress_interval_ms, 50, 10000));
    RDMIG_TRY(read_uint(m, "migration", "noProgressTimeoutSeconds",
                        c.migration.no_progress_timeout_seconds, 5, 86400));
    RDMIG_TRY(read_uint(m, "migration", "completionTimeoutSeconds",
                        c.migration.completion_timeout_seconds, 10, 7 * 86400));
    RDMIG_TRY(read_uint(m, "migration", "maxConcurrent", c.migration.max_concurrent, 1, 64));
    RDMIG_TRY(read_uint(m, "migration", "historySize", c.migration.history_size, 1, 10000));
  }
  if (const auto r = root["rdma"]) {
    RDMIG_TRY(check_keys(r, "rdma", {"device", "netdev", "resourceEnv"}));
    RDMIG_TRY(read_string(r, "rdma", "device", c.rdma.device));
    RDMIG_TRY(read_string(r, "rdma", "netdev", c.rdma.netdev));
    RDMIG_TRY(read_string(r, "rdma", "resourceEnv", c.rdma.resource_env));
  }
  RDMIG_TRY(read_string(root, "", "stateDir", c.state_dir));
  if (c.state_dir.empty() || c.state_dir.front() != '/') {
    return bad("stateDir", "must be an absolute path, got '" + c.state_dir + "'");
  }
  // QEMU-side unix socket paths are <stateDir>/<id>.sock; sun_path holds 107 bytes.
  if (c.state_dir.size() > 40) return bad("stateDir", "must be at most 40 characters (unix socket paths)");
  RDMIG_TRY(read_string(root, "", "logLevel", c.log_level));
  if (!log::parse_level(c.log_level)) {
    return bad("logLevel", "expected debug, info, warn or error, got '" + c.log_level + "'");
  }
  return ok_status();
}

}  // namespace

Result<AgentConfig> parse_agent_config(const std::string& yaml_text) {
  AgentConfig config;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return Error{Errc::kInvalidArgument, std::string("config is not valid YAML: ") + e.what()};
  }
  if (root.IsNull()) return config;  // empty file: all defaults
  try {
    if (auto st = parse_into(root, config); !st) return st.error();
  } catch (const YAML::Exception& e) {
    return Error{Errc::kInvalidArgument, std::string("config: ") + e.what()};
  }
  return config;
}

Result<AgentConfig> load_agent_config_file(const std::string& path) {
  auto text = read_text_file(path, "config");
  if (!text) return text.error();
  auto r = parse_agent_config(text.value());
  if (!r) return r.error().with_context(path);
  return r;
}

}  // namespace rdmig
