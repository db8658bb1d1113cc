// rdmig's Prometheus metrics (prefix rdmig_, base units). One instance per process, created
// in main and passed by reference; the text format comes from prometheus-cpp's serializer.
// Every counter/gauge here is lock-free to update (atomics); histogram observations take a
// short per-histogram lock that only the /metrics scrape shares.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace rdmig {

// Counters the data path updates for one transport kind ("tcp" or "rdma").
class Metrics;

struct TransportMetrics {
  Metrics* owner = nullptr;  // for error counters by kind
  std::string kind;
  prometheus::Counter* bytes_sent = nullptr;
  prometheus::Counter* bytes_received = nullptr;
  prometheus::Counter* chunks_sent = nullptr;
  prometheus::Counter* chunks_received = nullptr;
  prometheus::Counter* credit_stalls = nullptr;
  prometheus::Gauge* chunks_in_flight = nullptr;
  prometheus::Histogram* chunk_size = nullptr;
  prometheus::Histogram* chunk_write_latency = nullptr;
};

// Per-migration gauges, removed when the agent forgets the migration. `info`, `end_time` and
// `ended` change with the migration's phase (Metrics::migration_phase / migration_ended, under
// the Metrics' lock); the figures are set by the job's worker alone.
struct MigrationGauges {
  prometheus::Gauge* throughput = nullptr;
  prometheus::Gauge* transferred = nullptr;
  prometheus::Gauge* remaining = nullptr;
  prometheus::Gauge* total = nullptr;
  prometheus::Gauge* dirty_rate = nullptr;
  prometheus::Gauge* start_time = nullptr;  // rdmig_migration_start_time_seconds
  prometheus::Gauge* end_time = nullptr;    // rdmig_migration_end_time_seconds, once ended
  prometheus::Gauge* info = nullptr;        // rdmig_migration_info{...,phase,transport} 1
  std::map<std::string, std::string> labels;  // migration, role, namespace (when the VM has one), name
  bool ended = false;
};

// The fixed label values of the counters that alerts take increase() of. Their series exist
// from start-up (at 0), because increase() cannot see the increment that creates a series: the
// first failure or fallback after an agent starts would never alert. A value outside these sets
// is counted under "other".
// rdmig_migration_failures_total{reason}: Job::failure_of and Job::finish's explicit reasons.
inline constexpr const char* kFailureReasons[] = {"timeout", "io", "peer_lost", "qemu", "protocol",
                                                   "target_failed", "vm_paused_on_source", "postcopy_split",
                                                   "other"};
// rdmig_transport_selected_total{transport,reason}: what migration::choose_transport answers
// (the target decides, the source counts the target's reason), the source's own names when a
// target names none (auto, auto-no-local-rdma), and "other" for anything else a peer sends.
struct TransportReason {
  const char* transport;
  const char* reason;
};
inline constexpr TransportReason kTransportReasons[] = {
    {"rdma", "auto-both-rdma"},     {"rdma", "requested"},         {"rdma", "auto"},
    {"rdma", "other"},              {"tcp", "auto-no-source-rdma"}, {"tcp", "auto-no-peer-rdma"},
    {"tcp", "auto-no-local-rdma"},  {"tcp", "target-requested-tcp"}, {"tcp", "requested"},
    {"tcp", "auto"},                {"tcp", "other"}};
// The two data-plane transports: their per-transport counters and histograms exist from start-up.
inline constexpr const char* kTransports[] = {"tcp", "rdma"};

// Sets a per-VM gauge (the last migration's figure). A series made here starts out holding `value`:
// Add() alone makes it at 0, and the registry is collected without the caller's lock, so a scrape
// between Add() and Set() would read 0 (seen in the Soft-RoCE VM: a carried KubeVirt migration
// scraped once as rdmig_kubevirt_migration_carried 0). A series that exists keeps the previous
// migration's figure until Set().
inline void set_gauge(prometheus::Family<prometheus::Gauge>& family, const std::map<std::string, std::string>& labels,
                      double value) {
  family.Add(labels, value).Set(value);
}

