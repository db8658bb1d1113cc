// HMAC-SHA256 for proving a shared secret without sending it (challenge-response).
#pragma once

#include <string>

namespace rdmig {

// Hex HMAC-SHA256 of `message` under `key`.
std::string hmac_sha256_hex(const std::string& key, const std::string& message);

}  // namespace rdmig
