#include "migration/postcopy_recovery.h"

namespace rdmig::migration {

RecoveryStep recovery_step(const std::string& qemu_status) {
  if (qemu_status == kPostcopyPaused) return RecoveryStep::kResume;
  if (qemu_status == "completed") return RecoveryStep::kComplete;
  // "device": the source QEMU's stop-and-copy of the switch itself, which ends in post-copy (or
  // in a failure that QEMU undoes by running the guest again, SourceJob::postcopy_fell_through).
  if (qemu_status == "postcopy-active" || qemu_status == "postcopy-recover" ||
      qemu_status == "postcopy-recover-setup" || qemu_status == "device") {
    return RecoveryStep::kWait;
  }
  return RecoveryStep::kGiveUp;
}

std::string recovery_socket_path(const std::string& state_dir, const std::string& id, Role role, uint32_t attempt) {
  return state_dir + "/" + id + (role == Role::kSource ? ".src" : ".dst") + ".r" + std::to_string(attempt) + ".sock";
}

std::string describe_qemu(const std::string& migration_status, const std::string& run_state) {
  return "migration '" + migration_status + "', run state '" + run_state + "'";
}

std::string stuck_postcopy_reason(const StuckPostcopy& s) {
  const bool source = s.role == Role::kSource;
  const std::string own = source ? "source" : "target";
  const std::string peer = source ? "target" : "source";
  std::string r = "post-copy recovery failed: the link between the agents was lost after the switch to post-copy (" +
                  s.lost + ") and no path came back within " + std::to_string(s.deadline_seconds) +
                  " s (migration.postCopyRecoverySeconds; " + std::to_string(s.tries) + " tr" +
                  (s.tries == 1 ? "y" : "ies") + (s.last_try.empty() ? std::string() : ", the last: " + s.last_try) +
                  "). The " + own + " QEMU: " + s.own_qemu + "; the " + peer + " QEMU: " +
                  (s.peer_qemu.empty() ? "not known here (see the " + peer + " agent's status of this migration)"
                                       : s.peer_qemu) +
                  ". The target QEMU holds the VM's running state and the source QEMU the pages the target lacks: "
                  "neither can run the VM alone, so rdmig resumes neither (no cont, no migrate_cancel) and the VM "
                  "runs nowhere until it is recovered. Once a path between the nodes works, recover by hand "
                  "(docs/runbooks/RdmigPostcopySplit.md): on the target QEMU "
                  "{\"execute\":\"migrate-recover\",\"arguments\":{\"uri\":\"tcp:0.0.0.0:PORT\"}}, then on the source "
                  "QEMU {\"execute\":\"migrate\",\"arguments\":{\"uri\":\"tcp:TARGET-NODE:PORT\",\"resume\":true}}; "
                  "both QEMUs must be 'postcopy-paused' first (query-migrate)";
  return r;
}

std::string restart_not_recoverable_reason(Role role, const std::string& qemu) {
  const std::string own = role == Role::kSource ? "source" : "target";
  return "this agent restarted during post-copy and found its record of the migration, but the " + own +
         " QEMU is in " + qemu + ", not '" + kPostcopyPaused +
         "': there is nothing to resume, so rdmig leaves it exactly as it is (no cont, no migrate_cancel, no "
         "migrate-pause). Look at both QEMUs (query-migrate, query-status) before acting; "
         "docs/runbooks/RdmigPostcopySplit.md";
}

}  // namespace rdmig::migration
