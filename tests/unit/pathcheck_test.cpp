// The path check's synthetic stream: the pattern itself, and send/receive over real loopback
// TcpChannels, with a byte flipped at the receiver by a wrapping channel; the request bounds (the
// agent's pathCheck keys); the RDMA ports and rails a check reports, bounded against a hostile peer.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "api/models.h"
#include "common/net.h"
#include "metrics/metrics.h"
#include "pathcheck/check.h"
#include "pathcheck/pattern.h"
#include "pathcheck/stream.h"
#include "transport/tcp/tcp_channel.h"

using namespace rdmig;
using namespace rdmig::pathcheck;
using namespace std::chrono_literals;

namespace {

struct CheckPair {
  std::unique_ptr<transport::TcpChannel> a, b;
};

CheckPair connect_check_pair(Metrics& m, uint32_t chunk, uint32_t depth) {
  auto l = net::tcp_listen("127.0.0.1", 0);
  EXPECT_TRUE(l.ok());
  const uint16_t port = net::local_port(l->get()).value();
  auto c = net::tcp_connect({"127.0.0.1", port}, 2s);
  EXPECT_TRUE(c.ok());
  auto s = net::accept_for(l->get(), 2s);
  EXPECT_TRUE(s.ok());
  auto& tm = m.transport("tcp", "pathcheck");
  return CheckPair{transport::TcpChannel::create(std::move(c.value()), 0, chunk, depth, tm),
              transport::TcpChannel::create(std::move(s.value()), 0, chunk, depth, tm)};
}

// A receiving channel whose `nth` received chunk has one byte changed, as a fault on the path
// would change it: everything else passes through to the real channel.
class CorruptingChannel final : public transport::Channel {
 public:
  CorruptingChannel(transport::Channel& inner, uint64_t nth, size_t at) : inner_(inner), nth_(nth), at_(at) {}
  Result<std::span<std::byte>> acquire() override { return inner_.acquire(); }
  Status send(size_t n) override { return inner_.send(n); }
  void unacquire() override { inner_.unacquire(); }
  Status send_eof() override { return inner_.send_eof(); }
  Status drain() override { return inner_.drain(); }
  Result<transport::ChunkView> receive() override {
    auto c = inner_.receive();
    if (c && !c->eof && count_++ == nth_) {
      copy_.assign(c->data.begin(), c->data.end());
      copy_[at_ % copy_.size()] ^= std::byte{0x01};
      c->data = copy_;
    }
    return c;
  }
  Status release() override { return inner_.release(); }
  void abort(const Error& reason) override { inner_.abort(reason); }
  uint32_t index() const override { return inner_.index(); }
  size_t chunk_size() const override { return inner_.chunk_size(); }
  const char* transport() const override { return inner_.transport(); }

 private:
  transport::Channel& inner_;
  uint64_t nth_;
  size_t at_;
  uint64_t count_ = 0;
  std::vector<std::byte> copy_;
};

}  // namespace

TEST(PathCheckPattern, VerifiesWhatItFilledAtAnyOffsetAndLength) {
  for (uint64_t offset : {0ull, 1ull, 7ull, 8ull, 4097ull}) {
    std::vector<std::byte> buf(1000 + offset % 13);
    fill_pattern(buf, 42, offset);
    EXPECT_FALSE(verify_pattern(buf, 42, offset).has_value()) << offset;
    // The same bytes are not the stream at another offset or under another seed.
    EXPECT_TRUE(verify_pattern(buf, 43, offset).has_value());
    EXPECT_TRUE(verify_pattern(buf, 42, offset + 8).has_value());
  }
}

TEST(PathCheckPattern, PiecesFilledSeparatelyEqualTheWhole) {
  std::vector<std::byte> whole(300), parts(300);
  fill_pattern(whole, 7, 5);
  fill_pattern(std::span(parts).first(11), 7, 5);
  fill_pattern(std::span(parts).subspan(11), 7, 16);
  EXPECT_EQ(whole, parts);
}

TEST(PathCheckPattern, NamesTheFirstFlippedByte) {
  std::vector<std::byte> buf(4096);
  fill_pattern(buf, 9, 1 << 20);
  buf[1234] ^= std::byte{0x80};
  auto bad = verify_pattern(buf, 9, 1 << 20);
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->offset, (1u << 20) + 1234);
  EXPECT_EQ(bad->got, bad->expected ^ 0x80);
  EXPECT_NE(bad->describe().find("offset 1049810"), std::string::npos) << bad->describe();
}

