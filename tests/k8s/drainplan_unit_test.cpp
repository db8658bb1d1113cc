// RdmaDrainPlan's pure parts: a VMI's memory, the path a drain uses, the status the forecast
// writes (bounded for 1000 VMIs), and what an executing plan reads from its migrations.
#include <gtest/gtest.h>

#include <map>

#include <nlohmann/json.hpp>

#include "controller/drain_execution.h"
#include "controller/drain_forecast.h"
#include "controller/drainplan_reconciler.h"

namespace rdmig::controller {
namespace {

using nlohmann::json;
constexpr double GiB = 1024.0 * 1024 * 1024;

TEST(DrainPlan, ReadsVmiMemoryFromGuestThenRequestsInBinaryOrDecimal) {
  EXPECT_EQ(vmi_memory(json::parse(R"({"spec":{"domain":{"memory":{"guest":"2Gi"},
            "resources":{"requests":{"memory":"1Gi"}}}}})")), uint64_t(2) << 30);
  EXPECT_EQ(vmi_memory(json::parse(R"({"spec":{"domain":{"resources":{"requests":{"memory":"512Mi"}}}}})")),
            uint64_t(512) << 20);
  EXPECT_EQ(vmi_memory(json::parse(R"({"spec":{"domain":{"memory":{"guest":"1G"}}}})")), uint64_t(1000000000));
  EXPECT_EQ(vmi_memory(json::parse(R"({"spec":{"domain":{"devices":{}}}})")), std::nullopt);
  EXPECT_EQ(vmi_memory(json::parse(R"({"spec":{"domain":{"memory":{"guest":"lots"}}}})")), std::nullopt);
}

// One reader for every number in an annotation (dirty rate, resident memory, the plan's own): the
// whole text or nothing. The dirty rate once took "12x" as 12 (std::stod reads a prefix).
TEST(DrainPlan, AnnotationNumbersReadWholeOrNotAtAll) {
  auto ann = [](json value) { return json{{"n", value}}; };
  EXPECT_EQ(annotation_number(ann("0"), "n"), 0.0);
  EXPECT_EQ(annotation_number(ann("16777216"), "n"), 16777216.0);
  EXPECT_EQ(annotation_number(ann("1.5e+06"), "n"), 1.5e6);
  EXPECT_EQ(annotation_number(ann("2.5"), "n"), 2.5);
  for (const json& bad : {json("12x"), json(" 5"), json("5 "), json("0x10"), json("-1"), json("inf"), json("nan"),
                         json(""), json("1e999"), json("lots"), json(std::string(40, '1')), json(5), json(nullptr)}) {
    EXPECT_EQ(annotation_number(ann(bad), "n"), std::nullopt) << bad.dump();
  }
  EXPECT_EQ(annotation_number(json::object(), "n"), std::nullopt);
  EXPECT_EQ(annotation_number(json("not an object"), "n"), std::nullopt);
}

TEST(DrainPlan, ReadsTheResidentMemoryAnnotationAsBytesAndRefusesWhatDoesNotRead) {
  auto vmi = [](json value) {
    return json{{"metadata", {{"annotations", {{kResidentMemoryAnnotation, value}}}}}};
  };
  EXPECT_EQ(vmi_resident_memory(vmi("134217728")), uint64_t(128) << 20);
  EXPECT_EQ(vmi_resident_memory(vmi("1.34217728e+08")), uint64_t(128) << 20);  // as Prometheus writes it
  for (const json& bad : {json("0"), json("-5"), json("lots"), json("12x"), json(""), json("nan"), json("inf"),
                         json("1e300"), json(134217728), json(nullptr), json(std::string(40, '1'))}) {
    EXPECT_EQ(vmi_resident_memory(vmi(bad)), std::nullopt) << bad.dump();
  }
  EXPECT_EQ(vmi_resident_memory(json{{"metadata", {{"annotations", "not an object"}}}}), std::nullopt);
  EXPECT_EQ(vmi_resident_memory(json::object()), std::nullopt);
}

TEST(DrainPlan, AResidentMeasureIsWhatPassZeroMovesNeverMoreThanTheMemory) {
  // 1 GiB VMs over 1 GiB/s, idle: without a resident measure pass 0 moves the whole GiB; with one
  // of 128 MiB it moves that; a resident figure above the memory counts as the memory.
  DrainVm spec{.ns = "ns", .name = "spec", .memory = uint64_t(1) << 30, .dirty_rate = 0.0, .dirty_source = "annotation"};
  DrainVm resident = spec, above = spec;
  resident.name = "resident", resident.resident = uint64_t(128) << 20, resident.resident_time = "2026-12-07T12:00:00Z";
  above.name = "above", above.resident = uint64_t(3) << 30;
  forecast::PathMeasure path;
  path.throughput = 1 * GiB;
  DrainSettings s;
  s.max_concurrency = 1;
  const json out = drain_forecast({above, resident, spec}, path, "n2", s);
  std::map<std::string, json> by_name;
  for (const auto& e : out["vms"]) by_name[e["name"].get<std::string>()] = e;
  EXPECT_EQ(by_name["spec"]["memorySource"], "spec");
  EXPECT_FALSE(by_name["spec"].contains("residentMemoryBytes"));
  EXPECT_EQ(by_name["resident"]["memorySource"], "resident");
  EXPECT_EQ(by_name["resident"]["residentMemoryBytes"], uint64_t(128) << 20);
  EXPECT_EQ(by_name["resident"]["residentMemoryTime"], "2026-12-07T12:00:00Z");
  EXPECT_EQ(by_name["resident"]["memoryBytes"], uint64_t(1) << 30);
  const double t_spec = by_name["spec"]["totalSeconds"].get<double>();
  EXPECT_NEAR(t_spec, 1.0 + 0.02, 0.01);
  EXPECT_NEAR(by_name["resident"]["totalSeconds"].get<double>(), 0.125 + 0.02, 0.01);
  EXPECT_NEAR(by_name["above"]["totalSeconds"].get<double>(), t_spec, 1e-6);
  EXPECT_EQ(by_name["above"]["memorySource"], "spec");  // what the model took, the figure listed beside it
  EXPECT_EQ(by_name["above"]["residentMemoryBytes"], uint64_t(3) << 30);
  EXPECT_EQ(moved_memory(above), uint64_t(1) << 30);
  // The lower bound counts what the planned VMs move: 1 + 0.125 + 1 GiB at 1 GiB/s.
  EXPECT_NEAR(out["summary"]["lowerBoundSeconds"].get<double>(), 2.125, 1e-3);
}

json check(const std::string& name, const std::string& when, json pairs, int channels = 1) {
  return json{{"metadata", {{"namespace", "ops"}, {"name", name}}},
              {"spec", {{"channels", channels}}},
              {"status", {{"completionTime", when}, {"pairs", pairs}}}};
}

TEST(DrainPlan, UsesTheLatestCheckThatCarriedItsBytesAndItsFastestAllowedPair) {
  const json old_check = check("old", "2026-12-01T10:00:00Z",
                               json::array({{{"source", "n1"}, {"target", "n2"}, {"phase", "Passed"},
                                             {"throughputBytesPerSecond", 9e9}}}));
  const json new_check = check("new", "2026-12-02T10:00:00Z",
                               json::array({{{"source", "n1"}, {"target", "n2"}, {"phase", "Passed"},
                                             {"throughputBytesPerSecond", 1e9}, {"rttMicroseconds", 40}},
                                            {{"source", "n1"}, {"target", "n3"}, {"phase", "FellBack"},
                                             {"transport", "tcp"}, {"throughputBytesPerSecond", 2e9}},
                                            {{"source", "n1"}, {"target", "n4"}, {"phase", "Failed"}}}), 4);
  const json other_source = check("other", "2026-12-03T10:00:00Z",
                                  json::array({{{"source", "n9"}, {"target", "n2"}, {"phase", "Passed"},
                                                {"throughputBytesPerSecond", 5e9}}}));
  auto p = best_path_pair({old_check, new_check, other_source}, "n1", {});
  ASSERT_TRUE(p.is_object());
  EXPECT_EQ(p["pathCheck"], "ops/new");
  EXPECT_EQ(p["target"], "n3");
  EXPECT_EQ(p["channels"], 4);
  EXPECT_EQ(p["measuredAt"], "2026-12-02T10:00:00Z");
  p = best_path_pair({old_check, new_check}, "n1", {"n2"});
  EXPECT_EQ(p["target"], "n2");
  EXPECT_EQ(p["pathCheck"], "ops/new");
  EXPECT_EQ(p["rttMicroseconds"], 40);
  EXPECT_TRUE(best_path_pair({old_check, new_check}, "n1", {"n4"}).is_null());  // only a failed pair
  EXPECT_TRUE(best_path_pair({old_check}, "n2", {}).is_null());
}

TEST(DrainPlan, ThousandVmisGiveABoundedListAndAFullSummary) {
  std::vector<DrainVm> vms;
  for (int i = 0; i < 1000; ++i) {
    DrainVm vm{.ns = "ns", .name = "vm" + std::to_string(i), .memory = uint64_t(256) << 20,
               .dirty_rate = 10.0 * (1 << 20), .dirty_source = "annotation"};
    if (i % 100 == 7) vm.memory = uint64_t(1) << 30, vm.dirty_rate = 4 * GiB;  // 10 never converge
    if (i == 500) vm.memory.reset();             // 1 names no memory
    if (i == 501) vm.dirty_rate.reset(), vm.dirty_source = "none";
    vms.push_back(vm);
  }
  forecast::PathMeasure path;
  path.throughput = 1 * GiB;
  DrainSettings s;
  s.max_concurrency = 2;
  const json out = drain_forecast(vms, path, "n2", s);
  const json& sum = out["summary"];
  EXPECT_EQ(sum["vms"], 1000);
  EXPECT_EQ(sum["notConverging"], 10);
  EXPECT_EQ(sum["noInput"], 1);
  EXPECT_EQ(sum["unmeasuredDirtyRate"], 1);
  EXPECT_EQ(sum["withinLimits"], 989);
  EXPECT_EQ(sum["listed"], 100);
  EXPECT_EQ(sum["omitted"], 900);
  ASSERT_EQ(out["vms"].size(), 100u);
  EXPECT_LE(out.dump().size(), 120000u);  // far below the API server's 1.5 MiB object limit
  // The VMs that need attention come first: 10 not converging and the one without memory.
  for (size_t i = 0; i < 11; ++i) EXPECT_FALSE(out["vms"][i].value("convergesWithinLimits", false)) << i;
  EXPECT_TRUE(out["vms"][0].contains("reason"));
  EXPECT_EQ(out["vms"][11]["order"], 0);
  // 989 planned VMs of 256 MiB over 1 GiB/s: at least 247.25 s.
  EXPECT_NEAR(sum["lowerBoundSeconds"].get<double>(), 989 * 0.25, 1e-3);
  EXPECT_GE(sum["predictedDrainSeconds"].get<double>(), sum["lowerBoundSeconds"].get<double>());
  EXPECT_EQ(sum["predictedDrain"], duration_text(sum["predictedDrainSeconds"].get<double>()));
  // A non-converging VM says what would make it converge, with figures.
  const json& bad = out["vms"][0];
  EXPECT_EQ(bad["name"], "vm7");  // the unplanned keep the input's order
  EXPECT_TRUE(bad["remedies"].contains("postCopy"));
  EXPECT_TRUE(bad["remedies"].contains("largerDowntime"));
  EXPECT_GT(bad["remedies"]["largerDowntime"]["maxDowntimeSeconds"].get<double>(), 0.25);
}

TEST(DrainPlan, MigrationNamesAreDeterministicBoundedAndDistinctPerPlan) {
  const std::string a = drain_migration_name("drain-c", "uid-1", "vms", "web-1");
  EXPECT_EQ(a, drain_migration_name("drain-c", "uid-1", "vms", "web-1"));  // a restarted controller names it alike
  EXPECT_EQ(a.rfind("drain-c-web-1-", 0), 0u);
  EXPECT_NE(a, drain_migration_name("drain-c", "uid-2", "vms", "web-1"));  // a plan made again under the same name
  EXPECT_NE(a, drain_migration_name("drain-c", "uid-1", "other", "web-1"));
  EXPECT_LE(drain_migration_name(std::string(253, 'p'), "u", "n", std::string(253, 'v')).size(), 240u);
}

TEST(DrainPlan, ExecutedEntryPutsMeasuredFiguresBesideTheForecast) {
  json m = json::parse(R"({"metadata": {"namespace": "vms", "name": "drain-c-web-1-0a1b2c3d",
      "annotations": {"rdmig.io/drain-order": "2", "rdmig.io/drain-predicted-total-seconds": "2.000",
                      "rdmig.io/drain-predicted-downtime-seconds": "0.100",
                      "rdmig.io/drain-start-time": "2026-12-05T10:00:00.000000Z"}},
      "spec": {"source": {"vmi": {"name": "web-1"}}}, "status": {"phase": "Migrating"}})");
  json e = executed_entry(m, json(), "2026-12-05T10:00:05.000000Z");
  EXPECT_EQ(e["outcome"], "Running");
  EXPECT_EQ(e["order"], 2);
  EXPECT_FALSE(e.contains("finishTime"));
  // An order someone else wrote that is no whole number up to 2^53 is left out, not cast.
  for (const char* bad : {"1e300", "2.5", "12x"}) {
    json edited = m;
    edited["metadata"]["annotations"]["rdmig.io/drain-order"] = bad;
    EXPECT_FALSE(executed_entry(edited, json(), "2026-12-05T10:00:05.000000Z").contains("order")) << bad;
  }
  m["status"] = json{{"phase", "Succeeded"}, {"totalTimeMs", 2500}, {"downtimeMs", 50}};
  e = executed_entry(m, json{{"finishTime", "2026-12-05T10:00:03.000000Z"}}, "2026-12-05T10:00:05.000000Z");
  EXPECT_EQ(e["outcome"], "Succeeded");
  EXPECT_EQ(e["finishTime"], "2026-12-05T10:00:03.000000Z");  // first seen ended, kept
  EXPECT_EQ(e["actualTotalSeconds"], 2.5);                     // libvirt's
  EXPECT_EQ(e["totalRatio"], 1.25);
  EXPECT_EQ(e["actualDowntimeSeconds"], 0.05);
  EXPECT_EQ(e["downtimeRatio"], 0.5);
  m["status"].erase("totalTimeMs");  // no libvirt figure: finish - start
  EXPECT_EQ(executed_entry(m, json{{"finishTime", "2026-12-05T10:00:03.000000Z"}}, "")["actualTotalSeconds"], 3.0);
  m["status"] = json{{"phase", "Failed"}, {"reason", "MigrationFailed"}, {"failureReason", "KubeVirt: boom"}};
  e = executed_entry(m, json(), "2026-12-05T10:00:05.000000Z");
  EXPECT_EQ(e["outcome"], "Failed");
  EXPECT_EQ(e["error"], "MigrationFailed: KubeVirt: boom");
  EXPECT_FALSE(e.contains("actualTotalSeconds"));
}

