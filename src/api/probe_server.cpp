#include "api/probe_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

#include "api/listener.h"
#include "common/log.h"
#include "common/net.h"

namespace rdmig::api {

std::string probe_response(std::string_view head, bool ready, bool live) {
  const auto line_end = head.find("\r\n");
  const std::string_view line = head.substr(0, line_end);
  int status = 404;
  std::string body = R"({"error":{"code":"not_found","message":"the probe port serves GET /healthz and GET /readyz"}})";
  auto is = [&](std::string_view path) {
    const std::string want = "GET " + std::string(path) + " ";
    return line.rfind(want, 0) == 0;
  };
  if (is("/healthz")) {
    status = live ? 200 : 503;
    body = live ? R"({"status":"ok"})" : R"({"status":"stalled","message":"a work loop has not turned within its deadline"})";
  } else if (is("/readyz")) {
    status = ready ? 200 : 503;
    body = ready ? R"({"status":"ready"})" : R"({"status":"not ready"})";
  } else if (line.rfind("GET ", 0) != 0 && line.rfind("HEAD ", 0) != 0) {
    status = 405;
    body = R"({"error":{"code":"invalid_argument","message":"the probe port answers GET only"}})";
  }
  const char* text = status == 200 ? "OK" : status == 503 ? "Service Unavailable" : status == 405 ? "Method Not Allowed" : "Not Found";
  body += "\n";
  return "HTTP/1.1 " + std::to_string(status) + " " + text +
         "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

ProbeServer::ProbeServer(std::function<bool()> ready, std::function<bool()> live)
    : ready_(std::move(ready)), live_(std::move(live)) {}

ProbeServer::~ProbeServer() { stop(); }

Status ProbeServer::start(const std::string& address, uint16_t port) {
  auto l = open_listener(address, port, 128);
  if (!l) return l.error().with_context("api.probePort");
  listener_ = std::move(l->fd);
  wake_ = std::move(l->wake);
  port_ = l->port;
  thread_ = std::thread([this] { run(); });
  LOG_INFO("api") << "probes (/healthz, /readyz) on " << address << ":" << port_;
  return ok_status();
}

void ProbeServer::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  thread_.join();
}

namespace {
struct Client {
  UniqueFd fd;
  std::chrono::steady_clock::time_point deadline;
  std::string source;  // the peer's address
  std::string head;
  std::string reply;  // being written once the head is complete
  size_t written = 0;
};

// Which client makes room for a new one from `source` when the table is full: the oldest of
// that source's own when it holds its share already (a flood evicts only itself), else the
// oldest that has not finished its request (a probe that sent its request is answered first).
std::deque<Client>::iterator victim(std::deque<Client>& clients, const std::string& source, size_t per_source) {
  size_t mine = 0;
  for (const auto& c : clients) mine += c.source == source ? 1 : 0;
  for (auto it = clients.begin(); it != clients.end(); ++it) {
    if (mine >= per_source ? it->source == source : it->reply.empty()) return it;
  }
  return clients.begin();
}
}  // namespace

void ProbeServer::run() {
  std::deque<Client> clients;
  std::vector<pollfd> fds;
  // Reads what the client sent (never blocks); once its head is complete, answers and closes.
  auto serve = [this](Client& c) {
    if (c.reply.empty()) {
      char buf[1024];
      const ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
      if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EINTR)) c.fd.reset();
        return;
      }
      c.head.append(buf, static_cast<size_t>(n));
      if (c.head.find("\r\n\r\n") != std::string::npos || c.head.size() >= kMaxRequestBytes) {
        c.reply = probe_response(c.head, !ready_ || ready_(), !live_ || live_());
      }
    }
    if (!c.reply.empty()) {
      const ssize_t n = ::send(c.fd.get(), c.reply.data() + c.written, c.reply.size() - c.written, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) c.written += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN && errno != EINTR) c.fd.reset();
      if (c.written == c.reply.size()) c.fd.reset();  // answered: close
    }
  };
  while (!stopping_.load()) {
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({listener_.get(), POLLIN, 0});
    auto now = std::chrono::steady_clock::now();
    auto next = now + kRequestDeadline;
    for (auto& c : clients) {
      fds.push_back({c.fd.get(), static_cast<short>(c.reply.empty() ? POLLIN : POLLOUT), 0});
      next = std::min(next, c.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait, 0) + 1));
    if (rc < 0 && errno != EINTR) {
      LOG_ERROR("api") << "probe server poll: " << std::strerror(errno);
      return;
    }
    now = std::chrono::steady_clock::now();
    // Serve the clients first (their pollfds follow the two fixed ones, in order).
    for (size_t i = 0; i < clients.size(); ++i) {
      if (fds[i + 2].revents != 0) serve(clients[i]);
    }
    // Whole-request deadline, then drop what is done.
    for (auto& c : clients) {
      if (c.fd.valid() && now >= c.deadline) c.fd.reset();
    }
    std::erase_if(clients, [](const Client& c) { return !c.fd.valid(); });
    // New connections: each is read at once (a probe's request is usually there already and is
    // answered now); a full table makes room as victim() says.
    if (fds[1].revents & POLLIN) {
      for (;;) {
        UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!fd.valid()) break;
        Client c{std::move(fd), now + kRequestDeadline, {}, {}, {}, 0};
        c.source = net::peer_address(c.fd.get());
        serve(c);
        if (!c.fd.valid()) continue;  // answered already
        if (clients.size() >= kMaxClients) clients.erase(victim(clients, c.source, kMaxClientsPerSource));
        clients.push_back(std::move(c));
      }
    }
  }
}

}  // namespace rdmig::api
