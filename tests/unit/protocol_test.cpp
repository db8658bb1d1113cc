// The agent-to-agent protocol in one place (docs/protocol.md).
// Golden: the exact bytes of every hello and handshake message for fixed inputs, and of the MACs
// computed over them, as the agents produce them today: an agent of the previous release must keep
// reading them (the flow's proofs hash the hello's dump(), so one reordered key breaks every flow).
// Hostile: truncated, oversized, unknown kind, wrong state, replayed, wrong version; each refused
// with the error the agents give today.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <set>
#include <thread>

#include "common/fd.h"
#include "kubevirt/flow/flow_protocol.h"
#include "session/protocol.h"
#include "socket_pair.h"
#include "transport/rdma/cm.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"

using namespace rdmig;
using nlohmann::json;

namespace {

constexpr const char* kNonceA = "0123456789abcdef0123456789abcdef";
constexpr const char* kNonceB = "fedcba9876543210fedcba9876543210";

session::Hello full_control_hello() {
  session::Hello h;
  h.kind = session::HelloKind::kControl;
  h.migration_id = "m-1";
  h.nonce = kNonceA;
  h.channels = 5;
  h.chunk_size = 1 << 20;
  h.ring_depth = 8;
  h.transport = "rdma";
  h.transport_required = true;
  h.rdma_mtu = 4096;
  h.rdma_rails = {{0, "10.0.0.1", 4096}, {1, "10.0.1.1", 0}};
  h.verify_chunks = true;
  h.tls = true;
  return h;
}

session::Hello full_flow_hello() {
  session::Hello h;
  h.kind = session::HelloKind::kFlow;
  h.session = kNonceB;
  h.nonce = kNonceA;
  h.mode = "hook";
  h.vmi = session::VmiRef{"ns", "vm-1", "uid-1"};
  h.migration_uid = "mig-uid";
  h.source_node = "node-a";
  h.target_node = "node-b";
  h.chunk_size = 4 << 20;
  h.ring_depth = 16;
  h.transport = "tcp";
  h.rdma_rails = {{2, "10.0.2.1", 1024}};
  return h;
}

}  // namespace

TEST(ProtocolGolden, MigrationHellosAreByteIdentical) {
  EXPECT_EQ(full_control_hello().to_json().dump(), R"({"channels":5,"chunkSize":1048576,"kind":"control","migrationId":"m-1","nonce":"0123456789abcdef0123456789abcdef","protocol":3,"rdmaMtu":4096,"rdmaRails":[{"address":"10.0.0.1","mtu":4096,"rail":0},{"address":"10.0.1.1","rail":1}],"ringDepth":8,"tls":true,"transport":"rdma","transportRequired":true,"type":"hello","verifyChunks":true})");
  session::Hello minimal;
  minimal.kind = session::HelloKind::kControl;
  minimal.migration_id = "m-1";
  minimal.nonce = kNonceA;
  minimal.channels = 1;
  minimal.chunk_size = 1 << 20;
  minimal.ring_depth = 2;
  minimal.transport = "tcp";
  EXPECT_EQ(minimal.to_json().dump(), R"({"channels":1,"chunkSize":1048576,"kind":"control","migrationId":"m-1","nonce":"0123456789abcdef0123456789abcdef","protocol":3,"ringDepth":2,"transport":"tcp","transportRequired":false,"type":"hello"})");
  session::Hello data;
  data.kind = session::HelloKind::kData;
  data.migration_id = "m-1";
  data.session = "s-1";
  data.index = 3;
  data.tls = true;
  EXPECT_EQ(data.to_json().dump(), R"({"index":3,"kind":"data","migrationId":"m-1","protocol":3,"session":"s-1","tls":true,"type":"hello"})");
}