TEST(DrainPlan, AMigrationTheCancelledPlanCancelledIsCancelledNotFailed) {
  json m = json::parse(R"({"metadata": {"namespace": "vms", "name": "drain-c-web-1-0a1b2c3d",
      "annotations": {"rdmig.io/drain-order": "0", "rdmig.io/drain-cancelled": "ops/drain-c"}},
      "spec": {"source": {"vmi": {"name": "web-1"}}, "cancel": true},
      "status": {"phase": "Cancelled", "reason": "Cancelled", "failureReason": "VMIM deleted"}})");
  json e = executed_entry(m, json(), "2026-12-05T10:00:05.000000Z");
  EXPECT_EQ(e["outcome"], "Cancelled");
  EXPECT_EQ(e["error"], "Cancelled: cancelled with the plan (spec.runningOnCancel Cancel): VMIM deleted");
  m["metadata"]["annotations"].erase("rdmig.io/drain-cancelled");  // cancelled by someone else: a failure
  EXPECT_EQ(executed_entry(m, json(), "2026-12-05T10:00:05.000000Z")["outcome"], "Failed");
  m["metadata"]["annotations"]["rdmig.io/drain-cancelled"] = "ops/drain-c";
  m["status"]["phase"] = "Succeeded";  // too late to cancel: it moved
  EXPECT_EQ(executed_entry(m, json(), "2026-12-05T10:00:05.000000Z")["outcome"], "Succeeded");
}

