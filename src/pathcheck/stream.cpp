#include "pathcheck/stream.h"

#include <algorithm>
#include <string>

#include "pathcheck/pattern.h"

namespace rdmig::pathcheck {

Status send_stream(transport::Channel& channel, uint64_t seed, uint64_t bytes, std::atomic<uint64_t>& sent,
                   std::atomic<uint64_t>& chunks) {
  uint64_t offset = 0;
  while (offset < bytes) {
    auto buf = channel.acquire();
    if (!buf) return buf.error();
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf->size(), bytes - offset));
    fill_pattern(buf->first(n), seed, offset);
    RDMIG_TRY(channel.send(n));
    offset += n;
    sent.fetch_add(n, std::memory_order_relaxed);
    chunks.fetch_add(1, std::memory_order_relaxed);
  }
  RDMIG_TRY(channel.send_eof());
  return channel.drain();
}

Status receive_stream(transport::Channel& channel, uint64_t seed, uint64_t bytes, std::atomic<uint64_t>& verified,
                      std::atomic<uint64_t>& chunks) {
  const std::string where = "channel " + std::to_string(channel.index());
  uint64_t offset = 0;
  for (;;) {
    auto chunk = channel.receive();
    if (!chunk) return chunk.error();
    if (chunk->eof) {
      // Releasing the eof returns the credits still batched (the sender's drain waits for them).
      RDMIG_TRY(channel.release());
      break;
    }
    if (offset + chunk->data.size() > bytes) {
      return Error{Errc::kProtocol, where + ": more than the " + std::to_string(bytes) + " bytes announced arrived"};
    }
    if (auto bad = verify_pattern(chunk->data, seed, offset)) {
      return Error{Errc::kProtocol, where + ": data corrupted in transit: " + bad->describe()};
    }
    offset += chunk->data.size();
    verified.fetch_add(chunk->data.size(), std::memory_order_relaxed);
    chunks.fetch_add(1, std::memory_order_relaxed);
    RDMIG_TRY(channel.release());
  }
  if (offset != bytes) {
    return Error{Errc::kProtocol, where + ": stream ended after " + std::to_string(offset) + " of " +
                                      std::to_string(bytes) + " bytes"};
  }
  return ok_status();
}

}  // namespace rdmig::pathcheck
