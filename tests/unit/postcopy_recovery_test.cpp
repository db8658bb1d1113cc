// Post-copy recovery's pure parts (migration/postcopy_recovery.h), its config key, its hello flag
// and its status; the recovery itself runs between real agents and QEMUs in
// tests/integration/test_agent_migration.py (test_postcopy_link_...).
#include <gtest/gtest.h>

#include "config/agent_config.h"
#include "migration/passes.h"
#include "migration/postcopy_recovery.h"
#include "migration/types.h"
#include "session/protocol.h"
#include "source_dir.h"
#include "transport/wire.h"

using namespace rdmig;
using migration::RecoveryStep;

TEST(PostcopyRecovery, OnlyAPausedQemuIsResumedAndAQemuOnItsWayIsWaitedFor) {
  EXPECT_EQ(migration::recovery_step("postcopy-paused"), RecoveryStep::kResume);
  for (const char* s : {"postcopy-active", "postcopy-recover", "postcopy-recover-setup", "device"}) {
    EXPECT_EQ(migration::recovery_step(s), RecoveryStep::kWait) << s;
  }
  EXPECT_EQ(migration::recovery_step("completed"), RecoveryStep::kComplete);
  for (const char* s : {"failed", "cancelled", "none", "active", "", "unreadable"}) {
    EXPECT_EQ(migration::recovery_step(s), RecoveryStep::kGiveUp) << s;
  }
}

TEST(PostcopyRecovery, EachTryAndRoleHasItsOwnSocket) {
  EXPECT_EQ(migration::recovery_socket_path("/var/run/rdmig", "m-1", session::Role::kTarget, 2),
            "/var/run/rdmig/m-1.dst.r2.sock");
  EXPECT_EQ(migration::recovery_socket_path("/var/run/rdmig", "m-1", session::Role::kSource, 2),
            "/var/run/rdmig/m-1.src.r2.sock");
  EXPECT_NE(migration::recovery_socket_path("/s", "m", session::Role::kTarget, 1),
            migration::recovery_socket_path("/s", "m", session::Role::kTarget, 2));
}

TEST(PostcopyRecovery, TheDeadlinesReasonNamesEachQemusStateTheDeadlineTheTriesAndWhatToRun) {
  migration::StuckPostcopy s;
  s.role = session::Role::kSource;
  s.lost = "data plane: channel 0: recv: Connection reset by peer";
  s.deadline_seconds = 300;
  s.tries = 7;
  s.last_try = "recovery control connection to 10.0.0.2:7471: Connection refused";
  s.own_qemu = migration::describe_qemu("postcopy-paused", "finish-migrate");
  const std::string r = migration::stuck_postcopy_reason(s);
  for (const char* part : {"Connection reset by peer", "within 300 s (migration.postCopyRecoverySeconds; 7 tries",
                           "the last: recovery control connection to 10.0.0.2:7471: Connection refused",
                           "The source QEMU: migration 'postcopy-paused', run state 'finish-migrate'",
                           "the target QEMU: not known here (see the target agent's status",
                           "rdmig resumes neither", "migrate-recover", "\"resume\":true", "RdmigPostcopySplit.md"}) {
    EXPECT_NE(r.find(part), std::string::npos) << part << "\n" << r;
  }
  s.role = session::Role::kTarget;
  s.tries = 1;
  s.peer_qemu = migration::describe_qemu("postcopy-paused", "paused");
  const std::string t = migration::stuck_postcopy_reason(s);
  EXPECT_NE(t.find("1 try,"), std::string::npos) << t;
  EXPECT_NE(t.find("The target QEMU: migration 'postcopy-paused'"), std::string::npos) << t;
  EXPECT_NE(t.find("the source QEMU: migration 'postcopy-paused', run state 'paused'"), std::string::npos) << t;
}

TEST(PostcopyRecovery, TheStatusSaysRecoveredWithItsCountAndTimePausedAndNullWhenNeverNeeded) {
  migration::PostCopyStatus p;
  EXPECT_TRUE(migration::to_json(p)["recovery"].is_null());
  p.recovery = "recovered";
  p.recoveries = 2;
  p.paused_ms = 4200;
  p.recovery_reason = "link lost";
  p.recovery_tries = 3;
  p.source_qemu = migration::describe_qemu("postcopy-active", "finish-migrate");
  const auto j = migration::to_json(p)["recovery"];
  EXPECT_EQ(j["state"], "recovered");
  EXPECT_EQ(j["recoveries"], 2);
  EXPECT_EQ(j["pausedMs"], 4200);
  EXPECT_EQ(j["reason"], "link lost");
  EXPECT_EQ(j["tries"], 3);
  EXPECT_TRUE(j["lastTry"].is_null());
  EXPECT_TRUE(j["targetQemu"].is_null());
  EXPECT_EQ(j["sourceQemu"], "migration 'postcopy-active', run state 'finish-migrate'");
}

