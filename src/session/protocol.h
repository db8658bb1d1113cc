// The agent-to-agent protocol's vocabulary in one place (docs/protocol.md): the message kinds,
// the hello kinds and what each is for, the protocol versions and the refusal each end gives to
// another version, the field readers every parser uses (errors name `where.field`), and the
// typed handshake messages. Every message is a JSON object framed by transport/wire.h; a message
// names its kind in "type", a hello names its kind in "kind".
//
// The JSON objects are nlohmann::json (std::map: keys sorted), so a message's bytes depend only
// on its fields, never on the order they are set in: the golden tests (tests/unit/protocol_test.cpp)
// pin them, because the flow's proofs hash the hello's dump().
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"

namespace rdmig::session {

// --- Versions -------------------------------------------------------------------------------
// Each line is matched exactly today: a peer of another version is refused at its hello.
// The data plane (bare-QEMU migrations, path checks, the KubeVirt probe); transport/wire.h.
inline constexpr uint32_t kDataPlaneProtocol = 3;
// The KubeVirt flow (hellos "flow" and "flow-data"); kubevirt/flow/flow_protocol.h.
inline constexpr uint64_t kFlowProtocol = 6;
// (The RDMA connection request's private data has its own version, 2: transport/rdma/cm.h.)

// --- Message kinds ("type") -------------------------------------------------------------------
enum class MessageKind : uint8_t {
  kHello,       // a bare-QEMU migration's or path check's hello ("type":"hello" beside its "kind")
  kChallenge,   // acceptor -> dialler: its nonce (a flow's also carries the target's proofs)
  kAuth,        // dialler -> acceptor: its proof ("proof", or "mac" on a flow)
  kWelcome,     // acceptor -> dialler: admitted (session terms, or a channel's proof)
  kReject,      // either way: refused, {code?, message}
  kFallback,    // source -> target: RDMA failed, carry over TCP
  kFallbackOk,  // target -> source: the fallback is accepted (bare-QEMU migration)
  kStart,       // source -> target: every channel is up, begin
  kReady,       // target -> source: ready to receive
  kPing,        // path check: source -> target
  kPong,        // path check: target -> source; also the answer to a probe hello
  kStream,      // path check: source -> target, the stream phase begins
  kResult,      // target -> source: the verdict
  kGoodbye,     // source -> target: the session ends
  kOpen,        // flow: source -> target before a channel connects
  kEnd,         // flow: source -> target, the carried migration ended
  kStats,       // flow: target -> source, its answer to "end"
  kHeartbeat,   // flow: either way, on the signed control link
  kAbort,       // either way: the session fails, {reason}
  kResume,      // a data channel that fails over: each end's count taken (session/resume.h)
  kResumeOk,    // dialler -> acceptor: its proof over both counts
  kRecover,     // source -> target, post-copy recovery: run migrate-recover, take the fresh channel
  kRecoverReady,  // target -> source: its QEMU listens (migrate-recover) and the channel is attached
  kPostcopySwitch,    // source -> target, before migrate-start-postcopy: may it switch? {trigger, pass}
  kPostcopySwitchOk,  // target -> source: agreed; this end refuses cancels from now on
};
inline constexpr size_t kMessageKinds = 25;

// The field of "start" (source: "I ask before I switch to post-copy") and of "ready" (target: "I
// answer") that turns the post-copy switch agreement on (docs/protocol.md). Only when both carry it
// does the source send kPostcopySwitch; an agent without it ignores the field, and the switch then
// goes as it did before the agreement existed.
inline constexpr const char* kPostcopySwitchAgreementField = "postCopySwitchAgreement";
// True when `message` (a "start" or a "ready") carries the field as true.
bool offers_postcopy_switch_agreement(const nlohmann::json& message);
// True when `message` (an object: a welcome, a start, a ready) carries `field` as true: how an
// optional flag a peer confirms is read (an agent from before the flag leaves it out).
bool says(const nlohmann::json& message, const char* field);

std::string_view name(MessageKind kind);
std::string to_string(MessageKind kind);
// The kind a wire name names; nullopt for a name that is no message kind.
std::optional<MessageKind> parse_kind(std::string_view name);
// The kind of a received message: its "type" when that is a string naming a kind; nullopt when
// it is absent, not a string or unknown. Never throws (a hostile "type":5 is just no kind).
std::optional<MessageKind> kind_of(const nlohmann::json& message);
bool is(const nlohmann::json& message, MessageKind kind);
// A message of `kind`: `fields` (a JSON object) with "type" set to the kind's name.
nlohmann::json message(MessageKind kind, nlohmann::json fields = nlohmann::json::object());

// --- Hello kinds ("kind") and their purpose ---------------------------------------------------
// The first message on every connection to an agent's data-plane port names one of these.
enum class HelloKind : uint8_t {
  kControl,           // a bare-QEMU migration's control connection
  kData,              // one of its channels
  kPathcheckControl,  // a path check's control connection (the same fields as kControl)
  kPathcheckData,     // one of its channels (the same fields as kData)
  kFlow,              // a carried KubeVirt migration's control connection
  kFlowData,          // one of its TCP channels
  kProbe,             // "does this peer's data plane serve?" (answered with a pong)
};
// What a session is for; derived from the hello's kind, never a field of its own on the wire.
enum class Purpose : uint8_t { kMigration, kPathCheck, kFlow, kProbe };

std::string_view name(HelloKind kind);
std::string to_string(HelloKind kind);
std::optional<HelloKind> parse_hello_kind(std::string_view name);
Purpose purpose_of(HelloKind kind);
std::string_view name(Purpose purpose);
// True for a session's data channel (data, pathcheck-data, flow-data).
bool is_channel(HelloKind kind);
// The version the hellos of `purpose` carry in "protocol".
uint64_t protocol_of(Purpose purpose);

// Reads a hello's "protocol" and refuses any version but this agent's for `purpose`, with the
// errors the agents give today:
//   data plane: kProtocol "hello.protocol: peer speaks version N, this agent 3" (N in 1..1000)
//   flow:       kInvalidArgument "hello.protocol: this agent speaks 6, got N" (N in 0..1000)
Result<uint64_t> check_hello_protocol(const nlohmann::json& hello, Purpose purpose);

// --- Field readers ------------------------------------------------------------------------------
// A required string field, at most `max_len` bytes; errors name `where.key`.
Result<std::string> get_string(const nlohmann::json& j, const char* key, const std::string& where,
                               size_t max_len = 256);
// A required non-negative integer field in [min, max]; errors name `where.key`.
Result<uint64_t> get_uint(const nlohmann::json& j, const char* key, const std::string& where, uint64_t min,
                          uint64_t max);

// --- Session terms and rails (every hello that opens a session offers them) ----------------------
inline constexpr uint32_t kMaxChannels = 65;  // main + 64 multifd
// The index a re-dialled control connection's proof names (hello "control"): none of a data channel.
inline constexpr uint32_t kControlIndex = kMaxChannels;

// One RDMA rail of an agent as the other agent sees it: its index in that agent's config
// (rdma.devices[rail]) and where it is: the source's hello gives the address its channels leave
// from, the target's welcome the rdma_cm endpoint (ip:port) they connect to.
// One of a rail's alternate addresses (rdma.devices[i].alternateAddresses[index]), as a target's
// welcome lists it: {"index", "address": its rdma_cm endpoint}.
struct AlternateAddress {
  uint32_t index = 0;
  std::string address;
};
struct RailAddress {
  uint32_t rail = 0;
  std::string address;
  uint32_t mtu = 0;  // "mtu", optional: the active MTU (bytes) of the agent's port on this rail; 0 = not given
  // "alternates", optional (a welcome's rails only): the device's other addresses that listen.
  std::vector<AlternateAddress> alternates{};
};
inline constexpr uint32_t kMaxRails = 16;
inline constexpr uint32_t kMaxRailAlternates = 4;
nlohmann::json rails_to_json(const std::vector<RailAddress>& rails);
// `j[key]` (optional: an empty list when absent) as a list of rails; errors name `where.key[i]`.
Result<std::vector<RailAddress>> parse_rails(const nlohmann::json& j, const char* key, const std::string& where);

// What both ends of a session must agree on, as every session-opening hello offers it:
// chunkSize, ringDepth, transport (tcp|rdma), transportRequired (optional). Errors name
// `where.field`.
struct SessionTerms {
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  std::string transport;
  bool transport_required = false;
};
Result<SessionTerms> parse_session_terms(const nlohmann::json& j, const std::string& where);

// The VMI a carried KubeVirt migration moves (a flow hello's "vmi"; kubevirt/hook/vmi.h names it VmiRef).
struct VmiRef {
  std::string namespace_;
  std::string name;
  std::string uid;
  std::string key() const { return namespace_ + "/" + name; }
};

// --- The hello: the first message on every connection to an agent's data-plane port -------------
// One type for every purpose; its kind says the purpose (purpose_of). The bytes on the wire are
// those of the previous release, kind by kind (docs/protocol.md, "Hellos"):
//   control, pathcheck-control  {type:"hello", protocol 3, kind, migrationId, nonce, tls?, channels,
//                                chunkSize, ringDepth, transport, transportRequired, rdmaMtu?,
//                                rdmaRails?, verifyChunks?, failover?}
//   data, pathcheck-data        {type:"hello", protocol 3, kind, migrationId, session, index, nonce,
//                                tls?, resume?, control?, recover?}
//   flow                        {kind, protocol 6, session, nonce, mode, vmi?, migrationUid, sourceNode,
//                                targetNode, chunkSize, ringDepth, transport, transportRequired,
//                                rdmaRails?, failover?}     (no "type": a flow's proofs hash this dump)
//   flow-data                   {kind, protocol 6, session, index, nonce, tls?, resume?, control?}
//   probe                       {kind, protocol 3}
// A field a kind does not carry is ignored by to_json and left empty by parse.
struct Hello {
  HelloKind kind = HelloKind::kData;
  // 0: this agent's version for the kind's purpose (protocol_of); parse sets the peer's.
  uint64_t protocol = 0;
  Purpose purpose() const { return purpose_of(kind); }

