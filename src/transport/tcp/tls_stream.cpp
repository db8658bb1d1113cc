#include "transport/tcp/tls_stream.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/hmac.h"

namespace rdmig::transport {
namespace {

constexpr char kIdentity[] = "rdmig-channel";
constexpr size_t kReadBuffer = size_t{128} << 10;
// TLS_AES_128_GCM_SHA256 by its IANA code: the PSK's session names it.
constexpr unsigned char kCipherId[] = {0x13, 0x01};

struct PskData {
  std::array<uint8_t, 32> key{};
};

int psk_index() {
  static const int idx = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return idx;
}

SSL_SESSION* psk_session(SSL* ssl) {
  const auto* psk = static_cast<const PskData*>(SSL_get_ex_data(ssl, psk_index()));
  const SSL_CIPHER* cipher = SSL_CIPHER_find(ssl, kCipherId);
  if (psk == nullptr || cipher == nullptr) return nullptr;
  SSL_SESSION* s = SSL_SESSION_new();
  if (s == nullptr) return nullptr;
  if (SSL_SESSION_set1_master_key(s, psk->key.data(), psk->key.size()) != 1 || SSL_SESSION_set_cipher(s, cipher) != 1 ||
      SSL_SESSION_set_protocol_version(s, TLS1_3_VERSION) != 1) {
    SSL_SESSION_free(s);
    return nullptr;
  }
  return s;
}

int use_psk(SSL* ssl, const EVP_MD* md, const unsigned char** id, size_t* idlen, SSL_SESSION** sess) {
  SSL_SESSION* s = psk_session(ssl);
  if (s == nullptr) return 0;
  if (md != nullptr && SSL_CIPHER_get_handshake_digest(SSL_SESSION_get0_cipher(s)) != md) {
    SSL_SESSION_free(s);  // not usable with what the server chose: offer none
    *id = nullptr;
    *idlen = 0;
    *sess = nullptr;
    return 1;
  }
  *id = reinterpret_cast<const unsigned char*>(kIdentity);
  *idlen = sizeof kIdentity - 1;
  *sess = s;
  return 1;
}

int find_psk(SSL* ssl, const unsigned char* id, size_t idlen, SSL_SESSION** sess) {
  if (idlen != sizeof kIdentity - 1 || std::memcmp(id, kIdentity, idlen) != 0) {
    *sess = nullptr;  // unknown identity: the handshake fails (no certificate to fall back on)
    return 1;
  }
  *sess = psk_session(ssl);
  return *sess != nullptr ? 1 : 0;
}

SSL_CTX* context() {
  static SSL_CTX* const ctx = [] {
    SSL_CTX* c = SSL_CTX_new(TLS_method());
    if (c == nullptr) return c;
    SSL_CTX_set_min_proto_version(c, TLS1_3_VERSION);
    SSL_CTX_set_max_proto_version(c, TLS1_3_VERSION);
    SSL_CTX_set_ciphersuites(c, "TLS_AES_128_GCM_SHA256");
    SSL_CTX_set_num_tickets(c, 0);  // nothing after the handshake: a kernel receiver takes data records only
    SSL_CTX_set_options(c, SSL_OP_ENABLE_KTLS | SSL_OP_NO_TICKET | SSL_OP_IGNORE_UNEXPECTED_EOF);
    SSL_CTX_set_mode(c, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    // Room for read ahead (below): several 16 KiB records per read(2) instead of two reads each.
    SSL_CTX_set_default_read_buffer_len(c, kReadBuffer);
    return c;
  }();
  return ctx;
}

std::string ssl_errors() {
  std::string out;
  unsigned long e;
  while ((e = ERR_get_error()) != 0) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

// Waits for the socket; false on timeout. Interrupted polls are retried by the caller's loop.
bool wait_fd(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  return ::poll(&p, 1, timeout_ms) != 0;
}

}  // namespace

Result<std::unique_ptr<TlsStream>> TlsStream::handshake(int fd, Role role, const ChannelTerms& terms,
                                                      std::chrono::milliseconds timeout) {
  const std::string where = "channel " + std::to_string(terms.index) + " (TLS)";
  SSL_CTX* ctx = context();
  if (ctx == nullptr) return Error{Errc::kInternal, where + ": SSL_CTX_new: " + ssl_errors()};
  SSL* ssl = SSL_new(ctx);
  if (ssl == nullptr) return Error{Errc::kInternal, where + ": SSL_new: " + ssl_errors()};
  std::unique_ptr<TlsStream> t(new TlsStream(fd, ssl, where));
  auto psk = std::make_unique<PskData>();
  psk->key = hmac_sha256(terms.key, "rdmig-channel-tls\n" + terms.session + "\n" + std::to_string(terms.index));
  // The PskData lives as long as the SSL: freed after SSL_free by the owner below.
  SSL_set_ex_data(ssl, psk_index(), psk.get());
  if (role == Role::kDialler) {
    SSL_set_psk_use_session_callback(ssl, use_psk);
    SSL_set_connect_state(ssl);
  } else {
    SSL_set_psk_find_session_callback(ssl, find_psk);
    SSL_set_accept_state(ssl);
  }
  if (SSL_set_fd(ssl, fd) != 1) return Error{Errc::kInternal, where + ": SSL_set_fd: " + ssl_errors()};
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return errno_error(where + ": fcntl", errno);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    ERR_clear_error();
    const int r = SSL_do_handshake(ssl);
    if (r == 1) break;
    const int err = SSL_get_error(ssl, r);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if ((err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) && left.count() > 0) {
      (void)wait_fd(fd, err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, static_cast<int>(left.count()));
      continue;
    }
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      return Error{Errc::kTimeout, where + ": no handshake within " + std::to_string(timeout.count()) + " ms"};
    }
    const std::string detail = ssl_errors();
    return Error{Errc::kPermissionDenied,
                 where + ": handshake failed (the peer does not hold the session's key, or is not an rdmig agent "
                         "with dataPlane.tls on): " +
                     (detail.empty() ? (err == SSL_ERROR_SYSCALL ? std::string("connection closed") : "error " + std::to_string(err))
                                     : detail)};
  }
  SSL_set_ex_data(ssl, psk_index(), nullptr);  // the key is needed no more
  t->ktls_send_ = BIO_get_ktls_send(SSL_get_wbio(ssl)) != 0;
  t->ktls_recv_ = BIO_get_ktls_recv(SSL_get_rbio(ssl)) != 0;
  // User-space receive: read ahead, so one read(2) takes what the socket holds (up to kReadBuffer)
  // rather than each record's header and body apart (measured: 2.4 reads per record without).
  // Not before the handshake: records buffered ahead would keep a kernel receiver from being set up.
  if (!t->ktls_recv_) SSL_set_read_ahead(ssl, 1);
  if (t->kernel_both()) {
    // The channel reads and writes the socket itself, blocking, as a plain one.
    if (::fcntl(fd, F_SETFL, flags) != 0) return errno_error(where + ": fcntl", errno);
  }
  return t;
}

TlsStream::TlsStream(int fd, SSL* ssl, std::string where) : fd_(fd), ssl_(ssl), where_(std::move(where)) {}

TlsStream::~TlsStream() { SSL_free(ssl_); }  // never SSL_shutdown: the channel's framing ends the stream

const char* TlsStream::mode() const {
  if (kernel_both()) return "kernel";
  if (ktls_send_) return "kernel send";
  return "user space";
}

const char* TlsStream::label() const {
  if (kernel_both()) return "kernel";
  if (ktls_send_) return "kernel_send";
  return "user_space";
}

Result<size_t> TlsStream::read_some(std::span<std::byte> buf) {
  for (;;) {
    int err;
    size_t n = 0;
    {
      std::lock_guard lock(mu_);
      ERR_clear_error();
      const int r = SSL_read_ex(ssl_, buf.data(), buf.size(), &n);
      if (r == 1) return n;
      err = SSL_get_error(ssl_, r);
      if (err == SSL_ERROR_ZERO_RETURN) return size_t{0};
      if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
        const int sys = errno;
        const std::string detail = ssl_errors();
        if (err == SSL_ERROR_SYSCALL && detail.empty()) {
          if (sys == 0) return size_t{0};
          return errno_error(where_ + ": read", sys);
        }
        return Error{Errc::kUnavailable, where_ + ": SSL_read: " + (detail.empty() ? "error " + std::to_string(err) : detail)};
      }
    }
    // Not under the lock: the writer goes on meanwhile. A shut-down socket (the channel's abort)
    // wakes this wait and the next SSL_read fails.
    (void)wait_fd(fd_, err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, 1000);
  }
}

