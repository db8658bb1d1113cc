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
#include <tuple>

#include "kubevirt/flow/flow_record.h"
#include "metrics/metrics.h"

namespace rdmig::kubevirt {

// rdmig_kubevirt_not_carried_total{reason}: why the node hook left a migration to KubeVirt's own
// path, as a short fixed code (the record's reason text says more). post_copy, same_node and
// decentralized are by design (the alert RdmigKubevirtNotCarried leaves them out by default); the
// others are faults or missing pieces (docs/troubleshooting.md, "The dashboard says not carried").
inline constexpr const char* kNotCarriedReasons[] = {
    "post_copy",        "decentralized",   "same_node",     "wrong_node",     "no_target_address",
    "no_target_node",   "no_ports",        "no_peer_agent", "peer_unhealthy", "peer_declined",
    "peer_unreachable", "caller_refused",  "api_check",     "no_handler_netns", "draining",
    "peer_draining",    "other"};
// The code of a not-carried reason text (what relay_source.cpp and vmi.cpp's skip_reason() say).
std::string not_carried_code(const std::string& reason);

// rdmig_kubevirt_hook_serving: 1 while the node hook's socket path is this agent's listening
// socket, else 0 (the file was removed or replaced, or no hookSocket is configured). Registered
// only in KubeVirt mode; main sets it at each scrape (Metrics::on_scrape).
prometheus::Gauge& register_hook_serving(Metrics& metrics);

class KubevirtMetrics {
 public:
  explicit KubevirtMetrics(Metrics& metrics);
  void hook_call(const std::string& decision);  // carried | skipped | error
  // A skipped hook call's reason text, counted under its code (not_carried_code).
  void hook_not_carried(const std::string& reason);
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
  prometheus::Family<prometheus::Counter>& not_carried_;
  prometheus::Family<prometheus::Counter>& carried_;
  prometheus::Family<prometheus::Histogram>& total_time_;
  prometheus::Family<prometheus::Gauge>& vm_connections_;
  // rdmig_kubevirt_migration_info: one series per VMI and role, its labels those of the last
  // migration (nodes, result, transport and why, reason code); replaced at each migration.
  prometheus::Family<prometheus::Gauge>& vm_info_;
  std::map<std::tuple<std::string, std::string, std::string>, prometheus::Gauge*> info_series_;
  // Guards info_series_ and makes finished() and forget() one step each for the per-VMI series
  // (a forget never interleaves with a finished of the same VMI). Taken by the relay's threads
  // that end or drop a migration (control threads, maintenance loop). Scrapes read the
  // registry without it (hence the order finished() sets the series in). No lock under it.
  std::mutex mu_;
};

}  // namespace rdmig::kubevirt
