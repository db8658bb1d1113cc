#include "kubevirt/flow/kubevirt_metrics.h"

#include <chrono>
#include <utility>

namespace rdmig::kubevirt {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

namespace {
bool starts(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }
bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }
// libvirt's total time of KubeVirt migrations: a second or two for idle test guests, minutes for
// large dirtying ones (KubeVirt's completionTimeoutPerGiB is 150 s).
prometheus::Histogram::BucketBoundaries total_time_buckets() {
  return {0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600};
}
}  // namespace

std::string not_carried_code(const std::string& r) {
  // The texts of vmi.cpp's skip_reason() and relay_source.cpp's pre_migration_source(); the unit
  // test KubevirtMetrics.EveryNotCarriedReasonHasItsCode holds each one to its code.
  if (starts(r, "post-copy is allowed")) return "post_copy";
  if (starts(r, "cross-cluster")) return "decentralized";
  if (starts(r, "same-node migration")) return "same_node";
  if (starts(r, "this agent runs on ")) return "wrong_node";
  if (starts(r, "no targetNodeAddress") || starts(r, "targetNodeAddress")) return "no_target_address";
  if (starts(r, "no targetNode")) return "no_target_node";
  if (starts(r, "no memory or block port")) return "no_ports";
  if (starts(r, "no rdmig agent known")) return "no_peer_agent";
  if (starts(r, "the path to the agent on ")) return "peer_unhealthy";
  if (starts(r, "agent draining: ")) return "draining";
  if (starts(r, "the agent on ") && has(r, " declined: ") && has(r, "agent draining: ")) return "peer_draining";
  if (starts(r, "the agent on ") && has(r, " declined: ")) return "peer_declined";
  if (starts(r, "cannot reach the agent on ")) return "peer_unreachable";
  if (starts(r, "the hook caller is not ")) return "caller_refused";
  if (starts(r, "the API has no VMI") || starts(r, "cannot check the hook's VMI document") ||
      starts(r, "the API's VMI ") || starts(r, "the hook's VMI document does not match")) {
    return "api_check";
  }
  if (starts(r, "cannot find the network namespace")) return "no_handler_netns";
  return "other";
}

prometheus::Gauge& register_hook_serving(Metrics& m) {
  return BuildGauge()
      .Name("rdmig_kubevirt_hook_serving")
      .Help("1 while the node hook's socket (kubevirt.hookSocket) is this agent's listener, else 0: KubeVirt's "
            "Plugin cannot reach the agent, and with failureStrategy Ignore nothing is carried")
      .Register(*m.registry())
      .Add({}, 0);
}

