#include "qemu/qmp_protocol.h"

#include <cmath>
#include <limits>
#include "common/json_limits.h"

namespace rdmig::qemu {

using nlohmann::json;

Result<QmpMessage> parse_qmp_message(std::string_view line) {
  json j = parse_json_bounded(line);
  if (j.is_discarded() || !j.is_object()) {
    return Error{Errc::kProtocol, "QMP: not a JSON object: " + std::string(line.substr(0, 200))};
  }
  QmpMessage m;
  if (auto it = j.find("QMP"); it != j.end()) {
    m.kind = QmpMessageKind::kGreeting;
    m.value = *it;
    return m;
  }
  if (auto it = j.find("event"); it != j.end()) {
    if (!it->is_string()) return Error{Errc::kProtocol, "QMP: event name is not a string"};
    m.kind = QmpMessageKind::kEvent;
    m.event = it->get<std::string>();
    m.value = j.value("data", json::object());
    if (auto ts = j.find("timestamp"); ts != j.end() && ts->is_object()) {
      const auto s = ts->value("seconds", int64_t{0});
      const auto us = ts->value("microseconds", int64_t{0});
      m.timestamp_us = s * 1000000 + us;
    }
    return m;
  }
  if (auto it = j.find("return"); it != j.end()) {
    m.kind = QmpMessageKind::kReturn;
    m.value = *it;
    m.id = j.value("id", json());
    return m;
  }
  if (auto it = j.find("error"); it != j.end()) {
    if (!it->is_object()) return Error{Errc::kProtocol, "QMP: error is not an object"};
    m.kind = QmpMessageKind::kError;
    m.error_class = it->value("class", "");
    m.error_desc = it->value("desc", "");
    m.id = j.value("id", json());
    return m;
  }
  return Error{Errc::kProtocol, "QMP: unknown message: " + std::string(line.substr(0, 200))};
}

std::string encode_qmp_command(const std::string& command, const json& args, uint64_t id) {
  json j{{"execute", command}, {"id", id}};
  if (!args.is_null() && !args.empty()) j["arguments"] = args;
  return j.dump() + "\n";
}

namespace {
uint64_t u64(const json& o, const char* key) {
  auto it = o.find(key);
  if (it == o.end() || !it->is_number()) return 0;
  if (it->is_number_float()) return static_cast<uint64_t>(std::max(0.0, it->get<double>()));
  if (it->is_number_integer() && it->get<int64_t>() < 0) return 0;
  return it->get<uint64_t>();
}
int64_t i64(const json& o, const char* key) {
  auto it = o.find(key);
  if (it == o.end() || !it->is_number()) return -1;
  if (it->is_number_float()) return static_cast<int64_t>(it->get<double>());
  return it->get<int64_t>();
}
}  // namespace

Result<MigrationInfo> parse_migration_info(const json& value) {
  if (!value.is_object()) return Error{Errc::kProtocol, "query-migrate: reply is not an object"};
  MigrationInfo info;
  auto st = value.find("status");
  if (st == value.end()) {
    info.status = "none";  // QEMU omits status before any migration
  } else if (!st->is_string()) {
    return Error{Errc::kProtocol, "query-migrate: status is not a string"};
  } else {
    info.status = st->get<std::string>();
  }
  if (auto ram = value.find("ram"); ram != value.end() && ram->is_object()) {
    info.transferred_bytes = u64(*ram, "transferred");
    info.remaining_bytes = u64(*ram, "remaining");
    info.total_bytes = u64(*ram, "total");
    if (auto mbps = ram->find("mbps"); mbps != ram->end() && mbps->is_number()) {
      info.throughput_bytes_per_second = mbps->get<double>() * 1e6 / 8.0;
    }
    info.dirty_pages_rate = u64(*ram, "dirty-pages-rate");
    if (const auto ps = u64(*ram, "page-size"); ps != 0) info.page_size = ps;
    info.dirty_sync_count = u64(*ram, "dirty-sync-count");
    info.normal_pages = u64(*ram, "normal");
    info.duplicate_pages = u64(*ram, "duplicate");
    info.postcopy_requests = i64(*ram, "postcopy-requests");
  }
  info.postcopy_blocktime_ms = i64(value, "postcopy-blocktime");
  info.postcopy_latency_ns = i64(value, "postcopy-latency");
  if (auto d = value.find("postcopy-latency-dist"); d != value.end()) {
    if (!d->is_array() || d->size() > 64) return Error{Errc::kProtocol, "query-migrate: postcopy-latency-dist is not a list of at most 64 counts"};
    for (const auto& n : *d) {
      if (!n.is_number_unsigned()) return Error{Errc::kProtocol, "query-migrate: postcopy-latency-dist holds a value that is not a count"};
      info.postcopy_latency_dist.push_back(n.get<uint64_t>());
    }
  }
  info.total_time_ms = i64(value, "total-time");
  info.downtime_ms = i64(value, "downtime");
  info.expected_downtime_ms = i64(value, "expected-downtime");
  info.setup_time_ms = i64(value, "setup-time");
  if (auto e = value.find("error-desc"); e != value.end() && e->is_string()) {
    info.error_desc = e->get<std::string>();
  }
  return info;
}

std::optional<double> latency_dist_quantile_us(const std::vector<uint64_t>& dist, double q) {
  uint64_t total = 0;  // saturating: the counts are QEMU's, not trusted to add up
  for (const uint64_t n : dist) total = n > std::numeric_limits<uint64_t>::max() - total ? std::numeric_limits<uint64_t>::max() : total + n;
  if (total == 0 || q <= 0 || q > 1) return std::nullopt;
  // The rank of the q-th fault, 1-based: ceil(q * total).
  const auto rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(total)));
  uint64_t seen = 0;
  for (size_t i = 0; i < dist.size(); ++i) {
    seen = dist[i] > std::numeric_limits<uint64_t>::max() - seen ? std::numeric_limits<uint64_t>::max() : seen + dist[i];
    if (seen >= rank) return std::ldexp(1.0, static_cast<int>(i) + 1);
  }
  return std::ldexp(1.0, static_cast<int>(dist.size()));
}

bool migration_status_terminal(const std::string& status) {
  return status == "completed" || status == "failed" || status == "cancelled";
}

bool migration_status_postcopy(const std::string& status) { return status.rfind("postcopy-", 0) == 0; }

}  // namespace rdmig::qemu