TEST(PathCheckStream, CarriesAndVerifiesEveryByteOverTcp) {
  Metrics m;
  auto p = connect_check_pair(m, 64 * 1024, 4);
  const uint64_t total = 3 * 1024 * 1024 + 123;  // not a whole number of chunks
  std::atomic<uint64_t> sent{0}, verified{0}, chunks_sent{0}, chunks_received{0};
  Status rx = ok_status();
  std::thread receiver([&] { rx = receive_stream(*p.b, 77, total, verified, chunks_received); });
  auto tx = send_stream(*p.a, 77, total, sent, chunks_sent);
  receiver.join();
  EXPECT_TRUE(tx.ok()) << tx.error().message;
  EXPECT_TRUE(rx.ok()) << rx.error().message;
  EXPECT_EQ(sent.load(), total);
  EXPECT_EQ(verified.load(), total);
  EXPECT_EQ(chunks_sent.load(), 49u);  // 48 whole 64 KiB chunks and the rest
  EXPECT_EQ(chunks_received.load(), 49u);
}

TEST(PathCheckStream, DetectsAByteCorruptedOnThePath) {
  Metrics m;
  auto p = connect_check_pair(m, 64 * 1024, 4);
  const uint64_t total = 1024 * 1024;
  CorruptingChannel corrupt(*p.b, /*nth=*/5, /*at=*/321);
  std::atomic<uint64_t> sent{0}, verified{0}, chunks_sent{0}, chunks_received{0};
  Status rx = ok_status();
  std::thread receiver([&] {
    rx = receive_stream(corrupt, 5, total, verified, chunks_received);
    if (!rx) corrupt.abort(rx.error());  // as PathCheck::run_channels does: the sender stops
  });
  auto tx = send_stream(*p.a, 5, total, sent, chunks_sent);
  receiver.join();
  ASSERT_FALSE(rx.ok());
  EXPECT_NE(rx.error().message.find("corrupted"), std::string::npos) << rx.error().message;
  EXPECT_NE(rx.error().message.find("offset " + std::to_string(5 * 64 * 1024 + 321)), std::string::npos)
      << rx.error().message;
  EXPECT_EQ(verified.load(), 5u * 64 * 1024);  // the chunks before the bad one
  EXPECT_EQ(chunks_received.load(), 5u);
  EXPECT_FALSE(tx.ok());                       // the sender learnt the stream was stopped
}

TEST(PathCheckStream, FailsAStreamThatEndsShort) {
  Metrics m;
  auto p = connect_check_pair(m, 64 * 1024, 4);
  std::atomic<uint64_t> sent{0}, verified{0}, chunks_sent{0}, chunks_received{0};
  Status rx = ok_status();
  std::thread receiver([&] { rx = receive_stream(*p.b, 1, 200000, verified, chunks_received); });
  (void)send_stream(*p.a, 1, 100000, sent, chunks_sent);
  receiver.join();
  ASSERT_FALSE(rx.ok());
  EXPECT_NE(rx.error().message.find("ended after 100000 of 200000"), std::string::npos) << rx.error().message;
}

TEST(PathCheckRequest, RejectsHostileBodies) {
  AgentConfig config;
  auto err = [&](const nlohmann::json& body) {
    auto r = api::parse_pathcheck_request(body, config);
    return r ? std::string() : r.error().message;
  };
  EXPECT_NE(err(nlohmann::json::array()).find("body"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"bytes", "65Gi"}}).find("bytes"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"bytes", 0}}).find("bytes"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"bytes", -5}}).find("bytes"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"bytes", "lots"}}).find("bytes"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"chunkSize", 1000}}).find("chunkSize"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"channels", 17}}).find("channels"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"transport", "carrier-pigeon"}}).find("transport"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"allowDuringMigrations", "yes"}}).find("allowDuringMigrations"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"timeoutSeconds", 100000}}).find("timeoutSeconds"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"qmpSocket", "/x"}}).find("qmpSocket: unknown field"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"target", nlohmann::json::object()}}).find("only for role 'source'"), std::string::npos);
  EXPECT_NE(err({{"role", "source"}}).find("target: required"), std::string::npos);
  EXPECT_NE(err({{"role", "source"}, {"target", {{"endpoint", "10.0.0.2:1"}, {"checkId", "Bad_Id"}, {"token", "t"}}}})
                .find("target.checkId"), std::string::npos);
  // The endpoint is dialled on the client's word: the dial policy (issue 38).
  for (const char* ep : {"h:1", "169.254.169.254:80", "0.0.0.0:7471", "[::]:7471", "[::ffff:169.254.169.254]:80",
                         "127.0.0.1:7471"}) {
    const auto msg = err({{"role", "source"}, {"target", {{"endpoint", ep}, {"checkId", "c-1"}, {"token", "t"}}}});
    EXPECT_EQ(msg.rfind("target.endpoint: ", 0), 0u) << ep << ": " << msg;
    EXPECT_NE(msg.find("dial policy"), std::string::npos) << msg;
  }
  auto ok = api::parse_pathcheck_request({{"role", "target"}}, config);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->bytes, config.path_check.default_bytes);
  EXPECT_EQ(ok->timeout_seconds, config.path_check.default_timeout_seconds);
  EXPECT_EQ(ok->channels, 1u);
  auto sized = api::parse_pathcheck_request({{"role", "target"}, {"bytes", "64Mi"}, {"chunkSize", "256Ki"}}, config);
  ASSERT_TRUE(sized.ok()) << sized.error().message;
  EXPECT_EQ(sized->bytes, 64u << 20);
  EXPECT_EQ(sized->chunk_size, 256u << 10);
}

