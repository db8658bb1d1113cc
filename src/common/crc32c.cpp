#include "common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace rdmig {

namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // CRC32C, reflected

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

constexpr auto kTable = make_table();

#if defined(__x86_64__)
// 8 bytes per instruction, one stream (the instruction's latency bounds it near 8 bytes per 3
// cycles): verifyChunks is a safety and diagnostic option, not the default path.
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t n, uint32_t crc) {
  uint64_t c = ~crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

bool have_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t crc32c_portable(std::span<const std::byte> data, uint32_t crc) {
  uint32_t c = ~crc;
  for (std::byte b : data) c = kTable[(c ^ static_cast<uint8_t>(b)) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c(std::span<const std::byte> data, uint32_t crc) {
#if defined(__x86_64__)
  if (have_sse42()) return crc32c_sse42(reinterpret_cast<const unsigned char*>(data.data()), data.size(), crc);
#endif
  return crc32c_portable(data, crc);
}

}  // namespace rdmig
