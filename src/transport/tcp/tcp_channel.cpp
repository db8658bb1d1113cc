#include "transport/tcp/tcp_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/net.h"
#include "common/thread_name.h"

namespace rdmig::transport {
namespace {

// A pipe's capacity for splicing: one chunk, at most 1 MiB (the unprivileged default of
// /proc/sys/fs/pipe-max-size; larger chunks take several splices).
constexpr size_t kMaxPipeBytes = size_t{1} << 20;
// How long the reader leaves a payload on the socket for the receiver to splice.
constexpr auto kDeferWait = std::chrono::milliseconds(200);
// After a failed write, how long the reader may take to read why the peer closed (its abort
// frame, sent just before it shut the connection): the peer's reason names the cause ("refusing
// to dial ..."), a broken pipe does not.
constexpr auto kPeerReasonWait = std::chrono::milliseconds(250);

// splice(2), retried on EINTR; `local` (the side that is QEMU's socket, may be non-blocking) is
// waited for on EAGAIN. The pipe side never blocks here: pipes are emptied whole each chunk.
ssize_t splice_retry(int in, int out, size_t len, int local = -1, short events = 0) {
  for (;;) {
    const ssize_t n = ::splice(in, nullptr, out, nullptr, len, SPLICE_F_MOVE);
    if (n >= 0) return n;
    if (errno == EAGAIN && local >= 0) {
      net::wait_ready(local, events);
      continue;
    }
    if (errno != EINTR) return n;
  }
}

}  // namespace

void TcpChannel::notice_silent_link_within(std::chrono::milliseconds within) {
  net::detect_dead_peer_within(fd_.get(), within);
}

std::unique_ptr<TcpChannel> TcpChannel::create(UniqueFd fd, uint32_t index, uint32_t chunk_size,
                                               uint32_t depth, TransportMetrics& metrics,
                                               SpliceMode splice, std::unique_ptr<TlsStream> tls) {
  net::tune_tcp_for_bulk(fd.get());
  std::unique_ptr<TcpChannel> ch(
      new TcpChannel(std::move(fd), index, chunk_size, depth, metrics, splice, std::move(tls)));
  ch->reader_ = std::thread([c = ch.get()] { c->reader_loop(); });
  return ch;
}

TcpChannel::TcpChannel(UniqueFd fd, uint32_t index, uint32_t chunk_size, uint32_t depth,
                       TransportMetrics& metrics, SpliceMode splice, std::unique_ptr<TlsStream> tls)
    : fd_(std::move(fd)),
      tls_(std::move(tls)),
      via_tls_(tls_ && !tls_->kernel_both()),
      index_(index),
      chunk_size_(chunk_size),
      depth_(depth),
      metrics_(metrics),
      splice_mode_(splice),
      splice_ok_(splice != SpliceMode::kOff && !via_tls_),
      staging_(ChunkMemory::map(chunk_size)),
      credits_(depth),
      ring_(depth + 1),
      slot_stride_((size_t{chunk_size} + kSlotAlign - 1) / kSlotAlign * kSlotAlign),
      queued_(depth + 1),
      batcher_(depth) {
  free_.reserve(ring_.size());
  for (size_t i = ring_.size(); i-- > 0;) free_.push_back(static_cast<uint32_t>(i));
  for (size_t i = depth; i-- > 0;) free_places_.push_back(static_cast<uint32_t>(i));
}

TcpChannel::~TcpChannel() {
  abort(Error{Errc::kCancelled, "channel closed"});
  if (reader_.joinable()) reader_.join();
  LOG_DEBUG("transport") << "channel " << index_ << " closed: splice " << splice_mode_name(splice_mode_)
                         << ", spliced " << spliced_sent() << " bytes sent and " << spliced_received()
                         << " bytes received; " << inline_chunks() << " chunks written to QEMU by the reader";
  metrics_.chunks_in_flight->Decrement(static_cast<double>(outstanding_.load()));
}

Status TcpChannel::write_frame(FrameHeader h, const void* payload) {
  std::lock_guard lock(write_mu_);
  return write_frame_locked(h, payload);
}

Status TcpChannel::write_frame_locked(FrameHeader h, const void* payload) {
  auto header = encode_frame_header(h);
  if (via_tls_) {
    RDMIG_TRY(tls_->write_all(std::as_bytes(std::span(header))));
    if (payload == nullptr) return ok_status();
    return tls_->write_all(std::span(static_cast<const std::byte*>(payload), h.length));
  }
  iovec iov[2] = {{header.data(), header.size()}, {const_cast<void*>(payload), payload ? h.length : 0}};
  return net::writev_all(fd_.get(), iov, payload ? 2 : 1);
}

bool TcpChannel::ensure_staging() {
  if (!staging_) staging_ = ChunkMemory::map(chunk_size_);
  if (staging_) return true;
  out_of_memory("a chunk buffer of " + std::to_string(chunk_size_) + " bytes");
  return false;
}

bool TcpChannel::place_locked(Slot& s) {
  if (!rx_mem_) {
    rx_mem_ = ChunkMemory::map(rx_bytes());
    if (!rx_mem_) return false;
  }
  if (free_places_.empty()) return false;
  s.place = static_cast<int>(free_places_.back());
  free_places_.pop_back();
  s.data = rx_mem_.data() + static_cast<size_t>(s.place) * slot_stride_;
  return true;
}

void TcpChannel::unplace_locked(Slot& s) {
  if (s.place >= 0) free_places_.push_back(static_cast<uint32_t>(s.place));
  s.place = -1;
}

void TcpChannel::out_of_memory(const std::string& what) {
  // An allocation failure fails this migration, never the agent.
  fail(Error{Errc::kResourceExhausted, "channel " + std::to_string(index_) + ": out of memory for " + what});
}

Result<std::span<std::byte>> TcpChannel::acquire() {
  if (!ensure_staging()) return abort_error();
  auto waited = credits_.take();
  if (!waited) return waited.error();
  if (waited.value()) metrics_.credit_stalls->Increment();
  return std::span<std::byte>(staging_.data(), chunk_size_);
}

Status TcpChannel::send(size_t n) {
  if (n == 0 || n > chunk_size_) return Error{Errc::kInternal, "send of a chunk of " + std::to_string(n) + " bytes"};
  const auto t0 = std::chrono::steady_clock::now();
  auto st = write_frame(FrameHeader{FrameType::kData, static_cast<uint32_t>(n)}, staging_.data());
  if (!st) {
    fail_after_write_error(st.error());
    return abort_error();
  }
  return count_sent(n, t0);
}

Status TcpChannel::count_sent(size_t n, std::chrono::steady_clock::time_point t0) {
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

bool TcpChannel::splices() const { return splice_ok_.load(std::memory_order_relaxed); }

void TcpChannel::splice_unavailable(const std::string& why) {
  if (splice_ok_.exchange(false)) {
    LOG_WARN("transport") << "channel " << index_ << ": splice unavailable (" << why
                          << "), copying through user space";
  }
}

Result<bool> TcpChannel::ensure_pipe(Pipe& p) {
  if (p.r.valid()) return true;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    const int err = errno;
    if (splice_mode_ == SpliceMode::kOn) {
      return errno_error("channel " + std::to_string(index_) + ": pipe for splice", err);
    }
    splice_unavailable(std::string("pipe: ") + std::strerror(err));
    return false;
  }
  p.r = UniqueFd(fds[0]);
  p.w = UniqueFd(fds[1]);
  // A larger pipe is an optimisation: keep the default (64 KiB) if the kernel refuses.
  (void)::fcntl(p.w.get(), F_SETPIPE_SZ, static_cast<int>(std::min<size_t>(chunk_size_, kMaxPipeBytes)));
  const int cap = ::fcntl(p.w.get(), F_GETPIPE_SZ);
  p.capacity = cap > 0 ? static_cast<size_t>(cap) : 4096;
  return true;
}

Result<LocalMove> TcpChannel::send_from(int fd) {
  if (splices()) {
    auto have = ensure_pipe(up_pipe_);
    if (!have) {
      fail(have.error());
      return have.error();
    }
  }
  if (!splices()) {
    // Copy: one recv takes what QEMU has ready, up to a chunk (early flush).
    if (!ensure_staging()) return abort_error();
    const ssize_t n = net::recv_ready(fd, staging_.data(), chunk_size_, 0);  // fd may be an inline sink
    if (n < 0) return LocalMove{0, false, errno};
    if (n == 0) return LocalMove{0, true, 0};
    RDMIG_TRY(send(static_cast<size_t>(n)));
    return LocalMove{static_cast<size_t>(n), false, 0};
  }
  // One splice takes what QEMU has ready, up to a chunk and the pipe's capacity.
  const ssize_t n = splice_retry(fd, up_pipe_.w.get(), std::min<size_t>(chunk_size_, up_pipe_.capacity), fd, POLLIN);
  if (n < 0) {
    const int err = errno;
    if ((err == EINVAL || err == ENOSYS || err == EOPNOTSUPP) && splice_mode_ == SpliceMode::kAuto &&
        !spliced_once_) {
      // This kind of socket cannot splice: copy from now on.
      splice_unavailable(std::string("splice from the local socket: ") + std::strerror(err));
      return send_from(fd);
    }
    return LocalMove{0, false, err};
  }
  if (n == 0) return LocalMove{0, true, 0};
  spliced_once_ = true;
  auto len = static_cast<size_t>(n);
  // What more QEMU has ready joins the chunk, without waiting for it (never wait to fill): one
  // splice gives at most what QEMU's unix socket holds (its send buffer, about 208 KiB), and each
  // chunk costs a header here and a header read at the peer. Another splice is tried only while
  // the chunk has room for as much as the last one took (a splice that finds QEMU dry is a
  // syscall for nothing).
  if (takes_more_without_waiting(fd)) {
    const size_t cap = std::min<size_t>(chunk_size_, up_pipe_.capacity);
    size_t last = len;
    while (len < cap && cap - len >= last) {
      ssize_t k = 0;
      do k = ::splice(fd, nullptr, up_pipe_.w.get(), nullptr, cap - len, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      while (k < 0 && errno == EINTR);
      if (k <= 0) break;  // dry (EAGAIN), the pipe full, the end or an error: the next call meets it
      last = static_cast<size_t>(k);
      len += last;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string where = "channel " + std::to_string(index_);
  {
    std::lock_guard lock(write_mu_);
    // The header waits (MSG_MORE) for the payload that follows; the last splice pushes.
    const auto header = encode_frame_header(FrameHeader{FrameType::kData, static_cast<uint32_t>(len)});
    size_t off = 0;
    while (off < header.size()) {
      const ssize_t k = ::send(fd_.get(), header.data() + off, header.size() - off, MSG_NOSIGNAL | MSG_MORE);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0) {
        auto e = errno_error(where + ": send", errno);
        if (errno == ECONNRESET || errno == EPIPE) e.code = Errc::kUnavailable;
        fail_after_write_error(e);
        return abort_error();
      }
      off += static_cast<size_t>(k);
    }
    size_t left = len;
    while (left > 0) {
      const ssize_t k = splice_retry(up_pipe_.r.get(), fd_.get(), left);
      if (k <= 0) {
        auto e = k < 0 ? errno_error(where + ": splice to peer", errno)
                       : Error{Errc::kUnavailable, where + ": splice to peer moved nothing"};
        if (k < 0 && (errno == ECONNRESET || errno == EPIPE)) e.code = Errc::kUnavailable;
        fail_after_write_error(e);
        return abort_error();
      }
      left -= static_cast<size_t>(k);
    }
  }
  RDMIG_TRY(count_sent(len, t0));
  spliced_sent_.fetch_add(len, std::memory_order_relaxed);
  return LocalMove{len, false, 0};
}

bool TcpChannel::takes_more_without_waiting(int fd) {
  if (fd != probed_fd_) {
    probed_fd_ = fd;
    int domain = 0;
    socklen_t len = sizeof domain;
    const bool unix_socket = ::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_UNIX;
    const int fl = ::fcntl(fd, F_GETFL);
    take_more_ = unix_socket || (fl >= 0 && (fl & O_NONBLOCK) != 0);
  }
  return take_more_;
}

Error TcpChannel::abort_error() {
  std::lock_guard a(abort_mu_);
  return abort_reason_.value_or(Error{Errc::kCancelled, "channel aborted"});
}

void TcpChannel::unacquire() { credits_.untake(); }

Status TcpChannel::drain() { return credits_.wait_all(); }

Status TcpChannel::send_eof() {
  auto st = write_frame(FrameHeader{FrameType::kEof, 0}, nullptr);
  if (!st) fail(st.error());
  return st;
}

Result<ChunkView> TcpChannel::receive() { return next_chunk(false); }

Result<ChunkView> TcpChannel::receive_deferred() {
  if (splices()) {
    auto have = ensure_pipe(down_pipe_);
    if (!have) {
      fail(have.error());
      return have.error();
    }
  }
  if (!splices()) return next_chunk(false);
  {
    std::lock_guard lock(rx_mu_);
    if (!deferred_) {
      deferred_ = true;  // from the next DATA frame on, payloads that fit the pipe wait on the socket
      defer_limit_ = down_pipe_.capacity;
      no_read_ahead_.store(true, std::memory_order_relaxed);
    }
  }
  return next_chunk(true);
}

bool TcpChannel::claim_payload_locked(const Slot& s) {
  if (s.pending == 0 || !payload_on_socket_ || pulling_) return false;
  pulling_ = true;
  return true;
}

void TcpChannel::payload_taken_locked(Slot& s) {
  s.pending = 0;
  payload_on_socket_ = false;
  pulling_ = false;
  rx_cv_.notify_all();
}

Status TcpChannel::read_payload(Slot& s) {
  auto r = net::read_exact(fd_.get(), std::span(s.data, s.size));
  if (!r) {
    fail(r.error().with_context("channel " + std::to_string(index_)));
    return abort_error();
  }
  metrics_.chunks_received->Increment();
  metrics_.bytes_received->Increment(static_cast<double>(s.size));
  return ok_status();
}

Result<ChunkView> TcpChannel::next_chunk(bool deferred) {
  std::unique_lock lock(rx_mu_);
  for (;;) {
    rx_cv_.wait(lock, [&] { return rx_head_ < rx_tail_ || aborted_.load() || owed_credits_ > 0; });
    if (owed_credits_ == 0 || aborted_.load()) break;
    // Credits of chunks the reader wrote to the inline sink: this thread may wait for the write lock.
    const uint32_t owed = std::exchange(owed_credits_, 0);
    lock.unlock();
    if (auto st = write_frame(FrameHeader{FrameType::kCredit, owed}, nullptr); !st) {
      fail(st.error());
      return abort_error();
    }
    lock.lock();
  }
  // What arrived before an abort is still delivered in order (the eof of a peer that then
  // closed cleanly must not turn into an error).
  if (rx_head_ < rx_tail_) {
    Slot& s = ring_[queued_[rx_head_ % ring_.size()]];
    rx_holding_ = true;
    if (!deferred && claim_payload_locked(s)) {
      // A payload left on the socket for a caller that wants it in memory: read it here.
      lock.unlock();
      RDMIG_TRY(read_payload(s));
      lock.lock();
      payload_taken_locked(s);
    }
    // A leftover of the reader's inline splice is delivered by deliver_to() as a pending payload.
    const size_t pending = s.pending + s.piped + (s.rest - std::min(s.rest, s.offset));
    return ChunkView{std::span<const std::byte>(s.data + s.offset, pending > 0 ? 0 : s.size - s.offset), s.eof,
                     pending};
  }
  lock.unlock();
  return abort_error();
}

Result<LocalMove> TcpChannel::deliver_to(int fd) {
  Slot* s = nullptr;
  bool claimed = false;
  {
    std::unique_lock lock(rx_mu_);
    if (rx_holding_) s = &ring_[queued_[rx_head_ % ring_.size()]];
    if (s != nullptr && (s->piped > 0 || s->rest > s->offset)) {
      // What the reader's inline splice left: the pipe's bytes first, then the slot's. The slot
      // is queued, so only this thread touches it and the pipe now.
      lock.unlock();
      size_t moved = 0;
      while (s->piped > 0) {
        const ssize_t k = splice_retry(down_pipe_.r.get(), fd, s->piped, fd, POLLOUT);
        if (k <= 0) return LocalMove{moved, false, k < 0 ? errno : EPIPE};
        s->piped -= static_cast<size_t>(k);
        moved += static_cast<size_t>(k);
      }
      const size_t left = s->rest - s->offset;
      if (const int err = net::send_all_ready(fd, s->data + s->offset, left); err != 0) return LocalMove{moved, false, err};
      s->rest = s->offset = 0;
      return LocalMove{moved + left, false, 0};
    }
    if (s != nullptr && !(claimed = claim_payload_locked(*s))) {
      // The reader may be taking the payload into memory right now: let it finish.
      rx_cv_.wait(lock, [&] { return s->pending == 0 || aborted_.load(); });
      if (s->pending != 0) {
        lock.unlock();
        return abort_error();
      }
    }
  }
  if (s == nullptr || s->eof) return Error{Errc::kInternal, "deliver without a received chunk"};
  const size_t len = s->size;
  if (!claimed) {
    // The reader took the payload into memory meanwhile (the receiver was slow to come).
    if (const int err = net::send_all_ready(fd, s->data, len); err != 0) return LocalMove{0, false, err};
    return LocalMove{len, false, 0};
  }
  // Pull the whole payload into the pipe (what does not fit: into the slot), hand the socket
  // back to the reader, then push into QEMU: a slow QEMU holds up this chunk only, never the
  // connection.
  const auto got = pull_payload(len, s->data);
  if (!got) return abort_error();
  const size_t pulled = *got, rest = len - pulled;
  size_t written = 0;
  auto push = [&]() -> int {  // pipe -> QEMU, all of it; 0 or errno
    while (written < pulled) {
      const ssize_t k = splice_retry(down_pipe_.r.get(), fd, pulled - written, fd, POLLOUT);
      if (k <= 0) return k < 0 ? errno : EPIPE;
      written += static_cast<size_t>(k);
    }
    return 0;
  };
  {
    std::lock_guard lock(rx_mu_);
    payload_taken_locked(*s);
  }
  // The socket is the reader's again; QEMU gets the pipe, then the rest, in order.
  if (const int err = push(); err != 0) return LocalMove{written, false, err};
  if (rest > 0) {
    if (const int err = net::send_all_ready(fd, s->data, rest); err != 0) return LocalMove{written, false, err};
  }
  return LocalMove{len, false, 0};
}

Status TcpChannel::release() {
  uint32_t credits = 0;
  {
    std::lock_guard lock(rx_mu_);
    if (!rx_holding_) return Error{Errc::kInternal, "release without a received chunk"};
    const uint32_t held = queued_[rx_head_ % ring_.size()];
    const bool was_eof = ring_[held].eof;
    unplace_locked(ring_[held]);
    free_.push_back(held);
    ++rx_head_;
    rx_holding_ = false;
    const uint32_t granted = batcher_.on_release(was_eof);
    rx_granted_ += granted;
    credits = granted + std::exchange(owed_credits_, 0);
  }
  rx_cv_.notify_all();
  if (credits == 0) return ok_status();
  auto st = write_frame(FrameHeader{FrameType::kCredit, credits}, nullptr);
  if (!st) fail(st.error());
  return st;
}

void TcpChannel::fail_after_write_error(const Error& e) {
  const auto deadline = std::chrono::steady_clock::now() + kPeerReasonWait;
  while (!aborted_.load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  fail(e);  // ignored when the reader recorded the peer's reason first
}

std::optional<Error> TcpChannel::link_failure() const {
  if (!link_failed_.load()) return std::nullopt;
  std::lock_guard a(abort_mu_);
  return abort_reason_;
}

void TcpChannel::fail(const Error& e) {
  {
    std::lock_guard a(abort_mu_);
    if (abort_reason_) return;
    abort_reason_ = e;
    // Socket errors and an end of stream without the peer's abort frame: the link. A local abort
    // comes through abort() with its own code; the peer's reason sets peer_aborted_ first.
    link_failed_.store(!peer_aborted_.load() && !local_abort_.load() &&
                       (e.code == Errc::kUnavailable || e.code == Errc::kIo || e.code == Errc::kTimeout));
  }
  aborted_.store(true);
  credits_.abort(e);
  ::shutdown(fd_.get(), SHUT_RDWR);
  { std::lock_guard lock(rx_mu_); }  // a waiter between its check and its wait sees aborted_
  rx_cv_.notify_all();
}

void TcpChannel::abort(const Error& reason) {
  local_abort_.store(true);
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
      if (via_tls_) {
        std::string frame(reinterpret_cast<const char*>(header.data()), header.size());
        frame.append(msg, 0, len);
        (void)tls_->try_write(std::as_bytes(std::span(frame)));
        lock.unlock();
        fail(reason);
        return;
      }
      iovec iov[2] = {{header.data(), header.size()}, {const_cast<char*>(msg.data()), len}};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = 2;
      (void)::sendmsg(fd_.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
  }
  fail(reason);
}

bool TcpChannel::set_inline_sink(int fd, Delivered delivered) {
  // One chunk may wait in QEMU's unix socket instead of the ring: without room for it, most
  // chunks would be written only in part and the rest handed off after all. SO_SNDBUFFORCE (the
  // agent runs privileged) passes net.core.wmem_max; when refused, the socket keeps what it has.
  // A TCP socket (KubeVirt's proxies) is left alone: setting its buffer would end autotuning.
  // At most kMaxSinkBuffer: the buffer is kernel memory outside migration.bufferBudget, and
  // with 1 GiB chunks a socket nobody reads would otherwise hold 2 GiB of it per channel.
  sockaddr_storage addr{};
  socklen_t alen = sizeof addr;
  const bool unix_socket =
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) == 0 && addr.ss_family == AF_UNIX;
  int have = 0;
  socklen_t len = sizeof have;
  const size_t sink = std::min<size_t>(chunk_size_, kMaxSinkBuffer);
  if (unix_socket && ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &have, &len) == 0 && static_cast<size_t>(have) < 2 * sink) {
    const int want = static_cast<int>(sink);  // the kernel doubles it
    if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &want, sizeof want) != 0) {
      (void)::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
    }
  }
  // Splicing into it must never block the reader: the socket is made non-blocking (this
  // channel's own hops on it wait for readiness; so must its caller's).
  bool nonblocking = false;
  if (splices()) {
    const int flags = ::fcntl(fd, F_GETFL);
    nonblocking = flags >= 0 && ((flags & O_NONBLOCK) != 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0);
  }
  std::lock_guard lock(rx_mu_);
  sink_fd_ = fd;
  sink_ = std::move(delivered);
  sink_nonblocking_ = nonblocking;
  return true;
}

