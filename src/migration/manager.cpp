#include "migration/manager.h"

#include <sys/socket.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "migration/source_job.h"
#include "migration/target_job.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::migration {

// The session layer (src/session) this file stands on.
using session::DataPlaneServer;
using session::kHelloRefused;
using session::kHelloTimeout;

using nlohmann::json;
using namespace std::chrono_literals;

MigrationManager::MigrationManager(const AgentConfig& config, Metrics& metrics, DataPlaneServer& server)
    : config_(config), metrics_(metrics), server_(server) {
  server_.add_handler(session::to_string(session::HelloKind::kControl), [this](UniqueFd fd, const json& hello) { handle_hello(std::move(fd), hello); });
  server_.add_handler(session::to_string(session::HelloKind::kData), [this](UniqueFd fd, const json& hello) { handle_hello(std::move(fd), hello); });
  server_.add_rdma_resolver([this](const transport::rdma::ConnectRequest& request) {
    return rdma_lookup(request);
  });
  reaper_ = std::thread([this] { reaper_loop(); });
}

MigrationManager::~MigrationManager() {
  stopping_ = true;
  std::map<std::string, std::shared_ptr<Job>> jobs;
  {
    MutexLock lock(mu_);
    jobs.swap(jobs_);
  }
  jobs.clear();  // joins each worker
  {
    MutexLock lock(mu_);
    reaper_stop_ = true;
  }
  reap_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
}

void MigrationManager::reaper_loop() {
  MutexLock lock(mu_);
  for (;;) {
    while (!reaper_stop_ && reap_queue_.empty()) lock.wait(reap_cv_);
    if (reaper_stop_) return;
    const std::string id = std::move(reap_queue_.front());
    reap_queue_.pop_front();
    auto it = jobs_.find(id);
    std::shared_ptr<Job> job = it == jobs_.end() ? nullptr : it->second;
    lock.unlock();
    if (job) job->join_worker();
    job.reset();  // may be the last reference (evicted meanwhile): destroyed here, unlocked
    lock.lock();
  }
}

Result<transport::rdma::AcceptPlan> MigrationManager::rdma_lookup(const transport::rdma::ConnectRequest& request) {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    MutexLock lock(mu_);
    for (auto& [id, job] : jobs_) {
      if (!job->finished() && job->role() == Role::kTarget) jobs.push_back(job);
    }
  }
  for (auto& job : jobs) {
    auto plan = static_cast<TargetJob*>(job.get())->rdma_plan(request);
    if (plan) {
      // Keep the job alive until its channel is delivered.
      plan->deliver = [job, inner = std::move(plan->deliver)](Result<std::unique_ptr<transport::Channel>> ch) {
        inner(std::move(ch));
      };
      return plan;
    }
    if (plan.error().code != Errc::kPermissionDenied) return plan.error();
  }
  return Error{Errc::kPermissionDenied, "no migration has this session"};
}

