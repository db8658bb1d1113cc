#include <gtest/gtest.h>
#include <sys/socket.h>

#include <thread>

#include "common/fd.h"
#include "common/units.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"

using namespace rdmig;
using namespace rdmig::transport;
using nlohmann::json;
using session::Hello;

namespace {
Hello control_hello() {
  Hello h;
  h.kind = session::HelloKind::kControl;
  h.migration_id = "m-1";
  h.channels = 5;
  h.chunk_size = 4 << 20;
  h.ring_depth = 16;
  h.transport = "tcp";
  h.nonce = "0123456789abcdef0123456789abcdef";
  return h;
}
}  // namespace

TEST(Wire, ControlHelloRoundTrips) {
  auto parsed = Hello::parse(control_hello().to_json(), session::Purpose::kMigration);
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_EQ(parsed->channels, 5u);
  EXPECT_EQ(parsed->chunk_size, 4u << 20);
  // The one-time token is never on the wire: the hello does not carry it.
  EXPECT_FALSE(control_hello().to_json().contains("token"));
}

TEST(Wire, ControlProofBindsTokenBothNoncesAndMigration) {
  const auto p = control_proof("secret-token-123", "nonce-a", "m-1", "src-1");
  EXPECT_EQ(p.size(), 64u);
  EXPECT_EQ(p, control_proof("secret-token-123", "nonce-a", "m-1", "src-1"));
  EXPECT_NE(p, control_proof("secret-token-124", "nonce-a", "m-1", "src-1"));
  EXPECT_NE(p, control_proof("secret-token-123", "nonce-b", "m-1", "src-1"));
  EXPECT_NE(p, control_proof("secret-token-123", "nonce-a", "m-2", "src-1"));
  EXPECT_NE(p, control_proof("secret-token-123", "nonce-a", "m-1", "src-2")) << "the source's nonce is covered";
  EXPECT_EQ(p.find("secret"), std::string::npos);
}

TEST(Wire, HelloErrorsNameTheField) {
  auto j = control_hello().to_json();
  j["chunkSize"] = 3 << 20;
  auto r = Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("hello.chunkSize"), std::string::npos) << r.error().message;
  j = control_hello().to_json();
  j["channels"] = 0;
  EXPECT_NE(Hello::parse(j, session::Purpose::kMigration).error().message.find("hello.channels"), std::string::npos);
  j = control_hello().to_json();
  j["transport"] = "carrier-pigeon";
  EXPECT_NE(Hello::parse(j, session::Purpose::kMigration).error().message.find("hello.transport"), std::string::npos);
  j = control_hello().to_json();
  j.erase("migrationId");
  EXPECT_NE(Hello::parse(j, session::Purpose::kMigration).error().message.find("hello.migrationId"), std::string::npos);
  j = control_hello().to_json();
  j["protocol"] = 1;  // an agent that still sends its token in the hello
  EXPECT_EQ(Hello::parse(j, session::Purpose::kMigration).error().code, Errc::kProtocol);
  j["protocol"] = 2;  // an agent whose data channels prove nothing: refused naming both versions
  EXPECT_NE(Hello::parse(j, session::Purpose::kMigration).error().message.find("peer speaks version 2, this agent 3"), std::string::npos)
      << Hello::parse(j, session::Purpose::kMigration).error().message;
  j = control_hello().to_json();
  j.erase("nonce");
  EXPECT_NE(Hello::parse(j, session::Purpose::kMigration).error().message.find("hello.nonce"), std::string::npos);
  j["nonce"] = "ABC";
  EXPECT_NE(Hello::parse(j, session::Purpose::kMigration).error().message.find("hello.nonce"), std::string::npos);
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
  EXPECT_EQ(Hello::parse(h.to_json(), session::Purpose::kMigration)->rdma_mtu, 0u);
  h.rdma_mtu = 1024;
  auto parsed = Hello::parse(h.to_json(), session::Purpose::kMigration);
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_EQ(parsed->rdma_mtu, 1024u);
  for (int bad : {1500, 128, 8192, 0}) {
    auto j = h.to_json();
    j["rdmaMtu"] = bad;
    auto r = Hello::parse(j, session::Purpose::kMigration);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("hello.rdmaMtu"), std::string::npos) << r.error().message;
  }
}

TEST(Wire, ControlHelloCarriesTheSourcesRailsAndValidatesThem) {
  Hello h = control_hello();
  h.transport = "rdma";
  h.rdma_rails = {{0, "10.99.0.1"}, {1, "10.99.2.1"}};
  auto back = Hello::parse(h.to_json(), session::Purpose::kMigration);
  ASSERT_TRUE(back.ok()) << back.error().message;
  ASSERT_EQ(back->rdma_rails.size(), 2u);
  EXPECT_EQ(back->rdma_rails[1].rail, 1u);
  EXPECT_EQ(back->rdma_rails[1].address, "10.99.2.1");
  EXPECT_TRUE(Hello::parse(control_hello().to_json(), session::Purpose::kMigration)->rdma_rails.empty()) << "a one-device source sends none";
  auto j = h.to_json();
  j["rdmaRails"][1]["rail"] = 0;
  auto dup = Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.error().message.find("hello.rdmaRails[1]"), std::string::npos) << dup.error().message;
  j["rdmaRails"] = "10.99.0.1";
  EXPECT_FALSE(Hello::parse(j, session::Purpose::kMigration).ok());
  j["rdmaRails"] = json::array({json{{"rail", 99}, {"address", "10.99.0.1"}}});
  auto range = Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(range.ok());
  EXPECT_NE(range.error().message.find("hello.rdmaRails[0].rail"), std::string::npos) << range.error().message;
}

