#include "transport/rdma/rdma_channel.h"

#include <arpa/inet.h>
#include <poll.h>

#include <cstdio>
#include <cstring>
#include <string_view>

#include "common/log.h"
#include "common/thread_name.h"
#include "transport/rdma/imm.h"

namespace rdmig::transport::rdma {

using namespace std::chrono_literals;

namespace {

constexpr uint64_t kDataFlag = uint64_t{1} << 63;
constexpr uint64_t kTimeMask = (uint64_t{1} << 48) - 1;
// How long a close or an abort waits for the peer to acknowledge what this end wrote before it
// disconnects (await_acknowledged; a dead peer never does: that much later, never blocked).
constexpr auto kAbortSendWait = std::chrono::milliseconds(250);

uint64_t now_us() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch()).count());
}

}  // namespace

RdmaChannel::RdmaChannel(EventChannelPtr events, CmIdPtr id, const RdmaChannelParams& params,
                         TransportMetrics& metrics)
    : params_(params),
      metrics_(metrics),
      events_(std::move(events)),
      id_(std::move(id)),
      credits_(params.send_depth),
      batcher_(params.recv_depth) {}

RdmaChannel::~RdmaChannel() {
  bool open = false;
  {
    std::lock_guard lock(state_mu_);
    open = established_ && !error_;
  }
  // A close: the last credits this end posted reach the peer before the disconnect can flush
  // them (the peer would take the close for a lost link: rdmig-stream's client on Debian 13's rxe).
  if (open) await_acknowledged();
  stopping_ = true;
  {
    std::lock_guard lock(state_mu_);
    if (established_) rdma_disconnect(id_.get());
  }
  credits_.abort(Error{Errc::kCancelled, "channel closed"});
  rx_cv_.notify_all();
  sq_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
  metrics_.chunks_in_flight->Decrement(static_cast<double>(outstanding_.load()));
}

Status RdmaChannel::post_recv() {
  ibv_recv_wr wr{};
  ibv_recv_wr* bad = nullptr;
  wr.wr_id = 0;
  wr.sg_list = nullptr;
  wr.num_sge = 0;  // write-with-immediate lands in the ring; the receive only takes the immediate
  if (ibv_post_recv(id_->qp, &wr, &bad) != 0) return verbs_error("ibv_post_recv", errno);
  return ok_status();
}

Status RdmaChannel::post_write(uint32_t imm, const std::byte* local, uint32_t len, uint64_t remote_offset,
                               bool wait, bool signal) {
  std::unique_lock lock(sq_mu_);
  if (!wait && sq_outstanding_ + 1 >= sq_cap_) return Error{Errc::kResourceExhausted, "send queue full"};
  sq_cv_.wait(lock, [&] { return sq_outstanding_ + 1 < sq_cap_ || failed_.load(); });
  if (failed_.load()) {
    std::lock_guard s(state_mu_);
    return error_.value_or(Error{Errc::kCancelled, "channel failed"});
  }
  ibv_sge sge{};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = peer_ring_addr_ + remote_offset;
  wr.wr.rdma.rkey = peer_ring_rkey_;
  if (len > 0) {
    sge.addr = reinterpret_cast<uintptr_t>(local);
    sge.length = len;
    sge.lkey = staging_mr_->lkey;
    wr.sg_list = &sge;
    wr.num_sge = 1;
  }
  return post_locked(wr, len > 0, signal);
}

Status RdmaChannel::post_locked(ibv_send_wr& wr, bool data, bool force_signal) {
  ibv_send_wr* bad = nullptr;
  ++unsignaled_;
  const uint64_t now = now_us();
  // Signal every Nth write, and always before the send queue could fill with unsignalled work.
  const bool signaled = force_signal || unsignaled_ >= signal_every_ || sq_outstanding_ + 2 >= sq_cap_ / 2;
  const uint32_t covered = unsignaled_;
  if (signaled) {
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr_id = (data ? kDataFlag : 0) | (uint64_t{covered} << 48) | (now & kTimeMask);
    unsignaled_ = 0;
  }
  if (ibv_post_send(id_->qp, &wr, &bad) != 0) {
    const int err = errno;
    if (signaled) unsignaled_ = covered;
    --unsignaled_;
    return verbs_error("ibv_post_send", err);
  }
  ++sq_outstanding_;
  if (signaled) ++signaled_posted_;
  ack_watch_.posted(now, signaled);
  return ok_status();
}

