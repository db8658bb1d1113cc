#include "metrics/metrics.h"
#include "common/version.h"

#include <prometheus/text_serializer.h>

#include <chrono>
#include <sstream>

namespace rdmig {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

namespace {
prometheus::Histogram::BucketBoundaries duration_buckets() {
  // Measured: 50 ms (idle guests on loopback) to tens of minutes (large dirtying guests).
  return {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600};
}
prometheus::Histogram::BucketBoundaries chunk_size_buckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 4096; v <= 1024.0 * 1024 * 1024; v *= 4) b.push_back(v);
  return b;
}
prometheus::Histogram::BucketBoundaries latency_buckets() {
  return {1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 1};
}
double unix_seconds_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
// A VM's labels as KubeVirt's own migration metrics name them, so that one PromQL join relates
// both: "ns/name" (what the controller sends) gives namespace and name; a bare name (a migration
// created over REST without one) gives name only, and Prometheus then adds the scraped agent's
// namespace (honorLabels keeps an exported one).
std::map<std::string, std::string> vm_labels(const std::string& vm) {
  const auto slash = vm.find('/');
  if (slash == std::string::npos || slash == 0) return {{"name", vm}};
  return {{"namespace", vm.substr(0, slash)}, {"name", vm.substr(slash + 1)}};
}
std::string failure_label(const std::string& reason) {
  for (const char* r : kFailureReasons) {
    if (reason == r) return reason;
  }
  return "other";
}
}  // namespace

prometheus::Histogram::BucketBoundaries downtime_buckets() {
  // Measured downtimes start below a millisecond (idle guests); shared with the KubeVirt
  // histograms so one alert threshold is a bound of both.
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}

void register_build_info(prometheus::Registry& registry) {
  BuildGauge()
      .Name("rdmig_build_info")
      .Help("Always 1; the labels name the version and git revision of this program")
      .Register(registry)
      .Add({{"version", kVersion}, {"revision", kRevision}})
      .Set(1);
}

