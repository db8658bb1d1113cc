// SourceJob's post-copy: the switch (postCopy after/auto), its figures, and what follows a failure after
// it: the recovery over fresh connections (docs/api.md "Post-copy recovery") or the split state named.
// The rest of the job: source_job.cpp.
#include "migration/source_job.h"

#include <sys/stat.h>

#include <algorithm>
#include <thread>
#include <tuple>

#include "common/log.h"
#include "common/net.h"
#include "migration/postcopy_recovery.h"
#include "session/protocol.h"
#include "transport/channel_proof.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/wire.h"

namespace rdmig::migration {

// The session layer (src/session) this file stands on.
using session::ChannelPump;
using session::ControlLink;
using session::kHandshakeTimeout;
using session::wall_clock_ms;

using nlohmann::json;
using namespace std::chrono_literals;

Status SourceJob::maybe_switch_to_postcopy(const qemu::MigrationInfo& info,
                                           std::chrono::steady_clock::duration elapsed) {
  const auto& pc = spec_.post_copy;
  if (pc.mode == PostCopyMode::kNever || postcopy_switched_ || info.status != "active") return ok_status();
  std::string trigger;
  if (pc.mode == PostCopyMode::kAfter && passes_ >= 2) {
    trigger = "after-first-pass";
  } else if (pc.mode == PostCopyMode::kAuto && passes_ >= pc.after_passes) {
    trigger = "passes";
  } else if (pc.mode == PostCopyMode::kAuto && elapsed >= std::chrono::seconds(pc.after_seconds)) {
    trigger = "seconds";
  } else {
    return ok_status();
  }
  // Either a cancel or the switch wins, on both agents alike: a cancel accepted here first stops
  // the switch (monitor() ends the migration, the VM stays here); once agreed, cancels are refused.
  if (!agree_postcopy_switch()) return ok_status();
  if (target_agrees_) RDMIG_TRY(agree_switch_with_target(trigger, passes_));
  // On disk before the switch: an agent that dies right after it can still take part in a recovery.
  record_ = make_record();
  save_record("postcopy");
  auto r = qmp_->execute("migrate-start-postcopy", {}, kQmpTimeout);
  if (!r) return r.error().with_context("postCopy: source QEMU's migrate-start-postcopy");
  postcopy_switched_ = true;
  postcopy_at_ = std::chrono::steady_clock::now();
  if (record_) {
    record_->switched_at_ms = wall_clock_ms();
    save_record("postcopy");
  }
  const auto after_ms = std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count();
  LOG_INFO("migration") << log_prefix() << " switched to post-copy (" << trigger << ") after " << after_ms
                        << " ms at pass " << passes_;
  ctx_.metrics.postcopy_switched(transport_, trigger);
  update([&](MigrationStatus& s) {
    s.post_copy.switched = true;
    s.post_copy.trigger = trigger;
    s.post_copy.switched_at_ms = wall_clock_ms();
    s.post_copy.switch_after_ms = after_ms;
    s.post_copy.switch_at_pass = passes_;
  });
  return ok_status();
}

Status SourceJob::agree_switch_with_target(const std::string& trigger, int64_t pass) {
  // The target judges "switched?" from its own QEMU, which learns of the switch only through the
  // stream: until then a cancel there would be accepted, and its teardown would split the VM. So
  // the target says yes first, and from its yes on refuses cancels; a cancel it accepted before
  // the question comes back as its verdict (result ok:false), and this end then does not switch.
  RDMIG_TRY(link_->send(session::message(session::MessageKind::kPostcopySwitch, json{{"trigger", trigger}, {"pass", pass}})));
  const auto deadline = std::chrono::steady_clock::now() + kHandshakeTimeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return Error{Errc::kTimeout, "postCopy: the target agent did not agree to the switch within " +
                                       std::to_string(kHandshakeTimeout.count()) + " s; not switched"};
    }
    auto m = link_->next(std::min<std::chrono::milliseconds>(left, 250ms));
    if (!m) return m.error().with_context("target agent, before the post-copy switch");
    if (!m->has_value()) continue;
    if (session::is(**m, session::MessageKind::kPostcopySwitchOk)) return ok_status();
    if (auto e = take_target_message(**m)) return e->with_context("postCopy: not switched");
  }
}

