// The RdmaMigration spec fields named per the Kubernetes API conventions (maxDowntime as a
// duration, maxBandwidth as int-or-string, the old maxDowntimeMs still read) and the status
// mapping that explains an outcome: transportReason, the TCP fallback, one condition reason per
// outcome, a VM left paused on the source (issue 12, "CR status and events").
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "controller/migration_spec.h"
#include "controller/status_mapping.h"
#include "source_dir.h"

using nlohmann::json;
using namespace rdmig;

namespace {

json qemu_spec() {
  return json{{"source", {{"qemu", {{"node", "a"}, {"qmpSocket", "/run/a.qmp"}}}}},
              {"target", {{"qemu", {{"node", "b"}, {"qmpSocket", "/run/b.qmp"}}}}}};
}

Result<controller::MigrationRequest> with(const char* key, const json& value) {
  json s = qemu_spec();
  s[key] = value;
  return controller::parse_spec(s);
}

json side(const char* phase, const char* reason = nullptr) {
  return json{{"phase", phase}, {"result", {{"reason", reason ? json(reason) : json(nullptr)}}}};
}

}  // namespace

TEST(MigrationSpec, MaxDowntimeIsADurationString) {
  const std::pair<const char*, uint64_t> good[] = {{"300ms", 300},   {"1s", 1000},       {"1.5s", 1500},
                                                   {"1m30s", 90000}, {"2000s", 2000000}, {"1000000us", 1000},
                                                   {"1ms", 1},       {"0.25s", 250},     {"5000000ns", 5}};
  for (const auto& [text, ms] : good) {
    auto r = with("maxDowntime", text);
    ASSERT_TRUE(r.ok()) << text << ": " << r.error().message;
    EXPECT_EQ(r->max_downtime_ms, ms) << text;
    auto body = controller::source_request_body(r.value(), "m-1", "ns/x", json::object());
    EXPECT_EQ(body["maxDowntimeMs"], ms) << text;
  }
  const std::pair<json, const char*> bad[] = {
      {"1500us", "not a whole number of milliseconds"},
      {"0ms", "between 1ms and 2000000ms"},
      {"2001s", "between 1ms and 2000000ms"},
      {"300", "needs a unit"},
      {"300 ms", "unknown unit ' ms'"},
      {"-300ms", "must be a duration"},
      {"3d", "unknown unit 'd'"},
      {"1.s", "must be a duration"},
      {"0.1234567s", "at most 6 digits"},
      {"99999999999999h", "out of range"},
      {"", "empty string"},
      {300, "must be a duration string"},
  };
  for (const auto& [value, text] : bad) {
    auto r = with("maxDowntime", value);
    ASSERT_FALSE(r.ok()) << value.dump();
    EXPECT_EQ(r.error().message.rfind("spec.maxDowntime: ", 0), 0u) << r.error().message;
    EXPECT_NE(r.error().message.find(text), std::string::npos) << value.dump() << ": " << r.error().message;
  }
}

TEST(MigrationSpec, DeprecatedMaxDowntimeMsIsStillReadButNotBesideMaxDowntime) {
  auto old = with("maxDowntimeMs", 120);
  ASSERT_TRUE(old.ok()) << old.error().message;
  EXPECT_EQ(old->max_downtime_ms, 120u);
  EXPECT_FALSE(with("maxDowntimeMs", 0).ok());
  EXPECT_EQ(controller::parse_spec(qemu_spec())->max_downtime_ms, controller::kDefaultDowntimeMs);
  json both = qemu_spec();
  both["maxDowntime"] = "100ms";
  both["maxDowntimeMs"] = 100;
  auto r = controller::parse_spec(both);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("not both"), std::string::npos) << r.error().message;
}

TEST(MigrationSpec, MaxBandwidthIsAnIntegerOrAQuantity) {
  EXPECT_EQ(with("maxBandwidth", 1000000)->max_bandwidth_bytes_per_second, 1000000u);
  EXPECT_EQ(with("maxBandwidth", "10Gi")->max_bandwidth_bytes_per_second, 10ull << 30);
  EXPECT_EQ(with("maxBandwidth", "500M")->max_bandwidth_bytes_per_second, 500000000u);
  EXPECT_EQ(with("maxBandwidth", 0)->max_bandwidth_bytes_per_second, 0u);
  for (const json& bad : {json(-5), json(1.5), json("10GB"), json(true)}) {
    auto r = with("maxBandwidth", bad);
    ASSERT_FALSE(r.ok()) << bad.dump();
    EXPECT_EQ(r.error().message.rfind("spec.maxBandwidth", 0), 0u) << r.error().message;
  }
}