TEST(DrainPlan, CancelIsReadFromTheSpecAndAnUnknownRunningPolicyIsNamed) {
  EXPECT_FALSE(read_cancel(json::object()).requested);
  EXPECT_FALSE(read_cancel(json{{"cancel", "yes"}}).requested);
  const CancelRequest finish = read_cancel(json{{"cancel", true}});
  EXPECT_TRUE(finish.requested);
  EXPECT_FALSE(finish.cancel_running);
  EXPECT_TRUE(finish.problem.empty());
  EXPECT_TRUE(read_cancel(json{{"cancel", true}, {"runningOnCancel", "Cancel"}}).cancel_running);
  const CancelRequest odd = read_cancel(json{{"cancel", true}, {"runningOnCancel", "Abort"}});
  EXPECT_FALSE(odd.cancel_running);
  EXPECT_EQ(odd.problem, "spec.runningOnCancel: Finish or Cancel, not Abort");
}

TEST(DrainPlan, ASpecChangedWhileExecutingNamesEachFieldButTheCancel) {
  const json started = json::parse(R"({"node": "n1", "maxConcurrentPerPair": 1, "execute": true,
                                       "selector": {"app": "web"}, "cancel": false})");
  const json frozen = frozen_spec(started);
  EXPECT_FALSE(frozen.contains("cancel"));
  EXPECT_EQ(frozen["selector"], started["selector"]);
  json now = started;
  now["cancel"] = true;
  now["runningOnCancel"] = "Cancel";
  EXPECT_TRUE(changed_spec_fields(frozen, now).empty());
  now["maxConcurrentPerPair"] = 3;      // changed
  now["selector"]["tier"] = "db";       // changed inside
  now.erase("execute");                 // removed
  now["maxDowntime"] = "1s";            // added
  EXPECT_EQ(changed_spec_fields(frozen, now),
            (std::vector<std::string>{"spec.execute", "spec.maxConcurrentPerPair", "spec.maxDowntime", "spec.selector"}));
}

