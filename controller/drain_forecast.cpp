#include "controller/drain_forecast.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "controller/drain_execution.h"
#include "forecast/planner.h"

namespace rdmig::controller {

using nlohmann::json;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

// A VM's input to the model: what pass 0 moves (moved_memory) and its dirty rate (0 unmeasured).
forecast::VmInput model_input(const DrainVm& vm) { return {moved_memory(vm), vm.dirty_rate.value_or(0.0)}; }

json figures(const forecast::Prediction& p) {
  return json{{"totalSeconds", round3(p.total_seconds)}, {"downtimeSeconds", round3(p.downtime_seconds)}};
}

}  // namespace

uint64_t moved_memory(const DrainVm& vm) {
  const uint64_t memory = vm.memory.value_or(0);
  return vm.resident && *vm.resident > 0 ? std::min(memory, *vm.resident) : memory;
}

std::string duration_text(double seconds) {
  char buf[48];
  if (seconds < 120) {
    std::snprintf(buf, sizeof buf, "%.1fs", seconds);
  } else if (seconds < 7200) {
    const auto s = static_cast<long long>(std::llround(seconds));
    std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  } else {
    const auto m = static_cast<long long>(std::llround(seconds / 60));
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", m / 60, m % 60);
  }
  return buf;
}

json drain_forecast(const std::vector<DrainVm>& vms, const forecast::PathMeasure& path, const std::string& target,
                    const DrainSettings& settings, size_t max_listed, DrainOrder* order) {
  const uint32_t K = std::max<uint32_t>(settings.max_concurrency, 1);
  std::vector<json> entries(vms.size());
  std::vector<forecast::PlanJob> jobs;
  std::vector<size_t> job_vm;  // job index -> vm index
  std::vector<forecast::MigrationSettings> per_vm(vms.size(), settings.migration);
  int64_t no_input = 0, assumed = 0, unmeasured = 0;
  double bytes = 0;
  for (size_t i = 0; i < vms.size(); ++i) {
    const DrainVm& vm = vms[i];
    json& e = entries[i];
    e = json{{"namespace", vm.ns}, {"name", vm.name}, {"dirtyRateSource", vm.dirty_source}};
    if (!vm.dirty_time.empty()) e["dirtyRateTime"] = vm.dirty_time.substr(0, 64);
    if (!vm.memory || *vm.memory == 0) {
      ++no_input;
      e["reason"] = "no memory in spec.domain.memory.guest or spec.domain.resources.requests.memory";
      continue;
    }
    e["memoryBytes"] = *vm.memory;
    e["memorySource"] = moved_memory(vm) < *vm.memory ? "resident" : "spec";  // what the model took
    if (vm.resident) {
      e["residentMemoryBytes"] = *vm.resident;
      if (!vm.resident_time.empty()) e["residentMemoryTime"] = vm.resident_time.substr(0, 64);
    }
    if (vm.dirty_source == "assumed") ++assumed;
    if (!vm.dirty_rate) ++unmeasured;
    e["dirtyRateBytesPerSecond"] = vm.dirty_rate.value_or(0.0);
    e["target"] = target;
    per_vm[i].completion_timeout = settings.timeout_per_gib * std::max(1.0, static_cast<double>(*vm.memory) / kGiB);
    const forecast::VmInput in = model_input(vm);
    forecast::PlanJob job{vm.ns + "/" + vm.name, {}};
    for (uint32_t k = 1; k <= K; ++k) {
      auto s = per_vm[i];
      s.concurrent = k;
      const auto p = forecast::predict(in, path, s);
      job.duration.push_back(p.within_limits ? p.total_seconds : 0);
    }
    jobs.push_back(std::move(job));
    job_vm.push_back(i);
  }
  const forecast::Plan plan = forecast::plan(jobs, K);
  std::vector<int64_t> rank(vms.size(), -1);  // listing order: unplanned first, then by start
  uint32_t max_k = 0;
  for (size_t n = 0; n < plan.order.size(); ++n) {
    const auto& pj = plan.order[n];
    const size_t i = job_vm[pj.job];
    auto s = per_vm[i];
    s.concurrent = pj.concurrency;
    const auto p = forecast::predict(model_input(vms[i]), path, s);
    json& e = entries[i];
    e["order"] = n;
    e["concurrency"] = pj.concurrency;
    e["plannedStartSeconds"] = round3(pj.start);
    e["plannedEndSeconds"] = round3(pj.end);
    e["throughputBytesPerSecond"] = std::round(p.throughput);
    e["passes"] = p.passes;
    e["totalSeconds"] = round3(p.total_seconds);
    e["downtimeSeconds"] = round3(p.downtime_seconds);
    e["convergesWithinLimits"] = true;
    if (!vms[i].dirty_rate) e["reason"] = "no measured dirty rate: forecast at 0 B/s (best case)";
    rank[i] = static_cast<int64_t>(n);
    if (order) order->planned.push_back(PlannedVm{i, pj.concurrency, p.total_seconds, p.downtime_seconds});
    bytes += static_cast<double>(moved_memory(vms[i]));  // the bound covers the VMs the plan runs
    max_k = std::max(max_k, pj.concurrency);
  }
  if (order) {
    order->makespan = plan.makespan;
    for (size_t i = 0; i < vms.size(); ++i) {
      if (!vms[i].memory || *vms[i].memory == 0) order->unplanned.push_back(i);
    }
    for (size_t u : plan.unplanned) order->unplanned.push_back(job_vm[u]);
    std::sort(order->unplanned.begin(), order->unplanned.end());
  }
  int64_t not_converging = 0;
  for (size_t u : plan.unplanned) {
    const size_t i = job_vm[u];
    ++not_converging;
    auto s = per_vm[i];
    s.concurrent = 1;
    const forecast::VmInput in = model_input(vms[i]);
    const auto p = forecast::predict(in, path, s);
    json& e = entries[i];
    e["throughputBytesPerSecond"] = std::round(p.throughput);
    e["passes"] = p.passes;
    e["totalSeconds"] = round3(p.total_seconds);
    e["downtimeSeconds"] = round3(p.downtime_seconds);
    e["convergesWithinLimits"] = false;
    e["reason"] = (p.reason.empty() ? std::string("downtime above the accepted limit") : p.reason).substr(0, 1000);
    const auto r = forecast::remedies(in, path, s, settings.max_channels);
    json rem = json::object();
    if (r.postcopy) rem["postCopy"] = figures(*r.postcopy);
    if (r.auto_converge) {
      rem["autoConverge"] = figures(*r.auto_converge);
      rem["autoConverge"]["maxThrottlePercent"] = std::lround(r.auto_converge->max_throttle * 100);
    }
    if (r.more_channels) {
      rem["moreChannels"] = figures(*r.more_channels);
      rem["moreChannels"]["channels"] = r.channels_needed;
    }
    if (r.larger_downtime) {
      rem["largerDowntime"] = figures(*r.larger_downtime);
      rem["largerDowntime"]["maxDowntimeSeconds"] = r.downtime_needed;
    }
    e["remedies"] = rem;
  }
  // The list: VMs without a forecast or that do not converge first (input order), then by start.
  std::vector<size_t> listing(vms.size());
  for (size_t i = 0; i < vms.size(); ++i) listing[i] = i;
  std::stable_sort(listing.begin(), listing.end(), [&](size_t a, size_t b) { return rank[a] < rank[b]; });
  json list = json::array();
  for (size_t i : listing) {
    if (list.size() >= max_listed) break;
    list.push_back(entries[i]);
  }
  const double capacity = path.capacity > 0 ? path.capacity : path.throughput;
  const double lower = capacity > 0 ? bytes / capacity : 0;
  json summary{{"vms", vms.size()},
               {"forecast", static_cast<int64_t>(vms.size()) - no_input},
               {"withinLimits", plan.order.size()},
               {"notConverging", not_converging},
               {"noInput", no_input},
               {"assumedDirtyRate", assumed},
               {"unmeasuredDirtyRate", unmeasured},
               {"concurrency", max_k},
               {"predictedDrainSeconds", round3(plan.makespan)},
               {"lowerBoundSeconds", round3(lower)},
               {"predictedDrain", duration_text(plan.makespan)},
               {"lowerBound", duration_text(lower)},
               {"listed", list.size()},
               {"omitted", vms.size() - list.size()}};
  return json{{"vms", list}, {"summary", summary}};
}

}  // namespace rdmig::controller
