// What the node hook learns from the VirtualMachineInstance that KubeVirt sends it at
// PreMigrationSource, and whether rdmig may carry that migration. Field names follow
// kubevirt.io/api core/v1 (VirtualMachineInstanceMigrationState).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

// Keys of targetDirectMigrationNodePorts' values: the class of each published port.
inline constexpr int kLibvirtControlPort = 0;
inline constexpr int kMemoryPort = 49152;
inline constexpr int kBlockPort = 49153;

// A VMI by namespace, name and uid; the same type a flow hello carries (session/protocol.h).
using VmiRef = session::VmiRef;

struct PublishedPort {
  uint16_t port = 0;  // the target virt-handler's random TCP port
  int kind = 0;       // 0 = libvirt control, 49152 = memory, 49153 = block
};

struct MigrationIntent {
  VmiRef vmi;
  std::string migration_uid;
  std::string source_node;
  std::string target_node;
  std::string target_address;  // the target virt-handler's pod (or migration network) IP
  std::vector<PublishedPort> ports;
  std::string mode;             // PreCopy, PostCopy, or empty
  bool allow_post_copy = false;
  bool disable_tls = false;
  bool decentralized = false;   // cross-cluster (sourceState/targetState syncAddress)
};

// Parses the VMI JSON (bounded by the caller). Errors name the field.
Result<MigrationIntent> parse_vmi(const nlohmann::json& vmi);

// Why this migration must not be carried, or nullopt when it may be. `this_node` is the
// node the agent runs on (the hook's node context). A migration that may switch to post-copy is
// skipped unless `carry_post_copy` (kubevirt.carryPostCopy).
std::optional<std::string> skip_reason(const MigrationIntent& intent, const std::string& this_node,
                                       bool carry_post_copy = false);
// Whether the migration may switch to post-copy (allowPostCopy, or already in mode PostCopy).
inline bool may_post_copy(const MigrationIntent& in) { return in.allow_post_copy || in.mode == "PostCopy"; }

// Ports rdmig carries: memory and block. The libvirt control connection stays on KubeVirt's TCP.
std::vector<uint16_t> carried_ports(const MigrationIntent& intent);

}  // namespace rdmig::kubevirt