void MigrationManager::handle_hello(UniqueFd fd, const json& raw) {
  auto hello = session::Hello::parse(raw, session::Purpose::kMigration);
  if (!hello) {
    transport::send_reject(fd.get(), "invalid_argument", hello.error().message);
    LOG_WARN("dataplane") << "refused a hello: " << hello.error().message;
    return;
  }
  std::string nonce, proof;
  if (hello->kind == session::HelloKind::kControl) {
    // Challenge every control hello, whatever its id: the source proves the one-time token
    // (transport::control_proof) instead of sending it, and a refusal reads the same for an
    // unknown id and a wrong proof.
    nonce = random_hex(16);
    (void)transport::send_message(fd.get(), session::message(session::MessageKind::kChallenge, json{{"nonce", nonce}}));
    auto auth = transport::recv_message(fd.get(), kHelloTimeout);
    auto mac = auth ? transport::get_string(auth.value(), "proof", session::to_string(session::MessageKind::kAuth), 64) : Result<std::string>(auth.error());
    if (!auth || !session::is(*auth, session::MessageKind::kAuth) || !mac) {
      transport::send_reject(fd.get(), "permission_denied", kHelloRefused);
      LOG_WARN("dataplane") << "refused a control hello: no valid answer to the challenge";
      return;
    }
    proof = mac.value();
  }
  auto job = find(hello->migration_id);
  auto* target = dynamic_cast<TargetJob*>(job.get());
  if (!target) {
    transport::send_reject(fd.get(), "permission_denied", kHelloRefused);
    return;
  }
  if (hello->kind == session::HelloKind::kControl) {
    target->on_control(std::move(fd), hello.value(), nonce, proof);
    return;
  }
  // A data channel proves the session's channel key before it is admitted; a wrong proof takes
  // no index (transport/channel_proof.h).
  auto terms = target->channel_terms(hello->session, hello->control ? transport::kControlIndex : hello->index);
  if (!terms) {
    transport::send_reject(fd.get(), "permission_denied", kHelloRefused);
    return;
  }
  auto welcome_proof = transport::check_channel(fd.get(), terms.value(), hello->nonce, kHelloTimeout);
  if (!welcome_proof) {
    metrics_.transport_error("tcp", "auth");
    LOG_WARN("dataplane") << "refused a data channel of migration " << hello->migration_id << ": "
                          << welcome_proof.error().message;
    return;
  }
  target->on_data(std::move(fd), hello.value(), welcome_proof.value());
}

std::shared_ptr<Job> MigrationManager::find(const std::string& id) const {
  MutexLock lock(mu_);
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : it->second;
}

size_t MigrationManager::active_count() const {
  MutexLock lock(mu_);
  size_t n = 0;
  for (const auto& [id, job] : jobs_) n += job->finished() ? 0 : 1;
  return n;
}

bool MigrationManager::taken_locked(const std::string& id) const {
  return jobs_.contains(id) || reserved_.contains(id);
}

void MigrationManager::evict_finished_locked(std::vector<std::shared_ptr<Job>>& graveyard) {
  size_t finished = 0;
  for (const auto& [id, job] : jobs_) finished += job->finished() ? 1 : 0;
  for (auto it = order_.begin(); it != order_.end() && finished > config_.migration.history_size;) {
    auto j = jobs_.find(*it);
    if (j != jobs_.end() && j->second->finished()) {
      graveyard.push_back(std::move(j->second));
      jobs_.erase(j);
      it = order_.erase(it);
      --finished;
    } else {
      ++it;
    }
  }
}

// The QMP socket a bare-QEMU migration may open: the path with every symlink resolved, under
// one of migration.qmpSocketRoots (also resolved). The agent then connects to the resolved
// path, so what was checked is what is opened.
Result<std::string> resolve_qmp_socket(const std::string& path, const std::vector<std::string>& roots) {
  std::string allowed;
  for (const auto& r : roots) allowed += (allowed.empty() ? "" : ", ") + r;
  const std::string where = " (migration.qmpSocketRoots: " + (allowed.empty() ? std::string("none") : allowed) + ")";
  if (path == "/proc" || path.rfind("/proc/", 0) == 0) {
    return Error{Errc::kPermissionDenied, "qmpSocket: '" + path + "' is under /proc, which is never allowed" + where};
  }
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) {
    const int err = errno;
    return Error{Errc::kFailedPrecondition, "qmpSocket: cannot talk to QEMU at '" + path + "': " + std::strerror(err)};
  }
  const std::string resolved = buf;
  for (const auto& r : roots) {
    char rbuf[PATH_MAX];
    if (::realpath(r.c_str(), rbuf) == nullptr) continue;
    std::string root = rbuf;
    if (root.back() != '/') root += '/';
    if (resolved.size() > root.size() && resolved.compare(0, root.size(), root) == 0) return resolved;
  }
  return Error{Errc::kPermissionDenied, "qmpSocket: '" + path + "'" +
                                            (resolved != path ? " (resolves to '" + resolved + "')" : std::string()) +
                                            " is not under an allowed directory" + where};
}