TEST(MigrationSpec, VmiKindRefusesTheDowntimeFieldsByBothNames) {
  for (const auto& [key, value] : {std::pair<const char*, json>{"maxDowntime", "100ms"}, {"maxDowntimeMs", 100}}) {
    json s{{"source", {{"vmi", {{"name", "web-1"}}}}}};
    s[key] = value;
    auto r = controller::parse_vmi_spec(s);
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_EQ(r.error().message.rfind(std::string("spec.") + key + ": only for spec.source.qemu", 0), 0u)
        << r.error().message;
  }
}

TEST(StatusMapping, TransportReasonIsCopiedFromTheAgents) {
  json status;
  json source{{"phase", "Migrating"}, {"transport", "tcp"}, {"transportReason", "auto-no-peer-rdma"}};
  controller::copy_agent_status(status, source, json{{"phase", "Migrating"}, {"transportReason", "ignored"}});
  EXPECT_EQ(status["transportReason"], "auto-no-peer-rdma");
  // The source knows it only after the target's welcome; the target's is used until then.
  json early;
  controller::copy_agent_status(early, json{{"phase", "Connecting"}, {"transportReason", nullptr}},
                                json{{"phase", "Connecting"}, {"transportReason", "auto-both-rdma"}});
  EXPECT_EQ(early["transportReason"], "auto-both-rdma");
  json none;
  controller::copy_agent_status(none, json{{"phase", "Pending"}}, json{{"phase", "Pending"}});
  EXPECT_FALSE(none.contains("transportReason"));
}

TEST(StatusMapping, TcpFallbackIsTcpForAnyReasonButRequested) {
  auto st = [](const char* t, const char* r) {
    json s = json::object();
    if (t) s["transport"] = t;
    if (r) s["transportReason"] = r;
    return s;
  };
  for (const char* r : {"auto-no-peer-rdma", "auto-no-source-rdma", "auto-no-local-rdma", "target-requested-tcp", "auto"}) {
    EXPECT_TRUE(controller::transport_fell_back(st("tcp", r))) << r;
  }
  EXPECT_FALSE(controller::transport_fell_back(st("tcp", "requested")));
  EXPECT_FALSE(controller::transport_fell_back(st("rdma", "auto-both-rdma")));
  EXPECT_FALSE(controller::transport_fell_back(st("tcp", nullptr)));
  EXPECT_FALSE(controller::transport_fell_back(st(nullptr, "auto-no-peer-rdma")));
  EXPECT_FALSE(controller::transport_fell_back(st("tcp", "")));
  const std::string msg = controller::transport_fallback_message(st("tcp", "auto-no-peer-rdma"));
  EXPECT_NE(msg.find("auto-no-peer-rdma: the target agent has no usable RDMA device"), std::string::npos) << msg;
  // The agent's own reason code after ':' is explained too.
  const std::string detailed = controller::transport_fallback_message(st("tcp", "auto-no-peer-rdma:no-address"));
  EXPECT_NE(detailed.find("the target agent has no usable RDMA device (the RDMA device's interface has no IP address)"),
            std::string::npos) << detailed;
  EXPECT_TRUE(controller::transport_fell_back(st("tcp", "auto-no-source-rdma:gid-not-found")));
  const std::string cfg = controller::transport_fallback_message(st("tcp", "auto-no-source-rdma:transport-tcp"));
  EXPECT_NE(cfg.find("the source agent has no usable RDMA device (it is configured with transport: tcp)"),
            std::string::npos) << cfg;
  const std::string mtu = controller::transport_fallback_message(st("tcp", "auto-no-peer-rdma:mtu-mismatch"));
  EXPECT_NE(mtu.find("different active MTUs"), std::string::npos) << mtu;
  const std::string cut = controller::transport_fallback_message(st("tcp", "auto-no-peer-rdma:unreachable"));
  EXPECT_NE(cut.find("could not reach the target agent's RDMA address"), std::string::npos) << cut;
  EXPECT_EQ(cut.find("no usable RDMA device"), std::string::npos) << cut;
}

TEST(StatusMapping, JudgeGivesEachOutcomeItsOwnReason) {
  using controller::Outcome;
  EXPECT_EQ(controller::judge(side("Succeeded"), side("Succeeded")).code, "Succeeded");
  EXPECT_EQ(controller::judge(side("Migrating"), side("Migrating")).code, "");
  auto sf = controller::judge(side("Failed", "QEMU error: migration failed"), side("Failed", "source agent aborted"));
  EXPECT_EQ((sf.outcome == Outcome::kFailed), true);
  EXPECT_EQ(sf.code, "SourceFailed");
  auto tf = controller::judge(side("Migrating"), side("Failed", "target QEMU: incoming migration failed"));
  EXPECT_EQ(tf.code, "TargetFailed");
  EXPECT_EQ(controller::judge(side("Migrating"), side("Cancelled", "shutting down")).code, "TargetFailed");
  auto cancelled = controller::judge(side("Cancelled", "agent shutting down"), side("Migrating"));
  EXPECT_EQ((cancelled.outcome == Outcome::kCancelled), true);
  EXPECT_EQ(cancelled.code, "CancelledOnAgent");
}

