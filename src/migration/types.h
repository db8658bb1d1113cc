// What a migration is (its validated spec) and what the agent reports about it (its status).
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/transport_kind.h"
#include "session/types.h"

namespace rdmig::migration {

// A migration is one session (session/types.h): its role, phase and target are the session's.
using session::Phase;
using session::phase_name;
using session::phase_terminal;
using session::Role;
using session::role_name;
using session::TargetRef;

// Post-copy (docs/api.md, postCopy): the source agent switches the running migration to post-copy
// (QMP migrate-start-postcopy), after which the target runs the VM and pulls the pages it still
// lacks from the source over the return path.
enum class PostCopyMode { kNever, kAuto, kAfter };
const char* post_copy_mode_name(PostCopyMode mode);
struct PostCopySpec {
  PostCopyMode mode = PostCopyMode::kNever;
  // auto: switch once QEMU's passes (ram.dirty-sync-count, progress.passes) reach this, or once
  // pre-copy has run this long, whichever comes first.
  uint32_t after_passes = 5;
  uint32_t after_seconds = 60;
  // postcopy-preempt (QEMU 8.0+ on both nodes, without multifd): urgent pages on a connection of
  // their own, one more channel the agents carry (channels()). The target learns it from the
  // source's hello.
  bool preempt = false;
};

// The most multifd channels a migration may ask for (REST multifdChannels, the post-copy record).
inline constexpr uint32_t kMaxMultifdChannels = 64;

struct MigrationSpec {
  Role role = Role::kSource;
  std::string id;  // empty: the agent picks one (source: the target's migration id)
  std::string vm;  // display name for metrics and logs; defaults to the id
  std::string qmp_socket;
  uint32_t multifd_channels = 0;  // 0: no multifd (one channel)
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  TransportKind transport = TransportKind::kAuto;
  // Every chunk carries the CRC32C of its payload, checked before it reaches QEMU. The source
  // asks (request or migration.verifyChunks); the target follows the source's hello.
  bool verify_chunks = false;
  // Source only.
  TargetRef target;
  uint64_t max_downtime_ms = 300;
  uint64_t max_bandwidth_bytes_per_second = 0;  // 0: unlimited
  uint32_t completion_timeout_seconds = 0;
  uint32_t no_progress_timeout_seconds = 0;
  PostCopySpec post_copy;

