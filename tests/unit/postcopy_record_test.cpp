// The post-copy record an agent keeps in stateDir (migration/postcopy_record.h): what it holds,
// its bounds, and the refusals of a record that was changed, cut short, grown, or is not the
// agent's own file. The restart itself runs between real agents and QEMUs in
// tests/integration/test_agent_migration.py (test_postcopy_..._agent_killed_...).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "migration/postcopy_record.h"
#include "migration/postcopy_recovery.h"

using namespace rdmig;
using migration::PostcopyRecord;

namespace {

PostcopyRecord sample(session::Role role = session::Role::kSource) {
  PostcopyRecord r;
  r.id = "m-1a2b3c";
  r.role = role;
  r.vm = "vm-a";
  r.qmp_socket = "/run/vms/a/qmp-agent.sock";
  r.peer = role == session::Role::kSource ? "10.0.0.2:7472" : "10.0.0.1";
  if (role == session::Role::kSource) r.target_migration_id = "m-9f8e7d";
  r.session = std::string(32, 'a');
  r.channel_key = std::string(64, 'b');
  r.chunk_size = 1 << 20;
  r.ring_depth = 16;
  r.verify_chunks = true;
  r.post_copy_mode = role == session::Role::kSource ? "after" : "requested";
  r.completion_timeout_seconds = 600;
  r.no_progress_timeout_seconds = 60;
  r.state = "postcopy";
  r.switched_at_ms = 1765000000000;
  r.recoveries = 1;
  r.recovery_seconds = 300;
  r.alive_at_ms = 1765000001000;
  return r;
}

// The record's text with `field` set to `value` by hand, its digest left as the agent wrote it.
std::string with_field(const std::string& text, const std::string& field, const nlohmann::json& value) {
  auto j = nlohmann::json::parse(text);
  j[field] = value;
  return j.dump();
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/rdmig-pcrec-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace

TEST(PostcopyRecord, RoundTripsEveryFieldOfBothRoles) {
  for (const auto role : {session::Role::kSource, session::Role::kTarget}) {
    const auto r = sample(role);
    auto back = migration::parse_postcopy_record(migration::serialize_postcopy_record(r), r.id);
    ASSERT_TRUE(back) << back.error().message;
    EXPECT_EQ(back->role, role);
    EXPECT_EQ(back->qmp_socket, r.qmp_socket);
    EXPECT_EQ(back->peer, r.peer);
    EXPECT_EQ(back->target_migration_id, r.target_migration_id);
    EXPECT_EQ(back->session, r.session);
    EXPECT_EQ(back->channel_key, r.channel_key);
    EXPECT_EQ(back->chunk_size, r.chunk_size);
    EXPECT_EQ(back->ring_depth, r.ring_depth);
    EXPECT_TRUE(back->verify_chunks);
    EXPECT_EQ(back->post_copy_mode, r.post_copy_mode);
    EXPECT_EQ(back->state, "postcopy");
    EXPECT_EQ(back->switched_at_ms, r.switched_at_ms);
    EXPECT_EQ(back->recoveries, 1u);
    EXPECT_EQ(back->recovery_seconds, 300u);
    EXPECT_EQ(back->alive_at_ms, r.alive_at_ms);
    EXPECT_FALSE(back->preempt);
  }
}

TEST(PostcopyRecord, PostCopyPreemptIsWrittenOnlyWhenOnAndReadBack) {
  // Written only when on: a record without it (an agent from before it, or preempt off) reads as off,
  // and an agent from before it still reads the records it can resume.
  auto r = sample();
  EXPECT_EQ(migration::serialize_postcopy_record(r).find("postCopyPreempt"), std::string::npos);
  r.preempt = true;
  const std::string text = migration::serialize_postcopy_record(r);
  EXPECT_NE(text.find("\"postCopyPreempt\": true"), std::string::npos) << text;
  auto back = migration::parse_postcopy_record(text, r.id);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_TRUE(back->preempt);
  // Changed after it was written (off, or not a boolean): refused.
  for (const auto& v : {nlohmann::json(false), nlohmann::json("yes")}) {
    auto bad = migration::parse_postcopy_record(with_field(text, "postCopyPreempt", v), r.id);
    ASSERT_FALSE(bad) << v.dump();
  }
}

TEST(PostcopyRecord, MultifdChannelsAreWrittenOnlyWhenUsedAndReadBackBounded) {
  // Post-copy with multifd (QEMU 10.1+): the count is kept, so that a restarted agent knows the
  // preempt channel's index (after the multifd ones). Written only when > 0: an agent from before it
  // resumed no post-copy with multifd and refuses such a record whole (an unknown field).
  auto r = sample();
  EXPECT_EQ(migration::serialize_postcopy_record(r).find("multifdChannels"), std::string::npos);
  r.multifd_channels = 8;
  r.preempt = true;
  auto back = migration::parse_postcopy_record(migration::serialize_postcopy_record(r), r.id);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->multifd_channels, 8u);
  r.multifd_channels = migration::kMaxMultifdChannels + 1;
  auto bad = migration::parse_postcopy_record(migration::serialize_postcopy_record(r), r.id);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("postcopy record: multifdChannels"), std::string::npos) << bad.error().message;
}

