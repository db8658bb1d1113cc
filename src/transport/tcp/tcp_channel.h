// A channel over one TCP connection: frames (see framing.h) in both directions, vectored
// writes (header + payload in one sendmsg), a reader thread that receives straight into the
// receive buffer's places (two chunks ahead of the receiver, more only when it stalls) and handles
// credits coming back.
//
// Splice (SpliceMode auto/on): the pump moves payload between QEMU's socket and this one
// through a pipe with splice(2), so the bytes never pass through user space. Sending: one
// splice from QEMU into the pipe waits for QEMU's bytes, more splices that do not wait add what
// else QEMU has ready (at most a chunk and the pipe's capacity, 1 MiB), and that becomes the
// chunk: header (MSG_MORE), then the pipe into the socket.
// Receiving (receive_deferred): with an inline sink set (set_inline_sink: QEMU's socket, made
// non-blocking) and nothing queued, the reader thread splices a DATA frame's payload from the
// socket into the pipe and from the pipe into QEMU's socket itself, as the splice floor relay
// does, with no hand-off between threads; when QEMU's socket is full it waits for room, up to 50
// ms a chunk (a target QEMU slower than the link reads 32 KiB at a time: most chunks meet a full
// socket), and what is left then stays in the pipe, queued for the receiver (deliver_to).
// Otherwise the reader hands the chunk to the receiver and waits until deliver_to() has spliced
// its payload from the socket into QEMU's; the socket's receive buffer is the ring then, credits
// and their batching are unchanged.
//
// TLS (dataPlane.tls: on, tls_stream.h): with the kernel doing both directions the socket is
// used as above; otherwise every frame goes through the TlsStream and splice is off.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/chunk_memory.h"
#include "common/fd.h"
#include "metrics/metrics.h"
#include "transport/channel.h"
#include "transport/framing.h"
#include "transport/tcp/splice_mode.h"
#include "transport/tcp/tls_stream.h"

namespace rdmig::transport {

class TcpChannel final : public Channel {
 public:
  // The most a QEMU unix socket's send buffer is raised to for inline delivery (one chunk up
  // to this size waits there instead of the ring; the kernel doubles it).
  static constexpr size_t kMaxSinkBuffer = size_t{16} << 20;
  // Takes a connected socket whose handshake is done (and its TLS, when `tls` is given: the
  // stream made on that socket). `metrics` outlives the channel.
  static std::unique_ptr<TcpChannel> create(UniqueFd fd, uint32_t index, uint32_t chunk_size,
                                            uint32_t depth, TransportMetrics& metrics,
                                            SpliceMode splice = SpliceMode::kOff,
                                            std::unique_ptr<TlsStream> tls = nullptr);
  ~TcpChannel() override;

  Result<std::span<std::byte>> acquire() override;
  Status send(size_t n) override;
  void unacquire() override;
  Status send_eof() override;
  Status drain() override;
  Result<ChunkView> receive() override;
  Status release() override;
  bool splices() const override;
  Result<LocalMove> send_from(int fd) override;
  Result<ChunkView> receive_deferred() override;
  Result<LocalMove> deliver_to(int fd) override;
  bool set_inline_sink(int fd, Delivered delivered) override;
  void clear_inline_sink() override;
  void abort(const Error& reason) override;
  bool link_failed() const override { return link_failed_.load(); }
  std::optional<Error> link_failure() const override;
  void notice_silent_link_within(std::chrono::milliseconds within) override;
  uint32_t index() const override { return index_; }
  size_t chunk_size() const override { return chunk_size_; }
  const char* transport() const override { return "tcp"; }
  // Payload bytes that went through a pipe (splice) rather than through user space.
  uint64_t spliced_sent() const { return spliced_sent_.load(std::memory_order_relaxed); }
  uint64_t spliced_received() const { return spliced_received_.load(std::memory_order_relaxed); }
  // How long the reader holds back (kReaderQueueLimit chunks queued) for a receiver that takes
  // nothing before it reads on as far as the credits go (tests make it long to see the limit).
  void set_reader_hold_back(std::chrono::milliseconds t) { hold_back_ms_.store(t.count(), std::memory_order_relaxed); }
  // How long the reader waits for room in the inline sink before it hands a chunk's rest to the
  // receiving thread (kInlineWaitMs; tests set 0 to hand off at the first full socket, as before).
  void set_inline_wait(std::chrono::milliseconds t) { inline_wait_ms_.store(t.count(), std::memory_order_relaxed); }
  // "off", or the TLS stream's mode ("kernel", "kernel send", "user space").
  const char* tls_mode() const { return tls_ ? tls_->mode() : "off"; }
  // Chunks the reader wrote whole to the inline sink (set_inline_sink), and of them the ones it
  // spliced (splice mode).
  uint64_t inline_chunks() const { return inline_chunks_.load(std::memory_order_relaxed); }
  uint64_t inline_spliced() const { return inline_spliced_.load(std::memory_order_relaxed); }

