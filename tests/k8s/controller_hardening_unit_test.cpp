// Unit tests for the controller's hardening (issue 11): text cut between UTF-8 characters,
// field selector escaping, the agents' `vm` name for maximal object names, the time-to-live of
// finished objects, and the per-node slot taken by what runs rather than by the spec.
#include <gtest/gtest.h>

#include "common/text.h"
#include "controller/config.h"
#include "controller/migration_spec.h"
#include "controller/reconciler.h"
#include "controller/status_mapping.h"
#include "k8s/selectors.h"
#include "k8s/time_format.h"

using nlohmann::json;
using namespace rdmig;

namespace {

// Valid UTF-8 as nlohmann sees it: a strict dump throws on anything else.
bool strict_dump_ok(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::exception&) {
    return false;
  }
}

json finished(const std::string& phase, const std::string& completion, json spec = json::object()) {
  return json{{"metadata", {{"name", "m"}, {"namespace", "ns"}}},
              {"spec", spec},
              {"status", {{"phase", phase}, {"completionTime", completion}}}};
}

}  // namespace

TEST(Utf8Prefix, NeverCutsInsideACharacter) {
  const std::string four = "\xF0\x9F\x98\x80";  // U+1F600, 4 bytes
  std::string text;
  for (int i = 0; i < 300; ++i) text += four + "\xC3\xA9" + "a";  // 4 + 2 + 1 bytes
  for (size_t max = 0; max < 64; ++max) {
    const std::string cut = utf8_prefix(text, max);
    EXPECT_LE(cut.size(), max);
    EXPECT_GE(cut.size() + 3, max) << "dropped more than one character";
    EXPECT_TRUE(strict_dump_ok(cut)) << "cut at " << max << " left half a character";
  }
  EXPECT_EQ(utf8_prefix("short", 1024), "short");
  EXPECT_FALSE(strict_dump_ok(text.substr(0, 1024)));  // what a byte cut did
  EXPECT_TRUE(strict_dump_ok(utf8_prefix(text, 1024)));
}

TEST(Selectors, FieldSelectorValuesAreEscaped) {
  EXPECT_EQ(k8s::field_selector_value("node-a"), "node-a");
  EXPECT_EQ(k8s::field_selector_value("a,b=c\\d"), "a\\,b\\=c\\\\d");
  EXPECT_EQ(k8s::url_encode("spec.nodeName=" + k8s::field_selector_value("x,y")), "spec.nodeName%3Dx%5C%2Cy");
}

TEST(MigrationSpec, VmNameFitsTheAgentsLimitForMaximalNames) {
  const std::string ns(63, 'n');
  const std::string name(253, 'a');
  json obj{{"metadata", {{"namespace", ns}, {"name", name}}}};
  const std::string vm = controller::vm_name(obj);
  EXPECT_EQ(vm.size(), controller::kMaxVmName);
  EXPECT_EQ(vm.rfind(ns + "/aaaa", 0), 0u) << vm;
  EXPECT_EQ(controller::vm_name(obj), vm) << "deterministic";
  json other = obj;
  other["metadata"]["name"] = std::string(252, 'a') + "b";
  EXPECT_NE(controller::vm_name(other), vm) << "names that differ only past the cut stay distinct";
  EXPECT_EQ(controller::vm_name(json{{"metadata", {{"namespace", "vms"}, {"name", "web-1"}}}}), "vms/web-1");
  json fits{{"metadata", {{"namespace", "vms"}, {"name", std::string(249, 'x')}}}};
  EXPECT_EQ(controller::vm_name(fits), "vms/" + std::string(249, 'x'));
}

TEST(FinishedObjects, DeletionIsDueAfterTheTimeToLive) {
  const auto t0 = k8s::parse_time("2024-05-01T12:00:00Z").value();
  using std::chrono::seconds;
  EXPECT_EQ(controller::deletion_due(finished("Succeeded", "2024-05-01T12:00:00Z"), 600).value(), t0 + seconds(600));
  EXPECT_EQ(controller::deletion_due(finished("Failed", "2024-05-01T12:00:00Z", {{"ttlSecondsAfterFinished", 0}}), 600)
                .value(),
            t0);
  EXPECT_EQ(
      controller::deletion_due(finished("Cancelled", "2024-05-01T12:00:00Z", {{"ttlSecondsAfterFinished", 5}}), 600)
          .value(),
      t0 + seconds(5));
  // A negative value (an API server that did not check the schema) falls back to the default.
  EXPECT_EQ(
      controller::deletion_due(finished("Failed", "2024-05-01T12:00:00Z", {{"ttlSecondsAfterFinished", -5}}), 600)
          .value(),
      t0 + seconds(600));
  EXPECT_FALSE(controller::deletion_due(finished("Migrating", "2024-05-01T12:00:00Z"), 0));
  EXPECT_FALSE(controller::deletion_due(finished("Failed", "not a time"), 0));

  auto obj = finished("Succeeded", "2024-05-01T12:00:00Z", {{"ttlSecondsAfterFinished", 10}});
  EXPECT_FALSE(controller::finished_needs_work(obj, 600, t0 + seconds(9)));
  EXPECT_TRUE(controller::finished_needs_work(obj, 600, t0 + seconds(10)));
  obj["metadata"]["finalizers"] = json::array({controller::kFinalizer});
  EXPECT_TRUE(controller::finished_needs_work(obj, 600, t0)) << "the finalizer must go";
}

TEST(ControllerConfig, TtlSecondsAfterFinishedDefaultAndBounds) {
  EXPECT_EQ(controller::parse_controller_config("")->ttl_seconds_after_finished, 86400u);
  EXPECT_EQ(controller::parse_controller_config("ttlSecondsAfterFinished: 0")->ttl_seconds_after_finished, 0u);
  auto bad = controller::parse_controller_config("ttlSecondsAfterFinished: -1");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("ttlSecondsAfterFinished"), std::string::npos);
}

TEST(NodeSlots, ARunningObjectHoldsTheNodesItStartedOnNotWhatItsSpecSaysNow) {
  json obj{{"spec",
            {{"source", {{"qemu", {{"node", "a"}, {"qmpSocket", "/a"}}}}},
             {"target", {{"qemu", {{"node", "edited"}, {"qmpSocket", "/b"}}}}}}},
           {"status",
            {{"phase", "Migrating"},
             {"sourceAgent", {{"node", "a"}, {"pod", "p"}, {"address", "1.2.3.4:1"}}},
             {"targetAgent", {{"node", "b"}, {"pod", "q"}, {"address", "1.2.3.5:1"}}}}}};
  EXPECT_EQ(controller::nodes_in_use(obj), (std::vector<std::string>{"a", "b"}));
  obj["status"]["phase"] = "Failed";
  EXPECT_TRUE(controller::nodes_in_use(obj).empty());
  obj["status"] = json{{"phase", "Pending"}};
  EXPECT_TRUE(controller::nodes_in_use(obj).empty());
}

TEST(StatusMapping, ConditionMessagesAreBoundedBetweenCharacters) {
  std::string long_text;
  for (int i = 0; i < 3000; ++i) long_text += "\xE2\x82\xAC";  // U+20AC, 3 bytes
  json status;
  controller::set_condition(status, "Succeeded", "False", "X", long_text, 1, "2024-05-01T12:00:00Z");
  const std::string msg = status["conditions"][0]["message"];
  EXPECT_LE(msg.size(), controller::kMaxMessageBytes);
  EXPECT_TRUE(strict_dump_ok(msg));
}
