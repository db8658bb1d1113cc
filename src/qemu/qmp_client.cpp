#include "qemu/qmp_client.h"

#include <poll.h>
#include <sys/socket.h>

#include "common/log.h"
#include "common/net.h"

namespace rdmig::qemu {

namespace {
constexpr size_t kMaxLine = 8 * 1024 * 1024;
}

QmpClient::QmpClient(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}

QmpClient::~QmpClient() {
  close();
  if (reader_.joinable()) reader_.join();
}

Result<std::string> QmpClient::read_line_blocking(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (auto nl = rx_buffer_.find('\n'); nl != std::string::npos) {
      std::string line = rx_buffer_.substr(0, nl);
      rx_buffer_.erase(0, nl + 1);
      return line;
    }
    if (rx_buffer_.size() > kMaxLine) return Error{Errc::kProtocol, "QMP line too long"};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return Error{Errc::kTimeout, "QMP: no message from QEMU"};
    pollfd p{fd_.get(), POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno != EINTR) return errno_error("poll", errno);
    if (rc <= 0) continue;
    char buf[65536];
    const ssize_t n = ::recv(fd_.get(), buf, sizeof buf, 0);
    if (n == 0) return Error{Errc::kUnavailable, "QMP: QEMU closed the connection"};
    if (n < 0) {
      if (errno == EINTR) continue;
      auto e = errno_error("QMP recv", errno);
      e.code = Errc::kUnavailable;
      return e;
    }
    rx_buffer_.append(buf, static_cast<size_t>(n));
  }
}

Result<std::unique_ptr<QmpClient>> QmpClient::connect(const std::string& socket_path,
                                                      std::chrono::milliseconds timeout) {
  auto fd = net::unix_connect(socket_path, timeout);
  if (!fd) return fd.error().with_context("QMP " + socket_path);
  const int pid = net::peer_pid(fd->get());
  std::unique_ptr<QmpClient> c(new QmpClient(std::move(fd.value()), socket_path));
  c->peer_pid_ = pid;
  // Greeting, then leave capabilities negotiation mode; both synchronous, before the reader,
  // within one deadline however many events QEMU sends meanwhile (it can queue one ahead of
  // the greeting; a peer that only sends events must not hold the caller forever).
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                       deadline - std::chrono::steady_clock::now()));
  };
  for (;;) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return Error{Errc::kTimeout, "QMP " + socket_path + ": no greeting within " + std::to_string(timeout.count()) + " ms"};
    }
    auto greeting_line = c->read_line_blocking(left());
    if (!greeting_line) return greeting_line.error().with_context("QMP " + socket_path + " greeting");
    auto greeting = parse_qmp_message(greeting_line.value());
    if (greeting && greeting->kind == QmpMessageKind::kEvent) continue;
    if (!greeting || greeting->kind != QmpMessageKind::kGreeting) {
      return Error{Errc::kProtocol, "QMP " + socket_path + ": expected a greeting (is another client connected?)"};
    }
    break;
  }
  const std::string cmd = encode_qmp_command("qmp_capabilities", {}, 0);
  RDMIG_TRY(net::write_all(c->fd_.get(), std::as_bytes(std::span(cmd.data(), cmd.size()))));
  for (;;) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return Error{Errc::kTimeout, "QMP " + socket_path + ": qmp_capabilities not answered within " +
                                       std::to_string(timeout.count()) + " ms"};
    }
    auto line = c->read_line_blocking(left());
    if (!line) return line.error().with_context("QMP " + socket_path + " qmp_capabilities");
    auto m = parse_qmp_message(line.value());
    if (!m) return m.error();
    if (m->kind == QmpMessageKind::kEvent) continue;
    if (m->kind == QmpMessageKind::kError) {
      return Error{Errc::kQemu, "qmp_capabilities: " + m->error_desc};
    }
    break;
  }
  c->reader_ = std::thread([p = c.get()] { p->reader_loop(); });
  return c;
}

void QmpClient::reader_loop() {
  for (;;) {
    auto line = read_line_blocking(std::chrono::hours(24 * 365));
    if (!line) {
      std::lock_guard lock(mu_);
      if (!closed_) {
        closed_ = true;
        close_reason_ = line.error().message;
      }
      cv_.notify_all();
      return;
    }
    auto m = parse_qmp_message(line.value());
    if (!m) {
      LOG_WARN("qmp") << "socket=" << path_ << " ignoring message: " << m.error().message;
      continue;
    }
    std::lock_guard lock(mu_);
    if (m->kind == QmpMessageKind::kEvent) {
      events_.push_back(QmpEvent{m->event, m->value, m->timestamp_us, ++event_seq_});
      if (events_.size() > kMaxEvents) events_.pop_front();
      LOG_DEBUG("qmp") << "socket=" << path_ << " event=" << m->event << " data=" << m->value.dump();
    } else if (m->id.is_number_unsigned()) {
      auto it = pending_.find(m->id.get<uint64_t>());
      if (it != pending_.end()) it->second = std::move(m.value());
    }
    cv_.notify_all();
  }
}

Result<nlohmann::json> QmpClient::execute(const std::string& command, const nlohmann::json& args,
                                          std::chrono::milliseconds timeout) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (closed_) return Error{Errc::kUnavailable, "QMP " + path_ + ": connection closed: " + close_reason_};
    id = next_id_++;
    pending_.emplace(id, std::nullopt);
  }
  const std::string line = encode_qmp_command(command, args, id);
  {
    std::lock_guard wl(write_mu_);
    auto st = net::write_all(fd_.get(), std::as_bytes(std::span(line.data(), line.size())));
    if (!st) {
      std::lock_guard lock(mu_);
      pending_.erase(id);
      return st.error().with_context("QMP " + command);
    }
  }
  std::unique_lock lock(mu_);
  const bool got = cv_.wait_for(lock, timeout, [&] { return pending_[id].has_value() || closed_; });
  auto node = pending_.extract(id);
  if (!got || !node.mapped().has_value()) {
    if (closed_) return Error{Errc::kUnavailable, "QMP " + command + ": connection closed: " + close_reason_};
    return Error{Errc::kTimeout, "QMP " + command + ": no reply within " + std::to_string(timeout.count()) + " ms"};
  }
  QmpMessage& m = *node.mapped();
  if (m.kind == QmpMessageKind::kError) {
    return Error{Errc::kQemu, command + ": " + m.error_class + ": " + m.error_desc};
  }
  return std::move(m.value);
}

std::optional<QmpEvent> QmpClient::wait_event(const std::function<bool(const QmpEvent&)>& pred,
                                              uint64_t after, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  std::optional<QmpEvent> found;
  cv_.wait_for(lock, timeout, [&] {
    for (const auto& e : events_) {
      if (e.seq > after && pred(e)) {
        found = e;
        return true;
      }
    }
    return closed_;
  });
  return found;
}

std::vector<QmpEvent> QmpClient::events() const {
  std::lock_guard lock(mu_);
  return {events_.begin(), events_.end()};
}

uint64_t QmpClient::last_event_seq() const {
  std::lock_guard lock(mu_);
  return event_seq_;
}

bool QmpClient::connected() const {
  std::lock_guard lock(mu_);
  return !closed_;
}

void QmpClient::close() {
  {
    std::lock_guard lock(mu_);
    if (!closed_) {
      closed_ = true;
      close_reason_ = "closed by rdmig";
    }
  }
  cv_.notify_all();
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

}  // namespace rdmig::qemu
