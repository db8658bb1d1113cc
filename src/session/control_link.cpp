#include "session/control_link.h"

#include <sys/socket.h>

#include "common/net.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::session {

ControlLink::ControlLink(UniqueFd fd) : fd_(std::move(fd)) {
  net::detect_dead_peer(fd_.get());
  reader_ = std::thread([this] { reader_loop(); });
}

ControlLink::~ControlLink() {
  close();
  if (reader_.joinable()) reader_.join();
}

void ControlLink::close() {
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

Status ControlLink::send(const nlohmann::json& message) {
  MutexLock lock(write_mu_);
  auto st = transport::send_message(fd_.get(), message);
  if (!st) return st.error().with_context("control connection");
  return st;
}

void ControlLink::reader_loop() {
  for (;;) {
    auto m = transport::recv_message(fd_.get(), std::chrono::hours(24 * 365));
    MutexLock lock(mu_);
    if (!m) {
      closed_ = m.error().with_context("control connection");
      cv_.notify_all();
      return;
    }
    queue_.push_back(std::move(m.value()));
    cv_.notify_all();
  }
}

Result<std::optional<nlohmann::json>> ControlLink::next(std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (queue_.empty() && !closed_.has_value()) {
    if (lock.wait_until(cv_, deadline) == std::cv_status::timeout) break;
  }
  if (!queue_.empty()) {
    auto m = std::move(queue_.front());
    queue_.pop_front();
    return std::optional<nlohmann::json>(std::move(m));
  }
  if (closed_) return *closed_;
  return std::optional<nlohmann::json>();
}

void ControlLink::unread(nlohmann::json message) {
  MutexLock lock(mu_);
  queue_.push_front(std::move(message));
  cv_.notify_all();
}

Result<nlohmann::json> ControlLink::expect(const std::string& type, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return Error{Errc::kTimeout, "no '" + type + "' from the peer agent within " +
                                       std::to_string(timeout.count()) + " ms"};
    }
    auto m = next(left);
    if (!m) return m.error();
    if (!m->has_value()) continue;
    const auto& j = **m;
    const auto t = session::kind_of(j);
    if (t && session::name(*t) == type) return j;
    if (t == session::MessageKind::kAbort) {
      return Error{Errc::kCancelled, "peer agent aborted: " + j.value("reason", std::string("no reason"))};
    }
  }
}

}  // namespace rdmig::session
