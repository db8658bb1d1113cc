#include <gtest/gtest.h>

#include "api/models.h"

using namespace rdmig;
using nlohmann::json;

namespace {
json source_body() {
  return json{{"role", "source"},
              {"qmpSocket", "/run/vm/qmp.sock"},
              {"multifdChannels", 4},
              {"chunkSize", "1Mi"},
              {"maxDowntimeMs", 200},
              {"target", {{"endpoint", "10.0.0.2:7471"}, {"migrationId", "m-abc"}, {"token", "t0k"}}}};
}
std::string error_of(const json& body) {
  auto r = api::parse_create_request(body, AgentConfig{});
  return r.ok() ? "" : r.error().message;
}
}  // namespace

TEST(CreateRequest, ParsesSourceWithDefaults) {
  AgentConfig cfg;
  auto r = api::parse_create_request(source_body(), cfg);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->role, migration::Role::kSource);
  EXPECT_EQ(r->channels(), 5u);
  EXPECT_EQ(r->chunk_size, 1u << 20);
  EXPECT_EQ(r->ring_depth, cfg.migration.ring_depth);
  EXPECT_EQ(r->target.host, "10.0.0.2");
  EXPECT_EQ(r->target.port, 7471);
  EXPECT_EQ(r->max_downtime_ms, 200u);
  EXPECT_EQ(r->completion_timeout_seconds, cfg.migration.completion_timeout_seconds);
}

// verifyChunks: the source's choice (the target follows the hello); the agent's
// migration.verifyChunks is the default; only a boolean.
TEST(CreateRequest, VerifyChunksIsTheSourcesChoiceWithTheAgentsDefault) {
  AgentConfig cfg;
  auto r = api::parse_create_request(source_body(), cfg);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->verify_chunks);
  cfg.migration.verify_chunks = true;
  r = api::parse_create_request(source_body(), cfg);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->verify_chunks);
  auto b = source_body();
  b["verifyChunks"] = false;
  r = api::parse_create_request(b, cfg);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->verify_chunks);
  b["verifyChunks"] = "yes";
  EXPECT_NE(error_of(b).find("verifyChunks: must be true or false"), std::string::npos) << error_of(b);
  EXPECT_NE(error_of(json{{"role", "target"}, {"qmpSocket", "/q"}, {"verifyChunks", true}}).find("verifyChunks"),
            std::string::npos);
}

TEST(CreateRequest, TargetNeedsNoPeer) {
  auto r = api::parse_create_request(json{{"role", "target"}, {"qmpSocket", "/q"}}, AgentConfig{});
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->channels(), 1u);
  auto bad = source_body();
  bad["role"] = "target";
  EXPECT_NE(error_of(bad).find("target"), std::string::npos);
}

TEST(CreateRequest, ErrorsNameTheField) {
  auto b = source_body();
  b["chunkSize"] = "3Mi";
  EXPECT_NE(error_of(b).find("chunkSize"), std::string::npos);
  b = source_body();
  b["transport"] = "udp";
  EXPECT_NE(error_of(b).find("transport"), std::string::npos);
  b = source_body();
  b.erase("qmpSocket");
  EXPECT_NE(error_of(b).find("qmpSocket: required"), std::string::npos);
  b = source_body();
  b["qmpSocket"] = "relative.sock";
  EXPECT_NE(error_of(b).find("qmpSocket"), std::string::npos);
  b = source_body();
  b["target"].erase("token");
  EXPECT_NE(error_of(b).find("target.token"), std::string::npos);
  b = source_body();
  b["target"]["endpoint"] = "nohost";
  EXPECT_NE(error_of(b).find("target.endpoint"), std::string::npos);
  b = source_body();
  b["multifdChannels"] = 65;
  EXPECT_NE(error_of(b).find("multifdChannels"), std::string::npos);
  b = source_body();
  b["multifdChannels"] = -1;
  EXPECT_NE(error_of(b).find("multifdChannels"), std::string::npos);
  b = source_body();
  b["ringDepth"] = "deep";
  EXPECT_NE(error_of(b).find("ringDepth"), std::string::npos);
  b = source_body();
  b["bogus"] = 1;
  EXPECT_NE(error_of(b).find("bogus: unknown field"), std::string::npos);
  b = source_body();
  b["id"] = "Not_A_Label";
  EXPECT_NE(error_of(b).find("id"), std::string::npos);
  b = source_body();
  b["role"] = "middle";
  EXPECT_NE(error_of(b).find("role"), std::string::npos);
  EXPECT_NE(error_of(json::array()).find("body"), std::string::npos);
}

