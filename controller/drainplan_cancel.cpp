// An RdmaDrainPlan's cancel and its frozen spec (docs/drain.md, "Cancel" and "A spec edited while
// executing"): the cancel of a plan that has not started its drain, the cancel of one running
// RdmaMigration, and the check that the spec an executing plan reads is the one it started with.
// The executing plan's own cancel (no more starts, the running ones finished or cancelled, phase
// Cancelling then Cancelled) is part of its reconcile (drainplan_execute.cpp).
#include <string>

#include "common/log.h"
#include "controller/drain_execution.h"
#include "controller/drainplan_reconciler.h"
#include "controller/reconcile_util.h"
#include "controller/status_mapping.h"

namespace rdmig::controller {

using nlohmann::json;
using detail::now_text;

Result<Next> DrainPlanReconciler::cancel_before_start(const json& obj) {
  json status = obj.value("status", json::object());
  if (!status.is_object()) status = json::object();
  const std::string was = status.value("phase", std::string("Pending"));
  // The path check it started, if it still runs, stops with it; read from the API server, as the
  // cache may not hold one created a moment ago. After this the plan is Cancelled and creates none.
  // One that cannot be stopped now is recorded and stopped later (the Cancelled plan's reconcile).
  const auto stop = stop_path_check_for_cancel(obj, status, /*fresh=*/true);
  status["phase"] = "Cancelled";
  std::string message = "spec.cancel before the drain started (phase " + (was.empty() ? "Pending" : was) +
                        "): no migration was started";
  if (const std::string text = stopped_path_check_text(status); !text.empty()) message += "; " + text;
  set_condition(status, "Cancelled", "True", "Cancelled", message, detail::generation_of(obj), now_text());
  auto w = write_status(obj, status);
  if (!w) return w.error();
  events_.record(w.value(), "Warning", "DrainCancelled", message);
  export_metrics(w.value());
  if (stop.failed) return *stop.failed;  // retried (a Cancelled plan with stopError)
  return Next::kDone;
}

Result<bool> DrainPlanReconciler::cancel_migration(const json& plan, const json& migration) {
  const json& md = migration["metadata"];
  const std::string ns = md.value("namespace", ""), name = md.value("name", "");
  const json spec = migration.value("spec", json::object());
  const json ann = md.value("annotations", json::object());
  if (spec.is_object() && spec.value("cancel", false) && ann.is_object() && ann.contains(kCancelledByPlanAnnotation)) {
    return false;  // asked already; its reconciler is at it
  }
  json body = migration;
  body["spec"]["cancel"] = true;
  body["metadata"]["annotations"][kCancelledByPlanAnnotation] = informer_.key_of(plan);
  auto replaced = kube_.replace("/apis/rdmig.io/v1alpha1/namespaces/" + ns + "/rdmamigrations/" + name, body);
  if (!replaced) {
    // A write that raced the migration's own reconciler, or the object gone: the next poll reads it again.
    if (k8s::is_conflict(replaced.error()) || replaced.error().code == Errc::kNotFound) return false;
    return replaced.error().with_context("cancelling RdmaMigration " + ns + "/" + name);
  }
  LOG_INFO("drainplan") << informer_.key_of(plan) << ": cancelled RdmaMigration " << ns << "/" << name
                        << " (spec.runningOnCancel Cancel)";
  return true;
}

void DrainPlanReconciler::check_spec_unchanged(const json& obj, const json& frozen, json& status) {
  const auto changed = changed_spec_fields(frozen, obj.value("spec", json::object()));
  json previous;
  for (const auto& c : status.value("conditions", json::array())) {
    if (c.value("type", "") == "SpecChanged") previous = c;
  }
  const int64_t gen = detail::generation_of(obj);
  if (changed.empty()) {
    if (previous.is_object() && previous.value("status", "") == "True") {
      set_condition(status, "SpecChanged", "False", "AsStarted", "the spec is the one the drain started with", gen,
                    now_text());
    }
    return;
  }
  std::string fields;
  for (const auto& f : changed) fields += (fields.empty() ? "" : ", ") + f;
  const std::string message =
      fields + " changed after the drain started: not acted on; the drain keeps to the spec it started with "
               "(status.execution.spec). Only spec.cancel and spec.runningOnCancel may change; for a drain with "
               "the new spec, cancel this plan and create another";
  if (!previous.is_object() || previous.value("status", "") != "True" || previous.value("message", "") != message) {
    events_.record(obj, "Warning", "SpecChanged", message);
    LOG_WARN("drainplan") << informer_.key_of(obj) << ": " << fields << " changed while executing: not acted on";
  }
  set_condition(status, "SpecChanged", "True", "ChangedWhileExecuting", message, gen, now_text());
}

}  // namespace rdmig::controller
