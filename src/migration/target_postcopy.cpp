// TargetJob's post-copy: its figures, and its half of a recovery over fresh connections (docs/api.md
// "Post-copy recovery"). The rest of the job: target_job.cpp.
#include "migration/target_job.h"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

#include "common/log.h"
#include "common/net.h"
#include "migration/postcopy_recovery.h"
#include "session/protocol.h"
#include "transport/tcp/tcp_channel.h"

namespace rdmig::migration {

// The session layer (src/session) this file stands on.
using session::ChannelPump;
using session::ControlLink;
using session::kHandshakeTimeout;
using session::wall_clock_ms;

using nlohmann::json;
using namespace std::chrono_literals;

void TargetJob::record_postcopy(const qemu::MigrationInfo& info) {
  // QEMU's own MIGRATION events stamp the switch and the end (one host's clock): a post-copy
  // phase shorter than one poll is seen too.
  const auto event = [&](const char* status) {
    return qmp_->wait_event([status](const qemu::QmpEvent& e) { return e.name == "MIGRATION" && e.data.value("status", "") == status; },
                            events_before_incoming_, std::chrono::milliseconds(0));
  };
  const auto active = event("postcopy-active");
  const bool switched = active || qemu::migration_status_postcopy(info.status);
  const auto done = info.status == "completed" ? event("completed") : std::nullopt;
  update([&](MigrationStatus& s) {
    if (switched && !s.post_copy.switched) {
      s.post_copy.switched = true;
      s.post_copy.switched_at_ms = active ? active->timestamp_us / 1000 : wall_clock_ms();
    }
    if (active && done && done->timestamp_us >= active->timestamp_us) {
      s.post_copy.phase_ms = (done->timestamp_us - active->timestamp_us) / 1000;
    }
    if (info.postcopy_blocktime_ms >= 0) s.post_copy.blocktime_ms = info.postcopy_blocktime_ms;
    if (info.postcopy_latency_ns >= 0) s.post_copy.page_latency_us = static_cast<double>(info.postcopy_latency_ns) / 1e3;
    if (auto p50 = qemu::latency_dist_quantile_us(info.postcopy_latency_dist, 0.5)) s.post_copy.page_latency_p50_us = p50;
    if (auto p99 = qemu::latency_dist_quantile_us(info.postcopy_latency_dist, 0.99)) s.post_copy.page_latency_p99_us = p99;
  });
}

TargetJob::Recovery TargetJob::recover_postcopy(const Error& why) {
  using namespace std::chrono;
  const uint32_t seconds = ctx_.config.migration.postcopy_recovery_seconds;
  if (seconds == 0 || source_decided_ || !qmp_->connected()) {
    return Recovery::kNotRecoverable;
  }
  const auto seen = qemu_state();
  const std::string state = seen.first;
  if (const auto step = recovery_step(seen.second); step == RecoveryStep::kComplete || step == RecoveryStep::kGiveUp) {
    return Recovery::kNotRecoverable;
  }
  const auto t0 = steady_clock::now();
  const auto deadline = t0 + std::chrono::seconds(seconds);
  const int64_t paused_before = status().post_copy.paused_ms;
  LOG_WARN("migration") << log_prefix() << " post-copy link lost (" << why.message << "): recovering for up to "
                        << seconds << " s (target QEMU " << state << ")";
  set_phase(Phase::kRecovering);
  update([&](MigrationStatus& s) {
    s.post_copy.recovery = "recovering";
    s.post_copy.recovery_reason = why.message;
    s.post_copy.recovery_tries = 0;
    s.post_copy.recovery_last_try.clear();
    s.post_copy.target_qemu = state;
    s.post_copy.source_qemu.clear();
  });
  save_record("recovering");
  retire_data_plane(why.message);
  uint32_t attempt = 0;
  std::string last;
  bool refused = false;
  while (steady_clock::now() < deadline && !refused) {
    std::unique_ptr<ControlLink> link;
    {
      // Waits in slices: the record on disk says between them that this agent still recovers.
      MutexLock lock(conn_mu_);
      const auto slice = std::min(deadline, steady_clock::now() + 2s);
      while (!recover_control_fd_.valid() && steady_clock::now() < slice) lock.wait_for(conn_cv_, 200ms);
      if (recover_control_fd_.valid()) {
        link = std::make_unique<ControlLink>(std::move(recover_control_fd_));
        recover_asked_ = false;
      }
    }
    keep_record_alive();
    if (!link) continue;
    ++attempt;
    update([&](MigrationStatus& s) {
      s.post_copy.recovery_tries = attempt;
      s.post_copy.paused_ms = paused_before + duration_cast<milliseconds>(steady_clock::now() - t0).count();
    });
    auto st = try_recovery(std::move(link), attempt, deadline);
    if (st) {
      const auto took = steady_clock::now() - t0;
      paused_total_ += took;
      const auto took_ms = duration_cast<milliseconds>(took).count();
      LOG_WARN("migration") << log_prefix() << " post-copy recovered after " << took_ms << " ms (try " << attempt
                            << "): migrate-recover over a fresh channel";
      const std::string after = qemu_state().first;
      update([&](MigrationStatus& s) {
        s.post_copy.recovery = "recovered";
        ++s.post_copy.recoveries;
        s.post_copy.paused_ms = paused_before + took_ms;
        s.post_copy.target_qemu = after;
      });
      save_record("postcopy");
      set_phase(Phase::kMigrating);
      return Recovery::kResumed;
    }
    last = st.error().message;
    refused = st.error().code == Errc::kPermissionDenied;
    LOG_INFO("migration") << log_prefix() << " post-copy recovery try " << attempt << ": " << last;
    update([&](MigrationStatus& s) { s.post_copy.recovery_last_try = last; });
    retire_data_plane("recovery try " + std::to_string(attempt) + " failed");
  }
  {
    MutexLock lock(conn_mu_);
    recovery_open_ = false;  // later recovery connections are refused at once
  }
  const std::string now_state = qemu_state().first;
  update([&](MigrationStatus& s) {
    s.post_copy.recovery = "failed";
    s.post_copy.target_qemu = now_state;
    s.post_copy.paused_ms = paused_before + duration_cast<milliseconds>(steady_clock::now() - t0).count();
  });
  finish(Phase::kFailed,
         stuck_postcopy_reason(StuckPostcopy{Role::kTarget, why.message, seconds, attempt,
                                             last.empty() ? "the source agent never reached this agent" : last,
                                             now_state, ""}),
         "postcopy_split");
  return Recovery::kFinished;
}

PostcopyRecord TargetJob::make_record() {
  PostcopyRecord r;
  r.id = spec_.id;
  r.role = Role::kTarget;
  r.vm = spec_.vm;
  r.qmp_socket = spec_.qmp_socket;
  {
    MutexLock lock(conn_mu_);
    r.peer = source_address_;
    r.session = session_;
    r.channel_key = channel_key_;
    r.verify_chunks = verify_chunks_;
    r.preempt = spec_.post_copy.preempt;
    r.multifd_channels = spec_.multifd_channels;
  }
  r.chunk_size = spec_.chunk_size;
  r.ring_depth = spec_.ring_depth;
  r.post_copy_mode = "requested";
  r.completion_timeout_seconds = spec_.completion_timeout_seconds;
  r.no_progress_timeout_seconds = spec_.no_progress_timeout_seconds;
  r.switched_at_ms = status().post_copy.switched_at_ms;
  return r;
}

Result<std::unique_ptr<TargetJob>> TargetJob::restore(const PostcopyRecord& record, JobContext ctx) {
  MigrationSpec spec = spec_from_record(record, Role::kTarget);
  auto qmp = qemu::QmpClient::connect(spec.qmp_socket, 5s);
  if (!qmp) return qmp_check_failed(spec.qmp_socket, "its greeting", qmp.error());
  std::unique_ptr<TargetJob> owned(new TargetJob(std::move(spec), ctx, std::move(qmp.value())));
  TargetJob* job = owned.get();
  {
    MutexLock lock(job->conn_mu_);
    // The session as before the restart: only a source that proves its channel key is admitted,
    // and only for a recovery (recovery_open_, hello.recover).
    job->token_used_ = true;
    job->session_ = record.session;
    job->channel_key_ = record.channel_key;
    job->transport_ = "tcp";
    job->transport_reason_ = "post-copy recovery after a restart";
    job->verify_chunks_ = record.verify_chunks;
    job->source_address_ = record.peer;
    job->recovery_open_ = true;
  }
  job->post_copy_ = true;
  job->incoming_started_ = true;
  job->mark_restored(record);
  job->update([&](MigrationStatus& s) {
    s.peer = record.peer;
    s.post_copy.mode = "requested";
  });
  return owned;
}

void TargetJob::start_restored() {
  start_worker([this] { run_restored(); });
}

void TargetJob::run_restored() {
  const Error why = restored_why("target", "waiting for the source agent's recovery");
  const auto r = recover_postcopy(why);
  if (r == Recovery::kResumed) {
    monitor_to_end();
    return;
  }
  if (r == Recovery::kNotRecoverable) {
    {
      MutexLock lock(conn_mu_);
      recovery_open_ = false;
    }
    finish(Phase::kFailed, restart_not_recoverable_reason(Role::kTarget, qemu_state().first), "postcopy_split");
  }
}

Status TargetJob::try_recovery(std::unique_ptr<ControlLink> link, uint32_t attempt,
                               std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  const auto left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(1000),
                               duration_cast<milliseconds>(kHandshakeTimeout));
  auto recover = link->expect(session::to_string(session::MessageKind::kRecover), left);
  if (!recover) return recover.error().with_context("waiting for the source's recover");
  // This QEMU must be postcopy-paused for migrate-recover: it pauses once its stream breaks.
  std::string state, status;
  std::tie(state, status) = qemu_state();
  for (const auto until = steady_clock::now() + 10s;
       recovery_step(status) == RecoveryStep::kWait && steady_clock::now() < until;) {
    std::this_thread::sleep_for(100ms);
    std::tie(state, status) = qemu_state();
  }
  if (recovery_step(status) != RecoveryStep::kResume) {
    const std::string why = "the target QEMU cannot be recovered: " + state;
    (void)link->send(session::message(session::MessageKind::kAbort, json{{"reason", why}}));
    return Error{recovery_step(status) == RecoveryStep::kWait ? Errc::kTimeout : Errc::kPermissionDenied, why};
  }
  const std::string path = recovery_socket_path(ctx_.config.state_dir, spec_.id, Role::kTarget, attempt);
  ::unlink(path.c_str());
  auto r = qmp_->execute("migrate-recover", json{{"uri", "unix:" + path}}, kQmpTimeout);
  if (!r) {
    const Error e = r.error().with_context("target QEMU's migrate-recover");
    (void)link->send(session::message(session::MessageKind::kAbort, json{{"reason", e.message}}));
    return e;
  }
  // Channel 0 and, with postcopy-preempt, the preempt channel: the source dials them after its
  // control connection.
  const std::vector<uint32_t> indexes = spec_.recovery_channels();
  std::vector<UniqueFd> fds;
  std::vector<transport::ChannelTerms> terms;
  bool verify_chunks = false;
  {
    MutexLock lock(conn_mu_);
    const auto until = std::min(deadline, steady_clock::now() + left);
    for (;;) {
      size_t here = 0;
      for (const uint32_t i : indexes) {
        const auto it = recover_data_fds_.find(i);
        if (it != recover_data_fds_.end() && it->second.valid()) ++here;
      }
      if (here == indexes.size() || steady_clock::now() >= until) break;
      lock.wait_for(conn_cv_, 100ms);
    }
    for (const uint32_t i : indexes) {
      auto it = recover_data_fds_.find(i);
      if (it == recover_data_fds_.end() || !it->second.valid()) {
        return Error{Errc::kTimeout, "the source agent did not dial the recovery's channel " + std::to_string(i)};
      }
      fds.push_back(std::move(it->second));
      terms.push_back(transport::ChannelTerms{channel_key_, session_, i});
    }
    recover_data_fds_.clear();
    verify_chunks = verify_chunks_;
  }
  // The target QEMU takes the first connection to its recovery socket as the main channel, the
  // next as the preempt one: channel 0 opens it when its first bytes come, the preempt channel at
  // once after it (the target QEMU waits for it before it resumes; the source QEMU sends nothing on
  // it until a page is urgent).
  struct Order {
    std::mutex mu;
    std::condition_variable cv;
    bool main_open = false;
  };
  auto order = std::make_shared<Order>();
  std::vector<std::unique_ptr<transport::TcpChannel>> channels;
  std::vector<std::unique_ptr<ChannelPump>> pumps;
  for (size_t k = 0; k < indexes.size(); ++k) {
    const uint32_t index = indexes[k];
    const std::string what = "recovery channel " + std::to_string(index);
    std::unique_ptr<transport::TlsStream> tls;
    if (ctx_.config.data_plane.tls) {
      auto stream = channel_tls(fds[k].get(), transport::TlsStream::Role::kAcceptor, terms[k], left);
      if (!stream) return stream.error().with_context(what);
      tls = std::move(stream.value());
    }
    channels.push_back(transport::TcpChannel::create(std::move(fds[k]), index, static_cast<uint32_t>(spec_.chunk_size),
                                                     spec_.ring_depth, ctx_.metrics.transport("tcp"), ctx_.config.tcp.splice,
                                                     std::move(tls)));
    const bool main = k == 0;
    auto open = [this, path, what, main, order]() -> Result<UniqueFd> {
      if (!main) {
        std::unique_lock lock(order->mu);
        // Bounded: a try that fails before its main channel opened retires this pump.
        if (!order->cv.wait_for(lock, 30s, [&] { return order->main_open; })) {
          return Error{Errc::kTimeout, what + ": the main channel did not open within 30 s"};
        }
      }
      auto qfd = net::unix_connect(path, 10s);
      if (!qfd) return qfd.error().with_context("connecting the " + what + " to the target QEMU");
      RDMIG_TRY(check_qemu_peer(qfd->get(), what + ": " + path));
      if (main) {
        std::lock_guard lock(order->mu);
        order->main_open = true;
        order->cv.notify_all();
      }
      return qfd;
    };
    auto pump = std::make_unique<ChannelPump>(*channels.back(), std::move(open), /*open_first=*/!main);
    if (verify_chunks) pump->verify_chunks();
    pump->start();
    pumps.push_back(std::move(pump));
  }
  RDMIG_TRY(link->send(session::message(session::MessageKind::kRecoverReady, json{{"attempt", attempt},
                                                                                  {"targetQemu", state}})));
  for (size_t k = 0; k < channels.size(); ++k) {
    adopt_channel(std::move(channels[k]), std::move(pumps[k]), k == 0 ? std::move(link) : nullptr);
  }
  // QEMU leaves postcopy-paused once the source's resumed stream reaches it: until then monitor()
  // would take the pause for a new loss.
  for (const auto until = steady_clock::now() + 15s; steady_clock::now() < until;) {
    if (recovery_step(qemu_state().second) != RecoveryStep::kResume) return ok_status();
    std::this_thread::sleep_for(100ms);
  }
  return Error{Errc::kTimeout, "the target QEMU stayed postcopy-paused for 15 s after migrate-recover"};
}

}  // namespace rdmig::migration