Status RdmaChannel::post_probe_locked() {
  // A zero-length RDMA WRITE without immediate: the peer's NIC acknowledges it, and nothing
  // there changes (no receive taken, no byte written; the address and key are valid anyway).
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.wr.rdma.remote_addr = peer_ring_addr_;
  wr.wr.rdma.rkey = peer_ring_rkey_;
  return post_locked(wr, false, true);
}

void RdmaChannel::watch_acks(uint64_t now) {
  {
    std::lock_guard s(state_mu_);
    if (!established_ || error_) return;
  }
  std::unique_lock lock(sq_mu_);
  switch (ack_watch_.check(now, sq_outstanding_)) {
    case AckWatch::Verdict::kFine:
      return;
    case AckWatch::Verdict::kProbe: {
      if (sq_outstanding_ + 1 >= sq_cap_) return;  // a full queue holds a signalled write already
      if (auto st = post_probe_locked(); !st) {
        lock.unlock();
        fail(st.error().with_context("channel " + std::to_string(params_.index) + ": acknowledgement probe"),
             "post_send");
      }
      return;
    }
    case AckWatch::Verdict::kStalled: {
      const int64_t waited_ms = ack_watch_.oldest_wait_us(now) / 1000;
      const uint32_t outstanding = sq_outstanding_;
      lock.unlock();
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", static_cast<double>(waited_ms) / 1000.0);
      fail(Error{Errc::kUnavailable,
                 "channel " + std::to_string(params_.index) + ": the peer's RDMA NIC acknowledged nothing for " + secs +
                     " s (" + std::to_string(outstanding) +
                     " writes outstanding): this path carries no RoCE now (link, cable or switch port down, "
                     "VLAN or PFC misconfigured, or UDP 4791 filtered)"},
           "ack_stall");
      return;
    }
  }
}

Status RdmaChannel::post_control(uint32_t imm) { return post_write(imm, nullptr, 0, 0); }

Status RdmaChannel::wait_established() {
  std::unique_lock lock(state_mu_);
  state_cv_.wait_for(lock, 30s, [&] { return established_ || error_.has_value(); });
  if (error_) return *error_;
  if (!established_) return Error{Errc::kTimeout, "rdma connection not established within 30 s"};
  return ok_status();
}

Result<std::span<std::byte>> RdmaChannel::acquire() {
  RDMIG_TRY(wait_established());
  auto waited = credits_.take();
  if (!waited) return waited.error();
  if (waited.value()) metrics_.credit_stalls->Increment();
  const size_t slot = send_seq_ % params_.send_depth;
  return std::span<std::byte>(staging_.get() + slot * params_.send_chunk, params_.send_chunk);
}

void RdmaChannel::unacquire() { credits_.untake(); }

Status RdmaChannel::send(size_t n) {
  if (n == 0 || n > params_.send_chunk) return Error{Errc::kInternal, "send of " + std::to_string(n) + " bytes"};
  const size_t slot = send_seq_ % params_.send_depth;
  auto imm = encode_imm({ImmKind::kData, static_cast<uint32_t>(n)});
  auto st = post_write(*imm, staging_.get() + slot * params_.send_chunk, static_cast<uint32_t>(n),
                       uint64_t{slot} * params_.send_chunk);
  if (!st) {
    fail(st.error(), "post_send");
    return st;
  }
  ++send_seq_;
  outstanding_.fetch_add(1);
  metrics_.chunks_in_flight->Increment();
  metrics_.chunks_sent->Increment();
  metrics_.bytes_sent->Increment(static_cast<double>(n));
  metrics_.chunk_size->Observe(static_cast<double>(n));
  return ok_status();
}

