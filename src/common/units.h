// Byte quantities ("4Mi", "64Ki", "1Gi", "1048576") as used in config, REST and the CRD.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/result.h"

namespace rdmig {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;

// Chunk sizes allowed on the wire and in every API: a power of two in [64 KiB, 1 GiB].
inline constexpr uint64_t kMinChunkSize = 64 * kKiB;
inline constexpr uint64_t kMaxChunkSize = kGiB;

constexpr bool is_power_of_two(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Parses a Kubernetes-style binary quantity or a plain byte count. `field` names the
// input in the error.
Result<uint64_t> parse_bytes(std::string_view text, std::string_view field);

// Checks the chunk-size rule and names `field` in the error.
Status validate_chunk_size(uint64_t bytes, std::string_view field);

// "4Mi" for exact binary multiples, else the plain number.
std::string format_quantity(uint64_t bytes);
// Human form for logs and the demo: "1.50 GiB".
std::string format_bytes_human(double bytes);

// Lower-case hex of `n` bytes.
std::string to_hex(const unsigned char* data, size_t n);
// 32 hex characters from the kernel's CSPRNG (getrandom).
std::string random_hex(size_t bytes = 16);
// Compares without early exit (tokens).
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace rdmig
