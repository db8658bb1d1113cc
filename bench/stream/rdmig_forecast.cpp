// rdmig-forecast: one migration's forecast (src/forecast/model.h) from a JSON object on stdin,
// for bench/drain_accuracy.py (predicted against measured). Input fields (bytes, bytes/s,
// seconds): memory, dirtyRate, throughput, pathChannels, rttSeconds, capacity, channels,
// chunkSize, ringDepth, acceptedDowntime, switchover, completionTimeout, autoConverge,
// concurrent, maxBandwidth. Output: converges, withinLimits, passes, totalSeconds, downtimeSeconds,
// throughput, bytes, reason.
#include <iostream>
#include <nlohmann/json.hpp>

#include "forecast/model.h"

int main() {
  using nlohmann::json;
  json in;
  try {
    std::cin >> in;
  } catch (const std::exception& e) {
    std::cerr << "rdmig-forecast: stdin is not JSON: " << e.what() << "\n";
    return 2;
  }
  rdmig::forecast::VmInput vm{in.value("memory", uint64_t{0}), in.value("dirtyRate", 0.0)};
  rdmig::forecast::PathMeasure path;
  path.throughput = in.value("throughput", 0.0);
  path.channels = in.value("pathChannels", 1u);
  path.rtt_seconds = in.value("rttSeconds", 0.0);
  path.capacity = in.value("capacity", 0.0);
  rdmig::forecast::MigrationSettings s;
  s.channels = in.value("channels", 1u);
  s.chunk_size = in.value("chunkSize", s.chunk_size);
  s.ring_depth = in.value("ringDepth", s.ring_depth);
  s.accepted_downtime = in.value("acceptedDowntime", s.accepted_downtime);
  s.switchover = in.value("switchover", s.switchover);
  s.completion_timeout = in.value("completionTimeout", s.completion_timeout);
  s.auto_converge = in.value("autoConverge", false);
  s.concurrent = in.value("concurrent", 1u);
  s.max_bandwidth = in.value("maxBandwidth", 0.0);
  const auto p = rdmig::forecast::predict(vm, path, s);
  std::cout << json{{"converges", p.converges},         {"withinLimits", p.within_limits},
                    {"passes", p.passes},               {"totalSeconds", p.total_seconds},
                    {"downtimeSeconds", p.downtime_seconds}, {"throughput", p.throughput},
                    {"bytes", p.bytes},                 {"reason", p.reason}}
                   .dump()
            << "\n";
  return 0;
}
