// libvirt's figures for a migrated VMI, read on the target node: virDomainGetJobStats with
// COMPLETED | KEEP_COMPLETED on the daemon inside the target virt-launcher
// (/proc/<launcher pid>/root<libvirt socket>), domain "<namespace>_<name>" as KubeVirt names it.
#pragma once

#include <chrono>

#include "config/agent_config.h"
#include "kubevirt/flow_record.h"

namespace rdmig::kubevirt {

// Waits up to `wait` for the completed job to appear (libvirt finishes the job on the target
// shortly after the last byte).
Result<LibvirtJobStats> read_completed_job(const KubevirtConfig& config, const VmiRef& vmi,
                                           std::chrono::milliseconds wait);

// Aborts the outgoing migration job of the VMI's domain on this node (virDomainAbortJob on
// the launcher's libvirt): QEMU cancels and the VM keeps running here. Used when the carrier
// failed, so libvirt fails within seconds instead of waiting for KubeVirt's progress timeout
// (QEMU 7.2 can hang when a multifd connection fails while it is being set up). Precopy only:
// rdmig never carries post-copy. Returns what it did, for the log.
// `started_by_ms` (wall clock): only a job that had started by then is aborted, so a later
// migration of the same VMI is never hit by the abort meant for a failed one.
Result<std::string> abort_outgoing_job(const KubevirtConfig& config, const VmiRef& vmi, int64_t started_by_ms);

}  // namespace rdmig::kubevirt