TEST(ProtocolGolden, FlowHellosAreByteIdenticalAndSoAreTheirProofs) {
  EXPECT_EQ(full_flow_hello().to_json().dump(), R"({"chunkSize":4194304,"kind":"flow","migrationUid":"mig-uid","mode":"hook","nonce":"0123456789abcdef0123456789abcdef","protocol":6,"rdmaRails":[{"address":"10.0.2.1","mtu":1024,"rail":2}],"ringDepth":16,"session":"fedcba9876543210fedcba9876543210","sourceNode":"node-a","targetNode":"node-b","transport":"tcp","transportRequired":false,"vmi":{"name":"vm-1","namespace":"ns","uid":"uid-1"}})");
  session::Hello bare = full_flow_hello();
  bare.vmi = {};
  bare.rdma_rails.clear();
  bare.mode = "static";
  bare.transport_required = true;
  EXPECT_EQ(bare.to_json().dump(), R"({"chunkSize":4194304,"kind":"flow","migrationUid":"mig-uid","mode":"static","nonce":"0123456789abcdef0123456789abcdef","protocol":6,"ringDepth":16,"session":"fedcba9876543210fedcba9876543210","sourceNode":"node-a","targetNode":"node-b","transport":"tcp","transportRequired":true})");
  session::Hello data;
  data.kind = session::HelloKind::kFlowData;
  data.session = kNonceB;
  data.index = 7;
  EXPECT_EQ(data.to_json().dump(), R"({"index":7,"kind":"flow-data","protocol":6,"session":"fedcba9876543210fedcba9876543210"})");
  data.nonce = kNonceA;
  data.tls = true;
  EXPECT_EQ(data.to_json().dump(), R"({"index":7,"kind":"flow-data","nonce":"0123456789abcdef0123456789abcdef","protocol":6,"session":"fedcba9876543210fedcba9876543210","tls":true})");
  EXPECT_EQ(kubevirt::flow_proof("tok", "target", full_flow_hello(), kNonceB), R"(247a58dced470b0e58a18e5c4bc388d7fb350135b05558177261053399c9bbaa)");
  EXPECT_EQ(kubevirt::flow_proof("tok", "source", full_flow_hello(), kNonceB), R"(eba79d940afe182db566e477c917cb945b28e410f1ebbf6058ff388cd2b35831)");
  EXPECT_EQ(kubevirt::flow_session_key("tok", full_flow_hello(), kNonceB), R"(c02fb3c80f7b5ea9305385fb846c1461a32134af73c116228f514e6aa64daf9b)");
  EXPECT_EQ(kubevirt::flow_channel_key("tok", full_flow_hello(), kNonceB), R"(fef7f75b9da6eb4587e83c9036c91f73015993891d6522c2443812f75482ddae)");
  kubevirt::FlowSigner signer("key", "source", "target");
  EXPECT_EQ(signer.sign(session::message(session::MessageKind::kHeartbeat)).dump(), R"({"mac":"4921c49752b6fa765792157c64807f67d9fe22e14324a46431aab4afb1b67b2c","seq":0,"type":"heartbeat"})");
}

TEST(ProtocolCodec, AFlowsFailoverAndAResumeHelloReadBackAndAreOnlyOnTheWireWhenSet) {
  // Off, the hellos are byte-identical to before (the golden test above): an agent that does not
  // read "failover" still proves a hello without it.
  session::Hello h = full_flow_hello();
  EXPECT_FALSE(h.to_json().contains("failover"));
  h.failover = true;
  auto j = h.to_json();
  EXPECT_EQ(j["failover"], true);
  auto back = session::Hello::parse(j, session::Purpose::kFlow);
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_TRUE(back->failover);
  EXPECT_EQ(back->to_json().dump(), j.dump());  // the proofs cover it on both sides alike
  EXPECT_NE(kubevirt::flow_proof("tok", "source", h, kNonceB), kubevirt::flow_proof("tok", "source", full_flow_hello(), kNonceB));
  j["failover"] = "yes";
  EXPECT_EQ(session::Hello::parse(j, session::Purpose::kFlow).error().message, "hello.failover: expected a boolean");

  session::Hello d;
  d.kind = session::HelloKind::kFlowData;
  d.session = kNonceB;
  d.index = 3;
  d.nonce = kNonceA;
  EXPECT_FALSE(d.to_json().contains("resume"));
  d.resume = true;
  auto dj = d.to_json();
  auto dback = session::Hello::parse(dj, session::Purpose::kFlow);
  ASSERT_TRUE(dback.ok()) << dback.error().message;
  EXPECT_TRUE(dback->resume);
  EXPECT_EQ(dback->index, 3u);
  dj["resume"] = 1;
  EXPECT_EQ(session::Hello::parse(dj, session::Purpose::kFlow).error().message, "hello.resume: expected a boolean");
}

TEST(ProtocolCodec, AFlowsControlLinkReDialReadsBackOnlyAsAResumeOfIndexZeroWithoutTls) {
  // docs/failover.md: the source re-dials a flow's control link with a flow-data hello marked
  // resume and control (its proof names kControlIndex); off, the hello is as before.
  session::Hello d;
  d.kind = session::HelloKind::kFlowData;
  d.session = kNonceB;
  d.nonce = kNonceA;
  d.resume = true;
  EXPECT_FALSE(d.to_json().contains("control"));
  d.control = true;
  auto j = d.to_json();
  EXPECT_EQ(j.dump(), R"({"control":true,"index":0,"kind":"flow-data","nonce":"0123456789abcdef0123456789abcdef","protocol":6,"resume":true,"session":"fedcba9876543210fedcba9876543210"})");
  auto back = session::Hello::parse(j, session::Purpose::kFlow);
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_TRUE(back->control);
  EXPECT_TRUE(back->resume);
  EXPECT_EQ(back->to_json(), j);
  const std::string only = "hello.control: only a resume of the control link, with index 0 and no tls";
  for (auto bad : {json{{"resume", false}}, json{{"index", 2}}, json{{"tls", true}}}) {
    auto k = j;
    k.update(bad);
    if (!bad.contains("resume")) k["resume"] = true;
    if (bad.contains("resume")) k.erase("resume");
    EXPECT_EQ(session::Hello::parse(k, session::Purpose::kFlow).error().message, only) << bad.dump();
  }
  j["control"] = "yes";
  EXPECT_EQ(session::Hello::parse(j, session::Purpose::kFlow).error().message, "hello.control: expected a boolean");
}

TEST(ProtocolGolden, ControlProofIsByteIdentical) {
  EXPECT_EQ(transport::control_proof("tok", kNonceB, "m-1", kNonceA), R"(da6783848832b064e55b030be736a73123016d82fb95ea0b64893877a120d901)");
}

