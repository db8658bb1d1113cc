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

}  // namespace rdmig::kubevirt
