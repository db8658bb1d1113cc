// From the agents' view of one migration (GET /v1/migrations/{id} on source and target) to
// the RdmaMigration .status: progress, transport, results, and the combined outcome. Pure.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace rdmig::controller {

enum class Outcome { kRunning, kSucceeded, kFailed, kCancelled };

// Condition reasons (status.reason, the Succeeded condition's reason) for how a qemu-kind
// migration on the agents ended. One per outcome an operator handles differently.
inline constexpr const char* kReasonSucceeded = "Succeeded";
inline constexpr const char* kReasonSourceFailed = "SourceFailed";          // the source agent failed it; VM on the source
inline constexpr const char* kReasonTargetFailed = "TargetFailed";          // the target agent failed or cancelled first
inline constexpr const char* kReasonVmPausedOnSource = "VMPausedOnSource";  // verdict lost: the VM is paused, act
inline constexpr const char* kReasonCancelledOnAgent = "CancelledOnAgent";  // cancelled on the agent, not through spec.cancel

struct Verdict {
  Outcome outcome = Outcome::kRunning;
  std::string code;    // one of the kReason* above ("" while running)
  std::string reason;  // why it failed or was cancelled, naming the side
};

bool agent_phase_terminal(const std::string& phase);

// The source agent failed the migration and left the VM paused on the source because it could
// not learn the target's verdict after QEMU had handed the VM over (the agent's failure kind
// vm_paused_on_source, rdmig_source_vms_left_paused_total). The agent's REST status carries no
// machine-readable failure kind, so this reads the wording every such failure uses:
// kPausedOnSourceText in result.reason.
inline constexpr const char* kPausedOnSourceText = "the source VM is left paused";
bool vm_left_paused_on_source(const nlohmann::json& source);

// Source and target together: Succeeded only when both say so; any failure on one side fails
// the whole (VMPausedOnSource when the source says so, else SourceFailed; TargetFailed when the
// target ended first); a source cancelled without spec.cancel (e.g. by its agent shutting
// down) is Cancelled/CancelledOnAgent.
Verdict judge(const nlohmann::json& source, const nlohmann::json& target);

// Whether status.transport/transportReason say the agents fell back to TCP: transport "tcp"
// with a reason other than "requested" (auto-no-peer-rdma, auto-no-source-rdma,
// auto-no-local-rdma, target-requested-tcp, ...). False while either is unknown.
bool transport_fell_back(const nlohmann::json& status);
// The TransportFallback Event's message: the reason and what it means.
std::string transport_fallback_message(const nlohmann::json& status);

// Copies progress (transferred/remaining/total bytes, percent, throughput, dirty rate,
// passes, chunks), transport and transportReason, channels, chunk size, results (downtimeMs, switchoverMs,
// totalTimeMs, targetState), rails and railsLeftOut from the agents' status JSON into `status`. Null or missing
// figures are left out, never written as 0.
void copy_agent_status(nlohmann::json& status, const nlohmann::json& source, const nlohmann::json& target);

// RDMA rails in the RdmaMigration status, from the agents' `rails` (GET /v1/migrations/{id}, or
// one side of a KubeVirt record): one entry per rail index, rails matched by index between the
// two sides: {rail, channels, bytes and chunks (source -> target: the source's bytesSent and
// chunksSent, else the target's bytesReceived and chunksReceived), throughputBytesPerSecond
// (the source's, else the target's), sourceDevice, sourceGid, sourceAddress, targetDevice,
// targetGid, targetAddress}. Bounded (kMaxStatusRails rails, kMaxStatusRailChannels channel indexes each);
// fields an agent left out, or sent malformed or over-long, are left out. [] over TCP.
inline constexpr size_t kMaxStatusRails = 16;
inline constexpr size_t kMaxStatusRailChannels = 65;  // the main channel and up to 64 multifd channels
nlohmann::json status_rails(const nlohmann::json& source, const nlohmann::json& target);
// A rail's channel indexes from an agent's array: the non-negative integers up to `max_index`,
// at most `max_items` of them, anything else left out.
nlohmann::json bounded_channel_list(const nlohmann::json& channels, size_t max_items, uint64_t max_index);
// An agent's `rails` array (of a migration, a KubeVirt record or a path check) as (rail index,
// entry): objects with a rail index below `max_rails`, the first entry of each index, at most
// `max_rails` of them; nothing when `view` has no such array.
std::vector<std::pair<uint64_t, const nlohmann::json*>> agent_rail_entries(const nlohmann::json& view,
                                                                           size_t max_rails);
// The rails each agent left out at start ({side, rail, reason, message}), from `railsLeftOut`.
nlohmann::json status_rails_left_out(const nlohmann::json& source, const nlohmann::json& target);

// Preformatted strings for the printer columns, from the numeric fields (both kinds):
// status.display.{progress "57%", downtime "31ms", switchover "40ms", throughput "2.1GB/s",
// bytes "537MB"}. Fields whose figure is unknown are left out.
void update_display(nlohmann::json& status);

// rdmig's own record of a KubeVirt migration (an item of GET /v1/kubevirt/migrations) into
// status: transport and why, channels (connections), progress bytes/chunks/throughput,
// libvirt's downtime and total time, switchover, and the rails of the agent that wrote it. Null
// figures are left out.
void copy_kubevirt_record(nlohmann::json& status, const nlohmann::json& item);

// KubeVirt's view (the VMIM and the VMI's status.migrationState, when it is about that VMIM)
// into status.kubevirt and status.sourceNode/targetNode.
void copy_kubevirt_state(nlohmann::json& status, const nlohmann::json& vmim, const nlohmann::json& migration_state);

// The RdmaMigration phase for a VMIM phase: Pending..TargetReady -> PreparingTarget,
// Running -> Migrating, Succeeded/Failed as they are; "" for an unknown phase.
std::string phase_for_vmim_phase(const std::string& vmim_phase);

// Longest message (bytes) written into status (conditions, failureReason); longer text is cut
// between UTF-8 characters.
inline constexpr size_t kMaxMessageBytes = 4096;

// Sets condition `type` in status.conditions (message cut to kMaxMessageBytes); lastTransitionTime changes only when `status_value` changes.
void set_condition(nlohmann::json& status, const std::string& type, const std::string& status_value,
                   const std::string& reason, const std::string& message, int64_t generation,
                   const std::string& now);

}  // namespace rdmig::controller
