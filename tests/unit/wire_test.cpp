#include <gtest/gtest.h>
#include <sys/socket.h>

#include "common/fd.h"
#include "transport/wire.h"

using namespace rdmig;
using namespace rdmig::transport;
using nlohmann::json;

namespace {
Hello control_hello() {
  Hello h;
  h.kind = "control";
  h.migration_id = "m-1";
  h.channels = 5;
  h.chunk_size = 4 << 20;
  h.ring_depth = 16;
  h.transport = "tcp";
  return h;
}
}  // namespace

TEST(Wire, ControlHelloRoundTrips) {
  auto parsed = Hello::parse(control_hello().to_json());
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_EQ(parsed->channels, 5u);
  EXPECT_EQ(parsed->chunk_size, 4u << 20);
  // The one-time token is never on the wire: the hello does not carry it.
  EXPECT_FALSE(control_hello().to_json().contains("token"));
}

TEST(Wire, ControlProofBindsTokenNonceAndMigration) {
  const auto p = control_proof("secret-token-123", "nonce-a", "m-1");
  EXPECT_EQ(p.size(), 64u);
  EXPECT_EQ(p, control_proof("secret-token-123", "nonce-a", "m-1"));
  EXPECT_NE(p, control_proof("secret-token-124", "nonce-a", "m-1"));
  EXPECT_NE(p, control_proof("secret-token-123", "nonce-b", "m-1"));
  EXPECT_NE(p, control_proof("secret-token-123", "nonce-a", "m-2"));
  EXPECT_EQ(p.find("secret"), std::string::npos);
}

TEST(Wire, HelloErrorsNameTheField) {
  auto j = control_hello().to_json();
  j["chunkSize"] = 3 << 20;
  auto r = Hello::parse(j);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("hello.chunkSize"), std::string::npos) << r.error().message;
  j = control_hello().to_json();
  j["channels"] = 0;
  EXPECT_NE(Hello::parse(j).error().message.find("hello.channels"), std::string::npos);
  j = control_hello().to_json();
  j["transport"] = "carrier-pigeon";
  EXPECT_NE(Hello::parse(j).error().message.find("hello.transport"), std::string::npos);
  j = control_hello().to_json();
  j.erase("migrationId");
  EXPECT_NE(Hello::parse(j).error().message.find("hello.migrationId"), std::string::npos);
  j = control_hello().to_json();
  j["protocol"] = 1;  // an agent that still sends its token in the hello
  EXPECT_EQ(Hello::parse(j).error().code, Errc::kProtocol);
}

TEST(Wire, MessagesCrossASocketAndOversizedLengthIsRefused) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  ASSERT_TRUE(send_message(a.get(), json{{"type", "ready"}}).ok());
  auto m = recv_message(b.get(), std::chrono::seconds(1));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)["type"], "ready");
  const unsigned char huge[4] = {0xff, 0xff, 0xff, 0x7f};
  ASSERT_EQ(::send(a.get(), huge, 4, 0), 4);
  auto r = recv_message(b.get(), std::chrono::seconds(1));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::kProtocol);
}

TEST(Wire, ReceiveTimesOutWhenPeerIsSilent) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  auto r = recv_message(b.get(), std::chrono::milliseconds(50));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::kTimeout);
}

TEST(Wire, ControlHelloCarriesTheRdmaMtuWhenOfferedAndChecksIt) {
  auto h = control_hello();
  EXPECT_FALSE(h.to_json().contains("rdmaMtu")) << "0 = not offered: not on the wire";
  EXPECT_EQ(Hello::parse(h.to_json())->rdma_mtu, 0u);
  h.rdma_mtu = 1024;
  auto parsed = Hello::parse(h.to_json());
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_EQ(parsed->rdma_mtu, 1024u);
  for (int bad : {1500, 128, 8192, 0}) {
    auto j = h.to_json();
    j["rdmaMtu"] = bad;
    auto r = Hello::parse(j);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("hello.rdmaMtu"), std::string::npos) << r.error().message;
  }
}

TEST(Wire, ControlHelloCarriesTheSourcesRailsAndValidatesThem) {
  Hello h = control_hello();
  h.transport = "rdma";
  h.rdma_rails = {{0, "10.99.0.1"}, {1, "10.99.2.1"}};
  auto back = Hello::parse(h.to_json());
  ASSERT_TRUE(back.ok()) << back.error().message;
  ASSERT_EQ(back->rdma_rails.size(), 2u);
  EXPECT_EQ(back->rdma_rails[1].rail, 1u);
  EXPECT_EQ(back->rdma_rails[1].address, "10.99.2.1");
  EXPECT_TRUE(Hello::parse(control_hello().to_json())->rdma_rails.empty()) << "a one-device source sends none";
  auto j = h.to_json();
  j["rdmaRails"][1]["rail"] = 0;
  auto dup = Hello::parse(j);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.error().message.find("hello.rdmaRails[1]"), std::string::npos) << dup.error().message;
  j["rdmaRails"] = "10.99.0.1";
  EXPECT_FALSE(Hello::parse(j).ok());
  j["rdmaRails"] = json::array({json{{"rail", 99}, {"address", "10.99.0.1"}}});
  auto range = Hello::parse(j);
  ASSERT_FALSE(range.ok());
  EXPECT_NE(range.error().message.find("hello.rdmaRails[0].rail"), std::string::npos) << range.error().message;
}

// verifyChunks rides in the control hello only when asked for (a hello without it is what every
// earlier agent of this protocol sends), and only as a boolean.
TEST(Wire, ControlHelloCarriesVerifyChunksOnlyWhenAsked) {
  auto h = control_hello();
  EXPECT_FALSE(h.to_json().contains("verifyChunks"));
  auto parsed = Hello::parse(h.to_json());
  ASSERT_TRUE(parsed.ok());
  EXPECT_FALSE(parsed->verify_chunks);
  h.verify_chunks = true;
  auto j = h.to_json();
  EXPECT_EQ(j["verifyChunks"], true);
  parsed = Hello::parse(j);
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_TRUE(parsed->verify_chunks);
  j["verifyChunks"] = 1;
  parsed = Hello::parse(j);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.error().message.find("hello.verifyChunks"), std::string::npos) << parsed.error().message;
}
