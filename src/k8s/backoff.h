// Exponential backoff with a cap, for reconnecting watches and retrying API calls.
// Deterministic (no jitter source of its own) so it can be tested; callers that want jitter
// pass a fraction in [0, 1) to next().
#pragma once

#include <algorithm>
#include <chrono>

namespace rdmig::k8s {

class Backoff {
 public:
  using ms = std::chrono::milliseconds;
  Backoff(ms initial, ms max, double factor = 2.0) : initial_(initial), max_(max), factor_(factor) {}

  // The delay before the next attempt; grows by `factor` per call up to `max`. `jitter` in
  // [0, 1) adds up to that fraction of the delay.
  ms next(double jitter = 0.0) {
    const ms base = current_ == ms::zero() ? initial_ : current_;
    current_ = std::min(max_, ms(static_cast<long long>(static_cast<double>(base.count()) *
                                                        (current_ == ms::zero() ? 1.0 : factor_))));
    const double j = std::clamp(jitter, 0.0, 0.999);
    return std::min(max_, ms(current_.count() + static_cast<long long>(static_cast<double>(current_.count()) * j)));
  }
  // After a success: start again from `initial`.
  void reset() { current_ = ms::zero(); }

 private:
  ms initial_, max_;
  double factor_;
  ms current_ = ms::zero();
};

}  // namespace rdmig::k8s