Metrics::Metrics(std::string component)
    : registry_(std::make_shared<prometheus::Registry>()),
      started_(BuildCounter().Name("rdmig_migrations_started_total")
                   .Help("Migrations started on this " + component + ", by role")
                   .Register(*registry_)),
      finished_(BuildCounter().Name("rdmig_migrations_finished_total")
                    .Help("Migrations finished, by role and result (succeeded, failed, cancelled)")
                    .Register(*registry_)),
      failures_(BuildCounter().Name("rdmig_migration_failures_total")
                    .Help("Migrations that failed, by role and reason (timeout, peer_lost, qemu, protocol, io, "
                          "target_failed, vm_paused_on_source, postcopy_split, other)")
                    .Register(*registry_)),
      left_paused_(BuildCounter().Name("rdmig_source_vms_left_paused_total")
                       .Help("Source migrations that ended with the VM paused on the source because the "
                             "target's verdict was lost or unsure: an operator must find where the VM runs")
                       .Register(*registry_)),
      active_(BuildGauge().Name("rdmig_migrations_active")
                  .Help("Migrations in progress, by role").Register(*registry_)),
      duration_(BuildHistogram().Name("rdmig_migration_duration_seconds")
                    .Help("Total migration time from start to result, by role and result")
                    .Register(*registry_)),
      downtime_(BuildHistogram().Name("rdmig_downtime_seconds")
                    .Help("Guest downtime as reported by QEMU on the source, by transport")
                    .Register(*registry_)),
      last_downtime_(BuildGauge().Name("rdmig_last_downtime_seconds")
                         .Help("QEMU-reported downtime of the last migration of each VM")
                         .Register(*registry_)),
      switchover_(BuildHistogram().Name("rdmig_switchover_seconds")
                      .Help("True switchover: source STOP event to target RESUME event")
                      .Register(*registry_)),
      last_switchover_(BuildGauge().Name("rdmig_last_switchover_seconds")
                           .Help("True switchover time of the last migration of each VM")
                           .Register(*registry_)),
      postcopy_switches_(BuildCounter().Name("rdmig_postcopy_switches_total")
                             .Help("Migrations the source agent switched to post-copy, by transport and trigger "
                                   "(after-first-pass, passes, seconds; kubevirt: a carried KubeVirt migration libvirt switched)")
                             .Register(*registry_)),
      postcopy_phase_(BuildHistogram().Name("rdmig_postcopy_phase_seconds")
                          .Help("Post-copy phase of completed migrations: the switch to completion, by transport")
                          .Register(*registry_)),
      postcopy_requests_(BuildCounter().Name("rdmig_postcopy_page_requests_total")
                             .Help("Page requests the target sent the source during post-copy (the source QEMU's "
                                   "ram.postcopy-requests), by transport")
                             .Register(*registry_)),
      last_postcopy_blocktime_(BuildGauge().Name("rdmig_last_postcopy_blocktime_seconds")
                                   .Help("Target QEMU's postcopy-blocktime (time all vCPUs waited on pages) of "
                                         "the last post-copy migration of each VM")
                                   .Register(*registry_)),
      bytes_(BuildCounter().Name("rdmig_transferred_bytes_total")
                 .Help("Bytes carried by the data plane, by transport, direction and traffic (migration, pathcheck)")
                 .Register(*registry_)),
      chunks_(BuildCounter().Name("rdmig_chunks_total")
                  .Help("Chunks carried by the data plane, by transport, direction (sent, received) and traffic (migration, pathcheck)")
                  .Register(*registry_)),
      credit_stalls_(BuildCounter().Name("rdmig_credit_stalls_total")
                         .Help("Times a sender waited because the receiver's ring had no free slot")
                         .Register(*registry_)),
      in_flight_(BuildGauge().Name("rdmig_chunks_in_flight")
                     .Help("Chunks written but not yet acknowledged, by transport")
                     .Register(*registry_)),
      chunk_size_(BuildHistogram().Name("rdmig_chunk_size_bytes")
                      .Help("Payload size of each chunk sent (early flush makes chunks smaller than the configured size)")
                      .Register(*registry_)),
      chunk_latency_(BuildHistogram().Name("rdmig_chunk_write_latency_seconds")
                         .Help("Time from posting a chunk to its completion, by transport")
                         .Register(*registry_)),
      transport_errors_(BuildCounter().Name("rdmig_transport_errors_total")
                            .Help("Data-plane errors, by transport and kind")
                            .Register(*registry_)),
      failovers_(BuildCounter().Name("rdmig_failovers_total")
                     .Help("Data channels of migrations that failed over to a new link (docs/failover.md), by role "
                           "transport (the link that failed), peer (the other agent's data-plane address) and to (the path it "
                           "resumed on: rail or tcp)")
                     .Register(*registry_)),
      transport_selected_(BuildCounter().Name("rdmig_transport_selected_total")
                              .Help("Transport chosen for a migration, by transport and reason")
                              .Register(*registry_)),
      tls_channels_(BuildCounter().Name("rdmig_tls_channels_total")
                        .Help("TCP data channels that ran TLS (dataPlane.tls: on), by where the records were "
                              "encrypted: kernel (kTLS both ways), kernel_send (kTLS sending only), user_space")
                        .Register(*registry_)),
      rdma_devices_(BuildGauge().Name("rdmig_rdma_devices")
                        .Help("RDMA devices on this node with an active port, seen at start (not necessarily "
                              "the one the agent uses: see rdmig_rdma_selected)")
                        .Register(*registry_)),
      rdma_selected_(BuildGauge().Name("rdmig_rdma_selected")
                         .Help("1: the RDMA device, port, netdev, address and GID this agent uses (reason ok); "
                               "0: it uses none, reason says why")
                         .Register(*registry_)),
      rail_up_(BuildGauge().Name("rdmig_rdma_rail_up")
                   .Help("1: this configured RDMA rail (rdma.devices[rail]) is used (reason ok); 0: it is left "
                         "out, reason says why")
                   .Register(*registry_)),
      rail_bytes_(BuildCounter().Name("rdmig_rdma_rail_bytes_total")
                      .Help("Payload bytes carried over each RDMA rail, by rail, device, direction (sent, "
                            "received) and traffic (migration, pathcheck)")
                      .Register(*registry_)),
      rail_chunks_(BuildCounter().Name("rdmig_rdma_rail_chunks_total")
                       .Help("Chunks carried over each RDMA rail, by rail, device, direction (sent, received) and "
                             "traffic (migration, pathcheck)")
                       .Register(*registry_)),
      throughput_(BuildGauge().Name("rdmig_migration_throughput_bytes_per_second")
                      .Help("Current throughput of each migration (QEMU's figure on the source)")
                      .Register(*registry_)),
      transferred_(BuildGauge().Name("rdmig_migration_transferred_bytes")
                       .Help("Bytes transferred so far by each migration").Register(*registry_)),
      remaining_(BuildGauge().Name("rdmig_migration_remaining_bytes")
                     .Help("Bytes QEMU still has to send for each migration").Register(*registry_)),
      total_(BuildGauge().Name("rdmig_migration_total_bytes")
                 .Help("Guest RAM size of each migration").Register(*registry_)),
      dirty_rate_(BuildGauge().Name("rdmig_migration_dirty_rate_bytes_per_second")
                      .Help("Guest memory dirty rate seen by QEMU for each migration")
                      .Register(*registry_)),
      info_(BuildGauge().Name("rdmig_migration_info")
                .Help("Always 1, one series per migration this agent still holds; labels: migration, role, vm, "
                      "phase (Pending, Connecting, Migrating, Recovering, Completing, Succeeded, Failed, Cancelled) and "
                      "transport (tcp, rdma; empty until chosen)")
                .Register(*registry_)),
      start_time_(BuildGauge().Name("rdmig_migration_start_time_seconds")
                      .Help("Unix time at which this agent took each migration it still holds")
                      .Register(*registry_)),
      end_time_(BuildGauge().Name("rdmig_migration_end_time_seconds")
                    .Help("Unix time at which each migration this agent still holds ended (absent while it runs)")
                    .Register(*registry_)),
      pathchecks_started_(BuildCounter().Name("rdmig_pathchecks_started_total")
                              .Help("Path checks this agent started, by role")
                              .Register(*registry_)),
      pathchecks_finished_(BuildCounter().Name("rdmig_pathchecks_finished_total")
                               .Help("Path checks this agent finished, by role and result (succeeded, failed, cancelled)")
                               .Register(*registry_)) {
  // Every label value an alert or a dashboard takes increase() of exists from start-up, at 0
  // (see kFailureReasons in metrics.h).
  left_paused_.Add({});
  for (const char* role : {"source", "target"}) {
    started_.Add({{"role", role}});
    active_.Add({{"role", role}});
    for (const char* result : {"succeeded", "failed", "cancelled"}) {
      finished_.Add({{"role", role}, {"result", result}});
      duration_.Add({{"role", role}, {"result", result}}, duration_buckets());
    }
    for (const char* reason : kFailureReasons) failures_.Add({{"role", role}, {"reason", reason}});
  }
  for (const auto& t : kTransportReasons) transport_selected_.Add({{"transport", t.transport}, {"reason", t.reason}});
  for (const char* role : {"source", "target"}) {
    pathchecks_started_.Add({{"role", role}});
    for (const char* result : {"succeeded", "failed", "cancelled"}) {
      pathchecks_finished_.Add({{"role", role}, {"result", result}});
    }
  }
  for (const char* kind : kTransports) {
    transport(kind);
    transport(kind, "pathcheck");
    downtime_.Add({{"transport", kind}}, downtime_buckets());
    switchover_.Add({{"transport", kind}}, downtime_buckets());
    postcopy_phase_.Add({{"transport", kind}}, duration_buckets());
    postcopy_requests_.Add({{"transport", kind}});
  }
  rdma_devices_.Add({});
}

