// An executing RdmaDrainPlan's pure parts (docs/drain.md, "Execute"): the RdmaMigration it
// creates for a VMI, what each one says about its VM (status.vms entries with the measured
// figures beside the forecast), and the calibration the re-plan uses. Everything here is derived
// from the objects (the migrations, the plan's previous status), never from the controller's
// memory, so a restarted controller continues where the last one stopped.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace rdmig::controller {

// Seconds as a plan's status shows them: rounded to the millisecond (the forecast's and the
// execution's figures alike).
double round3(double seconds);

// A number in an annotation (the plan's own, and the figures copied onto a VMI: dirty rate,
// resident memory): the whole text, at most 32 characters, decimal digits with an optional sign,
// point and exponent ("1.34217728e+08", as Prometheus writes it), finite and not negative; unset
// otherwise ("12x", " 5", "0x10", "inf", a number that is not a string).
std::optional<double> annotation_number(const nlohmann::json& annotations, const char* key);
// The largest whole number a double holds exactly (2^53): the most a count or a byte figure read
// from an annotation may be before it is cast.
inline constexpr double kMaxExactWhole = 9007199254740992.0;

// Labels and annotations on the RdmaMigrations a plan creates.
inline constexpr const char* kPlanLabel = "rdmig.io/drain-plan";          // the plan's name (cut to 63)
inline constexpr const char* kPlanUidLabel = "rdmig.io/drain-plan-uid";   // selects a plan's migrations
inline constexpr const char* kOrderAnnotation = "rdmig.io/drain-order";
inline constexpr const char* kStartAnnotation = "rdmig.io/drain-start-time";
inline constexpr const char* kPredictedTotalAnnotation = "rdmig.io/drain-predicted-total-seconds";
inline constexpr const char* kPredictedDowntimeAnnotation = "rdmig.io/drain-predicted-downtime-seconds";
// Set (with spec.cancel) on a running migration the plan cancelled (spec.runningOnCancel Cancel):
// its end is the plan's Cancelled, not a failure.
inline constexpr const char* kCancelledByPlanAnnotation = "rdmig.io/drain-cancelled";

// The most VMs one plan starts (status.execution.started holds each): a node runs far fewer
// (kubelet's maxPods); VMs past it are skipped (skipReason TooManyVMs).
inline constexpr size_t kMaxStartedVms = 5000;

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

// The cancel an executing plan reads from its spec each time (spec.cancel, spec.runningOnCancel);
// the only fields that may change once it executes.
struct CancelRequest {
  bool requested = false;       // spec.cancel: no migration is started from now on
  bool cancel_running = false;  // spec.runningOnCancel Cancel: those running are cancelled too
  std::string problem;          // an unknown runningOnCancel value, named (read as Finish)
};
CancelRequest read_cancel(const nlohmann::json& spec);

// The spec an executing plan keeps to (status.execution.spec): `spec` less cancel and
// runningOnCancel.
nlohmann::json frozen_spec(const nlohmann::json& spec);
// "spec.<field>" for each field added, removed or changed in `spec` against `frozen`, sorted;
// cancel and runningOnCancel never.
std::vector<std::string> changed_spec_fields(const nlohmann::json& frozen, const nlohmann::json& spec);

// status.execution.started: {namespace, name, outcome} for each entry the plan started (those
// with a migration), sorted; what keeps a VM from being started twice when its RdmaMigration is
// deleted.
nlohmann::json started_record(const std::vector<nlohmann::json>& entries);

// The status.vms entry of a started VM whose RdmaMigration is gone (deleted by hand, or after its
// ttlSecondsAfterFinished): its previous entry (else one from its `record`), and if that was still
// Running, Failed at `now` (deleting an RdmaMigration aborts it) with an error that says so.
nlohmann::json gone_entry(const nlohmann::json& record, const nlohmann::json& previous, const std::string& migration,
                          const std::string& now);

// The path check a plan created because no check had measured its path (<plan>-paths) and whether
// the plan's cancel must stop it: stop when it is the plan's (an owner reference with `plan_uid`,
// or the label rdmig.io/drain-plan-uid), has not ended (phase "", Pending or Running) and is not
// being deleted already. RdmaPathCheck has no cancel of its own (its spec is immutable): deleting
// it is its cancel, its finalizer cancels the pairs still running on both agents. `where` says how
// far it got ("2 of 3 pairs ended, 1 running"), for the plan's status and Event.
struct PathCheckStop {
  bool stop = false;
  std::string where;
};
PathCheckStop path_check_to_stop(const nlohmann::json& check, const std::string& plan_uid);

// What a cancelled plan's conditions say of its path check from status.createdPathCheck: "path
// check <ns/name> stopped at <stopTime>, <stopped>: deleted, its pairs cancelled on the agents",
// "path check <ns/name> still runs: stopping it failed (<stopError>); retried until it holds" while
// a stop fails, or "" when the cancel stopped none.
std::string stopped_path_check_text(const nlohmann::json& status);

// Measured over predicted total time of the Succeeded entries that have both; the re-plan divides
// the path's throughput by it (bounded to [0.1, 10]). measured 0: scale 1.
struct Calibration {
  int measured = 0;
  double ratio = 1;  // sum(actual) / sum(predicted)
};
Calibration calibrate(const std::vector<nlohmann::json>& entries);

}  // namespace rdmig::controller