  // Every kind but probe.
  // data, pathcheck-data: the session id from the welcome (no secret); flow, flow-data: the id
  // the source chose (32 lowercase hex).
  std::string session;
  // control: the source's nonce, its half of the channel key; a channel: the dialler's fresh nonce
  // (transport/channel_proof.h adds it); flow: the source's half of the exchange. 32 lowercase hex.
  std::string nonce;
  uint32_t index = 0;  // a channel's index (0 = QEMU's main channel)
  // "tls" (migration and path check hellos, flow-data): the source has dataPlane.tls on, so every
  // TCP data channel runs TLS after its proof; the target refuses a wish that is not its own config.
  bool tls = false;
  // "resume" (data, flow-data): this connection re-establishes channel `index` of a session that
  // fails over; the resume exchange (session/resume.h) follows its proof.
  bool resume = false;

  // The session's terms: control, pathcheck-control, flow.
  uint64_t chunk_size = 0;
  uint32_t ring_depth = 0;
  std::string transport;  // offered: tcp | rdma
  bool transport_required = false;
  std::vector<RailAddress> rdma_rails;  // "rdmaRails", optional: the source's working RDMA rails
  // "failover", optional: the source fails its data channels over (docs/failover.md); the target's
  // welcome confirms it when it does too.
  bool failover = false;