namespace {

// Chunk buffers a migration holds on this agent: every channel has a ring each way, and with
// dataPlane.failover a third: the chunks it sent and keeps until they are known taken.
uint64_t ring_count(bool failover) { return failover ? 3 : 2; }
uint64_t buffer_bytes(const MigrationSpec& spec, bool failover) {
  uint64_t n = spec.chunk_size;
  for (const uint64_t f : {uint64_t{spec.ring_depth}, uint64_t{spec.channels()}, ring_count(failover)}) {
    if (__builtin_mul_overflow(n, f, &n)) return UINT64_MAX;
  }
  return n;
}
}  // namespace

Result<json> MigrationManager::create(MigrationSpec spec) {
  if (stopping_.load()) return Error{Errc::kUnavailable, "agent is shutting down"};
  if (draining_.load()) {
    return Error{Errc::kUnavailable, "agent draining: it is shutting down (an upgrade or a node drain) and takes no new "
                                     "migration; its " + std::to_string(active_count()) +
                                         " running migration(s) finish first. Retry on its replacement"};
  }
  const uint64_t need = buffer_bytes(spec, config_.data_plane.failover);
  const uint64_t budget = config_.migration.buffer_budget;
  auto figures = [&](uint64_t in_use) {
    return "chunkSize " + format_quantity(spec.chunk_size) + " x ringDepth " + std::to_string(spec.ring_depth) +
           " x " + std::to_string(spec.channels()) + " channels x " + std::to_string(ring_count(config_.data_plane.failover)) +
           (config_.data_plane.failover ? " (dataPlane.failover keeps a third)" : "") + " = " + format_quantity(need) +
           (in_use ? " with " + format_quantity(in_use) + " held by running migrations" : std::string()) +
           ", budget " + format_quantity(budget) + " (migration.bufferBudget)";
  };
  if (need > budget) return Error{Errc::kUnprocessable, "buffers: " + figures(0)};
  auto qmp = resolve_qmp_socket(spec.qmp_socket, config_.migration.qmp_socket_roots);
  if (!qmp) return qmp.error();
  spec.qmp_socket = qmp.value();

  // Admission: every check and the reservation under one lock, so concurrent requests cannot
  // all pass the same checks.
  std::vector<std::shared_ptr<Job>> graveyard;  // destroyed after the lock is released
  MutexLock lock(mu_);
  evict_finished_locked(graveyard);
  size_t active = reserved_.size();
  uint64_t in_use = 0;
  for (const auto& [id, r] : reserved_) {
    in_use += r.buffer_bytes;
    if (r.qmp_socket == spec.qmp_socket) {
      return Error{Errc::kAlreadyExists, "qmpSocket: '" + spec.qmp_socket + "' is already used by migration " + id};
    }
  }
  for (const auto& [id, job] : jobs_) {
    if (job->finished()) continue;
    ++active;
    in_use += buffer_bytes(job->spec(), config_.data_plane.failover);
    if (job->spec().qmp_socket == spec.qmp_socket) {
      return Error{Errc::kAlreadyExists, "qmpSocket: '" + spec.qmp_socket +
                                             "' is already used by migration " + id};
    }
  }
  if (active >= config_.migration.max_concurrent) {
    return Error{Errc::kResourceExhausted, "this agent already runs " + std::to_string(active) +
                                               " migrations (migration.maxConcurrent)"};
  }
  if (others_) in_use += others_();  // carried KubeVirt flows on this agent
  if (in_use + need > budget) return Error{Errc::kResourceExhausted, "buffers: " + figures(in_use)};
  if (spec.id.empty() && spec.role == Role::kSource && !taken_locked(spec.target.migration_id)) {
    spec.id = spec.target.migration_id;
  }
  if (spec.id.empty()) {
    do spec.id = "m-" + random_hex(6);
    while (taken_locked(spec.id));
  }
  if (taken_locked(spec.id)) return Error{Errc::kAlreadyExists, "id: migration '" + spec.id + "' exists"};
  if (spec.vm.empty()) spec.vm = spec.id;
  reserved_.emplace(spec.id, Reservation{spec.qmp_socket, need});
  lock.unlock();  // QMP checks below can take seconds; do not block GETs
  auto release = [&] {
    MutexLock relock(mu_);
    reserved_.erase(spec.id);
  };

  JobContext ctx = job_context();
  json body;
  std::shared_ptr<Job> job;
  if (spec.role == Role::kTarget) {
    auto t = TargetJob::create(spec, ctx);
    if (!t) {
      release();
      return t.error();
    }
    body = json{{"id", spec.id},
                {"role", "target"},
                {"endpoint", net::format_endpoint(server_.advertise_host(), server_.port())},
                {"dataPlane", {{"host", server_.advertise_host()}, {"port", server_.port()}}},
                {"migrationId", spec.id},
                {"token", t.value()->token()}};
    job = std::shared_ptr<Job>(std::move(t.value()));
  } else {
    auto s = SourceJob::create(spec, ctx);
    if (!s) {
      release();
      return s.error();
    }
    body = json{{"id", spec.id}, {"role", "source"}};
    job = std::shared_ptr<Job>(std::move(s.value()));
  }
  lock.lock();
  reserved_.erase(spec.id);
  jobs_.emplace(spec.id, job);
  order_.push_back(spec.id);
  lock.unlock();
  if (auto* t = dynamic_cast<TargetJob*>(job.get())) t->start();
  if (auto* s = dynamic_cast<SourceJob*>(job.get())) s->start();
  body["phase"] = phase_name(job->status().phase);
  LOG_INFO("migration") << "migration=" << spec.id << " role=" << role_name(spec.role) << " vm=" << spec.vm
                        << " created channels=" << spec.channels() << " chunkSize=" << format_quantity(spec.chunk_size)
                        << " ringDepth=" << spec.ring_depth << " buffers=" << format_quantity(need);
  return body;
}

