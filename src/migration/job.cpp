#include "migration/job.h"

#include <sys/socket.h>

#include <cstdlib>
#include <fstream>

#include "common/log.h"
#include "common/net.h"
#include "migration/postcopy_recovery.h"

namespace rdmig::migration {

// The session layer (src/session) this file stands on.
using session::account_rail_traffic;
using session::ChannelPump;
using session::ChannelTraffic;
using session::ControlLink;
using session::kMultifdDrainLimit;
using session::rail_of_channel_text;
using session::rail_usage;
using session::RailPair;
using session::wall_clock_ms;

Error qmp_check_failed(const std::string& socket, const std::string& what, const Error& e) {
  if (e.code == Errc::kTimeout) {
    return Error{Errc::kTimeout, "qmpSocket: QEMU at '" + socket + "' did not answer " + what + ": " + e.message};
  }
  return Error{Errc::kFailedPrecondition, "qmpSocket: cannot talk to QEMU at '" + socket + "' (" + what + "): " + e.message};
}

std::string QemuVersion::text() const {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(micro);
}

Result<QemuVersion> qemu_version(qemu::QmpClient& qmp) {
  auto v = qmp.execute("query-version", {}, kQmpTimeout);
  if (!v) return v.error();
  if (!v->is_object()) return Error{Errc::kProtocol, "query-version: not an object"};
  const auto q = v->value("qemu", nlohmann::json::object());
  if (!q.is_object()) return Error{Errc::kProtocol, "query-version: 'qemu' is not an object"};
  QemuVersion out;
  for (auto [key, field] : {std::pair{"major", &out.major}, std::pair{"minor", &out.minor}, std::pair{"micro", &out.micro}}) {
    const auto it = q.find(key);
    if (it == q.end() || !it->is_number_integer()) return Error{Errc::kProtocol, std::string("query-version: no qemu.") + key};
    *field = it->get<int>();
  }
  return out;
}

Job::Job(MigrationSpec spec, JobContext ctx)
    : spec_(std::move(spec)), ctx_(ctx), created_(std::chrono::steady_clock::now()) {
  status_.id = spec_.id;
  status_.role = spec_.role;
  status_.vm = spec_.vm;
  status_.channels = spec_.channels();
  status_.chunk_size = spec_.chunk_size;
  status_.ring_depth = spec_.ring_depth;
  status_.verify_chunks = spec_.verify_chunks;
  status_.created_at_ms = wall_clock_ms();
  gauges_ = ctx_.metrics.migration_gauges(spec_.id, role_name(spec_.role), spec_.vm);
  ctx_.metrics.migration_started(role_name(spec_.role));
}

Job::~Job() {
  stop_worker();
  ctx_.metrics.remove_migration_gauges(gauges_);
}

void Job::stop_worker() {
  request_cancel("agent shutting down");
  join_worker();
}

void Job::join_worker() {
  MutexLock lock(join_mu_);
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

void Job::start_worker(std::function<void()> body) {
  worker_ = std::thread([this, body = std::move(body)] {
    try {
      body();
    } catch (const std::exception& e) {
      // An allocation failure (or any other escape) fails this migration, never the agent.
      const Error error{Errc::kResourceExhausted, std::string("internal error: ") + e.what()};
      LOG_ERROR("migration") << log_prefix() << " " << error.message;
      try {
        on_exception(error);
      } catch (const std::exception&) {
      }
      finish(Phase::kFailed, error.message, "other");
    }
    release_resources();
    if (ctx_.on_worker_done) ctx_.on_worker_done(spec_.id);
  });
}

void Job::release_resources() {
  std::vector<std::unique_ptr<ChannelPump>> pumps;
  std::vector<std::unique_ptr<transport::Channel>> channels;
  std::unique_ptr<ControlLink> link;
  {
    MutexLock lock(data_mu_);
    pumps.swap(pumps_);
    channels.swap(channels_);
    link = std::move(link_);
  }
  // A failed source's multifd connections drain until QEMU closes them (at once here: QEMU's
  // cleanup shuts them down and nothing sits between), bounded by the pump's limit.
  for (auto& p : pumps) {
    if (p->draining()) p->wait(kMultifdDrainLimit + std::chrono::seconds(1));
  }
  for (auto& p : pumps) p->abort(Error{Errc::kCancelled, "migration finished"}, p->draining());
  pumps.clear();  // pumps use the channels: joined first
  channels.clear();
  link.reset();
  qmp_.reset();
  release_own();
}

int Job::qemu_pid_of(qemu::QmpClient& qmp) {
  auto cpus = qmp.execute("query-cpus-fast", {}, kQmpTimeout);
  if (cpus && cpus->is_array() && !cpus->empty() && (*cpus)[0].is_object()) {
    const auto tid = (*cpus)[0].value("thread-id", int64_t{0});
    if (tid > 0) {
      std::ifstream status("/proc/" + std::to_string(tid) + "/status");
      std::string line;
      while (std::getline(status, line)) {
        if (line.rfind("Tgid:", 0) == 0) {
          const int pid = std::atoi(line.c_str() + 5);
          if (pid > 0) return pid;
        }
      }
    }
  }
  return qmp.peer_pid();
}

Status Job::check_qemu_peer(int fd, const std::string& what) const {
  if (qemu_pid_ <= 0) return ok_status();
  const int pid = net::peer_pid(fd);
  if (pid == qemu_pid_) return ok_status();
  // pid 0: the kernel named no process this agent's pid namespace can see.
  const std::string peer = pid > 0 ? "pid " + std::to_string(pid) : "no process this agent can see (SO_PEERCRED pid 0)";
  return Error{Errc::kPermissionDenied, what + ": the peer is " + peer + ", not the QEMU behind qmpSocket (pid " +
                                            std::to_string(qemu_pid_) + ")"};
}

Job::CancelWatch::CancelWatch(Job& job, int fd) : job_(job), fd_(fd) {
  bool cancelled = false;
  {
    MutexLock lock(job_.status_mu_);
    job_.watched_fds_.push_back(fd_);
    cancelled = job_.cancel_requested_.load();
  }
  if (cancelled) ::shutdown(fd_, SHUT_RDWR);
}

Job::CancelWatch::~CancelWatch() {
  MutexLock lock(job_.status_mu_);
  std::erase(job_.watched_fds_, fd_);
}

MigrationStatus Job::status() const {
  MutexLock lock(status_mu_);
  return status_;
}

bool Job::finished() const {
  MutexLock lock(status_mu_);
  return phase_terminal(status_.phase);
}

bool Job::wait_finished(std::chrono::milliseconds timeout) const {
  MutexLock lock(status_mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!phase_terminal(status_.phase)) {
    if (lock.wait_until(status_cv_, deadline) == std::cv_status::timeout) break;
  }
  return phase_terminal(status_.phase);
}

void Job::request_cancel(const std::string& reason) {
  {
    MutexLock lock(status_mu_);
    if (cancel_requested_.load() || phase_terminal(status_.phase)) return;
    cancel_reason_ = reason;
    cancel_requested_.store(true);
    for (const int fd : watched_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  LOG_INFO("migration") << log_prefix() << " cancel requested: " << reason;
}

bool Job::request_cancel_before_postcopy(const std::string& reason) {
  {
    // The check and the cancel under one hold of the lock agree_postcopy_switch() takes.
    MutexLock lock(status_mu_);
    if (phase_terminal(status_.phase) || cancel_requested_.load()) return true;  // the status says the rest
    if (postcopy_agreed_ || status_.post_copy.switched) return false;
    cancel_reason_ = reason;
    cancel_requested_.store(true);
    for (const int fd : watched_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  LOG_INFO("migration") << log_prefix() << " cancel requested: " << reason;
  return true;
}

bool Job::agree_postcopy_switch() {
  MutexLock lock(status_mu_);
  if (cancel_requested_.load()) return false;
  postcopy_agreed_ = true;
  return true;
}

bool Job::postcopy_agreed() const {
  MutexLock lock(status_mu_);
  return postcopy_agreed_;
}

std::string Job::cancel_reason() const {
  MutexLock lock(status_mu_);
  return cancel_reason_;
}

void Job::set_phase(Phase phase) {
  {
    MutexLock lock(status_mu_);
    if (phase_terminal(status_.phase)) return;
    if (status_.phase == phase) return;
    status_.phase = phase;
    if (phase == Phase::kMigrating && status_.started_at_ms == 0) status_.started_at_ms = wall_clock_ms();
  }
  status_cv_.notify_all();
  ctx_.metrics.migration_phase(gauges_, phase_name(phase), status().transport);
  LOG_INFO("migration") << log_prefix() << " phase=" << phase_name(phase);
}

void Job::update(const std::function<void(MigrationStatus&)>& fn) {
  MutexLock lock(status_mu_);
  fn(status_);
}

void Job::refresh_data_counters(bool retiring) {
  uint64_t sent = 0, received = 0, chunks_sent = 0, chunks_received = 0;
  ChannelTraffic by_channel;  // pumps_[c] carries channel c
  {
    MutexLock lock(data_mu_);
    sent = retired_counts_[0];
    received = retired_counts_[1];
    chunks_sent = retired_counts_[2];
    chunks_received = retired_counts_[3];
    for (const auto& p : pumps_) {
      by_channel.bytes_sent.push_back(p->bytes_up());
      by_channel.bytes_received.push_back(p->bytes_down());
      by_channel.chunks_sent.push_back(p->chunks_up());
      by_channel.chunks_received.push_back(p->chunks_down());
      sent += p->bytes_up();
      received += p->bytes_down();
      chunks_sent += p->chunks_up();
      chunks_received += p->chunks_down();
    }
  }
  MutexLock lock(status_mu_);
  // A channel that failed over off its rail counts there what it carried until then (its first
  // refresh after the failover, within a second of it); what it carries since counts on the rail
  // it moved to, or on none over TCP.
  for (const auto& [c, to] : rail_moves_) {
    session::move_channel_off_rail(status_.rails, rail_pairs_for_status_, c, to, by_channel);
  }
  rail_moves_.clear();
  if (retiring) session::take_channels_off_rails(status_.rails, by_channel);
  status_.progress.data_bytes_sent = sent;
  status_.progress.data_bytes_received = received;
  status_.progress.chunks_sent = chunks_sent;
  status_.progress.chunks_received = chunks_received;
  account_rail_traffic(status_.rails, by_channel, ctx_.metrics, "migration");
}

void Job::set_rails(const std::vector<RailPair>& rails) {
  auto usage = rail_usage(rails, spec_.channels());
  for (const auto& r : usage) {
    std::string channels;
    for (const uint32_t c : r.channels) channels += (channels.empty() ? "" : ",") + std::to_string(c);
    LOG_INFO("migration") << log_prefix() << " rail " << r.rail << ": " << r.device << " gid=" << r.gid
                          << " address=" << r.address << " peer=" << (r.peer_address.empty() ? "?" : r.peer_address)
                          << " channels=" << channels;
  }
  std::vector<RailLeftOut> left_out;
  for (const auto& d : ctx_.rdma.down) {
    LOG_INFO("migration") << log_prefix() << " rail " << d.rail << " left out at start: " << d.reason_code << ": "
                          << d.reason;
    left_out.push_back(RailLeftOut{d.rail, d.reason_code, d.reason});
  }
  MutexLock lock(status_mu_);
  status_.rails = std::move(usage);
  status_.rails_left_out = std::move(left_out);
  rail_pairs_for_status_ = rails;
}

bool is_peer_abort(const Error& e) {
  // Both transports word it so: "<channel>: peer aborted" (RDMA's abort immediate) or
  // "...: peer aborted: <reason>" (TCP's abort frame).
  return e.message.find("peer aborted") != std::string::npos;
}

std::optional<ChannelFailure> channel_failure_to_report(const std::vector<std::optional<Error>>& errors) {
  std::optional<ChannelFailure> echo;
  for (uint32_t i = 0; i < errors.size(); ++i) {
    if (!errors[i]) continue;
    if (!is_peer_abort(*errors[i])) return ChannelFailure{i, *errors[i], false};
    if (!echo) echo = ChannelFailure{i, *errors[i], true};
  }
  return echo;
}

std::optional<ChannelFailure> Job::channel_failure(std::optional<Errc> only) const {
  std::vector<std::optional<Error>> errors;
  {
    MutexLock lock(data_mu_);
    errors.reserve(pumps_.size());
    for (const auto& p : pumps_) errors.push_back(p->error());  // pumps_[i] carries channel i
  }
  if (only) {
    for (auto& e : errors) {
      if (e && e->code != *only) e.reset();
    }
  }
  return channel_failure_to_report(errors);
}

Error Job::data_plane_error(const Error& e, uint32_t channel) const {
  std::string rail;
  {
    MutexLock lock(status_mu_);
    rail = rail_of_channel_text(status_.rails, channel);
    // A failover the counters have not applied yet moved it already: name where it runs now.
    for (const auto& [c, to] : rail_moves_) {
      if (c != channel) continue;
      const RailPair* p = to ? session::find_rail(rail_pairs_for_status_, *to) : nullptr;
      rail = p ? session::rail_text(*p) : "";
    }
  }
  return e.with_context(rail.empty() ? "data plane" : "data plane (" + rail + ")");
}

Error Job::qemu_failure(const std::string& what, const std::string& error_desc,
                        const std::optional<ChannelFailure>& failed) const {
  const std::string qemu_error = what + ": " + (error_desc.empty() ? std::string("no reason given") : error_desc);
  if (!failed) return Error{Errc::kQemu, qemu_error};
  Error e = data_plane_error(failed->error, failed->channel);
  e.message += "; " + qemu_error;
  return e;
}

void Job::abort_data_plane(const Error& reason, bool keep_link) {
  MutexLock lock(data_mu_);
  for (auto& p : pumps_) p->abort(reason);
  for (auto& c : channels_) c->abort(reason);
  if (link_ && !keep_link) link_->close();
}

void Job::retire_data_plane(const std::string& why) {
  // kCancelled: no abort frame reaches the peer (TcpChannel::abort), which recovers as this end does.
  const Error reason{Errc::kCancelled, "post-copy recovery: " + why};
  std::vector<std::unique_ptr<session::ChannelPump>> pumps;
  std::vector<std::unique_ptr<transport::Channel>> channels;
  std::unique_ptr<session::ControlLink> link;
  {
    MutexLock lock(data_mu_);
    for (auto& p : pumps_) p->abort(reason, /*reset=*/true);
    for (auto& c : channels_) c->abort(reason);
    for (auto& p : pumps_) p->wait(std::chrono::seconds(5));
  }
  // The pumps have stopped: their final counts go on their rails, which then list none of them (a
  // refresh from here on sees the same counts, or none once they are dropped below).
  refresh_data_counters(/*retiring=*/true);
  {
    MutexLock lock(data_mu_);
    for (auto& p : pumps_) {
      retired_counts_[0] += p->bytes_up();
      retired_counts_[1] += p->bytes_down();
      retired_counts_[2] += p->chunks_up();
      retired_counts_[3] += p->chunks_down();
    }
    pumps.swap(pumps_);
    channels.swap(channels_);
    failover_channels_.clear();
    link = std::move(link_);
  }
  if (link) link->close();
  pumps.clear();  // before the channels they pump
  channels.clear();
}

void Job::adopt_channel(std::unique_ptr<transport::Channel> channel, std::unique_ptr<session::ChannelPump> pump,
                        std::unique_ptr<session::ControlLink> link) {
  MutexLock lock(data_mu_);
  channels_.push_back(std::move(channel));
  pumps_.push_back(std::move(pump));
  if (link) link_ = std::move(link);  // a recovery's further channels come without one
}

const char* Job::failure_of(Errc code) {
  switch (code) {
    case Errc::kTimeout: return "timeout";
    case Errc::kUnavailable: return "peer_lost";
    case Errc::kQemu: return "qemu";
    case Errc::kProtocol: return "protocol";
    case Errc::kIo: return "io";
    default: return "other";
  }
}

void Job::finish(Phase phase, const std::string& reason, const char* failure) {
  // The migration's post-copy record goes before its end shows: nothing restores an ended one.
  if (record_) {
    remove_postcopy_record(ctx_.config.state_dir, spec_.id);
    LOG_INFO("migration") << log_prefix() << " post-copy record " << postcopy_record_path(ctx_.config.state_dir, spec_.id)
                          << " removed: the migration ends";
    record_.reset();
  }
  refresh_data_counters();
  std::string result;
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - created_).count();
  {
    MutexLock lock(status_mu_);
    if (metrics_finished_) return;
    metrics_finished_ = true;
    status_.phase = phase;
    if (!reason.empty()) status_.reason = reason;
    status_.finished_at_ms = wall_clock_ms();
    if (phase == Phase::kFailed) status_.failure_kind = failure ? failure : "other";
    if (!status_.total_time_ms && status_.started_at_ms) {
      status_.total_time_ms = status_.finished_at_ms - status_.started_at_ms;
    }
    result = phase == Phase::kSucceeded ? "succeeded" : phase == Phase::kCancelled ? "cancelled" : "failed";
  }
  status_cv_.notify_all();
  ctx_.metrics.migration_finished(role_name(spec_.role), result, seconds);
  ctx_.metrics.migration_ended(gauges_, phase_name(phase), status().transport);
  if (phase == Phase::kFailed) ctx_.metrics.migration_failed(role_name(spec_.role), failure ? failure : "other");
  gauges_.throughput->Set(0);
  if (phase == Phase::kSucceeded) {
    LOG_INFO("migration") << log_prefix() << " phase=" << phase_name(phase);
  } else {
    LOG_WARN("migration") << log_prefix() << " phase=" << phase_name(phase) << " reason=\"" << reason << "\"";
  }
  for (const auto& r : status().rails) {
    LOG_INFO("migration") << log_prefix() << " rail " << r.rail << " (" << r.device << "): sent " << r.bytes_sent
                          << " B, received " << r.bytes_received << " B";
  }
  if (qmp_) qmp_->close();  // free the monitor for other clients
}

void Job::save_record(const std::string& state) {
  const uint32_t seconds = ctx_.config.migration.postcopy_recovery_seconds;
  if (!record_ || seconds == 0) return;
  record_->state = state;
  record_->recoveries = status().post_copy.recoveries;
  record_->recovery_seconds = seconds;
  record_->alive_at_ms = wall_clock_ms();
  record_saved_ = std::chrono::steady_clock::now();
  if (auto st = write_postcopy_record(ctx_.config.state_dir, *record_); !st) {
    LOG_WARN("migration") << log_prefix() << " " << st.error().message
                          << ": a restart of this agent during post-copy would not resume the migration";
  }
}

MigrationSpec Job::spec_from_record(const PostcopyRecord& record, Role role) {
  MigrationSpec spec;
  spec.role = role;
  spec.id = record.id;
  spec.vm = record.vm;
  spec.qmp_socket = record.qmp_socket;
  spec.chunk_size = record.chunk_size;
  spec.ring_depth = record.ring_depth;
  spec.transport = TransportKind::kTcp;  // a recovery's fresh channel runs over TCP
  spec.verify_chunks = record.verify_chunks;
  spec.post_copy.preempt = record.preempt;
  spec.multifd_channels = record.multifd_channels;
  spec.completion_timeout_seconds = record.completion_timeout_seconds;
  spec.no_progress_timeout_seconds = record.no_progress_timeout_seconds;
  return spec;
}

void Job::mark_restored(const PostcopyRecord& record) {
  record_ = record;
  restored_ = true;
  (void)agree_postcopy_switch();  // cancels through the API are refused, as before the restart
  update([&](MigrationStatus& s) {
    s.transport = "tcp";
    s.transport_reason = "post-copy recovery after a restart";
    s.post_copy.switched = true;
    s.post_copy.switched_at_ms = record.switched_at_ms;
    s.post_copy.recoveries = record.recoveries;
    s.post_copy.after_restart = true;
    s.post_copy.preempt = record.preempt;
  });
}

Error Job::restored_why(const std::string& qemu_role, const std::string& next) {
  LOG_WARN("migration") << log_prefix() << " restored from its post-copy record after a restart: " << qemu_role
                        << " QEMU " << qemu_state().first << "; " << next;
  return Error{Errc::kUnavailable, "this agent restarted during post-copy (its record " +
                                       postcopy_record_path(ctx_.config.state_dir, spec_.id) + ")"};
}

void Job::keep_record_alive() {
  if (record_ && std::chrono::steady_clock::now() - record_saved_ >= std::chrono::seconds(5)) save_record(record_->state);
}

Result<std::unique_ptr<transport::TlsStream>> Job::channel_tls(int fd, transport::TlsStream::Role role,
                                                                const transport::ChannelTerms& terms,
                                                                std::chrono::milliseconds timeout) {
  auto stream = transport::TlsStream::handshake(fd, role, terms, timeout);
  if (!stream) ctx_.metrics.transport_error("tcp", "tls");
  return stream;
}

void Job::report_tls(uint32_t index, const transport::TlsStream& tls) {
  const std::string mode = std::string("tls (") + tls.mode() + ")";
  ctx_.metrics.tls_channel(tls.label());
  LOG_INFO("migration") << log_prefix() << " data channel " << index << ": " << mode << " (kTLS send "
                        << (tls.kernel_send() ? "yes" : "no") << ", receive " << (tls.kernel_recv() ? "yes" : "no") << ")";
  update([&](MigrationStatus& s) { s.encryption = index == 0 || s.encryption == mode ? mode : "tls (mixed)"; });
}

void Job::wrap_for_failover(const std::function<session::FailoverChannel::Reconnect(uint32_t)>& reconnect_for) {
  const auto deadline = std::chrono::seconds(ctx_.config.data_plane.failover_deadline_seconds);
  size_t n = 0;
  {
    MutexLock lock(data_mu_);
    for (auto& ch : channels_) {
      const uint32_t index = ch->index();
      auto fc = std::make_unique<session::FailoverChannel>(std::move(ch), spec_.ring_depth, deadline, reconnect_for(index),
                                                           [this](const session::FailoverEvent& ev) { on_failover(ev); });
      failover_channels_.push_back(fc.get());
      ch = std::move(fc);
    }
    n = channels_.size();
  }
  LOG_INFO("migration") << log_prefix() << " failover on: " << n << " channel(s), deadline " << deadline.count() << " s";
  update([&](MigrationStatus& s) { s.failover = true; });  // status_mu_ after data_mu_ is released
}

void Job::on_failover(const session::FailoverEvent& ev) {
  ctx_.metrics.failover(role_name(spec_.role), ev.from.empty() ? "tcp" : ev.from, failover_peer_,
                        session::failover_destination(ev.path));
  if (ev.from == "rdma" || ev.rail) {  // off a rail, onto one (from TCP too: a rail re-dial), or both
    MutexLock lock(status_mu_);
    rail_moves_.emplace_back(ev.index, ev.rail);
  }
  const std::string what = session::failover_words(ev);
  LOG_WARN("migration") << log_prefix() << " failover: " << what;
  update([&](MigrationStatus& s) {
    ++s.failovers;
    s.last_failover = what;
  });
}

void Job::on_control_failover(const std::string& reason, std::chrono::milliseconds took, uint64_t resent) {
  ctx_.metrics.failover(role_name(spec_.role), "tcp", failover_peer_);
  const std::string what = "control connection: " + reason + "; resumed after " + std::to_string(took.count()) +
                           " ms, " + std::to_string(resent) + " message(s) resent";
  LOG_WARN("migration") << log_prefix() << " failover: " << what;
  update([&](MigrationStatus& s) {
    ++s.failovers;
    s.last_failover = what;
  });
}

session::FailoverChannel* Job::failover_channel(uint32_t index) const {
  for (auto* fc : failover_channels_) {
    if (fc->index() == index) return fc;
  }
  return nullptr;
}

std::string Job::log_prefix() const {
  return std::string("migration=") + spec_.id + " role=" + role_name(spec_.role) + " vm=" + spec_.vm;
}

Result<std::string> run_state(qemu::QmpClient& qmp) {
  auto st = qmp.execute("query-status", {}, kQmpTimeout);
  if (!st) return st.error();
  if (!st->is_object() || !st->contains("status") || !(*st)["status"].is_string()) {
    return Error{Errc::kProtocol, "query-status: no status"};
  }
  return (*st)["status"].get<std::string>();
}

std::pair<std::string, std::string> Job::qemu_state() {
  if (!qmp_->connected()) return {"monitor lost", ""};
  std::string migration = "unreadable";
  if (auto raw = qmp_->execute("query-migrate", {}, kQmpTimeout)) {
    if (auto info = qemu::parse_migration_info(raw.value())) migration = info->status;
  }
  auto run = run_state(*qmp_);
  return {describe_qemu(migration, run ? run.value() : "unreadable"), migration};
}

}  // namespace rdmig::migration