// Every message kind as the agents build it (with fixed field values), byte for byte.
TEST(ProtocolGolden, HandshakeAndSessionMessagesAreByteIdentical) {
  const std::vector<std::pair<json, std::string>> cases = {
      {session::message(session::MessageKind::kChallenge, json{{"nonce", kNonceB}}), R"({"nonce":"fedcba9876543210fedcba9876543210","type":"challenge"})"},
      {session::message(session::MessageKind::kChallenge, json{{"nonce", kNonceB}, {"proofs", json::array({"p1", "p2"})}}), R"({"nonce":"fedcba9876543210fedcba9876543210","proofs":["p1","p2"],"type":"challenge"})"},
      {session::message(session::MessageKind::kAuth, json{{"proof", "mac"}}), R"({"proof":"mac","type":"auth"})"},
      {session::message(session::MessageKind::kAuth, json{{"mac", "mac"}}), R"({"mac":"mac","type":"auth"})"},
      {session::message(session::MessageKind::kWelcome, json{{"session", "s-1"}, {"transport", "tcp"}, {"transportReason", "why"}}), R"({"session":"s-1","transport":"tcp","transportReason":"why","type":"welcome"})"},
      {session::message(session::MessageKind::kWelcome, json{{"proof", "mac"}}), R"({"proof":"mac","type":"welcome"})"},
      {session::message(session::MessageKind::kReject, json{{"code", "invalid_argument"}, {"message", "no"}}), R"({"code":"invalid_argument","message":"no","type":"reject"})"},
      {session::message(session::MessageKind::kReject, json{{"message", "rdma is required here"}}), R"({"message":"rdma is required here","type":"reject"})"},
      {session::message(session::MessageKind::kFallback, json{{"transport", "tcp"}, {"error", "unreachable"}}), R"({"error":"unreachable","transport":"tcp","type":"fallback"})"},
      {session::message(session::MessageKind::kFallbackOk), R"({"type":"fallback-ok"})"},
      {session::message(session::MessageKind::kStart, json{{"clockUs", 12}}), R"({"clockUs":12,"type":"start"})"},
      {session::message(session::MessageKind::kStart, json{{"seed", 7}, {"bytes", 4096}}), R"({"bytes":4096,"seed":7,"type":"start"})"},
      {session::message(session::MessageKind::kReady, json{{"receivedClockUs", 1}, {"clockUs", 2}}), R"({"clockUs":2,"receivedClockUs":1,"type":"ready"})"},
      {session::message(session::MessageKind::kReady), R"({"type":"ready"})"},
      {session::message(session::MessageKind::kPing, json{{"seq", 3}}), R"({"seq":3,"type":"ping"})"},
      {session::message(session::MessageKind::kPong, json{{"seq", 3}}), R"({"seq":3,"type":"pong"})"},
      {session::message(session::MessageKind::kPong), R"({"type":"pong"})"},
      {session::message(session::MessageKind::kStream), R"({"type":"stream"})"},
      {session::message(session::MessageKind::kResult, json{{"ok", true}, {"state", "running"}, {"resumeTimestampUs", 5}}), R"({"ok":true,"resumeTimestampUs":5,"state":"running","type":"result"})"},
      {session::message(session::MessageKind::kGoodbye), R"({"type":"goodbye"})"},
      {session::message(session::MessageKind::kOpen, json{{"index", 1}, {"host", "10.0.0.2"}, {"port", 4444}}), R"({"host":"10.0.0.2","index":1,"port":4444,"type":"open"})"},
      {session::message(session::MessageKind::kEnd, json{{"bytesSent", 10}, {"bytesReceived", 20}}), R"({"bytesReceived":20,"bytesSent":10,"type":"end"})"},
      {session::message(session::MessageKind::kStats), R"({"type":"stats"})"},
      {session::message(session::MessageKind::kHeartbeat), R"({"type":"heartbeat"})"},
      {session::message(session::MessageKind::kAbort, json{{"reason", "gone"}}), R"({"reason":"gone","type":"abort"})"},
      {json{{"kind", session::to_string(session::HelloKind::kProbe)}, {"protocol", transport::kProtocolVersion}}, R"({"kind":"probe","protocol":3})"},
  };
  for (const auto& [message, bytes] : cases) EXPECT_EQ(message.dump(), bytes);
  EXPECT_EQ((session::Challenge{kNonceB, {}}.to_json().dump()), cases[0].second);
  EXPECT_EQ((session::Challenge{kNonceB, {"p1", "p2"}}.to_json().dump()), cases[1].second);
  EXPECT_EQ((session::Auth{session::Auth::kProofField, "mac"}.to_json().dump()), cases[2].second);
  EXPECT_EQ((session::Auth{session::Auth::kFlowField, "mac"}.to_json().dump()), cases[3].second);
  EXPECT_EQ((session::Reject{"invalid_argument", "no"}.to_json().dump()), cases[6].second);
  EXPECT_EQ((session::Reject{"", "rdma is required here"}.to_json().dump()), cases[7].second);
  EXPECT_EQ((session::Fallback{"tcp", "unreachable"}.to_json().dump()), cases[8].second);
}


