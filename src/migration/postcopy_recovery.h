// Post-copy recovery (docs/api.md "Post-copy recovery"): after the switch to post-copy the VM's
// state is split between the two QEMUs, and a link lost beyond failover leaves both in QEMU's
// postcopy-paused. The agents then keep trying a fresh channel between them until
// migration.postCopyRecoverySeconds; once one works the target QEMU runs migrate-recover on a
// fresh unix socket and the source QEMU migrate with resume: true. What both jobs decide from
// QEMU's states, and what they say when the deadline passes, lives here (pure, unit-tested).
#pragma once

#include <cstdint>
#include <string>

#include "migration/types.h"

namespace rdmig::migration {

// QEMU's migration status from which migrate-recover (target) and migrate resume (source) start.
inline constexpr const char* kPostcopyPaused = "postcopy-paused";

// What a job does with its QEMU's migration status once its link was lost in post-copy.
enum class RecoveryStep {
  kResume,    // postcopy-paused: recoverable, try a fresh channel
  kWait,      // postcopy-active / -recover(-setup), device (the switch under way): QEMU has not noticed
              // yet, is mid-resume or mid-switch: ask again
  kComplete,  // completed: every page arrived after all, nothing to recover
  kGiveUp,    // failed, cancelled, none or anything else: QEMU cannot be resumed
};
RecoveryStep recovery_step(const std::string& qemu_status);

// The fresh unix socket of recovery try `attempt` (1, 2, ...): the target QEMU listens on the
// target's (migrate-recover), the source agent on the source's (migrate resume connects to it).
std::string recovery_socket_path(const std::string& state_dir, const std::string& id, Role role, uint32_t attempt);

// One QEMU as a stuck-migration message names it: its migration status and its run state.
std::string describe_qemu(const std::string& migration_status, const std::string& run_state);

// The reason a post-copy migration fails with once its recovery deadline passed: why the link
// was lost, how long and how often the agents tried, the state of each QEMU (this agent's as it
// is now, the peer's as last known or "not known here"), that rdmig resumes neither, and the QMP
// commands an operator runs to recover by hand (docs/runbooks/RdmigPostcopySplit.md).
struct StuckPostcopy {
  Role role = Role::kSource;    // the agent that writes the message
  std::string lost;             // why the recovery began
  uint32_t deadline_seconds = 0;  // migration.postCopyRecoverySeconds
  uint32_t tries = 0;
  std::string last_try;         // the last try's error; empty when none was made
  std::string own_qemu;         // describe_qemu of this agent's QEMU
  std::string peer_qemu;        // the peer's QEMU as last known; empty: not known here
};
std::string stuck_postcopy_reason(const StuckPostcopy& s);

// Why a job restored after this agent restarted (postcopy_record.h) is not resumed: its QEMU
// (`qemu`: describe_qemu) is not postcopy-paused, so there is nothing a recovery can resume, and
// rdmig leaves that QEMU exactly as it is.
std::string restart_not_recoverable_reason(Role role, const std::string& qemu);

}  // namespace rdmig::migration
