// A channel over one RC queue pair.
//
// Each side registers a receive ring (recv_depth slots of recv_chunk bytes) that the peer
// writes into, and staging slots (send_depth x send_chunk) that QEMU's bytes are read into
// directly. A chunk is one RDMA WRITE WITH IMMEDIATE from staging slot k into the peer's
// ring slot k (k = sequence mod depth; RC keeps order, so the receiver needs no header).
// Credits come back as zero-length writes with a credit immediate; a staging slot is reused
// only when its credit is back, which also proves the write left our memory. Only every Nth
// write asks for a completion; the send queue is sized so it never fills with unsignalled work.
// A peer whose NIC stops acknowledging fails the channel after kAckStall (ack_watch.h).
//
// Threads: the sender thread posts writes, the receiver thread releases slots (posts credit
// messages), and a poller thread owned by the channel drains the completion queue and the
// connection's rdma_cm events; it is joined by the destructor.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "common/net.h"
#include "metrics/metrics.h"
#include "transport/channel.h"
#include "transport/framing.h"
#include "transport/rdma/ack_watch.h"
#include "transport/rdma/cm.h"
#include "transport/rdma/verbs.h"

namespace rdmig::transport::rdma {

struct RdmaChannelParams {
  uint32_t index = 0;
  uint32_t send_chunk = 0;  // slot size of the peer's ring
  uint32_t send_depth = 0;  // slots of the peer's ring = our credits
  uint32_t recv_chunk = 0;  // slot size of our ring
  uint32_t recv_depth = 0;
};

// Connecting side: bind rdma_cm to `source_ip` (the chosen device's address; "" = let routing
// pick the device) and put the IP ToS byte `tos` on the connection's packets (-1 = the kernel's
// default).
struct RdmaConnectOptions {
  std::string source_ip;
  int tos = -1;
};

class RdmaChannel final : public Channel {
 public:
  // Source side: resolves `ep`, connects, returns once the connection is established; `timeout`
  // bounds all of it (address and route resolution and the connect together).
  static Result<std::unique_ptr<RdmaChannel>> connect(const net::Endpoint& ep,
                                                       const ChannelCredentials& credentials,
                                                       const RdmaChannelParams& params,
                                                       TransportMetrics& metrics,
                                                       std::chrono::milliseconds timeout,
                                                       const std::function<bool()>& cancelled = {},
                                                       const RdmaConnectOptions& options = {});
  // Target side: `id` came in a CONNECT_REQUEST carrying `request`; `events` is the channel
  // the id was migrated to. Accepts; the poller sees the connection established.
  static Result<std::unique_ptr<RdmaChannel>> accept(EventChannelPtr events, CmIdPtr id,
                                                     const ConnectRequest& request,
                                                     const RdmaChannelParams& params,
                                                     TransportMetrics& metrics, const std::string& key);
  ~RdmaChannel() override;

  Result<std::span<std::byte>> acquire() override;
  Status send(size_t n) override;
  void unacquire() override;
  Status send_eof() override;
  Status drain() override;
  Result<ChunkView> receive() override;
  Status release() override;
  void abort(const Error& reason) override;
  // The link's failures: a work completion in error (retries exhausted, a flushed queue after
  // the QP broke), the acknowledgement watch's stall, a disconnect or device removal without the
  // peer's abort. Not: an abort of either end, a protocol error, a local verbs failure.
  bool link_failed() const override { return link_failed_.load(); }
  std::optional<Error> link_failure() const override;
  uint32_t index() const override { return params_.index; }
  size_t chunk_size() const override { return params_.send_chunk; }
  const char* transport() const override { return "rdma"; }

 private:
  RdmaChannel(EventChannelPtr events, CmIdPtr id, const RdmaChannelParams& params, TransportMetrics& metrics);
  Status setup_resources();
  Status post_recv();
  // Posts one write; waits for room in the send queue unless `wait` is false (then a full
  // queue is kResourceExhausted and nothing is posted).
  // `signal`: this write completes with a work completion of its own (which, on a reliable
  // connection, also completes every write before it).
  Status post_write(uint32_t imm, const std::byte* local, uint32_t len, uint64_t remote_offset, bool wait = true,
                    bool signal = false);
  Status post_control(uint32_t imm);
  // Waits (at most 250 ms) until the peer acknowledged every write posted so far, before a close
  // or an abort disconnects (which would flush what is not yet sent); returns at once on the
  // poller's thread, on a failed channel, or when the peer already stopped acknowledging.
  void await_acknowledged();
  // Posts `wr` (sq_mu_ held, room checked): signalled when `force_signal` or when due.
  Status post_locked(ibv_send_wr& wr, bool data, bool force_signal);
  // Posts a signalled zero-length write (sq_mu_ held, room checked): the acknowledgement probe.
  Status post_probe_locked();
  // Poller: fails the channel if the peer's NIC acknowledged nothing for kAckStall, or posts a
  // probe so that unsignalled writes get judged too (ack_watch.h).
  void watch_acks(uint64_t now_us);
  void start_poller();
  void poller_loop();
  bool handle_completion(const ibv_wc& wc);
  void handle_cm_event(const CmEvent& ev);
  void fail(const Error& e, const char* kind);
  Status wait_established();