// A peer's "type" that is no string is no kind: refused, never an exception out of the handshake.
TEST(ProtocolHostile, ANonStringKindFromThePeerIsRefusedNotThrown) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  UniqueFd dialler(fds[0]), acceptor(fds[1]);
  const transport::ChannelTerms terms{std::string(64, 'k'), kNonceB, 1};
  std::thread peer([&] {
    auto challenge = transport::recv_message(dialler.get(), std::chrono::seconds(5));
    ASSERT_TRUE(challenge.ok());
    ASSERT_TRUE(transport::send_message(dialler.get(), json{{"type", 5}, {"proof", std::string(64, '0')}}).ok());
    auto reject = transport::recv_message(dialler.get(), std::chrono::seconds(5));
    ASSERT_TRUE(reject.ok());
    EXPECT_EQ(reject->dump(), R"({"code":"permission_denied","message":"channel 1: auth.proof: required","type":"reject"})");
  });
  auto admitted = transport::check_channel(acceptor.get(), terms, kNonceA, std::chrono::seconds(5));
  peer.join();
  ASSERT_FALSE(admitted.ok());
  EXPECT_EQ(admitted.error().message, "channel 1: auth.proof: required");
}

// ---- The codec's tables ----

TEST(ProtocolCodec, EveryKindRoundTripsThroughItsWireName) {
  std::set<std::string> names;
  for (size_t i = 0; i < session::kMessageKinds; ++i) {
    const auto kind = static_cast<session::MessageKind>(i);
    EXPECT_EQ(session::parse_kind(session::name(kind)), kind);
    EXPECT_TRUE(session::is(session::message(kind), kind));
    names.insert(session::to_string(kind));
  }
  EXPECT_EQ(names.size(), session::kMessageKinds);
  for (auto k : {session::HelloKind::kControl, session::HelloKind::kData, session::HelloKind::kPathcheckControl,
                 session::HelloKind::kPathcheckData, session::HelloKind::kFlow, session::HelloKind::kFlowData,
                 session::HelloKind::kProbe}) {
    EXPECT_EQ(session::parse_hello_kind(session::name(k)), k);
  }
}

TEST(ProtocolCodec, ThePostcopySwitchAgreementHasItsWireNamesAndIsOnOnlyWhenOffered) {
  EXPECT_EQ(session::message(session::MessageKind::kPostcopySwitch).dump(), R"({"type":"postcopy-switch"})");
  EXPECT_EQ(session::message(session::MessageKind::kPostcopySwitchOk).dump(), R"({"type":"postcopy-switch-ok"})");
  EXPECT_EQ(session::parse_kind("postcopy-switch-ok"), session::MessageKind::kPostcopySwitchOk);
  // An agent from before the agreement sends start/ready without the field: no agreement, the
  // switch goes as before; only a true boolean offers it (a hostile "1" or "yes" does not).
  EXPECT_FALSE(session::offers_postcopy_switch_agreement(nlohmann::json{{"type", "ready"}, {"postCopy", true}}));
  EXPECT_TRUE(session::offers_postcopy_switch_agreement(
      nlohmann::json{{"type", "ready"}, {"postCopy", true}, {"postCopySwitchAgreement", true}}));
  EXPECT_FALSE(session::offers_postcopy_switch_agreement(nlohmann::json{{"postCopySwitchAgreement", false}}));
  EXPECT_FALSE(session::offers_postcopy_switch_agreement(nlohmann::json{{"postCopySwitchAgreement", 1}}));
  EXPECT_FALSE(session::offers_postcopy_switch_agreement(nlohmann::json{{"postCopySwitchAgreement", "yes"}}));
  EXPECT_FALSE(session::offers_postcopy_switch_agreement(nlohmann::json::array()));
}

TEST(ProtocolCodec, TheControlHellosPostCopyPreemptIsSentOnlyWhenOnAndReadStrictly) {
  auto h = full_control_hello();
  EXPECT_FALSE(h.to_json().contains("postCopyPreempt"));
  h.post_copy_preempt = true;
  auto j = h.to_json();
  EXPECT_EQ(j["postCopyPreempt"], true);
  auto back = session::Hello::parse(j, session::Purpose::kMigration);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_TRUE(back->post_copy_preempt);
  j["postCopyPreempt"] = "yes";
  EXPECT_EQ(session::Hello::parse(j, session::Purpose::kMigration).error().message,
            "hello.postCopyPreempt: expected a boolean");
  // says(): what a ready or a welcome confirms; only a true boolean counts.
  EXPECT_TRUE(session::says(nlohmann::json{{"postCopyPreempt", true}}, "postCopyPreempt"));
  EXPECT_FALSE(session::says(nlohmann::json{{"postCopyPreempt", "true"}}, "postCopyPreempt"));
  EXPECT_FALSE(session::says(nlohmann::json{{"postCopy", true}}, "postCopyPreempt"));
  EXPECT_FALSE(session::says(nlohmann::json::array({1}), "postCopyPreempt"));
}

