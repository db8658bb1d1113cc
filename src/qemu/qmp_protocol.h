// QMP wire messages (one JSON object per line): greeting, command replies, events.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"

namespace rdmig::qemu {

enum class QmpMessageKind { kGreeting, kReturn, kError, kEvent };

struct QmpMessage {
  QmpMessageKind kind = QmpMessageKind::kReturn;
  nlohmann::json id;              // kReturn/kError: the id we sent
  nlohmann::json value;           // kReturn: "return"; kEvent: "data"; kGreeting: "QMP"
  std::string error_class;        // kError
  std::string error_desc;         // kError
  std::string event;              // kEvent
  int64_t timestamp_us = 0;       // kEvent: QEMU's wall-clock timestamp in microseconds
};

Result<QmpMessage> parse_qmp_message(std::string_view line);

// {"execute": command, "arguments": args, "id": id} as one line (with the newline).
std::string encode_qmp_command(const std::string& command, const nlohmann::json& args, uint64_t id);

// The parts of query-migrate rdmig uses. Absent fields stay 0 (QEMU omits "ram" early on).
struct MigrationInfo {
  std::string status;               // none, setup, active, device, completed, failed, cancelling, cancelled, ...
  uint64_t transferred_bytes = 0;   // ram.transferred
  uint64_t remaining_bytes = 0;     // ram.remaining
  uint64_t total_bytes = 0;         // ram.total
  double throughput_bytes_per_second = 0;  // ram.mbps (megabits) converted to bytes/s
  uint64_t dirty_pages_rate = 0;    // ram.dirty-pages-rate (pages/s)
  uint64_t page_size = 4096;        // ram.page-size
  uint64_t dirty_sync_count = 0;    // ram.dirty-sync-count: QEMU's bitmap syncs (its passes up to 10.0:
                                    // migration/passes.h)
  uint64_t normal_pages = 0;        // ram.normal: pages sent whole
  uint64_t duplicate_pages = 0;     // ram.duplicate: zero pages (sent as a marker, or skipped)
  int64_t total_time_ms = -1;       // total-time
  int64_t downtime_ms = -1;         // downtime (completed only)
  int64_t expected_downtime_ms = -1;
  int64_t setup_time_ms = -1;
  std::string error_desc;           // error-desc when failed
  // Post-copy figures, -1 where QEMU gives none: ram.postcopy-requests (source: page requests
  // the target sent), postcopy-blocktime (target, with the postcopy-blocktime capability: ms all
  // vCPUs waited on pages), postcopy-latency (target, QEMU 10.1+: mean page-fault wait in ns).
  int64_t postcopy_requests = -1;
  int64_t postcopy_blocktime_ms = -1;
  int64_t postcopy_latency_ns = -1;
  // postcopy-latency-dist (target, QEMU 10.1+): page faults per latency bucket, bucket N counting
  // those that waited [2^N, 2^(N+1)) microseconds; empty where QEMU gives none. At most 64 buckets.
  std::vector<uint64_t> postcopy_latency_dist;
};

// The q-quantile (0 < q <= 1) of postcopy-latency-dist, in microseconds: the upper edge of the
// bucket the q-th fault falls in (so "p99 <= X us", power-of-two resolution); nullopt when no fault
// is counted.
std::optional<double> latency_dist_quantile_us(const std::vector<uint64_t>& dist, double q);

// Validates types; unknown statuses are kept as text (QEMU adds states over time).
Result<MigrationInfo> parse_migration_info(const nlohmann::json& value);

bool migration_status_terminal(const std::string& status);
// postcopy-active, postcopy-paused, postcopy-recover(-setup): the target runs the VM.
bool migration_status_postcopy(const std::string& status);

}  // namespace rdmig::qemu