  const RdmaChannelParams params_;
  TransportMetrics& metrics_;

  // Resources in dependency order: destroyed bottom-up.
  EventChannelPtr events_;
  CmIdPtr id_;
  PdPtr pd_;
  CompChannelPtr comp_;
  CqPtr cq_;
  AlignedBuffer recv_ring_;
  AlignedBuffer staging_;
  MrPtr recv_mr_;
  MrPtr staging_mr_;
  struct QpDestroyer {
    void operator()(rdma_cm_id* id) const { if (id && id->qp) rdma_destroy_qp(id); }
  };
  std::unique_ptr<rdma_cm_id, QpDestroyer> qp_;  // the QP of id_, destroyed before the CQ

  uint64_t peer_ring_addr_ = 0;
  uint32_t peer_ring_rkey_ = 0;

  // Send side.
  CreditGate credits_;
  uint64_t send_seq_ = 0;  // sender thread only
  // Guards sq_outstanding_, unsignaled_, the signalled counts and ack_watch_ (sq_cap_ and signal_every_ are set in
  // setup, before any thread, then only read); sq_cv_ signals room in the send queue. Taken by
  // the sender (post_write, post_locked) and the poller (completions, watch_acks). Lock order:
  // sq_mu_ -> state_mu_ (post_write reads error_ under both); released before fail().
  std::mutex sq_mu_;
  std::condition_variable sq_cv_;
  uint32_t sq_outstanding_ = 0;
  uint32_t unsignaled_ = 0;
  // Signalled writes posted and completed: completions come in posting order on a reliable
  // connection, so a write's number among the signalled ones tells when it was acknowledged (abort()).
  uint64_t signaled_posted_ = 0;
  uint64_t signaled_completed_ = 0;
  uint32_t sq_cap_ = 0;
  uint32_t signal_every_ = 1;
  AckWatch ack_watch_;  // under sq_mu_
  std::atomic<int64_t> outstanding_{0};  // chunks sent, credit not yet back (for the gauge)

  // Receive side.
  struct Arrival {
    uint32_t slot = 0;
    uint32_t size = 0;
    bool eof = false;
  };
  // Guards arrivals_, holding_ and peer_eof_; rx_cv_ signals an arrival. Taken by the poller
  // (queueing arrivals, the eof) and the receiving thread (receive, release). No other lock is
  // taken under it; fail() is never called with it held, and takes it (and sq_mu_) once after
  // setting failed_ so that no waiter misses the notify (as TcpChannel::fail).
  std::mutex rx_mu_;
  std::condition_variable rx_cv_;
  std::deque<Arrival> arrivals_;
  uint64_t rx_seq_ = 0;  // poller thread only
  bool holding_ = false;
  bool peer_eof_ = false;
  CreditBatcher batcher_;  // receiver thread only

  // Guards established_ and error_ (and the rdma_disconnect in fail(), once); state_cv_
  // signals either. Taken by the poller (CM events, completions), fail() from any thread, the
  // sender and receiver reading error_, and wait_established(). Innermost: taken under sq_mu_,
  // nothing taken under it. connect() sets established_ before the poller starts.
  mutable std::mutex state_mu_;
  std::condition_variable state_cv_;
  bool established_ = false;
  std::optional<Error> error_;
  // abort()'s reason from before it posts the abort until it fails the channel: a disconnect the
  // peer answers the abort with, seen in between, ends the channel as that abort, not as a link
  // failure (under state_mu_).
  std::optional<Error> aborting_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> link_failed_{false};  // set with error_, before failed_ (link_failed())
  std::atomic<bool> stopping_{false};
  std::thread poller_;
};

}  // namespace rdmig::transport::rdma