TEST(PathCheckRequest, BoundsAndDefaultsAreTheAgentsPathCheckKeys) {
  AgentConfig config;
  config.path_check.default_bytes = 8u << 20;
  config.path_check.max_bytes = 16u << 20;
  config.path_check.max_channels = 2;
  config.path_check.default_timeout_seconds = 30;
  config.path_check.max_timeout_seconds = 60;
  auto ok = api::parse_pathcheck_request({{"role", "target"}}, config);
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_EQ(ok->bytes, 8u << 20);
  EXPECT_EQ(ok->timeout_seconds, 30u);
  auto at_bounds = api::parse_pathcheck_request(
      {{"role", "target"}, {"bytes", "16Mi"}, {"channels", 2}, {"timeoutSeconds", 60}}, config);
  ASSERT_TRUE(at_bounds.ok()) << at_bounds.error().message;
  auto err = [&](const nlohmann::json& body) {
    auto r = api::parse_pathcheck_request(body, config);
    return r ? std::string() : r.error().message;
  };
  EXPECT_NE(err({{"role", "target"}, {"bytes", "17Mi"}}).find("pathCheck.maxBytes"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"channels", 3}}).find("pathCheck.maxChannels"), std::string::npos);
  EXPECT_NE(err({{"role", "target"}, {"timeoutSeconds", 61}}).find("pathCheck.maxTimeoutSeconds"), std::string::npos);
}

TEST(PathCheckRdmaEnd, ReportsDevicePortGidAndMtuOfTheChosenPort) {
  session::RdmaSupport rdma;
  rdma.available = true;
  rdma.device = "mlx5_2";
  rdma.device_port = 1;
  rdma.ip = "192.168.10.7";
  rdma.gid_index = 3;
  rdma.gid_type = "RoCE v2";
  rdma.netdev = "ens1f0v3.100";
  rdma.mtu = 4096;
  const auto end = RdmaEnd::of(rdma);
  EXPECT_EQ(end.gid_type, "RoCE v2");
  EXPECT_EQ(end.netdev, "ens1f0v3.100");
  const auto back = RdmaEnd::parse(end.to_json());
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->to_json(), end.to_json());
  EXPECT_EQ(end.device, "mlx5_2");
  EXPECT_EQ(end.port, 1);
  EXPECT_EQ(end.gid, "0000:0000:0000:0000:0000:ffff:c0a8:0a07");  // RoCE v2: the IPv4-mapped address
  EXPECT_EQ(end.gid_index, 3);
  EXPECT_EQ(end.mtu, 4096u);
  // What a peer sends back is bounded and typed, whatever it sends.
  auto parsed = RdmaEnd::parse({{"device", std::string(500, 'x')}, {"mtu", 1 << 30}, {"gidIndex", "3"},
                                {"netdev", std::string(100, 'n')}, {"gidType", 2}});
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->device.size(), 64u);
  EXPECT_EQ(parsed->netdev.size(), 64u);
  EXPECT_EQ(parsed->gid_type, "");
  EXPECT_EQ(parsed->mtu, 4096u);
  EXPECT_EQ(parsed->gid_index, -1);
  EXPECT_FALSE(RdmaEnd::parse(nlohmann::json::array()).has_value());
}