TEST(ProtocolCodec, TheHellosPurposeComesFromItsKind) {
  using session::HelloKind;
  using session::Purpose;
  EXPECT_EQ(session::purpose_of(HelloKind::kControl), Purpose::kMigration);
  EXPECT_EQ(session::purpose_of(HelloKind::kData), Purpose::kMigration);
  EXPECT_EQ(session::purpose_of(HelloKind::kPathcheckControl), Purpose::kPathCheck);
  EXPECT_EQ(session::purpose_of(HelloKind::kPathcheckData), Purpose::kPathCheck);
  EXPECT_EQ(session::purpose_of(HelloKind::kFlow), Purpose::kFlow);
  EXPECT_EQ(session::purpose_of(HelloKind::kFlowData), Purpose::kFlow);
  EXPECT_EQ(session::purpose_of(HelloKind::kProbe), Purpose::kProbe);
  EXPECT_TRUE(session::is_channel(HelloKind::kFlowData));
  EXPECT_FALSE(session::is_channel(HelloKind::kPathcheckControl));
  session::Hello h;
  h.kind = HelloKind::kPathcheckData;
  EXPECT_EQ(h.purpose(), Purpose::kPathCheck);
  EXPECT_EQ(session::protocol_of(Purpose::kMigration), 3u);
  EXPECT_EQ(session::protocol_of(Purpose::kPathCheck), 3u);
  EXPECT_EQ(session::protocol_of(Purpose::kFlow), 6u);
  // The purpose is never a field of its own: the hellos carry what they carried.
  EXPECT_FALSE(full_control_hello().to_json().contains("purpose"));
  EXPECT_FALSE(full_flow_hello().to_json().contains("purpose"));
}

TEST(ProtocolCodec, TypedHandshakeMessagesReadBackWhatTheyWrite) {
  auto c = session::Challenge::parse(session::Challenge{kNonceB, {"p1", "p2"}}.to_json());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->nonce, kNonceB);
  EXPECT_EQ(c->proofs, (std::vector<std::string>{"p1", "p2"}));
  auto a = session::Auth::parse(session::Auth{session::Auth::kFlowField, "m"}.to_json(), session::Auth::kFlowField);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->mac, "m");
  const auto r = session::Reject::from(session::Reject{"tls_mismatch", "no"}.to_json());
  EXPECT_EQ(r.code, "tls_mismatch");
  EXPECT_EQ(r.message, "no");
}

// ---- Hostile input, in one place ----

namespace {
struct FdPair {
  UniqueFd a, b;
};
FdPair fd_pair() {
  auto [a, b] = rdmig_test::socket_pair();
  return {std::move(a), std::move(b)};
}
void write_raw(int fd, const std::string& bytes) {
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
}
std::string length_prefix(uint32_t n) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}
}  // namespace

TEST(ProtocolHostile, ATruncatedMessageIsRefused) {
  {  // the length says 100, 10 bytes come, the peer hangs up
    auto p = fd_pair();
    write_raw(p.a.get(), length_prefix(100) + R"({"type":"c)");
    p.a.reset();
    auto m = transport::recv_message(p.b.get(), std::chrono::seconds(2));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.error().code, Errc::kUnavailable) << m.error().message;
  }
  {  // half a length
    auto p = fd_pair();
    write_raw(p.a.get(), std::string("\x05\x00", 2));
    p.a.reset();
    EXPECT_FALSE(transport::recv_message(p.b.get(), std::chrono::seconds(2)).ok());
  }
  {  // a whole frame whose JSON is cut short
    auto p = fd_pair();
    const std::string body = R"({"type":"challenge","nonce":")";
    write_raw(p.a.get(), length_prefix(static_cast<uint32_t>(body.size())) + body);
    auto m = transport::recv_message(p.b.get(), std::chrono::seconds(2));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.error().code, Errc::kProtocol);
    EXPECT_EQ(m.error().message, "control message is not a JSON object");
  }
}

TEST(ProtocolHostile, AnOversizedOrTooDeepMessageOrFieldIsRefused) {
  {
    auto p = fd_pair();
    write_raw(p.a.get(), length_prefix(transport::kMaxMessageBytes + 1));
    auto m = transport::recv_message(p.b.get(), std::chrono::seconds(2));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.error().message, "control message length 65537 out of range");
  }
  {
    auto p = fd_pair();
    write_raw(p.a.get(), length_prefix(0));
    auto m = transport::recv_message(p.b.get(), std::chrono::seconds(2));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.error().message, "control message length 0 out of range");
  }
  {  // 33 levels: refused before the parser sees it
    auto p = fd_pair();
    const std::string body = R"({"type":"auth","proof":)" + std::string(32, '[') + std::string(32, ']') + "}";
    write_raw(p.a.get(), length_prefix(static_cast<uint32_t>(body.size())) + body);
    auto m = transport::recv_message(p.b.get(), std::chrono::seconds(2));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.error().message, "control message is not a JSON object");
  }
  {
    auto p = fd_pair();
    EXPECT_EQ(transport::send_message(p.a.get(), json{{"x", std::string(transport::kMaxMessageBytes, 'x')}}).error().message,
              "control message too large");
  }
  auto hello = full_control_hello().to_json();
  hello["migrationId"] = std::string(64, 'm');
  EXPECT_EQ(session::Hello::parse(hello, session::Purpose::kMigration).error().message, "hello.migrationId: longer than 63");
  auto auth = session::Auth::parse(session::message(session::MessageKind::kAuth, json{{"proof", std::string(65, 'a')}}));
  EXPECT_EQ(auth.error().message, "auth.proof: longer than 64");
  auto challenge = session::Challenge{kNonceB, {"1", "2", "3", "4", "5"}}.to_json();
  EXPECT_TRUE(session::Challenge::parse(challenge)->proofs.empty());  // more than four: no proof at all
}