TEST(DrainPlan, EveryStartedVmIsRecordedAndOneWhoseMigrationIsGoneKeepsItsEnd) {
  const std::vector<json> entries{
      {{"namespace", "vms"}, {"name", "b"}, {"migration", "p-b-1"}, {"outcome", "Failed"}, {"error", "boom"}},
      {{"namespace", "vms"}, {"name", "a"}, {"migration", "p-a-1"}, {"outcome", "Running"}},
      {{"namespace", "vms"}, {"name", "c"}, {"outcome", "Pending"}}};  // not started: not recorded
  EXPECT_EQ(started_record(entries), json::parse(R"([{"namespace": "vms", "name": "a", "outcome": "Running"},
                                                     {"namespace": "vms", "name": "b", "outcome": "Failed"}])"));
  const std::string now = "2026-12-05T10:00:05.000000Z";
  // Failed, then deleted: its last entry as it was.
  json e = gone_entry(json{{"namespace", "vms"}, {"name", "b"}, {"outcome", "Failed"}}, entries[0], "p-b-1", now);
  EXPECT_EQ(e, entries[0]);
  // Not listed in status.vms (past the 100): made from the record.
  e = gone_entry(json{{"namespace", "vms"}, {"name", "b"}, {"outcome", "Succeeded"}}, json(), "p-b-1", now);
  EXPECT_EQ(e, json::parse(R"({"namespace": "vms", "name": "b", "outcome": "Succeeded", "migration": "p-b-1"})"));
  // Deleted while it ran: the deletion aborted it.
  e = gone_entry(json{{"namespace", "vms"}, {"name", "a"}, {"outcome", "Running"}}, entries[1], "p-a-1", now);
  EXPECT_EQ(e["outcome"], "Failed");
  EXPECT_EQ(e["finishTime"], now);
  EXPECT_NE(e["error"].get<std::string>().find("was deleted before it ended"), std::string::npos);
}

