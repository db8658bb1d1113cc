#include "tls/self_signed.h"

#include <arpa/inet.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/x509v3.h>

#include <cstdio>

namespace rdmig::tls {

namespace {

Error openssl_error(const std::string& what) {
  const unsigned long e = ERR_get_error();
  char text[256] = {};
  if (e != 0) ERR_error_string_n(e, text, sizeof text);
  ERR_clear_error();
  return Error{Errc::kInternal, "self-signed certificate: " + what + (e ? std::string(": ") + text : std::string())};
}

bool is_ip(const std::string& name) {
  unsigned char buf[16];
  return inet_pton(AF_INET, name.c_str(), buf) == 1 || inet_pton(AF_INET6, name.c_str(), buf) == 1;
}

}  // namespace

bool SelfSigned::configure(SSL_CTX& ctx) const {
  SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(&ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
  if (SSL_CTX_use_certificate(&ctx, cert.get()) != 1 || SSL_CTX_use_PrivateKey(&ctx, key.get()) != 1) {
    ERR_clear_error();
    return false;
  }
  return true;
}

Result<SelfSigned> make_self_signed(const std::string& common_name, const std::vector<std::string>& names, int days) {
  SelfSigned out;
  out.key.reset(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"));  // EVP_EC_gen without its C cast
  if (!out.key) return openssl_error("EC key");
  out.cert.reset(X509_new());
  X509* x = out.cert.get();
  if (!x || X509_set_version(x, 2) != 1) return openssl_error("X509_new");
  {
    std::unique_ptr<BIGNUM, decltype(&BN_free)> serial(BN_new(), BN_free);
    if (!serial || BN_rand(serial.get(), 64, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) != 1 ||
        !BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(x))) {
      return openssl_error("serial number");
    }
  }
  if (!X509_gmtime_adj(X509_getm_notBefore(x), -3600) ||
      !X509_gmtime_adj(X509_getm_notAfter(x), static_cast<long>(days) * 86400L)) {
    return openssl_error("validity");
  }
  X509_NAME* subject = X509_get_subject_name(x);
  if (X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(common_name.c_str()),
                                 -1, -1, 0) != 1 ||
      X509_set_issuer_name(x, subject) != 1 || X509_set_pubkey(x, out.key.get()) != 1) {
    return openssl_error("subject");
  }
  std::string san;
  for (const auto& n : names) san += (san.empty() ? "" : ",") + std::string(is_ip(n) ? "IP:" : "DNS:") + n;
  X509V3_CTX v3;
  X509V3_set_ctx_nodb(&v3);
  X509V3_set_ctx(&v3, x, x, nullptr, nullptr, 0);
  const std::pair<int, std::string> extensions[] = {{NID_basic_constraints, "critical,CA:FALSE"},
                                                    {NID_key_usage, "critical,digitalSignature"},
                                                    {NID_ext_key_usage, "serverAuth"},
                                                    {NID_subject_alt_name, san}};
  for (const auto& [nid, value] : extensions) {
    if (value.empty()) continue;
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &v3, nid, value.c_str());
    if (!ext) return openssl_error("extension " + value);
    const int added = X509_add_ext(x, ext, -1);
    X509_EXTENSION_free(ext);
    if (added != 1) return openssl_error("extension " + value);
  }
  if (X509_sign(x, out.key.get(), EVP_sha256()) == 0) return openssl_error("signing");
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (X509_digest(x, EVP_sha256(), md, &len) != 1) return openssl_error("digest");
  char byte[3];
  for (unsigned int i = 0; i < len; ++i) {
    std::snprintf(byte, sizeof byte, "%02x", md[i]);
    out.fingerprint += byte;
  }
  return out;
}

}  // namespace rdmig::tls
