// The REST port's front: it accepts every connection itself and hands one to an HTTP worker
// only once the request's headers are all there.
//
// Why not httplib's own accept loop: it listens with a backlog of 5 and gives each connection
// to a worker thread at accept, before a byte has arrived. A client that sends its headers a
// byte at a time then holds a worker for as long as it likes (each read has a timeout; the
// request as a whole has none), and the per-client cap could count a request only once its
// headers were parsed: 64 trickling connections from one address held every worker.
//
// Here one thread (run()) accepts, does the TLS handshake and reads the request head of every
// connection without blocking. A connection counts against its source address from accept to
// close (at most kMaxPerSource; a source over its share loses its own newest connection, so a
// flood from one address never pushes out another's), the head must be complete within
// kHeaderDeadline of accept (else 408 and close), and the whole request (head and body) must be
// read within kRequestDeadline. Workers (at most kMaxWorkers, started as needed) get only
// connections whose head is complete, and run the request through `serve`.
//
// The front also owns the request's framing (api/request_framing.h): a head over kMaxHeadBytes,
// a bad or over-limit Content-Length, a Transfer-Encoding other than chunked, both together, is
// answered here at once (400/413/414/431, JSON naming the header) without a worker and before
// the token is checked (the answer depends on nothing but the bytes sent and api.maxBodyBytes).
// On a worker, the stream hands httplib exactly the body the framing announces (nothing when
// there is none) and follows a chunked body as the handler reads it (so after the token check):
// a chunk size that is not hex or takes the body past the limit is answered as soon as its
// digits arrive, not when the chunk would have. After such an answer the
// connection is closed for writing and what the client still sends is read and dropped for up
// to kLinger (at most kMaxLingerBytes), so the answer is not lost to a reset (RFC 9112 9.6).
#pragma once

#include <openssl/ssl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/result.h"

namespace httplib {
class Stream;
}

namespace rdmig::api {

class HttpFront {
 public:
  static constexpr auto kHeaderDeadline = std::chrono::seconds(10);   // accept → end of head
  static constexpr auto kRequestDeadline = std::chrono::seconds(30);  // accept → body read
  static constexpr auto kIoTimeout = std::chrono::seconds(10);        // any one wait for the peer
  static constexpr size_t kMaxHeadBytes = 16 * 1024;  // past this: 414 or 431, at once
  static constexpr auto kLinger = std::chrono::seconds(2);  // after a refusal: input dropped
  static constexpr size_t kMaxLingerBytes = 4 * 1024 * 1024;
  static constexpr size_t kMaxConnections = 512;      // open at once, in every state
  static constexpr size_t kMaxPerSource = 128;        // of those, from one address
  static constexpr size_t kMaxWorkers = 64;

  // Runs one request on a connection whose head has arrived; the front closes it afterwards.
  using Serve = std::function<void(httplib::Stream&)>;

  // `tls`: the server context when the port serves HTTPS only (not owned; must outlive this),
  // null for plain HTTP. `max_body`: the largest request body taken (api.maxBodyBytes).
  HttpFront(SSL_CTX* tls, uint64_t max_body, Serve serve);
  ~HttpFront();
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

  // Binds address:port (0 = any free port).
  Status bind(const std::string& address, uint16_t port);
  uint16_t port() const { return port_; }
  // Accepts and reads request heads until stop(); then waits for the workers.
  void run();
  void stop();

  // Connections of `source` open now (tests and the refusal message).
  size_t open_from(const std::string& source);

  struct Conn;  // a connection in the front or on a worker (http_front.cpp)

 private:
  class Workers;
  bool admit(const std::string& source);  // counts the connection; false: source over its share
  void release(const std::string& source);
  void dispatch(std::shared_ptr<Conn> c);
  void hand_back(std::shared_ptr<Conn> c);  // a worker's refused connection: the front lingers

  SSL_CTX* tls_;
  uint64_t max_body_;
  Serve serve_;
  UniqueFd listener_;
  UniqueFd wake_;  // eventfd: stop() wakes run()
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::unique_ptr<Workers> workers_;
  // Guards per_source_, open_ and handed_back_. Taken by run()'s thread (admit, the full
  // check, taking handed_back_), the worker threads (release, hand_back) and open_from()
  // (tests). Held only for the book-keeping (and hand_back's one eventfd write); independent
  // of Workers' own queue lock, never held with it.
  std::mutex mu_;
  std::map<std::string, size_t> per_source_;
  size_t open_ = 0;
  std::vector<std::shared_ptr<Conn>> handed_back_;  // under mu_; run() takes them to linger
};

}  // namespace rdmig::api
