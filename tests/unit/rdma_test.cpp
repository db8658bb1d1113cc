// RDMA transport: wire encodings run everywhere (device selection: rdma_device_test.cpp); the channel tests
// need a usable RDMA device (Soft-RoCE in the test VM) and skip elsewhere.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <fstream>
#include <thread>

#include "common/units.h"
#include "metrics/metrics.h"
#include "transport/rdma/ack_watch.h"
#include "transport/rdma/cm.h"
#include "transport/rdma/imm.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/rdma/rdma_listener.h"

using namespace rdmig;
using namespace rdmig::transport::rdma;
namespace fs = std::filesystem;

TEST(RdmaImm, DataCreditEofAbortRoundTrip) {
  for (uint32_t len : {1u, 4096u, 1u << 20, 1u << 30}) {
    auto raw = encode_imm({ImmKind::kData, len});
    ASSERT_TRUE(raw.has_value());
    EXPECT_EQ(decode_imm(*raw).kind, ImmKind::kData);
    EXPECT_EQ(decode_imm(*raw).value, len);
  }
  EXPECT_FALSE(encode_imm({ImmKind::kData, 0}).has_value());
  EXPECT_FALSE(encode_imm({ImmKind::kData, (1u << 30) + 1}).has_value());
  auto c = decode_imm(*encode_imm({ImmKind::kCredit, 7}));
  EXPECT_EQ(c.kind, ImmKind::kCredit);
  EXPECT_EQ(c.value, 7u);
  EXPECT_EQ(decode_imm(*encode_imm({ImmKind::kEof, 0})).kind, ImmKind::kEof);
  EXPECT_EQ(decode_imm(*encode_imm({ImmKind::kAbort, 0})).kind, ImmKind::kAbort);
}

TEST(RdmaAckWatch, StallsOnlyWhenTheOldestSignalledWriteWaitsTooLong) {
  using namespace std::chrono_literals;
  using V = AckWatch::Verdict;
  AckWatch w(5000ms, 1000ms);
  w.reserve(4);
  const uint64_t s = 1'000'000'000;  // microseconds
  EXPECT_EQ(w.check(s, 0), V::kFine) << "nothing outstanding";
  w.posted(s, false);
  w.posted(s + 10, true);   // covers both
  w.posted(s + 20, false);
  EXPECT_EQ(w.check(s + 4'999'999, 3), V::kFine);
  EXPECT_EQ(w.check(s + 5'000'010, 3), V::kStalled) << "the oldest signalled write waited 5 s";
  EXPECT_EQ(w.oldest_wait_us(s + 5'000'010), 5'000'000);
  w.completed(s + 5'000'010);  // the signalled one came back: one unsignalled write left, posted at s+20
  EXPECT_EQ(w.check(s + 5'000'010, 1), V::kProbe) << "only unsignalled work, idle for 5 s: probe it";
  EXPECT_EQ(w.check(s + 500'000, 1), V::kFine) << "idle for less than probe_after";
  EXPECT_EQ(w.check(s + 5'000'010, 0), V::kFine) << "every write covered";
  w.posted(s + 5'000'020, true);  // the probe
  EXPECT_EQ(w.check(s + 5'000'030, 1), V::kFine);
  EXPECT_EQ(w.check(s + 10'000'020, 1), V::kStalled) << "the probe was not acknowledged either";
  // Completions pop in order: after two of three, the third's wait counts from its post or
  // from the last completion, whichever is later.
  AckWatch v(5000ms, 1000ms);
  v.reserve(3);
  v.posted(s, true);
  v.posted(s + 2'000'000, true);
  v.posted(s + 4'000'000, true);
  v.completed(s + 1'000'000);
  v.completed(s + 3'000'000);
  EXPECT_EQ(v.signaled_outstanding(), 1u);
  EXPECT_EQ(v.check(s + 8'999'999, 1), V::kFine);
  EXPECT_EQ(v.check(s + 9'000'000, 1), V::kStalled);
  // Big writes queued behind each other on a slow link (16 MiB at 6 MiB/s: one completion every
  // 2.7 s): each waits longer than `stall` since its post, yet the NIC acknowledges all along.
  AckWatch q(5000ms, 1000ms);
  q.reserve(4);
  for (int i = 0; i < 3; ++i) q.posted(s, true);
  q.completed(s + 2'700'000);
  q.completed(s + 5'400'000);
  EXPECT_EQ(q.check(s + 8'000'000, 1), V::kFine) << "the third write waited 8 s, 2.6 s since the last completion";
  EXPECT_EQ(q.check(s + 10'400'000, 1), V::kStalled) << "5 s without any completion";
  v.completed(s + 9'000'000);
  v.completed(s + 9'000'000);  // more completions than posts (a flushed queue): ignored
  EXPECT_EQ(v.signaled_outstanding(), 0u);
  // The ring wraps: many posts and completions through a small capacity.
  for (int i = 0; i < 100; ++i) {
    v.posted(s + 10'000'000 + static_cast<uint64_t>(i), true);
    v.completed(s + 10'000'000 + static_cast<uint64_t>(i));
  }
  EXPECT_EQ(v.check(s + 100'000'000, 0), V::kFine);
  // A clock read before the post (another thread's now) never looks like a long wait.
  v.posted(s + 200'000'000, true);
  EXPECT_EQ(v.check(s + 100'000'000, 1), V::kFine);
}

TEST(RdmaPrivateData, ConnectRequestAndReplyRoundTripWithinCmLimits) {
  ConnectRequest req;
  req.session = session_from_hex("00112233445566778899aabbccddeeff").value();
  req.index = 4;
  req.ring_addr = 0x7f0012345000;
  req.ring_rkey = 0xabcdef;
  sign_request(req, "key");
  auto raw = req.encode();
  EXPECT_EQ(raw.size(), kConnectRequestBytes);
  EXPECT_LE(raw.size(), 56u) << "rdma_connect(3): private data for RDMA_PS_TCP on IB/RoCE holds 56 bytes";
  raw.resize(56, 0);  // rdma_cm pads
  auto back = ConnectRequest::decode(raw);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->session, req.session);
  EXPECT_EQ(back->index, 4);
  EXPECT_EQ(back->ring_addr, req.ring_addr);
  EXPECT_EQ(back->ring_rkey, req.ring_rkey);
  EXPECT_EQ(back->nonce, req.nonce);
  EXPECT_EQ(back->proof, req.proof);
  ConnectReply rep{0x1000, 42, {}};
  sign_reply(rep, req, "key");
  EXPECT_LE(rep.encode().size(), 196u) << "rdma_accept(3): 196 bytes for RDMA_PS_TCP";
  auto r = ConnectReply::decode(rep.encode());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ring_addr, 0x1000u);
  EXPECT_EQ(r->ring_rkey, 42u);
  EXPECT_TRUE(check_reply(r.value(), req, "key"));
  std::vector<uint8_t> junk(56, 0xff);
  EXPECT_EQ(ConnectRequest::decode(junk).error().code, Errc::kProtocol);
  EXPECT_FALSE(session_from_hex("xyz").ok());
}

