// The agent's HTTPS certificate and key. Read and checked at start; when either file changes
// (a Kubernetes Secret volume swaps both at once when cert-manager renews the certificate) the
// pair is read again, at most once a second, on the next handshake. A changed pair that does not
// load or whose key does not match is logged and the previous pair is kept, so a half-written
// update never takes the API down. Each handshake gets the pair that is current when it starts.
#pragma once

#include <openssl/ssl.h>
#include <sys/stat.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "common/result.h"
#include "tls/pem_files.h"

namespace rdmig::tls {

class ServerCertificate {
 public:
  // Errors name `cert_key` or `key_key` (e.g. "api.tls.certFile").
  static Result<std::shared_ptr<ServerCertificate>> load(const std::string& cert_file, const std::string& cert_key,
                                                         const std::string& key_file, const std::string& key_key);
  ~ServerCertificate();
  ServerCertificate(const ServerCertificate&) = delete;
  ServerCertificate& operator=(const ServerCertificate&) = delete;

  // Prepares a server context: TLS 1.2 or newer, no compression or renegotiation, and this
  // certificate chosen per handshake. The context must not outlive this object.
  bool configure(SSL_CTX& ctx);

  // What is served now.
  CertInfo info();

 private:
  struct Pair;
  struct FileId {
    dev_t dev = 0;
    ino_t ino = 0;
    off_t size = 0;
    timespec mtime{};
    bool operator==(const FileId& o) const;
  };
  ServerCertificate() = default;
  static FileId file_id(const std::string& path);
  static Result<std::shared_ptr<Pair>> read_pair(const std::string& cert_file, const std::string& cert_key,
                                                 const std::string& key_file, const std::string& key_key);
  static int select(SSL* ssl, void* self);  // SSL_CTX_set_cert_cb
  std::shared_ptr<Pair> current();          // reloads when the files changed

  std::string cert_file_, cert_key_, key_file_, key_key_;
  // The file names above are set in load(), then only read.
  // mu_ guards every member below it (pair_, cert_id_, key_id_, next_check_): current() checks
  // and reloads the files under it, at most once a second. Taken by each TLS handshake
  // (select, from the serving threads: HttpFront's, the metrics server's), info() and
  // configure(). Held across the stat and the file read of a reload; no other lock under it.
  std::mutex mu_;
  std::shared_ptr<Pair> pair_;
  FileId cert_id_, key_id_;
  std::chrono::steady_clock::time_point next_check_{};
};

}  // namespace rdmig::tls
