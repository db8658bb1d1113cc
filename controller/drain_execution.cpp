#include "controller/drain_execution.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>

#include "k8s/time_format.h"

namespace rdmig::controller {

double round3(double seconds) { return std::round(seconds * 1000) / 1000; }

using nlohmann::json;

std::optional<double> annotation_number(const json& annotations, const char* key) {
  if (!annotations.is_object() || !annotations.contains(key) || !annotations[key].is_string()) return std::nullopt;
  const std::string text = annotations[key].get<std::string>();
  if (text.empty() || text.size() > 32 ||
      text.find_first_not_of("0123456789.eE+-") != std::string::npos) {
    return std::nullopt;
  }
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (...) {
    return std::nullopt;
  }
  if (used != text.size() || !std::isfinite(v) || v < 0) return std::nullopt;
  return v;
}

namespace {

std::optional<double> seconds_between(const std::string& from, const std::string& to) {
  const auto a = k8s::parse_time(from), b = k8s::parse_time(to);
  if (!a || !b) return std::nullopt;
  return std::max(0.0, std::chrono::duration<double>(*b - *a).count());
}

}  // namespace

std::string drain_migration_name(const std::string& plan, const std::string& plan_uid, const std::string& vmi_ns,
                                 const std::string& vmi) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (const char c : plan_uid + "/" + vmi_ns + "/" + vmi) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08llx", static_cast<unsigned long long>(h & 0xffffffffull));
  auto part = [](std::string s, size_t n) {
    if (s.size() > n) s.resize(n);
    while (!s.empty() && (s.back() == '-' || s.back() == '.')) s.pop_back();
    return s;
  };
  return part(plan, 100) + "-" + part(vmi, 120) + "-" + hex;
}

json executed_entry(const json& migration, const json& previous, const std::string& now) {
  const json md = migration.value("metadata", json::object());
  const json ann = md.value("annotations", json::object());
  const json spec = migration.value("spec", json::object());
  const json st = migration.value("status", json::object()).is_object() ? migration.value("status", json::object())
                                                                         : json::object();
  std::string vmi;
  if (spec.is_object() && spec.contains("source") && spec["source"].is_object() && spec["source"].contains("vmi") &&
      spec["source"]["vmi"].is_object()) {
    vmi = spec["source"]["vmi"].value("name", "");
  }
  json e{{"namespace", md.value("namespace", "")}, {"name", vmi}, {"migration", md.value("name", "")}};
  // The order is a whole number the plan wrote; anyone who may edit the migration may write
  // another ("1e300" reads as a number, and casting it would be undefined): at most 2^53 or none.
  if (const auto o = annotation_number(ann, kOrderAnnotation); o && *o <= kMaxExactWhole && *o == std::floor(*o)) {
    e["order"] = static_cast<int64_t>(*o);
  }
  const auto predicted_total = annotation_number(ann, kPredictedTotalAnnotation);
  const auto predicted_downtime = annotation_number(ann, kPredictedDowntimeAnnotation);
  if (predicted_total) e["totalSeconds"] = round3(*predicted_total);
  if (predicted_downtime) e["downtimeSeconds"] = round3(*predicted_downtime);
  const std::string start = ann.is_object() ? ann.value(kStartAnnotation, std::string()) : std::string();
  if (!start.empty()) e["startTime"] = start;
  const std::string phase = st.value("phase", "");
  const bool ended = phase == "Succeeded" || phase == "Failed" || phase == "Cancelled";
  if (!ended) {
    e["outcome"] = "Running";
    return e;
  }
  const bool by_plan = phase == "Cancelled" && ann.is_object() && ann.contains(kCancelledByPlanAnnotation);
  e["outcome"] = phase == "Succeeded" ? "Succeeded" : by_plan ? "Cancelled" : "Failed";
  std::string finish = previous.is_object() ? previous.value("finishTime", std::string()) : std::string();
  if (finish.empty()) finish = now;
  e["finishTime"] = finish;
  if (phase != "Succeeded") {
    std::string error = st.value("failureReason", std::string());
    if (error.empty()) error = phase == "Cancelled" ? "cancelled" : "failed without a reason";
    if (by_plan) error = "cancelled with the plan (spec.runningOnCancel Cancel): " + error;
    e["error"] = (st.value("reason", std::string()).empty() ? error : st.value("reason", std::string()) + ": " + error)
                     .substr(0, 1000);
    return e;
  }
  std::optional<double> total;
  if (st.contains("totalTimeMs") && st["totalTimeMs"].is_number()) total = st["totalTimeMs"].get<double>() / 1000;
  else if (!start.empty()) total = seconds_between(start, finish);
  if (total) {
    e["actualTotalSeconds"] = round3(*total);
    if (predicted_total && *predicted_total > 0) e["totalRatio"] = round3(*total / *predicted_total);
  }
  if (st.contains("downtimeMs") && st["downtimeMs"].is_number()) {
    const double downtime = st["downtimeMs"].get<double>() / 1000;
    e["actualDowntimeSeconds"] = round3(downtime);
    if (predicted_downtime && *predicted_downtime > 0) e["downtimeRatio"] = round3(downtime / *predicted_downtime);
  }
  return e;
}