TEST(RdmaPrivateData, AnOlderAgentsRequestIsRefusedNamingBothVersions) {
  // Version 1 (no proof, 36 bytes) as an agent before the channel proof sent it.
  std::vector<uint8_t> v1{0x52, 0x44, 0x4d, 0x47, 1, 0, 0, 0};
  v1.resize(36, 0);
  auto r = ConnectRequest::decode(v1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("private data version 1, this agent speaks 2"), std::string::npos)
      << r.error().message;
}

namespace {
ConnectRequest signed_request(const std::string& key, uint16_t index = 3) {
  ConnectRequest req;
  req.session = session_from_hex("00112233445566778899aabbccddeeff").value();
  req.index = index;
  req.ring_addr = 0x7f0012345000;
  req.ring_rkey = 0x1234;
  sign_request(req, key);
  return ConnectRequest::decode(req.encode()).value();  // as the listener sees it
}
}  // namespace

TEST(RdmaPrivateData, TheTargetTakesOnlyARequestThatProvesTheKeyOnce) {
  const std::string key = transport::channel_key("tok", "src-nonce", "dst-nonce", "00112233445566778899aabbccddeeff");
  transport::ProofLedger ledger;
  const auto good = signed_request(key);
  EXPECT_TRUE(check_request(good, key, ledger));
  // Replayed (the same private data again, e.g. captured on the path): refused.
  auto replay = check_request(good, key, ledger);
  ASSERT_FALSE(replay);
  EXPECT_EQ(replay.error().code, Errc::kUnauthenticated);
  EXPECT_NE(replay.error().message.find("used before"), std::string::npos);
  auto refused = [&](ConnectRequest r, const std::string& k, const std::string& why) {
    transport::ProofLedger fresh;
    auto st = check_request(r, k, fresh);
    ASSERT_FALSE(st) << why;
    EXPECT_EQ(st.error().code, Errc::kUnauthenticated) << why;
    EXPECT_NE(st.error().message.find("does not prove"), std::string::npos) << why;
  };
  refused(signed_request("another key"), key, "wrong key (no token, or another session's)");
  auto other_index = good;
  other_index.index = 4;
  refused(other_index, key, "wrong index");
  auto other_session = good;
  other_session.session[0] ^= 1;
  refused(other_session, key, "wrong session");
  auto other_ring = good;
  other_ring.ring_rkey ^= 1;
  refused(other_ring, key, "another connection's parameters");
  auto other_nonce = good;
  other_nonce.nonce ^= 1;
  refused(other_nonce, key, "another nonce");
  auto zero = good;
  zero.proof = {};
  refused(zero, key, "no proof");
  // A reply's proof (the acceptor's) never passes as a request's, and the reverse.
  ConnectReply rep{good.ring_addr, good.ring_rkey, {}};
  sign_reply(rep, good, key);
  auto as_request = good;
  as_request.proof = rep.proof;
  refused(as_request, key, "the acceptor's proof as the dialler's");
  ConnectReply forged{0x1000, 42, good.proof};
  EXPECT_FALSE(check_reply(forged, good, key));
  // Two requests of one source differ (fresh nonce): both are taken.
  transport::ProofLedger l2;
  EXPECT_TRUE(check_request(signed_request(key), key, l2));
  EXPECT_TRUE(check_request(signed_request(key), key, l2));
}

