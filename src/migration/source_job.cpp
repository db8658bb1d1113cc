#include "migration/source_job.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <tuple>

#include "common/json_limits.h"
#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "migration/postcopy_recovery.h"
#include "session/transport_choice.h"
#include "transport/channel_proof.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/wire.h"
#include "session/protocol.h"
#include "session/resume.h"

namespace rdmig::migration {

// The session layer (src/session) this file stands on.
using session::ChannelPump;
using session::kMultifdDrainLimit;

using nlohmann::json;
using namespace std::chrono_literals;

namespace {
constexpr auto kVerdictTimeout = 120s;
// Once the source QEMU's monitor is lost while the job completes, the wait for the target's
// verdict is bounded by this: nothing on the source can be resumed or checked any more.
constexpr auto kVerdictAfterMonitorLost = 15s;
// A channel ended by the target's abort: how long the source waits for the target's reason on the
// control link (the target checks its QEMU for up to 10 s before it sends its verdict).
constexpr auto kTargetReasonWait = 15s;
constexpr uint64_t kUnlimitedBandwidth = uint64_t{1} << 40;  // 1 TiB/s: QEMU has no "off"

}  // namespace

Result<std::unique_ptr<SourceJob>> SourceJob::create(MigrationSpec spec, JobContext ctx) {
  auto qmp = qemu::QmpClient::connect(spec.qmp_socket, 5s);
  if (!qmp) return qmp_check_failed(spec.qmp_socket, "its greeting", qmp.error());
  auto state = run_state(*qmp.value());
  if (!state) return qmp_check_failed(spec.qmp_socket, "query-status", state.error());
  if (state.value() != "running" && state.value() != "paused") {
    return Error{Errc::kFailedPrecondition, "qmpSocket: QEMU at '" + spec.qmp_socket + "' is '" +
                                                state.value() + "', not running or paused: nothing to migrate"};
  }
  auto mig = qmp.value()->execute("query-migrate", {}, kQmpTimeout);
  if (!mig) return qmp_check_failed(spec.qmp_socket, "query-migrate", mig.error());
  auto info = qemu::parse_migration_info(mig.value());
  if (!info) return qmp_check_failed(spec.qmp_socket, "query-migrate", info.error());
  if (info->status != "none" && !qemu::migration_status_terminal(info->status)) {
    return Error{Errc::kFailedPrecondition,
                 "qmpSocket: QEMU already has a migration in state '" + info->status + "'"};
  }
  if (spec.post_copy.mode != PostCopyMode::kNever && (spec.multifd_channels > 0 || spec.post_copy.preempt)) {
    auto v = qemu_version(*qmp.value());
    if (!v) return qmp_check_failed(spec.qmp_socket, "query-version", v.error());
    // QEMU allows post-copy together with multifd from 10.1 on: 10.0 refuses the pair, and 7.2
    // accepts it although its post-copy does not know multifd's channels.
    if (spec.multifd_channels > 0 && !v->at_least(10, 1)) {
      return Error{Errc::kFailedPrecondition,
                   "postCopy: with multifdChannels it needs QEMU 10.1 or later on both nodes; the source QEMU is " +
                       v->text() + " (migrate with multifdChannels 0, or postCopy 'never')"};
    }
    // postcopy-preempt's connection opens at the switch, after the main one, from QEMU 8.0 on; a
    // 7.x QEMU opens it at once, racing the main one to the target (rdmig keeps QEMU's order).
    if (spec.post_copy.preempt && !v->at_least(8, 0)) {
      return Error{Errc::kFailedPrecondition, "postCopyPreempt: needs QEMU 8.0 or later on both nodes; the source QEMU is " +
                                                  v->text() + " (migrate with postCopyPreempt false)"};
    }
  }
  const bool running = state.value() == "running";
  return std::unique_ptr<SourceJob>(
      new SourceJob(std::move(spec), ctx, std::move(qmp.value()), running));
}

SourceJob::SourceJob(MigrationSpec spec, JobContext ctx, std::unique_ptr<qemu::QmpClient> qmp,
                     bool was_running)
    : Job(std::move(spec), ctx), was_running_(was_running) {
  qmp_ = std::move(qmp);
  qemu_pid_ = qemu_pid_of(*qmp_);
  socket_path_ = ctx_.config.state_dir + "/" + spec_.id + ".src.sock";
  update([&](MigrationStatus& s) {
    s.peer = net::format_endpoint(spec_.target.host, spec_.target.port);
    s.post_copy.mode = post_copy_mode_name(spec_.post_copy.mode);
    s.post_copy.preempt = spec_.post_copy.preempt;
  });
}

SourceJob::~SourceJob() {
  stop_worker();
  stop_accepting();
}

void SourceJob::stop_accepting() {
  accepting_ = false;
  if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
}

void SourceJob::release_own() {
  stop_accepting();
  listener_.reset();
}

void SourceJob::start() {
  start_worker([this] { run(); });
}

Status SourceJob::configure_qemu() {
  const bool multifd = spec_.multifd_channels > 0;
  json caps = json::array({json{{"capability", "events"}, {"state", true}},
                           json{{"capability", "multifd"}, {"state", multifd}}});
  if (spec_.post_copy.mode != PostCopyMode::kNever) {
    // postcopy-preempt opens one more connection at the switch, for the pages the target's vCPUs
    // wait on; carried as the last channel when asked (postCopyPreempt), else off: the page
    // requests' answers then queue behind the background copy on the main channel (docs/api.md).
    caps.push_back(json{{"capability", "postcopy-ram"}, {"state", true}});
    caps.push_back(json{{"capability", "postcopy-preempt"}, {"state", spec_.post_copy.preempt}});
  }
  auto r = qmp_->execute("migrate-set-capabilities", json{{"capabilities", caps}}, kQmpTimeout);
  if (!r) {
    if (spec_.post_copy.mode != PostCopyMode::kNever) return r.error().with_context("postCopy: source QEMU");
    return r.error();
  }
  json params{{"downtime-limit", spec_.max_downtime_ms},
              {"max-bandwidth", spec_.max_bandwidth_bytes_per_second ? spec_.max_bandwidth_bytes_per_second
                                                                     : kUnlimitedBandwidth}};
  if (multifd) params["multifd-channels"] = spec_.multifd_channels;
  r = qmp_->execute("migrate-set-parameters", params, kQmpTimeout);
  if (!r) return r.error();
  return ok_status();
}

void SourceJob::accept_loop() {
  for (uint32_t i = 0; i < spec_.channels() && accepting_.load(); ) {
    auto fd = net::accept_for(listener_.get(), 200ms);
    if (!fd) {
      if (fd.error().code == Errc::kTimeout) continue;
      if (accepting_.load()) {
        LOG_WARN("migration") << log_prefix() << " accept: " << fd.error().message;
      }
      return;
    }
    if (auto peer = check_qemu_peer(fd->get(), "migration socket " + socket_path_); !peer) {
      // Not our QEMU: refuse this connection, keep waiting for QEMU's own.
      LOG_WARN("migration") << log_prefix() << " refused a connection: " << peer.error().message;
      ctx_.metrics.transport_error(transport_, "foreign_peer");
      continue;
    }
    MutexLock lock(data_mu_);
    auto pump = std::make_unique<ChannelPump>(*channels_[i], std::move(fd.value()));
    // Connection 0 is QEMU's main channel: a failure reaches QEMU there; its multifd
    // connections drain (ChannelPump::drain_on_failure) until QEMU's cleanup closes them.
    if (i > 0) pump->drain_on_failure(kMultifdDrainLimit);
    if (spec_.verify_chunks) pump->verify_chunks();
    pump->start();
    pumps_.push_back(std::move(pump));
    LOG_DEBUG("migration") << log_prefix() << " QEMU connection " << i << " accepted";
    ++i;
  }
}

Status SourceJob::start_migration() {
  auto listener = net::unix_listen(socket_path_);
  if (!listener) return listener.error();
  ::chmod(socket_path_.c_str(), 0600);
  listener_ = std::move(listener.value());
  accepting_ = true;
  acceptor_ = std::thread([this] { accept_loop(); });
  events_before_migrate_ = qmp_->last_event_seq();
  auto r = qmp_->execute("migrate", json{{"uri", "unix:" + socket_path_}}, kQmpTimeout);
  if (!r) return r.error();
  return ok_status();
}

void SourceJob::apply_progress(const qemu::MigrationInfo& info) {
  refresh_data_counters();
  const double dirty = static_cast<double>(info.dirty_pages_rate) * static_cast<double>(info.page_size);
  passes_ = pass_counter_.observe(info);
  update([&](MigrationStatus& s) {
    s.progress.qemu_status = info.status;
    s.progress.transferred_bytes = info.transferred_bytes;
    s.progress.remaining_bytes = info.remaining_bytes;
    s.progress.total_bytes = info.total_bytes;
    s.progress.throughput_bytes_per_second = info.throughput_bytes_per_second;
    s.progress.dirty_rate_bytes_per_second = dirty;
    s.progress.passes = passes_;
  });
  gauges_.throughput->Set(info.throughput_bytes_per_second);
  gauges_.transferred->Set(static_cast<double>(info.transferred_bytes));
  gauges_.remaining->Set(static_cast<double>(info.remaining_bytes));
  gauges_.total->Set(static_cast<double>(info.total_bytes));
  gauges_.dirty_rate->Set(dirty);
}

Result<qemu::MigrationInfo> SourceJob::monitor() {
  if (!monitor_started_) monitor_started_ = std::chrono::steady_clock::now();
  const auto started = *monitor_started_;
  const auto no_progress = std::chrono::seconds(spec_.no_progress_timeout_seconds);
  auto last_progress = started;
  uint64_t last_transferred = 0;
  const auto interval = std::chrono::milliseconds(ctx_.config.migration.progress_interval_ms);
  for (;;) {
    auto raw = qmp_->execute("query-migrate", {}, kQmpTimeout);
    if (!raw) return raw.error().with_context("source QEMU");
    auto info = qemu::parse_migration_info(raw.value());
    if (!info) return info.error();
    apply_progress(info.value());
    if (auto st = maybe_switch_to_postcopy(info.value(), std::chrono::steady_clock::now() - started); !st) {
      return st.error();
    }
    if (postcopy_switched_) keep_record_alive();
    if (info->status == "completed") {
      // QEMU 7.2 sets "completed" (and sends the event) just before it computes total-time
      // and downtime: ask again until they are filled in.
      for (int i = 0; i < 100 && info->total_time_ms <= 0; ++i) {
        std::this_thread::sleep_for(10ms);
        auto again = qmp_->execute("query-migrate", {}, kQmpTimeout);
        if (!again) break;
        auto parsed = qemu::parse_migration_info(again.value());
        if (!parsed) break;
        info = std::move(parsed);
      }
      record_postcopy_end(info.value());
      return info;
    }
    // A channel that failed in the data plane (a rail cut: a failed work completion) shuts its
    // QEMU connection down, and QEMU then fails the migration too ("Unable to write to socket"):
    // both are often seen in the same poll. The channel's error is the cause and names the rail
    // and channel, so it comes first, QEMU's after it. A channel that only carries the target's
    // abort is no cause: the target says why on the control link (the rail and channel that
    // failed there), so that is what the migration's reason names.
    auto failed = channel_failure();
    if (failed && failed->peer_abort) {
      if (auto why = target_reason(kTargetReasonWait)) return *why;
    }
    if (info->status == "failed") return qemu_failure("source QEMU: migration failed", info->error_desc, failed);
    if (info->status == "cancelled") return Error{Errc::kCancelled, "source QEMU cancelled the migration"};
    // After the switch the target runs the VM: a cancel (the agent shutting down) cannot bring
    // it back here, so post-copy runs to its end (docs/api.md).
    if (cancel_requested() && !postcopy_switched_) return Error{Errc::kCancelled, cancel_reason()};
    if (failed) return data_plane_error(failed->error, failed->channel);
    if (postcopy_switched_ && info->status == kPostcopyPaused) {
      return Error{Errc::kUnavailable, "the source QEMU paused post-copy (postcopy-paused): its stream to the target broke"};
    }
    const auto now = std::chrono::steady_clock::now();
    if (info->transferred_bytes > last_transferred) {
      last_transferred = info->transferred_bytes;
      last_progress = now;
    } else if (now - last_progress > no_progress) {
      return Error{Errc::kTimeout, "no progress for " + std::to_string(spec_.no_progress_timeout_seconds) +
                                       " s (noProgressTimeoutSeconds)"};
    }
    // Time spent recovering a lost link in post-copy does not count against completion.
    if (now > started + std::chrono::seconds(spec_.completion_timeout_seconds) + paused_total_) {
      return Error{Errc::kTimeout, "not completed within " + std::to_string(spec_.completion_timeout_seconds) +
                                       " s (completionTimeoutSeconds)"};
    }
    // Wait one interval, or less when QEMU reports the end of the migration.
    qmp_->wait_event(
        [](const qemu::QmpEvent& e) {
          return e.name == "MIGRATION" && qemu::migration_status_terminal(e.data.value("status", ""));
        },
        events_before_migrate_, interval);
    auto m = link_->next(0ms);
    if (!m) return m.error().with_context("target agent");
    if (m->has_value()) {
      if (auto e = take_target_message(**m)) return *e;
    }
  }
}

std::optional<Error> SourceJob::take_target_message(const json& msg) {
  const auto type = session::kind_of(msg);
  if (type == session::MessageKind::kAbort) {
    target_decided_ = true;
    return Error{Errc::kUnavailable, "target agent aborted: " + msg.value("reason", std::string("?"))};
  }
  if (type == session::MessageKind::kResult) {
    // Kept for complete(): the target can have the VM running before our next
    // query-migrate sees "completed", or fail just as the source completes.
    verdict_ = msg;
    if (!msg.value("ok", false)) {
      target_decided_ = true;
      return Error{Errc::kUnavailable, "target failed: " + msg.value("reason", std::string("?"))};
    }
  }
  return std::nullopt;
}

void SourceJob::complete(const qemu::MigrationInfo& info, const std::string& unsure) {
  set_phase(Phase::kCompleting);
  update([&](MigrationStatus& s) {
    if (info.downtime_ms >= 0) s.downtime_ms = info.downtime_ms;
    if (info.total_time_ms >= 0) s.total_time_ms = info.total_time_ms;
    if (info.setup_time_ms >= 0) s.setup_time_ms = info.setup_time_ms;
  });
  if (info.downtime_ms >= 0) {
    ctx_.metrics.set_downtime(spec_.vm, transport_, static_cast<double>(info.downtime_ms) / 1000.0);
  }
  // The source has handed the VM over. From here only the target's verdict decides: resuming
  // the source while the target might run the VM would run it twice. Without the source's
  // monitor (QEMU exited or closed QMP) the wait is short: no VM can be resumed here anyway.
  Result<json> verdict = verdict_ ? Result<json>(*verdict_) : wait_for_verdict();
  {
    MutexLock lock(data_mu_);
    for (auto& p : pumps_) p->wait(5s);
  }
  refresh_data_counters();
  const std::string handed = unsure.empty() ? "source QEMU completed" : unsure;
  // Without its monitor there is no paused source VM to speak of: QEMU exited or dropped QMP.
  // Nothing can be resumed here either way; the operator must look at the target.
  const auto source_gone = [&](const std::string& what) {
    const int pid = qmp_->peer_pid();
    const std::string process =
        pid <= 0 ? std::string("its process exited or closed QMP")
        : ::kill(pid, 0) == 0 || errno == EPERM
            ? "its process " + std::to_string(pid) + " still runs without a monitor, state unknown (after a "
                                                     "completed migration QEMU stays paused, postmigrate)"
            : "its process " + std::to_string(pid) + " has exited";
    finish(Phase::kFailed,
           what + "; the source QEMU's monitor is gone (" + process + "), so no VM can be resumed here: check "
                  "whether the target runs the VM",
           "qemu");
  };
  if (!verdict && !qmp_->connected()) {
    source_gone(handed + " but the target agent did not confirm (" + verdict.error().message + ")");
    return;
  }
  if (!verdict) {
    finish(Phase::kFailed,
           handed + " but the target agent did not confirm (" + verdict.error().message +
               "); the source VM is left paused (postmigrate) so the VM cannot run twice: check the target "
               "and 'cont' the source only if the target does not run the VM",
           "vm_paused_on_source");
    return;
  }
  const auto& v = verdict.value();
  if (!v.value("ok", false)) {
    const std::string why = v.value("reason", std::string("?"));
    if (!v.value("safeToResumeSource", false) && !qmp_->connected()) {
      source_gone("target failed after the source may have handed the VM over (" + why + ")");
      return;
    }
    if (!v.value("safeToResumeSource", false)) {
      finish(Phase::kFailed, "target failed after the source handed the VM over (" + why + ")" +
                                 (unsure.empty() ? std::string() : " [" + unsure + "]") +
                                 " and cannot rule out that it started the VM; the source VM is left paused "
                                 "(postmigrate) so the VM cannot run twice: check the target and 'cont' the source "
                                 "only if the target does not run the VM",
             "vm_paused_on_source");
      return;
    }
    std::string resumed = "source VM left paused";
    if (was_running_) {
      auto c = qmp_->execute("cont", {}, kQmpTimeout);
      resumed = c ? "VM resumed on the source" : "could not resume the source: " + c.error().message;
    }
    finish(Phase::kFailed, "target failed to take the VM: " + why + "; " + resumed, "target_failed");
    return;
  }
  const std::string state = v.value("state", std::string("running"));
  std::optional<int64_t> switchover;
  const int64_t resume_us = v.value("resumeTimestampUs", int64_t{0});
  if (resume_us > 0) {
    for (const auto& e : qmp_->events()) {
      if (e.seq > events_before_migrate_ && e.name == "STOP") {
        switchover = switchover_ms(e.timestamp_us, resume_us, clock_);
        if (!switchover) {
          LOG_WARN("migration") << log_prefix() << " switchover not measured: "
                                << (clock_ ? "the target's RESUME precedes the source's STOP beyond the clock "
                                             "estimate's uncertainty"
                                           : "no clock offset estimate from the target agent");
        }
        break;
      }
    }
  }
  if (switchover) ctx_.metrics.set_switchover(spec_.vm, transport_, static_cast<double>(*switchover) / 1000.0);
  update([&](MigrationStatus& s) {
    if (const auto b = v.find("postCopyBlocktimeMs"); b != v.end() && b->is_number_integer()) {
      s.post_copy.blocktime_ms = b->get<int64_t>();
    }
    // The target's figures, bounded (kMaxPageLatencyUs): an older target sends none.
    const auto latency = [&](const char* key, std::optional<double>& out) {
      if (const auto l = v.find(key); l != v.end() && page_latency_us_in_bounds(*l)) {
        out = l->get<double>();
      }
    };
    latency("postCopyPageLatencyUs", s.post_copy.page_latency_us);
    latency("postCopyPageLatencyP50Us", s.post_copy.page_latency_p50_us);
    latency("postCopyPageLatencyP99Us", s.post_copy.page_latency_p99_us);
    s.target_state = state;
    s.switchover_ms = switchover;
    s.progress.remaining_bytes = 0;
  });
  (void)link_->send(session::message(session::MessageKind::kGoodbye));
  if (!unsure.empty()) {
    LOG_WARN("migration") << log_prefix() << " " << unsure << "; the target confirmed it runs the VM";
  }
  finish(Phase::kSucceeded, "");
}

std::optional<Error> SourceJob::target_reason(std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    auto m = link_->next(std::min<std::chrono::milliseconds>(left, 250ms));
    if (!m) return std::nullopt;  // the link is gone: the channel's error is all there is
    if (!m->has_value()) continue;
    const auto& msg = **m;
    if (auto e = take_target_message(msg)) return e;
    if (session::is(msg, session::MessageKind::kResult)) {
      link_->unread(msg);  // the target has the VM: monitor() and complete() take it from here
      return std::nullopt;
    }
  }
}