KubevirtMetrics::KubevirtMetrics(Metrics& m)
    : hook_calls_(BuildCounter().Name("rdmig_kubevirt_hook_calls_total")
                      .Help("PreMigrationSource node-hook calls, by decision (carried, skipped, error)")
                      .Register(*m.registry())),
      migrations_(BuildCounter().Name("rdmig_kubevirt_migrations_total")
                      .Help("KubeVirt migrations seen by this agent, by role and result (Succeeded, Failed, NotCarried)")
                      .Register(*m.registry())),
      plaintext_(BuildCounter().Name("rdmig_kubevirt_plaintext_migrations_total")
                     .Help("KubeVirt migrations whose own TLS was off (disableTLS), seen by the source agent, by "
                           "action (carried, refused: kubevirt.plaintextMigrations)")
                     .Register(*m.registry())),
      active_(BuildGauge().Name("rdmig_kubevirt_migrations_active")
                  .Help("KubeVirt migrations this agent is carrying now").Register(*m.registry())),
      downtime_(BuildHistogram().Name("rdmig_kubevirt_downtime_seconds")
                    .Help("libvirt's downtime of carried KubeVirt migrations (read on the target), by transport")
                    .Register(*m.registry())),
      vm_carried_(BuildGauge().Name("rdmig_kubevirt_migration_carried")
                      .Help("1 when rdmig carried the last migration of each VMI, 0 when KubeVirt's own path did")
                      .Register(*m.registry())),
      vm_bytes_(BuildGauge().Name("rdmig_kubevirt_migration_bytes")
                    .Help("Bytes carried for the last migration of each VMI, by direction")
                    .Register(*m.registry())),
      vm_throughput_(BuildGauge().Name("rdmig_kubevirt_migration_throughput_bytes_per_second")
                         .Help("Average throughput of the last carried migration of each VMI")
                         .Register(*m.registry())),
      vm_downtime_(BuildGauge().Name("rdmig_kubevirt_migration_downtime_seconds")
                       .Help("libvirt's downtime of the last carried migration of each VMI")
                       .Register(*m.registry())),
      vm_total_time_(BuildGauge().Name("rdmig_kubevirt_migration_total_time_seconds")
                         .Help("libvirt's total time of the last carried migration of each VMI")
                         .Register(*m.registry())),
      not_carried_(BuildCounter().Name("rdmig_kubevirt_not_carried_total")
                       .Help("Migrations the node hook left to KubeVirt's own path, by reason code (post_copy, "
                             "same_node, peer_unreachable, ...; docs/metrics.md)")
                       .Register(*m.registry())),
      carried_(BuildCounter().Name("rdmig_kubevirt_carried_total")
                   .Help("KubeVirt migrations this agent carried (ended Succeeded or Failed), by role and transport")
                   .Register(*m.registry())),
      total_time_(BuildHistogram().Name("rdmig_kubevirt_total_time_seconds")
                      .Help("libvirt's total time of carried KubeVirt migrations (read on the target), by transport")
                      .Register(*m.registry())),
      vm_connections_(BuildGauge().Name("rdmig_kubevirt_migration_connections")
                          .Help("KubeVirt's connections (memory and block) carried in the last migration of each VMI")
                          .Register(*m.registry())),
      vm_info_(BuildGauge().Name("rdmig_kubevirt_migration_info")
                   .Help("The last migration of each VMI: source and target node, result (Succeeded, Failed, "
                         "NotCarried), transport and why, and the not-carried reason code; the value is its end "
                         "time (unix seconds)")
                   .Register(*m.registry())) {
  // The label values that alerts and the dashboard take increase() of exist from start-up, at 0:
  // increase() cannot see the increment that creates a series (see kFailureReasons in metrics.h).
  for (const char* decision : {"carried", "skipped", "error"}) hook_calls_.Add({{"decision", decision}});
  for (const char* role : {"source", "target"}) {
    for (const char* result : {"Succeeded", "Failed", "NotCarried"}) migrations_.Add({{"role", role}, {"result", result}});
  }
  for (const char* transport : kTransports) {
    downtime_.Add({{"transport", transport}}, downtime_buckets());
    total_time_.Add({{"transport", transport}}, total_time_buckets());
    for (const char* role : {"source", "target"}) carried_.Add({{"role", role}, {"transport", transport}});
  }
  for (const char* reason : kNotCarriedReasons) not_carried_.Add({{"reason", reason}});
  for (const char* action : {"carried", "refused"}) plaintext_.Add({{"action", action}});
}

void KubevirtMetrics::hook_call(const std::string& decision) { hook_calls_.Add({{"decision", decision}}).Increment(); }

void KubevirtMetrics::hook_not_carried(const std::string& reason) {
  not_carried_.Add({{"reason", not_carried_code(reason)}}).Increment();
}

void KubevirtMetrics::set_active(double n) { active_.Add({}).Set(n); }