// rdmig_build_info{version,revision} 1: which build a program runs (common/version.h).
void register_build_info(prometheus::Registry& registry);
// Bucket bounds of every downtime histogram (rdmig_downtime_seconds, rdmig_kubevirt_downtime_seconds).
prometheus::Histogram::BucketBoundaries downtime_buckets();

// rdmig_rdma_selected: the RDMA device, port, netdev, address and GID this agent chose (value
// 1, reason "ok"), or why it chose none (value 0, reason no-device, no-address, gid-not-found,
// transport-tcp, listener-failed; the other labels empty).
struct RdmaSelectionInfo {
  std::string reason;
  std::string device;
  std::string device_port;
  std::string netdev;
  std::string address;
  std::string gid_index;
  std::string gid_type;
};

class Metrics {
 public:
  explicit Metrics(std::string component = "agent");
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  // The Prometheus text exposition format of everything registered; runs the on_scrape
  // callbacks first.
  std::string serialize() const;
  // A callback that refreshes gauges read from the outside world (the node hook's socket) just
  // before each scrape. Set up at start, before the API serves.
  void on_scrape(std::function<void()> fn);

  void migration_started(const std::string& role);
  void migration_finished(const std::string& role, const std::string& result,
                          double duration_seconds);
  // A failed migration's reason, from a fixed set (see rdmig_migration_failures_total).
  void migration_failed(const std::string& role, const std::string& reason);
  void set_downtime(const std::string& vm, const std::string& transport, double qemu_seconds);
  void set_switchover(const std::string& vm, const std::string& transport, double seconds);
  // Post-copy (source): rdmig_postcopy_switches_total{transport,trigger} at the switch; at the end
  // rdmig_postcopy_phase_seconds{transport} and rdmig_postcopy_page_requests_total{transport}.
  void postcopy_switched(const std::string& transport, const std::string& trigger);
  void postcopy_ended(const std::string& transport, double phase_seconds,
                      uint64_t page_requests);
  // Post-copy (target): rdmig_last_postcopy_blocktime_seconds{name}, the target QEMU's
  // postcopy-blocktime (all vCPUs waiting on pages) of the last migration of each VM.
  void set_postcopy_blocktime(const std::string& vm, double seconds);

  // `traffic`: "migration" or "pathcheck" (the label that tells a path check's bytes apart).
  TransportMetrics& transport(const std::string& kind, const std::string& traffic = "migration");
  void transport_error(const std::string& transport, const std::string& kind);
  // rdmig_failovers_total{role, transport, peer, to}: one data channel (or the control connection) of a
  // migration failed over (docs/failover.md); `transport` is the link that failed, `to` the path it
  // resumed on (rail: an RDMA rail's own address; address: an alternate address of a rail's device; tcp); `peer` is the other agent's data-plane address, so that
  // a flapping node pair shows (alert RdmigRepeatedFailovers).
  void failover(const std::string& role, const std::string& transport, const std::string& peer,
                const std::string& to = "tcp");
  // rdmig_tls_channels_total{mode}: one TCP data channel ran TLS; mode kernel|kernel_send|user_space.
  void tls_channel(const std::string& mode);
  void pathcheck_started(const std::string& role);
  // `phase`: the check's terminal phase (Succeeded, Failed, Cancelled).
  void pathcheck_finished(const std::string& role, const std::string& phase);
  void transport_selected(const std::string& transport, const std::string& reason);
  void set_rdma_devices(double count);
  // Replaces the one rdmig_rdma_selected series.
  void set_rdma_selection(const RdmaSelectionInfo& info);
  // rdmig_rdma_rail_up{rail,device,netdev,address,reason}: one series per configured rail, 1 when
  // it is used (reason ok), 0 with why not (same reasons as rdmig_rdma_selected).
  void set_rdma_rail(const std::string& rail, const RdmaSelectionInfo& info);
  // rdmig_rdma_rail_bytes_total{rail,device,direction,traffic}: payload bytes carried over one
  // rail (sent or received), added as a migration's or path check's channels move them.
  void add_rail_bytes(const std::string& rail, const std::string& device, const std::string& direction,
                      const std::string& traffic, uint64_t bytes);
  // rdmig_rdma_rail_chunks_total{rail,device,direction,traffic}: chunks carried over one rail.
  void add_rail_chunks(const std::string& rail, const std::string& device, const std::string& direction,
                       const std::string& traffic, uint64_t chunks);

