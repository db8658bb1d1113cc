#include "session/pump.h"

#include <poll.h>
#include <sys/socket.h>

#include <array>
#include <cstdio>

#include "common/crc32c.h"
#include "common/log.h"
#include "common/net.h"
#include "common/thread_name.h"

namespace rdmig::session {

namespace {

// Closes a QEMU connection with a RST (SO_LINGER 0) so that its peer fails at once, and wakes
// any thread blocked on it.
void reset_socket(int fd) {
  linger l{1, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  ::shutdown(fd, SHUT_RDWR);
}

// What verify_chunks() puts in a chunk's trailer: the CRC32C of the chunk's sequence number
// (8 bytes, little-endian) and then its payload.
uint32_t chunk_crc(uint64_t seq, std::span<const std::byte> payload) {
  std::array<std::byte, 8> s{};
  for (size_t k = 0; k < s.size(); ++k) s[k] = static_cast<std::byte>(seq >> (8 * k));
  return crc32c(payload, crc32c(s));
}

// All of buf into QEMU's socket, which a splicing channel makes non-blocking
// (Channel::set_inline_sink), so every read and write of the pump on it waits for readiness.
Status write_ready(int fd, std::span<const std::byte> buf) {
  const int err = net::send_all_ready(fd, buf.data(), buf.size());
  if (err == 0) return ok_status();
  auto e = errno_error("send", err);
  if (err == ECONNRESET || err == EPIPE) e.code = Errc::kUnavailable;
  return e;
}

}  // namespace

ChannelPump::ChannelPump(transport::Channel& channel, UniqueFd qemu_fd)
    : channel_(channel), qemu_fd_(std::move(qemu_fd)), qemu_ready_(true) {}

ChannelPump::ChannelPump(transport::Channel& channel, Opener open_qemu, bool open_first)
    : channel_(channel), opener_(std::move(open_qemu)), open_first_(open_first) {}

ChannelPump::~ChannelPump() {
  if (!finished()) abort(Error{Errc::kCancelled, "pump stopped"}, drain_);  // a drain ends here
  if (up_.joinable()) up_.join();
  if (down_.joinable()) down_.join();
}

void ChannelPump::start() {
  up_ = std::thread([this] { up_loop(); });
  down_ = std::thread([this] { down_loop(); });
}

bool ChannelPump::finished() const {
  MutexLock lock(mu_);
  return directions_done_ == 2;
}

std::optional<Error> ChannelPump::error() const {
  MutexLock lock(mu_);
  return error_;
}

bool ChannelPump::wait(std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (directions_done_ != 2) {
    if (lock.wait_until(cv_, deadline) == std::cv_status::timeout) break;
  }
  return directions_done_ == 2;
}

void ChannelPump::record_error(const Error& e) {
  bool first = false;
  {
    MutexLock lock(mu_);
    if (!error_) {
      error_ = e;
      first = true;
    }
  }
  if (first) abort(e);
}

void ChannelPump::drain_on_failure(std::chrono::milliseconds limit) {
  MutexLock lock(mu_);
  drain_ = true;
  drain_limit_ = limit;
}

void ChannelPump::set_drain_on_failure(bool on, std::chrono::milliseconds limit) {
  MutexLock lock(mu_);
  if (aborted_) return;  // decided already
  drain_ = on;
  drain_limit_ = limit;
}

bool ChannelPump::drains_on_failure() const {
  MutexLock lock(mu_);
  return drain_;
}

bool ChannelPump::draining() const {
  MutexLock lock(mu_);
  return drain_ && aborted_ && !hard_ && directions_done_ < 2;
}

void ChannelPump::abort(const Error& reason, bool reset) {
  {
    MutexLock lock(mu_);
    if (!aborted_) aborted_at_ = std::chrono::steady_clock::now();
    aborted_ = true;
    if (reset || !drain_) {
      hard_ = true;
      if (qemu_fd_.valid()) {
        if (reset) {
          reset_socket(qemu_fd_.get());
        } else {
          ::shutdown(qemu_fd_.get(), SHUT_RDWR);
        }
      }
    }
  }
  cv_.notify_all();
  channel_.abort(reason);
}

void ChannelPump::drain_local(int fd) {
  // Reads until QEMU closes, the read fails, or watch_drain() (the down thread) resets the
  // socket: QEMU silent for kMultifdDrainIdle, or drain_limit_ after the failure.
  char sink[64 << 10];
  for (;;) {
    {
      MutexLock lock(mu_);
      if (hard_) return;
    }
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, 100);
    if (r <= 0) continue;  // timeout, EINTR: look at hard_ again
    const ssize_t n = ::recv(fd, sink, sizeof sink, MSG_DONTWAIT);
    if (n > 0) {
      bytes_drained_.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      break;  // QEMU closed (its cleanup ran), or the socket failed
    }
  }
  MutexLock lock(mu_);
  if (hard_) return;
  hard_ = true;
  cv_.notify_all();
  reset_socket(fd);
}

void ChannelPump::watch_drain() {
  using Clock = std::chrono::steady_clock;
  MutexLock lock(mu_);
  // Nothing to watch unless this pump drains after a failure. Then the up thread reads QEMU's
  // socket to nowhere (drain_local), or still sits in the read it was in when the failure
  // came, which only a reset ends when QEMU sends nothing more.
  while (!(up_done_ || hard_ || (aborted_ && drain_))) lock.wait(cv_);
  if (up_done_ || hard_) return;
  const auto limit_at = aborted_at_ + drain_limit_;
  uint64_t seen = bytes_up_.load(std::memory_order_relaxed) + bytes_drained_.load(std::memory_order_relaxed);
  auto moved_at = Clock::now();
  for (;;) {
    const auto turn_end = Clock::now() + std::chrono::milliseconds(100);
    while (!(up_done_ || hard_)) {
      if (lock.wait_until(cv_, turn_end) == std::cv_status::timeout) break;
    }
    if (up_done_ || hard_) return;
    const auto now = Clock::now();
    const uint64_t total =
        bytes_up_.load(std::memory_order_relaxed) + bytes_drained_.load(std::memory_order_relaxed);
    if (total != seen) {
      seen = total;
      moved_at = now;
    }
    const bool silent = now - moved_at >= kMultifdDrainIdle;
    if (!silent && now < limit_at) continue;
    const auto after_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - aborted_at_).count();
    LOG_DEBUG("pump") << "channel " << channel_.index() << ": "
                      << (silent ? "QEMU wrote nothing for " + std::to_string(kMultifdDrainIdle.count()) +
                                       " ms and kept its connection open"
                                 : "QEMU did not close its connection")
                      << " (" << after_ms << " ms after the failure); resetting it";
    hard_ = true;
    if (qemu_fd_.valid()) reset_socket(qemu_fd_.get());  // wakes the up thread wherever it reads
    cv_.notify_all();
    return;
  }
}