 private:
  struct Slot;
  TcpChannel(UniqueFd fd, uint32_t index, uint32_t chunk_size, uint32_t depth,
             TransportMetrics& metrics, SpliceMode splice, std::unique_ptr<TlsStream> tls);
  // A pipe for one direction of splicing, made on first use. False (auto: logged once, and
  // the channel copies from then on) when no pipe can be had.
  struct Pipe {
    UniqueFd r, w;
    size_t capacity = 0;
  };
  Result<bool> ensure_pipe(Pipe& p);
  // Turns splicing off for this channel (auto only): `why` is logged once.
  void splice_unavailable(const std::string& why);
  Result<ChunkView> next_chunk(bool deferred);
  // Deferred payloads: whoever claims one (receiver or reader, under rx_mu_) reads it off the
  // socket; payload_taken_locked() hands the socket back to the reader.
  bool claim_payload_locked(const Slot& s);
  void payload_taken_locked(Slot& s);
  Status read_payload(Slot& s);  // into the slot's memory; fails the channel on error
  // Reader thread: fills `dst` from the socket, bytes read ahead first. With `ahead`, each recv
  // also takes up to kReadAhead bytes past `dst` (the next frame's header, credits queued behind
  // a payload), so a stream of frames costs one recv per payload rather than two, and credit
  // frames that arrive together are read together. False at a clean end of stream (`eof_ok`
  // and nothing read).
  Result<bool> fill(std::span<std::byte> dst, bool eof_ok, bool ahead);
  Status count_sent(size_t n, std::chrono::steady_clock::time_point t0);
  void reader_loop();
  Status write_frame(FrameHeader h, const void* payload);
  Status write_frame_locked(FrameHeader h, const void* payload);  // write_mu_ held
  void fail(const Error& e);
  // A write failed: the peer may have closed after telling why (an abort frame the reader has yet
  // to read). Waits briefly for the reader to record that reason, then fails with e if it did not.
  void fail_after_write_error(const Error& e);
  Error abort_error();  // the reason the channel failed
  // Maps the send buffer if not yet done; false (and the channel failed, naming the size) when
  // memory runs out.
  bool ensure_staging();
  // Gives a slot taken for a received DATA chunk a place in rx_mem_ (mapped on first use) and
  // points s.data at it. False when the memory cannot be mapped (or, never by the reader's queue
  // limit, no place is free). Under rx_mu_.
  bool place_locked(Slot& s);
  void unplace_locked(Slot& s);  // gives its place back; under rx_mu_
  size_t rx_bytes() const { return size_t{depth_} * slot_stride_; }
  void out_of_memory(const std::string& what);  // fails the channel, naming what was refused

