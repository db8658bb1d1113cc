#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
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
    // Give only once the taker waits (a fixed sleep raced with a slow taker under load: the
    // credit was back before take() ran, so it did not wait).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (g.waiters() == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
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

namespace {
// Runs `body`; a body still running after `limit` (a lost wake-up leaves a thread asleep for good)
// ends the test binary with a message rather than hanging until ctest's timeout.
template <typename F>
void within(std::chrono::seconds limit, F body) {
  std::promise<void> done;
  auto finished = done.get_future();
  std::thread runner([&] {
    body();
    done.set_value();
  });
  if (finished.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "still running after %llds: a lost wake-up\n", static_cast<long long>(limit.count()));
    std::abort();
  }
  runner.join();
}

// As within(), but the limit is on a stall, not on the whole: the body bumps `progress` as it
// goes, and only `limit` without a bump ends the test binary. A lost wake-up makes no progress at
// all; a taker and a giver handing over 200000 credits on a loaded 2-core machine (a suite row
// beside it, every thread yielding to others) are slow, not stuck.
template <typename F>
void within_progress(std::chrono::seconds limit, F body) {
  std::atomic<long> progress{0};
  std::promise<void> done;
  auto finished = done.get_future();
  std::thread runner([&] {
    body(progress);
    done.set_value();
  });
  long last = -1;
  auto since = std::chrono::steady_clock::now();
  while (finished.wait_for(std::chrono::milliseconds(500)) != std::future_status::ready) {
    const long now = progress.load();
    if (now != last) {
      last = now;
      since = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - since > limit) {
      std::fprintf(stderr, "no progress for %llds (at %ld): a lost wake-up\n", static_cast<long long>(limit.count()),
                   now);
      std::abort();
    }
  }
  runner.join();
}
}  // namespace

// The gate is lock-free (one atomic word waited on): a sender and a giver racing through many
// stalls lose no credit and no wake-up (a lost one leaves take() asleep: within_progress() ends the test),
// and the taker saw at least one stall, so the sleeping path ran.
TEST(CreditGate, ASenderAndAGiverRacingLoseNoCreditAndNoWakeUp) {
  within_progress(std::chrono::seconds(60), [](std::atomic<long>& progress) {
    constexpr uint32_t kDepth = 4;
    constexpr int kChunks = 200000;
    CreditGate g(kDepth);
    std::atomic<int> taken{0};
    std::atomic<bool> giver_failed{false};
    std::atomic<bool> stop{false};  // the taker failed: the giver gives up too
    std::thread giver([&] {
      int given = 0;
      while (given < kChunks && !stop.load()) {
        const int owed = taken.load() - given;
        if (owed <= 0) {
          std::this_thread::yield();
          continue;
        }
        if (given % 997 == 0 && owed == static_cast<int>(kDepth)) {
          // Now and then let the taker run dry and go to sleep before giving, so that the
          // sleeping path certainly runs (the rest is left to chance).
          while (g.waiters() == 0 && !stop.load()) std::this_thread::yield();
        }
        const uint32_t n = static_cast<uint32_t>(std::min(owed, given % 3 + 1));  // batches of 1-3
        if (!g.give(n).ok()) giver_failed = true;
        given += static_cast<int>(n);
      }
    });
    int stalls = 0;
    for (int i = 0; i < kChunks && !stop.load(); ++i) {
      auto r = g.take();
      if (!r.ok()) {
        ADD_FAILURE() << r.error().message;
        stop = true;
        break;
      }
      if (r.value()) ++stalls;
      taken.fetch_add(1);
      progress.fetch_add(1);
    }
    if (!stop.load()) {
      EXPECT_TRUE(g.wait_all().ok());
    }
    giver.join();
    EXPECT_FALSE(giver_failed.load()) << "a give beyond depth: a credit counted twice";
    EXPECT_EQ(g.available(), kDepth);
    EXPECT_GT(stalls, 0);
  });
}