Status RdmaChannel::send_eof() {
  RDMIG_TRY(wait_established());
  auto st = post_control(*encode_imm({ImmKind::kEof, 0}));
  if (!st) fail(st.error(), "post_send");
  return st;
}

Status RdmaChannel::drain() { return credits_.wait_all(); }

Result<ChunkView> RdmaChannel::receive() {
  std::unique_lock lock(rx_mu_);
  rx_cv_.wait(lock, [&] { return !arrivals_.empty() || failed_.load(); });
  if (!arrivals_.empty()) {
    const Arrival& a = arrivals_.front();
    holding_ = true;
    if (a.eof) return ChunkView{{}, true};
    return ChunkView{std::span<const std::byte>(recv_ring_.get() + size_t{a.slot} * params_.recv_chunk, a.size), false};
  }
  std::lock_guard s(state_mu_);
  return error_.value_or(Error{Errc::kCancelled, "channel closed"});
}

Status RdmaChannel::release() {
  bool eof = false;
  {
    std::lock_guard lock(rx_mu_);
    if (!holding_ || arrivals_.empty()) return Error{Errc::kInternal, "release without a received chunk"};
    eof = arrivals_.front().eof;
    arrivals_.pop_front();
    holding_ = false;
  }
  const uint32_t credits = batcher_.on_release(eof);
  if (credits == 0) return ok_status();
  auto st = post_control(*encode_imm({ImmKind::kCredit, credits}));
  if (!st) fail(st.error(), "post_send");
  return st;
}

void RdmaChannel::await_acknowledged() {
  if (std::this_thread::get_id() == poller_.get_id()) return;  // it delivers the completions
  std::unique_lock lock(sq_mu_);
  if (sq_outstanding_ == 0 || failed_.load()) return;
  // A peer that already left a write unacknowledged this long is not waited for (a dead link:
  // each of a path check's channels would add the whole wait).
  const auto bound_us = std::chrono::duration_cast<std::chrono::microseconds>(kAbortSendWait).count();
  if (ack_watch_.oldest_wait_us(now_us()) >= bound_us) return;
  // The last writes asked for no completion: a probe asks for one.
  if (unsignaled_ > 0 && sq_outstanding_ + 1 < sq_cap_ && !post_probe_locked().ok()) return;
  const uint64_t ticket = signaled_posted_;
  sq_cv_.wait_for(lock, kAbortSendWait, [&] { return signaled_completed_ >= ticket || failed_.load(); });
}

void RdmaChannel::abort(const Error& reason) {
  bool established = false;
  {
    std::lock_guard lock(state_mu_);
    established = established_ && !error_;
    if (!error_) aborting_ = reason;
  }
  // Tell the peer only if the send queue has room: an abort never queues behind writes a dead
  // or stalled peer will not complete. fail() then disconnects, which ends every waiter.
  if (established && reason.code != Errc::kCancelled) {
    // The disconnect (fail() below) moves this end's QP to the error state, which flushes a write
    // not yet sent, and travels as a CM message on another queue pair, in no order with the
    // abort's write: Debian 13's rxe (6.12, its send queue run from a workqueue) flushed the abort
    // every time, and the peer saw only "peer disconnected", a link failure.
    if (post_write(*encode_imm({ImmKind::kAbort, 0}), nullptr, 0, 0, /*wait=*/false, /*signal=*/true).ok()) {
      await_acknowledged();
    }
  }
  fail(reason, nullptr);
}

std::optional<Error> RdmaChannel::link_failure() const {
  if (!link_failed_.load()) return std::nullopt;
  std::lock_guard lock(state_mu_);
  return error_;
}

