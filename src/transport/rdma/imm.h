// The 32-bit immediate of every RDMA WRITE WITH IMMEDIATE rdmig posts. Top two bits: kind.
//   00 data:   low 30 bits = length - 1 (1 byte .. 1 GiB); the payload is in the next slot
//   01 credit: low 30 bits = slots freed
//   10 eof:    the sender will send no more data
//   11 abort:  the sender gave up (the reason travels on the control connection)
// The immediate goes over the wire in network byte order (htonl/ntohl at post/poll).
#pragma once

#include <cstdint>
#include <optional>

namespace rdmig::transport::rdma {

enum class ImmKind : uint32_t { kData = 0, kCredit = 1, kEof = 2, kAbort = 3 };

struct Imm {
  ImmKind kind = ImmKind::kData;
  uint32_t value = 0;  // data: length in bytes; credit: count
};

constexpr uint32_t kImmValueMask = (1u << 30) - 1;

constexpr std::optional<uint32_t> encode_imm(Imm imm) {
  switch (imm.kind) {
    case ImmKind::kData:
      if (imm.value == 0 || imm.value > (1u << 30)) return std::nullopt;
      return imm.value - 1;
    case ImmKind::kCredit:
      if (imm.value == 0 || imm.value > kImmValueMask) return std::nullopt;
      return (1u << 30) | imm.value;
    case ImmKind::kEof:
      return 2u << 30;
    case ImmKind::kAbort:
      return 3u << 30;
  }
  return std::nullopt;
}

constexpr Imm decode_imm(uint32_t raw) {
  const auto kind = static_cast<ImmKind>(raw >> 30);
  const uint32_t low = raw & kImmValueMask;
  if (kind == ImmKind::kData) return Imm{kind, low + 1};
  return Imm{kind, low};
}

}  // namespace rdmig::transport::rdma