// target.endpoint is dialled on the client's word: the dial policy refuses it here, naming the
// field and the rule, before the agent connects anywhere (issue 38).
TEST(CreateRequest, TargetEndpointObeysTheDialPolicy) {
  for (const char* ep : {"169.254.169.254:80", "0.0.0.0:7471", "[::]:7471", "[::ffff:169.254.169.254]:80",
                         "[64:ff9b::a9fe:a9fe]:80", "224.0.0.1:7471", "localhost:7471", "127.0.0.1:7471",
                         "[::1]:7471"}) {
    auto b = source_body();
    b["target"]["endpoint"] = ep;
    const auto msg = error_of(b);
    EXPECT_EQ(msg.rfind("target.endpoint: ", 0), 0u) << ep << ": " << msg;
    EXPECT_NE(msg.find("dial policy"), std::string::npos) << msg;
  }
  // Loopback only on an agent whose config says it is a lab.
  AgentConfig lab;
  lab.data_plane.allow_loopback_peers = true;
  for (const char* ep : {"127.0.0.1:7471", "[::1]:7471"}) {
    auto b = source_body();
    b["target"]["endpoint"] = ep;
    auto r = api::parse_create_request(b, lab);
    ASSERT_TRUE(r.ok()) << ep << ": " << r.error().message;
  }
  auto b = source_body();
  b["target"]["endpoint"] = "169.254.169.254:80";
  EXPECT_FALSE(api::parse_create_request(b, lab).ok()) << "a lab still never dials the metadata address";
  b["target"]["endpoint"] = "[fd00::2]:7471";
  EXPECT_TRUE(api::parse_create_request(b, AgentConfig{}).ok());
}

TEST(CreateRequest, ErrorStatusMapping) {
  EXPECT_EQ(api::http_status(Errc::kInvalidArgument), 400);
  EXPECT_EQ(api::http_status(Errc::kUnauthenticated), 401);
  EXPECT_EQ(api::http_status(Errc::kPermissionDenied), 403);
  EXPECT_EQ(api::http_status(Errc::kNotFound), 404);
  EXPECT_EQ(api::http_status(Errc::kResourceExhausted), 429);
  const auto body = api::error_body(Error{Errc::kNotFound, "no migration 'x'"});
  EXPECT_EQ(body["error"]["code"], "not_found");
  EXPECT_EQ(body["error"]["message"], "no migration 'x'");
  EXPECT_FALSE(body["error"].contains("reason"));
}

TEST(CreateRequest, ErrorBodyCarriesAReasonOnlyWhenGiven) {
  const auto body = api::error_body(Error{Errc::kNotFound, "KubeVirt mode is off on this agent (kubevirt.enabled)"},
                                    "KubevirtModeOff");
  EXPECT_EQ(body, json::parse(R"j({"error": {"code": "not_found", "reason": "KubevirtModeOff",
                                            "message": "KubeVirt mode is off on this agent (kubevirt.enabled)"}})j"));
}

// ---- switchover across two hosts' clocks (issue 11, item 7) ----