void ChannelPump::direction_done(bool up) {
  MutexLock lock(mu_);
  if (up) up_done_ = true;
  ++directions_done_;
  cv_.notify_all();
}

int ChannelPump::qemu_fd_wait() {
  MutexLock lock(mu_);
  while (!(qemu_ready_ || aborted_)) lock.wait(cv_);
  return qemu_ready_ && !aborted_ ? qemu_fd_.get() : -1;
}

void ChannelPump::up_loop() {
  name_this_thread(std::string(opener_ ? "rdmig-t-up-" : "rdmig-s-up-") + std::to_string(channel_.index()));
  const int fd = qemu_fd_wait();
  if (fd < 0) {
    direction_done(true);
    return;
  }
  const std::string where = "channel " + std::to_string(channel_.index()) + " (QEMU to peer)";
  if (first_bytes_) {
    // One peek, once per connection: blocks exactly as the first read would have.
    std::array<std::byte, 8> head{};
    const ssize_t n = net::recv_ready(fd, head.data(), head.size(), MSG_PEEK);
    if (n > 0) first_bytes_(std::span<const std::byte>(head.data(), static_cast<size_t>(n)));
  }
  for (;;) {
    // Take a credit first, then read QEMU's bytes straight into the slot it buys. Holding one
    // credit while QEMU is quiet costs nothing; an abort wakes the read (shutdown).
    auto buf = channel_.acquire();
    if (!buf) {
      record_error(buf.error());
      break;
    }
    size_t filled = 0;
    bool eof = false;
    int read_errno = 0;
    if (channel_.splices() && !verify_) {
      // QEMU's bytes go from its socket to the peer through a pipe (splice), sent in the call.
      auto moved = channel_.send_from(fd);
      if (!moved) {
        record_error(moved.error());
        break;
      }
      filled = moved->bytes;
      eof = moved->local_eof;
      read_errno = moved->local_errno;
    } else {
      // One recv: on a unix stream socket it returns everything QEMU has queued, up to the
      // slot's size. Whatever it returns is sent at once (early flush: never wait to fill).
      auto span = buf.value();
      // With verify_chunks() the slot's last bytes are kept for the payload's CRC32C.
      const size_t room = verify_ ? span.size() - kVerifyTrailer : span.size();
      const ssize_t n = net::recv_ready(fd, span.data(), room, 0);
      if (n > 0) {
        filled = static_cast<size_t>(n);
        size_t wire = filled;
        if (verify_) {
          const uint32_t crc = chunk_crc(send_seq_, span.first(filled));
          for (size_t k = 0; k < kVerifyTrailer; ++k) span[filled + k] = static_cast<std::byte>(crc >> (8 * k));
          wire += kVerifyTrailer;
        }
        if (auto st = channel_.send(wire); !st) {
          record_error(st.error());
          break;
        }
        ++send_seq_;
      } else if (n == 0) {
        eof = true;
      } else {
        read_errno = errno;
      }
    }
    if (read_errno != 0) {
      MutexLock lock(mu_);
      if (aborted_) {
        eof = true;  // the abort path reports the reason
      } else {
        lock.unlock();
        channel_.unacquire();
        record_error(errno_error(where + ": read from QEMU", read_errno));
        break;
      }
    }
    if (filled > 0) {
      bytes_up_.fetch_add(filled, std::memory_order_relaxed);
      chunks_up_.fetch_add(1, std::memory_order_relaxed);
    } else {
      channel_.unacquire();
    }
    if (eof) {
      {
        MutexLock lock(mu_);
        if (error_ || aborted_) break;
      }
      if (auto st = channel_.send_eof(); !st) {
        record_error(st.error());
        break;
      }
      if (auto st = channel_.drain(); !st) record_error(st.error());
      break;
    }
  }
  bool drain = false;
  {
    MutexLock lock(mu_);
    drain = drain_ && aborted_ && !hard_;
  }
  if (drain) drain_local(fd);
  direction_done(true);
}