TEST(ProtocolHostile, AnUnknownOrMistypedKindIsNoKind) {
  EXPECT_FALSE(session::parse_kind("bogus").has_value());
  EXPECT_FALSE(session::parse_kind("Welcome").has_value());
  EXPECT_FALSE(session::parse_kind("").has_value());
  EXPECT_FALSE(session::parse_hello_kind("pathcheck").has_value());
  // Never a throw, whatever the peer put in "type".
  EXPECT_FALSE(session::kind_of(json{{"type", 5}}).has_value());
  EXPECT_FALSE(session::kind_of(json{{"type", nullptr}}).has_value());
  EXPECT_FALSE(session::kind_of(json::array({"welcome"})).has_value());
  EXPECT_FALSE(session::kind_of(json{{"kind", "welcome"}}).has_value());
  EXPECT_FALSE(session::is(json{{"type", json::object()}}, session::MessageKind::kWelcome));
  const auto r = session::Reject::from(json{{"type", "reject"}, {"message", 5}, {"code", json::array()}});
  EXPECT_EQ(r.message, "?");
  EXPECT_EQ(r.code, "");
  auto hello = full_control_hello().to_json();
  hello["kind"] = "bogus";
  EXPECT_EQ(session::Hello::parse(hello, session::Purpose::kMigration).error().message, "hello.kind: expected control or data, got 'bogus'");
  hello["type"] = "welcome";
  EXPECT_EQ(session::Hello::parse(hello, session::Purpose::kMigration).error().message, "expected a hello, got 'welcome'");
}

TEST(ProtocolHostile, AMessageOutOfItsStateIsRefused) {
  // A channel's acceptor that gets a welcome where the auth belongs refuses the channel.
  auto p = fd_pair();
  const transport::ChannelTerms terms{std::string(64, 'k'), kNonceB, 1};
  std::thread dialler([&] {
    auto challenge = transport::recv_message(p.a.get(), std::chrono::seconds(5));
    ASSERT_TRUE(challenge.ok());
    EXPECT_TRUE(session::is(challenge.value(), session::MessageKind::kChallenge));
    ASSERT_TRUE(transport::send_message(p.a.get(), session::message(session::MessageKind::kWelcome,
                                                                    json{{"proof", std::string(64, '0')}})).ok());
    auto reject = transport::recv_message(p.a.get(), std::chrono::seconds(5));
    ASSERT_TRUE(reject.ok());
    EXPECT_TRUE(session::is(reject.value(), session::MessageKind::kReject));
    EXPECT_EQ(session::Reject::from(reject.value()).message, "channel 1: auth.proof: required");
  });
  auto admitted = transport::check_channel(p.b.get(), terms, kNonceA, std::chrono::seconds(5));
  dialler.join();
  ASSERT_FALSE(admitted.ok());
  EXPECT_EQ(admitted.error().code, Errc::kPermissionDenied);
  // A dialler whose challenge is a welcome reads it as the refusal it is.
  EXPECT_EQ(session::Challenge::parse(session::message(session::MessageKind::kWelcome)).error().message,
            "expected a challenge");
}

TEST(ProtocolHostile, AReplayedMessageOrProofIsRefused) {
  kubevirt::FlowSigner source("key", "source", "target");
  kubevirt::FlowSigner target("key", "target", "source");
  const json open = source.sign(session::message(session::MessageKind::kOpen, json{{"index", 0}}));
  ASSERT_TRUE(target.verify(open).ok());
  auto again = target.verify(open);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.error().message, "control message 1: out of sequence");
  // The source's own message reflected back to it: not the target's MAC.
  kubevirt::FlowSigner source2("key", "source", "target");
  const json mine = source2.sign(session::message(session::MessageKind::kHeartbeat));
  EXPECT_EQ(source2.verify(mine).error().message, "control message 0: its MAC does not match");
  // A channel's RDMA connect request is good once.
  transport::rdma::ConnectRequest req;
  req.index = 2;
  transport::rdma::sign_request(req, "channel-key");
  transport::ProofLedger ledger;
  EXPECT_TRUE(transport::rdma::check_request(req, "channel-key", ledger).ok());
  EXPECT_EQ(transport::rdma::check_request(req, "channel-key", ledger).error().message,
            "channel 2: the connect request's proof was used before (a replay)");
}