// ---- Real verbs: need a device (the Soft-RoCE VM sets RDMIG_RDMA_IP). ----
namespace {
std::string rdma_ip() {
  const char* ip = std::getenv("RDMIG_RDMA_IP");
  return ip ? ip : "";
}
struct RdmaPair {
  std::unique_ptr<transport::Channel> client, server;
};
// Both ends bound to the device's address with a traffic class (DSCP 26), as the agents run them:
// rdma_set_option(RDMA_OPTION_ID_TOS) must be accepted on the listening, accepted and connecting ids.
// The listener checks each request's proof of `key` as the agents' owners do; `dial_key` is what
// the connecting side proves.
RdmaPair connect_rdma_pair(Metrics& m, uint32_t chunk, uint32_t depth, const std::array<uint8_t, 16>& session,
                  int tos = 104, const std::string& dial_key = "k-test", std::string* rejected = nullptr) {
  std::mutex mu;
  std::condition_variable cv;
  RdmaPair p;
  auto& tm = m.transport("rdma");
  const std::string key = "k-test";
  transport::ProofLedger ledger;
  auto listener = RdmaListener::create(rdma_ip(), 0, [&](const ConnectRequest& r) -> Result<AcceptPlan> {
    if (r.session != session) return Error{Errc::kPermissionDenied, "wrong session"};
    RDMIG_TRY(check_request(r, key, ledger));
    AcceptPlan plan{RdmaChannelParams{r.index, chunk, depth, chunk, depth}, &tm, key,
                    [&](Result<std::unique_ptr<transport::Channel>> ch) {
                      std::lock_guard l(mu);
                      if (ch) p.server = std::move(ch.value());
                      cv.notify_all();
                    }};
    return plan;
  }, tos);
  EXPECT_TRUE(listener.ok());
  auto c = RdmaChannel::connect({rdma_ip(), listener.value()->port()}, ChannelCredentials{session, dial_key},
                                RdmaChannelParams{0, chunk, depth, chunk, depth}, tm,
                                std::chrono::seconds(10), {}, RdmaConnectOptions{rdma_ip(), tos});
  if (rejected) {
    EXPECT_FALSE(c.ok());
    if (!c) *rejected = c.error().message;
    return p;
  }
  EXPECT_TRUE(c.ok()) << (c.ok() ? "" : c.error().message);
  if (c) p.client = std::move(c.value());
  std::unique_lock l(mu);
  cv.wait_for(l, std::chrono::seconds(10), [&] { return p.server != nullptr; });
  return p;
}
}  // namespace