TEST(PostcopyRecord, RefusesARecordChangedAfterItWasWrittenNamingTheDigest) {
  const std::string text = migration::serialize_postcopy_record(sample());
  // Another QEMU's socket, another peer, a longer deadline: each a valid value, each refused.
  for (const auto& [field, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"qmpSocket", "/run/vms/b/qmp.sock"}, {"peer", "10.0.0.9:7472"}, {"recoverySeconds", 86400},
           {"aliveAtMs", 1865000000000}, {"channelKey", std::string(64, 'c')}}) {
    auto r = migration::parse_postcopy_record(with_field(text, field, value), "m-1a2b3c");
    ASSERT_FALSE(r) << field;
    EXPECT_NE(r.error().message.find("postcopy record: digest: does not match"), std::string::npos) << r.error().message;
  }
  auto r = migration::parse_postcopy_record(with_field(text, "digest", std::string(64, '0')), "m-1a2b3c");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("digest"), std::string::npos);
}

TEST(PostcopyRecord, RefusesARecordCutShortOversizedOrWithUnknownFields) {
  const std::string text = migration::serialize_postcopy_record(sample());
  auto cut = migration::parse_postcopy_record(text.substr(0, text.size() / 2), "m-1a2b3c");
  ASSERT_FALSE(cut);
  EXPECT_NE(cut.error().message.find("postcopy record: document: not a JSON object"), std::string::npos);
  auto big = migration::parse_postcopy_record(text + std::string(migration::kPostcopyRecordMaxBytes, ' '), "m-1a2b3c");
  ASSERT_FALSE(big);
  EXPECT_NE(big.error().message.find("postcopy record: size: "), std::string::npos) << big.error().message;
  auto extra = migration::parse_postcopy_record(with_field(text, "token", "tok-secret"), "m-1a2b3c");
  ASSERT_FALSE(extra);
  EXPECT_NE(extra.error().message.find("postcopy record: token: unknown field"), std::string::npos);
  auto deep = migration::parse_postcopy_record(R"({"version":[[[[[[1]]]]]]})", "m-1a2b3c");
  ASSERT_FALSE(deep);
  auto v2 = migration::parse_postcopy_record(with_field(text, "version", 2), "m-1a2b3c");
  ASSERT_FALSE(v2);
  EXPECT_NE(v2.error().message.find("postcopy record: version: 2"), std::string::npos);
}

TEST(PostcopyRecord, EachFieldIsBoundedAndNamedWhenItIsNot) {
  // Values the agent itself never writes: refused by the field's own check, named.
  const auto refused = [](PostcopyRecord r, const std::string& field) {
    auto p = migration::parse_postcopy_record(migration::serialize_postcopy_record(r), r.id);
    ASSERT_FALSE(p) << field;
    EXPECT_NE(p.error().message.find("postcopy record: " + field), std::string::npos) << p.error().message;
  };
  auto r = sample();
  r.session = std::string(31, 'a') + "Z";
  refused(r, "session");
  r = sample();
  r.channel_key = "short";
  refused(r, "channelKey");
  r = sample();
  r.qmp_socket = "relative/qmp.sock";
  refused(r, "qmpSocket");
  r = sample();
  r.qmp_socket = "/" + std::string(200, 'q');
  refused(r, "qmpSocket");
  r = sample();
  r.peer = "not an endpoint";
  refused(r, "peer");
  r = sample();
  r.chunk_size = 3 << 20;
  refused(r, "chunkSize");
  r = sample();
  r.ring_depth = 1 << 20;
  refused(r, "ringDepth");
  r = sample();
  r.state = "done";
  refused(r, "state");
  r = sample();
  r.post_copy_mode = "never";
  refused(r, "postCopyMode");
  r = sample();
  r.vm = "vm; rm -rf /";
  refused(r, "vm");
  r = sample();
  r.id = "M_1";
  refused(r, "id");
  r = sample();
  r.recovery_seconds = 0;
  refused(r, "recoverySeconds");
  // The file of another migration.
  auto other = migration::parse_postcopy_record(migration::serialize_postcopy_record(sample()), "m-other");
  ASSERT_FALSE(other);
  EXPECT_NE(other.error().message.find("postcopy record: id: 'm-1a2b3c' is not the file's migration 'm-other'"),
            std::string::npos);
}

