#include "api/http_front.h"

#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <thread>
#include <vector>

#include "api/listener.h"
#include "api/models.h"
#include "api/request_framing.h"
#include "common/log.h"
#include "common/net.h"

namespace rdmig::api {

using Clock = std::chrono::steady_clock;

struct HttpFront::Conn {
  UniqueFd fd;
  SSL* ssl = nullptr;
  std::string source;  // the peer's address: what the per-source share counts
  int source_port = 0;
  Clock::time_point accepted;
  bool handshaken = false;  // TLS: the handshake is done (plain HTTP: always)
  short want = POLLIN;      // what the front waits for on fd
  std::string head;         // bytes read so far (the head, maybe part of the body)
  size_t taken = 0;         // of `head`, how much the worker has read
  // The request's framing (request_framing.h), set when the head is complete: the stream hands
  // httplib bytes up to `limit` (a position in the connection's input, head included) and then
  // the end of input; `received` is how far the input has been taken into `head`.
  std::string early;                   // what the front read past the head: the body's start
  std::optional<ChunkedBody> chunked;  // a chunked body not yet ended
  uint64_t limit = UINT64_MAX;
  uint64_t received = 0;
  bool answered = false;  // refused by the front: httplib's own answer is dropped
  Clock::time_point linger_until;
  size_t lingered = 0;  // input bytes dropped while lingering
  ~Conn() {
    if (ssl) SSL_free(ssl);
  }
};

namespace {

// Waits until fd is ready for `events` or `until` passes (at most kIoTimeout from now).
bool wait_for(int fd, short events, Clock::time_point until) {
  for (;;) {
    const auto now = Clock::now();
    const auto end = std::min(until, now + HttpFront::kIoTimeout);
    if (now >= end) return false;
    pollfd p{fd, events, 0};
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(end - now).count() + 1;
    const int rc = ::poll(&p, 1, static_cast<int>(ms));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return false;
  }
}

// One read without blocking: >0 bytes, 0 end of stream, -1 error, -2 would block (wait for
// `want`).
ssize_t read_some(HttpFront::Conn& c, char* buf, size_t len, short& want) {
  if (!c.ssl) {
    const ssize_t n = ::recv(c.fd.get(), buf, len, MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      want = POLLIN;
      return -2;
    }
    return -1;
  }
  ERR_clear_error();
  const int n = SSL_read(c.ssl, buf, static_cast<int>(std::min<size_t>(len, INT32_MAX)));
  if (n > 0) return n;
  switch (SSL_get_error(c.ssl, n)) {
    case SSL_ERROR_WANT_READ: want = POLLIN; return -2;
    case SSL_ERROR_WANT_WRITE: want = POLLOUT; return -2;
    case SSL_ERROR_ZERO_RETURN: return 0;
    default: return -1;
  }
}

// Writes all of buf, waiting at most kIoTimeout each time the peer does not take more.
bool write_all(HttpFront::Conn& c, const char* buf, size_t len) {
  size_t done = 0;
  while (done < len) {
    short want = POLLOUT;
    if (!c.ssl) {
      const ssize_t n = ::send(c.fd.get(), buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        done += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    } else {
      ERR_clear_error();
      const int n = SSL_write(c.ssl, buf + done, static_cast<int>(std::min<size_t>(len - done, INT32_MAX)));
      if (n > 0) {
        done += static_cast<size_t>(n);
        continue;
      }
      const int e = SSL_get_error(c.ssl, n);
      if (e == SSL_ERROR_WANT_READ) {
        want = POLLIN;
      } else if (e != SSL_ERROR_WANT_WRITE) {
        return false;
      }
    }
    if (!wait_for(c.fd.get(), want, Clock::now() + HttpFront::kIoTimeout)) return false;
  }
  return true;
}

// A whole HTTP answer from the front itself: the JSON error shape, then the connection closes.
std::string error_reply(int status, const Error& e) {
  const char* reason = "Bad Request";
  switch (status) {
    case 408: reason = "Request Timeout"; break;
    case 413: reason = "Payload Too Large"; break;
    case 414: reason = "URI Too Long"; break;
    case 431: reason = "Request Header Fields Too Large"; break;
    default: break;
  }
  const std::string body =
      error_body(e).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  return "HTTP/1.1 " + std::to_string(status) + " " + reason + "\r\nContent-Type: application/json\r\n" +
         "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// Writes `reply` without waiting (the front thread never blocks): best effort, a fresh
// connection's send buffer takes a short answer whole.
void send_nowait(HttpFront::Conn& c, const std::string& reply) {
  if (c.ssl && !c.handshaken) return;
  if (!c.ssl) {
    (void)!::send(c.fd.get(), reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  } else {
    ERR_clear_error();
    SSL_write(c.ssl, reply.data(), static_cast<int>(reply.size()));
  }
}

Error framing_error(const FramingError& f) { return Error{Errc::kInvalidArgument, f.message}; }

// The connection as httplib reads and writes it on a worker: first what the front read, then
// the socket, every read bounded by the request's deadline, and no byte past the request's end
// (its framing); a chunked body is checked as it arrives, and a bad one answered at once.
class FrontStream final : public httplib::Stream {
 public:
  explicit FrontStream(HttpFront::Conn& c) : c_(c), deadline_(c.accepted + HttpFront::kRequestDeadline) {}

  bool is_readable() const override {
    if (c_.taken < c_.head.size() || c_.received >= c_.limit || (c_.ssl && SSL_pending(c_.ssl) > 0)) return true;
    return wait_for(c_.fd.get(), POLLIN, deadline_);
  }
  bool is_writable() const override { return wait_for(c_.fd.get(), POLLOUT, Clock::now() + HttpFront::kIoTimeout); }

  ssize_t read(char* ptr, size_t size) override {
    if (c_.answered) return -1;
    if (c_.taken == c_.head.size()) {
      if (c_.received >= c_.limit) return 0;  // the request's end
      c_.taken = 0;
      const uint64_t room = c_.limit - c_.received;
      if (!c_.early.empty()) {
        c_.head = std::move(c_.early);
        c_.early.clear();
      } else {
        char buf[16 * 1024];
        for (;;) {
          short want = POLLIN;
          const ssize_t n = read_some(c_, buf, static_cast<size_t>(std::min<uint64_t>(sizeof buf, room)), want);
          if (n == 0) return 0;
          if (n == -1) return -1;
          if (n > 0) {
            c_.head.assign(buf, static_cast<size_t>(n));
            break;
          }
          if (!wait_for(c_.fd.get(), want, deadline_)) return -1;  // silent past the deadline
        }
      }
      if (c_.head.size() > room) c_.head.resize(static_cast<size_t>(room));
      if (c_.chunked) {
        auto r = c_.chunked->feed(c_.head);
        if (const auto* e = std::get_if<FramingError>(&r)) {
          const std::string reply = error_reply(e->status, framing_error(*e));
          (void)write_all(c_, reply.data(), reply.size());
          c_.answered = true;
          return -1;
        }
        if (c_.chunked->done()) {
          c_.head.resize(std::get<size_t>(r));
          c_.limit = c_.received + c_.head.size();
          c_.chunked.reset();
        }
      }
      c_.received += c_.head.size();
    }
    const size_t n = std::min(size, c_.head.size() - c_.taken);
    std::memcpy(ptr, c_.head.data() + c_.taken, n);
    c_.taken += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (c_.answered) return static_cast<ssize_t>(size);  // the front's refusal was the answer
    return write_all(c_, ptr, size) ? static_cast<ssize_t>(size) : -1;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = c_.source;
    port = c_.source_port;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    ip.clear();
    port = 0;
    if (::getsockname(c_.fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) return;
    char host[NI_MAXHOST];
    char serv[NI_MAXSERV];
    if (::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, serv, sizeof serv,
                      NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(serv);
    }
  }
  socket_t socket() const override { return c_.fd.get(); }

 private:
  HttpFront::Conn& c_;
  Clock::time_point deadline_;
};

// Ends a connection: TLS close_notify (best effort, never waits), then both directions.
void close_conn(HttpFront::Conn& c) {
  if (!c.fd.valid()) return;
  if (c.ssl && c.handshaken) {
    ERR_clear_error();
    SSL_shutdown(c.ssl);
  }
  ::shutdown(c.fd.get(), SHUT_RDWR);
  c.fd.reset();
}

// A 408 for a head that did not arrive in time (best effort: the client is trickling).
void answer_timeout(HttpFront::Conn& c) {
  static const std::string reply =
      error_reply(408, Error{Errc::kTimeout, "request head not complete within " +
                                                 std::to_string(HttpFront::kHeaderDeadline.count()) + " s of connecting"});
  send_nowait(c, reply);
}

// After a refusal: no more output (TLS close_notify, then FIN), input still read and dropped.
void start_linger(HttpFront::Conn& c, Clock::time_point now) {
  if (c.ssl && c.handshaken) {
    ERR_clear_error();
    SSL_shutdown(c.ssl);
  }
  ::shutdown(c.fd.get(), SHUT_WR);
  c.linger_until = now + HttpFront::kLinger;
  c.want = POLLIN;
}

// Reads and drops what is there (raw bytes: TLS is over). True when lingering is over: the
// client closed, the connection broke, or it sent more than kMaxLingerBytes.
bool drain(HttpFront::Conn& c) {
  char buf[16 * 1024];
  for (;;) {
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
      c.lingered += static_cast<size_t>(n);
      if (c.lingered > HttpFront::kMaxLingerBytes) return true;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    return true;
  }
}

}  // namespace

// Threads that run requests: one is started whenever queued connections outnumber idle
// workers, up to kMaxWorkers; only past that do connections wait.
class HttpFront::Workers {
 public:
  ~Workers() { shutdown(); }

  void enqueue(std::function<void()> fn) {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    tasks_.push_back(std::move(fn));
    if (tasks_.size() > idle_ && threads_.size() < kMaxWorkers) {
      threads_.emplace_back([this] { work(); });
    } else {
      cv_.notify_one();
    }
  }

  void shutdown() {
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      threads.swap(threads_);
    }
    cv_.notify_all();
    for (auto& t : threads) t.join();
  }

 private:
  void work() {
    std::unique_lock lock(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      --idle_;
      if (tasks_.empty()) return;  // stopping, nothing left
      auto fn = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

HttpFront::HttpFront(SSL_CTX* tls, uint64_t max_body, Serve serve)
    : tls_(tls), max_body_(max_body), serve_(std::move(serve)), workers_(std::make_unique<Workers>()) {}

HttpFront::~HttpFront() {
  stop();
  workers_->shutdown();
}

Status HttpFront::bind(const std::string& address, uint16_t port) {
  auto l = open_listener(address, port, 1024);
  if (!l) return l.error();
  listener_ = std::move(l->fd);
  wake_ = std::move(l->wake);
  port_ = l->port;
  return ok_status();
}

void HttpFront::stop() {
  stopping_ = true;
  if (wake_.valid()) {
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
  }
}

size_t HttpFront::open_from(const std::string& source) {
  std::lock_guard lock(mu_);
  auto it = per_source_.find(source);
  return it == per_source_.end() ? 0 : it->second;
}

bool HttpFront::admit(const std::string& source) {
  std::lock_guard lock(mu_);
  size_t& n = per_source_[source];
  if (n >= kMaxPerSource) return false;
  ++n;
  ++open_;
  return true;
}

void HttpFront::release(const std::string& source) {
  std::lock_guard lock(mu_);
  auto it = per_source_.find(source);
  if (it != per_source_.end() && --it->second == 0) per_source_.erase(it);
  --open_;
}

void HttpFront::dispatch(std::shared_ptr<Conn> c) {
  workers_->enqueue([this, c] {
    {
      FrontStream stream(*c);
      try {
        serve_(stream);
      } catch (const std::exception& e) {
        LOG_ERROR("api") << "request from " << c->source << " failed: " << e.what();
      }
    }
    if (c->answered) return hand_back(c);  // refused mid-body: the front lingers
    close_conn(*c);
    release(c->source);
  });
}

void HttpFront::hand_back(std::shared_ptr<Conn> c) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_.load()) {
      handed_back_.push_back(std::move(c));
      const uint64_t one = 1;
      (void)!::write(wake_.get(), &one, sizeof one);
      return;
    }
  }
  close_conn(*c);
  release(c->source);
}

void HttpFront::run() {
  std::list<std::shared_ptr<Conn>> pending;    // in accept order: the oldest deadline first
  std::list<std::shared_ptr<Conn>> lingering;  // refused, input dropped: the oldest first
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Conn>> polled;
  auto drop = [this](Conn& c) {
    close_conn(c);
    release(c.source);
  };
  // Answers a refusal at once and lingers (the connection leaves `pending`).
  auto refuse = [&](const std::shared_ptr<Conn>& cp, const FramingError& e) {
    send_nowait(*cp, error_reply(e.status, framing_error(e)));
    start_linger(*cp, Clock::now());
    lingering.push_back(cp);
  };
  // The head is complete (`end` bytes of c.head): its framing decides whether a worker takes
  // it, and how much of the input is the request. A chunked body's chunks are checked as the
  // worker reads them (after the token: the handler reads the body), those already here too.
  auto take_head = [&](const std::shared_ptr<Conn>& cp, size_t end) {
    Conn& c = *cp;
    auto checked = check_request_head(std::string_view(c.head).substr(0, end), max_body_);
    if (const auto* e = std::get_if<FramingError>(&checked)) return refuse(cp, *e);
    const auto& framing = std::get<BodyFraming>(checked);
    c.early = c.head.substr(end);
    c.head.resize(end);
    c.received = end;
    if (framing.kind == BodyFraming::Kind::kChunked) {
      c.chunked.emplace(max_body_);
    } else {
      c.limit = end + (framing.kind == BodyFraming::Kind::kLength ? framing.length : 0);
    }
    dispatch(cp);
  };
  // Moves a connection on as far as it goes without blocking: handshake, then the head. True
  // when it left `pending` (handed to a worker, refused, or closed).
  auto advance = [&](const std::shared_ptr<Conn>& cp) {
    Conn& c = *cp;
    if (c.ssl && !c.handshaken) {
      ERR_clear_error();
      const int rc = SSL_do_handshake(c.ssl);
      if (rc != 1) {
        const int e = SSL_get_error(c.ssl, rc);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
          c.want = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
          return false;
        }
        drop(c);  // not TLS, or a handshake that failed: HTTPS only
        return true;
      }
      c.handshaken = true;
    }
    char buf[4096];
    for (;;) {
      const size_t before = c.head.size();
      const ssize_t n = read_some(c, buf, std::min(sizeof buf, kMaxHeadBytes - before), c.want);
      if (n == -2) return false;
      if (n <= 0) {
        drop(c);  // closed or broken before its head was complete
        return true;
      }
      c.head.append(buf, static_cast<size_t>(n));
      if (const size_t end = find_head_end(c.head, before); end != std::string::npos) {
        take_head(cp, end);
        return true;
      }
      if (c.head.size() >= kMaxHeadBytes) {
        refuse(cp, head_too_large(c.head, kMaxHeadBytes));
        return true;
      }
    }
  };
  auto accept_all = [&](Clock::time_point now) {
    for (;;) {
      UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd.valid()) {
        if (errno == EMFILE || errno == ENFILE) {
          // Out of descriptors: the listener stays readable, so back off instead of spinning.
          LOG_WARN("api") << "accept: " << std::strerror(errno);
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return;
      }
      auto c = std::make_shared<Conn>();
      c->fd = std::move(fd);
      c->accepted = now;
      c->source = net::peer_address(c->fd.get());
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      if (::getpeername(c->fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
        c->source_port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                        : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      }
      // Full: a refused connection still lingering goes first, else the oldest head still
      // awaited from the address that holds the most.
      bool full = false;
      {
        std::lock_guard lock(mu_);
        full = open_ >= kMaxConnections;
      }
      if (full && !lingering.empty()) {
        drop(*lingering.front());
        lingering.pop_front();
      } else if (full) {
        std::string biggest;
        size_t most = 0;
        {
          std::lock_guard lock(mu_);
          for (const auto& [src, n] : per_source_) {
            if (n > most) most = n, biggest = src;
          }
        }
        auto it = std::find_if(pending.begin(), pending.end(), [&](const auto& p) { return p->source == biggest; });
        if (it == pending.end()) it = pending.begin();
        if (it == pending.end()) continue;  // everything open is on a worker: refuse this one
        drop(**it);
        pending.erase(it);
      }
      if (!admit(c->source)) continue;  // this address holds its share already: its newest goes
      if (tls_) {
        c->ssl = SSL_new(tls_);
        if (!c->ssl || SSL_set_fd(c->ssl, c->fd.get()) != 1) {
          drop(*c);
          continue;
        }
        SSL_set_accept_state(c->ssl);
      } else {
        c->handshaken = true;
      }
      if (!advance(c)) pending.push_back(std::move(c));  // most requests are complete already
    }
  };

  while (!stopping_.load()) {
    fds.clear();
    polled.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({listener_.get(), POLLIN, 0});
    for (auto& c : pending) {
      fds.push_back({c->fd.get(), c->want, 0});
      polled.push_back(c);
    }
    const size_t lingering_from = polled.size();
    for (auto& c : lingering) {
      fds.push_back({c->fd.get(), POLLIN, 0});
      polled.push_back(c);
    }
    auto now = Clock::now();
    auto next = pending.empty() ? now + std::chrono::seconds(1) : pending.front()->accepted + kHeaderDeadline;
    if (!lingering.empty()) next = std::min(next, lingering.front()->linger_until);
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<long long>(wait, 0, 1000) + 1));
    if (rc < 0 && errno != EINTR) {
      LOG_ERROR("api") << "front poll: " << std::strerror(errno);
      break;
    }
    now = Clock::now();
    if (fds[0].revents & POLLIN) {  // stop(), or connections that workers refused mid-body
      uint64_t count = 0;
      (void)!::read(wake_.get(), &count, sizeof count);
      std::vector<std::shared_ptr<Conn>> back;
      {
        std::lock_guard lock(mu_);
        back.swap(handed_back_);
      }
      for (auto& c : back) {
        start_linger(*c, now);
        lingering.push_back(std::move(c));
      }
      if (stopping_.load()) break;
    }
    std::vector<const Conn*> gone;
    std::vector<const Conn*> lingered;
    for (size_t i = 0; i < polled.size(); ++i) {
      if (fds[i + 2].revents == 0) continue;
      if (i < lingering_from) {
        if (advance(polled[i])) gone.push_back(polled[i].get());
      } else if (drain(*polled[i])) {
        drop(*polled[i]);
        lingered.push_back(polled[i].get());
      }
    }
    pending.remove_if([&](const auto& c) { return std::find(gone.begin(), gone.end(), c.get()) != gone.end(); });
    lingering.remove_if([&](const auto& c) { return std::find(lingered.begin(), lingered.end(), c.get()) != lingered.end(); });
    while (!pending.empty() && now >= pending.front()->accepted + kHeaderDeadline) {
      answer_timeout(*pending.front());
      drop(*pending.front());
      pending.pop_front();
    }
    // Lingering ends at its deadline (the list is in deadline order: each began at its push).
    while (!lingering.empty() && now >= lingering.front()->linger_until) {
      drop(*lingering.front());
      lingering.pop_front();
    }
    if (fds[1].revents & POLLIN) accept_all(now);
  }
  for (auto& c : pending) drop(*c);
  pending.clear();
  for (auto& c : lingering) drop(*c);
  lingering.clear();
  std::vector<std::shared_ptr<Conn>> back;
  {
    std::lock_guard lock(mu_);
    back.swap(handed_back_);
  }
  for (auto& c : back) drop(*c);
  workers_->shutdown();
}

}  // namespace rdmig::api