TEST(PostcopyRecovery, TheRecoveringPhaseAndMessagesHaveNames) {
  EXPECT_STREQ(session::phase_name(session::Phase::kRecovering), "Recovering");
  EXPECT_FALSE(session::phase_terminal(session::Phase::kRecovering));
  EXPECT_EQ(session::parse_kind("recover"), session::MessageKind::kRecover);
  EXPECT_EQ(session::parse_kind("recover-ready"), session::MessageKind::kRecoverReady);
}

TEST(PostcopyRecovery, RecoverySecondsDefaultToFiveMinutesZeroTurnsItOffAndOutOfRangeIsRefusedNamingTheKey) {
  EXPECT_EQ(parse_agent_config("")->migration.postcopy_recovery_seconds, 300u);
  EXPECT_EQ(parse_agent_config("migration:\n  postCopyRecoverySeconds: 0\n")->migration.postcopy_recovery_seconds, 0u);
  EXPECT_EQ(parse_agent_config("migration:\n  postCopyRecoverySeconds: 20\n")->migration.postcopy_recovery_seconds, 20u);
  for (const char* v : {"86401", "-1", "soon"}) {
    auto c = parse_agent_config(std::string("migration:\n  postCopyRecoverySeconds: ") + v + "\n");
    ASSERT_FALSE(c.ok()) << v;
    EXPECT_NE(c.error().message.find("migration.postCopyRecoverySeconds"), std::string::npos) << c.error().message;
  }
  auto shipped = load_agent_config_file(rdmig_test::source_dir() + "/agent/agent.yaml");
  ASSERT_TRUE(shipped.ok()) << shipped.error().message;
  EXPECT_EQ(shipped->migration.postcopy_recovery_seconds, AgentConfig{}.migration.postcopy_recovery_seconds);
}


// --- passes over memory (migration/passes.h) -------------------------------------------------

namespace {

qemu::MigrationInfo pass_sample(uint64_t syncs, uint64_t sent_pages, uint64_t remaining_pages) {
  qemu::MigrationInfo i;
  i.status = "active";
  i.total_bytes = 49282ull * 4096;  // a 192 MiB guest's RAM as QEMU 10.0 and 11.1 report it
  i.page_size = 4096;
  i.dirty_sync_count = syncs;
  i.normal_pages = sent_pages / 2;
  i.duplicate_pages = sent_pages - sent_pages / 2;
  i.remaining_bytes = remaining_pages * 4096;
  return i;
}

}  // namespace

TEST(PassCounter, FollowsQemu100WhoseSyncsArePasses) {
  // Samples a second apart of a QEMU 10.0 source (192 MiB guest rewriting 32 MiB at 24 MiB/s, 12 MiB/s
  // max-bandwidth, postcopy-ram on): (dirty-sync-count, normal + duplicate, remaining pages).
  migration::PassCounter c;
  EXPECT_EQ(c.observe(pass_sample(0, 0, 0)), 0u);  // setup: QEMU has not counted yet
  EXPECT_EQ(c.observe(pass_sample(1, 5676, 43605)), 1u);
  EXPECT_EQ(c.observe(pass_sample(1, 44114, 5167)), 1u);
  EXPECT_EQ(c.observe(pass_sample(2, 48921, 8501)), 2u);  // QEMU synced at 99.3% of the pages
  EXPECT_EQ(c.observe(pass_sample(2, 55437, 1985)), 2u);
  EXPECT_EQ(c.observe(pass_sample(3, 58647, 6567)), 3u);  // 9726 sent since, 8501 were left
  EXPECT_EQ(c.observe(pass_sample(3, 61847, 3367)), 3u);
  EXPECT_EQ(c.observe(pass_sample(4, 65048, 7860)), 3u);  // QEMU one round ahead of the pages here:
  EXPECT_EQ(c.observe(pass_sample(4, 68257, 4651)), 4u);  // counted once 6567 more were sent
}

TEST(PassCounter, IgnoresQemu111sBitmapSyncsWithinAPass) {
  // QEMU 11.1 with postcopy-ram and 4 multifd channels: a sync every ~100 ms within the first pass.
  migration::PassCounter c;
  EXPECT_EQ(c.observe(pass_sample(4, 960 + 241, 47900)), 1u);  // after 250 ms ("after" used to switch here)
  EXPECT_EQ(c.observe(pass_sample(12, 11776, 37577)), 1u);
  EXPECT_EQ(c.observe(pass_sample(33, 29568, 25596)), 1u);
  EXPECT_EQ(c.observe(pass_sample(45, 47872, 8407)), 1u);  // 97.1%: not yet
  EXPECT_EQ(c.observe(pass_sample(55, 53122, 4741)), 2u);  // the first pass done
  EXPECT_EQ(c.observe(pass_sample(65, 56000, 3565)), 2u);
  EXPECT_EQ(c.observe(pass_sample(75, 57900, 3128)), 3u);  // 4778 more sent of the 4741 left
  // Nothing left to send: no further pass is counted, however often QEMU syncs.
  EXPECT_EQ(c.observe(pass_sample(80, 61100, 0)), 4u);
  EXPECT_EQ(c.observe(pass_sample(90, 70000, 0)), 4u);
}
