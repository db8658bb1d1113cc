#include "common/hmac.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "common/units.h"

namespace rdmig {

std::array<uint8_t, 32> hmac_sha256(std::string_view key, std::string_view message) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), out.data(), &len);
  return out;
}

std::string hmac_sha256_hex(const std::string& key, const std::string& message) {
  const auto mac = hmac_sha256(key, message);
  return to_hex(mac.data(), mac.size());
}

}  // namespace rdmig
