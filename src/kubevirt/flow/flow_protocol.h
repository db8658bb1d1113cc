// The agent-to-agent session of one carried KubeVirt migration (hello kind "flow", purpose flow:
// session::Hello, read and written by the codec in session/protocol.h), on the data-plane port
// beside the bare-QEMU jobs' "control"/"data" hellos. Protocol 6:
//   source -> target  hello {kind:"flow", protocol, session, nonce, mode, vmi, migrationUid,
//                            sourceNode, targetNode, chunkSize, ringDepth, transport, transportRequired,
//                            rdmaRails?: [{rail, address, mtu?}] (the source's working RDMA rails)}
//   target -> source  {type: challenge, nonce, proofs:[...]}   the target proves the token first:
//                     one proof per token it accepts (current, and the previous one during a
//                     rotation), each HMAC(token, "target" role label, both nonces, the hello)
//   source -> target  {type:"auth", mac}    HMAC(token, "source" role label, both nonces, the hello)
//   target -> source  {type: welcome, transport, transportReason, rdmaEndpoint?, rdmaRails?} | {type: reject}
//                     rdmaRails: the target's rdma_cm endpoint on each working rail; channels
//                     are striped across the rails both agents have (session/rails.h)
// Every proof covers every field of the hello as the target parsed it, so a relay of the
// exchange cannot change the nodes, the VMI or the migration; the role label keeps a proof of
// one side from serving as the other's. Both sides then derive a session key from the token
// and both nonces, and every later message on that connection (a ControlLink) carries
// {seq, mac}: HMAC(key, direction label, the message) with a sequence number per direction,
// so nothing can be injected, replayed or reordered, the destinations included:
//   source -> target  {type:"open", index, host, port}  before channel `index` connects
//   source -> target  {type:"end", ...counters}  target -> source {type:"stats", libvirt}
//   either way        {type:"abort", reason}
//   either way        {type:"heartbeat"}  every kFlowHeartbeatInterval from the link's own thread,
//                     until the source sends "end"; a side that verified nothing from its peer
//                     for kubevirt.heartbeatTimeoutSeconds fails the session (a cut link or a
//                     frozen agent shows in seconds: TCP alone notices after its 30 s user timeout)
// Failover (hello and welcome "failover": true, docs/failover.md): a TCP or RDMA channel whose link
// fails is re-dialled over TCP by the source with {kind:"flow-data", ..., resume:true}, proved as
// below, then resumed where each direction stopped (session/resume.h); admitted only for a live
// channel of a session that fails over.
// Channels: TCP connections with hello {kind:"flow-data", protocol, session, index, nonce}, or
// rdma_cm connections carrying (session, index), like the bare-QEMU jobs' channels. Each proves
// the session's channel key (transport/channel_proof.h: derived from the token and both nonces,
// bound to the session, the index and the proving end, over a fresh nonce of the target's or, on
// RDMA, the request's own parameters) before the target admits it: the session id is no secret.
// The agents share the API token (one Secret); it never crosses the wire.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/result.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

// The flow's own protocol version (the bare-QEMU hellos have transport::kProtocolVersion).
// 4: heartbeats on the control link. 5: rails (rdmaRails in the hello and the welcome).
// 6: every channel proves the session's channel key; the flow-data hello carries the protocol.
inline constexpr uint64_t kFlowProtocolVersion = 6;
// How often each side sends a heartbeat on the control link (the peer's timeout is at least 2 s).
inline constexpr std::chrono::milliseconds kFlowHeartbeatInterval{500};

// The proofs of the shared token (hex HMAC-SHA256), each over the role, both nonces and the
// whole hello; and the session key both sides derive for the control link.
std::string flow_proof(const std::string& token, const std::string& role, const session::Hello& hello,
                       const std::string& target_nonce);
std::string flow_session_key(const std::string& token, const session::Hello& hello, const std::string& target_nonce);
// The key every channel of the session proves (transport::channel_key over the same nonces).
std::string flow_channel_key(const std::string& token, const session::Hello& hello, const std::string& target_nonce);

// The first message of a flow's TCP channel, without its nonce (transport::prove_channel adds it):
// {kind:"flow-data", protocol, session, index, tls?, resume?}. `resume`: the source re-dials a
// channel that fails over (docs/failover.md); after the proof both ends run the resume exchange.
session::Hello flow_data_hello(const std::string& session, uint32_t index, bool tls, bool resume);
// The hello of the control link re-dialled to fail it over: {kind:"flow-data", protocol, session,
// index:0, resume:true, control:true}; its proof names transport::kControlIndex; no TLS.
session::Hello flow_control_hello(const std::string& session);

// Signs what one side sends on the control link and checks what it receives: {seq, mac} on
// every message, in order per direction. Not thread-safe: the owner serialises.
class FlowSigner {
 public:
  // `own`/`peer`: the direction labels ("source"/"target" or the reverse).
  FlowSigner(std::string key, std::string own, std::string peer);
  nlohmann::json sign(nlohmann::json message);
  // The message with seq and mac removed, or an error naming what is wrong.
  Result<nlohmann::json> verify(const nlohmann::json& message);

 private:
  std::string mac_of(const std::string& label, const nlohmann::json& message) const;
  std::string key_, own_, peer_;
  uint64_t sent_ = 0, received_ = 0;
};

}  // namespace rdmig::kubevirt
