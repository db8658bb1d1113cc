// HMAC-SHA256 for proving a shared secret without sending it (challenge-response).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace rdmig {

// HMAC-SHA256 of `message` under `key`.
std::array<uint8_t, 32> hmac_sha256(std::string_view key, std::string_view message);
// The same as lowercase hex.
std::string hmac_sha256_hex(const std::string& key, const std::string& message);

}  // namespace rdmig