TEST(DrainPlan, CalibrationIsMeasuredOverForecastOfTheSucceededAndBounded) {
  EXPECT_EQ(calibrate({}).measured, 0);
  EXPECT_EQ(calibrate({}).ratio, 1);
  const std::vector<json> entries{
      {{"outcome", "Succeeded"}, {"totalSeconds", 1.0}, {"actualTotalSeconds", 2.0}},
      {{"outcome", "Succeeded"}, {"totalSeconds", 3.0}, {"actualTotalSeconds", 4.0}},
      {{"outcome", "Failed"}, {"totalSeconds", 1.0}, {"actualTotalSeconds", 100.0}},
      {{"outcome", "Running"}, {"totalSeconds", 1.0}}};
  const Calibration c = calibrate(entries);
  EXPECT_EQ(c.measured, 2);
  EXPECT_DOUBLE_EQ(c.ratio, 1.5);
  EXPECT_EQ(calibrate({{{"outcome", "Succeeded"}, {"totalSeconds", 1.0}, {"actualTotalSeconds", 100.0}}}).ratio, 10);
}

TEST(DrainPlan, DurationsReadAsPeopleWriteThem) {
  EXPECT_EQ(duration_text(42.04), "42.0s");
  EXPECT_EQ(duration_text(725), "12m05s");
  EXPECT_EQ(duration_text(7380), "2h03m");
}