TEST(RdmaChannel, CarriesChunksBothWaysAndReturnsCredits) {
  if (rdma_ip().empty()) GTEST_SKIP() << "no RDMA device here (set RDMIG_RDMA_IP; runs in the Soft-RoCE VM)";
  Metrics m;
  std::array<uint8_t, 16> session{1, 2, 3};
  auto p = connect_rdma_pair(m, 64 * 1024, 4, session);
  ASSERT_TRUE(p.client && p.server);
  for (int i = 0; i < 10; ++i) {  // more chunks than slots: credits must come back
    auto buf = p.client->acquire();
    ASSERT_TRUE(buf.ok()) << buf.error().message;
    std::memset(buf->data(), i, 1000 + i);
    ASSERT_TRUE(p.client->send(1000 + i).ok());
    auto got = p.server->receive();
    ASSERT_TRUE(got.ok()) << got.error().message;
    ASSERT_EQ(got->data.size(), static_cast<size_t>(1000 + i));
    EXPECT_EQ(got->data[999], static_cast<std::byte>(i));
    ASSERT_TRUE(p.server->release().ok());
  }
  auto back = p.server->acquire();
  ASSERT_TRUE(back.ok());
  (*back)[0] = std::byte{42};
  ASSERT_TRUE(p.server->send(1).ok());
  auto r = p.client->receive();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->data[0], std::byte{42});
  ASSERT_TRUE(p.client->release().ok());
  ASSERT_TRUE(p.client->send_eof().ok());
  auto eof = p.server->receive();
  ASSERT_TRUE(eof.ok());
  EXPECT_TRUE(eof->eof);
  ASSERT_TRUE(p.server->release().ok());
  EXPECT_TRUE(p.client->drain().ok());
}

TEST(RdmaChannel, ListenerRejectsUnknownSession) {
  if (rdma_ip().empty()) GTEST_SKIP() << "no RDMA device here (set RDMIG_RDMA_IP; runs in the Soft-RoCE VM)";
  Metrics m;
  auto listener = RdmaListener::create(rdma_ip(), 0, [](const ConnectRequest&) -> Result<AcceptPlan> {
    return Error{Errc::kPermissionDenied, "unknown session"};
  });
  ASSERT_TRUE(listener.ok());
  auto c = RdmaChannel::connect({rdma_ip(), listener.value()->port()}, ChannelCredentials{{9}, "k"},
                                RdmaChannelParams{0, 65536, 4, 65536, 4}, m.transport("rdma"), std::chrono::seconds(10));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("rejected"), std::string::npos) << c.error().message;
}

TEST(RdmaChannel, ListenerRejectsARequestThatDoesNotProveTheSessionsKey) {
  if (rdma_ip().empty()) GTEST_SKIP() << "no RDMA device here (set RDMIG_RDMA_IP; runs in the Soft-RoCE VM)";
  Metrics m;
  std::string why;
  auto p = connect_rdma_pair(m, 64 * 1024, 4, std::array<uint8_t, 16>{5}, 104, "not the key", &why);
  EXPECT_EQ(p.server, nullptr) << "no QP was accepted";
  EXPECT_NE(why.find("rejected"), std::string::npos) << why;
  EXPECT_NE(why.find("does not prove"), std::string::npos) << why;
}

TEST(RdmaChannel, PeerGoneFailsTheOtherSideWithAReasonAndCountsIt) {
  if (rdma_ip().empty()) GTEST_SKIP() << "no RDMA device here (set RDMIG_RDMA_IP; runs in the Soft-RoCE VM)";
  Metrics m;
  auto p = connect_rdma_pair(m, 64 * 1024, 4, std::array<uint8_t, 16>{7});
  ASSERT_TRUE(p.client && p.server);
  p.server.reset();  // disconnects without eof
  auto r = p.client->receive();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::kUnavailable) << r.error().message;
  // Counted by kind: a disconnect event, or a flushed/failed completion, whichever came first.
  // Both ends share `m` here, and the closing end may count its own disconnect too (1 or 2).
  const std::string text = m.serialize();
  const std::string disconnected = "rdmig_transport_errors_total{kind=\"disconnected\",transport=\"rdma\"} ";
  const auto at = text.find(disconnected);
  const bool counted = (at != std::string::npos && std::stod(text.substr(at + disconnected.size())) >= 1) ||
                       text.find("rdmig_transport_errors_total{kind=\"wc_") != std::string::npos;
  EXPECT_TRUE(counted) << r.error().message << "\n" << text.substr(at == std::string::npos ? 0 : at, 200);
  // Gone without an abort: the link's failure, which failover may resume (session/failover_channel.h).
  EXPECT_TRUE(p.client->link_failed()) << r.error().message;
}

TEST(RdmaChannel, AnAbortOfEitherEndIsNotALinkFailure) {
  if (rdma_ip().empty()) GTEST_SKIP() << "no RDMA device here (set RDMIG_RDMA_IP; runs in the Soft-RoCE VM)";
  Metrics m;
  auto p = connect_rdma_pair(m, 64 * 1024, 4, std::array<uint8_t, 16>{8});
  ASSERT_TRUE(p.client && p.server);
  p.server->abort(Error{Errc::kQemu, "the target QEMU failed"});
  auto r = p.client->receive();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("peer aborted"), std::string::npos) << r.error().message;
  EXPECT_FALSE(p.client->link_failed()) << r.error().message;
  EXPECT_FALSE(p.server->link_failed());
}
