#include "config/agent_config.h"

#include <arpa/inet.h>
#include <yaml-cpp/yaml.h>

#include <cstring>
#include <limits>
#include <set>

#include "common/log.h"
#include "common/text.h"
#include "common/units.h"
#include "config/yaml_reader.h"

namespace rdmig {

namespace {

using namespace yaml_reader;

bool is_ip_address(const std::string& text) {
  unsigned char buf[16];
  return inet_pton(AF_INET, text.c_str(), buf) == 1 || inet_pton(AF_INET6, text.c_str(), buf) == 1;
}

// Whether two address literals name one address, however spelled ("fd00::1" and "fd00:0:0::1";
// "10.0.0.1" and "::ffff:10.0.0.1").
bool same_address(const std::string& a, const std::string& b) {
  auto parse = [](const std::string& text, in6_addr& out) {
    in_addr v4{};
    if (inet_pton(AF_INET, text.c_str(), &v4) == 1) {
      out = in6_addr{};
      out.s6_addr[10] = out.s6_addr[11] = 0xff;
      std::memcpy(&out.s6_addr[12], &v4, 4);
      return true;
    }
    return inet_pton(AF_INET6, text.c_str(), &out) == 1;
  };
  in6_addr x{}, y{};
  return parse(a, x) && parse(b, y) && std::memcmp(&x, &y, sizeof x) == 0;
}

Status read_string_list(const YAML::Node& parent, const std::string& prefix, const char* key,
                        std::vector<std::string>& out, size_t max_items) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string name = join(prefix, key);
  if (!n.IsSequence()) return bad(name, "expected a list");
  if (n.size() > max_items) return bad(name, "at most " + std::to_string(max_items) + " entries");
  out.clear();
  for (const auto& item : n) {
    if (!item.IsScalar()) return bad(name, "expected a list of strings");
    out.push_back(item.as<std::string>());
  }
  return ok_status();
}

Status parse_kubevirt(const YAML::Node& k, KubevirtConfig& c) {
  RDMIG_TRY(check_keys(k, "kubevirt",
                       {"enabled", "hookSocket", "nodeName", "handlerProcess", "launcherProgram", "libvirtSockets",
                        "ruleTimeoutSeconds", "sessionIdleSeconds", "probeIntervalSeconds", "heartbeatTimeoutSeconds",
                        "multifdOnFailure", "ringDepth", "staticMode", "peers",
                        "discovery", "kubeconfig", "agentNamespace", "agentSelector", "handlerNamespace",
                        "handlerSelector", "discoveryIntervalSeconds", "socketMark", "socketMarkMask",
                        "plaintextMigrations", "carryPostCopy"}));
  RDMIG_TRY(read_bool(k, "kubevirt", "carryPostCopy", c.carry_post_copy));
  RDMIG_TRY(read_string(k, "kubevirt", "plaintextMigrations", c.plaintext_migrations));
  if (c.plaintext_migrations != "carry" && c.plaintext_migrations != "refuse") {
    return bad("kubevirt.plaintextMigrations", "expected carry or refuse, got '" + c.plaintext_migrations + "'");
  }
  RDMIG_TRY(read_string(k, "kubevirt", "discovery", c.discovery));
  if (c.discovery != "static" && c.discovery != "kubernetes") {
    return bad("kubevirt.discovery", "expected static or kubernetes, got '" + c.discovery + "'");
  }
  RDMIG_TRY(read_string(k, "kubevirt", "kubeconfig", c.kubeconfig));
  RDMIG_TRY(read_string(k, "kubevirt", "agentNamespace", c.agent_namespace));
  RDMIG_TRY(read_string(k, "kubevirt", "agentSelector", c.agent_selector));
  RDMIG_TRY(read_string(k, "kubevirt", "handlerNamespace", c.handler_namespace));
  RDMIG_TRY(read_string(k, "kubevirt", "handlerSelector", c.handler_selector));
  RDMIG_TRY(read_uint(k, "kubevirt", "discoveryIntervalSeconds", c.discovery_interval_seconds, 5, 3600));
  RDMIG_TRY(read_bool(k, "kubevirt", "enabled", c.enabled));
  RDMIG_TRY(read_string(k, "kubevirt", "hookSocket", c.hook_socket));
  if (!c.hook_socket.empty() && (c.hook_socket.front() != '/' || c.hook_socket.size() > 100)) {
    return bad("kubevirt.hookSocket", "must be an absolute path of at most 100 characters (or empty: no hook)");
  }
  RDMIG_TRY(read_string(k, "kubevirt", "nodeName", c.node_name));
  RDMIG_TRY(read_string(k, "kubevirt", "handlerProcess", c.handler_process));
  if (c.handler_process.empty() || c.handler_process.size() > 15) {
    return bad("kubevirt.handlerProcess", "must be a process name of 1..15 characters (/proc/<pid>/comm)");
  }
  RDMIG_TRY(read_string(k, "kubevirt", "launcherProgram", c.launcher_program));
  RDMIG_TRY(read_string_list(k, "kubevirt", "libvirtSockets", c.libvirt_sockets, 8));
  for (const auto& s : c.libvirt_sockets) {
    if (s.empty() || s.front() != '/' || s.size() > 80) {
      return bad("kubevirt.libvirtSockets", "entries must be absolute paths of at most 80 characters");
    }
  }
  RDMIG_TRY(read_uint(k, "kubevirt", "ruleTimeoutSeconds", c.rule_timeout_seconds, 3, 3600));
  RDMIG_TRY(read_uint(k, "kubevirt", "sessionIdleSeconds", c.session_idle_seconds, 1, 600));
  RDMIG_TRY(read_uint(k, "kubevirt", "probeIntervalSeconds", c.probe_interval_seconds, 1, 3600));
  RDMIG_TRY(read_uint(k, "kubevirt", "heartbeatTimeoutSeconds", c.heartbeat_timeout_seconds, 2, 300));
  RDMIG_TRY(read_string(k, "kubevirt", "multifdOnFailure", c.multifd_on_failure));
  if (c.multifd_on_failure != "auto" && c.multifd_on_failure != "drain" && c.multifd_on_failure != "reset") {
    return bad("kubevirt.multifdOnFailure", "expected auto, drain or reset, got '" + c.multifd_on_failure + "'");
  }
  RDMIG_TRY(read_uint(k, "kubevirt", "ringDepth", c.ring_depth, 0, 1024));
  if (c.ring_depth == 1) return bad("kubevirt.ringDepth", "expected 0 (by migration.chunkSize) or 2..1024, got 1");
  RDMIG_TRY(read_bool(k, "kubevirt", "staticMode", c.static_mode));
  RDMIG_TRY(read_uint(k, "kubevirt", "socketMark", c.socket_mark, 1, 0xFFFFFFFFu));
  RDMIG_TRY(read_uint(k, "kubevirt", "socketMarkMask", c.socket_mark_mask, 1, 0xFFFFFFFFu));
  if ((c.socket_mark & ~c.socket_mark_mask) != 0) {
    return bad("kubevirt.socketMark", "has bits outside kubevirt.socketMarkMask");
  }
  if ((c.socket_mark_mask & 0xC000u) != 0) {
    return bad("kubevirt.socketMarkMask", "overlaps kube-proxy's masquerade (0x4000) or drop (0x8000) mark bits");
  }
  if (const auto peers = k["peers"]) {
    if (!peers.IsSequence()) return bad("kubevirt.peers", "expected a list of {node, agent, handlerAddresses}");
    if (peers.size() > 4096) return bad("kubevirt.peers", "at most 4096 peers");
    c.peers.clear();
    for (size_t i = 0; i < peers.size(); ++i) {
      const std::string prefix = "kubevirt.peers[" + std::to_string(i) + "]";
      const auto p = peers[i];
      if (!p.IsMap()) return bad(prefix, "expected {node, agent, handlerAddresses}");
      RDMIG_TRY(check_keys(p, prefix, {"node", "agent", "handlerAddresses"}));
      KubevirtPeer peer;
      RDMIG_TRY(read_string(p, prefix, "node", peer.node));
      RDMIG_TRY(read_string(p, prefix, "agent", peer.agent));
      RDMIG_TRY(read_string_list(p, prefix, "handlerAddresses", peer.handler_addresses, 16));
      if (peer.node.empty()) return bad(prefix + ".node", "required");
      if (peer.agent.empty()) return bad(prefix + ".agent", "required (host:port of the peer's data plane)");
      c.peers.push_back(std::move(peer));
    }
  }
  return ok_status();
}

// A DNS-1123 label (a namespace) or subdomain (a NetworkAttachmentDefinition's name).
bool is_dns_name(const std::string& s, size_t max, bool dots) {
  if (s.empty() || s.size() > max) return false;
  const auto alnum = [](char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9'); };
  if (!alnum(s.front()) || !alnum(s.back())) return false;
  for (const char ch : s) {
    if (!alnum(ch) && ch != '-' && !(dots && ch == '.')) return false;
  }
  return true;
}

// rdma.network: "<namespace>/<name>" or "<name>", as the k8s.v1.cni.cncf.io/networks annotation
// names a NetworkAttachmentDefinition (no "@interface": the agent reads the interface Multus chose).
bool is_network_name(const std::string& s) {
  const auto slash = s.find('/');
  if (slash == std::string::npos) return is_dns_name(s, 253, true);
  return is_dns_name(s.substr(0, slash), 63, false) && is_dns_name(s.substr(slash + 1), 253, true);
}

// Sizes given as a quantity ("64Gi") or a count; errors name `prefix.key`.
Status read_size(const YAML::Node& parent, const std::string& prefix, const char* key, uint64_t& out, uint64_t min,
                 uint64_t max) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string name = join(prefix, key);
  if (!n.IsScalar()) return bad(name, "expected a size like 1Gi");
  auto v = parse_bytes(n.as<std::string>(), "config key '" + name + "'");
  if (!v) return v.error();
  if (v.value() < min || v.value() > max) {
    return bad(name, "must be between " + format_quantity(min) + " and " + format_quantity(max) + ", got " +
                         format_quantity(v.value()));
  }
  out = v.value();
  return ok_status();
}

Status parse_path_check(const YAML::Node& p, PathCheckConfig& c) {
  RDMIG_TRY(check_keys(p, "pathCheck",
                       {"maxConcurrent", "historySize", "defaultBytes", "maxBytes", "maxChannels",
                        "defaultTimeoutSeconds", "maxTimeoutSeconds", "stallTimeoutSeconds", "rttSamples"}));
  RDMIG_TRY(read_uint(p, "pathCheck", "maxConcurrent", c.max_concurrent, 1, 64));
  RDMIG_TRY(read_uint(p, "pathCheck", "historySize", c.history_size, 1, 10000));
  RDMIG_TRY(read_size(p, "pathCheck", "maxBytes", c.max_bytes, 1, uint64_t{1} << 40));
  RDMIG_TRY(read_size(p, "pathCheck", "defaultBytes", c.default_bytes, 1, uint64_t{1} << 40));
  if (c.default_bytes > c.max_bytes) {
    return bad("pathCheck.defaultBytes", format_quantity(c.default_bytes) + " is over pathCheck.maxBytes (" +
                                             format_quantity(c.max_bytes) + ")");
  }
  // A check's channels are data-plane channels: at most 1 + 64 multifd, as for a migration.
  RDMIG_TRY(read_uint(p, "pathCheck", "maxChannels", c.max_channels, 1, 64));
  RDMIG_TRY(read_uint(p, "pathCheck", "maxTimeoutSeconds", c.max_timeout_seconds, 5, 86400));
  RDMIG_TRY(read_uint(p, "pathCheck", "defaultTimeoutSeconds", c.default_timeout_seconds, 5, 86400));
  if (c.default_timeout_seconds > c.max_timeout_seconds) {
    return bad("pathCheck.defaultTimeoutSeconds", std::to_string(c.default_timeout_seconds) +
                                                      " is over pathCheck.maxTimeoutSeconds (" +
                                                      std::to_string(c.max_timeout_seconds) + ")");
  }
  RDMIG_TRY(read_uint(p, "pathCheck", "stallTimeoutSeconds", c.stall_timeout_seconds, 1, 3600));
  RDMIG_TRY(read_uint(p, "pathCheck", "rttSamples", c.rtt_samples, 1, 100));
  return ok_status();
}

// The keys of one rail (rdma, or rdma.devices[i]); errors name `prefix.key`.
Status parse_rdma_rail(const YAML::Node& r, const std::string& prefix, RdmaRailConfig& rail) {
  RDMIG_TRY(read_string(r, prefix, "network", rail.network));
  if (!rail.network.empty()) {
    if (!is_network_name(rail.network)) {
      return bad(prefix + ".network", "expected a NetworkAttachmentDefinition as <namespace>/<name> or <name> "
                                      "(lower-case DNS names, no @interface), got '" + rail.network + "'");
    }
    for (const char* key : {"device", "netdev", "address", "resourceEnv"}) {
      if (const auto v = r[key]; v && v.IsScalar() && !v.as<std::string>().empty()) {
        return bad(prefix + "." + key, std::string("cannot be set beside ") + prefix +
                                           ".network: the network's entry in the pod's network-status gives the "
                                           "device, interface and address (leave " + key + " empty, or drop network)");
      }
    }
  }
  RDMIG_TRY(read_string(r, prefix, "device", rail.device));
  RDMIG_TRY(read_string(r, prefix, "netdev", rail.netdev));
  RDMIG_TRY(read_string(r, prefix, "address", rail.address));
  if (!rail.address.empty() && !is_ip_address(rail.address)) {
    return bad(prefix + ".address", "expected an IPv4 or IPv6 address, got '" + rail.address + "'");
  }
  RDMIG_TRY(read_string(r, prefix, "resourceEnv", rail.resource_env));
  RDMIG_TRY(read_string_list(r, prefix, "alternateAddresses", rail.alternate_addresses, kMaxAlternateAddresses));
  const std::string alternates = prefix + ".alternateAddresses";
  if (!rail.alternate_addresses.empty() && !rail.network.empty()) {
    return bad(alternates, "cannot be set beside " + prefix + ".network (the network's entry gives one address)");
  }
  for (size_t i = 0; i < rail.alternate_addresses.size(); ++i) {
    const auto& a = rail.alternate_addresses[i];
    const std::string item = alternates + "[" + std::to_string(i) + "]";
    if (!is_ip_address(a)) return bad(item, "expected an IPv4 or IPv6 address, got '" + a + "'");
    if (!rail.address.empty() && same_address(a, rail.address)) {
      return bad(item, "is the rail's own address (" + rail.address + "): list the device's other addresses");
    }
    for (size_t j = 0; j < i; ++j) {
      if (same_address(a, rail.alternate_addresses[j])) return bad(item, "'" + a + "' listed twice");
    }
  }
  if (const auto tc = r["trafficClass"]; tc && !tc.IsNull()) {
    uint32_t v = 0;
    RDMIG_TRY(read_uint(r, prefix, "trafficClass", v, 0, 255));
    if ((v & 3u) != 0) {
      return bad(prefix + ".trafficClass", "is the IP ToS byte, DSCP x 4 (e.g. 104 for DSCP 26); its two ECN bits "
                                           "must be 0, got " + std::to_string(v));
    }
    rail.traffic_class = static_cast<int>(v);
  }
  return ok_status();
}

Status parse_into(const YAML::Node& root, AgentConfig& c) {
  RDMIG_TRY(check_keys(root, "", {"api", "dataPlane", "transport", "migration", "tcp", "rdma",
                                  "stateDir", "logLevel", "kubevirt", "shutdownGraceSeconds", "pathCheck"}));
  if (const auto api = root["api"]) {
    RDMIG_TRY(check_keys(api, "api", {"address", "port", "probePort", "tokenFile", "tokenGraceSeconds", "maxBodyBytes",
                                      "tls"}));
    RDMIG_TRY(read_uint(api, "api", "tokenGraceSeconds", c.api.token_grace_seconds, 0, 86400));
    RDMIG_TRY(read_uint(api, "api", "probePort", c.api.probe_port, 0, 65535));
    RDMIG_TRY(read_string(api, "api", "address", c.api.address));
    RDMIG_TRY(read_uint(api, "api", "port", c.api.port, 0, 65535));
    RDMIG_TRY(read_string(api, "api", "tokenFile", c.api.token_file));
    RDMIG_TRY(read_uint(api, "api", "maxBodyBytes", c.api.max_body_bytes, 1024, 16 * kMiB));
    if (c.api.token_file.empty()) return bad("api.tokenFile", "must name the file holding the API token");
    if (const auto t = api["tls"]; t && !t.IsNull()) {
      RDMIG_TRY(check_keys(t, "api.tls", {"certFile", "keyFile"}));
      RDMIG_TRY(read_string(t, "api.tls", "certFile", c.api.tls.cert_file));
      RDMIG_TRY(read_string(t, "api.tls", "keyFile", c.api.tls.key_file));
      if (c.api.tls.cert_file.empty()) return bad("api.tls.certFile", "must name the PEM certificate the API serves");
      if (c.api.tls.key_file.empty()) return bad("api.tls.keyFile", "must name the PEM private key of api.tls.certFile");
    }
  }
  if (const auto dp = root["dataPlane"]) {
    RDMIG_TRY(check_keys(dp, "dataPlane", {"address", "port", "rdmaPort", "advertiseAddress", "allowLoopbackPeers", "tls",
                                           "failover", "failoverDeadlineSeconds", "failoverPaths"}));
    // YAML 1.1 readers take on/off for booleans: accept both spellings.
    const auto on_off = [&](const char* key, bool& out) -> Status {
      const auto t = dp[key];
      if (!t) return ok_status();
      const std::string v = t.IsScalar() ? t.as<std::string>() : std::string();
      if (v == "on" || v == "true") {
        out = true;
      } else if (v == "off" || v == "false") {
        out = false;
      } else {
        return bad(std::string("dataPlane.") + key, "expected off or on, got '" + v + "'");
      }
      return ok_status();
    };
    RDMIG_TRY(on_off("tls", c.data_plane.tls));
    RDMIG_TRY(on_off("failover", c.data_plane.failover));
    RDMIG_TRY(read_uint(dp, "dataPlane", "failoverDeadlineSeconds", c.data_plane.failover_deadline_seconds, 1, 60));
    RDMIG_TRY(read_string_list(dp, "dataPlane", "failoverPaths", c.data_plane.failover_paths, 3));
    if (c.data_plane.failover_paths.empty()) {
      return bad("dataPlane.failoverPaths", "expected some of rail, address and tcp, in order");
    }
    for (size_t i = 0; i < c.data_plane.failover_paths.size(); ++i) {
      const auto& p = c.data_plane.failover_paths[i];
      if (p != "rail" && p != "address" && p != "tcp") {
        return bad("dataPlane.failoverPaths", "expected rail, address or tcp, got '" + p + "'");
      }
      for (size_t j = 0; j < i; ++j) {
        if (c.data_plane.failover_paths[j] == p) return bad("dataPlane.failoverPaths", "'" + p + "' listed twice");
      }
    }
    RDMIG_TRY(read_uint(dp, "dataPlane", "rdmaPort", c.data_plane.rdma_port, 0, 65535));
    RDMIG_TRY(read_string(dp, "dataPlane", "address", c.data_plane.address));
    RDMIG_TRY(read_uint(dp, "dataPlane", "port", c.data_plane.port, 0, 65535));
    RDMIG_TRY(read_string(dp, "dataPlane", "advertiseAddress", c.data_plane.advertise_address));
    RDMIG_TRY(read_bool(dp, "dataPlane", "allowLoopbackPeers", c.data_plane.allow_loopback_peers));
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
                          "completionTimeoutSeconds", "maxConcurrent", "historySize", "bufferBudget",
                          "qmpSocketRoots", "verifyChunks", "postCopyRecoverySeconds"}));
    RDMIG_TRY(read_bool(m, "migration", "verifyChunks", c.migration.verify_chunks));
    RDMIG_TRY(read_string_list(m, "migration", "qmpSocketRoots", c.migration.qmp_socket_roots, 32));
    for (const auto& root_dir : c.migration.qmp_socket_roots) {
      if (root_dir.empty() || root_dir.front() != '/') {
        return bad("migration.qmpSocketRoots", "'" + root_dir + "' is not an absolute path");
      }
      if (root_dir == "/" || root_dir == "/proc" || root_dir.rfind("/proc/", 0) == 0) {
        return bad("migration.qmpSocketRoots", "'" + root_dir + "' would open every socket on the node");
      }
    }
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
    RDMIG_TRY(read_uint(m, "migration", "postCopyRecoverySeconds", c.migration.postcopy_recovery_seconds, 0, 86400));
    RDMIG_TRY(read_uint(m, "migration", "maxConcurrent", c.migration.max_concurrent, 1, 64));
    RDMIG_TRY(read_uint(m, "migration", "historySize", c.migration.history_size, 1, 10000));
    if (const auto bb = m["bufferBudget"]) {
      if (!bb.IsScalar()) return bad("migration.bufferBudget", "expected a size like 2Gi");
      auto v = parse_bytes(bb.as<std::string>(), "config key 'migration.bufferBudget'");
      if (!v) return v.error();
      if (v.value() < (uint64_t{64} << 20)) return bad("migration.bufferBudget", "must be at least 64Mi");
      c.migration.buffer_budget = v.value();
    }
  }
  if (const auto t = root["tcp"]) {
    RDMIG_TRY(check_keys(t, "tcp", {"splice"}));
    if (const auto sp = t["splice"]) {
      const auto mode = sp.IsScalar() ? transport::parse_splice_mode(sp.as<std::string>()) : std::nullopt;
      if (!mode) {
        return bad("tcp.splice", "expected auto, on or off" +
                                     (sp.IsScalar() ? ", got '" + sp.as<std::string>() + "'" : std::string()));
      }
      c.tcp.splice = *mode;
    }
  }
  if (const auto r = root["rdma"]) {
    RDMIG_TRY(check_keys(r, "rdma", {"device", "netdev", "address", "resourceEnv", "network", "trafficClass",
                                     "alternateAddresses", "devices", "networkStatusFile", "networkWaitSeconds", "connectTimeoutSeconds"}));
    RDMIG_TRY(parse_rdma_rail(r, "rdma", c.rdma));
    RDMIG_TRY(read_string(r, "rdma", "networkStatusFile", c.rdma.network_status_file));
    if (c.rdma.network_status_file.empty() || c.rdma.network_status_file.front() != '/') {
      return bad("rdma.networkStatusFile", "must be an absolute path (the downward API file with the pod's "
                                           "k8s.v1.cni.cncf.io/network-status annotation), got '" +
                                               c.rdma.network_status_file + "'");
    }
    // The liveness probe (first after 5 s, 6 failures 10 s apart) is served only after this wait.
    RDMIG_TRY(read_uint(r, "rdma", "networkWaitSeconds", c.rdma.network_wait_seconds, 0, 40));
    // At most 60 s: a target waits for the source's channels migration.completionTimeoutSeconds.
    RDMIG_TRY(read_uint(r, "rdma", "connectTimeoutSeconds", c.rdma.connect_timeout_seconds, 1, 60));
    if (const auto list = r["devices"]; list && !list.IsNull()) {
      if (!list.IsSequence()) return bad("rdma.devices", "expected a list of rails (device, netdev, address, ...)");
      if (list.size() == 0) return bad("rdma.devices", "must list at least one rail, or be left out");
      if (list.size() > kMaxRdmaRails) {
        return bad("rdma.devices", "at most " + std::to_string(kMaxRdmaRails) + " rails, got " +
                                       std::to_string(list.size()));
      }
      if (!c.rdma.alternate_addresses.empty()) {
        return bad("rdma.alternateAddresses", "cannot be set beside rdma.devices: give each rail its own");
      }
      for (const auto& [key, value] : {std::pair{"device", &c.rdma.device}, std::pair{"netdev", &c.rdma.netdev},
                                       std::pair{"address", &c.rdma.address},
                                       std::pair{"resourceEnv", &c.rdma.resource_env},
                                       std::pair{"network", &c.rdma.network}}) {
        if (!value->empty()) {
          return bad(std::string("rdma.") + key, "cannot be set beside rdma.devices: give each rail its own");
        }
      }
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string prefix = "rdma.devices[" + std::to_string(i) + "]";
        if (!list[i].IsMap()) {
          return bad(prefix, "expected a map (device, netdev, address, resourceEnv, network, trafficClass)");
        }
        RdmaRailConfig rail;
        rail.traffic_class = c.rdma.traffic_class;
        RDMIG_TRY(check_keys(list[i], prefix, {"device", "netdev", "address", "resourceEnv", "network", "trafficClass",
                                               "alternateAddresses"}));
        RDMIG_TRY(parse_rdma_rail(list[i], prefix, rail));
        if (rail.device.empty() && rail.netdev.empty() && rail.address.empty() && rail.resource_env.empty() &&
            rail.network.empty()) {
          return bad(prefix, "names no device: set device, netdev, address, resourceEnv or network");
        }
        c.rdma.devices.push_back(std::move(rail));
      }
      // Two rails on one address would be one NIC twice, and their listeners would collide.
      for (size_t i = 0; i < c.rdma.devices.size(); ++i) {
        for (size_t j = 0; j < i; ++j) {
          const auto& a = c.rdma.devices[j];
          const auto& b = c.rdma.devices[i];
          const bool same = (!b.address.empty() && !a.address.empty() && same_address(a.address, b.address)) ||
                            (b.address.empty() && a.address.empty() && b.device == a.device &&
                             b.netdev == a.netdev && b.resource_env == a.resource_env && b.network == a.network);
          if (same) {
            return bad("rdma.devices[" + std::to_string(i) + "]",
                       "selects the same device as rdma.devices[" + std::to_string(j) + "]");
          }
          // An address is one rail's, as its own or as an alternate: listeners would collide.
          std::vector<std::string> mine = b.alternate_addresses, theirs = a.alternate_addresses;
          if (!b.address.empty()) mine.push_back(b.address);
          if (!a.address.empty()) theirs.push_back(a.address);
          for (const auto& x : mine) {
            for (const auto& y : theirs) {
              if (same_address(x, y)) {
                return bad("rdma.devices[" + std::to_string(i) + "]", "address " + x + " is rdma.devices[" +
                                                                          std::to_string(j) + "]'s too");
              }
            }
          }
        }
      }
    }
  }
  if (const auto k = root["kubevirt"]) RDMIG_TRY(parse_kubevirt(k, c.kubevirt));
  if (c.kubevirt.carry_post_copy && !c.data_plane.failover) {
    // After the switch a channel that cannot fail over leaves the VM split between two nodes.
    return bad("kubevirt.carryPostCopy", "needs dataPlane.failover: on (a channel lost after the switch to post-copy "
                                         "would pause the VM on both nodes)");
  }
  if (const auto p = root["pathCheck"]) RDMIG_TRY(parse_path_check(p, c.path_check));
  RDMIG_TRY(read_string(root, "", "stateDir", c.state_dir));
  if (c.state_dir.empty() || c.state_dir.front() != '/') {
    return bad("stateDir", "must be an absolute path, got '" + c.state_dir + "'");
  }
  // QEMU-side unix socket paths are <stateDir>/<id>.sock; sun_path holds 107 bytes.
  if (c.state_dir.size() > 40) return bad("stateDir", "must be at most 40 characters (unix socket paths)");
  RDMIG_TRY(read_uint(root, "", "shutdownGraceSeconds", c.shutdown_grace_seconds, 1, 3600));
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
