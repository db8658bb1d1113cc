#include "qemu/dirty_rate.h"

#include <thread>

namespace rdmig::qemu {

using nlohmann::json;

Result<DirtyRate> measure_dirty_rate(QmpClient& qmp, uint32_t seconds, uint32_t sample_pages) {
  if (seconds < 1 || seconds > kMaxDirtyRateSeconds) {
    return Error{Errc::kInvalidArgument, "calcSeconds: must be between 1 and " + std::to_string(kMaxDirtyRateSeconds)};
  }
  if (sample_pages < kMinSamplePages || sample_pages > kMaxSamplePages) {
    return Error{Errc::kInvalidArgument, "samplePages: must be between " + std::to_string(kMinSamplePages) + " and " +
                                             std::to_string(kMaxSamplePages)};
  }
  auto started = qmp.execute("calc-dirty-rate", json{{"calc-time", seconds}, {"sample-pages", sample_pages},
                                                     {"mode", "page-sampling"}});
  if (!started) return started.error().with_context("calc-dirty-rate");
  // QEMU measures for `seconds`, then publishes; poll until then plus a margin.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds + 5);
  std::this_thread::sleep_for(std::chrono::milliseconds(900) * seconds);
  for (;;) {
    auto q = qmp.execute("query-dirty-rate");
    if (!q) return q.error().with_context("query-dirty-rate");
    const std::string status = q->value("status", "");
    if (status == "measured") {
      if (!q->contains("dirty-rate") || !(*q)["dirty-rate"].is_number()) {
        return Error{Errc::kQemu, "query-dirty-rate: measured without a dirty-rate"};
      }
      DirtyRate out;
      out.bytes_per_second = (*q)["dirty-rate"].get<double>() * 1024 * 1024;
      out.calc_seconds = seconds;
      out.sample_pages = q->value("sample-pages", sample_pages);
      out.qemu_start_time = q->value("start-time", int64_t{0});
      return out;
    }
    if (status != "measuring" && status != "unstarted") {
      return Error{Errc::kQemu, "query-dirty-rate: status '" + status.substr(0, 64) + "'"};
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Error{Errc::kTimeout, "query-dirty-rate: still '" + status + "' " + std::to_string(seconds + 5) +
                                       " s after calc-dirty-rate"};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace rdmig::qemu
