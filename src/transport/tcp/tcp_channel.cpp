#include "transport/tcp/tcp_channel.h"

#include <sys/socket.h>

#include <algorithm>
#include <chrono>

#include "common/log.h"
#include "common/net.h"

namespace rdmig::transport {

std::unique_ptr<TcpChannel> TcpChannel::create(UniqueFd fd, uint32_t index, uint32_t chunk_size,
                                               uint32_t depth, TransportMetrics& metrics) {
  net::tune_tcp_for_bulk(fd.get());
  std::unique_ptr<TcpChannel> ch(new TcpChannel(std::move(fd), index, chunk_size, depth, metrics));
  ch->reader_ = std::thread([c = ch.get()] { c->reader_loop(); });
  return ch;
}

TcpChannel::TcpChannel(UniqueFd fd, uint32_t index, uint32_t chunk_size, uint32_t depth,
                       TransportMetrics& metrics)
    : fd_(std::move(fd)),
      index_(index),
      chunk_size_(chunk_size),
      depth_(depth),
      metrics_(metrics),
      staging_(std::make_unique_for_overwrite<std::byte[]>(chunk_size)),
      credits_(depth),
      ring_(depth + 1),
      batcher_(depth) {}

TcpChannel::~TcpChannel() {
  abort(Error{Errc::kCancelled, "channel closed"});
  if (reader_.joinable()) reader_.join();
  metrics_.chunks_in_flight->Decrement(static_cast<double>(outstanding_.load()));
}

Status TcpChannel::write_frame(FrameHeader h, const void* payload) {
  auto header = encode_frame_header(h);
  iovec iov[2] = {{header.data(), header.size()}, {const_cast<void*>(payload), payload ? h.length : 0}};
  std::lock_guard lock(write_mu_);
  return net::writev_all(fd_.get(), iov, payload ? 2 : 1);
}

Result<std::span<std::byte>> TcpChannel::acquire() {
  auto waited = credits_.take();
  if (!waited) return waited.error();
  if (waited.value()) metrics_.credit_stalls->Increment();
  return std::span<std::byte>(staging_.get(), chunk_size_);
}

Status TcpChannel::send(size_t n) {
  if (n == 0 || n > chunk_size_) return Error{Errc::kInternal, "send of a chunk of " + std::to_string(n) + " bytes"};
  const auto t0 = std::chrono::steady_clock::now();
  auto st = write_frame(FrameHeader{FrameType::kData, static_cast<uint32_t>(n)}, staging_.get());
  if (!st) {
    fail(st.error());
    return st;
  }
  // On TCP a chunk is "complete" when the kernel has taken all of it.
  metrics_.chunk_write_latency->Observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  outstanding_.fetch_add(1);
  metrics_.chunks_in_flight->Increment();
  metrics_.chunks_sent->Increment();
  metrics_.bytes_sent->Increment(static_cast<double>(n));
  metrics_.chunk_size->Observe(static_cast<double>(n));
  return ok_status();
}

void TcpChannel::unacquire() { credits_.untake(); }

Status TcpChannel::drain() { return credits_.wait_all(); }

Status TcpChannel::send_eof() {
  auto st = write_frame(FrameHeader{FrameType::kEof, 0}, nullptr);
  if (!st) fail(st.error());
  return st;
}

Result<ChunkView> TcpChannel::receive() {
  std::unique_lock lock(rx_mu_);
  rx_cv_.wait(lock, [&] { return rx_head_ < rx_tail_ || aborted_.load(); });
  // What arrived before an abort is still delivered in order (the eof of a peer that then
  // closed cleanly must not turn into an error).
  if (rx_head_ < rx_tail_) {
    Slot& s = ring_[rx_head_ % ring_.size()];
    rx_holding_ = true;
    return ChunkView{std::span<const std::byte>(s.data.get(), s.size), s.eof};
  }
  std::lock_guard a(abort_mu_);
  return abort_reason_.value_or(Error{Errc::kCancelled, "channel aborted"});
}

Status TcpChannel::release() {
  bool was_eof = false;
  bool queue_empty = false;
  {
    std::lock_guard lock(rx_mu_);
    if (!rx_holding_) return Error{Errc::kInternal, "release without a received chunk"};
    was_eof = ring_[rx_head_ % ring_.size()].eof;
    ++rx_head_;
    rx_holding_ = false;
    queue_empty = rx_head_ == rx_tail_;
  }
  rx_cv_.notify_all();
  const uint32_t credits = batcher_.on_release(was_eof, queue_empty);
  if (credits == 0) return ok_status();
  auto st = write_frame(FrameHeader{FrameType::kCredit, credits}, nullptr);
  if (!st) fail(st.error());
  return st;
}

void TcpChannel::fail(const Error& e) {
  {
    std::lock_guard a(abort_mu_);
    if (abort_reason_) return;
    abort_reason_ = e;
  }
  aborted_.store(true);
  credits_.abort(e);
  ::shutdown(fd_.get(), SHUT_RDWR);
  rx_cv_.notify_all();
}

void TcpChannel::abort(const Error& reason) {
  bool first = false;
  {
    std::lock_guard a(abort_mu_);
    first = !abort_reason_.has_value();
  }
  if (first && reason.code != Errc::kCancelled) {
    // Tell the peer why, without blocking behind a stuck sender.
    std::unique_lock lock(write_mu_, std::try_to_lock);
    if (lock.owns_lock()) {
      const std::string& msg = reason.message;
      const auto len = static_cast<uint32_t>(std::min<size_t>(msg.size(), kMaxAbortReason));
      auto header = encode_frame_header({FrameType::kAbort, len});
      iovec iov[2] = {{header.data(), header.size()}, {const_cast<char*>(msg.data()), len}};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = 2;
      (void)::sendmsg(fd_.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
  }
  fail(reason);
}

void TcpChannel::reader_loop() {
  const std::string where = "channel " + std::to_string(index_);
  for (;;) {
    std::array<std::byte, kFrameHeaderSize> raw{};
    auto got = net::read_exact(fd_.get(), raw, /*eof_ok=*/true);
    if (got && !got.value()) {
      bool clean = false;
      {
        std::lock_guard lock(rx_mu_);
        clean = peer_eof_;
      }
      if (clean && credits_.in_flight() == 0) {
        // The peer finished both directions and closed: not an error.
        fail(Error{Errc::kCancelled, where + ": closed"});
        return;
      }
    }
    if (!got || !got.value()) {
      if (!aborted_.load()) {
        fail(got ? Error{Errc::kUnavailable, where + ": peer closed the connection"}
                 : got.error().with_context(where));
      }
      return;
    }
    auto h = decode_frame_header(raw, chunk_size_, depth_);
    if (!h) {
      fail(h.error().with_context(where));
      return;
    }
    switch (h->type) {
      case FrameType::kCredit:
        if (auto st = credits_.give(h->length); !st) {
          fail(st.error().with_context(where));
          return;
        }
        outstanding_.fetch_sub(h->length);
        metrics_.chunks_in_flight->Decrement(h->length);
        break;
      case FrameType::kData:
      case FrameType::kEof: {
        Slot* slot = nullptr;
        {
          std::lock_guard lock(rx_mu_);
          // An eof marker may sit in the one extra place the ring keeps for it.
          const uint64_t limit = h->type == FrameType::kEof ? depth_ + 1 : depth_;
          if (peer_eof_ || rx_tail_ - rx_head_ >= limit) {
            fail(Error{Errc::kProtocol, where + ": peer sent beyond its credits or after eof"});
            return;
          }
          slot = &ring_[rx_tail_ % ring_.size()];
          if (h->type == FrameType::kEof) peer_eof_ = true;
        }
        slot->eof = h->type == FrameType::kEof;
        slot->size = h->length;
        if (!slot->eof) {
          if (!slot->data) slot->data = std::make_unique_for_overwrite<std::byte[]>(chunk_size_);
          auto r = net::read_exact(fd_.get(), std::span(slot->data.get(), h->length));
          if (!r) {
            fail(r.error().with_context(where));
            return;
          }
          metrics_.chunks_received->Increment();
          metrics_.bytes_received->Increment(h->length);
        }
        {
          std::lock_guard lock(rx_mu_);
          ++rx_tail_;
        }
        rx_cv_.notify_all();
        // After an eof, keep reading: credits for our own direction still come back here.
        break;
      }
      case FrameType::kAbort: {
        std::string reason(h->length, '\0');
        if (h->length > 0) {
          (void)net::read_exact(fd_.get(), std::as_writable_bytes(std::span(reason.data(), reason.size())));
        }
        fail(Error{Errc::kUnavailable, where + ": peer aborted: " + reason});
        return;
      }
    }
  }
}

}  // namespace rdmig::transport