// verifyChunks rides in the control hello only when asked for (a hello without it is what every
// earlier agent of this protocol sends), and only as a boolean.
TEST(Wire, ControlHelloCarriesVerifyChunksOnlyWhenAsked) {
  auto h = control_hello();
  EXPECT_FALSE(h.to_json().contains("verifyChunks"));
  auto parsed = Hello::parse(h.to_json(), session::Purpose::kMigration);
  ASSERT_TRUE(parsed.ok());
  EXPECT_FALSE(parsed->verify_chunks);
  h.verify_chunks = true;
  auto j = h.to_json();
  EXPECT_EQ(j["verifyChunks"], true);
  parsed = Hello::parse(j, session::Purpose::kMigration);
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_TRUE(parsed->verify_chunks);
  j["verifyChunks"] = 1;
  parsed = Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.error().message.find("hello.verifyChunks"), std::string::npos) << parsed.error().message;
}

// ---- transport/channel_proof.h: every data channel proves the session's key ----
namespace {
std::pair<UniqueFd, UniqueFd> channel_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}
const std::string kSession = "00112233445566778899aabbccddeeff";
ChannelTerms terms(const std::string& key, uint32_t index = 2, const std::string& session = kSession) {
  return ChannelTerms{key, session, index};
}
struct Exchange {
  Status dialler = ok_status();
  Result<std::string> acceptor = std::string();
};
// One real exchange over a socket pair: the dialler proves `dial`, the acceptor checks `accept`.
Exchange exchange(const ChannelTerms& dial, const ChannelTerms& accept) {
  auto [d, a] = channel_pair();
  Exchange out;
  std::thread acceptor([&, fd = a.get()] {
    auto hello = recv_message(fd, std::chrono::seconds(5));
    ASSERT_TRUE(hello.ok());
    out.acceptor = check_channel(fd, accept, hello->value("nonce", ""), std::chrono::seconds(5));
    if (out.acceptor) (void)send_message(fd, json{{"type", "welcome"}, {"proof", out.acceptor.value()}});
  });
  out.dialler = prove_channel(d.get(), json{{"kind", "data"}}, dial, std::chrono::seconds(5));
  acceptor.join();
  return out;
}
}  // namespace

TEST(ChannelProof, TheKeyComesFromTheTokenAndBothNoncesAndNeverShowsTheToken) {
  const auto k = channel_key("secret-token", "n-src", "n-dst", kSession);
  EXPECT_EQ(k.size(), 64u);
  EXPECT_EQ(k.find("secret"), std::string::npos);
  EXPECT_NE(k, channel_key("other-token", "n-src", "n-dst", kSession));
  EXPECT_NE(k, channel_key("secret-token", "n-src2", "n-dst", kSession));
  EXPECT_NE(k, channel_key("secret-token", "n-src", "n-dst2", kSession));
  EXPECT_NE(k, channel_key("secret-token", "n-src", "n-dst", "ff" + kSession.substr(2)));
  // Not the flow control link's key over the same nonces (another purpose).
  EXPECT_NE(k, derive_session_key("secret-token", "rdmig-flow-key", "n-src", "n-dst", kSession));
}

TEST(ChannelProof, TheMacBindsSessionIndexDirectionKeyAndFreshPart) {
  const auto t = terms("k");
  const auto m = channel_mac(t, ProofBy::kDialler, "fresh");
  EXPECT_EQ(m, channel_mac(t, ProofBy::kDialler, "fresh"));
  EXPECT_NE(m, channel_mac(t, ProofBy::kAcceptor, "fresh")) << "direction";
  EXPECT_NE(m, channel_mac(terms("k", 3), ProofBy::kDialler, "fresh")) << "index";
  EXPECT_NE(m, channel_mac(terms("k", 2, "ff" + kSession.substr(2)), ProofBy::kDialler, "fresh")) << "session";
  EXPECT_NE(m, channel_mac(terms("k2"), ProofBy::kDialler, "fresh")) << "key";
  EXPECT_NE(m, channel_mac(t, ProofBy::kDialler, "fresh2")) << "fresh part";
  EXPECT_TRUE(mac_equal(m, m));
  EXPECT_FALSE(mac_equal(std::span(m).first(16), m)) << "truncated";
  EXPECT_FALSE(mac_equal({}, {}));
}