void Metrics::on_scrape(std::function<void()> fn) { on_scrape_.push_back(std::move(fn)); }

std::string Metrics::serialize() const {
  for (const auto& fn : on_scrape_) fn();
  prometheus::TextSerializer serializer;
  std::ostringstream out;
  serializer.Serialize(out, registry_->Collect());
  return out.str();
}

void Metrics::migration_started(const std::string& role) {
  started_.Add({{"role", role}}).Increment();
  active_.Add({{"role", role}}).Increment();
}

void Metrics::migration_failed(const std::string& role, const std::string& reason) {
  failures_.Add({{"role", role}, {"reason", failure_label(reason)}}).Increment();
  if (reason == "vm_paused_on_source") left_paused_.Add({}).Increment();
}

void Metrics::migration_finished(const std::string& role, const std::string& result,
                                 double duration_seconds) {
  finished_.Add({{"role", role}, {"result", result}}).Increment();
  active_.Add({{"role", role}}).Decrement();
  duration_.Add({{"role", role}, {"result", result}}, duration_buckets()).Observe(duration_seconds);
}

void Metrics::set_downtime(const std::string& vm, const std::string& transport, double qemu_seconds) {
  downtime_.Add({{"transport", transport}}, downtime_buckets()).Observe(qemu_seconds);
  set_gauge(last_downtime_, vm_labels(vm), qemu_seconds);
}