int ChannelPump::open_local() {
  MutexLock lock(mu_);
  if (!qemu_ready_) {
    // Aborted before QEMU's connection existed: abort() had no socket to shut, so opening one now
    // would leave this thread writing to a QEMU that may never read (seen: a target pump whose
    // first chunk arrived after the abort blocked in its write for good).
    if (aborted_) {
      lock.unlock();
      record_error(Error{Errc::kCancelled, "aborted before QEMU's connection was opened"});
      return -1;
    }
    lock.unlock();
    auto opened = opener_();
    lock.lock();
    if (!opened) {
      lock.unlock();
      record_error(opened.error());
      return -1;
    }
    qemu_fd_ = std::move(opened.value());
    qemu_ready_ = true;
    // An abort that came while the opener ran found no socket either: shut this one as it would have.
    if (aborted_ && hard_) ::shutdown(qemu_fd_.get(), SHUT_RDWR);
    cv_.notify_all();
  }
  return qemu_fd_.get();
}

void ChannelPump::down_loop() {
  name_this_thread(std::string(opener_ ? "rdmig-t-dn-" : "rdmig-s-dn-") + std::to_string(channel_.index()));
  const std::string where = "channel " + std::to_string(channel_.index()) + " (peer to QEMU)";
  int fd = -1;
  if (open_first_) {
    if ((fd = open_local()) < 0) {
      direction_done();
      return;
    }
    inline_sink(fd);
  }
  for (;;) {
    // With splice the payload may still sit in the channel (pending): deliver_to() moves it
    // into QEMU's socket without a copy through user space.
    auto chunk = channel_.splices() && !verify_ ? channel_.receive_deferred() : channel_.receive();
    if (!chunk) {
      record_error(chunk.error());
      break;
    }
    if (fd < 0) {
      if ((fd = open_local()) < 0) break;
      inline_sink(fd);
    }
    if (chunk->eof) {
      ::shutdown(fd, SHUT_WR);  // the peer's QEMU closed its side: pass the eof on
      (void)channel_.release();
      break;
    }
    size_t written = chunk->data.size();
    if (verify_) {
      // Nothing of a chunk reaches QEMU before its CRC32C matched.
      const auto data = chunk->data;
      const uint64_t seq = verify_seq_++;
      if (data.size() <= kVerifyTrailer) {
        record_error(Error{Errc::kProtocol, where + ": chunk " + std::to_string(seq) + " of " +
                                                std::to_string(data.size()) + " bytes has no room for its CRC32C"});
        break;
      }
      const auto payload = data.first(data.size() - kVerifyTrailer);
      uint32_t carried = 0;
      for (size_t k = 0; k < kVerifyTrailer; ++k) {
        carried |= static_cast<uint32_t>(data[payload.size() + k]) << (8 * k);
      }
      if (const uint32_t computed = chunk_crc(seq, payload); computed != carried) {
        // Say which: a chunk with a valid CRC for another sequence number is out of place.
        std::string what = "the transport damaged it";
        for (uint64_t other = seq > 64 ? seq - 64 : 0; other <= seq + 64; ++other) {
          if (other != seq && chunk_crc(other, payload) == carried) {
            what = "it is chunk " + std::to_string(other) + ": the transport lost, repeated or reordered chunks";
            break;
          }
        }
        char detail[96];
        std::snprintf(detail, sizeof detail, "carried 0x%08x, computed 0x%08x", carried, computed);
        record_error(Error{Errc::kProtocol, where + ": chunk " + std::to_string(seq) + " (" +
                                                std::to_string(payload.size()) + " bytes) failed its CRC32C check (" +
                                                detail + "): " + what + "; nothing of it reached QEMU"});
        break;
      }
      if (auto st = write_ready(fd, payload); !st) {
        record_error(st.error().with_context(where + ": write to QEMU"));
        break;
      }
      written = payload.size();
      chunks_verified_.fetch_add(1, std::memory_order_relaxed);
    } else if (chunk->pending > 0) {
      auto moved = channel_.deliver_to(fd);
      if (!moved) {
        record_error(moved.error());
        break;
      }
      if (moved->local_errno != 0) {
        auto e = errno_error("send", moved->local_errno);
        if (moved->local_errno == ECONNRESET || moved->local_errno == EPIPE) e.code = Errc::kUnavailable;
        record_error(e.with_context(where + ": write to QEMU"));
        break;
      }
      written = moved->bytes;
    } else if (auto st = write_ready(fd, chunk->data); !st) {
      record_error(st.error().with_context(where + ": write to QEMU"));
      break;
    }
    bytes_down_.fetch_add(written, std::memory_order_relaxed);
    chunks_down_.fetch_add(1, std::memory_order_relaxed);
    if (auto st = channel_.release(); !st) {
      record_error(st.error());
      break;
    }
  }
  channel_.clear_inline_sink();  // before anything may close fd
  watch_drain();
  direction_done();
}

void ChannelPump::inline_sink(int fd) {
  // Chunks checked here (verify_chunks) go through this thread. A splicing channel splices
  // chunks into fd itself when nothing waits before them (and makes fd non-blocking).
  if (verify_) return;
  channel_.set_inline_sink(fd, [this](size_t bytes, bool whole_chunk) {
    bytes_down_.fetch_add(bytes, std::memory_order_relaxed);
    if (whole_chunk) chunks_down_.fetch_add(1, std::memory_order_relaxed);
  });
}

}  // namespace rdmig::session
