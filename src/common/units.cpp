#include "common/units.h"

#include <sys/random.h>

#include <cstdio>
#include <vector>

namespace rdmig {

Result<uint64_t> parse_bytes(std::string_view text, std::string_view field) {
  const std::string f(field);
  if (text.empty()) return Error{Errc::kInvalidArgument, f + ": empty size"};
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (UINT64_MAX - digit) / 10) {
      return Error{Errc::kInvalidArgument, f + ": size too large: '" + std::string(text) + "'"};
    }
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) {
    return Error{Errc::kInvalidArgument,
                 f + ": expected a byte count or a quantity like 4Mi, got '" + std::string(text) + "'"};
  }
  const std::string_view suffix = text.substr(i);
  uint64_t mult = 1;
  if (suffix.empty()) mult = 1;
  else if (suffix == "Ki") mult = kKiB;
  else if (suffix == "Mi") mult = kMiB;
  else if (suffix == "Gi") mult = kGiB;
  else if (suffix == "Ti") mult = 1024 * kGiB;
  else if (suffix == "k") mult = 1000;
  else if (suffix == "M") mult = 1000 * 1000;
  else if (suffix == "G") mult = 1000ull * 1000 * 1000;
  else {
    return Error{Errc::kInvalidArgument, f + ": unknown unit '" + std::string(suffix) +
                                             "' (use Ki, Mi, Gi, Ti, k, M, G or plain bytes)"};
  }
  if (value > UINT64_MAX / mult) {
    return Error{Errc::kInvalidArgument, f + ": size too large: '" + std::string(text) + "'"};
  }
  return value * mult;
}

Status validate_chunk_size(uint64_t bytes, std::string_view field) {
  const std::string f(field);
  if (!is_power_of_two(bytes)) {
    return Error{Errc::kInvalidArgument,
                 f + ": must be a power of two, got " + std::to_string(bytes)};
  }
  if (bytes < kMinChunkSize || bytes > kMaxChunkSize) {
    return Error{Errc::kInvalidArgument, f + ": must be between 64Ki and 1Gi, got " +
                                             format_quantity(bytes)};
  }
  return ok_status();
}

std::string format_quantity(uint64_t bytes) {
  if (bytes != 0 && bytes % kGiB == 0) return std::to_string(bytes / kGiB) + "Gi";
  if (bytes != 0 && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + "Mi";
  if (bytes != 0 && bytes % kKiB == 0) return std::to_string(bytes / kKiB) + "Ki";
  return std::to_string(bytes);
}

std::string format_bytes_human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", bytes, units[u]);
  return buf;
}

std::string random_hex(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return to_hex(raw.data(), raw.size());
}

std::string to_hex(const unsigned char* data, size_t n) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(hex[data[i] >> 4]);
    out.push_back(hex[data[i] & 15]);
  }
  return out;
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = a.size() < b.size() ? a.size() : b.size();
  for (size_t i = 0; i < n; ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace rdmig
