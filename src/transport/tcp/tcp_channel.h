// A channel over one TCP connection: frames (see framing.h) in both directions, vectored
// writes (header + payload in one sendmsg), a reader thread that receives straight into the
// receive ring's slots and handles credits coming back.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "metrics/metrics.h"
#include "transport/channel.h"
#include "transport/framing.h"

namespace rdmig::transport {

class TcpChannel final : public Channel {
 public:
  // Takes a connected socket whose handshake is done. `metrics` outlives the channel.
  static std::unique_ptr<TcpChannel> create(UniqueFd fd, uint32_t index, uint32_t chunk_size,
                                            uint32_t depth, TransportMetrics& metrics);
  ~TcpChannel() override;

  Result<std::span<std::byte>> acquire() override;
  Status send(size_t n) override;
  void unacquire() override;
  Status send_eof() override;
  Status drain() override;
  Result<ChunkView> receive() override;
  Status release() override;
  void abort(const Error& reason) override;
  uint32_t index() const override { return index_; }
  size_t chunk_size() const override { return chunk_size_; }
  const char* transport() const override { return "tcp"; }

 private:
  TcpChannel(UniqueFd fd, uint32_t index, uint32_t chunk_size, uint32_t depth,
             TransportMetrics& metrics);
  void reader_loop();
  Status write_frame(FrameHeader h, const void* payload);
  void fail(const Error& e);

  UniqueFd fd_;
  const uint32_t index_;
  const uint32_t chunk_size_;
  const uint32_t depth_;
  TransportMetrics& metrics_;

  // Send side (sender thread only, plus the write lock shared with credit returns).
  // Buffers are allocated without zero-filling: a 4 MiB chunk buffer that QEMU fills with
  // 200 KiB must not cost 4 MiB of page faults and memset (that made multifd 4x slower).
  std::unique_ptr<std::byte[]> staging_;
  CreditGate credits_;
  std::mutex write_mu_;

  // Receive side: slots filled by the reader thread, consumed by receive()/release().
  struct Slot {
    std::unique_ptr<std::byte[]> data;  // chunk_size bytes, allocated on first use
    size_t size = 0;
    bool eof = false;
  };
  std::vector<Slot> ring_;  // depth + 1: the eof marker may follow a full ring
  std::mutex rx_mu_;
  std::condition_variable rx_cv_;
  uint64_t rx_head_ = 0;  // next slot to hand to receive()
  uint64_t rx_tail_ = 0;  // next slot the reader fills
  bool rx_holding_ = false;
  bool peer_eof_ = false;
  CreditBatcher batcher_;               // receiver thread only
  std::atomic<int64_t> outstanding_{0};  // chunks sent, credit not yet back (for the gauge)

  std::atomic<bool> aborted_{false};
  std::mutex abort_mu_;
  std::optional<Error> abort_reason_;
  std::thread reader_;  // last: started after everything above exists, joined first
};

}  // namespace rdmig::transport
