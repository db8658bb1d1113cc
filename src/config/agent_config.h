// The agent's configuration: loaded once from YAML, validated, then passed by const ref.
// Defaults here are the documented defaults; agent/agent.yaml spells them out.
#pragma once

#include <algorithm>

#include <cstdint>
#include <string>
#include <vector>

#include "common/dial_policy.h"
#include "common/result.h"
#include "common/transport_kind.h"
#include "transport/tcp/splice_mode.h"

namespace rdmig {

struct ApiConfig {
  std::string address = "0.0.0.0";
  uint16_t port = 7470;
  // /healthz and /readyz for the kubelet on a port of their own (api/probe_server.h).
  uint16_t probe_port = 7473;
  std::string token_file = "/etc/rdmig/token";
  // After tokenFile changes, the token it replaced is still accepted this long (the
  // controller and the other agents pick up a rotated Secret at different moments).
  uint32_t token_grace_seconds = 600;
  uint64_t max_body_bytes = 64 * 1024;
  // HTTPS on `port` (and nothing else there): a PEM certificate chain (leaf first) and its PEM
  // private key, both set or neither (plain HTTP). The probe port stays plain HTTP.
  struct Tls {
    std::string cert_file;
    std::string key_file;
    bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
  } tls;
};

struct DataPlaneConfig {
  std::string address = "0.0.0.0";
  uint16_t port = 7471;
  uint16_t rdma_port = 7472;  // rdma_cm listener on the RDMA device's address
  // Address peers should dial; empty = the POD_IP environment variable, else NODE_IP, else
  // `address` (when that is not a wildcard).
  std::string advertise_address;
  // A lab (two agents on one host): a REST client may name a loopback address (127.0.0.0/8, ::1)
  // as a source's target.endpoint. Off: the agent never dials its own host's services on a
  // request's word (net::DialPolicy, docs/security.md).
  bool allow_loopback_peers = false;
  // TLS 1.3 on every TCP data channel (bare QEMU, KubeVirt flows, path checks), keyed by the
  // session's channel key (transport/tcp/tls_stream.h); both agents must agree or the channel is
  // refused, never carried in clear. RDMA channels are not encrypted (docs/security.md).
  bool tls = false;
  // Failover of a bare-QEMU migration's TCP data channels (session/failover_channel.h,
  // docs/failover.md): a channel whose link fails is re-dialled and resumed where each direction
  // stopped, within failover_deadline_seconds, QEMU seeing a stall. Used when both agents have it on
  // (the control hello offers it, the welcome confirms it). Off: a lost link fails the migration.
  bool failover = false;
  uint32_t failover_deadline_seconds = 5;
  // Where a failed RDMA channel is re-dialled, in this order (docs/failover.md): "rail" (another
  // rail of the session, rdma_cm to the target's address on it), "address" (another address of
  // the same rail's device: rdma.devices[i].alternateAddresses on both agents) and "tcp" (the
  // target's data port; only under transport auto). Each at most once, at least one. A TCP
  // channel's only path is TCP: with no "tcp" in the list it does not fail over either
  // (source_dial.cpp, source_session.cpp).
  std::vector<std::string> failover_paths{"rail", "address", "tcp"};
  bool fails_over_to(const std::string& path) const {
    return std::find(failover_paths.begin(), failover_paths.end(), path) != failover_paths.end();
  }
};

// The rule for every dial to a peer agent that a REST client named (migrations and path checks,
// role source): checked on the request (400 naming target.endpoint) and at the dial.
inline net::DialPolicy peer_dial_policy(const DataPlaneConfig& data_plane) {
  return net::DialPolicy::peer_agents(data_plane.allow_loopback_peers);
}

struct MigrationDefaults {
  uint64_t chunk_size = 1024 * 1024;  // chosen by bench/run.py: see README "Benchmarks"
  uint32_t ring_depth = 16;
  // Every chunk ends in the CRC32C of its payload, checked before it reaches QEMU: a transport
  // that corrupts data fails the migration (the VM stays on the source) instead of moving a
  // damaged VM. Costs one CRC pass per byte on each agent; a request's verifyChunks overrides.
  bool verify_chunks = false;
  uint32_t progress_interval_ms = 250;
  uint32_t no_progress_timeout_seconds = 120;
  uint32_t completion_timeout_seconds = 1800;
  // Post-copy recovery (docs/api.md): how long both agents keep trying a fresh channel for a
  // post-copy migration whose link was lost beyond failover (both QEMUs postcopy-paused) before
  // the migration fails naming each QEMU's state. 0: no recovery (fails at once, as before).
  uint32_t postcopy_recovery_seconds = 300;
  uint32_t max_concurrent = 4;
  // Finished migrations kept for GET before being forgotten.
  uint32_t history_size = 64;
  // Chunk buffers all running migrations may hold at once: chunkSize x ringDepth x channels x 2
  // per migration (both directions), reserved when a migration is created.
  uint64_t buffer_budget = uint64_t{2} << 30;
  // The bare-QEMU kind connects only to QMP sockets under these directories (each resolved
  // with realpath, as is the socket path: no symlink leads out of them).
  std::vector<std::string> qmp_socket_roots{"/run/vms"};
};

// TCP transport. splice: move payload between QEMU's socket and the peer's with splice(2)
// (no copy through user space); see transport/tcp/splice_mode.h. auto by default: since the
// receiving agent splices chunks through to QEMU from its reader thread, it is the cheapest mode
// on both paths (bench/relay_floor.py, README "Benchmarks"); channels that cannot splice
// (user-space TLS, verifyChunks, failover) copy.
struct TcpConfig {
  transport::SpliceMode splice = transport::SpliceMode::kAuto;
};

// One RDMA device the data plane uses (a "rail"); the data plane maps it onto
// transport::rdma::RdmaOptions (device.h says how the device, netdev, address and GID are chosen).
struct RdmaRailConfig {
  std::string device;        // e.g. mlx5_0
  std::string netdev;        // e.g. ens1f0v0, or a VLAN/macvlan on it
  std::string address;       // one of the netdev's addresses; empty = its first IPv4, else global IPv6
  std::string resource_env;  // e.g. PCIDEVICE_NVIDIA_COM_MLNX_SRIOV_RDMA or nvidia.com/mlnx_sriov_rdma
  // A Multus secondary network (NetworkAttachmentDefinition, "<namespace>/<name>" or "<name>" in
  // $POD_NAMESPACE): device, netdev and address come from its entry in the pod's network-status
  // (transport/rdma/network_status.h), so none of the four keys above may be set beside it.
  std::string network;
  // IP ToS byte of RoCE v2 packets (DSCP x 4, e.g. 104 = DSCP 26); -1 = the kernel's default.
  int traffic_class = -1;
  // Other addresses of the same device (another VLAN or subnet on its port: each has a GID of its
  // own), listened on too and used only as failover paths ("address" in dataPlane.failoverPaths):
  // a channel whose link on `address` fails is re-dialled from this rail's alternate k to the
  // peer's alternate k of the same rail (docs/failover.md). Not beside `network`.
  std::vector<std::string> alternate_addresses;
};

// Key `rdma`: either one rail from the keys device/netdev/address/resourceEnv/trafficClass, or
// a list of rails under `devices` (each with those keys; a rail's trafficClass defaults to
// rdma.trafficClass). A migration stripes its channels across the rails (session/rails.h).
struct RdmaConfig : RdmaRailConfig {
  std::vector<RdmaRailConfig> devices;  // empty: the single rail above
  // Multus mode (`network` on the rail or rails): the downward API file holding the pod's
  // k8s.v1.cni.cncf.io/network-status annotation, and how long the agent waits at start for the
  // network's entry to appear in it (the kubelet may write the file before Multus wrote the
  // annotation). Kept below the agent's liveness window (the probe server starts after this).
  std::string network_status_file = "/etc/podinfo/network-status";
  uint32_t network_wait_seconds = 30;
  // How long a source agent tries to connect one RDMA channel to the target (rdma_cm address and
  // route resolution and the connect together) before the peer's RDMA counts as unreachable:
  // transport auto then falls back to TCP (auto-no-peer-rdma:unreachable), rdma fails. A
  // reachable peer answers in milliseconds; while RoCE is broken on a path every migration of a
  // drain waits this long before it moves over TCP.
  uint32_t connect_timeout_seconds = 15;