// (Was KubevirtFlowHello.RoundTripsAndValidatesEveryField in kubevirt_test.cpp.)
TEST(ProtocolHostile, AFlowHelloRoundTripsAndRefusesEveryBadField) {
  session::Hello h = full_flow_hello();
  h.rdma_rails.clear();
  auto back = session::Hello::parse(h.to_json(), session::Purpose::kFlow);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->vmi.key(), "ns/vm-1");
  EXPECT_TRUE(back->rdma_rails.empty());
  EXPECT_FALSE(h.to_json().contains("rdmaRails")) << "no rails, no key: the proof covers exactly what was sent";
  session::Hello railed = h;
  railed.rdma_rails = {{0, "10.10.0.1", 4096}, {1, "fd00::1", 0}};
  auto back2 = session::Hello::parse(railed.to_json(), session::Purpose::kFlow);
  ASSERT_TRUE(back2) << back2.error().message;
  ASSERT_EQ(back2->rdma_rails.size(), 2u);
  EXPECT_EQ(back2->rdma_rails[1].address, "fd00::1");
  EXPECT_EQ(back2->to_json(), railed.to_json());
  for (auto [key, value, field] : std::vector<std::tuple<std::string, json, std::string>>{
           {"session", "ZZ", "hello.session"},
           {"chunkSize", 3, "hello.chunkSize"},
           {"ringDepth", 1, "hello.ringDepth"},
           {"transport", "ib", "hello.transport"},
           {"mode", "x", "hello.mode"},
           {"nonce", "short", "hello.nonce"},
           {"protocol", 1, "hello.protocol"},
           {"protocol", 2, "hello.protocol"},
           {"protocol", 4, "hello.protocol"},
           {"rdmaRails", json::array({json{{"rail", 0}, {"address", "10.10.0.1"}, {"mtu", 1500}}}), "hello.rdmaRails[0].mtu"},
           {"rdmaRails", json::array({json{{"rail", 16}, {"address", "10.10.0.1"}}}), "hello.rdmaRails[0].rail"},
           {"rdmaRails", json::array({json{{"rail", 0}, {"address", "a"}}, json{{"rail", 0}, {"address", "b"}}}),
            "hello.rdmaRails[1].rail"},
           {"rdmaRails", json(std::vector<json>(17, json{{"rail", 0}, {"address", "a"}})), "hello.rdmaRails"},
           {"rdmaRails", "10.10.0.1", "hello.rdmaRails"}}) {
    auto j = h.to_json();
    j[key] = value;
    auto r = session::Hello::parse(j, session::Purpose::kFlow);
    ASSERT_FALSE(r) << key;
    EXPECT_NE(r.error().message.find(field), std::string::npos) << r.error().message;
  }
}

// (Was in postcopy_recovery_test.cpp.)
TEST(ProtocolHostile, ARecoverHelloIsAFreshConnectionNeverAResumeAndMayCarryTheControlConnection) {
  session::Hello h;
  h.kind = session::HelloKind::kData;
  h.migration_id = "m-1";
  h.session = std::string(32, 'a');
  h.nonce = std::string(32, 'b');
  h.recover = true;
  auto parsed = session::Hello::parse(h.to_json(), session::Purpose::kMigration);
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_TRUE(parsed->recover);
  EXPECT_FALSE(parsed->resume || parsed->control);
  h.control = true;
  parsed = session::Hello::parse(h.to_json(), session::Purpose::kMigration);
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_TRUE(parsed->recover && parsed->control);
  auto j = h.to_json();
  j["resume"] = true;
  auto r = session::Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("hello.recover"), std::string::npos) << r.error().message;
  j = h.to_json();
  j["index"] = 1;  // a recovery's control connection is index 0, as a resumed one
  r = session::Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("hello.control"), std::string::npos) << r.error().message;
  j = h.to_json();
  j["recover"] = 1;
  EXPECT_NE(session::Hello::parse(j, session::Purpose::kMigration).error().message.find("hello.recover: expected a boolean"), std::string::npos);
  EXPECT_FALSE(session::Hello{}.to_json().contains("recover"));
}

TEST(ProtocolHostile, AHelloOfAnotherPurposeIsRefusedNamingTheKinds) {
  // One codec, one type: a hello is read for the purpose of the registry it reached, and a kind
  // of another purpose is refused at hello.kind, never read with another purpose's fields.
  auto control = full_control_hello().to_json();
  auto r = session::Hello::parse(control, session::Purpose::kPathCheck);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message, "hello.kind: expected pathcheck-control or pathcheck-data, got 'control'");
  control["kind"] = "flow";
  EXPECT_EQ(session::Hello::parse(control, session::Purpose::kMigration).error().message,
            "hello.kind: expected control or data, got 'flow'");
  auto flow = full_flow_hello().to_json();
  flow["kind"] = "control";
  EXPECT_EQ(session::Hello::parse(flow, session::Purpose::kFlow).error().message,
            "hello.kind: expected flow or flow-data, got 'control'");
  flow["kind"] = 5;
  EXPECT_EQ(session::Hello::parse(flow, session::Purpose::kFlow).error().message, "hello.kind: must be a string");
  // A flow hello reaching the migration registry has no "type": refused before any field.
  EXPECT_EQ(session::Hello::parse(full_flow_hello().to_json(), session::Purpose::kMigration).error().message,
            "hello.type: required");
  EXPECT_EQ(session::Hello::parse(json::array(), session::Purpose::kFlow).error().message, "expected a hello");
}