  // Bare-QEMU migrations and path checks.
  std::string migration_id;  // the target agent's migration (or path check) id
  uint32_t channels = 0;     // control: QEMU connections (1 + multifd channels)
  // control, optional: active MTU (bytes) of the source's RDMA port; 0 = not offered.
  uint32_t rdma_mtu = 0;
  // control, optional ("verifyChunks"): every chunk ends in the CRC32C of its payload (session/pump.h).
  bool verify_chunks = false;
  // control, optional ("postCopyPreempt", bare-QEMU migrations): the last of `channels` is post-copy's
  // preempt connection; a target agent from before it refuses the count (its multifdChannels + 1).
  bool post_copy_preempt = false;
  // data and flow-data, optional ("control", with resume (or, data only, recover), index 0):
  // re-establishes the control connection instead; its proof's terms name kControlIndex.
  bool control = false;
  // data, optional ("recover", not with resume): a fresh connection of a post-copy recovery.
  bool recover = false;

  // A carried KubeVirt migration (flow).
  std::string mode;  // hook | static
  VmiRef vmi;        // empty in static mode
  std::string migration_uid;
  std::string source_node;
  std::string target_node;

  nlohmann::json to_json() const;
  // Reads a hello of `purpose` strictly: the version (check_hello_protocol: the refusal names both
  // versions), the kind (a kind of another purpose is refused as "hello.kind: expected ..."), and
  // every field the kind carries; errors name the field ("hello.chunkSize").
  static Result<Hello> parse(const nlohmann::json& j, Purpose purpose);
};

// The hello that opens a data channel (data, pathcheck-data, flow-data): what the three features
// send on each channel, one builder for all (flow-data has no migration id: pass "").
Hello channel_hello(HelloKind kind, std::string migration_id, std::string session, uint32_t index, bool tls,
                    bool resume);

// --- Typed handshake messages -----------------------------------------------------------------
// {"type":"challenge","nonce", "proofs"?}: the acceptor's fresh nonce; a flow's target adds one
// proof of the token per token it accepts (at most kMaxChallengeProofs).
struct Challenge {
  std::string nonce;
  std::vector<std::string> proofs;  // flow only; absent on the wire when empty
  nlohmann::json to_json() const;
  // A "challenge" whose nonce is a string of at most `max_nonce` bytes ("challenge.nonce: ...").
  // The proofs are read leniently, as today: anything but a list of at most four is no proof.
  static Result<Challenge> parse(const nlohmann::json& j, size_t max_nonce = 64);
};
inline constexpr size_t kMaxChallengeProofs = 4;

// {"type":"auth", field: mac}: the dialler's proof; `field` is "proof" (control and channels) or
// "mac" (a flow's control connection).
struct Auth {
  static constexpr const char* kProofField = "proof";
  static constexpr const char* kFlowField = "mac";
  std::string field = kProofField;
  std::string mac;
  nlohmann::json to_json() const;
  // An "auth" with `field` a string of at most 64 bytes; errors name "auth.<field>".
  static Result<Auth> parse(const nlohmann::json& j, const char* field = kProofField);
};

// {"type":"reject","code"?,"message"}: a refusal (transport::send_reject sends one with a code).
struct Reject {
  std::string code;  // absent on the wire when empty
  std::string message;
  nlohmann::json to_json() const;
  // Any message read as a refusal: its "code" and "message" when they are strings ("?" for a
  // missing message), never throwing on a hostile peer's types.
  static Reject from(const nlohmann::json& j);
};

// {"type":"fallback","transport":"tcp","error"}: the source's RDMA failed; carry over TCP.
struct Fallback {
  std::string transport = "tcp";
  std::string error;
  nlohmann::json to_json() const;
};

}  // namespace rdmig::session