void RdmaChannel::fail(const Error& e, const char* kind) {
  {
    std::lock_guard lock(state_mu_);
    if (error_) return;
    // This end is aborting (abort()): whatever ends the link meanwhile, such as the peer's
    // disconnect in answer to the abort, is that abort (seen in a full run under load: the peer's
    // RDMA_CM_EVENT_DISCONNECTED reached this end's poller before abort() called fail()).
    error_ = aborting_ ? *aborting_ : e;
    // What fail() is called with names the cause (`kind` is its metric): the link's kinds below;
    // an abort (either end's) passes none, a protocol error "protocol", a local call its own.
    const std::string_view k = kind ? kind : "";
    link_failed_.store(!aborting_ && e.code == Errc::kUnavailable &&
                       (k.starts_with("wc_") || k == "ack_stall" || k == "disconnected" || k == "device_removal"));
    if (established_) rdma_disconnect(id_.get());
  }
  failed_ = true;
  if (kind && metrics_.owner) metrics_.owner->transport_error("rdma", kind);
  if (e.code != Errc::kCancelled) {
    // Most reasons name the channel already ("channel N: ..."); say it once.
    const std::string tag = "channel " + std::to_string(params_.index) + ": ";
    LOG_WARN("rdma") << (e.message.starts_with(tag) ? "" : tag) << e.message;
  }
  credits_.abort(e);
  // A receiver or sender between its predicate check and its wait (neither wait has a timeout)
  // holds its mutex there: taking each one once orders failed_ before that wait, so the notify
  // below cannot be missed (as TcpChannel::fail does). Never called with either held.
  { std::lock_guard lock(rx_mu_); }
  { std::lock_guard lock(sq_mu_); }
  rx_cv_.notify_all();
  sq_cv_.notify_all();
  state_cv_.notify_all();
}

bool RdmaChannel::handle_completion(const ibv_wc& wc) {
  const std::string where = "channel " + std::to_string(params_.index);
  if (wc.status != IBV_WC_SUCCESS) {
    if (!failed_.load()) {
      fail(Error{Errc::kUnavailable, where + ": work completion failed: " + ibv_wc_status_str(wc.status) +
                                         " (vendor error " + std::to_string(wc.vendor_err) + ")"},
           (std::string("wc_") + ibv_wc_status_str(wc.status)).c_str());
    }
    return false;
  }
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    if (auto st = post_recv(); !st) {
      fail(st.error().with_context(where), "post_recv");
      return false;
    }
    const Imm imm = decode_imm(ntohl(wc.imm_data));
    LOG_DEBUG("rdma") << where << ": imm kind=" << static_cast<int>(imm.kind) << " value=" << imm.value;
    switch (imm.kind) {
      case ImmKind::kData: {
        if (imm.value > params_.recv_chunk) {
          fail(Error{Errc::kProtocol, where + ": chunk of " + std::to_string(imm.value) + " bytes exceeds the slot"}, "protocol");
          return false;
        }
        bool overrun = false;
        {
          std::lock_guard lock(rx_mu_);
          overrun = peer_eof_ || arrivals_.size() >= params_.recv_depth;
          if (!overrun) {
            arrivals_.push_back(Arrival{static_cast<uint32_t>(rx_seq_ % params_.recv_depth), imm.value, false});
            ++rx_seq_;
            metrics_.chunks_received->Increment();
            metrics_.bytes_received->Increment(imm.value);
            rx_cv_.notify_all();
          }
        }
        // Outside rx_mu_: fail() takes it to wake the receiver.
        if (overrun) {
          fail(Error{Errc::kProtocol, where + ": peer wrote beyond its credits"}, "protocol");
          return false;
        }
        return true;
      }
      case ImmKind::kCredit:
        if (auto st = credits_.give(imm.value); !st) {
          fail(st.error().with_context(where), "protocol");
          return false;
        }
        outstanding_.fetch_sub(imm.value);
        metrics_.chunks_in_flight->Decrement(imm.value);
        return true;
      case ImmKind::kEof: {
        std::lock_guard lock(rx_mu_);
        peer_eof_ = true;
        arrivals_.push_back(Arrival{0, 0, true});
        rx_cv_.notify_all();
        return true;
      }
      case ImmKind::kAbort:
        fail(Error{Errc::kUnavailable, where + ": peer aborted"}, nullptr);
        return false;
    }
    return true;
  }
  if (wc.opcode == IBV_WC_RDMA_WRITE) {
    const uint32_t covered = static_cast<uint32_t>((wc.wr_id >> 48) & 0x7fff);
    if (wc.wr_id & kDataFlag) {
      const uint64_t posted = wc.wr_id & kTimeMask;
      const uint64_t now = now_us() & kTimeMask;
      if (now >= posted) metrics_.chunk_write_latency->Observe(static_cast<double>(now - posted) / 1e6);
    }
    std::lock_guard lock(sq_mu_);
    sq_outstanding_ -= std::min(covered, sq_outstanding_);
    ++signaled_completed_;
    ack_watch_.completed(now_us());
    sq_cv_.notify_all();
  }
  return true;
}