void SourceJob::record_postcopy_end(const qemu::MigrationInfo& info) {
  if (!postcopy_switched_) return;
  // The phase from QEMU's own MIGRATION events (postcopy-active to completed), else as the agent saw it.
  std::optional<int64_t> active_us, done_us;
  for (const auto& e : qmp_->events()) {
    if (e.seq <= events_before_migrate_ || e.name != "MIGRATION") continue;
    const auto st = e.data.value("status", "");
    if (st == "postcopy-active" && !active_us) active_us = e.timestamp_us;
    if (st == "completed") done_us = e.timestamp_us;
  }
  int64_t phase_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - postcopy_at_).count();
  if (active_us && done_us && *done_us >= *active_us) phase_ms = (*done_us - *active_us) / 1000;
  ctx_.metrics.postcopy_ended(transport_, static_cast<double>(phase_ms) / 1000.0,
                              info.postcopy_requests >= 0 ? static_cast<uint64_t>(info.postcopy_requests) : 0);
  update([&](MigrationStatus& s) {
    s.post_copy.phase_ms = phase_ms;
    if (info.postcopy_requests >= 0) s.post_copy.page_requests = static_cast<uint64_t>(info.postcopy_requests);
  });
}

std::optional<std::string> SourceJob::postcopy_fell_through() {
  using namespace std::chrono_literals;
  if (!qmp_->connected()) return std::nullopt;
  auto seen = qemu_state();
  for (const auto until = std::chrono::steady_clock::now() + 10s;
       seen.second == "device" && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(100ms);
    seen = qemu_state();
  }
  if (seen.second == "active") return seen.first;
  if (seen.second == "failed" || seen.second == "cancelled") {
    auto run = run_state(*qmp_);
    if (run && run.value() == "running") return seen.first;
  }
  return std::nullopt;
}

void SourceJob::fail_in_postcopy(const Error& error) {
  // The target ran the VM from the switch on; the source holds the pages it has not sent. Neither
  // migrate_cancel nor cont may run here, and neither QEMU is stopped: QEMU keeps both in
  // postcopy-paused, from which a recovery (migrate-recover on the target, migrate with resume
  // on the source, over a fresh channel) can still complete the migration.
  std::string state = "unreadable";
  if (qmp_->connected()) {
    if (auto raw = qmp_->execute("query-migrate", {}, kQmpTimeout)) {
      if (auto info = qemu::parse_migration_info(raw.value())) {
        if (info->status == "completed") {
          record_postcopy_end(info.value());
          complete(info.value());
          return;
        }
        state = info->status;
      }
    }
  } else {
    state = "gone (monitor lost)";
  }
  if (link_) (void)link_->send(session::message(session::MessageKind::kAbort, json{{"reason", error.message}}));
  abort_data_plane(error);
  finish(Phase::kFailed,
         error.message + "; in post-copy: the target ran the VM and the source QEMU (migration '" + state +
             "') still holds pages the target lacks, so neither QEMU can run the VM alone and rdmig resumes "
             "neither: both are left as they are (QEMU keeps them postcopy-paused); recover with migrate-recover "
             "on the target QEMU and migrate with resume: true on the source QEMU (docs/api.md)",
         "postcopy_split");
}