// An abort at any moment around a taker going to sleep wakes it with the reason (an abort that
// landed between the taker's check and its sleep would leave it asleep for good).
TEST(CreditGate, AnAbortRacingATakerGoingToSleepWakesIt) {
  within(std::chrono::seconds(120), [] {
    for (int i = 0; i < 2000; ++i) {
      CreditGate g(1);
      ASSERT_TRUE(g.take().ok());
      std::thread aborter([&] {
        for (int spin = 0; spin < i % 64; ++spin) std::this_thread::yield();
        g.abort(Error{Errc::kUnavailable, "peer gone"});
      });
      auto r = g.take();
      aborter.join();
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().message, "peer gone");
      EXPECT_FALSE(g.wait_all().ok());
      EXPECT_TRUE(g.give(1).ok()) << "credits still count after an abort (drain reads in_flight)";
      EXPECT_EQ(g.in_flight(), 0u);
    }
  });
}

TEST(CreditGate, WaitAllReturnsWhenEveryCreditIsBack) {
  CreditGate g(3);
  ASSERT_TRUE(g.take().ok());
  std::thread giver([&] { ASSERT_TRUE(g.give(1).ok()); });
  EXPECT_TRUE(g.wait_all().ok());
  giver.join();
  EXPECT_EQ(g.available(), 3u);
}

TEST(CreditBatcher, SendsAQuarterRingAtOnceAndFlushesAtEof) {
  CreditBatcher b(16);  // batch of 4
  EXPECT_EQ(b.on_release(false), 0u);
  EXPECT_EQ(b.on_release(false), 0u);
  EXPECT_EQ(b.on_release(false), 0u);
  EXPECT_EQ(b.on_release(false), 4u) << "a full batch goes out";
  EXPECT_EQ(b.on_release(false), 0u);
  EXPECT_EQ(b.on_release(false), 0u);
  EXPECT_EQ(b.on_release(true), 2u) << "the peer's eof flushes what is held";
  EXPECT_EQ(b.on_release(true), 0u) << "an eof alone frees no slot";
  CreditBatcher tiny(2);
  EXPECT_EQ(tiny.on_release(false), 1u);
}

// The batcher's promise, played out: a sender that takes every credit it can, a receiver that
// releases at its own pace (one at a time, bursts, pauses), credits held by the batcher; the
// sender never waits for good (every chunk of a long stream gets through) and never holds more
// than the ring.
TEST(CreditBatcher, HeldCreditsNeverStallTheSenderForGood) {
  for (uint32_t depth : {2u, 3u, 4u, 5u, 8u, 16u, 17u, 64u}) {
    CreditBatcher b(depth);
    uint32_t sender_credits = depth;
    uint32_t in_transit = 0, queued = 0, held = 0;
    uint64_t delivered = 0;
    uint32_t rng = 12345u + depth;
    auto next = [&] { rng = rng * 1103515245u + 12345u; return (rng >> 16) & 0x7fff; };
    for (int step = 0; step < 200000 && delivered < 20000; ++step) {
      switch (next() % 3) {
        case 0:  // the sender sends all it may
          in_transit += sender_credits;
          sender_credits = 0;
          break;
        case 1:  // the network delivers some
          { const uint32_t k = in_transit == 0 ? 0 : 1 + next() % in_transit; in_transit -= k; queued += k; }
          break;
        default:  // the receiver releases some
          for (uint32_t k = queued == 0 ? 0 : 1 + next() % queued; k > 0; --k) {
            --queued;
            ++delivered;
            ++held;
            const uint32_t n = b.on_release(false);
            ASSERT_LE(n, held);
            held -= n;
            sender_credits += n;
          }
      }
      ASSERT_EQ(sender_credits + in_transit + queued + held, depth);
      ASSERT_LT(held, b.batch());
      if (sender_credits == 0) {
        // A waiting sender waits for something: chunks still coming whose release fills the batch.
        ASSERT_GT(in_transit + queued, 0u) << "depth " << depth << ": credits held while the sender waits";
      }
    }
    EXPECT_GE(delivered, 20000u) << "depth " << depth << ": the stream stalled";
  }
}
