// libvirt's figures for a migrated VMI, read on the target node: virDomainGetJobStats with
// COMPLETED | KEEP_COMPLETED on the daemon inside the target virt-launcher
// (/proc/<launcher pid>/root<libvirt socket>), domain "<namespace>_<name>" as KubeVirt names it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>

#include "config/agent_config.h"
#include "kubevirt/flow/flow_record.h"
#include "kubevirt/hook/handler_identity.h"

namespace rdmig::kubevirt {

// The URI of a launcher's libvirt daemon reached through `socket`: qemu+unix:///system for a
// privileged daemon (KubeVirt's Root feature gate), qemu+unix:///session for an unprivileged
// one (KubeVirt's default non-root launcher: virtqemud as uid 107). The path is
// percent-encoded into the query.
std::string libvirt_uri(const std::string& socket, bool privileged);
// The uid the daemon listening on `socket` runs as (SO_PEERCRED of a connection to it).
Result<uid_t> daemon_uid(const std::string& socket);

// The daemons are those in the root of the VMI's launcher processes: `config.launcherProgram`
// with `--uid <VMI UID>`, and in a launcher pod of the VMI (`launchers`) when the agent knows
// the pods from the API.
// Waits up to `wait` for the completed job to appear (libvirt finishes the job on the target
// shortly after the last byte). Errc::kFailedPrecondition when, for kGoneFor, the domain ran
// nowhere on this node: every launcher daemon of the VMI answered without it active (libvirt
// failed the incoming migration and removed it) or, when `launcher_was_here` (one was seen at
// the session's start), no launcher process of the VMI is left (the target pod is gone).
// kNotFound when the figures could not be read in time (a daemon that refused the agent), and at
// once when no launcher of the VMI was seen at the session's start nor is now (the agent cannot
// see it: nothing to wait for).
inline constexpr std::chrono::milliseconds kGoneFor{1000};
Result<LibvirtJobStats> read_completed_job(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                           const VmiRef& vmi, std::chrono::milliseconds wait,
                                           bool launcher_was_here);
// Whether the VMI's outgoing migration on this node switched to post-copy: its domain is paused
// for post-copy (VIR_DOMAIN_PAUSED_POSTCOPY, or POSTCOPY_FAILED once it failed), as libvirt shows
// it after KubeVirt's launcher called MigrateStartPostCopy. kNotFound when no launcher daemon of
// the VMI answered with the domain.
Result<bool> outgoing_switched_to_postcopy(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                           const VmiRef& vmi);
// The completed outgoing job of the VMI's domain on this node (the source, after the move: its
// domain defined and no longer running): libvirt's figures as the source has them. After a
// switch to post-copy the target's libvirt (11.3) keeps no completed job, so these are the only
// figures there are. kNotFound when there is none.
Result<LibvirtJobStats> read_outgoing_completed_job(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                                    const VmiRef& vmi);
// Whether a launcher of `vmi` with a libvirt socket runs on this node now.
bool launcher_present(const KubevirtConfig& config, const LauncherIdentity& launchers, const VmiRef& vmi);

// kubevirt.multifdOnFailure "auto": whether a failure drains the multifd connections of a QEMU
// of `version` (libvirt's number) rather than resetting them with the rest. Every QEMU drains.
// A multifd channel that fails while QEMU's migration thread waits in multifd_send_sync_main
// can leave that thread waiting for good, the VM unable to migrate again until it restarts
// (`duplicate yank instance`): on QEMU 7.2 a channel that finds the exit flag set leaves
// without posting the sync; from QEMU 9.0 on the first channel's error sets the exit flag
// (multifd_send_set_error), and a channel that then takes its sync request leaves the same
// way. Seen on QEMU 10.0 with every connection reset (1 wedge in 114 tries, after a link cut,
// the migration thread and 5 of 8 channel threads alive 15 s later;
// bench/results/kubevirt-failures/). Resetting the main channel only fails QEMU on its
// migration stream, and QEMU's own cleanup then ends the multifd threads.
inline bool drain_multifd_for_qemu(unsigned long /*version*/) { return true; }
// "10.0.13" for libvirt's 10000013.
std::string qemu_version_string(unsigned long version);
// The QEMU version of the VMI's launcher on this node, as its libvirt daemon reports it
// (virConnectGetVersion: major * 1000000 + minor * 1000 + micro).
Result<unsigned long> launcher_qemu_version(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                            const VmiRef& vmi);

// Aborts the outgoing migration job of the VMI's domain on this node (virDomainAbortJob on
// the launcher's libvirt): QEMU cancels and the VM keeps running here. Used when the carrier
// failed, so libvirt fails within seconds instead of waiting for KubeVirt's progress timeout
// (QEMU 7.2 can hang when a multifd connection fails while it is being set up). Pre-copy only:
// a migration that switched to post-copy is never aborted (the guest runs on the target), and
// what was found is returned instead. Returns what it did, for the log.
// Only the job the failed session carried is aborted: one that started between the session's
// arming (`armed_at_ms`, wall clock; KubeVirt calls the hook before libvirt starts the job) and
// its failure (`failed_at_ms`). An older job, or a later migration of the same VMI, is left alone.
Result<std::string> abort_outgoing_job(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                       const VmiRef& vmi, int64_t armed_at_ms, int64_t failed_at_ms);

}  // namespace rdmig::kubevirt
