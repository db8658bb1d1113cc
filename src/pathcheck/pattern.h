// The synthetic stream of a path check: a deterministic byte pattern, seeded per check and per
// channel, that the sender writes into each chunk and the receiver checks byte for byte. Byte
// `o` of a stream is byte (o % 8) (little-endian) of splitmix64(seed + o / 8): any offset can be
// produced or checked on its own, so neither side keeps state beyond its stream offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace rdmig::pathcheck {

// The seed of channel `index` of a check whose seed is `seed`.
uint64_t channel_seed(uint64_t seed, uint32_t index);

// Writes the stream's bytes [offset, offset + out.size()) into `out`.
void fill_pattern(std::span<std::byte> out, uint64_t seed, uint64_t offset);

struct Mismatch {
  uint64_t offset = 0;  // stream offset of the first byte that differs
  uint8_t expected = 0;
  uint8_t got = 0;
  std::string describe() const;
};

// Checks `data` against the stream's bytes [offset, offset + data.size()): the first byte that
// differs, or nullopt when all match.
std::optional<Mismatch> verify_pattern(std::span<const std::byte> data, uint64_t seed, uint64_t offset);

}  // namespace rdmig::pathcheck