void RdmaChannel::handle_cm_event(const CmEvent& ev) {
  const std::string where = "channel " + std::to_string(params_.index);
  switch (ev.type) {
    case RDMA_CM_EVENT_ESTABLISHED: {
      LOG_DEBUG("rdma") << where << ": established";
      std::lock_guard lock(state_mu_);
      established_ = true;
      state_cv_.notify_all();
      return;
    }
    case RDMA_CM_EVENT_DISCONNECTED:
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
    case RDMA_CM_EVENT_TIMEWAIT_EXIT: {
      bool clean = false;
      {
        std::lock_guard lock(rx_mu_);
        clean = peer_eof_ && credits_.in_flight() == 0;
      }
      if (clean) {
        fail(Error{Errc::kCancelled, where + ": closed"}, nullptr);
      } else if (!failed_.load()) {
        fail(Error{Errc::kUnavailable, where + ": peer disconnected (" + rdma_event_str(ev.type) + ")"},
             ev.type == RDMA_CM_EVENT_DEVICE_REMOVAL ? "device_removal" : "disconnected");
      }
      return;
    }
    case RDMA_CM_EVENT_REJECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
      fail(Error{Errc::kUnavailable, where + ": " + rdma_event_str(ev.type)}, "connect_error");
      return;
    default:
      return;
  }
}

void RdmaChannel::start_poller() {
  poller_ = std::thread([this] { poller_loop(); });
}

void RdmaChannel::poller_loop() {
  name_this_thread("rdmig-cq-" + std::to_string(params_.index));
  ibv_wc wcs[32];
  uint64_t watched_us = now_us();
  while (!stopping_.load()) {
    // Judge the peer's acknowledgements every 100 ms, busy or idle (a channel that only
    // receives completes work all the time while its own writes may be stuck).
    if (const uint64_t now = now_us(); now - watched_us >= 100000) {
      watched_us = now;
      watch_acks(now);
    }
    int n = ibv_poll_cq(cq_.get(), 32, wcs);
    if (n < 0) {
      fail(Error{Errc::kUnavailable, "ibv_poll_cq failed"}, "poll_cq");
      n = 0;
    }
    for (int i = 0; i < n; ++i) handle_completion(wcs[i]);
    if (n > 0) continue;
    // Nothing to do: arm the completion channel, check once more, then sleep on it.
    ibv_req_notify_cq(cq_.get(), 0);
    n = ibv_poll_cq(cq_.get(), 32, wcs);
    for (int i = 0; i < n; ++i) handle_completion(wcs[i]);
    if (n > 0) continue;
    pollfd fds[2] = {{comp_->fd, POLLIN, 0}, {events_->fd, POLLIN, 0}};
    const int rc = ::poll(fds, 2, 100);
    if (rc <= 0) continue;
    if (fds[0].revents & POLLIN) {
      ibv_cq* ev_cq = nullptr;
      void* ev_ctx = nullptr;
      if (ibv_get_cq_event(comp_.get(), &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
    }
    if (fds[1].revents & POLLIN) {
      // Completions queued before the event count first: a peer that posts its last credits
      // and then disconnects closed cleanly, but with both fds ready the credits would still
      // sit in the CQ when the disconnect is judged (seen between two nodes' rxe devices).
      while ((n = ibv_poll_cq(cq_.get(), 32, wcs)) > 0) {
        for (int i = 0; i < n; ++i) handle_completion(wcs[i]);
      }
      auto ev = next_cm_event(events_.get(), 0ms);
      if (ev) handle_cm_event(ev.value());
    }
  }
}

}  // namespace rdmig::transport::rdma
