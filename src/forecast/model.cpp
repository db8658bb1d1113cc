#include "forecast/model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace rdmig::forecast {

namespace {

constexpr double kThrottleTrigger = 0.5;   // QEMU's throttle-trigger-threshold 50%
constexpr double kThrottleInitial = 0.2;   // cpu-throttle-initial 20
constexpr double kThrottleIncrement = 0.1; // cpu-throttle-increment 10
constexpr double kThrottleMax = 0.99;      // max-cpu-throttle 99

std::string rate(double bytes_per_second) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB/s", bytes_per_second / (1 << 20));
  return buf;
}

}  // namespace

double path_throughput(const PathMeasure& path, const MigrationSettings& s) {
  if (path.throughput <= 0) return 0;
  double per_channel = path.throughput / std::max<uint32_t>(path.channels, 1);
  if (path.rtt_seconds > 0) {
    per_channel = std::min(per_channel, static_cast<double>(s.ring_depth) * static_cast<double>(s.chunk_size) /
                                            path.rtt_seconds);
  }
  const double capacity = path.capacity > 0 ? path.capacity : path.throughput;
  const double alone = std::min(per_channel * std::max<uint32_t>(s.channels, 1), capacity);
  const double shared = std::min(alone, capacity / std::max<uint32_t>(s.concurrent, 1));
  return s.max_bandwidth > 0 ? std::min(shared, s.max_bandwidth) : shared;
}

Prediction predict(const VmInput& vm, const PathMeasure& path, const MigrationSettings& s) {
  Prediction p;
  p.throughput = path_throughput(path, s);
  const double B = p.throughput;
  const double M = static_cast<double>(vm.memory);
  if (B <= 0) {
    p.reason = "the path has no measured throughput";
    return p;
  }
  const double limit = s.accepted_downtime - s.switchover;  // QEMU's downtime-limit
  if (limit <= 0) {
    p.reason = "the accepted downtime is not above the switchover cost";
    p.total_seconds = s.completion_timeout;
    p.downtime_seconds = M / B + s.switchover;
    return p;
  }
  const double threshold = B * limit;
  double x = M, t = 0, sent = 0, throttle = 0;
  int high = 0;
  for (;;) {
    if (x <= threshold) {
      p.converges = true;
      p.downtime_seconds = x / B + s.switchover;
      p.total_seconds = t + p.downtime_seconds;
      p.bytes = static_cast<uint64_t>(sent + x);
      p.within_limits = p.downtime_seconds <= s.accepted_downtime + 1e-9 && p.total_seconds <= s.completion_timeout;
      if (p.total_seconds > s.completion_timeout) {
        p.converges = false;
        p.reason = "the stop comes after the completion timeout";
      }
      p.max_throttle = throttle;
      return p;
    }
    const double dt = x / B;
    if (t + dt > s.completion_timeout || p.passes >= s.max_passes) {
      p.reason = p.passes >= s.max_passes ? "more passes than the limit" : "still iterating at the completion timeout";
      break;
    }
    t += dt;
    sent += x;
    ++p.passes;
    const double dirtied = std::min(vm.dirty_rate * (1 - throttle) * dt, M);
    if (s.auto_converge && dirtied > kThrottleTrigger * x && ++high >= 2) {
      high = 0;
      throttle = throttle == 0 ? kThrottleInitial : std::min(throttle + kThrottleIncrement, kThrottleMax);
    }
    if (!s.auto_converge && dirtied >= x) {
      p.reason = "the dirty rate " + rate(vm.dirty_rate) + " is not below the throughput " + rate(B);
      x = dirtied;
      break;
    }
    x = dirtied;
  }
  p.total_seconds = s.completion_timeout;
  p.downtime_seconds = x / B + s.switchover;
  p.bytes = static_cast<uint64_t>(sent);
  p.max_throttle = throttle;
  return p;
}

Prediction predict_postcopy(const VmInput& vm, const PathMeasure& path, const MigrationSettings& s) {
  Prediction p;
  p.throughput = path_throughput(path, s);
  const double B = p.throughput;
  if (B <= 0) {
    p.reason = "the path has no measured throughput";
    return p;
  }
  const double M = static_cast<double>(vm.memory);
  const double first = M / B;
  const double rest = std::min(vm.dirty_rate * first, M);
  p.passes = 1;
  p.downtime_seconds = s.switchover;
  p.total_seconds = first + rest / B + s.switchover;
  p.bytes = static_cast<uint64_t>(M + rest);
  p.converges = p.total_seconds <= s.completion_timeout;
  p.within_limits = p.converges && p.downtime_seconds <= s.accepted_downtime;
  if (!p.converges) p.reason = "post-copy itself ends after the completion timeout";
  return p;
}

Remedies remedies(const VmInput& vm, const PathMeasure& path, const MigrationSettings& s, uint32_t max_channels) {
  Remedies r;
  if (predict(vm, path, s).within_limits) return r;
  if (auto pc = predict_postcopy(vm, path, s); pc.within_limits) r.postcopy = pc;
  if (!s.auto_converge) {
    MigrationSettings ac = s;
    ac.auto_converge = true;
    if (auto p = predict(vm, path, ac); p.within_limits) r.auto_converge = p;
  }
  const double base = path_throughput(path, s);
  for (uint32_t c = s.channels + 1; c <= max_channels; ++c) {
    MigrationSettings more = s;
    more.channels = c;
    if (path_throughput(path, more) <= base * (1 + 1e-9)) continue;
    if (auto p = predict(vm, path, more); p.within_limits) {
      r.more_channels = p;
      r.channels_needed = c;
      break;
    }
  }
  // The least accepted downtime that converges: the smallest remainder a pass leaves before the
  // timeout, sent while paused, plus the switchover; rounded up to the millisecond.
  const double B = base;
  if (B > 0) {
    const double M = static_cast<double>(vm.memory);
    double x = M, t = 0, best = std::numeric_limits<double>::infinity();
    for (uint32_t pass = 0; pass <= s.max_passes; ++pass) {
      if (t + x / B > s.completion_timeout) break;
      best = std::min(best, x);
      if (x <= 0) break;
      const double dt = x / B;
      t += dt;
      const double next = std::min(vm.dirty_rate * dt, M);
      if (next >= x) break;  // no pass will leave less
      x = next;
    }
    if (std::isfinite(best)) {
      MigrationSettings larger = s;
      larger.accepted_downtime = std::ceil((best / B + s.switchover) * 1000 - 1e-6) / 1000;
      auto p = predict(vm, path, larger);
      if (!p.within_limits) {  // the remainder sat just above the rounded limit
        larger.accepted_downtime += 0.001;
        p = predict(vm, path, larger);
      }
      if (larger.accepted_downtime > s.accepted_downtime) {
        if (p.within_limits) {
          r.larger_downtime = p;
          r.downtime_needed = larger.accepted_downtime;
        }
      }
    }
  }
  return r;
}

}  // namespace rdmig::forecast