TEST(ChannelProof, ADiallerWithTheKeyIsAdmittedAndTheAcceptorProvesItBack) {
  const auto k = channel_key("tok", "a", "b", kSession);
  auto ok = exchange(terms(k), terms(k));
  EXPECT_TRUE(ok.dialler) << ok.dialler.error().message;
  ASSERT_TRUE(ok.acceptor) << ok.acceptor.error().message;
  EXPECT_EQ(ok.acceptor->size(), 64u);
}

TEST(ChannelProof, WrongKeyIndexOrSessionIsRefusedNamingTheProof) {
  const auto k = channel_key("tok", "a", "b", kSession);
  for (const auto& [dial, why] : {std::pair{terms(channel_key("not-the-token", "a", "b", kSession)), "wrong key"},
                                  std::pair{terms(k, 3), "wrong index"},
                                  std::pair{terms(k, 2, "ff" + kSession.substr(2)), "wrong session"}}) {
    auto r = exchange(dial, terms(k));
    ASSERT_FALSE(r.acceptor) << why;
    EXPECT_EQ(r.acceptor.error().code, Errc::kPermissionDenied) << why;
    EXPECT_NE(r.acceptor.error().message.find("auth.proof"), std::string::npos) << r.acceptor.error().message;
    ASSERT_FALSE(r.dialler) << why;
    EXPECT_NE(r.dialler.error().message.find("refused"), std::string::npos) << r.dialler.error().message;
  }
}

TEST(ChannelProof, ATruncatedOrReplayedProofIsRefused) {
  const auto k = channel_key("tok", "a", "b", kSession);
  const std::string dnonce = "0123456789abcdef0123456789abcdef";
  // A dialler as an observer would be: it replays what it saw on an earlier connection.
  std::string seen_proof;
  for (int round = 0; round < 3; ++round) {
    auto [d, a] = channel_pair();
    Result<std::string> checked = std::string();
    std::thread acceptor([&, fd = a.get()] { checked = check_channel(fd, terms(k), dnonce, std::chrono::seconds(5)); });
    auto challenge = recv_message(d.get(), std::chrono::seconds(5));
    ASSERT_TRUE(challenge.ok());
    const std::string anonce = challenge->value("nonce", "");
    const auto mac = channel_mac(terms(k), ProofBy::kDialler, dnonce + "\n" + anonce);
    const std::string good = to_hex(mac.data(), mac.size());
    std::string sent = good;
    if (round == 1) sent = seen_proof;          // replayed from round 0
    if (round == 2) sent = good.substr(0, 32);  // truncated
    ASSERT_TRUE(send_message(d.get(), json{{"type", "auth"}, {"proof", sent}}));
    acceptor.join();
    if (round == 0) {
      EXPECT_TRUE(checked) << checked.error().message;
      seen_proof = good;
    } else {
      ASSERT_FALSE(checked) << "round " << round;
      EXPECT_EQ(checked.error().code, Errc::kPermissionDenied);
      auto reject = recv_message(d.get(), std::chrono::seconds(5));
      ASSERT_TRUE(reject.ok());
      EXPECT_EQ(reject->value("type", ""), "reject");
      EXPECT_NE(reject->value("message", "").find("auth.proof"), std::string::npos);
    }
  }
}

TEST(ChannelProof, ADiallerRefusesAWelcomeThatDoesNotProveTheKey) {
  const auto k = channel_key("tok", "a", "b", kSession);
  // An acceptor without the key reflects the dialler's own proof (the wrong direction).
  auto [d, a] = channel_pair();
  std::thread fake([fd = a.get()] {
    (void)recv_message(fd, std::chrono::seconds(5));
    (void)send_message(fd, json{{"type", "challenge"}, {"nonce", "fedcba9876543210fedcba9876543210"}});
    auto auth = recv_message(fd, std::chrono::seconds(5));
    (void)send_message(fd, json{{"type", "welcome"}, {"proof", auth ? auth->value("proof", "") : ""}});
  });
  auto st = prove_channel(d.get(), json{{"kind", "data"}}, terms(k), std::chrono::seconds(5));
  fake.join();
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("welcome.proof"), std::string::npos) << st.error().message;
}

TEST(Wire, AControlResumeHelloIsAResumeWithIndexZeroOnly) {
  Hello h;
  h.kind = session::HelloKind::kData;
  h.migration_id = "m-1";
  h.session = std::string(32, 'a');
  h.nonce = std::string(32, 'b');
  h.resume = true;
  h.control = true;
  auto parsed = Hello::parse(h.to_json(), session::Purpose::kMigration);
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  EXPECT_TRUE(parsed->control && parsed->resume);
  auto j = h.to_json();
  j.erase("resume");  // a control hello that resumes nothing
  auto r = Hello::parse(j, session::Purpose::kMigration);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("hello.control"), std::string::npos) << r.error().message;
  j = h.to_json();
  j["index"] = 3;
  EXPECT_FALSE(Hello::parse(j, session::Purpose::kMigration).ok());
  j = h.to_json();
  j["control"] = "yes";
  EXPECT_NE(Hello::parse(j, session::Purpose::kMigration).error().message.find("hello.control: expected a boolean"), std::string::npos);
}