void TcpChannel::clear_inline_sink() {
  std::unique_lock lock(rx_mu_);
  sink_fd_ = -1;
  sink_ = nullptr;
  sink_nonblocking_ = false;
  // The reader may be waiting for room in the socket (at most kInlineWaitMs): the caller closes it next.
  rx_cv_.wait(lock, [&] { return !inline_pushing_; });
}

bool TcpChannel::return_inline_credits(uint32_t credits) {
  if (credits == 0) return true;
  // Never wait for the write lock here (the sender may hold it, blocked on a full socket whose
  // peer waits for this thread to read): leave the credits to the receiving thread.
  std::unique_lock w(write_mu_, std::try_to_lock);
  if (w.owns_lock()) {
    if (auto st = write_frame_locked(FrameHeader{FrameType::kCredit, credits}, nullptr); !st) {
      w.unlock();
      fail(st.error().with_context("channel " + std::to_string(index_)));
      return false;
    }
    return true;
  }
  {
    std::lock_guard lock(rx_mu_);
    owed_credits_ += credits;
  }
  rx_cv_.notify_all();
  return true;
}

std::optional<size_t> TcpChannel::pull_into_pipe(size_t len) {
  // The socket read waits for the payload's first byte; a full pipe ends the pull (the pipe is
  // empty when it starts, so an EAGAIN before any byte is the socket's).
  size_t pulled = 0;
  while (pulled < len) {
    ssize_t n;
    do n = ::splice(fd_.get(), nullptr, down_pipe_.w.get(), nullptr, len - pulled, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
    while (n < 0 && errno == EINTR);
    if (n > 0) {
      pulled += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EAGAIN) {
      if (pulled > 0) break;  // the pipe is full
      pollfd p{fd_.get(), POLLIN, 0};
      (void)::poll(&p, 1, 1000);
      if (aborted_.load()) return std::nullopt;
      continue;
    }
    if (!aborted_.load()) {
      const std::string where = "channel " + std::to_string(index_);
      fail(n == 0 ? Error{Errc::kUnavailable, where + ": peer closed the connection"}
                  : errno_error(where + ": splice from peer", errno));
    }
    return std::nullopt;
  }
  return pulled;
}

bool TcpChannel::finish_pull(size_t len, size_t piped, std::byte* rest_at) {
  if (const size_t rest = len - piped; rest > 0) {
    auto r = net::read_exact(fd_.get(), std::span(rest_at, rest));
    if (!r) {
      fail(r.error().with_context("channel " + std::to_string(index_)));
      return false;
    }
  }
  metrics_.chunks_received->Increment();
  metrics_.bytes_received->Increment(static_cast<double>(len));
  spliced_received_.fetch_add(piped, std::memory_order_relaxed);
  return true;
}

std::optional<size_t> TcpChannel::pull_payload(size_t len, std::byte* rest_at) {
  // Into the pipe (empty: the previous payload left it whole, or is still queued and then nobody
  // pulls). What a full pipe leaves goes into the slot's memory: emptying the pipe into QEMU could
  // block on QEMU while this thread holds the socket.
  const auto pulled = pull_into_pipe(len);
  if (!pulled || !finish_pull(len, *pulled, rest_at)) return std::nullopt;
  return pulled;
}

void TcpChannel::push_inline_locked(std::unique_lock<std::mutex>& lock, const Slot& s, size_t pulled, size_t rest,
                                    size_t& pushed, size_t& wrote, std::chrono::steady_clock::time_point deadline) {
  // Without blocking under rx_mu_; when the sink is full, wait for room without the lock
  // (inline_pushing_ keeps the socket open: clear_inline_sink() waits for it). A partial write
  // is not an error here: the receiver meets any error itself.
  while (sink_fd_ >= 0 && sink_nonblocking_ && !aborted_.load()) {
    const size_t before = pushed + wrote;
    int err = 0;
    while (pushed < pulled) {
      ssize_t k;
      do k = ::splice(down_pipe_.r.get(), nullptr, sink_fd_, nullptr, pulled - pushed, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      while (k < 0 && errno == EINTR);
      if (k <= 0) {
        err = k < 0 ? errno : EPIPE;
        break;
      }
      pushed += static_cast<size_t>(k);
    }
    while (pushed == pulled && wrote < rest) {
      ssize_t k;
      do k = ::send(sink_fd_, s.data + wrote, rest - wrote, MSG_DONTWAIT | MSG_NOSIGNAL);
      while (k < 0 && errno == EINTR);
      if (k <= 0) {
        err = k < 0 ? errno : EPIPE;
        break;
      }
      wrote += static_cast<size_t>(k);
    }
    if (pushed + wrote > before) sink_(pushed + wrote - before, pushed + wrote == s.size);
    if ((pushed == pulled && wrote == rest) || err != EAGAIN) return;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    const int sink = sink_fd_;
    inline_pushing_ = true;
    lock.unlock();
    pollfd p{sink, POLLOUT, 0};
    const int r = ::poll(&p, 1, static_cast<int>(left.count()));
    lock.lock();
    inline_pushing_ = false;
    // clear_inline_sink() waits for it (and set sink_fd_ first). Otherwise no one does: the
    // receiving thread parked in next_chunk() must not be woken for nothing on every wait.
    if (sink_fd_ != sink) rx_cv_.notify_all();
    if (r <= 0 || (p.revents & POLLOUT) == 0) return;  // timed out, or failing: the receiver meets it
  }
}

bool TcpChannel::splice_inline(Slot& s, uint32_t slot_index) {
  const size_t len = s.size;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(inline_wait_ms_.load(std::memory_order_relaxed));
  size_t pulled = 0, pushed = 0, wrote = 0;
  for (;;) {
    const auto got = pull_into_pipe(len - pulled);
    if (!got) return false;
    pulled += *got;
    if (pulled == len) break;
    // The pipe filled before the payload was in (pieces smaller than a page: a stream relayed
    // from a TCP socket): empty it into the sink and pull on, rather than copy the rest through
    // memory. If the sink does not take all of it in time, the rest goes into the slot.
    std::unique_lock lock(rx_mu_);
    push_inline_locked(lock, s, pulled, 0, pushed, wrote, deadline);
    if (pushed < pulled) break;
  }
  const size_t rest = len - pulled;  // into the slot: the first `rest` bytes of its memory
  if (!finish_pull(len, pulled, s.data)) return false;
  uint32_t credits = 0;
  bool whole = false;
  {
    std::unique_lock lock(rx_mu_);
    push_inline_locked(lock, s, pulled, rest, pushed, wrote, deadline);
    whole = pushed + wrote == len;
    if (whole) {
      credits = batcher_.on_release(false);
      rx_granted_ += credits;
      inline_chunks_.fetch_add(1, std::memory_order_relaxed);
      inline_spliced_.fetch_add(1, std::memory_order_relaxed);
      unplace_locked(s);  // nothing queued: the next chunk goes where this one went
      free_.push_back(slot_index);
    } else {
      s.piped = pulled - pushed;
      s.rest = rest;
      s.offset = wrote;
      queued_[rx_tail_ % ring_.size()] = slot_index;
      ++rx_tail_;
    }
  }
  if (!whole) {
    rx_cv_.notify_all();
    return true;
  }
  return return_inline_credits(credits);
}

bool TcpChannel::deliver_inline_locked(Slot& slot, uint32_t& credits) {
  if (sink_fd_ < 0 || rx_head_ != rx_tail_ || slot.eof || aborted_.load()) return false;
  ssize_t k;
  do k = ::send(sink_fd_, slot.data, slot.size, MSG_DONTWAIT | MSG_NOSIGNAL);
  while (k < 0 && errno == EINTR);
  if (k <= 0) return false;  // full (or failing: the receiving thread meets the error)
  const auto n = static_cast<size_t>(k);
  const bool whole = n == slot.size;
  sink_(n, whole);
  if (!whole) {
    slot.offset = n;
    return false;
  }
  credits = batcher_.on_release(false);
  rx_granted_ += credits;
  inline_chunks_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

Result<bool> TcpChannel::fill(std::span<std::byte> dst, bool eof_ok, bool ahead) {
  if (via_tls_) {
    // The TLS layer reads whole records ahead itself.
    size_t got = 0;
    while (got < dst.size()) {
      auto n = tls_->read_some(dst.subspan(got));
      if (!n) return n.error();
      if (n.value() == 0) {
        if (got == 0 && eof_ok) return false;
        return Error{Errc::kUnavailable, "peer closed the connection"};
      }
      got += n.value();
    }
    return true;
  }
  const size_t have = std::min(dst.size(), ahead_len_);
  if (have > 0) {
    std::memcpy(dst.data(), ahead_.data() + ahead_off_, have);
    ahead_off_ += have;
    ahead_len_ -= have;
  }
  if (have == dst.size()) return true;
  // Nothing is left ahead here: the reads may take the next bytes into ahead_.
  ahead_off_ = 0;
  return net::read_exact_ahead(fd_.get(), dst.subspan(have), ahead ? std::span(ahead_) : std::span<std::byte>(),
                               ahead_len_, eof_ok && have == 0);
}

void TcpChannel::reader_loop() {
  name_this_thread("rdmig-rx-" + std::to_string(index_));
  const std::string where = "channel " + std::to_string(index_);
  for (;;) {
    std::array<std::byte, kFrameHeaderSize> raw{};
    const bool ahead = !no_read_ahead_.load(std::memory_order_relaxed);
    auto got = fill(raw, /*eof_ok=*/true, ahead);
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
        uint32_t slot_index = 0;
        bool defer = false;
        bool inline_splice = false;
        bool placed = false;
        {
          std::unique_lock lock(rx_mu_);
          bool within = false;
          if (h->type == FrameType::kData) {
            // The peer may have at most depth chunks unanswered by a credit.
            within = !peer_eof_ && rx_data_ - rx_granted_ < depth_;
            if (within) {
              ++rx_data_;
              // Read no further ahead of the receiver than kReaderQueueLimit: the rest of what the
              // credits let the peer send waits in the socket's receive buffer. A receiver that
              // takes nothing for the hold-back (its QEMU stopped reading) is left behind: then the
              // reader reads on, as far as the credits go, until the receiver catches up, so that
              // credits for the other direction queued behind the data still get through.
              if (rx_tail_ - rx_head_ < kReaderQueueLimit) {
                reader_unheld_ = false;
              } else if (!reader_unheld_) {
                const auto hold = std::chrono::milliseconds(hold_back_ms_.load(std::memory_order_relaxed));
                if (!rx_cv_.wait_for(lock, hold, [&] { return rx_tail_ - rx_head_ < kReaderQueueLimit || aborted_.load(); })) {
                  reader_unheld_ = true;
                }
              }
              if (aborted_.load()) return;
            }
          } else {
            // An eof marker may sit in the one extra place the ring keeps for it.
            within = !peer_eof_ && rx_tail_ - rx_head_ < depth_ + 1;
          }
          if (within) {
            // Fewer than depth + 1 slots are queued, so one is free.
            slot_index = free_.back();
            free_.pop_back();
            slot = &ring_[slot_index];
            placed = h->type != FrameType::kData || place_locked(*slot);
            if (h->type == FrameType::kEof) peer_eof_ = true;
            defer = deferred_ && h->type == FrameType::kData && h->length <= defer_limit_ && ahead_len_ == 0;
            // Nothing queued before it and QEMU's socket at hand: this thread splices it through.
            inline_splice = defer && sink_fd_ >= 0 && sink_nonblocking_ && rx_head_ == rx_tail_;
          }
        }
        if (slot == nullptr) {
          fail(Error{Errc::kProtocol, where + ": peer sent beyond its credits or after eof"});
          return;
        }
        if (!placed) {
          if (!rx_mem_) {
            out_of_memory("its receive buffer of " + std::to_string(rx_bytes()) + " bytes (ring depth " +
                          std::to_string(depth_) + " x chunks of " + std::to_string(chunk_size_) + " bytes)");
          } else {
            fail(Error{Errc::kInternal, where + ": no free place for a received chunk"});
          }
          return;
        }
        slot->eof = h->type == FrameType::kEof;
        slot->size = h->length;
        slot->offset = 0;
        slot->pending = 0;
        slot->piped = 0;
        slot->rest = 0;
        if (inline_splice) {
          if (!splice_inline(*slot, slot_index)) return;
          break;
        }
        if (defer) {
          // The payload stays on the socket for the receiver to splice (deliver_to). If the
          // receiver has not come for it within kDeferWait (QEMU is slow), take it into the
          // slot as without splice, so the connection waits on QEMU no longer than that.
          std::unique_lock lock(rx_mu_);
          slot->pending = h->length;
          payload_on_socket_ = true;
          queued_[rx_tail_ % ring_.size()] = slot_index;
          ++rx_tail_;
          rx_cv_.notify_all();
          while (payload_on_socket_ && !aborted_.load()) {
            if (rx_cv_.wait_for(lock, kDeferWait, [&] { return !payload_on_socket_ || aborted_.load(); })) break;
            if (claim_payload_locked(*slot)) {
              lock.unlock();
              if (!read_payload(*slot)) return;
              lock.lock();
              payload_taken_locked(*slot);
            }
          }
          if (aborted_.load()) return;
          break;
        }
        if (!slot->eof) {
          auto r = fill(std::span(slot->data, h->length), /*eof_ok=*/false, ahead);
          if (!r) {
            fail(r.error().with_context(where));
            return;
          }
          metrics_.chunks_received->Increment();
          metrics_.bytes_received->Increment(h->length);
        }
        uint32_t credits = 0;
        bool inline_done = false;
        {
          std::lock_guard lock(rx_mu_);
          inline_done = deliver_inline_locked(*slot, credits);
          if (inline_done) {
            unplace_locked(*slot);  // nothing queued: the next chunk goes where this one went
            free_.push_back(slot_index);
          } else {
            queued_[rx_tail_ % ring_.size()] = slot_index;
            ++rx_tail_;
          }
        }
        if (!inline_done) {
          rx_cv_.notify_all();
        } else if (!return_inline_credits(credits)) {
          return;
        }
        // After an eof, keep reading: credits for our own direction still come back here.
        break;
      }
      case FrameType::kAbort: {
        std::string reason(h->length, '\0');
        if (h->length > 0) {
          (void)fill(std::as_writable_bytes(std::span(reason.data(), reason.size())), /*eof_ok=*/false, false);
        }
        peer_aborted_.store(true);
        fail(Error{Errc::kUnavailable, where + ": peer aborted: " + reason});
        return;
      }
    }
  }
}

}  // namespace rdmig::transport
