#include "pathcheck/pattern.h"

#include <cstdio>
#include <cstring>

namespace rdmig::pathcheck {

namespace {
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint8_t pattern_byte(uint64_t seed, uint64_t offset) {
  return static_cast<uint8_t>(splitmix64(seed + offset / 8) >> (8 * (offset % 8)));
}
}  // namespace

uint64_t channel_seed(uint64_t seed, uint32_t index) { return splitmix64(seed ^ (uint64_t{index} << 40)); }

void fill_pattern(std::span<std::byte> out, uint64_t seed, uint64_t offset) {
  size_t i = 0;
  // Leading bytes up to a word boundary of the stream, then whole words, then the tail.
  for (; i < out.size() && (offset + i) % 8 != 0; ++i) out[i] = std::byte{pattern_byte(seed, offset + i)};
  for (; i + 8 <= out.size(); i += 8) {
    const uint64_t w = splitmix64(seed + (offset + i) / 8);
    std::memcpy(out.data() + i, &w, 8);  // little-endian hosts (x86-64, aarch64)
  }
  for (; i < out.size(); ++i) out[i] = std::byte{pattern_byte(seed, offset + i)};
}

std::optional<Mismatch> verify_pattern(std::span<const std::byte> data, uint64_t seed, uint64_t offset) {
  size_t i = 0;
  auto byte_at = [&](size_t k) -> std::optional<Mismatch> {
    const uint8_t want = pattern_byte(seed, offset + k);
    const auto got = static_cast<uint8_t>(data[k]);
    if (want != got) return Mismatch{offset + k, want, got};
    return std::nullopt;
  };
  for (; i < data.size() && (offset + i) % 8 != 0; ++i) {
    if (auto m = byte_at(i)) return m;
  }
  for (; i + 8 <= data.size(); i += 8) {
    const uint64_t w = splitmix64(seed + (offset + i) / 8);
    uint64_t got;
    std::memcpy(&got, data.data() + i, 8);
    if (got != w) {
      for (size_t k = i; k < i + 8; ++k) {
        if (auto m = byte_at(k)) return m;
      }
    }
  }
  for (; i < data.size(); ++i) {
    if (auto m = byte_at(i)) return m;
  }
  return std::nullopt;
}

std::string Mismatch::describe() const {
  char buf[128];
  std::snprintf(buf, sizeof buf, "byte at stream offset %llu is 0x%02x, expected 0x%02x",
                static_cast<unsigned long long>(offset), got, expected);
  return buf;
}

}  // namespace rdmig::pathcheck
