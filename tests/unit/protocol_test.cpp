// The agent-to-agent protocol in one place (docs/protocol.md).
// Golden: the exact bytes of every hello and handshake message for fixed inputs, and of the MACs
// computed over them, as the agents produce them today: an agent of the previous release must keep
// reading them (the flow's proofs hash the hello's dump(), so one reordered key breaks every flow).
// Hostile: truncated, oversized, unknown kind, wrong state, replayed, wrong version; each refused
// with the error the agents give today.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <thread>

#include "common/fd.h"
#include "kubevirt/flow_protocol.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"

using namespace rdmig;
using nlohmann::json;

namespace {

constexpr const char* kNonceA = "0123456789abcdef0123456789abcdef";
constexpr const char* kNonceB = "fedcba9876543210fedcba9876543210";

transport::Hello full_control_hello() {
  transport::Hello h;
  h.kind = "control";
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

kubevirt::FlowHello full_flow_hello() {
  kubevirt::FlowHello h;
  h.session = kNonceB;
  h.nonce = kNonceA;
  h.mode = "hook";
  h.vmi = kubevirt::VmiRef{"ns", "vm-1", "uid-1"};
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
  transport::Hello minimal;
  minimal.kind = "control";
  minimal.migration_id = "m-1";
  minimal.nonce = kNonceA;
  minimal.channels = 1;
  minimal.chunk_size = 1 << 20;
  minimal.ring_depth = 2;
  minimal.transport = "tcp";
  EXPECT_EQ(minimal.to_json().dump(), R"({"channels":1,"chunkSize":1048576,"kind":"control","migrationId":"m-1","nonce":"0123456789abcdef0123456789abcdef","protocol":3,"ringDepth":2,"transport":"tcp","transportRequired":false,"type":"hello"})");
  transport::Hello data;
  data.kind = "data";
  data.migration_id = "m-1";
  data.session = "s-1";
  data.index = 3;
  data.tls = true;
  EXPECT_EQ(data.to_json().dump(), R"({"index":3,"kind":"data","migrationId":"m-1","protocol":3,"session":"s-1","tls":true,"type":"hello"})");
}

TEST(ProtocolGolden, FlowHellosAreByteIdenticalAndSoAreTheirProofs) {
  EXPECT_EQ(full_flow_hello().to_json().dump(), R"({"chunkSize":4194304,"kind":"flow","migrationUid":"mig-uid","mode":"hook","nonce":"0123456789abcdef0123456789abcdef","protocol":6,"rdmaRails":[{"address":"10.0.2.1","mtu":1024,"rail":2}],"ringDepth":16,"session":"fedcba9876543210fedcba9876543210","sourceNode":"node-a","targetNode":"node-b","transport":"tcp","transportRequired":false,"vmi":{"name":"vm-1","namespace":"ns","uid":"uid-1"}})");
  kubevirt::FlowHello bare = full_flow_hello();
  bare.vmi = {};
  bare.rdma_rails.clear();
  bare.mode = "static";
  bare.transport_required = true;
  EXPECT_EQ(bare.to_json().dump(), R"({"chunkSize":4194304,"kind":"flow","migrationUid":"mig-uid","mode":"static","nonce":"0123456789abcdef0123456789abcdef","protocol":6,"ringDepth":16,"session":"fedcba9876543210fedcba9876543210","sourceNode":"node-a","targetNode":"node-b","transport":"tcp","transportRequired":true})");
  kubevirt::FlowDataHello data;
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
  EXPECT_EQ(signer.sign(json{{"type", "heartbeat"}}).dump(), R"({"mac":"4921c49752b6fa765792157c64807f67d9fe22e14324a46431aab4afb1b67b2c","seq":0,"type":"heartbeat"})");
}

TEST(ProtocolGolden, ControlProofIsByteIdentical) {
  EXPECT_EQ(transport::control_proof("tok", kNonceB, "m-1", kNonceA), R"(da6783848832b064e55b030be736a73123016d82fb95ea0b64893877a120d901)");
}

// Every message kind as the agents build it (with fixed field values), byte for byte.
TEST(ProtocolGolden, HandshakeAndSessionMessagesAreByteIdentical) {
  const std::vector<std::pair<json, std::string>> cases = {
      {json{{"type", "challenge"}, {"nonce", kNonceB}}, R"({"nonce":"fedcba9876543210fedcba9876543210","type":"challenge"})"},
      {json{{"type", "challenge"}, {"nonce", kNonceB}, {"proofs", json::array({"p1", "p2"})}}, R"({"nonce":"fedcba9876543210fedcba9876543210","proofs":["p1","p2"],"type":"challenge"})"},
      {json{{"type", "auth"}, {"proof", "mac"}}, R"({"proof":"mac","type":"auth"})"},
      {json{{"type", "auth"}, {"mac", "mac"}}, R"({"mac":"mac","type":"auth"})"},
      {json{{"type", "welcome"}, {"session", "s-1"}, {"transport", "tcp"}, {"transportReason", "why"}}, R"({"session":"s-1","transport":"tcp","transportReason":"why","type":"welcome"})"},
      {json{{"type", "welcome"}, {"proof", "mac"}}, R"({"proof":"mac","type":"welcome"})"},
      {json{{"type", "reject"}, {"code", "invalid_argument"}, {"message", "no"}}, R"({"code":"invalid_argument","message":"no","type":"reject"})"},
      {json{{"type", "reject"}, {"message", "rdma is required here"}}, R"({"message":"rdma is required here","type":"reject"})"},
      {json{{"type", "fallback"}, {"transport", "tcp"}, {"error", "unreachable"}}, R"({"error":"unreachable","transport":"tcp","type":"fallback"})"},
      {json{{"type", "fallback-ok"}}, R"({"type":"fallback-ok"})"},
      {json{{"type", "start"}, {"clockUs", 12}}, R"({"clockUs":12,"type":"start"})"},
      {json{{"type", "start"}, {"seed", 7}, {"bytes", 4096}}, R"({"bytes":4096,"seed":7,"type":"start"})"},
      {json{{"type", "ready"}, {"receivedClockUs", 1}, {"clockUs", 2}}, R"({"clockUs":2,"receivedClockUs":1,"type":"ready"})"},
      {json{{"type", "ready"}}, R"({"type":"ready"})"},
      {json{{"type", "ping"}, {"seq", 3}}, R"({"seq":3,"type":"ping"})"},
      {json{{"type", "pong"}, {"seq", 3}}, R"({"seq":3,"type":"pong"})"},
      {json{{"type", "pong"}}, R"({"type":"pong"})"},
      {json{{"type", "stream"}}, R"({"type":"stream"})"},
      {json{{"type", "result"}, {"ok", true}, {"state", "running"}, {"resumeTimestampUs", 5}}, R"({"ok":true,"resumeTimestampUs":5,"state":"running","type":"result"})"},
      {json{{"type", "goodbye"}}, R"({"type":"goodbye"})"},
      {json{{"type", "open"}, {"index", 1}, {"host", "10.0.0.2"}, {"port", 4444}}, R"({"host":"10.0.0.2","index":1,"port":4444,"type":"open"})"},
      {json{{"type", "end"}, {"bytesSent", 10}, {"bytesReceived", 20}}, R"({"bytesReceived":20,"bytesSent":10,"type":"end"})"},
      {json{{"type", "stats"}}, R"({"type":"stats"})"},
      {json{{"type", "heartbeat"}}, R"({"type":"heartbeat"})"},
      {json{{"type", "abort"}, {"reason", "gone"}}, R"({"reason":"gone","type":"abort"})"},
      {json{{"kind", "probe"}, {"protocol", transport::kProtocolVersion}}, R"({"kind":"probe","protocol":3})"},
  };
  for (const auto& [message, bytes] : cases) EXPECT_EQ(message.dump(), bytes);
}