TEST(PostcopyRecord, ExpiresOnceTheRecoveryDeadlinePassedSinceTheAgentLastWroteIt) {
  const auto r = sample();
  EXPECT_FALSE(migration::postcopy_record_expired(r, r.alive_at_ms));
  EXPECT_FALSE(migration::postcopy_record_expired(r, r.alive_at_ms + 300 * 1000));
  EXPECT_TRUE(migration::postcopy_record_expired(r, r.alive_at_ms + 300 * 1000 + 1));
}

TEST(PostcopyRecord, IsWrittenPrivateAndAtomicallyAndReadBackOnlyFromTheAgentsOwnFile) {
  TempDir dir;
  const auto r = sample();
  ASSERT_TRUE(migration::write_postcopy_record(dir.path(), r));
  const std::string path = migration::postcopy_record_path(dir.path(), r.id);
  EXPECT_EQ(path, dir.path() + "/m-1a2b3c.postcopy.json");
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_NE(::access((path + ".tmp").c_str(), F_OK), 0);  // renamed into place
  EXPECT_EQ(migration::postcopy_record_ids(dir.path()), std::vector<std::string>{"m-1a2b3c"});
  auto back = migration::read_postcopy_record(path, r.id);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->channel_key, r.channel_key);

  // Written again (a refresh) replaces it whole.
  auto r2 = r;
  r2.state = "recovering";
  ASSERT_TRUE(migration::write_postcopy_record(dir.path(), r2));
  EXPECT_EQ(migration::read_postcopy_record(path, r.id)->state, "recovering");

  // Open to others: refused before it is read.
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  auto open = migration::read_postcopy_record(path, r.id);
  ASSERT_FALSE(open);
  EXPECT_NE(open.error().message.find("open to group or others (mode 644)"), std::string::npos) << open.error().message;
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);

  // Grown past the bound: refused by its size, naming it.
  {
    std::ofstream out(path, std::ios::app);
    out << std::string(migration::kPostcopyRecordMaxBytes, ' ');
  }
  auto grown = migration::read_postcopy_record(path, r.id);
  ASSERT_FALSE(grown);
  EXPECT_NE(grown.error().message.find("size: "), std::string::npos) << grown.error().message;

  // A symlink in its place (to a good record elsewhere): refused.
  ASSERT_TRUE(migration::write_postcopy_record(dir.path(), PostcopyRecord(sample())));
  const std::string elsewhere = dir.path() + "/elsewhere";
  ASSERT_EQ(::rename(path.c_str(), elsewhere.c_str()), 0);
  ASSERT_EQ(::symlink(elsewhere.c_str(), path.c_str()), 0);
  auto link = migration::read_postcopy_record(path, r.id);
  ASSERT_FALSE(link);
  EXPECT_NE(link.error().message.find("not a regular file"), std::string::npos);

  migration::remove_postcopy_record(dir.path(), r.id);
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  migration::remove_postcopy_record(dir.path(), r.id);  // gone already: fine
}

TEST(PostcopyRecord, ARestartThatFindsItsQemuNotPausedSaysWhatItSawAndThatNothingIsTouched) {
  const auto reason = migration::restart_not_recoverable_reason(
      session::Role::kSource, migration::describe_qemu("completed", "postmigrate"));
  EXPECT_NE(reason.find("the source QEMU is in migration 'completed', run state 'postmigrate', not 'postcopy-paused'"),
            std::string::npos)
      << reason;
  EXPECT_NE(reason.find("no cont, no migrate_cancel, no migrate-pause"), std::string::npos);
}