TEST(DrainPlan, ACancelStopsThePlansOwnPathCheckOnlyWhileItRuns) {
  json check = json::parse(R"({"metadata": {"namespace": "ops", "name": "drain-b-paths",
      "ownerReferences": [{"kind": "RdmaDrainPlan", "name": "drain-b", "uid": "uid-b"}]},
      "status": {"phase": "Running", "pairs": [{"target": "node-a", "phase": "Passed"},
                                               {"target": "node-c", "phase": "Running"},
                                               {"target": "node-d", "phase": "Pending"}]}})");
  PathCheckStop s = path_check_to_stop(check, "uid-b");
  EXPECT_TRUE(s.stop);
  EXPECT_EQ(s.where, "1 of 3 pair(s) ended, 1 running");
  EXPECT_FALSE(path_check_to_stop(check, "uid-other").stop);  // another plan's (or a person's) check
  EXPECT_FALSE(path_check_to_stop(check, "").stop);
  for (const char* phase : {"Succeeded", "Failed"}) {  // ended: nothing to stop, its figures kept
    json ended = check;
    ended["status"]["phase"] = phase;
    EXPECT_FALSE(path_check_to_stop(ended, "uid-b").stop) << phase;
  }
  json fresh = check;  // created a moment ago: no status yet
  fresh.erase("status");
  s = path_check_to_stop(fresh, "uid-b");
  EXPECT_TRUE(s.stop);
  EXPECT_EQ(s.where, "not started yet");
  json deleting = check;  // being deleted already (its finalizer cancels the pairs)
  deleting["metadata"]["deletionTimestamp"] = "2026-12-05T10:00:00Z";
  EXPECT_FALSE(path_check_to_stop(deleting, "uid-b").stop);
  json by_label = check;  // no owner reference, the plan's uid label
  by_label["metadata"].erase("ownerReferences");
  EXPECT_FALSE(path_check_to_stop(by_label, "uid-b").stop);
  by_label["metadata"]["labels"] = {{kPlanUidLabel, "uid-b"}};
  EXPECT_TRUE(path_check_to_stop(by_label, "uid-b").stop);

  EXPECT_EQ(stopped_path_check_text(json::object()), "");
  EXPECT_EQ(stopped_path_check_text(json{{"createdPathCheck", {{"name", "ops/drain-b-paths"}}}}), "");  // not stopped
  EXPECT_EQ(stopped_path_check_text(json{{"createdPathCheck", {{"name", "ops/drain-b-paths"},
                                                               {"stopTime", "2026-12-05T10:00:01Z"},
                                                               {"stopped", "0 of 1 pair(s) ended, 1 running"}}}}),
            "path check ops/drain-b-paths stopped at 2026-12-05T10:00:01Z (0 of 1 pair(s) ended, 1 running): "
            "deleted, its pairs cancelled on the agents");
  EXPECT_EQ(stopped_path_check_text(json{{"createdPathCheck", {{"name", "ops/drain-b-paths"},
                                                               {"stopError", "stopping path check: 403 Forbidden"}}}}),
            "path check ops/drain-b-paths still runs: stopping it failed (stopping path check: 403 Forbidden); "
            "retried until it holds");
}

}  // namespace
}  // namespace rdmig::controller
