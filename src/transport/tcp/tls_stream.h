// TLS on one TCP data channel (dataPlane.tls: on), after the channel's proof (channel_proof.h).
//
// No certificates: TLS 1.3 with an external pre-shared key that only the two token-proven agents
// hold: HMAC-SHA256(channel key, "rdmig-channel-tls\n" session "\n" index), the channel key being
// the one the proofs use. A peer without it fails the handshake (the PSK binder does not verify).
// Key exchange psk_dhe_ke (OpenSSL's default for PSKs: ECDHE under the PSK), so a key learnt later
// does not open a recorded stream. Cipher TLS_AES_128_GCM_SHA256 (one kernel TLS can take).
//
// Kernel TLS: SSL_OP_ENABLE_KTLS asks OpenSSL to hand the record layer to the kernel (tls.ko);
// whether it took each direction is kernel_send()/kernel_recv(). With both, the channel uses
// the socket as a plain one (the kernel encrypts; splice keeps working). OpenSSL 3.0 (Debian 12)
// hands over only the sending direction for TLS 1.3 (tls13_enc.c), so there "kernel send" is the
// best case; TLS 1.2 would give both, but its PSK suites with forward secrecy (ECDHE-PSK) have no
// AES-GCM, so TLS 1.3 it is. Otherwise every byte
// goes through SSL_read/SSL_write in user space (no splice), from two threads (the channel's
// reader and its one writer at a time): the socket is non-blocking and each SSL call is made
// under one lock, never held while waiting for the socket.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "common/result.h"
#include "transport/channel_proof.h"

typedef struct ssl_st SSL;

namespace rdmig::transport {

class TlsStream {
 public:
  enum class Role { kDialler, kAcceptor };  // TLS client (the source, which dials), server
  // Runs the handshake on `fd` (connected, its proof exchanged; not owned). Fails with
  // kPermissionDenied naming the channel when the peer does not hold the key, kTimeout after
  // `timeout`. The socket is left non-blocking unless the kernel took both directions.
  static Result<std::unique_ptr<TlsStream>> handshake(int fd, Role role, const ChannelTerms& terms,
                                                      std::chrono::milliseconds timeout);
  ~TlsStream();
  TlsStream(const TlsStream&) = delete;
  TlsStream& operator=(const TlsStream&) = delete;

  bool kernel_send() const { return ktls_send_; }
  bool kernel_recv() const { return ktls_recv_; }
  // Both directions in the kernel: the socket carries plaintext for its user.
  bool kernel_both() const { return ktls_send_ && ktls_recv_; }
  // "kernel", "kernel send" (receive in user space), "user space".
  const char* mode() const;
  // The same as a metric label: "kernel", "kernel_send", "user_space".
  const char* label() const;

  // Some bytes into `buf` (waits for at least one); 0 at the end of the stream.
  Result<size_t> read_some(std::span<std::byte> buf);
  Status write_all(std::span<const std::byte> buf);
  // Best effort (an abort's reason): never waits for the socket, and for the lock at most
  // kTryWriteLockWait; false when it could not write all of it.
  bool try_write(std::span<const std::byte> buf);

 private:
  TlsStream(int fd, SSL* ssl, std::string where);
  int fd_;
  SSL* ssl_;
  std::string where_;  // "channel N (TLS)"
  bool ktls_send_ = false;
  bool ktls_recv_ = false;
  // Guards ssl_: every SSL call after the handshake (OpenSSL's SSL object is not safe for a
  // reader and a writer at once). Taken by the channel's reader thread (read_some) and its
  // writers (write_all under TcpChannel's write_mu_; try_write with try_lock, for at most
  // kTryWriteLockWait). Released while read_some/write_all poll the socket, so neither
  // direction waits for the other's I/O.
  std::mutex mu_;  // every SSL call after the handshake
  // try_write's wait for mu_ (held only across one SSL call, never across I/O waits).
  static constexpr std::chrono::milliseconds kTryWriteLockWait{50};
};


}  // namespace rdmig::transport