JobContext MigrationManager::job_context() {
  return JobContext{config_, metrics_, server_.advertise_host(), server_.port(), server_.rdma(),
                    [this](const std::string& done) {
                      {
                        MutexLock relock(mu_);
                        reap_queue_.push_back(done);
                      }
                      reap_cv_.notify_one();
                    }};
}

void MigrationManager::restore_postcopy_records() {
  const std::string& dir = config_.state_dir;
  for (const auto& id : postcopy_record_ids(dir)) {
    const std::string path = postcopy_record_path(dir, id);
    const auto drop = [&](const std::string& why) {
      LOG_WARN("migration") << "post-copy record " << path << " not acted on, removed: " << why;
      ::unlink(path.c_str());
    };
    auto record = read_postcopy_record(path, id);
    if (!record) {
      drop(record.error().message);
      continue;
    }
    const auto& r = record.value();
    const std::string what = "migration " + r.id + " (" + role_name(r.role) + ", vm " + r.vm + ", QEMU " + r.qmp_socket + ")";
    if (config_.migration.postcopy_recovery_seconds == 0) {
      drop(what + ": post-copy recovery is off on this agent (migration.postCopyRecoverySeconds 0)");
      continue;
    }
    if (postcopy_record_expired(r, session::wall_clock_ms())) {
      drop(what + ": older than its recovery deadline (last written " +
           std::to_string((session::wall_clock_ms() - r.alive_at_ms) / 1000) + " s ago, deadline " +
           std::to_string(r.recovery_seconds) + " s): the peer agent has given up; recover by hand "
           "(docs/runbooks/RdmigPostcopySplit.md)");
      continue;
    }
    auto resolved = resolve_qmp_socket(r.qmp_socket, config_.migration.qmp_socket_roots);
    if (!resolved) {
      drop(what + ": " + resolved.error().message);
      continue;
    }
    if (resolved.value() != r.qmp_socket) {
      drop(what + ": qmpSocket now resolves to '" + resolved.value() + "', not the socket the migration used");
      continue;
    }
    std::shared_ptr<Job> job;
    if (r.role == Role::kSource) {
      auto s = SourceJob::restore(r, job_context());
      if (!s) {
        drop(what + ": its QEMU is gone (" + s.error().message + ")");
        continue;
      }
      job = std::shared_ptr<Job>(std::move(s.value()));
    } else {
      auto t = TargetJob::restore(r, job_context());
      if (!t) {
        drop(what + ": its QEMU is gone (" + t.error().message + ")");
        continue;
      }
      job = std::shared_ptr<Job>(std::move(t.value()));
    }
    bool taken = false;
    {
      MutexLock lock(mu_);
      taken = taken_locked(r.id);
      if (!taken) {
        jobs_.emplace(r.id, job);
        order_.push_back(r.id);
      }
    }
    if (taken) {
      drop(what + ": a migration with this id exists already");
      continue;
    }
    LOG_WARN("migration") << "post-copy record " << path << ": " << what
                          << " taken up again after this agent restarted (state " << r.state << ", "
                          << r.recoveries << " recoveries before)";
    if (auto* t = dynamic_cast<TargetJob*>(job.get())) t->start_restored();
    if (auto* s = dynamic_cast<SourceJob*>(job.get())) s->start_restored();
  }
}