  // QEMU's connections: the main one, the multifd ones, and post-copy's preempt connection (the
  // last index; QEMU opens it at the switch).
  uint32_t channels() const { return 1 + multifd_channels + (post_copy.preempt ? 1 : 0); }
  uint32_t preempt_index() const { return 1 + multifd_channels; }
  // The channels a post-copy recovery opens again, in QEMU's order: the main one, then the preempt one.
  std::vector<uint32_t> recovery_channels() const {
    if (post_copy.preempt) return {0, preempt_index()};
    return {0};
  }
};

struct Progress {
  std::string qemu_status = "none";
  uint64_t transferred_bytes = 0;
  uint64_t remaining_bytes = 0;
  uint64_t total_bytes = 0;
  double throughput_bytes_per_second = 0;
  double dirty_rate_bytes_per_second = 0;
  uint64_t passes = 0;
  uint64_t chunks_sent = 0;
  uint64_t chunks_received = 0;
  uint64_t data_bytes_sent = 0;
  uint64_t data_bytes_received = 0;
};

// A configured rail (rdma.devices[rail]) this agent left out at start, and why: a migration over
// RDMA ran on the other rails.
struct RailLeftOut {
  uint32_t rail = 0;
  std::string reason;   // no-device, no-address, gid-not-found, listener-failed (rdmig_rdma_rail_up's label)
  std::string message;  // what to fix
};
nlohmann::json to_json(const RailLeftOut& rail);

// What post-copy did (both roles; figures each agent's QEMU gives, nullopt where it gives none).
struct PostCopyStatus {
  std::string mode = "never";  // the source's postCopy; the target: "requested" once the source asked
  // postcopy-preempt on both QEMUs, its connection carried as the last channel (docs/api.md).
  bool preempt = false;
  bool switched = false;
  std::string trigger;              // source: after-first-pass | passes | seconds
  int64_t switched_at_ms = 0;       // wall clock (source: when migrate-start-postcopy returned)
  std::optional<int64_t> switch_after_ms;  // source: pre-copy's length before the switch
  std::optional<uint64_t> switch_at_pass;  // source: progress.passes at the switch
  std::optional<int64_t> phase_ms;  // the switch to the migration's completion
  std::optional<uint64_t> page_requests;   // source QEMU's ram.postcopy-requests: page requests served
  std::optional<int64_t> blocktime_ms;     // target QEMU's postcopy-blocktime: all vCPUs waiting on pages
  std::optional<double> page_latency_us;   // target QEMU's postcopy-latency (QEMU 10.1+): mean page-fault wait
  // From the target QEMU's postcopy-latency-dist (QEMU 10.1+): the median and 99th percentile page-fault
  // wait, each the upper edge of QEMU's power-of-two bucket (qemu::latency_dist_quantile_us).
  std::optional<double> page_latency_p50_us;
  std::optional<double> page_latency_p99_us;
  // Recovery (docs/api.md "Post-copy recovery"): the link lost beyond failover, both QEMUs paused.
  std::string recovery;           // "" (never needed), recovering, recovered, failed
  uint32_t recoveries = 0;        // times the migration was resumed over a fresh channel
  int64_t paused_ms = 0;          // time spent recovering in all, ms (the current one included)
  std::string recovery_reason;    // why the last recovery began (the lost link)
  uint32_t recovery_tries = 0;    // tries of the current (or last) recovery
  std::string recovery_last_try;  // the last failed try's error
  std::string source_qemu;        // source QEMU's state during the recovery (its agent's view)
  std::string target_qemu;        // target QEMU's state during the recovery (its agent's view)
  // This agent restarted during post-copy and took the migration up again from its record in
  // stateDir (postcopy_record.h): the recovery that followed was after that restart.
  bool after_restart = false;
};
nlohmann::json to_json(const PostCopyStatus& p);

struct MigrationStatus {
  std::string id;
  Role role = Role::kSource;
  std::string vm;
  Phase phase = Phase::kPending;
  std::string transport;  // chosen transport, once known
  std::string transport_reason;
  uint32_t channels = 1;
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  bool verify_chunks = false;  // every chunk checked against its CRC32C (target: as the source asked)
  // The data channels' encryption: "none", or "tls (kernel)" | "tls (kernel send)" |
  // "tls (user space)" (dataPlane.tls: on; where this agent's records are encrypted). RDMA: "none".
  std::string encryption = "none";
  // dataPlane.failover confirmed by both agents (docs/failover.md); its data channels' failovers so
  // far and the last one's reason, path and cost.
  bool failover = false;
  uint64_t failovers = 0;
  std::string last_failover;
  Progress progress;
  PostCopyStatus post_copy;
  // RDMA only: the rails the channels were striped across (session/rails.h), with their bytes.
  std::vector<session::RailUsage> rails;
  // RDMA only: this agent's configured rails left out at start (so not in `rails`), and why.
  std::vector<RailLeftOut> rails_left_out;
  std::optional<int64_t> downtime_ms;     // QEMU's figure (source)
  std::optional<int64_t> switchover_ms;   // source STOP event to target RESUME event
  std::optional<int64_t> total_time_ms;   // QEMU's total-time (source) or agent-measured
  std::optional<int64_t> setup_time_ms;
  std::string target_state;  // target after success: running or paused
  std::string reason;        // why it failed or was cancelled
  std::string failure_kind;  // a failed migration's kind: the reason label of rdmig_migration_failures_total
  std::string peer;          // the other agent's data-plane endpoint
  int64_t created_at_ms = 0;
  int64_t started_at_ms = 0;
  int64_t finished_at_ms = 0;
};

nlohmann::json to_json(const MigrationStatus& s);

// The target host's wall clock minus the source host's, estimated from one exchange over the
// control link (NTP's four timestamps): t0 source sends, t1 target receives, t2 target sends,
// t3 source receives. `uncertainty_us` is half the round trip without the target's own time.
struct ClockOffset {
  int64_t offset_us = 0;
  int64_t uncertainty_us = 0;
};
std::optional<ClockOffset> estimate_clock_offset(int64_t t0, int64_t t1, int64_t t2, int64_t t3);
// The true switchover from the source QEMU's STOP (source clock) to the target QEMU's RESUME
// (target clock), in ms, with the target's timestamp moved onto the source's clock. A result
// below zero by no more than the uncertainty is 0; further below (the estimate cannot hold)
// or without an estimate, nullopt: never a figure that subtracts one host's clock from another's.
std::optional<int64_t> switchover_ms(int64_t stop_us, int64_t resume_us, const std::optional<ClockOffset>& offset);

}  // namespace rdmig::migration
