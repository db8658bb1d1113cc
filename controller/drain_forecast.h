// An RdmaDrainPlan's status.vms and status.summary from its inputs: each VM's memory and dirty
// rate, the measured path, the plan's settings. The model and the planner are src/forecast;
// this file maps them onto the CRD (docs/drain.md) and bounds the list: at most kMaxListedVms
// VMs in status.vms (those that do not converge or lack an input first, then in start order),
// the summary counting every VM. The predicted drain time and its lower bound (the planned VMs'
// memory over the path's capacity) both cover the VMs that converge within their limits.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "forecast/model.h"

namespace rdmig::controller {

inline constexpr size_t kMaxListedVms = 100;

struct DrainVm {
  std::string ns{}, name{};
  std::optional<uint64_t> memory{};     // bytes; unset: the spec names none
  std::optional<double> dirty_rate{};   // bytes/s
  std::string dirty_source = "none";    // annotation, assumed, none
  std::string dirty_time{};             // when it was measured ("" unknown)
  // The guest RAM its QEMU holds resident (bytes; the annotation, docs/drain.md "Inputs"): pages
  // never written go as zero-page markers, so pass 0 moves at most this much. Unset: the memory.
  std::optional<uint64_t> resident{};
  std::string resident_time{};          // when it was measured ("" unknown)
};

// What pass 0 moves: the resident part where it was measured (at most the memory), else the
// memory. The completion timeout stays on the memory, as KubeVirt's does.
uint64_t moved_memory(const DrainVm& vm);

struct DrainSettings {
  forecast::MigrationSettings migration;  // concurrent and completion_timeout are set per VM
  double timeout_per_gib = 150;
  uint32_t max_concurrency = 2;           // per node pair, rails counted
  uint32_t max_channels = 16;
};

// One VM of the plan, every one of them (status.vms lists at most max_listed): what an executing
// plan starts, in this order.
struct PlannedVm {
  size_t vm = 0;               // index into the input
  uint32_t concurrency = 0;    // migrations at once in its phase
  double total_seconds = 0, downtime_seconds = 0;  // predicted at that concurrency
};
struct DrainOrder {
  std::vector<PlannedVm> planned;  // in start order
  std::vector<size_t> unplanned;   // do not converge within their limits, or lack an input (input order)
  double makespan = 0;
};

// {"vms": [...], "summary": {...}} as the CRD's status holds them; `order`, when given, gets the
// whole plan.
nlohmann::json drain_forecast(const std::vector<DrainVm>& vms, const forecast::PathMeasure& path,
                              const std::string& target, const DrainSettings& settings,
                              size_t max_listed = kMaxListedVms, DrainOrder* order = nullptr);

// "42.0s", "12m05s", "2h03m".
std::string duration_text(double seconds);

}  // namespace rdmig::controller