namespace {
session::RailPair rail_pair(uint32_t index, const std::string& device, const std::string& ip, uint32_t mtu) {
  session::RailPair p;
  p.rail = index;
  p.local.rail = index;
  p.local.device = device;
  p.local.device_port = 1;
  p.local.netdev = "ens" + std::to_string(index + 1) + "f0v0";
  p.local.ip = ip;
  p.local.port = 7472;
  p.local.gid_index = 3;
  p.local.gid_type = "RoCE v2";
  p.local.mtu = mtu;
  p.peer = "10.10." + std::to_string(index) + ".2:7472";
  return p;
}
}  // namespace

TEST(PathCheckRails, EachRailUsedListsBothPortsThroughTheTargetsReady) {
  // Source and target each with two rails; three channels: rail 0 carries 0 and 2, rail 1 carries 1.
  auto source = check_rails({rail_pair(0, "mlx5_0", "10.10.0.1", 4096), rail_pair(1, "mlx5_1", "10.10.1.1", 1024)}, 3);
  const auto target = check_rails({rail_pair(0, "mlx5_4", "10.10.0.2", 4096), rail_pair(1, "mlx5_5", "10.10.1.2", 1024)}, 3);
  ASSERT_EQ(source.size(), 2u);
  EXPECT_EQ(source[0].usage.channels, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(source[1].local.device, "mlx5_1");
  EXPECT_EQ(source[1].local.netdev, "ens2f0v0");
  EXPECT_EQ(source[1].local.mtu, 1024u);
  EXPECT_EQ(source[1].local.gid, "0000:0000:0000:0000:0000:ffff:0a0a:0101") << "from the rail's address";
  // The target's ready, as the wire carries it.
  const nlohmann::json ready{{"type", "ready"}, {"rails", rails_to_ready(target)}};
  peer_rails_from_ready(nlohmann::json::parse(ready.dump()), source);
  ASSERT_TRUE(source[1].peer.has_value());
  EXPECT_EQ(source[1].peer->device, "mlx5_5");
  EXPECT_EQ(source[1].peer->netdev, "ens2f0v0");
  EXPECT_EQ(source[0].peer->device, "mlx5_4");
  // The agent's status JSON: each rail with its channels, bytes and both ends.
  CheckStatus st;
  st.rails = source;
  st.rails[1].usage.bytes_sent = 1024;
  const auto j = to_json(st);
  ASSERT_EQ(j["rails"].size(), 2u);
  EXPECT_EQ(j["rails"][1]["rail"], 1);
  EXPECT_EQ(j["rails"][1]["bytesSent"], 1024);
  EXPECT_EQ(j["rails"][1]["localRdma"]["device"], "mlx5_1");
  EXPECT_EQ(j["rails"][1]["peerRdma"]["device"], "mlx5_5");
  EXPECT_EQ(j["rails"][1]["peerRdma"]["mtu"], 1024);
  EXPECT_EQ(j["rails"][0]["channels"], nlohmann::json::array({0, 2}));
  EXPECT_FALSE(to_json(CheckStatus{}).contains("rails")) << "over TCP: no rails";
}

TEST(PathCheckRails, AHostileReadyIsBoundedAndCannotRenameRails) {
  auto source = check_rails({rail_pair(0, "mlx5_0", "10.10.0.1", 4096), rail_pair(1, "mlx5_1", "10.10.1.1", 4096)}, 2);
  nlohmann::json rails = nlohmann::json::array();
  rails.push_back("not a rail");
  rails.push_back({{"rail", -1}, {"device", "negative"}});
  rails.push_back({{"rail", 1}, {"device", std::string(5000, 'd')}, {"mtu", 99999}});
  rails.push_back({{"rail", 1}, {"device", "second-claim"}});  // the first claim on a rail holds
  for (int i = 0; i < 1000; ++i) rails.push_back({{"rail", 7}, {"device", "unknown-rail"}});
  rails.push_back({{"rail", 0}, {"device", "past-the-bound"}});  // entry 1005: never read
  peer_rails_from_ready({{"rails", rails}}, source);
  EXPECT_FALSE(source[0].peer.has_value());
  ASSERT_TRUE(source[1].peer.has_value());
  EXPECT_EQ(source[1].peer->device.size(), 64u);
  EXPECT_EQ(source[1].peer->mtu, 4096u);
  EXPECT_EQ(source.size(), 2u);
  peer_rails_from_ready({{"rails", "lots"}}, source);
  peer_rails_from_ready(nlohmann::json::object(), source);
}
