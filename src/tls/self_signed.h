// A self-signed certificate made in memory when a program starts, for an HTTPS port that has no
// certificate configured (the controller's /metrics without metrics.tls, as controller-runtime
// does). A client cannot verify it against a CA: it protects the bearer token and the answer
// from passive eavesdropping, and a scraper skips verification (Prometheus' insecureSkipVerify).
#pragma once

#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <memory>
#include <string>
#include <vector>

#include "common/result.h"

namespace rdmig::tls {

struct SelfSigned {
  struct CertFree {
    void operator()(X509* x) const { X509_free(x); }
  };
  struct KeyFree {
    void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
  };
  std::unique_ptr<X509, CertFree> cert;
  std::unique_ptr<EVP_PKEY, KeyFree> key;
  std::string fingerprint;  // SHA-256 of the DER certificate, hex, for the start-up log line

  // TLS 1.2 or newer, no compression or renegotiation, this certificate.
  bool configure(SSL_CTX& ctx) const;
};

// An ECDSA P-256 key and a certificate for `common_name` with the DNS names and IP addresses in
// `names` as subjectAltNames, valid from an hour ago for `days` days.
Result<SelfSigned> make_self_signed(const std::string& common_name, const std::vector<std::string>& names, int days);

}  // namespace rdmig::tls
