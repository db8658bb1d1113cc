#include "migration/types.h"

#include <chrono>

namespace rdmig::migration {

std::optional<ClockOffset> estimate_clock_offset(int64_t t0, int64_t t1, int64_t t2, int64_t t3) {
  if (t0 <= 0 || t1 <= 0 || t2 < t1 || t3 < t0) return std::nullopt;
  const int64_t round_trip = (t3 - t0) - (t2 - t1);
  if (round_trip < 0) return std::nullopt;
  return ClockOffset{((t1 - t0) + (t2 - t3)) / 2, round_trip / 2 + 1};
}

std::optional<int64_t> switchover_ms(int64_t stop_us, int64_t resume_us, const std::optional<ClockOffset>& offset) {
  if (!offset || stop_us <= 0 || resume_us <= 0) return std::nullopt;
  const int64_t us = resume_us - offset->offset_us - stop_us;
  if (us < 0) {
    if (-us > offset->uncertainty_us) return std::nullopt;
    return 0;
  }
  return us / 1000;
}

const char* post_copy_mode_name(PostCopyMode mode) {
  switch (mode) {
    case PostCopyMode::kAuto: return "auto";
    case PostCopyMode::kAfter: return "after";
    case PostCopyMode::kNever: break;
  }
  return "never";
}

nlohmann::json to_json(const PostCopyStatus& p) {
  using nlohmann::json;
  auto opt = [](const auto& v) { return v ? json(*v) : json(nullptr); };
  return json{{"mode", p.mode},
              {"preempt", p.preempt},
              {"switched", p.switched},
              {"trigger", p.trigger.empty() ? json(nullptr) : json(p.trigger)},
              {"switchedAtMs", p.switched_at_ms ? json(p.switched_at_ms) : json(nullptr)},
              {"switchAfterMs", opt(p.switch_after_ms)},
              {"switchAtPass", opt(p.switch_at_pass)},
              {"phaseMs", opt(p.phase_ms)},
              {"pageRequests", opt(p.page_requests)},
              {"blocktimeMs", opt(p.blocktime_ms)},
              {"pageLatencyUs", opt(p.page_latency_us)},
              {"pageLatencyP50Us", opt(p.page_latency_p50_us)},
              {"pageLatencyP99Us", opt(p.page_latency_p99_us)},
              {"recovery", p.recovery.empty() ? json(nullptr) : json{{"state", p.recovery},
                                                                      {"recoveries", p.recoveries},
                                                                      {"pausedMs", p.paused_ms},
                                                                      {"reason", p.recovery_reason},
                                                                      {"tries", p.recovery_tries},
                                                                      {"lastTry", p.recovery_last_try.empty() ? json(nullptr) : json(p.recovery_last_try)},
                                                                      {"sourceQemu", p.source_qemu.empty() ? json(nullptr) : json(p.source_qemu)},
                                                                      {"targetQemu", p.target_qemu.empty() ? json(nullptr) : json(p.target_qemu)},
                                                                      {"afterRestart", p.after_restart}}}};
}

nlohmann::json to_json(const RailLeftOut& r) {
  return nlohmann::json{{"rail", r.rail}, {"reason", r.reason}, {"message", r.message}};
}

nlohmann::json to_json(const MigrationStatus& s) {
  using nlohmann::json;
  const auto& p = s.progress;
  double percent = 0;
  if (s.phase == Phase::kSucceeded) {
    percent = 100;
  } else if (p.total_bytes > 0) {
    percent = 100.0 * static_cast<double>(p.total_bytes - std::min(p.remaining_bytes, p.total_bytes)) /
              static_cast<double>(p.total_bytes);
  }
  json progress{{"qemuStatus", p.qemu_status},
                {"transferredBytes", p.transferred_bytes},
                {"remainingBytes", p.remaining_bytes},
                {"totalBytes", p.total_bytes},
                {"percent", percent},
                {"throughputBytesPerSecond", p.throughput_bytes_per_second},
                {"dirtyRateBytesPerSecond", p.dirty_rate_bytes_per_second},
                {"passes", p.passes},
                {"chunksSent", p.chunks_sent},
                {"chunksReceived", p.chunks_received},
                {"dataBytesSent", p.data_bytes_sent},
                {"dataBytesReceived", p.data_bytes_received}};
  auto opt = [](const std::optional<int64_t>& v) { return v ? json(*v) : json(nullptr); };
  json rails = json::array();
  for (const auto& r : s.rails) rails.push_back(to_json(r));
  json left_out = json::array();
  for (const auto& r : s.rails_left_out) left_out.push_back(to_json(r));
  json result{{"downtimeMs", opt(s.downtime_ms)},
              {"switchoverMs", opt(s.switchover_ms)},
              {"totalTimeMs", opt(s.total_time_ms)},
              {"setupTimeMs", opt(s.setup_time_ms)},
              {"targetState", s.target_state.empty() ? json(nullptr) : json(s.target_state)},
              {"reason", s.reason.empty() ? json(nullptr) : json(s.reason)},
              {"failureKind", s.failure_kind.empty() ? json(nullptr) : json(s.failure_kind)}};
  return json{{"id", s.id},
              {"role", role_name(s.role)},
              {"vm", s.vm},
              {"phase", phase_name(s.phase)},
              {"transport", s.transport.empty() ? json(nullptr) : json(s.transport)},
              {"transportReason", s.transport_reason.empty() ? json(nullptr) : json(s.transport_reason)},
              {"channels", s.channels},
              {"chunkSize", s.chunk_size},
              {"ringDepth", s.ring_depth},
              {"verifyChunks", s.verify_chunks},
              {"encryption", s.encryption},
              {"failover", json{{"enabled", s.failover},
                                {"failovers", s.failovers},
                                {"last", s.last_failover.empty() ? json(nullptr) : json(s.last_failover)}}},
              {"peer", s.peer.empty() ? json(nullptr) : json(s.peer)},
              {"progress", progress},
              {"postCopy", to_json(s.post_copy)},
              {"rails", rails},
              {"railsLeftOut", left_out},
              {"result", result},
              {"createdAtMs", s.created_at_ms},
              {"startedAtMs", s.started_at_ms ? json(s.started_at_ms) : json(nullptr)},
              {"finishedAtMs", s.finished_at_ms ? json(s.finished_at_ms) : json(nullptr)}};
}

}  // namespace rdmig::migration
