#include <gtest/gtest.h>

#include <thread>

#include "transport/framing.h"

using namespace rdmig;
using namespace rdmig::transport;

TEST(Framing, HeaderRoundTripsLittleEndian) {
  auto raw = encode_frame_header({FrameType::kData, 0x01020304});
  EXPECT_EQ(static_cast<int>(raw[0]), 1);
  EXPECT_EQ(static_cast<int>(raw[4]), 4);
  EXPECT_EQ(static_cast<int>(raw[7]), 1);
  auto h = decode_frame_header(raw, 0x02000000, 16);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->type, FrameType::kData);
  EXPECT_EQ(h->length, 0x01020304u);
}

TEST(Framing, RejectsDataLargerThanChunkOrEmpty) {
  EXPECT_FALSE(decode_frame_header(encode_frame_header({FrameType::kData, 65537}), 65536, 4).ok());
  EXPECT_FALSE(decode_frame_header(encode_frame_header({FrameType::kData, 0}), 65536, 4).ok());
  EXPECT_TRUE(decode_frame_header(encode_frame_header({FrameType::kData, 65536}), 65536, 4).ok());
}

TEST(Framing, RejectsUnknownTypeAndBadCredits) {
  std::array<std::byte, kFrameHeaderSize> raw{};
  raw[0] = std::byte{9};
  EXPECT_EQ(decode_frame_header(raw, 65536, 4).error().code, Errc::kProtocol);
  EXPECT_FALSE(decode_frame_header(encode_frame_header({FrameType::kCredit, 5}), 65536, 4).ok());
  EXPECT_FALSE(decode_frame_header(encode_frame_header({FrameType::kCredit, 0}), 65536, 4).ok());
  EXPECT_FALSE(decode_frame_header(encode_frame_header({FrameType::kEof, 1}), 65536, 4).ok());
}

TEST(CreditGate, TakesUntilEmptyThenStallsUntilGiven) {
  CreditGate g(2);
  EXPECT_FALSE(g.take().value());
  EXPECT_FALSE(g.take().value());
  EXPECT_EQ(g.in_flight(), 2u);
  std::thread giver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(g.give(1).ok());
  });
  auto waited = g.take();  // blocks until the giver returns a credit
  giver.join();
  ASSERT_TRUE(waited.ok());
  EXPECT_TRUE(waited.value()) << "a take that had to wait is a credit stall";
}

TEST(CreditGate, ReturningMoreThanGivenIsProtocolError) {
  CreditGate g(2);
  EXPECT_EQ(g.give(1).error().code, Errc::kProtocol);
  ASSERT_TRUE(g.take().ok());
  EXPECT_TRUE(g.give(1).ok());
}

TEST(CreditGate, AbortWakesWaitersWithTheReason) {
  CreditGate g(1);
  ASSERT_TRUE(g.take().ok());
  std::thread aborter([&] { g.abort(Error{Errc::kUnavailable, "peer gone"}); });
  auto r = g.take();
  aborter.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message, "peer gone");
  EXPECT_FALSE(g.wait_all().ok());
}

TEST(CreditGate, WaitAllReturnsWhenEveryCreditIsBack) {
  CreditGate g(3);
  ASSERT_TRUE(g.take().ok());
  std::thread giver([&] { ASSERT_TRUE(g.give(1).ok()); });
  EXPECT_TRUE(g.wait_all().ok());
  giver.join();
  EXPECT_EQ(g.available(), 3u);
}

TEST(CreditBatcher, SendsAQuarterRingAtOnceButNeverHoldsWhenIdleOrAtEof) {
  CreditBatcher b(16);  // batch of 4
  EXPECT_EQ(b.on_release(false, false), 0u);
  EXPECT_EQ(b.on_release(false, false), 0u);
  EXPECT_EQ(b.on_release(false, false), 0u);
  EXPECT_EQ(b.on_release(false, false), 4u) << "a full batch goes out";
  EXPECT_EQ(b.on_release(false, false), 0u);
  EXPECT_EQ(b.on_release(false, true), 2u) << "nothing else queued: the sender may be waiting";
  EXPECT_EQ(b.on_release(false, false), 0u);
  EXPECT_EQ(b.on_release(true, false), 1u) << "the peer's eof flushes what is held";
  EXPECT_EQ(b.on_release(true, true), 0u) << "an eof alone frees no slot";
  CreditBatcher tiny(2);
  EXPECT_EQ(tiny.on_release(false, false), 1u);
}
