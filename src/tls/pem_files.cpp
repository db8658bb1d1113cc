#include "tls/pem_files.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>

#include "common/text.h"

namespace rdmig::tls {

namespace {

using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;
using KeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using BioPtr = std::unique_ptr<BIO, decltype(&BIO_free)>;
using NamesPtr = std::unique_ptr<GENERAL_NAMES, decltype(&GENERAL_NAMES_free)>;

Error bad(const std::string& key, const std::string& what) {
  return Error{Errc::kInvalidArgument, "config key '" + key + "': " + what};
}

// The oldest error OpenSSL queued on this thread, then the queue emptied ("" when none).
std::string openssl_error() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  return std::string(" (") + buf + ")";
}

BioPtr memory_bio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())), BIO_free);
}

std::string bio_text(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string();
}

CertInfo describe(X509* cert) {
  CertInfo info;
  BioPtr subject(BIO_new(BIO_s_mem()), BIO_free);
  X509_NAME_print_ex(subject.get(), X509_get_subject_name(cert), 0, XN_FLAG_RFC2253);
  info.subject = bio_text(subject.get());
  BioPtr when(BIO_new(BIO_s_mem()), BIO_free);
  ASN1_TIME_print(when.get(), X509_get0_notAfter(cert));
  info.not_after = bio_text(when.get());
  info.expired = X509_cmp_current_time(X509_get0_notAfter(cert)) < 0;
  NamesPtr names(static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)),
                 GENERAL_NAMES_free);
  for (int i = 0; names && i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* n = sk_GENERAL_NAME_value(names.get(), i);
    std::string one;
    if (n->type == GEN_DNS) {
      one = std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(n->d.dNSName)),
                        static_cast<size_t>(ASN1_STRING_length(n->d.dNSName)));
    } else if (n->type == GEN_IPADD) {
      BioPtr ip(BIO_new(BIO_s_mem()), BIO_free);
      GENERAL_NAME_print(ip.get(), const_cast<GENERAL_NAME*>(n));
      one = bio_text(ip.get());
    }
    if (!one.empty()) info.names += (info.names.empty() ? "" : ", ") + one;
  }
  return info;
}

}  // namespace

Result<CertInfo> check_cert_and_key(const std::string& cert_file, const std::string& cert_key,
                                    const std::string& key_file, const std::string& key_key) {
  if (cert_file.empty()) return bad(cert_key, "must not be empty");
  if (key_file.empty()) return bad(key_key, "must not be empty");
  auto cert_text = read_text_file(cert_file, "config key '" + cert_key + "'");
  if (!cert_text) return Error{Errc::kInvalidArgument, cert_text.error().message};
  auto key_text = read_text_file(key_file, "config key '" + key_key + "'");
  if (!key_text) return Error{Errc::kInvalidArgument, key_text.error().message};
  ERR_clear_error();
  auto cb = memory_bio(cert_text.value());
  X509Ptr cert(PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr), X509_free);
  if (!cert) return bad(cert_key, "'" + cert_file + "' holds no PEM certificate" + openssl_error());
  auto kb = memory_bio(key_text.value());
  KeyPtr key(PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr), EVP_PKEY_free);
  if (!key) return bad(key_key, "'" + key_file + "' holds no PEM private key (or it is encrypted)" + openssl_error());
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return bad(key_key, "the key in '" + key_file + "' does not belong to the certificate in '" + cert_file +
                            "' (" + cert_key + ")");
  }
  return describe(cert.get());
}

Result<int> check_ca_bundle(const std::string& ca_file, const std::string& key) {
  if (ca_file.empty()) return bad(key, "must not be empty");
  auto text = read_text_file(ca_file, "config key '" + key + "'");
  if (!text) return Error{Errc::kInvalidArgument, text.error().message};
  auto bio = memory_bio(text.value());
  int n = 0;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    X509_free(cert);
    ++n;
  }
  ERR_clear_error();  // the end of the bundle reads as "no start line"
  if (n == 0) return bad(key, "'" + ca_file + "' holds no PEM certificate");
  return n;
}

std::string verify_error_text(long verify_result) {
  return X509_verify_cert_error_string(verify_result);
}

bool is_hostname_mismatch(long verify_result) { return verify_result == X509_V_ERR_HOSTNAME_MISMATCH; }

}  // namespace rdmig::tls