SourceJob::Recovery SourceJob::recover_postcopy(const Error& why) {
  using namespace std::chrono;
  const uint32_t seconds = ctx_.config.migration.postcopy_recovery_seconds;
  // QEMU resumes post-copy on its main channel (and the preempt one): with multifd (QEMU 10.1+) its
  // multifd channels are not opened again (spec_.recovery_channels()).
  if (seconds == 0 || target_decided_ || !qmp_->connected()) {
    return Recovery::kNotRecoverable;
  }
  const auto first_seen = qemu_state();
  const std::string first = first_seen.first, first_status = first_seen.second;
  const RecoveryStep step = recovery_step(first_status);
  if (step == RecoveryStep::kComplete || step == RecoveryStep::kGiveUp) return Recovery::kNotRecoverable;
  const auto t0 = steady_clock::now();
  const auto deadline = t0 + std::chrono::seconds(seconds);
  const int64_t paused_before = status().post_copy.paused_ms;
  LOG_WARN("migration") << log_prefix() << " post-copy link lost (" << why.message << "): recovering for up to "
                        << seconds << " s (source QEMU " << first << ")";
  set_phase(Phase::kRecovering);
  update([&](MigrationStatus& s) {
    s.post_copy.recovery = "recovering";
    s.post_copy.recovery_reason = why.message;
    s.post_copy.recovery_tries = 0;
    s.post_copy.recovery_last_try.clear();
    s.post_copy.source_qemu = first;
    s.post_copy.target_qemu.clear();
  });
  save_record("recovering");
  stop_accepting();
  listener_.reset();
  retire_data_plane(why.message);
  // QEMU pauses as soon as its connection is reset; one that has not noticed is paused by hand.
  std::string state = first, status = first_status;
  bool paused_by_hand = false;
  for (const auto wait_from = steady_clock::now(); recovery_step(status) == RecoveryStep::kWait;) {
    // A job restored after a restart only looks: its QEMU lost the agent's connection at once.
    if (!paused_by_hand && !restored_ && steady_clock::now() - wait_from > 5s) {
      (void)qmp_->execute("migrate-pause", {}, kQmpTimeout);
      paused_by_hand = true;
    }
    if (steady_clock::now() - wait_from > 15s) break;
    std::this_thread::sleep_for(100ms);
    std::tie(state, status) = qemu_state();
  }
  update([&](MigrationStatus& s) { s.post_copy.source_qemu = state; });
  // QEMU undid the switch itself (the target QEMU had not loaded it): a pre-copy failure, the VM
  // runs here (fail_and_protect_vm, through the caller).
  if (recovery_step(status) == RecoveryStep::kGiveUp && postcopy_fell_through()) return Recovery::kNotRecoverable;
  if (recovery_step(status) != RecoveryStep::kResume) {
    // Failed, or stuck short of postcopy-paused: nothing a fresh channel can resume.
    finish(Phase::kFailed,
           why.message + "; in post-copy, and the source QEMU did not pause for a recovery (" + state +
               "): rdmig resumes neither QEMU (neither can run the VM alone); see docs/runbooks/RdmigPostcopySplit.md",
           "postcopy_split");
    return Recovery::kFinished;
  }
  uint32_t attempt = 0;
  std::string last;
  while (steady_clock::now() < deadline) {
    const auto tried_at = steady_clock::now();
    ++attempt;
    update([&](MigrationStatus& s) {
      s.post_copy.recovery_tries = attempt;
      s.post_copy.paused_ms = paused_before + duration_cast<milliseconds>(tried_at - t0).count();
    });
    auto st = try_recovery(attempt, deadline);
    if (st) {
      const auto took = steady_clock::now() - t0;
      paused_total_ += took;
      const auto took_ms = duration_cast<milliseconds>(took).count();
      LOG_WARN("migration") << log_prefix() << " post-copy recovered after " << took_ms << " ms (try " << attempt
                            << "): resumed over a fresh channel";
      update([&](MigrationStatus& s) {
        s.post_copy.recovery = "recovered";
        ++s.post_copy.recoveries;
        s.post_copy.paused_ms = paused_before + took_ms;
        s.post_copy.source_qemu = qemu_state().first;
      });
      save_record("postcopy");
      set_phase(Phase::kMigrating);
      return Recovery::kResumed;
    }
    keep_record_alive();
    last = st.error().message;
    LOG_INFO("migration") << log_prefix() << " post-copy recovery try " << attempt << ": " << last;
    update([&](MigrationStatus& s) { s.post_copy.recovery_last_try = last; });
    retire_data_plane("recovery try " + std::to_string(attempt) + " failed");
    stop_accepting();
    listener_.reset();
    if (st.error().code == Errc::kPermissionDenied) break;  // the target refused: no later try can do better
    if (cancel_requested()) {
      last += "; then this agent stopped trying (" + cancel_reason() + ")";
      break;
    }
    std::this_thread::sleep_until(std::min(deadline, tried_at + 1s));
  }
  const std::string now_state = qemu_state().first;
  update([&](MigrationStatus& s) {
    s.post_copy.recovery = "failed";
    s.post_copy.source_qemu = now_state;
    s.post_copy.paused_ms = paused_before + duration_cast<milliseconds>(steady_clock::now() - t0).count();
  });
  finish(Phase::kFailed,
         stuck_postcopy_reason(StuckPostcopy{Role::kSource, why.message, seconds, attempt, last, now_state, ""}),
         "postcopy_split");
  return Recovery::kFinished;
}