void Metrics::set_switchover(const std::string& vm, const std::string& transport, double seconds) {
  switchover_.Add({{"transport", transport}}, downtime_buckets()).Observe(seconds);
  set_gauge(last_switchover_, vm_labels(vm), seconds);
}

void Metrics::postcopy_switched(const std::string& transport, const std::string& trigger) {
  postcopy_switches_.Add({{"transport", transport}, {"trigger", trigger}}).Increment();
}

void Metrics::postcopy_ended(const std::string& transport, double phase_seconds, uint64_t page_requests) {
  postcopy_phase_.Add({{"transport", transport}}, duration_buckets()).Observe(phase_seconds);
  postcopy_requests_.Add({{"transport", transport}}).Increment(static_cast<double>(page_requests));
}

void Metrics::set_postcopy_blocktime(const std::string& vm, double seconds) {
  set_gauge(last_postcopy_blocktime_, vm_labels(vm), seconds);
}

TransportMetrics& Metrics::transport(const std::string& kind, const std::string& traffic) {
  std::lock_guard lock(mu_);
  const std::string key = kind + "/" + traffic;
  auto it = transports_.find(key);
  if (it != transports_.end()) return it->second;
  TransportMetrics t;
  t.owner = this;
  t.kind = kind;
  // Bytes and chunks tell path checks from migrations; the latency, size and credit figures
  // describe the transport and are shared.
  t.bytes_sent = &bytes_.Add({{"transport", kind}, {"direction", "sent"}, {"traffic", traffic}});
  t.bytes_received = &bytes_.Add({{"transport", kind}, {"direction", "received"}, {"traffic", traffic}});
  t.chunks_sent = &chunks_.Add({{"transport", kind}, {"direction", "sent"}, {"traffic", traffic}});
  t.chunks_received = &chunks_.Add({{"transport", kind}, {"direction", "received"}, {"traffic", traffic}});
  t.credit_stalls = &credit_stalls_.Add({{"transport", kind}});
  t.chunks_in_flight = &in_flight_.Add({{"transport", kind}});
  t.chunk_size = &chunk_size_.Add({{"transport", kind}}, chunk_size_buckets());
  t.chunk_write_latency = &chunk_latency_.Add({{"transport", kind}}, latency_buckets());
  return transports_.emplace(key, t).first->second;
}

void Metrics::pathcheck_started(const std::string& role) { pathchecks_started_.Add({{"role", role}}).Increment(); }

void Metrics::pathcheck_finished(const std::string& role, const std::string& phase) {
  std::string result = phase == "Succeeded" ? "succeeded" : phase == "Cancelled" ? "cancelled" : "failed";
  pathchecks_finished_.Add({{"role", role}, {"result", result}}).Increment();
}

void Metrics::tls_channel(const std::string& mode) { tls_channels_.Add({{"mode", mode}}).Increment(); }

void Metrics::transport_error(const std::string& transport, const std::string& kind) {
  transport_errors_.Add({{"transport", transport}, {"kind", kind}}).Increment();
}

void Metrics::failover(const std::string& role, const std::string& transport, const std::string& peer,
                       const std::string& to) {
  failovers_.Add({{"role", role}, {"transport", transport}, {"peer", peer}, {"to", to}}).Increment();
}

void Metrics::transport_selected(const std::string& transport, const std::string& reason) {
  // The reason may come from the peer agent (the source counts the target's): only the fixed
  // pairs become label values.
  const std::string kind = transport == "rdma" ? "rdma" : "tcp";
  // "auto-no-peer-rdma:no-address" counts as auto-no-peer-rdma (the detail is in status and logs).
  const std::string base = reason.substr(0, reason.find(':'));
  std::string label = "other";
  for (const auto& t : kTransportReasons) {
    if (kind == t.transport && base == t.reason) label = base;
  }
  transport_selected_.Add({{"transport", kind}, {"reason", label}}).Increment();
}