  // A migration's gauges, its start time (now) and its info series (phase Pending, no transport).
  MigrationGauges migration_gauges(const std::string& id, const std::string& role,
                                   const std::string& vm);
  // The info series follows the phase and the chosen transport ("" until chosen); ignored once
  // the migration has ended, so a late phase change never overwrites the result.
  void migration_phase(MigrationGauges& gauges, const std::string& phase, const std::string& transport);
  // The terminal phase and the end time (now).
  void migration_ended(MigrationGauges& gauges, const std::string& phase, const std::string& transport);
  void remove_migration_gauges(MigrationGauges& gauges);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& started_;
  prometheus::Family<prometheus::Counter>& finished_;
  prometheus::Family<prometheus::Counter>& failures_;
  prometheus::Family<prometheus::Counter>& left_paused_;
  prometheus::Family<prometheus::Gauge>& active_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Histogram>& downtime_;
  prometheus::Family<prometheus::Gauge>& last_downtime_;
  prometheus::Family<prometheus::Histogram>& switchover_;
  prometheus::Family<prometheus::Gauge>& last_switchover_;
  prometheus::Family<prometheus::Counter>& postcopy_switches_;
  prometheus::Family<prometheus::Histogram>& postcopy_phase_;
  prometheus::Family<prometheus::Counter>& postcopy_requests_;
  prometheus::Family<prometheus::Gauge>& last_postcopy_blocktime_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Counter>& chunks_;
  prometheus::Family<prometheus::Counter>& credit_stalls_;
  prometheus::Family<prometheus::Gauge>& in_flight_;
  prometheus::Family<prometheus::Histogram>& chunk_size_;
  prometheus::Family<prometheus::Histogram>& chunk_latency_;
  prometheus::Family<prometheus::Counter>& transport_errors_;
  prometheus::Family<prometheus::Counter>& failovers_;
  prometheus::Family<prometheus::Counter>& transport_selected_;
  prometheus::Family<prometheus::Counter>& tls_channels_;
  prometheus::Family<prometheus::Gauge>& rdma_devices_;
  prometheus::Family<prometheus::Gauge>& rdma_selected_;
  prometheus::Gauge* rdma_selected_series_ = nullptr;
  prometheus::Family<prometheus::Gauge>& rail_up_;
  prometheus::Family<prometheus::Counter>& rail_bytes_;
  prometheus::Family<prometheus::Counter>& rail_chunks_;
  prometheus::Family<prometheus::Gauge>& throughput_;
  prometheus::Family<prometheus::Gauge>& transferred_;
  prometheus::Family<prometheus::Gauge>& remaining_;
  prometheus::Family<prometheus::Gauge>& total_;
  prometheus::Family<prometheus::Gauge>& dirty_rate_;
  prometheus::Family<prometheus::Gauge>& info_;
  prometheus::Family<prometheus::Gauge>& start_time_;
  prometheus::Family<prometheus::Gauge>& end_time_;
  prometheus::Family<prometheus::Counter>& pathchecks_started_;
  prometheus::Family<prometheus::Counter>& pathchecks_finished_;

  void set_info(MigrationGauges& gauges, const std::string& phase, const std::string& transport);

  // Guards transports_ (lookup and creation in transport(); any thread that opens a channel).
  // Not the hot path: callers cache the TransportMetrics& it returns. Never held with info_mu_.
  std::mutex mu_;  // guards transports_ creation (not the hot path: pointers are cached)
  // Guards, in every MigrationGauges, the fields info, end_time, ended and labels, and the
  // Add/Remove of those series in info_ and end_time_: migration_gauges, migration_phase,
  // migration_ended and remove_migration_gauges (job, session and REST threads). Never held
  // with mu_.
  std::mutex info_mu_;  // guards the info/end_time pointers of every MigrationGauges
  std::map<std::string, TransportMetrics> transports_;
  // Not under either mutex: on_scrape_ is filled during start-up wiring, before serving, and
  // rdma_selected_series_ is set by set_rdma_selection() from DataPlaneServer::start().
  std::vector<std::function<void()>> on_scrape_;
};

}  // namespace rdmig