Result<json> SourceJob::wait_for_verdict() {
  const auto start = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> lost_at;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (!lost_at && !qmp_->connected()) lost_at = now;
    if (lost_at && now - *lost_at >= kVerdictAfterMonitorLost) {
      return Error{Errc::kTimeout, "no 'result' from the peer agent within " +
                                       std::to_string(kVerdictAfterMonitorLost.count()) +
                                       " s of losing the source QEMU's monitor"};
    }
    if (now - start >= kVerdictTimeout) {
      return Error{Errc::kTimeout, "no 'result' from the peer agent within " +
                                       std::to_string(kVerdictTimeout.count()) + " s"};
    }
    auto v = link_->expect(session::to_string(session::MessageKind::kResult), 500ms);
    if (v || v.error().code != Errc::kTimeout) return v;
  }
}

void SourceJob::fail_and_protect_vm(const Error& error, bool cancelled) {
  LOG_WARN("migration") << log_prefix() << " stopping: " << error.message;
  std::string notes;
  if (postcopy_switched_) {
    const auto fell_through = postcopy_fell_through();
    if (!fell_through) {
      fail_in_postcopy(error);
      return;
    }
    // QEMU never switched, or undid the switch before the target QEMU loaded it: a pre-copy failure.
    LOG_WARN("migration") << log_prefix() << " the switch to post-copy did not take effect (source QEMU "
                          << *fell_through << "): the VM stays here";
    notes = "; the switch to post-copy had not taken effect (the source QEMU: " + *fell_through +
            "): the target QEMU never ran the VM";
    update([](MigrationStatus& s) { s.post_copy.switched = false; });
  }
  auto raw = qmp_->execute("query-migrate", {}, kQmpTimeout);
  if (!raw) {
    // QEMU's monitor can stall during the final stop-and-copy. If the run state says QEMU is in
    // or past it (or cannot be read), the VM may already be the target's: resuming the source
    // without the target's verdict could run it twice.
    auto state = qmp_->connected() ? run_state(*qmp_) : Result<std::string>(Error{Errc::kUnavailable, "monitor gone"});
    if (!state || state.value() == "postmigrate" || state.value() == "finish-migrate") {
      const std::string why = "source QEMU's query-migrate failed (" + raw.error().message + ") while its run state was " +
                              (state ? "'" + state.value() + "'" : "unreadable (" + state.error().message + ")") +
                              ", so it may have handed the VM over";
      LOG_WARN("migration") << log_prefix() << " " << why << ": waiting for the target's verdict";
      complete(qemu::MigrationInfo{}, why);
      return;
    }
  }
  if (raw) {
    auto info = qemu::parse_migration_info(raw.value());
    if (info && info->status == "completed") {
      // Too late to cancel: QEMU handed the VM over; the target decides.
      complete(info.value());
      return;
    }
    if (info && info->status != "none" && !qemu::migration_status_terminal(info->status)) {
      auto c = qmp_->execute("migrate_cancel", {}, kQmpTimeout);
      if (!c) notes += "; migrate_cancel failed: " + c.error().message;
      // Wait until QEMU has left the migration (it resumes the guest itself when it stopped it).
      const auto deadline = std::chrono::steady_clock::now() + 30s;
      while (std::chrono::steady_clock::now() < deadline) {
        auto q = qmp_->execute("query-migrate", {}, kQmpTimeout);
        if (!q) break;
        auto qi = qemu::parse_migration_info(q.value());
        if (!qi || qemu::migration_status_terminal(qi->status)) {
          if (qi && qi->status == "completed") {
            complete(qi.value());
            return;
          }
          break;
        }
        std::this_thread::sleep_for(50ms);
      }
    }
  }
  if (link_) (void)link_->send(session::message(session::MessageKind::kAbort, json{{"reason", error.message}}));
  abort_data_plane(error);
  if (was_running_ && qmp_->connected()) {
    auto state = run_state(*qmp_);
    if (state && state.value() == "postmigrate") {
      // QEMU finished sending after all: the target may run the VM; never resume here.
      finish(Phase::kFailed, error.message + notes +
                                 "; the source VM is left paused (postmigrate): QEMU handed it over as the "
                                 "migration failed, so check the target and 'cont' the source only if the "
                                 "target does not run the VM",
             "vm_paused_on_source");
      return;
    }
    if (state && state.value() == "paused") {
      auto c = qmp_->execute("cont", {}, kQmpTimeout);
      notes += c ? "; resumed the source VM" : "; could not resume the source VM: " + c.error().message;
    }
    if (state) notes += "; source VM is " + (state.value() == "running" ? std::string("running") : state.value());
  } else if (!qmp_->connected()) {
    notes += "; source QEMU's monitor is gone";
  }
  finish(cancelled ? Phase::kCancelled : Phase::kFailed, error.message + notes, failure_of(error.code));
}