TEST(Switchover, OffsetEstimateRemovesTheTargetClocksSkew) {
  using rdmig::migration::estimate_clock_offset;
  using rdmig::migration::switchover_ms;
  // Target clock 5 s ahead; 200 us each way; the target took 3 ms between receive and send.
  const int64_t skew = 5'000'000, t0 = 1'000'000'000;
  const int64_t t1 = t0 + 200 + skew, t2 = t1 + 3000, t3 = t0 + 200 + 3000 + 200;
  auto off = estimate_clock_offset(t0, t1, t2, t3);
  ASSERT_TRUE(off.has_value());
  EXPECT_EQ(off->offset_us, skew);
  EXPECT_EQ(off->uncertainty_us, 201);
  // STOP on the source at 2.000 s; RESUME on the target 40 ms later by true time.
  const int64_t stop = 2'000'000'000, resume = stop + 40'000 + skew;
  EXPECT_EQ(switchover_ms(stop, resume, off), 40);
  // The old figure, resume - stop across clocks, was 5040 ms; a target behind gave a negative one.
  auto behind = estimate_clock_offset(t0, t1 - 2 * skew, t2 - 2 * skew, t3);
  ASSERT_TRUE(behind.has_value());
  EXPECT_EQ(switchover_ms(stop, stop + 40'000 - skew, behind), 40);
}

TEST(Switchover, NeverNegativeAndNotMeasuredWithoutAnEstimate) {
  using rdmig::migration::ClockOffset;
  using rdmig::migration::estimate_clock_offset;
  using rdmig::migration::switchover_ms;
  const int64_t stop = 2'000'000'000;
  // Slightly before STOP, within the estimate's uncertainty: 0, not negative.
  EXPECT_EQ(switchover_ms(stop, stop - 150, ClockOffset{0, 200}), 0);
  // Far before: the estimate cannot hold; no figure rather than a wrong one.
  EXPECT_EQ(switchover_ms(stop, stop - 50'000, ClockOffset{0, 200}), std::nullopt);
  // A peer that sent no timestamps (an older agent) gives no estimate, so no switchover.
  EXPECT_EQ(estimate_clock_offset(1000, 0, 0, 2000), std::nullopt);
  EXPECT_EQ(switchover_ms(stop, stop + 40'000, std::nullopt), std::nullopt);
  // Timestamps that contradict each other (t3 before t0) give no estimate.
  EXPECT_EQ(estimate_clock_offset(2000, 5000, 5100, 1000), std::nullopt);
}

// postCopy: never (default), auto with its two thresholds, after; the thresholds only with auto;
// the target follows the source and refuses the fields.
TEST(CreateRequest, PostCopyModesAndThresholdsAreValidatedNamingTheField) {
  auto r = api::parse_create_request(source_body(), AgentConfig{});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->post_copy.mode, migration::PostCopyMode::kNever);
  auto b = source_body();
  b["postCopy"] = "auto";
  b["postCopyAfterPasses"] = 3;
  b["postCopyAfterSeconds"] = 40;
  r = api::parse_create_request(b, AgentConfig{});
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->post_copy.mode, migration::PostCopyMode::kAuto);
  EXPECT_EQ(r->post_copy.after_passes, 3u);
  EXPECT_EQ(r->post_copy.after_seconds, 40u);
  b = source_body();
  b["postCopy"] = "after";
  r = api::parse_create_request(b, AgentConfig{});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->post_copy.mode, migration::PostCopyMode::kAfter);

  const std::vector<std::pair<json, std::string>> bad{
      {{{"postCopy", "sometimes"}}, "postCopy: must be 'never', 'auto' or 'after'"},
      {{{"postCopy", true}}, "postCopy: must be a string"},
      {{{"postCopy", "auto"}, {"postCopyAfterPasses", 1}}, "postCopyAfterPasses: must be between 2 and 1000"},
      {{{"postCopy", "auto"}, {"postCopyAfterPasses", 1001}}, "postCopyAfterPasses: must be between 2 and 1000"},
      {{{"postCopy", "auto"}, {"postCopyAfterSeconds", 0}}, "postCopyAfterSeconds: must be between 1 and 86400"},
      {{{"postCopy", "after"}, {"postCopyAfterSeconds", 5}}, "postCopyAfterSeconds: only with postCopy 'auto'"},
      {{{"postCopyAfterPasses", 5}}, "postCopyAfterPasses: only with postCopy 'auto'"},
  };
  for (const auto& [fields, want] : bad) {
    b = source_body();
    b.update(fields);
    EXPECT_NE(error_of(b).find(want), std::string::npos) << fields.dump() << " -> " << error_of(b);
  }
  EXPECT_NE(error_of(json{{"role", "target"}, {"qmpSocket", "/q"}, {"postCopy", "auto"}}).find("postCopy: only for role 'source'"),
            std::string::npos);
}

TEST(CreateRequest, PostCopyPreemptAddsTheLastChannelOnlyWithPostCopy) {
  auto b = source_body();
  b["multifdChannels"] = 0;
  b["postCopy"] = "after";
  b["postCopyPreempt"] = true;
  auto r = api::parse_create_request(b, AgentConfig{});
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(r->post_copy.preempt);
  EXPECT_EQ(r->channels(), 2u);  // QEMU's main connection and its preempt connection
  EXPECT_EQ(r->preempt_index(), 1u);
  b["postCopyPreempt"] = false;
  r = api::parse_create_request(b, AgentConfig{});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->channels(), 1u);
  // With multifd (QEMU 10.1+) the preempt connection comes after QEMU's multifd connections: the last.
  b["postCopyPreempt"] = true;
  b["multifdChannels"] = 8;
  r = api::parse_create_request(b, AgentConfig{});
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->channels(), 10u);
  EXPECT_EQ(r->preempt_index(), 9u);
  EXPECT_EQ(r->recovery_channels(), (std::vector<uint32_t>{0, 9}));
  const std::vector<std::pair<json, std::string>> bad{
      {{{"postCopyPreempt", true}}, "postCopyPreempt: only with postCopy 'auto' or 'after'"},
      {{{"postCopy", "never"}, {"postCopyPreempt", true}}, "postCopyPreempt: only with postCopy 'auto' or 'after'"},
      {{{"postCopy", "after"}, {"postCopyPreempt", "yes"}}, "postCopyPreempt: must be true or false"},
      {{{"postCopy", "after"}, {"postCopyPreempt", 1}}, "postCopyPreempt: must be true or false"},
  };
  for (const auto& [fields, want] : bad) {
    b = source_body();
    b["multifdChannels"] = 0;
    b.update(fields);
    EXPECT_NE(error_of(b).find(want), std::string::npos) << fields.dump() << " -> " << error_of(b);
  }
  EXPECT_NE(error_of(json{{"role", "target"}, {"qmpSocket", "/q"}, {"postCopyPreempt", true}}).find("postCopyPreempt"),
            std::string::npos);
}
