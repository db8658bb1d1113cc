// Unit tests for the controller's hardening (issue 11): text cut between UTF-8 characters,
// field selector escaping, the agents' `vm` name for maximal object names, the time-to-live of
// finished objects, the per-node slot taken by what runs rather than by the spec, and the
// bounded cache of /metrics' token and access reviews (its reviews against the API server double
// run in tests/k8s/test_controller_faults.py).
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "common/text.h"
#include "controller/config.h"
#include "controller/metrics_auth.h"
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

namespace {

// An API server that answers TokenReviews from a table of tokens and SubjectAccessReviews from a
// set of allowed users, counting both; `down` makes every call fail as a refused connection.
class ReviewingApi final : public k8s::KubeClient {
 public:
  std::map<std::string, std::string> users;  // token -> username
  std::set<std::string> allowed;             // usernames that may get /metrics
  bool down = false;
  int token_reviews = 0, access_reviews = 0;
  json last_access_spec;

  Result<json> create(const std::string& path, const json& body) override {
    if (down) return Error{Errc::kUnavailable, "POST " + path + ": Connection refused"};
    if (path == "/apis/authentication.k8s.io/v1/tokenreviews") {
      ++token_reviews;
      auto it = users.find(body["spec"]["token"].get<std::string>());
      json status = {{"authenticated", it != users.end()}};
      if (it != users.end()) status["user"] = {{"username", it->second}, {"groups", {"system:authenticated"}}};
      return json{{"status", status}};
    }
    if (path == "/apis/authorization.k8s.io/v1/subjectaccessreviews") {
      ++access_reviews;
      last_access_spec = body["spec"];
      return json{{"status", {{"allowed", allowed.count(body["spec"]["user"].get<std::string>()) > 0}}}};
    }
    return Error{Errc::kNotFound, path};
  }
  Result<json> get(const std::string& p) override { return Error{Errc::kNotFound, p}; }
  Result<json> replace(const std::string& p, const json&) override { return Error{Errc::kNotFound, p}; }
  Result<json> remove(const std::string& p, const json&) override { return Error{Errc::kNotFound, p}; }
  Result<k8s::WatchEnd> watch(const std::string&, const std::function<bool(const k8s::WatchEvent&)>&) override {
    return k8s::WatchEnd::kStopped;
  }
  void stop_watches() override {}
};

}  // namespace

TEST(MetricsAuth, ReviewsOnceThenAnswersFromTheCacheUntilTheTtl) {
  ReviewingApi api;
  api.users = {{"prom-token", "system:serviceaccount:monitoring:prometheus"}};
  api.allowed = {"system:serviceaccount:monitoring:prometheus"};
  auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  controller::MetricsAuth auth(api, 8, [&] { return now; });
  EXPECT_EQ(auth.check("", "/metrics").status, 401);
  EXPECT_EQ(auth.check("Basic cHJvbTpwcm9t", "/metrics").status, 401);
  EXPECT_EQ(auth.check("Bearer ", "/metrics").status, 401);
  EXPECT_EQ(api.token_reviews, 0) << "no token: no API call";
  auto d = auth.check("Bearer prom-token", "/metrics");
  EXPECT_EQ(d.status, 200) << d.message;
  EXPECT_EQ(d.user, "system:serviceaccount:monitoring:prometheus");
  EXPECT_EQ(api.last_access_spec["nonResourceAttributes"], json({{"path", "/metrics"}, {"verb", "get"}}));
  EXPECT_EQ(api.last_access_spec["groups"], json({"system:authenticated"}));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(auth.check("Bearer prom-token", "/metrics").status, 200);
  EXPECT_EQ(std::make_pair(api.token_reviews, api.access_reviews), std::make_pair(1, 1));
  // Past the TTL the token is reviewed again: a revoked token stops working.
  now += controller::MetricsAuth::kAllowTtl;
  api.users.clear();
  EXPECT_EQ(auth.check("Bearer prom-token", "/metrics").status, 401);
  EXPECT_EQ(api.token_reviews, 2);
}

TEST(MetricsAuth, ForbiddenAndUnknownTokensAreCachedBriefly) {
  ReviewingApi api;
  api.users = {{"other", "alice"}};
  auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  controller::MetricsAuth auth(api, 8, [&] { return now; });
  auto d = auth.check("Bearer other", "/metrics");
  EXPECT_EQ(d.status, 403);
  EXPECT_NE(d.message.find("'alice' may not get /metrics"), std::string::npos) << d.message;
  EXPECT_EQ(auth.check("Bearer nobody", "/metrics").status, 401);
  EXPECT_EQ(auth.check("Bearer other", "/metrics").status, 403);
  EXPECT_EQ(auth.check("Bearer nobody", "/metrics").status, 401);
  EXPECT_EQ(api.token_reviews, 2);
  // alice is granted the role: within the deny TTL still 403, after it 200.
  api.allowed.insert("alice");
  now += controller::MetricsAuth::kDenyTtl - std::chrono::seconds(1);
  EXPECT_EQ(auth.check("Bearer other", "/metrics").status, 403);
  now += std::chrono::seconds(1);
  EXPECT_EQ(auth.check("Bearer other", "/metrics").status, 200);
}

TEST(MetricsAuth, AnApiServerThatFailsNeverGivesTwoHundredAndIsNotCached) {
  ReviewingApi api;
  api.users = {{"prom-token", "prometheus"}};
  api.allowed = {"prometheus"};
  controller::MetricsAuth auth(api, 8);
  api.down = true;
  auto d = auth.check("Bearer prom-token", "/metrics");
  EXPECT_EQ(d.status, 503);
  EXPECT_NE(d.message.find("TokenReview failed"), std::string::npos) << d.message;
  EXPECT_EQ(auth.cached(), 0u);
  api.down = false;
  EXPECT_EQ(auth.check("Bearer prom-token", "/metrics").status, 200) << "a failure is asked again next time";
}

TEST(MetricsAuth, TheCacheHoldsAtMostItsEntriesAndDropsTheLeastRecentlyUsed) {
  ReviewingApi api;
  for (int i = 0; i < 20; ++i) {
    api.users["t" + std::to_string(i)] = "u" + std::to_string(i);
    api.allowed.insert("u" + std::to_string(i));
  }
  controller::MetricsAuth auth(api, 3);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(auth.check("Bearer t" + std::to_string(i), "/metrics").status, 200);
  EXPECT_EQ(auth.cached(), 3u);
  EXPECT_EQ(api.token_reviews, 20);
  // t17, t18, t19 are held; using t17 makes t18 the least recently used, so t0 pushes t18 out.
  EXPECT_EQ(auth.check("Bearer t17", "/metrics").status, 200);
  EXPECT_EQ(api.token_reviews, 20);
  EXPECT_EQ(auth.check("Bearer t0", "/metrics").status, 200);
  EXPECT_EQ(api.token_reviews, 21);
  EXPECT_EQ(auth.check("Bearer t17", "/metrics").status, 200);
  EXPECT_EQ(auth.check("Bearer t19", "/metrics").status, 200);
  EXPECT_EQ(api.token_reviews, 21);
  EXPECT_EQ(auth.check("Bearer t18", "/metrics").status, 200);
  EXPECT_EQ(api.token_reviews, 22);
  EXPECT_EQ(auth.cached(), 3u);
}
