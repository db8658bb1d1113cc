// The RdmaMigration spec, validated at the boundary (errors name the field, "spec.chunkSize"),
// and the agent REST bodies built from it. Checks the CRD schema cannot express live here:
// the two nodes differ, the chunk size is a power of two in [64Ki, 1Gi].
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/result.h"

namespace rdmig::controller {

struct QemuEndpoint {
  std::string node;
  std::string qmp_socket;
};

struct MigrationRequest {
  QemuEndpoint source;
  QemuEndpoint target;
  std::string transport = "auto";
  std::optional<uint64_t> chunk_size;  // unset: the agents' default
  uint32_t multifd_channels = 0;
  std::optional<uint32_t> ring_depth;
  uint64_t max_downtime_ms = 300;  // spec.maxDowntime, or the deprecated spec.maxDowntimeMs
  uint64_t max_bandwidth_bytes_per_second = 0;  // 0: unlimited
  std::optional<uint32_t> completion_timeout_seconds;
  // spec.postCopy (never | auto | after; unset: never) and, with auto only, its two thresholds
  // (unset: the agent's defaults). Passed to the source agent as they are (docs/api.md).
  std::optional<std::string> post_copy;
  std::optional<uint32_t> post_copy_after_passes;
  std::optional<uint32_t> post_copy_after_seconds;
  bool post_copy_preempt = false;  // spec.postCopyPreempt: QEMU's postcopy-preempt, carried
  bool cancel = false;
};

// QEMU's downtime-limit bounds, in milliseconds (spec.maxDowntime / spec.maxDowntimeMs).
inline constexpr uint64_t kMinDowntimeMs = 1;
inline constexpr uint64_t kMaxDowntimeMs = 2'000'000;
inline constexpr uint64_t kDefaultDowntimeMs = 300;

// A Kubernetes duration string (Go's time.ParseDuration form without a sign: "300ms", "1.5s",
// "1m30s"; units ns, us, µs, ms, s, m, h; at most 6 fractional digits) as whole milliseconds in
// [min_ms, max_ms]. Errors name `field`.
Result<uint64_t> parse_duration_ms(const std::string& text, const std::string& field, uint64_t min_ms, uint64_t max_ms);

// spec.source names exactly one kind of endpoint.
enum class SourceKind { kQemu, kVmi };
Result<SourceKind> source_kind(const nlohmann::json& spec);

// spec.source.qemu (bare QEMU): both endpoints, the tunables.
Result<MigrationRequest> parse_spec(const nlohmann::json& spec);

// spec.source.vmi (KubeVirt): the VMI in the object's namespace, optional
// spec.target.nodeSelector (KubeVirt's addedNodeSelector). The bare-QEMU tunables are refused:
// under KubeVirt the agents' `kubevirt:` config and KubeVirt's migration policy decide them.
struct VmiRequest {
  std::string name;
  std::map<std::string, std::string> node_selector;
  bool cancel = false;
};
Result<VmiRequest> parse_vmi_spec(const nlohmann::json& spec);

// The id both agents use for this object's migration: "m-" + metadata.uid (a DNS label).
// Deterministic, so a restarted controller finds the migration it started.
Result<std::string> agent_migration_id(const nlohmann::json& object);

// "namespace/name" of the object, used as the agents' VM display name (their `vm` field). The
// agents take at most kMaxVmName characters; a longer one keeps its first characters and ends
// in "-" and 8 hex digits of a hash of the whole (deterministic, so a restarted controller sends
// the same).
inline constexpr size_t kMaxVmName = 253;
std::string vm_name(const nlohmann::json& object);

// POST /v1/migrations bodies.
nlohmann::json target_request_body(const MigrationRequest& r, const std::string& id, const std::string& vm);
nlohmann::json source_request_body(const MigrationRequest& r, const std::string& id, const std::string& vm,
                                   const nlohmann::json& target_reply);

}  // namespace rdmig::controller
