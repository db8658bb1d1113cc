// What the agent reports about one KubeVirt migration it saw (GET /v1/kubevirt/migrations):
// whether it carried it and why (not), and its figures. Both agents keep one; the source's
// is complete at the end (the target sends it libvirt's figures).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kubevirt/hook/vmi.h"
#include "session/types.h"

namespace rdmig::kubevirt {

// libvirt's completed-job statistics of the incoming domain (virDomainGetJobStats).
struct LibvirtJobStats {
  int64_t downtime_ms = -1;
  int64_t total_time_ms = -1;
  uint64_t data_total_bytes = 0;
  // Pages the target requested after the switch to post-copy (memory_postcopy_requests);
  // -1 when libvirt does not give it.
  int64_t postcopy_requests = -1;
  std::string domain;
};

// Source: a migration that may switch to post-copy (kubevirt.carryPostCopy, docs/kubevirt.md).
// `switched` once the source's libvirt shows the domain paused for post-copy (KubeVirt's launcher
// called MigrateStartPostCopy), `switched_at_ms` then (wall clock, as the agent saw it).
struct FlowPostCopy {
  bool allowed = false;
  bool switched = false;
  int64_t switched_at_ms = 0;
};
nlohmann::json to_json(const LibvirtJobStats& s);
LibvirtJobStats libvirt_stats_from_json(const nlohmann::json& j);

struct FlowRecord {
  std::string migration_uid;  // KubeVirt's (VMIM uid); static mode: the session id
  VmiRef vmi;                 // empty in static mode (no hook tells which VMI)
  std::string role;           // source | target
  std::string source_node;
  std::string target_node;
  std::string mode;           // hook | static
  bool carried = false;
  std::string reason;         // why not carried, or why it failed
  std::string phase;          // Armed | Carrying | Succeeded | Failed | NotCarried
  std::string transport;
  std::string transport_reason;
  std::string peer;           // the other agent
  uint32_t connections = 0;
  // Source: the carried connection taken for QEMU's main memory channel (reset on a failure;
  // the other memory connections drain), and how it was told: "magic" (its first bytes were
  // QEMU's stream header, seen when KubeVirt's TLS is off) or "order" (the first connection
  // to the memory port; with TLS nothing else can be seen). -1: none yet.
  int main_connection = -1;
  std::string main_connection_by;
  // Source: what a failure does to the multifd connections ("drain" or "reset", see
  // kubevirt.multifdOnFailure), why ("config", or "qemu <version>" as the source launcher's
  // libvirt reports it; "qemu unknown" while or when that is not known).
  // Between the agents: "none", or "tls (kernel)" | "tls (kernel send)" | "tls (user space)"
  // (dataPlane.tls: on, TCP only).
  std::string encryption = "none";
  // Source: KubeVirt's own migration TLS as the first bytes of the memory connections show it:
  // "on" (a TLS record), "off" (QEMU's stream in clear: disableTLS), "" not seen yet.
  std::string kubevirt_tls;
  // Source, when kubevirt_tls is "off": "carried" or "refused" (kubevirt.plaintextMigrations).
  std::string plaintext;
  std::string on_failure;
  std::string on_failure_by;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t chunks_sent = 0;
  uint64_t chunks_received = 0;
  double throughput_bytes_per_second = 0;
  // Over RDMA: each rail that carries a connection (its device, both addresses, the channels on
  // it, its bytes), in rail order; connection i uses matched rail i mod n (session/rails.h).
  std::vector<session::RailUsage> rails;
  std::optional<LibvirtJobStats> libvirt;
  // Failover (dataPlane.failover on both agents, docs/failover.md): whether this flow's channels
  // fail over, how many times one did, and the last one ("channel 1: ...; resumed on ...").
  bool failover = false;
  uint64_t failovers = 0;
  std::string last_failover;
  FlowPostCopy post_copy;
  int64_t started_at_ms = 0;
  int64_t finished_at_ms = 0;

  bool terminal() const { return phase == "Succeeded" || phase == "Failed" || phase == "NotCarried"; }
};

nlohmann::json to_json(const FlowRecord& r);

}  // namespace rdmig::kubevirt
