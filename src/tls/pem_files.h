// The PEM files behind HTTPS, checked when a program starts (and by --check-config), so that a
// wrong path, a file that holds no certificate or a key that belongs to another certificate
// stops the program with a message naming the config key instead of failing every handshake.
#pragma once

#include <string>

#include "common/result.h"

namespace rdmig::tls {

// What was checked, for the start-up log line.
struct CertInfo {
  std::string subject;    // e.g. "CN=rdmig-agent"
  std::string names;      // the DNS and IP subjectAltNames, comma-separated ("" when none)
  std::string not_after;  // e.g. "Dec  1 02:00:00 2027 GMT"
  bool expired = false;
};

// `cert_file` (a PEM chain, leaf first) and `key_file` (its PEM private key) are readable, and
// the key is the leaf's. Errors name `cert_key` or `key_key` (e.g. "api.tls.certFile").
Result<CertInfo> check_cert_and_key(const std::string& cert_file, const std::string& cert_key,
                                    const std::string& key_file, const std::string& key_key);

// `ca_file` is readable and holds at least one PEM certificate; returns how many. Errors name `key`.
Result<int> check_ca_bundle(const std::string& ca_file, const std::string& key);

// The reason OpenSSL gives for a certificate verification result (X509_V_ERR_*).
std::string verify_error_text(long verify_result);

// The verification result that means "the certificate does not carry the expected name".
bool is_hostname_mismatch(long verify_result);

}  // namespace rdmig::tls