Status TlsStream::write_all(std::span<const std::byte> buf) {
  while (!buf.empty()) {
    int err;
    {
      std::lock_guard lock(mu_);
      ERR_clear_error();
      size_t n = 0;
      const int r = SSL_write_ex(ssl_, buf.data(), buf.size(), &n);
      if (r == 1) {
        buf = buf.subspan(n);
        continue;
      }
      err = SSL_get_error(ssl_, r);
      if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
        const int sys = errno;
        const std::string detail = ssl_errors();
        if (err == SSL_ERROR_SYSCALL && detail.empty()) {
          auto e = errno_error(where_ + ": write", sys == 0 ? EPIPE : sys);
          if (sys == 0 || sys == EPIPE || sys == ECONNRESET) e.code = Errc::kUnavailable;
          return e;
        }
        return Error{Errc::kUnavailable, where_ + ": SSL_write: " + (detail.empty() ? "error " + std::to_string(err) : detail)};
      }
    }
    (void)wait_fd(fd_, err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, 1000);
  }
  return ok_status();
}

bool TlsStream::try_write(std::span<const std::byte> buf) {
  // mu_ is held only across SSL calls on the non-blocking socket, never across a wait: a reader
  // inside SSL_read (a TLS 1.3 session ticket right after the handshake) lets go within
  // microseconds. One try_lock lost the abort frame to exactly that (the peer then saw "peer
  // closed the connection" instead of the reason, 1 in 6 runs of the unit tests), so try for a
  // little while, never longer than kTryWriteLockWait.
  std::unique_lock lock(mu_, std::defer_lock);
  const auto until = std::chrono::steady_clock::now() + kTryWriteLockWait;
  while (!lock.try_lock()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ERR_clear_error();
  size_t n = 0;
  const bool ok = SSL_write_ex(ssl_, buf.data(), buf.size(), &n) == 1 && n == buf.size();
  ERR_clear_error();
  return ok;
}

}  // namespace rdmig::transport