  // The rails in configured order: `devices`, or the single rail.
  std::vector<RdmaRailConfig> rails() const {
    return devices.empty() ? std::vector<RdmaRailConfig>{static_cast<const RdmaRailConfig&>(*this)} : devices;
  }
};

// At most this many rails per agent (nodes carry 2-8 RDMA NICs).
inline constexpr size_t kMaxRdmaRails = 16;
// At most this many alternate addresses per rail.
inline constexpr size_t kMaxAlternateAddresses = 4;

// A peer agent for KubeVirt mode: which node it runs on, where its data plane listens, and
// (static mode) the addresses of that node's virt-handler pod.
struct KubevirtPeer {
  std::string node;
  std::string agent;                          // host:port of its data plane
  std::vector<std::string> handler_addresses;  // static mode: redirect connections to these
};

// KubeVirt mode: rdmig carries KubeVirt's own migration connections (docs/kubevirt.md).
struct KubevirtConfig {
  bool enabled = false;
  std::string hook_socket = "/var/run/kubevirt/plugins/rdmig.sock";  // gRPC node hook (Plugin)
  std::string node_name;                       // empty: $NODE_NAME
  std::string handler_process = "virt-handler";  // /proc/<pid>/comm of KubeVirt's node agent
  std::string launcher_program = "virt-launcher";  // argv[0] prefix of the launcher (--uid <vmi uid>)
  // libvirt sockets inside the launcher's root, tried in order (virtqemud, then libvirtd).
  std::vector<std::string> libvirt_sockets = {"/var/run/libvirt/virtqemud-sock", "/var/run/libvirt/libvirt-sock"};
  uint32_t rule_timeout_seconds = 30;   // redirect elements expire this long after the agent stops refreshing
  uint32_t session_idle_seconds = 2;    // a carried migration ends this long after its last connection closed
  uint32_t probe_interval_seconds = 5;  // unhealthy peers are probed this often
  // A carried migration fails when nothing came from the peer agent on the session's control
  // link (its heartbeats come every 0.5 s) for this long: a cut link or a frozen agent is
  // noticed in seconds, not after TCP's 30 s user timeout.
  uint32_t heartbeat_timeout_seconds = 3;
  // What a failed carried migration does to the source's multifd connections: "drain" reads
  // them to nowhere for up to 10 s and resets only QEMU's main channel (QEMU 7.2 could hang
  // its migration for good when multifd sockets were reset); "reset" resets every connection
  // at once; "auto" asks the source launcher's libvirt for its QEMU version
  // (virConnectGetVersion) for the record and drains on every version so far: QEMU 10.0 wedged
  // once in 114 link-cut tries with every connection reset (kubevirt/flow/libvirt_stats.h,
  // bench/results/kubevirt-failures/).
  std::string multifd_on_failure = "auto";
  // Chunks in flight per carried connection (the flow's credits; migration.ringDepth is the
  // bare-QEMU jobs'). KubeVirt's target proxy reads through its own TCP socket and TLS: chunks
  // beyond the few that keep the agents' hop busy only wait in front of it, and whatever waits
  // there when QEMU stops the guest drains inside the downtime (4 x 1 MiB against 16:
  // bench/results/kubevirt-hop-bound). 0 (not set): kubevirt::flow_ring_depth() decides.
  uint32_t ring_depth = 0;
  bool static_mode = false;             // redirect to peers' handler addresses without the hook
  // The agent's own dials inside virt-handler's namespace carry this mark (SO_MARK) and its
  // redirect rules let (mark & mask) == mark through. Bit 13 only: kube-proxy uses 0x4000
  // (masquerade) and 0x8000 (drop), Calico the upper 16 bits, Cilium 0x0F00 (docs/kubevirt.md).
  uint32_t socket_mark = 0x2000;
  uint32_t socket_mark_mask = 0x2000;
  std::vector<KubevirtPeer> peers;      // discovery "static": the peers, by hand
  // "kubernetes": peers from the API server: the rdmig agent pods (node, pod IP: the node's on the
  // host network; the same dataPlane.port) and, for static mode, the virt-handler pods' IPs.
  std::string discovery = "static";
  std::string kubeconfig;                // empty: in-cluster service account
  std::string agent_namespace;           // empty: $POD_NAMESPACE, else the service account's
  std::string agent_selector = "app.kubernetes.io/name=rdmig-agent";
  std::string handler_namespace = "kubevirt";
  std::string handler_selector = "kubevirt.io=virt-handler";
  uint32_t discovery_interval_seconds = 30;
  // A KubeVirt migration whose own TLS is off (disableTLS: its main connection does not start
  // with a TLS record): "carry" it (a warning naming the VMI, a metric, the flow record says
  // so) or "refuse" it (not carried: docs/kubevirt.md says what KubeVirt then does).
  std::string plaintext_migrations = "carry";
  // Carry migrations that may switch to post-copy (allowPostCopy in their migration
  // configuration, or mode PostCopy). Off: they go KubeVirt's own way (NotCarried, reason
  // post_copy). On: carried like any other, with dataPlane.failover required on both agents
  // (this one: the config refuses carryPostCopy without it; the target: a session whose welcome
  // does not confirm failover is not carried): after libvirt's switch the guest runs on the
  // target and pulls its missing pages over the carried main channel, a channel lost beyond
  // failover pauses both QEMUs (postcopy-paused) and KubeVirt has no post-copy recovery
  // (kubevirt#15924: virt-handler shuts the paused VM down). docs/kubevirt.md "Post-copy".
  bool carry_post_copy = false;
};

// Key `pathCheck`: the bounds this agent applies to the path checks it runs (docs/pathcheck.md).
// A request over a bound is refused (400) naming the key; one over maxConcurrent is 429.
struct PathCheckConfig {
  uint32_t max_concurrent = 4;                     // running at once on this agent, both roles
  uint32_t history_size = 32;                      // finished checks kept for GET
  uint64_t default_bytes = uint64_t{1} << 30;      // a request without `bytes`
  uint64_t max_bytes = uint64_t{64} << 30;         // `bytes` at most
  uint32_t max_channels = 16;                      // `channels` at most
  uint32_t default_timeout_seconds = 120;          // a request without `timeoutSeconds`
  uint32_t max_timeout_seconds = 3600;             // `timeoutSeconds` at most
  // A running stream that moves no byte for this long has stalled (a path that broke mid-stream:
  // RoCE v2 dropped, a link down, a frozen agent): the check fails naming it, not its deadline.
  uint32_t stall_timeout_seconds = 10;
  uint32_t rtt_samples = 5;                        // control-link round trips; the median is reported
};

struct AgentConfig {
  ApiConfig api;
  DataPlaneConfig data_plane;
  TransportKind transport = TransportKind::kAuto;
  MigrationDefaults migration;
  TcpConfig tcp;
  RdmaConfig rdma;
  KubevirtConfig kubevirt;
  PathCheckConfig path_check;
  std::string state_dir = "/var/run/rdmig";
  std::string log_level = "info";
  // On SIGTERM the agent drains: no new work, and the running migrations, path checks and
  // KubeVirt sessions go on for up to this long; what still runs then (or at a second signal)
  // is cancelled, the VM staying on the source. Keep the pod's terminationGracePeriodSeconds
  // above it (the chart gives it + 10 s).
  uint32_t shutdown_grace_seconds = 300;
};

// Parses and validates YAML text. Errors name the offending key ("migration.chunkSize").
Result<AgentConfig> parse_agent_config(const std::string& yaml_text);
Result<AgentConfig> load_agent_config_file(const std::string& path);

}  // namespace rdmig
