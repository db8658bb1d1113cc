// The migration forecast: how long one VM's pre-copy migration takes, how long the guest is
// paused, and whether it converges, from its memory, its measured dirty rate and the measured
// throughput of its path. This is the one place the model lives; docs/drain.md gives the same
// formulas with a worked example.
//
// Path throughput with c channels of chunk size s (each channel keeps `ring_depth` chunks in
// flight), from a path check that measured T bytes/s with c0 channels and a round trip rtt:
//   per channel   b    = min(T / c0, ring_depth * s / rtt)        (window bound; rtt 0: none)
//   migration     B(c) = min(c * b, capacity)     capacity: the path's, else T (no gain assumed
//                                                 past what was measured)
//   sharing       B_k  = min(B(c), capacity / k, max_bandwidth)  with k migrations on the path
//                 at once; max_bandwidth: QEMU's max-bandwidth, or QEMU's own send rate on the
//                 node where that is lower than the path's (0: no cap)
// Pre-copy (QEMU's RAM iterations), dirty rate D, memory M, QEMU's downtime-limit
// L_q = accepted downtime - switchover:
//   pass 0 sends x0 = M; pass i+1 sends what was dirtied while pass i ran:
//   x(i+1) = min(D * x(i) / B, M)  (with auto-converge D is scaled by (1 - throttle))
//   QEMU stops the guest once x(n) <= B * L_q; downtime = x(n) / B + switchover;
//   total = sum(x(0..n)) / B + switchover.  With r = D / B < 1, x(i) = M r^i and
//   n = ceil(log(B L_q / M) / log r); r >= 1 never shrinks: no convergence.
//   Converges within limits: it stops before the completion timeout (and max_passes).
// Remedies, each with its predicted figures: post-copy (one pass, then the guest runs on the
// target and pulls the pages dirtied meanwhile), auto-converge (QEMU's vCPU throttle, as
// migration_trigger_throttle: every second pass that dirtied more than half of what it sent
// raises it, to 20% first, then by 10%, at most 99%; D scales by 1 - throttle), more channels (the fewest up to max_channels that converge), a larger downtime (the
// least accepted downtime that converges within the timeout).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace rdmig::forecast {

// What the path check measured between the two nodes.
struct PathMeasure {
  double throughput = 0;           // bytes/s the check carried (T)
  uint32_t channels = 1;           // channels the check used (c0)
  double rtt_seconds = 0;          // round trip; 0: unknown (no window bound)
  double capacity = 0;             // bytes/s the path can carry with any channel count; 0: T
};

struct MigrationSettings {
  uint32_t channels = 1;                 // data channels (QEMU main + multifd)
  uint64_t chunk_size = 4ull << 20;      // bytes per chunk
  uint32_t ring_depth = 16;              // chunks in flight per channel
  double accepted_downtime = 0.3;        // seconds the operator accepts
  double switchover = 0.02;              // seconds: stop vCPUs, device state, start on the target
  double completion_timeout = 150;       // seconds the migration may run at most
  uint32_t max_passes = 1000;            // pre-copy passes at most (a bound on the loop)
  bool auto_converge = false;
  uint32_t concurrent = 1;               // migrations sharing the path (k)
  double max_bandwidth = 0;              // bytes/s a migration sends at most (0: no cap)
};

struct VmInput {
  uint64_t memory = 0;                   // bytes (M)
  double dirty_rate = 0;                 // bytes/s (D)
};

struct Prediction {
  bool converges = false;    // stops within the completion timeout and max_passes
  bool within_limits = false;  // converges and downtime <= accepted_downtime
  uint32_t passes = 0;       // pre-copy passes before the stop (pass 0 included)
  double total_seconds = 0;  // converged: until the guest runs on the target; else: until the timeout
  double downtime_seconds = 0;  // converged: the predicted pause; else the pause a stop at the timeout would cost
  double throughput = 0;     // B_k, bytes/s
  uint64_t bytes = 0;        // bytes sent
  double max_throttle = 0;   // auto-converge: the vCPU throttle reached (0..0.99)
  std::string reason;        // why it does not converge ("" when it does)
};

// The migration's throughput on the path: B_k above.
double path_throughput(const PathMeasure& path, const MigrationSettings& s);

// One migration, pre-copy as configured.
Prediction predict(const VmInput& vm, const PathMeasure& path, const MigrationSettings& s);

// Remedies for a VM that does not converge within its limits (each unset when it does not help).
struct Remedies {
  std::optional<Prediction> postcopy;
  std::optional<Prediction> auto_converge;
  std::optional<Prediction> more_channels;
  uint32_t channels_needed = 0;          // with more_channels
  std::optional<Prediction> larger_downtime;
  double downtime_needed = 0;            // seconds, with larger_downtime
};
Remedies remedies(const VmInput& vm, const PathMeasure& path, const MigrationSettings& s, uint32_t max_channels);

// Post-copy after the first pass: downtime = switchover, total = M / B + min(D * M / B, M) / B +
// switchover; the guest runs on the target while the rest is pulled (a link failure then loses it).
Prediction predict_postcopy(const VmInput& vm, const PathMeasure& path, const MigrationSettings& s);

}  // namespace rdmig::forecast
