#include "tls/server_certificate.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "common/log.h"
#include "common/text.h"

namespace rdmig::tls {

struct ServerCertificate::Pair {
  X509* cert = nullptr;
  STACK_OF(X509)* chain = nullptr;  // the intermediates after the leaf in the file
  EVP_PKEY* key = nullptr;
  CertInfo info;
  Pair() = default;
  Pair(const Pair&) = delete;
  Pair& operator=(const Pair&) = delete;
  ~Pair() {
    if (chain) sk_X509_pop_free(chain, X509_free);
    if (cert) X509_free(cert);
    if (key) EVP_PKEY_free(key);
  }
};

bool ServerCertificate::FileId::operator==(const FileId& o) const {
  return dev == o.dev && ino == o.ino && size == o.size && mtime.tv_sec == o.mtime.tv_sec &&
         mtime.tv_nsec == o.mtime.tv_nsec;
}

ServerCertificate::FileId ServerCertificate::file_id(const std::string& path) {
  struct stat st {};
  FileId id;
  if (::stat(path.c_str(), &st) == 0) {  // follows the Secret volume's symlinks
    id.dev = st.st_dev;
    id.ino = st.st_ino;
    id.size = st.st_size;
    id.mtime = st.st_mtim;
  }
  return id;
}

Result<std::shared_ptr<ServerCertificate::Pair>> ServerCertificate::read_pair(const std::string& cert_file,
                                                                             const std::string& cert_key,
                                                                             const std::string& key_file,
                                                                             const std::string& key_key) {
  auto info = check_cert_and_key(cert_file, cert_key, key_file, key_key);  // names the key on error
  if (!info) return info.error();
  auto cert_text = read_text_file(cert_file, cert_key);
  auto key_text = read_text_file(key_file, key_key);
  if (!cert_text || !key_text) return Error{Errc::kInvalidArgument, "config key '" + cert_key + "': files changed while read"};
  auto pair = std::make_shared<Pair>();
  pair->info = info.value();
  std::unique_ptr<BIO, decltype(&BIO_free)> cb(
      BIO_new_mem_buf(cert_text->data(), static_cast<int>(cert_text->size())), BIO_free);
  pair->cert = PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr);
  pair->chain = sk_X509_new_null();
  while (X509* extra = PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr)) sk_X509_push(pair->chain, extra);
  std::unique_ptr<BIO, decltype(&BIO_free)> kb(BIO_new_mem_buf(key_text->data(), static_cast<int>(key_text->size())),
                                               BIO_free);
  pair->key = PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr);
  ERR_clear_error();
  if (!pair->cert || !pair->key || X509_check_private_key(pair->cert, pair->key) != 1) {
    ERR_clear_error();
    return Error{Errc::kInvalidArgument, "config key '" + key_key + "': the key in '" + key_file +
                                             "' does not belong to the certificate in '" + cert_file + "'"};
  }
  return pair;
}

Result<std::shared_ptr<ServerCertificate>> ServerCertificate::load(const std::string& cert_file,
                                                                   const std::string& cert_key,
                                                                   const std::string& key_file,
                                                                   const std::string& key_key) {
  std::shared_ptr<ServerCertificate> sc(new ServerCertificate());
  sc->cert_file_ = cert_file;
  sc->cert_key_ = cert_key;
  sc->key_file_ = key_file;
  sc->key_key_ = key_key;
  sc->cert_id_ = file_id(cert_file);
  sc->key_id_ = file_id(key_file);
  auto pair = read_pair(cert_file, cert_key, key_file, key_key);
  if (!pair) return pair.error();
  sc->pair_ = std::move(pair.value());
  sc->next_check_ = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  return sc;
}

ServerCertificate::~ServerCertificate() = default;

std::shared_ptr<ServerCertificate::Pair> ServerCertificate::current() {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now < next_check_) return pair_;
  next_check_ = now + std::chrono::seconds(1);
  const FileId c = file_id(cert_file_), k = file_id(key_file_);
  if (c == cert_id_ && k == key_id_) return pair_;
  auto pair = read_pair(cert_file_, cert_key_, key_file_, key_key_);
  if (!pair) {
    // Keep serving the previous pair; try again when the files change once more.
    LOG_WARN("tls") << "the certificate files changed but cannot be used, still serving the previous certificate: "
                    << pair.error().message;
  } else {
    pair_ = std::move(pair.value());
    LOG_INFO("tls") << "serving a new certificate: " << pair_->info.subject << " (" << pair_->info.names
                    << "), valid until " << pair_->info.not_after;
  }
  cert_id_ = c;
  key_id_ = k;
  return pair_;
}

CertInfo ServerCertificate::info() { return current()->info; }

int ServerCertificate::select(SSL* ssl, void* self) {
  auto pair = static_cast<ServerCertificate*>(self)->current();
  // SSL_use_cert_and_key takes its own references: the pair may be replaced after this.
  return SSL_use_cert_and_key(ssl, pair->cert, pair->key, pair->chain, 1) == 1 ? 1 : 0;
}

bool ServerCertificate::configure(SSL_CTX& ctx) {
  SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(&ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION |
                                SSL_OP_NO_SESSION_RESUMPTION_ON_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
  auto pair = current();
  if (SSL_CTX_use_cert_and_key(&ctx, pair->cert, pair->key, pair->chain, 1) != 1) {
    ERR_clear_error();
    return false;
  }
  SSL_CTX_set_cert_cb(&ctx, &ServerCertificate::select, this);
  return true;
}

}  // namespace rdmig::tls
