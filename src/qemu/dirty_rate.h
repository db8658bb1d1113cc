// A guest's memory dirty rate, measured by QEMU itself over QMP: calc-dirty-rate starts a
// measurement of `seconds`, query-dirty-rate reports it ("dirty-rate" in MiB/s) once its status
// is "measured". Used by the agent's POST /v1/dirtyrate (docs/api.md) for the drain forecast
// (docs/drain.md). Blocks the caller for about `seconds`.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/result.h"
#include "qemu/qmp_client.h"

namespace rdmig::qemu {

inline constexpr uint32_t kMaxDirtyRateSeconds = 60;
// QEMU's bounds on sample-pages (pages per GiB hashed at the start and the end).
inline constexpr uint32_t kMinSamplePages = 128;
inline constexpr uint32_t kMaxSamplePages = 4096;
inline constexpr uint32_t kDefaultSamplePages = 512;

struct DirtyRate {
  double bytes_per_second = 0;  // QEMU's MiB/s times 2^20
  uint32_t calc_seconds = 0;
  uint32_t sample_pages = 0;
  int64_t qemu_start_time = 0;  // QEMU's start-time (seconds of its clock)
};

// Mode page-sampling only: QEMU hashes `sample_pages` random pages per GiB at the start and the
// end and scales the share that changed to the guest's memory, so the figure is the memory
// dirtied over `seconds` (a page written twice counts once). It works beside a running
// migration. The other modes are not offered: dirty-bitmap killed a QEMU 7.2 TCG guest here (the
// process ended on calc-dirty-rate), dirty-ring needs KVM's dirty ring.
Result<DirtyRate> measure_dirty_rate(QmpClient& qmp, uint32_t seconds, uint32_t sample_pages);

}  // namespace rdmig::qemu
