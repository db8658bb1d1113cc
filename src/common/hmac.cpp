#include "common/hmac.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "common/units.h"

namespace rdmig {

std::string hmac_sha256_hex(const std::string& key, const std::string& message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), out, &len);
  return to_hex(out, len);
}

}  // namespace rdmig