uint64_t MigrationManager::buffer_bytes_in_use() const {
  MutexLock lock(mu_);
  uint64_t in_use = 0;
  for (const auto& [id, r] : reserved_) in_use += r.buffer_bytes;
  for (const auto& [id, job] : jobs_) {
    if (!job->finished()) in_use += buffer_bytes(job->spec(), config_.data_plane.failover);
  }
  return in_use;
}

std::vector<MigrationStatus> MigrationManager::list() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    MutexLock lock(mu_);
    for (const auto& id : order_) {
      if (auto it = jobs_.find(id); it != jobs_.end()) jobs.push_back(it->second);
    }
  }
  std::vector<MigrationStatus> out;
  out.reserve(jobs.size());
  for (const auto& j : jobs) out.push_back(j->status());
  return out;
}

Result<MigrationStatus> MigrationManager::get(const std::string& id) const {
  auto job = find(id);
  if (!job) return Error{Errc::kNotFound, "no migration '" + id + "'"};
  return job->status();
}

Result<MigrationStatus> MigrationManager::cancel(const std::string& id) {
  auto job = find(id);
  if (!job) return Error{Errc::kNotFound, "no migration '" + id + "'"};
  if (!job->request_cancel_before_postcopy("cancelled through the API")) {
    // The target runs the VM and the source still holds pages it lacks (or the two agents agreed
    // to switch): neither side can take the VM back alone, so the migration runs to its end
    // (docs/api.md).
    return Error{Errc::kFailedPrecondition, "migration '" + id + "' is in post-copy (the target runs the VM): "
                                            "it cannot be cancelled, it completes or fails"};
  }
  return job->status();
}

void MigrationManager::shutdown(std::chrono::milliseconds grace) {
  stopping_ = true;
  std::vector<std::shared_ptr<Job>> jobs;
  {
    MutexLock lock(mu_);
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (auto& j : jobs) {
    if (!j->finished()) j->request_cancel("agent shutting down");
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (auto& j : jobs) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (!j->wait_finished(std::max(left, 0ms))) {
      LOG_WARN("agent") << "migration=" << j->id() << " still running at shutdown";
    }
  }
}

}  // namespace rdmig::migration