  UniqueFd fd_;
  // TLS on this socket, if any; via_tls_: every byte goes through it (the kernel does not do both
  // directions), so no splice and no read ahead on the socket.
  std::unique_ptr<TlsStream> tls_;
  const bool via_tls_;
  const uint32_t index_;
  const uint32_t chunk_size_;
  const uint32_t depth_;
  TransportMetrics& metrics_;
  const SpliceMode splice_mode_;
  std::atomic<bool> splice_ok_;  // mode != off and no socket refused splice (auto)
  Pipe up_pipe_;    // sender thread only
  bool spliced_once_ = false;  // sender thread only
  // Whether a splice from QEMU's socket can be told not to wait: a unix stream socket honours
  // SPLICE_F_NONBLOCK, a TCP socket only its own O_NONBLOCK. Probed once per socket (sender thread).
  bool takes_more_without_waiting(int fd);
  int probed_fd_ = -1;     // sender thread only
  bool take_more_ = false;  // sender thread only
  std::atomic<uint64_t> spliced_sent_{0};
  std::atomic<uint64_t> spliced_received_{0};
  // The receiver thread's, and the reader's while it splices a chunk inline (nothing queued then,
  // so never both at once; a leftover it leaves is queued before the receiver touches the pipe).
  Pipe down_pipe_;

  // Send side (sender thread only, plus the write lock shared with credit returns).
  // Buffers are mapped, not zero-filled: a 4 MiB chunk buffer that QEMU fills with 200 KiB must
  // not cost 4 MiB of page faults and memset (that made multifd 4x slower). See ChunkMemory.
  ChunkMemory staging_;
  CreditGate credits_;
  // Guards the send side of fd_ and tls_ (no member beyond them): one frame at a time, header
  // and payload together. Taken by the sender thread (write_frame, the spliced send), by
  // release()/next_chunk() sending credits (the receiving thread), and only with try_lock by
  // the reader thread (inline credits; else owed_credits_) and by abort() (the reason frame):
  // neither ever waits for it. Held across blocking socket writes. Never taken under rx_mu_;
  // TlsStream's own lock nests inside it.
  std::mutex write_mu_;