void SourceJob::run() {
  set_phase(Phase::kConnecting);
  auto st = connect_data_plane();
  if (!st) {
    if (link_) (void)link_->send(session::message(session::MessageKind::kAbort, json{{"reason", st.error().message}}));
    abort_data_plane(st.error());
    // QEMU has not been touched: nothing to undo.
    finish(cancel_requested() ? Phase::kCancelled : Phase::kFailed, st.error().message, failure_of(st.error().code));
    return;
  }
  if (cancel_requested()) {
    fail_and_protect_vm(Error{Errc::kCancelled, cancel_reason()}, true);
    return;
  }
  st = configure_qemu();
  if (st) st = start_migration();
  if (!st) {
    fail_and_protect_vm(st.error().with_context("starting the migration"), false);
  } else {
    set_phase(Phase::kMigrating);
    monitor_to_end();
  }
  stop_accepting();
  ::unlink(socket_path_.c_str());
  abort_data_plane(Error{Errc::kCancelled, "migration finished"});
}

void SourceJob::monitor_to_end() {
  auto info = monitor();
  for (;;) {
    if (info) {
      complete(info.value());
      break;
    }
    // Past the switch a lost link is recovered over a fresh channel where it can be.
    const auto r = postcopy_switched_ ? recover_postcopy(info.error()) : Recovery::kNotRecoverable;
    if (r == Recovery::kResumed) {
      info = monitor();
      continue;
    }
    if (r == Recovery::kNotRecoverable) {
      fail_and_protect_vm(info.error(), info.error().code == Errc::kCancelled && cancel_requested());
    }
    break;
  }
}

}  // namespace rdmig::migration
