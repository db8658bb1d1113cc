// The agent-to-agent session of one carried KubeVirt migration (hello kind "flow"), on the
// data-plane port beside the bare-QEMU jobs' "control"/"data" hellos:
//   source -> target  hello {kind:"flow", protocol, session, mode, vmi, migrationUid, sourceNode,
//                            targetNode, chunkSize, ringDepth, transport, transportRequired}
//   target -> source  {type:"challenge", nonce}
//   source -> target  {type:"auth", mac}        mac = HMAC-SHA256(agent token, nonce || session)
//   target -> source  {type:"welcome", transport, transportReason, rdmaEndpoint?} | {type:"reject"}
// then on that connection (a ControlLink):
//   source -> target  {type:"open", index, destination:"ip:port"}  before channel `index` connects
//   source -> target  {type:"end", ...counters}  target -> source {type:"stats", libvirt}
//   either way        {type:"abort", reason}
// Channels: TCP connections with hello {kind:"flow-data", session, index}, or rdma_cm
// connections carrying (session, index) like the bare-QEMU jobs' channels.
// The agents share the API token (one Secret); it never crosses the wire.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "common/result.h"
#include "config/agent_config.h"
#include "kubevirt/vmi.h"

namespace rdmig::kubevirt {

struct FlowHello {
  std::string session;  // 32 hex characters, chosen by the source
  std::string mode;     // hook | static
  VmiRef vmi;           // empty in static mode
  std::string migration_uid;
  std::string source_node;
  std::string target_node;
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  std::string transport;  // offered: tcp | rdma
  bool transport_required = false;

  nlohmann::json to_json() const;
  static Result<FlowHello> parse(const nlohmann::json& j);
};

// HMAC-SHA256(token, nonce || session), hex.
std::string flow_mac(const std::string& token, const std::string& nonce, const std::string& session);

}  // namespace rdmig::kubevirt
