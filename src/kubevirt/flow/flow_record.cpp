#include "kubevirt/flow/flow_record.h"

namespace rdmig::kubevirt {

using nlohmann::json;

json to_json(const LibvirtJobStats& s) {
  auto opt = [](int64_t v) { return v >= 0 ? json(v) : json(nullptr); };
  return json{{"downtimeMs", opt(s.downtime_ms)},
              {"totalTimeMs", opt(s.total_time_ms)},
              {"dataTotalBytes", s.data_total_bytes},
              {"postcopyRequests", opt(s.postcopy_requests)},
              {"domain", s.domain}};
}

LibvirtJobStats libvirt_stats_from_json(const json& j) {
  LibvirtJobStats s;
  if (!j.is_object()) return s;
  auto num = [&](const char* k) -> int64_t {
    auto it = j.find(k);
    return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : -1;
  };
  s.downtime_ms = num("downtimeMs");
  s.total_time_ms = num("totalTimeMs");
  const int64_t total = num("dataTotalBytes");
  s.data_total_bytes = total > 0 ? static_cast<uint64_t>(total) : 0;
  s.postcopy_requests = num("postcopyRequests");
  if (s.postcopy_requests < -1) s.postcopy_requests = -1;
  if (auto it = j.find("domain"); it != j.end() && it->is_string()) s.domain = it->get<std::string>().substr(0, 512);
  return s;
}

static json rails_json(const std::vector<session::RailUsage>& rails) {
  json a = json::array();
  for (const auto& u : rails) a.push_back(session::to_json(u));
  return a;
}

json to_json(const FlowRecord& r) {
  auto str = [](const std::string& v) { return v.empty() ? json(nullptr) : json(v); };
  return json{{"migrationUid", r.migration_uid},
              {"vmi", r.vmi.name.empty() ? json(nullptr)
                                         : json{{"namespace", r.vmi.namespace_}, {"name", r.vmi.name}, {"uid", r.vmi.uid}}},
              {"role", r.role},
              {"sourceNode", str(r.source_node)},
              {"targetNode", str(r.target_node)},
              {"mode", r.mode},
              {"carried", r.carried},
              {"reason", str(r.reason)},
              {"phase", r.phase},
              {"transport", str(r.transport)},
              {"transportReason", str(r.transport_reason)},
              {"peer", str(r.peer)},
              {"connections", r.connections},
              {"mainConnection", r.main_connection < 0 ? json(nullptr)
                                                       : json{{"index", r.main_connection}, {"by", r.main_connection_by}}},
              {"encryption", r.encryption},
              {"kubevirtTls", r.kubevirt_tls.empty() ? json(nullptr) : json(r.kubevirt_tls)},
              {"plaintext", r.plaintext.empty() ? json(nullptr) : json(r.plaintext)},
              {"onFailure", r.on_failure.empty() ? json(nullptr) : json{{"multifd", r.on_failure}, {"by", r.on_failure_by}}},
              {"bytesSent", r.bytes_sent},
              {"bytesReceived", r.bytes_received},
              {"chunksSent", r.chunks_sent},
              {"chunksReceived", r.chunks_received},
              {"throughputBytesPerSecond", r.throughput_bytes_per_second},
              {"rails", rails_json(r.rails)},
              {"libvirt", r.libvirt ? to_json(*r.libvirt) : json(nullptr)},
              {"failover", json{{"enabled", r.failover},
                                {"failovers", r.failovers},
                                {"last", r.last_failover.empty() ? json(nullptr) : json(r.last_failover)}}},
              {"postCopy", !r.post_copy.allowed ? json(nullptr)
                                               : json{{"allowed", true},
                                                      {"switched", r.post_copy.switched},
                                                      {"switchedAtMs", r.post_copy.switched_at_ms
                                                                           ? json(r.post_copy.switched_at_ms)
                                                                           : json(nullptr)},
                                                      {"pageRequests", r.libvirt && r.libvirt->postcopy_requests >= 0
                                                                           ? json(r.libvirt->postcopy_requests)
                                                                           : json(nullptr)}}},
              {"switchoverMs", nullptr},
              {"startedAtMs", r.started_at_ms ? json(r.started_at_ms) : json(nullptr)},
              {"finishedAtMs", r.finished_at_ms ? json(r.finished_at_ms) : json(nullptr)}};
}

}  // namespace rdmig::kubevirt
