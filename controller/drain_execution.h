// An executing RdmaDrainPlan's pure parts (docs/drain.md, "Execute"): the RdmaMigration it
// creates for a VMI, what each one says about its VM (status.vms entries with the measured
// figures beside the forecast), and the calibration the re-plan uses. Everything here is derived
// from the objects (the migrations, the plan's previous status), never from the controller's
// memory, so a restarted controller continues where the last one stopped.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace rdmig::controller {

// Seconds as a plan's status shows them: rounded to the millisecond (the forecast's and the
// execution's figures alike).
double round3(double seconds);

// Labels and annotations on the RdmaMigrations a plan creates.
inline constexpr const char* kPlanLabel = "rdmig.io/drain-plan";          // the plan's name (cut to 63)
inline constexpr const char* kPlanUidLabel = "rdmig.io/drain-plan-uid";   // selects a plan's migrations
inline constexpr const char* kOrderAnnotation = "rdmig.io/drain-order";
inline constexpr const char* kStartAnnotation = "rdmig.io/drain-start-time";
inline constexpr const char* kPredictedTotalAnnotation = "rdmig.io/drain-predicted-total-seconds";
inline constexpr const char* kPredictedDowntimeAnnotation = "rdmig.io/drain-predicted-downtime-seconds";

// <plan>-<vmi>-<8 hex of a hash of the plan's uid and the VMI's namespace/name>: the same for the
// same plan and VMI (a restarted controller's create meets AlreadyExists), at most 240 characters
// (the VMIM adds "rdmig-").
std::string drain_migration_name(const std::string& plan, const std::string& plan_uid, const std::string& vmi_ns,
                                 const std::string& vmi);

// The status.vms entry of a VM whose migration exists: the forecast it was started with (its
// annotations), its outcome (Running, Succeeded, Failed), start (the plan's, micro time) and finish
// (first seen ended: `previous` keeps it, else `now`), the measured total (libvirt's totalTimeMs,
// else finish - start) and downtime (downtimeMs), each ratio actual / predicted, the error.
nlohmann::json executed_entry(const nlohmann::json& migration, const nlohmann::json& previous, const std::string& now);

// Measured over predicted total time of the Succeeded entries that have both; the re-plan divides
// the path's throughput by it (bounded to [0.1, 10]). measured 0: scale 1.
struct Calibration {
  int measured = 0;
  double ratio = 1;  // sum(actual) / sum(predicted)
};
Calibration calibrate(const std::vector<nlohmann::json>& entries);

}  // namespace rdmig::controller