TEST(ProtocolHostile, ATruncatedHelloOfEachPurposeNamesTheMissingField) {
  for (const char* key : {"session", "nonce", "mode", "migrationUid", "sourceNode", "targetNode", "chunkSize", "ringDepth",
                          "transport"}) {
    auto flow = full_flow_hello().to_json();
    flow.erase(key);
    auto r = session::Hello::parse(flow, session::Purpose::kFlow);
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_EQ(r.error().message, std::string("hello.") + key + ": required");
  }
  session::Hello fd;
  fd.kind = session::HelloKind::kFlowData;
  fd.session = kNonceB;
  fd.nonce = kNonceA;
  for (const char* key : {"session", "index", "nonce"}) {
    auto j = fd.to_json();
    j.erase(key);
    EXPECT_EQ(session::Hello::parse(j, session::Purpose::kFlow).error().message, std::string("hello.") + key + ": required");
  }
  for (const char* key : {"migrationId", "nonce", "channels", "chunkSize", "ringDepth", "transport"}) {
    auto j = full_control_hello().to_json();
    j.erase(key);
    EXPECT_EQ(session::Hello::parse(j, session::Purpose::kMigration).error().message, std::string("hello.") + key + ": required");
  }
}

TEST(ProtocolGolden, PathCheckAndProbeHellosAreByteIdentical) {
  // A path check's hellos are a migration's fields under the path check's kinds (the previous
  // release rewrote "kind" after serialising a migration hello: the same bytes).
  session::Hello h = full_control_hello();
  h.kind = session::HelloKind::kPathcheckControl;
  EXPECT_EQ(h.to_json().dump(), R"({"channels":5,"chunkSize":1048576,"kind":"pathcheck-control","migrationId":"m-1","nonce":"0123456789abcdef0123456789abcdef","protocol":3,"rdmaMtu":4096,"rdmaRails":[{"address":"10.0.0.1","mtu":4096,"rail":0},{"address":"10.0.1.1","rail":1}],"ringDepth":8,"tls":true,"transport":"rdma","transportRequired":true,"type":"hello","verifyChunks":true})");
  auto back = session::Hello::parse(h.to_json(), session::Purpose::kPathCheck);
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back->kind, session::HelloKind::kPathcheckControl);
  EXPECT_EQ(back->purpose(), session::Purpose::kPathCheck);
  EXPECT_EQ(back->to_json(), h.to_json());
  session::Hello d;
  d.kind = session::HelloKind::kPathcheckData;
  d.migration_id = "pc-1";
  d.session = "s-1";
  d.index = 2;
  d.nonce = kNonceA;
  EXPECT_EQ(d.to_json().dump(), R"({"index":2,"kind":"pathcheck-data","migrationId":"pc-1","nonce":"0123456789abcdef0123456789abcdef","protocol":3,"session":"s-1","type":"hello"})");
  auto dback = session::Hello::parse(d.to_json(), session::Purpose::kPathCheck);
  ASSERT_TRUE(dback.ok()) << dback.error().message;
  EXPECT_EQ(dback->kind, session::HelloKind::kPathcheckData);
  EXPECT_EQ(dback->index, 2u);
  session::Hello probe;
  probe.kind = session::HelloKind::kProbe;
  EXPECT_EQ(probe.to_json().dump(), R"({"kind":"probe","protocol":3})");
}

TEST(ProtocolHostile, AnotherVersionIsRefusedAtTheHelloNamingBoth) {
  for (uint64_t v : {2u, 4u}) {
    auto hello = full_control_hello().to_json();
    hello["protocol"] = v;
    auto r = session::Hello::parse(hello, session::Purpose::kMigration);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, Errc::kProtocol);
    EXPECT_EQ(r.error().message, "hello.protocol: peer speaks version " + std::to_string(v) + ", this agent 3");
  }
  auto zero = full_control_hello().to_json();
  zero["protocol"] = 0;
  EXPECT_EQ(session::Hello::parse(zero, session::Purpose::kMigration).error().message, "hello.protocol: must be between 1 and 1000, got 0");
  auto flow = full_flow_hello().to_json();
  flow["protocol"] = 5;
  auto f = session::Hello::parse(flow, session::Purpose::kFlow);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.error().code, Errc::kInvalidArgument);
  EXPECT_EQ(f.error().message, "hello.protocol: this agent speaks 6, got 5");
  session::Hello fd;
  fd.kind = session::HelloKind::kFlowData;
  fd.session = kNonceB;
  fd.nonce = kNonceA;
  auto data = fd.to_json();
  data["protocol"] = 7;
  EXPECT_EQ(session::Hello::parse(data, session::Purpose::kFlow).error().message, "hello.protocol: this agent speaks 6, got 7");
  data.erase("protocol");
  EXPECT_EQ(session::Hello::parse(data, session::Purpose::kFlow).error().message, "hello.protocol: required");
  // The RDMA connect request's own version.
  transport::rdma::ConnectRequest req;
  auto raw = req.encode();
  raw[4] = 1;
  raw[5] = 0;
  EXPECT_EQ(transport::rdma::ConnectRequest::decode(raw).error().message,
            "rdma connect request: private data version 1, this agent speaks 2 (upgrade both agents)");
}
