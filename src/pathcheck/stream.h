// The two ends of one channel of a path check's synthetic stream, on any transport::Channel:
// the sender fills each acquired chunk with the pattern and sends it (credits and chunking as
// a migration's pump), the receiver checks every byte before it releases the slot.
#pragma once

#include <atomic>
#include <cstdint>

#include "common/result.h"
#include "transport/channel.h"

namespace rdmig::pathcheck {

// Sends `bytes` pattern bytes of `seed` in chunks of up to the channel's chunk size, then eof,
// then waits until the receiver has released every chunk. `sent` counts payload bytes as they go,
// `chunks` the chunks.
Status send_stream(transport::Channel& channel, uint64_t seed, uint64_t bytes, std::atomic<uint64_t>& sent,
                   std::atomic<uint64_t>& chunks);

// Receives until eof, checking each byte against the pattern of `seed`; fails (kProtocol, naming
// the channel and the first wrong byte's offset) on the first byte that differs, and when the
// stream ends after more or fewer than `bytes` bytes. `verified` counts checked bytes, `chunks`
// the chunks they came in.
Status receive_stream(transport::Channel& channel, uint64_t seed, uint64_t bytes, std::atomic<uint64_t>& verified,
                      std::atomic<uint64_t>& chunks);

}  // namespace rdmig::pathcheck