void Metrics::set_rdma_devices(double count) { rdma_devices_.Add({}).Set(count); }

void Metrics::set_rdma_selection(const RdmaSelectionInfo& info) {
  if (rdma_selected_series_) rdma_selected_.Remove(rdma_selected_series_);
  rdma_selected_series_ = &rdma_selected_.Add({{"reason", info.reason},
                                               {"device", info.device},
                                               {"device_port", info.device_port},
                                               {"netdev", info.netdev},
                                               {"address", info.address},
                                               {"gid_index", info.gid_index},
                                               {"gid_type", info.gid_type}});
  rdma_selected_series_->Set(info.reason == "ok" ? 1 : 0);
}

void Metrics::set_rdma_rail(const std::string& rail, const RdmaSelectionInfo& info) {
  rail_up_.Add({{"rail", rail}, {"device", info.device}, {"netdev", info.netdev}, {"address", info.address},
                {"reason", info.reason}})
      .Set(info.reason == "ok" ? 1 : 0);
}

void Metrics::add_rail_bytes(const std::string& rail, const std::string& device, const std::string& direction,
                             const std::string& traffic, uint64_t bytes) {
  if (bytes == 0) return;
  rail_bytes_.Add({{"rail", rail}, {"device", device}, {"direction", direction}, {"traffic", traffic}})
      .Increment(static_cast<double>(bytes));
}

void Metrics::add_rail_chunks(const std::string& rail, const std::string& device, const std::string& direction,
                              const std::string& traffic, uint64_t chunks) {
  if (chunks == 0) return;
  rail_chunks_.Add({{"rail", rail}, {"device", device}, {"direction", direction}, {"traffic", traffic}})
      .Increment(static_cast<double>(chunks));
}

MigrationGauges Metrics::migration_gauges(const std::string& id, const std::string& role,
                                          const std::string& vm) {
  auto labels = vm_labels(vm);
  labels["migration"] = id;
  labels["role"] = role;
  MigrationGauges g;
  g.throughput = &throughput_.Add(labels);
  g.transferred = &transferred_.Add(labels);
  g.remaining = &remaining_.Add(labels);
  g.total = &total_.Add(labels);
  g.dirty_rate = &dirty_rate_.Add(labels);
  g.start_time = &start_time_.Add(labels);
  g.start_time->Set(unix_seconds_now());
  g.labels = labels;
  std::lock_guard lock(info_mu_);
  set_info(g, "Pending", "");
  return g;
}

void Metrics::set_info(MigrationGauges& g, const std::string& phase, const std::string& transport) {
  auto labels = g.labels;
  labels["phase"] = phase;
  labels["transport"] = transport;
  auto* info = &info_.Add(labels);
  if (info == g.info) return;
  if (g.info) info_.Remove(g.info);
  info->Set(1);
  g.info = info;
}

void Metrics::migration_phase(MigrationGauges& g, const std::string& phase, const std::string& transport) {
  std::lock_guard lock(info_mu_);
  if (!g.ended && !g.labels.empty()) set_info(g, phase, transport);
}

void Metrics::migration_ended(MigrationGauges& g, const std::string& phase, const std::string& transport) {
  std::lock_guard lock(info_mu_);
  if (g.ended || g.labels.empty()) return;
  set_info(g, phase, transport);
  g.end_time = &end_time_.Add(g.labels);
  g.end_time->Set(unix_seconds_now());
  g.ended = true;
}

void Metrics::remove_migration_gauges(MigrationGauges& g) {
  if (g.throughput) throughput_.Remove(g.throughput);
  if (g.transferred) transferred_.Remove(g.transferred);
  if (g.remaining) remaining_.Remove(g.remaining);
  if (g.total) total_.Remove(g.total);
  if (g.dirty_rate) dirty_rate_.Remove(g.dirty_rate);
  if (g.start_time) start_time_.Remove(g.start_time);
  std::lock_guard lock(info_mu_);
  if (g.info) info_.Remove(g.info);
  if (g.end_time) end_time_.Remove(g.end_time);
  g = MigrationGauges{};
}

}  // namespace rdmig
