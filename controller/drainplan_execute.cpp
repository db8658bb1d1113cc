// An RdmaDrainPlan with spec.execute true, in phase Executing (docs/drain.md, "Execute"). Each
// reconcile reads the state from the objects: the plan's RdmaMigrations (by the label naming its
// uid, from the API server, not a cache, so a migration created a moment ago is counted), the
// VMIs still on the node, and the plan's previous status (finish times first seen). It re-plans
// the VMIs that have no migration yet with the measured figures, starts those the concurrency
// allows in the plan's order, and writes status.vms, status.execution and the conditions.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "common/log.h"
#include "controller/drain_execution.h"
#include "controller/drainplan_reconciler.h"
#include "controller/reconcile_util.h"
#include "controller/status_mapping.h"
#include "k8s/selectors.h"

namespace rdmig::controller {

using nlohmann::json;
using detail::now_text;

namespace {

std::string key_of(const std::string& ns, const std::string& name) { return ns + "/" + name; }

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

// status.vms while executing: what needs attention first, then what is left, then what is done.
int rank_of(const json& e) {
  const std::string o = e.value("outcome", "");
  return o == "Failed" ? 0 : o == "Running" ? 1 : o == "Cancelled" ? 2 : o == "Skipped" ? 3 : o == "Pending" ? 4 : 5;
}

double seconds_since(const std::string& from, k8s::Clock::time_point to) {
  const auto at = k8s::parse_time(from);
  return at ? std::max(0.0, std::chrono::duration<double>(to - *at).count()) : 0.0;
}

}  // namespace

Result<json> DrainPlanReconciler::start_migration(const json& plan, const DrainVm& vm, const PlannedVm* planned,
                                                  size_t order, const Inputs& in) {
  const json& md = plan["metadata"];
  const std::string plan_ns = md.value("namespace", ""), plan_name = md.value("name", ""), uid = md.value("uid", "");
  const std::string name = drain_migration_name(plan_name, uid, vm.ns, vm.name);
  json annotations{{kPlanLabel, key_of(plan_ns, plan_name)},
                   {kOrderAnnotation, std::to_string(order)},
                   {kStartAnnotation, k8s::format_micro_time(k8s::Clock::now())}};
  if (planned) {
    annotations[kPredictedTotalAnnotation] = number_text(planned->total_seconds);
    annotations[kPredictedDowntimeAnnotation] = number_text(planned->downtime_seconds);
  }
  json body{{"apiVersion", kGroupVersion},
            {"kind", "RdmaMigration"},
            {"metadata",
             {{"name", name},
              {"namespace", vm.ns},
              {"labels", {{kPlanLabel, plan_name.substr(0, 63)}, {kPlanUidLabel, uid}}},
              {"annotations", annotations}}},
            {"spec", {{"source", {{"vmi", {{"name", vm.name}}}}}}}};
  // spec.targets: the forecast's pair (KubeVirt's addedNodeSelector); unset, the scheduler picks.
  const std::string target = plan["status"].value("path", json::object()).value("target", "");
  if (!in.targets.empty() && !target.empty()) {
    body["spec"]["target"] = json{{"nodeSelector", {{"kubernetes.io/hostname", target}}}};
  }
  if (vm.ns == plan_ns) {  // an owner reference must not cross namespaces; the labels name the plan anyway
    body["metadata"]["ownerReferences"] =
        json::array({json{{"apiVersion", kGroupVersion}, {"kind", "RdmaDrainPlan"}, {"name", plan_name},
                          {"uid", uid}, {"controller", true}, {"blockOwnerDeletion", false}}});
  }
  const std::string path = "/apis/rdmig.io/v1alpha1/namespaces/" + vm.ns + "/rdmamigrations";
  auto created = kube_.create(path, body);
  if (created) {
    LOG_INFO("drainplan") << informer_.key_of(plan) << ": started RdmaMigration " << vm.ns << "/" << name
                          << " for VMI " << vm.name << " (order " << order << ")";
    return created;
  }
  if (created.error().code != Errc::kAlreadyExists) {
    return created.error().with_context("creating RdmaMigration " + vm.ns + "/" + name);
  }
  auto existing = kube_.get(path + "/" + name);
  if (!existing) return existing.error().with_context("reading RdmaMigration " + vm.ns + "/" + name);
  const json labels = existing->value("metadata", json::object()).value("labels", json::object());
  if (!labels.is_object() || labels.value(kPlanUidLabel, "") != uid) {
    return Error{Errc::kFailedPrecondition, "RdmaMigration " + vm.ns + "/" + name + " exists and is not this plan's"};
  }
  return existing;
}

Result<Next> DrainPlanReconciler::execute(json obj) {
  json status = obj["status"];
  const json before = status;
  json ex = status.value("execution", json::object());
  if (!ex.is_object()) ex = json::object();
  // The spec the drain started with (a plan that started before it was kept: the spec now); the
  // cancel is read from the spec as it is.
  if (!ex.contains("spec") || !ex["spec"].is_object()) ex["spec"] = frozen_spec(obj.value("spec", json::object()));
  const json spec = ex["spec"];
  auto in = read_spec(spec);
  if (!in) return fail(obj, "InvalidSpec", in.error().message);
  const CancelRequest cancel = read_cancel(obj.value("spec", json::object()));
  if (cancel.requested) {
    // Its own path check may still run (other pairs of a check the forecast took its first from);
    // a stop that fails is recorded and tried again, and holds up no part of the cancel.
    (void)stop_path_check_for_cancel(obj, status, /*fresh=*/false);
  }
  const json& md = obj["metadata"];
  const std::string uid = md.value("uid", ""), plan_name = md.value("name", "");
  const int64_t gen = detail::generation_of(obj);
  const auto now = k8s::Clock::now();
  const std::string now_micro = k8s::format_micro_time(now);

  // The plan's migrations.
  const std::string collection = config_.watch_namespace.empty()
                                     ? "/apis/rdmig.io/v1alpha1/rdmamigrations"
                                     : "/apis/rdmig.io/v1alpha1/namespaces/" + config_.watch_namespace + "/rdmamigrations";
  auto list = kube_.get(collection + "?labelSelector=" + k8s::url_encode(std::string(kPlanUidLabel) + "=" + uid));
  if (!list) return list.error().with_context("listing the plan's RdmaMigrations");
  std::map<std::string, json> previous;
  for (const auto& e : status.value("vms", json::array())) {
    previous[key_of(e.value("namespace", ""), e.value("name", ""))] = e;
  }
  std::vector<json> executed;
  std::vector<json> running_migrations;
  std::set<std::string> has_migration;
  uint32_t running = 0;
  for (const auto& m : list->value("items", json::array())) {
    json e = executed_entry(m, json(), now_micro);
    const std::string key = key_of(e.value("namespace", ""), e.value("name", ""));
    auto prev = previous.find(key);
    if (e.value("outcome", "") != "Running") {
      // The finish: first seen ended (kept in status); an entry not listed before, the object's completionTime.
      const json p = prev != previous.end() ? prev->second : json::object();
      std::string finish = p.value("finishTime", std::string());
      if (finish.empty()) {
        finish = prev != previous.end() ? now_micro
                                        : m.value("status", json::object()).value("completionTime", now_micro);
      }
      e = executed_entry(m, json{{"finishTime", finish}}, now_micro);
      if (e.value("outcome", "") == "Failed" && (prev == previous.end() || p.value("outcome", "") != "Failed")) {
        events_.record(obj, "Warning", "MigrationFailed",
                       "VMI " + key + " (RdmaMigration " + e.value("migration", "") + "): " + e.value("error", "") +
                           "; the drain continues with the others");
      }
    } else {
      ++running;
      running_migrations.push_back(m);
    }
    has_migration.insert(key);
    executed.push_back(std::move(e));
  }
  // The VMs started before whose RdmaMigration is gone since (deleted by hand, or its TTL): as
  // they were last seen, never started again.
  for (const auto& r : ex.value("started", json::array())) {
    if (!r.is_object()) continue;
    const std::string ns = r.value("namespace", ""), name = r.value("name", ""), key = key_of(ns, name);
    if (has_migration.count(key)) continue;
    const auto prev = previous.find(key);
    json e = gone_entry(r, prev != previous.end() ? prev->second : json(),
                        drain_migration_name(plan_name, uid, ns, name), now_micro);
    if (e.value("outcome", "") != r.value("outcome", "")) {
      events_.record(obj, "Warning", "MigrationFailed", "VMI " + key + ": " + e.value("error", ""));
    }
    has_migration.insert(key);
    executed.push_back(std::move(e));
  }

  auto vms = node_vms(spec, in.value());
  if (!vms) return vms.error().with_context("listing the VMIs on " + in->node);
  std::vector<DrainVm> remaining;
  for (auto& vm : vms.value()) {
    if (!has_migration.count(key_of(vm.ns, vm.name))) remaining.push_back(std::move(vm));
  }

  // Re-plan what has not started, with the path's throughput divided by how much longer (or
  // shorter) the finished migrations took than forecast.
  const Calibration cal = calibrate(executed);
  const json path_pair = status.value("path", json::object());
  forecast::PathMeasure path = path_measure(spec, path_pair, in.value());
  path.throughput /= cal.ratio;
  if (path.capacity > 0) path.capacity /= cal.ratio;
  DrainOrder order;
  const json rest = drain_forecast(remaining, path, path_pair.value("target", ""), in->settings, kMaxListedVms, &order);

  // Starts: none once cancelled; at most kMaxStartedVms in all.
  std::set<size_t> started;
  size_t next_order = executed.size();
  auto start = [&](size_t i, const PlannedVm* p) -> Result<bool> {
    if (executed.size() >= kMaxStartedVms) return false;
    auto m = start_migration(obj, remaining[i], p, next_order++, in.value());
    if (!m) return m.error();
    executed.push_back(executed_entry(m.value(), json(), now_micro));
    started.insert(i);
    ++running;
    return true;
  };
  if (!cancel.requested) {
    for (const auto& p : order.planned) {
      if (running >= std::min(p.concurrency, in->settings.max_concurrency)) break;
      auto s = start(p.vm, &p);
      if (!s) return s.error();
      if (!s.value()) break;
    }
    const bool planned_left = started.size() < order.planned.size();
    // VMs forecast not to converge (or without an input): with notConverging Migrate, one at a
    // time after the planned ones; else skipped.
    if (in->migrate_not_converging && !planned_left) {
      for (size_t u : order.unplanned) {
        if (running >= 1) break;
        auto s = start(u, nullptr);
        if (!s) return s.error();
        if (!s.value()) break;
      }
    }
  } else if (cancel.cancel_running) {
    for (const auto& m : running_migrations) {
      if (auto c = cancel_migration(obj, m); !c) return c.error();
    }
  }
  const bool full = executed.size() >= kMaxStartedVms;

  // status.vms: the executed, then the rest as re-planned (not started: Pending or Skipped).
  std::map<std::string, int64_t> counts{{"pending", 0},   {"running", 0}, {"succeeded", 0},
                                        {"failed", 0},    {"skipped", 0}, {"cancelled", 0}};
  std::vector<json> entries = executed;
  for (const auto& e : executed) {
    const std::string o = e.value("outcome", "");
    ++counts[o == "Running" ? "running" : o == "Succeeded" ? "succeeded" : o == "Cancelled" ? "cancelled" : "failed"];
  }
  std::set<size_t> unplanned(order.unplanned.begin(), order.unplanned.end());
  int64_t not_started = 0;  // by the cancel or the bound
  for (size_t i = 0; i < remaining.size(); ++i) {
    if (started.count(i)) continue;
    const bool by_forecast = unplanned.count(i) && !in->migrate_not_converging;
    not_started += !by_forecast && (cancel.requested || full);
    ++counts[by_forecast || cancel.requested || full ? "skipped" : "pending"];
  }
  for (json e : rest.value("vms", json::array())) {
    const std::string key = key_of(e.value("namespace", ""), e.value("name", ""));
    bool was_started = false;
    for (size_t i : started) was_started |= key_of(remaining[i].ns, remaining[i].name) == key;
    if (was_started) continue;
    const bool by_forecast = !e.value("convergesWithinLimits", false) && !in->migrate_not_converging;
    const std::string skip = by_forecast      ? (e.contains("memoryBytes") ? "NotConverging" : "NoInput")
                             : cancel.requested ? "PlanCancelled"
                             : full             ? "TooManyVMs"
                                                : "";
    e["outcome"] = skip.empty() ? "Pending" : "Skipped";
    if (!skip.empty()) e["skipReason"] = skip;
    e.erase("plannedStartSeconds");
    e.erase("plannedEndSeconds");
    entries.push_back(std::move(e));
  }
  std::stable_sort(entries.begin(), entries.end(), [](const json& a, const json& b) {
    if (rank_of(a) != rank_of(b)) return rank_of(a) < rank_of(b);
    return a.value("order", int64_t{1} << 40) < b.value("order", int64_t{1} << 40);
  });
  if (entries.size() > kMaxListedVms) entries.resize(kMaxListedVms);
  status["vms"] = entries;

  const std::string exec_start = ex.value("startTime", now_micro);
  ex["startTime"] = exec_start;
  ex["started"] = started_record(executed);
  for (const auto& [state, n] : counts) ex[state] = n;
  ex["measured"] = cal.measured;
  ex["throughputScale"] = std::round(1000 / cal.ratio) / 1000;
  const bool first_cancel = cancel.requested && !ex.contains("cancelTime");
  if (first_cancel) ex["cancelTime"] = now_micro;
  const bool done = running == 0 && counts["pending"] == 0;
  double elapsed = seconds_since(exec_start, now);
  if (done) {
    std::string finish = cancel.requested ? ex.value("cancelTime", exec_start) : exec_start;
    for (const auto& e : executed) finish = std::max(finish, e.value("finishTime", exec_start));
    ex["finishTime"] = finish;
    elapsed = seconds_since(exec_start, k8s::parse_time(finish).value_or(now));
    ex.erase("replannedDrainSeconds");
  } else {
    // Now, plus what the running ones have left by their forecast, plus the re-planned rest.
    double running_left = 0;
    for (const auto& e : executed) {
      if (e.value("outcome", "") != "Running") continue;
      running_left = std::max(running_left, e.value("totalSeconds", 0.0) - seconds_since(e.value("startTime", ""), now));
    }
    ex["replannedDrainSeconds"] =
        std::round((elapsed + running_left + (cancel.requested ? 0.0 : order.makespan)) * 1000) / 1000;
  }
  ex["actualDrainSeconds"] = std::round(elapsed * 1000) / 1000;
  const double predicted = ex.value("predictedDrainSeconds", 0.0);
  if (predicted > 0) ex["drainRatio"] = std::round(elapsed / predicted * 1000) / 1000;
  status["execution"] = ex;

  if (counts["failed"] > 0) {
    std::string which;
    int listed = 0;
    for (const auto& e : entries) {
      if (e.value("outcome", "") != "Failed" || ++listed > 10) continue;
      which += (which.empty() ? "" : "; ") + key_of(e.value("namespace", ""), e.value("name", "")) + ": " +
               e.value("error", "");
    }
    set_condition(status, "MigrationFailed", "True", "MigrationFailed",
                  std::to_string(counts["failed"]) + " migration(s) failed, the drain went on with the others: " + which,
                  gen, now_text());
  } else {
    set_condition(status, "MigrationFailed", "False", "NoFailure", "no migration of this plan failed", gen, now_text());
  }
  std::string tally = std::to_string(counts["succeeded"]) + " succeeded, " + std::to_string(counts["failed"]) +
                      " failed, ";
  if (counts["cancelled"] > 0) tally += std::to_string(counts["cancelled"]) + " cancelled, ";
  std::string why = "not converging or no input";
  if (not_started > 0) {
    const std::string by = cancel.requested ? "by the cancel"
                                            : "past the bound of " + std::to_string(kMaxStartedVms) + " VMs";
    why = not_started == counts["skipped"] ? by : std::to_string(not_started) + " " + by + ", the others " + why;
  }
  tally += std::to_string(counts["skipped"]) + " skipped (" + why + ")";
  const std::string ended = "drain of " + in->node + (cancel.requested ? " cancelled" : " ended") + " after " +
                            duration_text(elapsed) + " (forecast " + duration_text(predicted) + "): " + tally;
  std::string cancel_text;
  if (cancel.requested) {
    cancel_text = "spec.cancel seen at " + ex.value("cancelTime", now_micro) + ": no migration started since; " +
                  std::to_string(not_started) + " VM(s) not started, " + std::to_string(counts["running"]) +
                  " running " +
                  (cancel.cancel_running ? "being cancelled (spec.runningOnCancel Cancel)"
                                         : "left to finish (spec.runningOnCancel Finish)");
    if (!cancel.problem.empty()) cancel_text += "; " + cancel.problem + ": read as Finish";
    if (const std::string pc = stopped_path_check_text(status); !pc.empty()) cancel_text += "; " + pc;
    status["phase"] = done ? "Cancelled" : "Cancelling";
    const std::string check_text = stopped_path_check_text(status);
    set_condition(status, "Cancelled", "True", done ? "Cancelled" : "Cancelling",
                  done ? ended + (check_text.empty() ? "" : "; " + check_text) : cancel_text, gen, now_text());
    set_condition(status, "Executed", done ? "False" : "Unknown", done ? "Cancelled" : "Cancelling",
                  done ? ended : cancel_text, gen, now_text());
  } else if (done) {
    status["phase"] = "Completed";
    const bool all = counts["failed"] == 0 && counts["skipped"] == 0;
    set_condition(status, "Executed", all ? "True" : "False",
                  all ? "AllMigrated" : counts["failed"] > 0 ? "MigrationsFailed" : "VMsSkipped", ended, gen, now_text());
  } else {
    set_condition(status, "Executed", "Unknown", "Executing",
                  std::to_string(counts["running"]) + " running, " + std::to_string(counts["pending"]) + " to start; " +
                      tally,
                  gen, now_text());
  }
  check_spec_unchanged(obj, spec, status);
  // No write when only the clock moved (a write wakes this plan again through the watch).
  auto steady = [](json s) {
    if (s.contains("execution") && s["execution"].is_object()) {
      for (const char* k : {"actualDrainSeconds", "drainRatio", "replannedDrainSeconds"}) s["execution"].erase(k);
    }
    return s;
  };
  if (steady(status) != steady(before)) {
    auto w = write_status(obj, status);
    if (!w) return w.error();
    obj = w.value();
    if (first_cancel) events_.record(obj, "Normal", "CancelRequested", cancel_text);
    if (done) {
      const bool all = counts["failed"] == 0 && counts["skipped"] == 0;
      events_.record(obj, all ? "Normal" : "Warning",
                     cancel.requested ? "DrainCancelled" : all ? "Drained" : "DrainIncomplete", ended);
    }
  } else {
    obj["status"] = status;
  }
  export_metrics(obj);
  return done ? Next::kDone : Next::kPoll;
}

void DrainPlanReconciler::export_metrics(const json& obj) {
  const json status = obj.value("status", json::object());
  if (!status.is_object() || !status.contains("summary")) return;
  ControllerMetrics::DrainPlanFigures f;
  f.predicted_seconds = status["summary"].value("predictedDrainSeconds", 0.0);
  const json ex = status.value("execution", json::object());
  if (ex.is_object() && ex.contains("startTime")) {
    f.actual_seconds = ex.contains("finishTime")
                           ? ex.value("actualDrainSeconds", 0.0)
                           : seconds_since(ex.value("startTime", ""), k8s::Clock::now());
    for (const char* state : {"pending", "running", "succeeded", "failed", "skipped", "cancelled"}) {
      f.vms[state] = ex.value(state, int64_t{0});
    }
  } else {
    // A forecast: every planned VM pending, the others skipped.
    const json s = status["summary"];
    f.vms["pending"] = s.value("withinLimits", int64_t{0});
    f.vms["skipped"] = s.value("notConverging", int64_t{0}) + s.value("noInput", int64_t{0});
  }
  metrics_.set_drainplan(obj["metadata"].value("namespace", ""), obj["metadata"].value("name", ""), f);
}

}  // namespace rdmig::controller
