// RDMA transport: wire encodings and device selection run everywhere; the channel tests
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
#include "transport/rdma/cm.h"
#include "transport/rdma/device.h"
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

TEST(RdmaPrivateData, ConnectRequestAndReplyRoundTripWithinCmLimits) {
  ConnectRequest req;
  req.session = session_from_hex("00112233445566778899aabbccddeeff").value();
  req.index = 4;
  req.ring_addr = 0x7f0012345000;
  req.ring_rkey = 0xabcdef;
  auto raw = req.encode();
  EXPECT_LE(raw.size(), 56u) << "rdma_connect private data on IB/RoCE holds 56 bytes";
  raw.resize(56, 0);  // rdma_cm pads
  auto back = ConnectRequest::decode(raw);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->session, req.session);
  EXPECT_EQ(back->index, 4);
  EXPECT_EQ(back->ring_addr, req.ring_addr);
  EXPECT_EQ(back->ring_rkey, req.ring_rkey);
  ConnectReply rep{0x1000, 42};
  auto r = ConnectReply::decode(rep.encode());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ring_addr, 0x1000u);
  EXPECT_EQ(r->ring_rkey, 42u);
  std::vector<uint8_t> junk(56, 0xff);
  EXPECT_EQ(ConnectRequest::decode(junk).error().code, Errc::kProtocol);
  EXPECT_FALSE(session_from_hex("xyz").ok());
}

namespace {
// A fake /sys with two devices: mlx5_2 (a VF at 0000:3b:00.2 on ens1f0v0) and rxe0 (on va).
struct FakeSysfs {
  fs::path root;
  FakeSysfs() {
    root = fs::temp_directory_path() / ("rdmig-sysfs-" + random_hex(4));
    auto w = [&](const fs::path& p, const std::string& v) {
      fs::create_directories(p.parent_path());
      std::ofstream(p) << v << "\n";
    };
    w(root / "class/infiniband/mlx5_2/ports/1/gid_attrs/ndevs/0", "ens1f0v0");
    fs::create_directories(root / "class/infiniband/mlx5_2/device/net/ens1f0v0");
    fs::create_directories(root / "bus/pci/devices/0000:3b:00.2/infiniband/mlx5_2");
    w(root / "class/infiniband/rxe0/parent", "va");
  }
  ~FakeSysfs() { fs::remove_all(root); }
  SysfsView view() const { return SysfsView{root.string()}; }
};
std::string fake_ip(const std::string& netdev) {
  if (netdev == "ens1f0v0") return "192.0.2.10";
  if (netdev == "va") return "10.99.0.1";
  return "";
}
}  // namespace

TEST(RdmaDeviceSelection, ByDeviceNameNetdevAndAuto) {
  FakeSysfs fake;
  RdmaConfig c;
  c.device = "mlx5_2";
  auto d = select_device(c, {}, fake.view(), &fake_ip);
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(d->netdev, "ens1f0v0");
  EXPECT_EQ(d->ip, "192.0.2.10");
  c = RdmaConfig{};
  c.netdev = "va";
  d = select_device(c, {}, fake.view(), &fake_ip);
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(d->name, "rxe0");
  d = select_device(RdmaConfig{}, {}, fake.view(), &fake_ip);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->name, "mlx5_2");
}

TEST(RdmaDeviceSelection, FromSriovDevicePluginEnvironment) {
  FakeSysfs fake;
  RdmaConfig c;
  c.resource_env = "PCIDEVICE_NVIDIA_COM_SRIOV_RDMA";
  auto d = select_device(c, {{"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA", "0000:3b:00.2"}}, fake.view(), &fake_ip);
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(d->name, "mlx5_2");
  // The _INFO JSON's rdma_dev wins when present.
  d = select_device(c, {{"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA", "0000:3b:00.2"},
                        {"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA_INFO",
                         R"({"0000:3b:00.2":{"generic":{"deviceID":"0000:3b:00.2"},"rdma":{"rdma_mgmt":"/dev/infiniband/rdma_cm","rdma_dev":"rxe0"}}})"}},
                    fake.view(), &fake_ip);
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(d->name, "rxe0");
  // Resource name form (nvidia.com/sriov_rdma) maps to the variable name.
  c.resource_env = "nvidia.com/sriov_rdma";
  d = select_device(c, {{"PCIDEVICE_NVIDIA_COM_SRIOV_RDMA", "0000:3b:00.2"}}, fake.view(), &fake_ip);
  ASSERT_TRUE(d.ok()) << d.error().message;
}

TEST(RdmaDeviceSelection, ErrorsNameTheConfigKeyAndWhatIsMissing) {
  FakeSysfs fake;
  RdmaConfig c;
  c.device = "mlx5_9";
  auto d = select_device(c, {}, fake.view(), &fake_ip);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message.find("rdma.device"), std::string::npos);
  c = RdmaConfig{};
  c.resource_env = "PCIDEVICE_X";
  d = select_device(c, {}, fake.view(), &fake_ip);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message.find("PCIDEVICE_X"), std::string::npos);
  EXPECT_FALSE(select_device(RdmaConfig{}, {}, SysfsView{"/nonexistent"}, &fake_ip).ok());
}

// ---- Real verbs: need a device (the Soft-RoCE VM sets RDMIG_RDMA_IP). ----
namespace {
std::string rdma_ip() {
  const char* ip = std::getenv("RDMIG_RDMA_IP");
  return ip ? ip : "";
}
struct Pair {
  std::unique_ptr<transport::Channel> client, server;
};
Pair connect_pair(Metrics& m, uint32_t chunk, uint32_t depth, const std::array<uint8_t, 16>& session) {
  std::mutex mu;
  std::condition_variable cv;
  Pair p;
  auto& tm = m.transport("rdma");
  auto listener = RdmaListener::create(rdma_ip(), 0, [&](const std::array<uint8_t, 16>& s, uint32_t i) -> Result<AcceptPlan> {
    if (s != session) return Error{Errc::kPermissionDenied, "wrong session"};
    AcceptPlan plan{RdmaChannelParams{i, chunk, depth, chunk, depth}, &tm, [&](Result<std::unique_ptr<transport::Channel>> ch) {
                      std::lock_guard l(mu);
                      if (ch) p.server = std::move(ch.value());
                      cv.notify_all();
                    }};
    return plan;
  });
  EXPECT_TRUE(listener.ok());
  auto c = RdmaChannel::connect({rdma_ip(), listener.value()->port()}, session, RdmaChannelParams{0, chunk, depth, chunk, depth}, tm,
                                std::chrono::seconds(10));
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
  auto p = connect_pair(m, 64 * 1024, 4, session);
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
  auto listener = RdmaListener::create(rdma_ip(), 0, [](const std::array<uint8_t, 16>&, uint32_t) -> Result<AcceptPlan> {
    return Error{Errc::kPermissionDenied, "unknown session"};
  });
  ASSERT_TRUE(listener.ok());
  auto c = RdmaChannel::connect({rdma_ip(), listener.value()->port()}, std::array<uint8_t, 16>{9},
                                RdmaChannelParams{0, 65536, 4, 65536, 4}, m.transport("rdma"), std::chrono::seconds(10));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("rejected"), std::string::npos) << c.error().message;
}

TEST(RdmaChannel, PeerGoneFailsTheOtherSideWithAReasonAndCountsIt) {
  if (rdma_ip().empty()) GTEST_SKIP() << "no RDMA device here (set RDMIG_RDMA_IP; runs in the Soft-RoCE VM)";
  Metrics m;
  auto p = connect_pair(m, 64 * 1024, 4, std::array<uint8_t, 16>{7});
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
}
