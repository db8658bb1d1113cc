// What an agent keeps on disk while one of its migrations is in post-copy, so that a restarted
// agent can take part in the recovery (docs/api.md "Post-copy recovery", docs/security.md): after
// the switch the VM's state is split between the two QEMUs, and an agent that dies loses the
// session's keys with its memory. The record holds the least that a resume needs: which job and
// role, the QEMU's QMP socket, the peer agent's endpoint, the session's name and channel key (a
// per-session secret derived from the one-time migration token; never the agents' API token), and
// the recovery's state. One file per migration, `<stateDir>/<id>.postcopy.json`, 0600 in the
// 0700 stateDir, written atomically (a temporary file, fsync, rename), refreshed while post-copy
// runs (aliveAtMs), removed when the migration ends.
//
// Read back only through read_postcopy_record: a regular file owned by this agent's user, no group
// or other bits, at most kPostcopyRecordMaxBytes, JSON with exactly the known fields, each bounded,
// its id the file's, and its digest over every other field right (a record changed after the agent
// wrote it, or cut short, is refused naming what is wrong). Pure but for the file functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"
#include "migration/types.h"

namespace rdmig::migration {

inline constexpr size_t kPostcopyRecordMaxBytes = 4096;
inline constexpr int kPostcopyRecordVersion = 1;
inline constexpr const char* kPostcopyRecordSuffix = ".postcopy.json";

struct PostcopyRecord {
  std::string id;  // this agent's migration id (the file's name)
  Role role = Role::kSource;
  std::string vm;
  std::string qmp_socket;
  // Source: the target agent's data-plane endpoint, dialled again; target: the source agent's
  // address as last seen (for the log; the source dials).
  std::string peer;
  std::string target_migration_id;  // source: the target's id for the migration (the hello's)
  std::string session;              // the session's name (32 hex)
  std::string channel_key;          // what every channel of the session proves (64 hex)
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  bool verify_chunks = false;
  // postcopy-preempt's connection is carried too (the recovery opens it again); written only when
  // true, so an agent from before it reads the records it can resume.
  bool preempt = false;
  // QEMU's multifd channels (10.1+: post-copy with multifd); a recovery resumes the main channel
  // (and the preempt one) only, but the preempt channel's index follows them. Written only when > 0:
  // an agent from before it resumed no post-copy with multifd and refuses such a record whole.
  uint32_t multifd_channels = 0;
  std::string post_copy_mode;  // source: after | auto; target: requested
  uint32_t completion_timeout_seconds = 0;
  uint32_t no_progress_timeout_seconds = 0;
  std::string state;  // "postcopy" (running, or about to switch) | "recovering"
  int64_t switched_at_ms = 0;  // wall clock; 0 before the switch
  uint32_t recoveries = 0;
  uint32_t recovery_seconds = 0;  // migration.postCopyRecoverySeconds when written
  int64_t alive_at_ms = 0;        // wall clock of the last write: the agent ran the migration then
};

// The file of migration `id` in `state_dir`.
std::string postcopy_record_path(const std::string& state_dir, const std::string& id);

// The record as it is written: JSON with a "digest" over the other fields.
std::string serialize_postcopy_record(const PostcopyRecord& r);
// The record in `text`, read from the file of migration `file_id`; every refusal names the field
// or the check ("postcopy record: digest: ...").
Result<PostcopyRecord> parse_postcopy_record(std::string_view text, const std::string& file_id);

// Whether the recovery a record belongs to is over by `now_ms`: the last time the agent ran it
// plus the recovery deadline has passed (the peer agent has given up by then).
bool postcopy_record_expired(const PostcopyRecord& r, int64_t now_ms);

// Files: written atomically with mode 0600 (a temporary file in the same directory, fsync, rename);
// read with the checks above (lstat first: a symlink, another owner, group or other bits, or a size
// over the bound are refused before a byte is read); removed (a missing file is fine).
Status write_postcopy_record(const std::string& state_dir, const PostcopyRecord& r);
Result<PostcopyRecord> read_postcopy_record(const std::string& path, const std::string& file_id);
void remove_postcopy_record(const std::string& state_dir, const std::string& id);
// The migration ids that have a record file in `state_dir` (names ending in .postcopy.json;
// the id is what precedes the suffix, whatever it is: read_postcopy_record judges it).
std::vector<std::string> postcopy_record_ids(const std::string& state_dir);

}  // namespace rdmig::migration