TEST(StatusMapping, VmLeftPausedOnTheSourceHasItsOwnReason) {
  // The three ways the source agent words it (src/migration/source_job.cpp, failure kind
  // vm_paused_on_source), as they reach result.reason.
  const char* agent_words[] = {
      "source QEMU completed but the target agent did not confirm (control link: peer closed); the source VM is "
      "left paused (postmigrate) so the VM cannot run twice: check the target and 'cont' the source only if the "
      "target does not run the VM",
      "target failed after the source handed the VM over (x) and cannot rule out that it started the VM; the "
      "source VM is left paused (postmigrate) so the VM cannot run twice: check the target and 'cont' the source "
      "only if the target does not run the VM",
      "data plane: channel 0: peer disconnected; the source VM is left paused (postmigrate): QEMU handed it over "
      "as the migration failed, so check the target and 'cont' the source only if the target does not run the VM",
  };
  for (const char* words : agent_words) {
    const auto v = controller::judge(side("Failed", words), side("Succeeded"));
    EXPECT_EQ(v.code, "VMPausedOnSource") << words;
    EXPECT_NE(v.reason.find(words), std::string::npos);
    EXPECT_TRUE(controller::vm_left_paused_on_source(side("Failed", words)));
  }
  // A VM that was paused before the migration and stays so is not this case.
  EXPECT_EQ(controller::judge(side("Failed", "target failed to take the VM: x; source VM left paused"),
                              side("Failed", "x")).code,
            "SourceFailed");
  EXPECT_FALSE(controller::vm_left_paused_on_source(side("Cancelled", agent_words[0])));
}

// The controller recognises the case by the agent's wording (its REST status has no failure
// kind): every failure the agent counts as vm_paused_on_source must use that wording.
TEST(StatusMapping, EveryPausedOnSourceFailureOfTheAgentUsesTheWordsTheControllerReads) {
  std::ifstream f(rdmig_test::source_dir() + "/src/migration/source_job.cpp");
  ASSERT_TRUE(f) << "cannot read src/migration/source_job.cpp";
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string code = ss.str();
  int found = 0;
  for (size_t at = code.find("\"vm_paused_on_source\""); at != std::string::npos;
       at = code.find("\"vm_paused_on_source\"", at + 1)) {
    const size_t call = code.rfind("finish(", at);
    ASSERT_NE(call, std::string::npos);
    // Join the string literals of the call ("a " "b" across lines reads "a b").
    std::string text;
    bool in_literal = false;
    for (size_t i = call; i < at; ++i) {
      if (code[i] == '"' && code[i - 1] != '\\') in_literal = !in_literal;
      else if (in_literal) text.push_back(code[i]);
    }
    EXPECT_NE(text.find(controller::kPausedOnSourceText), std::string::npos)
        << "a vm_paused_on_source failure without '" << controller::kPausedOnSourceText << "': " << text;
    ++found;
  }
  EXPECT_GE(found, 3) << "the agent's vm_paused_on_source failures moved: update this test and the controller";
}

TEST(CrStatus, FailoverCountAndLastComeFromTheSourceWhenBothAgentsRunIt) {
  json status;
  const json source = {{"phase", "Migrating"},
                       {"failover", {{"enabled", true}, {"failovers", 2},
                                     {"last", "channel 1: recv: Connection reset by peer; resumed on tcp 10.0.0.2:7471 after 3 ms, 4 chunk(s) resent"}}}};
  controller::copy_agent_status(status, source, json{{"phase", "Migrating"}});
  ASSERT_TRUE(status.contains("failover"));
  EXPECT_EQ(status["failover"]["enabled"], true);
  EXPECT_EQ(status["failover"]["failovers"], 2);
  EXPECT_NE(status["failover"]["last"].get<std::string>().find("resumed on tcp 10.0.0.2:7471"), std::string::npos);
  // Off (or an agent from before it): nothing; a hostile agent's types or an over-long reason: left out.
  json off;
  controller::copy_agent_status(off, json{{"phase", "Migrating"}, {"failover", {{"enabled", false}, {"failovers", 0}}}},
                                json::object());
  EXPECT_FALSE(off.contains("failover"));
  json hostile;
  controller::copy_agent_status(hostile, json{{"failover", {{"enabled", true}, {"failovers", -3}, {"last", std::string(5000, 'x')}}}},
                                json::object());
  EXPECT_EQ(hostile["failover"], (json{{"enabled", true}}));
  json junk;
  controller::copy_agent_status(junk, json{{"failover", "yes"}}, json::object());
  EXPECT_FALSE(junk.contains("failover"));
}
