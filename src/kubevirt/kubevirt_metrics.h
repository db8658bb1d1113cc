// Metrics of KubeVirt mode, registered in the agent's registry. Per-VMI series carry the
// labels namespace/name (as KubeVirt's own migration metrics do) and are removed when the
// agent forgets the migration, so their number stays bounded by the history size.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <map>
#include <mutex>
#include <string>

#include "kubevirt/flow_record.h"
#include "metrics/metrics.h"

namespace rdmig::kubevirt {

class KubevirtMetrics {
 public:
  explicit KubevirtMetrics(Metrics& metrics);
  void hook_call(const std::string& decision);  // carried | skipped | error
  // A migration ended (record terminal): counters, downtime histogram, per-VMI gauges.
  void finished(const FlowRecord& r);
  // The migration left the history: its per-VMI series go too.
  void forget(const FlowRecord& r);
  void set_active(double n);

 private:
  prometheus::Family<prometheus::Counter>& hook_calls_;
  prometheus::Family<prometheus::Counter>& migrations_;
  prometheus::Family<prometheus::Counter>& plaintext_;
  prometheus::Family<prometheus::Gauge>& active_;
  prometheus::Family<prometheus::Histogram>& downtime_;
  // Registered (and so collected) before the other per-VMI series, and set after them: a scrape
  // that sees a VMI's carried series sees the rest of that migration's series too.
  prometheus::Family<prometheus::Gauge>& vm_carried_;
  prometheus::Family<prometheus::Gauge>& vm_bytes_;
  prometheus::Family<prometheus::Gauge>& vm_throughput_;
  prometheus::Family<prometheus::Gauge>& vm_downtime_;
  prometheus::Family<prometheus::Gauge>& vm_total_time_;
  std::mutex mu_;
};

}  // namespace rdmig::kubevirt