CancelRequest read_cancel(const json& spec) {
  CancelRequest c;
  if (!spec.is_object()) return c;
  c.requested = spec.value("cancel", json(false)).is_boolean() && spec.value("cancel", false);
  const json running = spec.value("runningOnCancel", json("Finish"));
  const std::string value = running.is_string() ? running.get<std::string>() : running.dump();
  if (value == "Cancel") c.cancel_running = true;
  else if (value != "Finish") c.problem = "spec.runningOnCancel: Finish or Cancel, not " + value.substr(0, 64);
  return c;
}

namespace {
bool mutable_field(const std::string& key) { return key == "cancel" || key == "runningOnCancel"; }
}  // namespace

json frozen_spec(const json& spec) {
  json frozen = json::object();
  if (!spec.is_object()) return frozen;
  for (const auto& [k, v] : spec.items()) {
    if (!mutable_field(k)) frozen[k] = v;
  }
  return frozen;
}

std::vector<std::string> changed_spec_fields(const json& frozen, const json& spec) {
  const json a = frozen_spec(frozen), b = frozen_spec(spec);
  std::set<std::string> keys;
  for (const auto& [k, v] : a.items()) keys.insert(k);
  for (const auto& [k, v] : b.items()) keys.insert(k);
  std::vector<std::string> changed;
  for (const auto& k : keys) {
    if (!a.contains(k) || !b.contains(k) || a[k] != b[k]) changed.push_back("spec." + k);
  }
  return changed;
}

json started_record(const std::vector<json>& entries) {
  std::vector<std::pair<std::pair<std::string, std::string>, std::string>> rows;
  for (const auto& e : entries) {
    if (!e.contains("migration")) continue;
    rows.push_back({{e.value("namespace", ""), e.value("name", "")}, e.value("outcome", "")});
  }
  std::sort(rows.begin(), rows.end());
  json record = json::array();
  for (const auto& [key, outcome] : rows) {
    record.push_back(json{{"namespace", key.first}, {"name", key.second}, {"outcome", outcome}});
  }
  return record;
}

json gone_entry(const json& record, const json& previous, const std::string& migration, const std::string& now) {
  json e = previous.is_object() && !previous.empty()
               ? previous
               : json{{"namespace", record.value("namespace", "")},
                      {"name", record.value("name", "")},
                      {"outcome", record.value("outcome", "Running")}};
  e["migration"] = migration;
  const std::string outcome = e.value("outcome", "");
  if (outcome == "Succeeded" || outcome == "Failed" || outcome == "Cancelled") return e;
  e["outcome"] = "Failed";
  e["finishTime"] = now;
  e["error"] = "RdmaMigration " + migration +
               " was deleted before it ended (deleting it aborts the migration); this plan does not start the VM again";
  return e;
}

Calibration calibrate(const std::vector<json>& entries) {
  Calibration c;
  double actual = 0, predicted = 0;
  for (const auto& e : entries) {
    if (e.value("outcome", "") != "Succeeded" || !e.contains("actualTotalSeconds") || !e.contains("totalSeconds")) {
      continue;
    }
    const double p = e["totalSeconds"].get<double>(), a = e["actualTotalSeconds"].get<double>();
    if (!(p > 0) || !(a > 0)) continue;
    actual += a, predicted += p, ++c.measured;
  }
  if (c.measured > 0) c.ratio = std::clamp(actual / predicted, 0.1, 10.0);
  return c;
}

PathCheckStop path_check_to_stop(const json& check, const std::string& plan_uid) {
  PathCheckStop out;
  if (!check.is_object() || plan_uid.empty()) return out;
  const json md = check.value("metadata", json::object());
  if (!md.is_object() || md.contains("deletionTimestamp")) return out;
  bool owned = false;
  for (const auto& r : md.value("ownerReferences", json::array())) {
    owned |= r.is_object() && r.value("uid", "") == plan_uid;
  }
  const json labels = md.value("labels", json::object());
  owned |= labels.is_object() && labels.value(kPlanUidLabel, "") == plan_uid;
  if (!owned) return out;
  const json status = check.value("status", json::object());
  const std::string phase = status.is_object() ? status.value("phase", "") : "";
  if (phase != "" && phase != "Pending" && phase != "Running") return out;
  size_t ended = 0, running = 0, pairs = 0;
  if (status.is_object()) {
    for (const auto& p : status.value("pairs", json::array())) {
      const std::string pp = p.is_object() ? p.value("phase", "") : "";
      ++pairs;
      ended += pp == "Passed" || pp == "FellBack" || pp == "Failed";
      running += pp == "Running";
    }
  }
  out.stop = true;
  out.where = pairs == 0 ? std::string("not started yet")
                         : std::to_string(ended) + " of " + std::to_string(pairs) + " pair(s) ended, " +
                               std::to_string(running) + " running";
  return out;
}

std::string stopped_path_check_text(const json& status) {
  if (!status.is_object()) return "";
  const json r = status.value("createdPathCheck", json::object());
  if (!r.is_object()) return "";
  if (!r.contains("stopTime")) {
    if (!r.contains("stopError")) return "";
    return "path check " + r.value("name", std::string("?")) + " still runs: stopping it failed (" +
           r.value("stopError", std::string()) + "); retried until it holds";
  }
  return "path check " + r.value("name", std::string("?")) + " stopped at " + r.value("stopTime", std::string()) +
         " (" + r.value("stopped", std::string("running")) + "): deleted, its pairs cancelled on the agents";
}

}  // namespace rdmig::controller
