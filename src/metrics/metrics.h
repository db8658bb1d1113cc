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

#include <map>
#include <memory>
#include <mutex>
#include <string>

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

// Per-migration gauges, removed when the agent forgets the migration.
struct MigrationGauges {
  prometheus::Gauge* throughput = nullptr;
  prometheus::Gauge* transferred = nullptr;
  prometheus::Gauge* remaining = nullptr;
  prometheus::Gauge* total = nullptr;
  prometheus::Gauge* dirty_rate = nullptr;
};

// rdmig_build_info{version,revision} 1: which build a program runs (common/version.h).
void register_build_info(prometheus::Registry& registry);
// Bucket bounds of every downtime histogram (rdmig_downtime_seconds, rdmig_kubevirt_downtime_seconds).
prometheus::Histogram::BucketBoundaries downtime_buckets();

class Metrics {
 public:
  explicit Metrics(std::string component = "agent");
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  // The Prometheus text exposition format of everything registered.
  std::string serialize() const;

  void migration_started(const std::string& role);
  void migration_finished(const std::string& role, const std::string& result,
                          double duration_seconds);
  // A failed migration's reason, from a fixed set (see rdmig_migration_failures_total).
  void migration_failed(const std::string& role, const std::string& reason);
  void set_downtime(const std::string& vm, const std::string& transport, double qemu_seconds);
  void set_switchover(const std::string& vm, const std::string& transport, double seconds);

  TransportMetrics& transport(const std::string& kind);
  void transport_error(const std::string& transport, const std::string& kind);
  void transport_selected(const std::string& transport, const std::string& reason);
  void set_rdma_devices(double count);

  MigrationGauges migration_gauges(const std::string& id, const std::string& role,
                                   const std::string& vm);
  void remove_migration_gauges(const MigrationGauges& gauges);

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
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Counter>& chunks_;
  prometheus::Family<prometheus::Counter>& credit_stalls_;
  prometheus::Family<prometheus::Gauge>& in_flight_;
  prometheus::Family<prometheus::Histogram>& chunk_size_;
  prometheus::Family<prometheus::Histogram>& chunk_latency_;
  prometheus::Family<prometheus::Counter>& transport_errors_;
  prometheus::Family<prometheus::Counter>& transport_selected_;
  prometheus::Family<prometheus::Gauge>& rdma_devices_;
  prometheus::Family<prometheus::Gauge>& throughput_;
  prometheus::Family<prometheus::Gauge>& transferred_;
  prometheus::Family<prometheus::Gauge>& remaining_;
  prometheus::Family<prometheus::Gauge>& total_;
  prometheus::Family<prometheus::Gauge>& dirty_rate_;

  std::mutex mu_;  // guards transports_ creation (not the hot path: pointers are cached)
  std::map<std::string, TransportMetrics> transports_;
};

}  // namespace rdmig
