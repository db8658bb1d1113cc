#include "kubevirt/kubevirt_metrics.h"

namespace rdmig::kubevirt {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

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
                         .Register(*m.registry())) {
  // The label values that alerts and the dashboard take increase() of exist from start-up, at 0:
  // increase() cannot see the increment that creates a series (see kFailureReasons in metrics.h).
  for (const char* decision : {"carried", "skipped", "error"}) hook_calls_.Add({{"decision", decision}});
  for (const char* role : {"source", "target"}) {
    for (const char* result : {"Succeeded", "Failed", "NotCarried"}) migrations_.Add({{"role", role}, {"result", result}});
  }
  for (const char* action : {"carried", "refused"}) plaintext_.Add({{"action", action}});
  for (const char* transport : kTransports) downtime_.Add({{"transport", transport}}, downtime_buckets());
}

void KubevirtMetrics::hook_call(const std::string& decision) { hook_calls_.Add({{"decision", decision}}).Increment(); }

void KubevirtMetrics::set_active(double n) { active_.Add({}).Set(n); }

void KubevirtMetrics::finished(const FlowRecord& r) {
  std::lock_guard lock(mu_);
  migrations_.Add({{"role", r.role}, {"result", r.phase}}).Increment();
  if (!r.plaintext.empty()) plaintext_.Add({{"action", r.plaintext}}).Increment();
  if (r.vmi.name.empty()) return;
  const std::map<std::string, std::string> vm{{"namespace", r.vmi.namespace_}, {"name", r.vmi.name}, {"role", r.role}};
  // The carried gauge goes last: a scrape that sees it sees the migration's other series too
  // (the registry is read without this lock; seen in the Soft-RoCE VM: carried, but no bytes).
  if (!r.carried) {
    set_gauge(vm_carried_, vm, 0);
    return;
  }
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
  drop(vm_carried_, vm);
}

}  // namespace rdmig::kubevirt