PostcopyRecord SourceJob::make_record() const {
  PostcopyRecord r;
  r.id = spec_.id;
  r.role = Role::kSource;
  r.vm = spec_.vm;
  r.qmp_socket = spec_.qmp_socket;
  r.peer = net::format_endpoint(spec_.target.host, spec_.target.port);
  r.target_migration_id = spec_.target.migration_id;
  r.session = session_;
  r.channel_key = channel_key_;
  r.chunk_size = spec_.chunk_size;
  r.ring_depth = spec_.ring_depth;
  r.verify_chunks = spec_.verify_chunks;
  r.preempt = spec_.post_copy.preempt;
  r.multifd_channels = spec_.multifd_channels;
  r.post_copy_mode = post_copy_mode_name(spec_.post_copy.mode);
  r.completion_timeout_seconds = spec_.completion_timeout_seconds;
  r.no_progress_timeout_seconds = spec_.no_progress_timeout_seconds;
  return r;
}

Result<std::unique_ptr<SourceJob>> SourceJob::restore(const PostcopyRecord& record, JobContext ctx) {
  auto ep = net::parse_endpoint(record.peer, "peer");
  if (!ep) return ep.error();
  MigrationSpec spec = spec_from_record(record, Role::kSource);
  spec.target = TargetRef{ep->host, ep->port, record.target_migration_id, ""};
  spec.post_copy.mode = record.post_copy_mode == "auto" ? PostCopyMode::kAuto : PostCopyMode::kAfter;
  auto qmp = qemu::QmpClient::connect(spec.qmp_socket, 5s);
  if (!qmp) return qmp_check_failed(spec.qmp_socket, "its greeting", qmp.error());
  auto job = std::unique_ptr<SourceJob>(new SourceJob(std::move(spec), ctx, std::move(qmp.value()), true));
  job->session_ = record.session;
  job->channel_key_ = record.channel_key;
  job->transport_ = "tcp";
  job->postcopy_switched_ = true;
  job->postcopy_at_ = std::chrono::steady_clock::now();
  job->mark_restored(record);
  return job;
}

void SourceJob::start_restored() {
  start_worker([this] { run_restored(); });
}

void SourceJob::run_restored() {
  const Error why = restored_why("source", "taking part in the recovery");
  const auto r = recover_postcopy(why);
  if (r == Recovery::kResumed) {
    monitor_to_end();
  } else if (r == Recovery::kNotRecoverable) {
    if (const auto fell_through = postcopy_fell_through()) {
      // This agent died as the switch began, before the target QEMU loaded it: QEMU undid the switch
      // when its stream to this agent broke and runs the guest again (postcopy_fell_through).
      update([](MigrationStatus& s) { s.post_copy.switched = false; });
      finish(Phase::kFailed,
             why.message + "; the switch to post-copy had not taken effect (the source QEMU: " + *fell_through +
                 "): the target QEMU never ran the VM; source VM is running",
             "peer_lost");
    } else {
      finish(Phase::kFailed, restart_not_recoverable_reason(Role::kSource, qemu_state().first), "postcopy_split");
    }
  }
  stop_accepting();
  abort_data_plane(Error{Errc::kCancelled, "migration finished"});
}

Result<UniqueFd> SourceJob::dial_recovery(bool control, uint32_t index, std::chrono::milliseconds left) {
  const net::Endpoint ep{spec_.target.host, spec_.target.port};
  const std::string where = (control ? std::string("recovery control connection") : "recovery channel " + std::to_string(index)) +
                            " to " + ep.to_string();
  // The same endpoint and dial policy as the first dial; the session's keys prove it.
  auto fd = peer_dial_policy(ctx_.config.data_plane).connect(ep, "target.endpoint", left, [](int) { return ok_status(); });
  if (!fd) return fd.error().with_context(where);
  session::Hello dh = data_hello(control ? 0 : index, /*resume=*/false);
  dh.recover = true;
  dh.control = control;
  if (control) dh.tls = false;  // the control connection runs no TLS
  const transport::ChannelTerms terms{channel_key_, session_, control ? transport::kControlIndex : index};
  if (auto st = transport::prove_channel(fd->get(), dh.to_json(), terms, left); !st) return st.error().with_context(where);
  return fd;
}