void KubevirtMetrics::finished(const FlowRecord& r) {
  std::lock_guard lock(mu_);
  migrations_.Add({{"role", r.role}, {"result", r.phase}}).Increment();
  if (r.carried && (r.phase == "Succeeded" || r.phase == "Failed") && !r.transport.empty()) {
    carried_.Add({{"role", r.role}, {"transport", r.transport}}).Increment();
    if (r.role == "target" && r.libvirt && r.libvirt->total_time_ms >= 0) {
      total_time_.Add({{"transport", r.transport}}, total_time_buckets())
          .Observe(static_cast<double>(r.libvirt->total_time_ms) / 1000.0);
    }
  }
  if (!r.plaintext.empty()) plaintext_.Add({{"action", r.plaintext}}).Increment();
  if (r.vmi.name.empty()) return;
  const std::map<std::string, std::string> vm{{"namespace", r.vmi.namespace_}, {"name", r.vmi.name}, {"role", r.role}};
  // The info series of this migration replaces the VMI's previous one (other label values).
  const auto key = std::make_tuple(r.vmi.namespace_, r.vmi.name, r.role);
  if (auto it = info_series_.find(key); it != info_series_.end()) {
    vm_info_.Remove(it->second);
    info_series_.erase(it);
  }
  auto info = vm;
  info["source_node"] = r.source_node;
  info["target_node"] = r.target_node;
  info["result"] = r.phase;
  info["transport"] = r.carried ? r.transport : "";
  info["transport_reason"] = r.carried ? r.transport_reason : "";
  info["reason"] = r.phase == "NotCarried" ? not_carried_code(r.reason) : "";
  const double ended = r.finished_at_ms > 0 ? static_cast<double>(r.finished_at_ms) / 1000.0
                                            : std::chrono::duration<double>(
                                                  std::chrono::system_clock::now().time_since_epoch()).count();
  info_series_[key] = &vm_info_.Add(info, ended);
  info_series_[key]->Set(ended);
  // The carried gauge goes last: a scrape that sees it sees the migration's other series too
  // (the registry is read without this lock; seen in the Soft-RoCE VM: carried, but no bytes).
  if (!r.carried) {
    set_gauge(vm_carried_, vm, 0);
    return;
  }
  set_gauge(vm_connections_, vm, static_cast<double>(r.connections));
  auto sent = vm;
  sent["direction"] = "sent";
  auto received = vm;
  received["direction"] = "received";
  set_gauge(vm_bytes_, sent, static_cast<double>(r.bytes_sent));
  set_gauge(vm_bytes_, received, static_cast<double>(r.bytes_received));
  set_gauge(vm_throughput_, vm, r.throughput_bytes_per_second);
  if (r.libvirt && r.libvirt->downtime_ms >= 0) {
    set_gauge(vm_downtime_, vm, static_cast<double>(r.libvirt->downtime_ms) / 1000.0);
    if (r.role == "target") {
      downtime_.Add({{"transport", r.transport}}, downtime_buckets())
          .Observe(static_cast<double>(r.libvirt->downtime_ms) / 1000.0);
    }
  }
  if (r.libvirt && r.libvirt->total_time_ms >= 0) {
    set_gauge(vm_total_time_, vm, static_cast<double>(r.libvirt->total_time_ms) / 1000.0);
  }
  set_gauge(vm_carried_, vm, r.phase == "Succeeded" ? 1 : 0);
}

void KubevirtMetrics::forget(const FlowRecord& r) {
  if (r.vmi.name.empty()) return;
  std::lock_guard lock(mu_);
  const std::map<std::string, std::string> vm{{"namespace", r.vmi.namespace_}, {"name", r.vmi.name}, {"role", r.role}};
  auto drop = [&](prometheus::Family<prometheus::Gauge>& f, const std::map<std::string, std::string>& labels) {
    if (f.Has(labels)) f.Remove(&f.Add(labels));
  };
  auto sent = vm;
  sent["direction"] = "sent";
  auto received = vm;
  received["direction"] = "received";
  drop(vm_bytes_, sent);
  drop(vm_bytes_, received);
  drop(vm_throughput_, vm);
  drop(vm_downtime_, vm);
  drop(vm_total_time_, vm);
  drop(vm_connections_, vm);
  drop(vm_carried_, vm);
  if (auto it = info_series_.find(std::make_tuple(r.vmi.namespace_, r.vmi.name, r.role)); it != info_series_.end()) {
    vm_info_.Remove(it->second);
    info_series_.erase(it);
  }
}

}  // namespace rdmig::kubevirt