  // Receive side: slots filled by the reader thread, consumed by receive()/release().
  struct Slot {
    std::byte* data = nullptr;  // `size` bytes in rx_mem_ (none for an eof marker)
    size_t size = 0;
    size_t offset = 0;   // bytes of it the reader wrote to the inline sink already
    size_t pending = 0;  // deferred: payload bytes still on the socket
    // Left by the reader's inline splice (QEMU's socket took only part): `piped` bytes in
    // down_pipe_, then `rest` bytes at data (what did not fit the pipe), `offset` of them written.
    size_t piped = 0;
    size_t rest = 0;
    bool eof = false;
    int place = -1;  // its place in rx_mem_ (a DATA chunk), -1 for none
  };
  std::vector<Slot> ring_;  // depth + 1: the eof marker may follow a full ring
  // The received chunks' bytes: one mapping (ChunkMemory, huge pages, mapped at the first chunk)
  // of a place per chunk the credits allow (depth), a chunk_size (kSlotAlign-rounded) each,
  // reserved, not touched. A slot takes a place when its chunk arrives and gives it back when
  // released, last-freed first; the reader queues kReaderQueueLimit chunks (more only behind a
  // receiver that stalled), so two places are in use: a receiver that keeps up has every chunk
  // written to the same bytes, and a chunk touches as much of its place as it fills (QEMU sends
  // what its socket holds, about 220 KiB on the bare path, whatever chunk_size is). Before, the
  // reader queued as far as the credits went, in a ring of depth + 2 chunks packed in arrival
  // order that was walked from end to end behind a receiver whose queue never emptied (a proxy's
  // TCP socket on the KubeVirt path): a fresh huge page cleared every 2 MiB.
  static constexpr size_t kSlotAlign = 64;
  const size_t slot_stride_;
  ChunkMemory rx_mem_;
  std::vector<uint32_t> free_places_;  // under rx_mu_
  // Which slot holds each received chunk: queued_[i % ring_.size()] for rx_head_ <= i < rx_tail_;
  // free_ the slots (their bookkeeping, not their bytes) not queued. Both under rx_mu_; the
  // reader holds at most one slot of neither (the one it is filling).
  std::vector<uint32_t> queued_;
  std::vector<uint32_t> free_;
  // Guards the receive bookkeeping: free_places_, queued_, free_, the slots of ring_ once
  // queued (the reader fills one unlocked), rx_mem_'s mapping (place_locked), reader_unheld_,
  // rx_data_, rx_granted_, rx_head_, rx_tail_, rx_holding_, peer_eof_, deferred_,
  // defer_limit_, payload_on_socket_, pulling_, batcher_, sink_fd_, sink_ and owed_credits_;
  // rx_cv_ signals any change. Taken by the reader thread and the receiving thread
  // (receive/next_chunk/release/the inline sink setters), and briefly by fail() to wake
  // waiters. Released before any write_mu_ wait (credits are sent after unlocking); the
  // reader writes to the inline sink (MSG_DONTWAIT) under it, and waits for room in it without it.
  std::mutex rx_mu_;
  std::condition_variable rx_cv_;
  // The reader reads a chunk's payload off the socket only while fewer than this many are queued
  // for the receiver: further chunks wait in the kernel's socket buffer (TCP's window pushes back
  // on the peer), not in rdmig's memory, where each place first touched costs a page fault (a
  // fresh huge page: ~1 ms on a paravirtualised machine) and the reader runs ahead of a receiver
  // it cannot make faster. Two: the receiver finds the next chunk ready when it is done with one.
  static constexpr uint64_t kReaderQueueLimit = 2;
  // How long the reader waits for a receiver that takes nothing before reading on regardless.
  static constexpr int64_t kReaderHoldBackMs = 500;
  std::atomic<int64_t> hold_back_ms_{kReaderHoldBackMs};
  // How long the reader waits for room in QEMU's socket while it splices a chunk through itself,
  // before it hands the rest to the receiving thread. A target QEMU reads its stream 32 KiB at a
  // time (QEMUFile's buffer) and is often slower than the link: handing every such chunk to the
  // receiving thread cost two thread switches per chunk, and the next chunks' payloads were
  // copied through memory while the receiver was busy (bench/relay_floor.py --reader-rate). Any
  // frame behind the chunk on the connection (credits for the other direction, an abort) waits up
  // to this long while QEMU's socket is full; before, a frame right behind a chunk that met a
  // full socket was read at once, and one behind a second DATA frame waited up to kDeferWait (200
  // ms). On the source, the sink is QEMU's return path, whose reader rarely lets its socket fill.
  static constexpr int64_t kInlineWaitMs = 50;
  std::atomic<int64_t> inline_wait_ms_{kInlineWaitMs};  // unless a test sets it (set_inline_wait)
  bool reader_unheld_ = false;  // held back that long: reads on until the queue is short (rx_mu_)
  uint64_t rx_data_ = 0;     // DATA frames the peer sent (under rx_mu_)
  uint64_t rx_granted_ = 0;  // credits for them decided (sent or about to be; under rx_mu_)
  uint64_t rx_head_ = 0;  // next slot to hand to receive()
  uint64_t rx_tail_ = 0;  // next slot the reader fills
  bool rx_holding_ = false;
  bool peer_eof_ = false;
  // Deferred receiving (set by the first receive_deferred()): the reader leaves payloads on
  // the socket and waits while one is pending.
  bool deferred_ = false;
  size_t defer_limit_ = 0;           // payloads up to the receive pipe's capacity are deferred
  bool payload_on_socket_ = false;  // a published chunk's payload is still on the socket
  bool pulling_ = false;            // and someone is reading it off
  CreditBatcher batcher_;               // under rx_mu_ (the reader releases inline chunks)
  // Inline sink (under rx_mu_): a chunk that arrives with nothing queued before it is written
  // to it by the reader thread.
  int sink_fd_ = -1;
  Delivered sink_;
  // Credits of inline chunks the reader could not send itself (the sender held the write lock:
  // the reader never waits for it); the receiving thread sends them from next_chunk().
  uint32_t owed_credits_ = 0;
  std::atomic<uint64_t> inline_chunks_{0};
  std::atomic<uint64_t> inline_spliced_{0};  // of them, spliced (splice_inline)
  // Writes the chunk in `slot` to the inline sink if it may; true when all of it went (the slot
  // stays free and `credits` says what to return). Under rx_mu_.
  bool deliver_inline_locked(Slot& slot, uint32_t& credits);
  // Reader thread, a deferred DATA payload of `slot` on the socket, nothing queued and an inline
  // sink set: pulls it into down_pipe_ and pushes it into the sink, emptying the pipe into the
  // sink whenever it fills before the payload is in; waits for room (without rx_mu_) up to
  // kInlineWaitMs in all, after which what is still on the socket goes into the slot and the
  // leftover is queued for deliver_to(). False when the channel failed. A chunk may so reach the
  // sink in part before the rest of it has arrived: a channel that fails then fails its
  // migration, never resends the chunk (FailoverChannel, which resends, sets no inline sink).
  bool splice_inline(Slot& slot, uint32_t slot_index);
  // splice_inline's push, under rx_mu_ (`lock`): the pipe's bytes up to `pulled`, then the slot's
  // first `rest` bytes, into the inline sink without blocking, `pushed` and `wrote` counting what
  // went; while the sink is full, waits for room without the lock until `deadline`. Returns when
  // all of it went, at the deadline, or on a sink error (the receiving thread meets it).
  void push_inline_locked(std::unique_lock<std::mutex>& lock, const Slot& slot, size_t pulled, size_t rest,
                          size_t& pushed, size_t& wrote, std::chrono::steady_clock::time_point deadline);
  // Splices up to `len` bytes of a deferred payload off the socket into down_pipe_, which must be
  // empty: waits for the first byte, then takes what has arrived until `len` or a full pipe (its
  // slots hold page pieces, not bytes: a payload relayed from a TCP socket fills it in pieces
  // smaller than a page). The bytes in the pipe; nullopt when the channel failed.
  std::optional<size_t> pull_into_pipe(size_t len);
  // A deferred payload of `len` bytes off the socket (deliver_to's pull): into down_pipe_ as far
  // as it takes, the rest into `rest_at`; counts it received. The bytes in the pipe; nullopt when
  // the channel failed.
  std::optional<size_t> pull_payload(size_t len, std::byte* rest_at);
  // Reads the `rest` bytes of a deferred payload that the pipe did not take into `rest_at`, and
  // counts the payload (`len` bytes, `piped` of them through the pipe) received. False when the
  // channel failed.
  bool finish_pull(size_t len, size_t piped, std::byte* rest_at);
  // Reader thread: returns the credits of a chunk it delivered itself, never waiting for the
  // write lock (else the receiving thread sends them). False when the channel failed.
  bool return_inline_credits(uint32_t credits);
  bool sink_nonblocking_ = false;  // sink_fd_ was made non-blocking (splice mode); under rx_mu_
  bool inline_pushing_ = false;    // the reader waits for room in sink_fd_ without rx_mu_; under rx_mu_
  std::atomic<int64_t> outstanding_{0};  // chunks sent, credit not yet back (for the gauge)

  std::atomic<bool> aborted_{false};
  // The first failure was the link's (link_failed()): set with abort_reason_, before aborted_.
  std::atomic<bool> link_failed_{false};
  std::atomic<bool> peer_aborted_{false};  // the reader read the peer's abort frame
  std::atomic<bool> local_abort_{false};   // abort() was called
  // Guards abort_reason_ alone (the first reason wins; aborted_ is set after it). Taken by
  // any thread that fails or aborts the channel and by abort_error(); held only for the
  // optional, with no other lock taken under it.
  mutable std::mutex abort_mu_;
  std::optional<Error> abort_reason_;
  // Read ahead (reader thread only): bytes taken from the socket past the frame being read. Off
  // once the receiver splices (a deferred payload must still be on the socket), and a payload
  // is deferred only when nothing of it was read ahead.
  static constexpr size_t kReadAhead = 4096;
  std::array<std::byte, kReadAhead> ahead_{};
  size_t ahead_off_ = 0;
  size_t ahead_len_ = 0;
  std::atomic<bool> no_read_ahead_{false};

  std::thread reader_;  // last: started after everything above exists, joined first
};

}  // namespace rdmig::transport