Status SourceJob::try_recovery(uint32_t attempt, std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  const auto left = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds(1000),
                               duration_cast<milliseconds>(kHandshakeTimeout));
  auto cfd = dial_recovery(/*control=*/true, 0, left);
  if (!cfd) return cfd.error();
  auto link = std::make_unique<ControlLink>(std::move(cfd.value()));
  RDMIG_TRY(link->send(session::message(session::MessageKind::kRecover, json{{"attempt", attempt}})));
  // QEMU resumes on its main channel and, with postcopy-preempt, opens its preempt connection again.
  const std::vector<uint32_t> indexes = spec_.recovery_channels();
  std::vector<std::unique_ptr<transport::TcpChannel>> channels;
  for (const uint32_t index : indexes) {
    const std::string what = "recovery channel " + std::to_string(index);
    auto dfd = dial_recovery(/*control=*/false, index, left);
    if (!dfd) return dfd.error();
    std::unique_ptr<transport::TlsStream> tls;
    if (ctx_.config.data_plane.tls) {
      auto stream = channel_tls(dfd->get(), transport::TlsStream::Role::kDialler,
                                transport::ChannelTerms{channel_key_, session_, index}, left);
      if (!stream) return stream.error().with_context(what);
      tls = std::move(stream.value());
    }
    channels.push_back(transport::TcpChannel::create(std::move(dfd.value()), index, static_cast<uint32_t>(spec_.chunk_size),
                                                     spec_.ring_depth, ctx_.metrics.transport("tcp"), ctx_.config.tcp.splice,
                                                     std::move(tls)));
  }
  auto ready = link->expect(session::to_string(session::MessageKind::kRecoverReady), left);
  if (!ready) {
    // The target's abort: it cannot recover (its QEMU, or the session is over there): final.
    if (ready.error().code == Errc::kCancelled) return Error{Errc::kPermissionDenied, "the target agent refused: " + ready.error().message};
    return ready.error().with_context("waiting for the target's migrate-recover");
  }
  if (const auto t = ready->find("targetQemu"); t != ready->end() && t->is_string()) {
    update([&](MigrationStatus& s) { s.post_copy.target_qemu = t->get<std::string>(); });
  }
  const std::string path = recovery_socket_path(ctx_.config.state_dir, spec_.id, Role::kSource, attempt);
  ::unlink(path.c_str());
  auto listener = net::unix_listen(path);
  if (!listener) return listener.error();
  ::chmod(path.c_str(), 0600);
  listener_ = std::move(listener.value());
  auto r = qmp_->execute("migrate", json{{"uri", "unix:" + path}, {"resume", true}}, kQmpTimeout);
  if (!r) {
    ::unlink(path.c_str());
    return r.error().with_context("source QEMU's migrate resume");
  }
  // QEMU's connections in its order: the main one at once, the preempt one once the resumed main
  // channel's handshake (carried by the first pump) has run.
  std::vector<std::unique_ptr<ChannelPump>> pumps;
  for (size_t k = 0; k < channels.size(); ++k) {
    auto qfd = net::accept_for(listener_.get(), 10s);
    if (!qfd) {
      ::unlink(path.c_str());
      for (auto& p : pumps) p->abort(Error{Errc::kCancelled, "recovery try failed"}, /*reset=*/true);
      return qfd.error().with_context(k == 0 ? "source QEMU's resumed connection" : "source QEMU's resumed preempt connection");
    }
    RDMIG_TRY(check_qemu_peer(qfd->get(), "migration socket " + path));
    LOG_DEBUG("migration") << log_prefix() << " recovery try " << attempt << ": QEMU's resumed connection for channel "
                           << indexes[k] << " accepted";
    auto pump = std::make_unique<ChannelPump>(*channels[k], std::move(qfd.value()));
    if (spec_.verify_chunks) pump->verify_chunks();
    pump->start();
    pumps.push_back(std::move(pump));
  }
  ::unlink(path.c_str());
  for (size_t k = 0; k < channels.size(); ++k) {
    adopt_channel(std::move(channels[k]), std::move(pumps[k]), k == 0 ? std::move(link) : nullptr);
  }
  // QEMU leaves postcopy-paused once the resumed stream's handshake runs: until then monitor()
  // would take the pause for a new loss.
  for (const auto until = steady_clock::now() + 15s; steady_clock::now() < until;) {
    if (recovery_step(qemu_state().second) != RecoveryStep::kResume) return ok_status();
    std::this_thread::sleep_for(100ms);
  }
  return Error{Errc::kTimeout, "the source QEMU stayed postcopy-paused for 15 s after migrate resume"};
}

}  // namespace rdmig::migration
