// rdmig-controller configuration: loaded once from YAML, validated (errors name the key),
// then passed by const reference. controller/controller.yaml documents every key.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/result.h"

namespace rdmig::controller {

// The largest ttlSecondsAfterFinished (config and spec): ten years, "keep".
inline constexpr uint32_t kMaxTtlSeconds = 315360000;

struct ControllerConfig {
  std::string namespace_;       // agent pods and the Lease; resolved at start when empty
  std::string watch_namespace;  // "" = all namespaces
  struct Agents {
    std::string label_selector = "app.kubernetes.io/name=rdmig-agent";
    std::map<std::string, std::string> labels;  // parsed label_selector
    uint16_t port = 7470;
    std::string port_name = "api";
    std::string token_file = "/etc/rdmig/token";
    uint32_t request_timeout_seconds = 10;
    uint32_t unreachable_timeout_seconds = 30;
    // HTTPS to the agents (api.tls on the agents). The controller dials agents by pod IP, so it
    // checks the certificate's chain against ca_file and its name against server_name, never
    // against the IP. Empty ca_file: plain HTTP.
    struct Tls {
      std::string ca_file;
      std::string server_name = "rdmig-agent";
      bool enabled() const { return !ca_file.empty(); }
    } tls;
  } agents;
  uint32_t max_concurrent_per_node = 2;
  // The bare-QEMU kind (spec.source.qemu) lets its author drive any QEMU on any node, so it
  // is an opt-in: namespaces whose RdmaMigration objects may use it ("*" = every namespace).
  struct Qemu {
    std::vector<std::string> allowed_namespaces;
    bool allowed(const std::string& ns) const;
  } qemu;
  // KubeVirt: the vmi kind, and reporting of every VirtualMachineInstanceMigration.
  struct Kubevirt {
    bool enabled = true;                  // false: no VMIM watch, the vmi kind is refused
    uint32_t max_reported_vmis = 256;     // VMIs with rdmig_controller_vmi_* series at once
    uint32_t figures_wait_seconds = 10;   // after KubeVirt's end, wait this long for rdmig's figures
  } kubevirt;
  // A finished RdmaMigration (Succeeded, Failed, Cancelled) is deleted this long after its
  // status.completionTime unless its spec.ttlSecondsAfterFinished says otherwise (0: at once).
  uint32_t ttl_seconds_after_finished = 86400;
  uint32_t poll_interval_ms = 1000;
  struct LeaderElection {
    bool enabled = true;
    std::string lease_name = "rdmig-controller";
    std::string identity;
    double lease_duration_seconds = 15;
    double renew_deadline_seconds = 10;
    double retry_period_seconds = 2;
  } leader_election;
  // /metrics (controller/metrics_auth.h). secure: HTTPS, and each scrape's bearer token checked
  // with a TokenReview and a SubjectAccessReview (get on /metrics) against the API server, as
  // controller-runtime's secure metrics serving does. secure false: plain HTTP on a loopback
  // address only (a sidecar or `kubectl port-forward` reads it).
  struct MetricsServer {
    bool secure = true;
    std::string address;  // "" = 0.0.0.0 when secure, else 127.0.0.1
    uint16_t port = 8443;
    // The HTTPS certificate and key (PEM, reloaded when they change). Both empty: a self-signed
    // certificate made at start (a scraper then skips verification, as with controller-runtime's).
    struct Tls {
      std::string cert_file;
      std::string key_file;
    } tls;
    uint32_t auth_cache_entries = 256;  // tokens whose review answers are kept (bounded; TTLs in metrics_auth.h)
  } metrics;
  // /healthz and /readyz for the kubelet: plain HTTP, no authentication, apart from /metrics.
  struct Probes {
    std::string address = "0.0.0.0";
    uint16_t port = 8081;
  } probes;
  std::string log_level = "info";
};

Result<ControllerConfig> parse_controller_config(const std::string& yaml_text);
// 127.0.0.0/8, ::1 or localhost: where plain-HTTP metrics may listen.
bool is_loopback_address(const std::string& address);
Result<ControllerConfig> load_controller_config_file(const std::string& path);

}  // namespace rdmig::controller
