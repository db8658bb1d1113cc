#include "migration/postcopy_record.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "common/fd.h"
#include "common/hmac.h"
#include "common/json_limits.h"
#include "common/net.h"
#include "common/units.h"

namespace rdmig::migration {

using nlohmann::json;

namespace {

// The digest detects a record cut short or changed after the agent wrote it; its key is no
// secret (whoever can write stateDir is root on the node: docs/security.md).
constexpr const char* kRecordDigestKey = "rdmig-postcopy-record-v1";

Error rec_bad(const std::string& field, const std::string& what) {
  return Error{Errc::kInvalidArgument, "postcopy record: " + field + ": " + what};
}

bool rec_is_hex(const std::string& s, size_t n) {
  if (s.size() != n) return false;
  for (const char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool rec_is_id(const std::string& s) {
  if (s.empty() || s.size() > 63 || s.front() == '-' || s.back() == '-') return false;
  for (const char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

bool rec_is_safe(const std::string& s) {
  for (const char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                    c == '_' || c == '.' || c == '/';
    if (!ok) return false;
  }
  return true;
}

json rec_body_of(const PostcopyRecord& r) {
  json j{{"version", kPostcopyRecordVersion},
         {"id", r.id},
         {"role", role_name(r.role)},
         {"vm", r.vm},
         {"qmpSocket", r.qmp_socket},
         {"peer", r.peer},
         {"session", r.session},
         {"channelKey", r.channel_key},
         {"chunkSize", r.chunk_size},
         {"ringDepth", r.ring_depth},
         {"verifyChunks", r.verify_chunks},
         {"postCopyMode", r.post_copy_mode},
         {"completionTimeoutSeconds", r.completion_timeout_seconds},
         {"noProgressTimeoutSeconds", r.no_progress_timeout_seconds},
         {"state", r.state},
         {"switchedAtMs", r.switched_at_ms},
         {"recoveries", r.recoveries},
         {"recoverySeconds", r.recovery_seconds},
         {"aliveAtMs", r.alive_at_ms}};
  if (r.role == Role::kSource) j["targetMigrationId"] = r.target_migration_id;
  if (r.preempt) j["postCopyPreempt"] = true;
  if (r.multifd_channels > 0) j["multifdChannels"] = r.multifd_channels;
  return j;
}

std::string rec_digest_of(const json& body) { return hmac_sha256_hex(kRecordDigestKey, body.dump()); }

Result<std::string> rec_str(const json& j, const char* key, size_t max) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return rec_bad(key, "missing, or not a string");
  auto s = it->get<std::string>();
  if (s.size() > max) return rec_bad(key, "longer than " + std::to_string(max) + " characters");
  return s;
}

Result<uint64_t> rec_num(const json& j, const char* key, uint64_t lo, uint64_t hi) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) return rec_bad(key, "missing, or not a non-negative integer");
  const auto v = it->get<uint64_t>();
  if (v < lo || v > hi) return rec_bad(key, std::to_string(v) + " is outside " + std::to_string(lo) + ".." + std::to_string(hi));
  return v;
}

}  // namespace

std::string postcopy_record_path(const std::string& state_dir, const std::string& id) {
  return state_dir + "/" + id + kPostcopyRecordSuffix;
}

std::string serialize_postcopy_record(const PostcopyRecord& r) {
  json j = rec_body_of(r);
  j["digest"] = rec_digest_of(j);
  return j.dump(1) + "\n";
}

Result<PostcopyRecord> parse_postcopy_record(std::string_view text, const std::string& file_id) {
  if (text.size() > kPostcopyRecordMaxBytes) {
    return rec_bad("size", std::to_string(text.size()) + " bytes, more than " + std::to_string(kPostcopyRecordMaxBytes));
  }
  const json j = parse_json_bounded(text, 4);
  if (j.is_discarded() || !j.is_object()) return rec_bad("document", "not a JSON object (cut short, or not a record)");
  static const std::set<std::string> known{
      "version",   "id",          "role",         "vm",          "qmpSocket",    "peer",
      "session",   "channelKey",  "chunkSize",    "ringDepth",   "verifyChunks", "postCopyMode",
      "completionTimeoutSeconds", "noProgressTimeoutSeconds",    "state",        "switchedAtMs",
      "recoveries", "recoverySeconds", "aliveAtMs", "targetMigrationId", "postCopyPreempt", "multifdChannels", "digest"};
  for (const auto& [key, v] : j.items()) {
    if (!known.contains(key)) return rec_bad(key.substr(0, 64), "unknown field");
  }
  auto version = rec_num(j, "version", 0, 1000);
  if (!version) return version.error();
  if (version.value() != kPostcopyRecordVersion) {
    return rec_bad("version", std::to_string(version.value()) + ", this agent reads version " +
                              std::to_string(kPostcopyRecordVersion));
  }
  // The digest before any field is believed: a record changed by hand is refused as a whole.
  auto digest = rec_str(j, "digest", 64);
  if (!digest) return digest.error();
  json body = j;
  body.erase("digest");
  if (!constant_time_equal(digest.value(), rec_digest_of(body))) {
    return rec_bad("digest", "does not match the record's contents (changed or damaged after the agent wrote it)");
  }
  PostcopyRecord r;
  auto id = rec_str(j, "id", 63);
  if (!id) return id.error();
  if (!rec_is_id(id.value())) return rec_bad("id", "not a migration id (a DNS label)");
  if (id.value() != file_id) return rec_bad("id", "'" + id.value() + "' is not the file's migration '" + file_id + "'");
  r.id = id.value();
  auto role = rec_str(j, "role", 16);
  if (!role) return role.error();
  if (role.value() == "source") r.role = Role::kSource;
  else if (role.value() == "target") r.role = Role::kTarget;
  else return rec_bad("role", "must be source or target, got '" + role.value() + "'");
  auto vm = rec_str(j, "vm", 253);
  if (!vm) return vm.error();
  if (!rec_is_safe(vm.value())) return rec_bad("vm", "may hold only letters, digits and - _ . /");
  r.vm = vm.value();
  auto qmp = rec_str(j, "qmpSocket", 107);
  if (!qmp) return qmp.error();
  const bool control = std::any_of(qmp->begin(), qmp->end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; });
  if (qmp->empty() || qmp->front() != '/' || control) return rec_bad("qmpSocket", "not an absolute socket path");
  r.qmp_socket = qmp.value();
  auto peer = rec_str(j, "peer", 300);
  if (!peer) return peer.error();
  if (r.role == Role::kSource) {
    auto ep = net::parse_endpoint(peer.value(), "postcopy record: peer");
    if (!ep) return ep.error();
  }
  r.peer = peer.value();
  if (r.role == Role::kSource) {
    auto tid = rec_str(j, "targetMigrationId", 63);
    if (!tid) return tid.error();
    if (!rec_is_id(tid.value())) return rec_bad("targetMigrationId", "not a migration id (a DNS label)");
    r.target_migration_id = tid.value();
  } else if (j.contains("targetMigrationId")) {
    return rec_bad("targetMigrationId", "only in a source's record");
  }
  auto session = rec_str(j, "session", 32);
  if (!session) return session.error();
  if (!rec_is_hex(session.value(), 32)) return rec_bad("session", "not 32 lowercase hex characters");
  r.session = session.value();
  auto key = rec_str(j, "channelKey", 64);
  if (!key) return key.error();
  if (!rec_is_hex(key.value(), 64)) return rec_bad("channelKey", "not 64 lowercase hex characters");
  r.channel_key = key.value();
  auto chunk = rec_num(j, "chunkSize", 0, uint64_t{1} << 30);
  if (!chunk) return chunk.error();
  if (auto st = validate_chunk_size(chunk.value(), "postcopy record: chunkSize"); !st) return st.error();
  r.chunk_size = chunk.value();
  auto depth = rec_num(j, "ringDepth", 2, 1024);
  if (!depth) return depth.error();
  r.ring_depth = static_cast<uint32_t>(depth.value());
  const auto vc = j.find("verifyChunks");
  if (vc == j.end() || !vc->is_boolean()) return rec_bad("verifyChunks", "missing, or not true/false");
  r.verify_chunks = vc->get<bool>();
  if (const auto pp = j.find("postCopyPreempt"); pp != j.end()) {
    if (!pp->is_boolean()) return rec_bad("postCopyPreempt", "not true/false");
    r.preempt = pp->get<bool>();
  }
  if (j.contains("multifdChannels")) {
    auto mf = rec_num(j, "multifdChannels", 1, kMaxMultifdChannels);
    if (!mf) return mf.error();
    r.multifd_channels = static_cast<uint32_t>(mf.value());
  }
  auto mode = rec_str(j, "postCopyMode", 16);
  if (!mode) return mode.error();
  const bool mode_ok = r.role == Role::kSource ? (mode.value() == "after" || mode.value() == "auto")
                                                : mode.value() == "requested";
  if (!mode_ok) return rec_bad("postCopyMode", "'" + mode.value() + "' is not a post-copy mode of a " + role.value());
  r.post_copy_mode = mode.value();
  auto ct = rec_num(j, "completionTimeoutSeconds", 1, 7 * 86400);
  if (!ct) return ct.error();
  r.completion_timeout_seconds = static_cast<uint32_t>(ct.value());
  auto np = rec_num(j, "noProgressTimeoutSeconds", 0, 86400);
  if (!np) return np.error();
  r.no_progress_timeout_seconds = static_cast<uint32_t>(np.value());
  auto state = rec_str(j, "state", 16);
  if (!state) return state.error();
  if (state.value() != "postcopy" && state.value() != "recovering") {
    return rec_bad("state", "must be postcopy or recovering, got '" + state.value() + "'");
  }
  r.state = state.value();
  constexpr uint64_t kYear3000Ms = 32503680000000;
  auto sw = rec_num(j, "switchedAtMs", 0, kYear3000Ms);
  if (!sw) return sw.error();
  r.switched_at_ms = static_cast<int64_t>(sw.value());
  auto rec = rec_num(j, "recoveries", 0, 1000000);
  if (!rec) return rec.error();
  r.recoveries = static_cast<uint32_t>(rec.value());
  auto rs = rec_num(j, "recoverySeconds", 1, 86400);
  if (!rs) return rs.error();
  r.recovery_seconds = static_cast<uint32_t>(rs.value());
  auto alive = rec_num(j, "aliveAtMs", 1, kYear3000Ms);
  if (!alive) return alive.error();
  r.alive_at_ms = static_cast<int64_t>(alive.value());
  return r;
}

bool postcopy_record_expired(const PostcopyRecord& r, int64_t now_ms) {
  return now_ms > r.alive_at_ms + int64_t{r.recovery_seconds} * 1000;
}

Status write_postcopy_record(const std::string& state_dir, const PostcopyRecord& r) {
  const std::string path = postcopy_record_path(state_dir, r.id);
  const std::string tmp = path + ".tmp";
  const std::string text = serialize_postcopy_record(r);
  const auto fail = [&](const std::string& what) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Error{Errc::kIo, "postcopy record " + path + ": " + what + ": " + std::strerror(err)};
  };
  ::unlink(tmp.c_str());  // one left by an agent that died while writing
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return fail("create");
  for (size_t off = 0; off < text.size();) {
    const ssize_t n = ::write(fd.get(), text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("write");
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return fail("fsync");
  fd.reset();
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename");
  return ok_status();
}

Result<PostcopyRecord> read_postcopy_record(const std::string& path, const std::string& file_id) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return Error{Errc::kNotFound, "postcopy record " + path + ": " + std::strerror(errno)};
  }
  const auto refuse = [&](const std::string& why) {
    return Error{Errc::kInvalidArgument, "postcopy record " + path + ": " + why};
  };
  if (!S_ISREG(st.st_mode)) return refuse("not a regular file (a symlink or something else)");
  if (st.st_uid != ::geteuid()) return refuse("owned by uid " + std::to_string(st.st_uid) + ", not this agent's");
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%03o", static_cast<unsigned>(st.st_mode & 0777));
    return refuse(std::string("open to group or others (mode ") + mode + "), not 0600");
  }
  if (st.st_size > static_cast<off_t>(kPostcopyRecordMaxBytes)) {
    return refuse("size: " + std::to_string(st.st_size) + " bytes, more than " + std::to_string(kPostcopyRecordMaxBytes));
  }
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) return refuse(std::strerror(errno));
  std::string text(kPostcopyRecordMaxBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return refuse(std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);  // grown since the lstat: the parse refuses the size
  auto r = parse_postcopy_record(text, file_id);
  if (!r) return refuse(r.error().message);
  return r;
}

void remove_postcopy_record(const std::string& state_dir, const std::string& id) {
  ::unlink(postcopy_record_path(state_dir, id).c_str());
}

std::vector<std::string> postcopy_record_ids(const std::string& state_dir) {
  std::vector<std::string> ids;
  DIR* dir = ::opendir(state_dir.c_str());
  if (dir == nullptr) return ids;
  const std::string suffix = kPostcopyRecordSuffix;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      ids.push_back(name.substr(0, name.size() - suffix.size()));
    }
  }
  ::closedir(dir);
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace rdmig::migration
