#include "session/control_link.h"

#include <sys/socket.h>

#include <vector>

#include "common/log.h"
#include "common/net.h"
#include "session/failover_channel.h"
#include "session/protocol.h"
#include "transport/wire.h"

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
  MutexLock lock(fd_mu_);
  closing_ = true;
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

int ControlLink::fd() const {
  MutexLock lock(fd_mu_);
  return fd_.get();
}

void ControlLink::fail_over_with(Reconnect reconnect, std::chrono::milliseconds deadline, OnFailover on_failover) {
  {
    MutexLock lock(fd_mu_);
    // A silent link is noticed as a data channel's is.
    if (fd_.valid()) net::detect_dead_peer_within(fd_.get(), FailoverChannel::kSilentLinkAfter);
  }
  MutexLock lock(mu_);
  reconnect_ = std::move(reconnect);
  on_failover_ = std::move(on_failover);
  deadline_ = deadline;
  failover_on_.store(true);
}

void ControlLink::stop_failing_over() {
  {
    MutexLock lock(write_mu_);
    failover_on_.store(false);
    sent_log_.clear();
  }
  MutexLock lock(mu_);
  reconnect_ = nullptr;
  on_failover_ = nullptr;
}

void ControlLink::interrupt() {
  if (!failover_on_.load()) return;
  MutexLock lock(fd_mu_);
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);  // the reader's read fails: it fails over
}

uint64_t ControlLink::received() {
  MutexLock lock(mu_);
  return received_;
}

void ControlLink::acknowledged(uint64_t peer_has) {
  MutexLock lock(write_mu_);
  if (peer_has > sent_) return;  // not a count this end can have caused
  while (!sent_log_.empty() && sent_ - sent_log_.size() < peer_has) sent_log_.pop_front();
}

Status ControlLink::send(const nlohmann::json& message) {
  MutexLock lock(write_mu_);
  const bool keep = failover_on_.load();
  if (keep) sent_log_.push_back(message);
  ++sent_;
  int fd = -1;
  {
    MutexLock flock(fd_mu_);
    fd = fd_.get();
  }
  // fd stays open while write_mu_ is held: only a failover (under write_mu_) replaces it.
  auto st = transport::send_message(fd, message);
  if (!st && keep) {
    // Kept: the failover resends it on the next connection, or the link fails for good and the
    // reader says so (next()).
    return ok_status();
  }
  if (!st) return st.error().with_context("control connection");
  return st;
}

bool ControlLink::recover(const Error& why) {
  using Clock = std::chrono::steady_clock;
  Reconnect reconnect;
  OnFailover on_failover;
  uint64_t received = 0;
  std::chrono::milliseconds span{0};
  {
    MutexLock lock(mu_);
    if (!reconnect_ || peer_aborted_) return false;
    reconnect = reconnect_;
    on_failover = on_failover_;
    received = received_;
    span = deadline_;
  }
  {
    MutexLock lock(fd_mu_);
    if (closing_) return false;  // this end closed it
    ::shutdown(fd_.get(), SHUT_RDWR);  // a send blocked on the old connection returns
  }
  const auto started = Clock::now();
  {
    MutexLock lock(mu_);
    recovery_why_ = why;
    recovery_started_ = started;
    recovery_tries_ = 0;
    recovery_last_.reset();
  }
  recovering_.store(true);
  struct Done {
    ControlLink& link;
    ~Done() {
      {
        MutexLock lock(link.mu_);
        link.recovery_why_.reset();
      }
      link.recovering_.store(false);
    }
  } done{*this};
  const auto deadline = started + span;
  LOG_WARN("failover") << "control connection lost (" << why.message << "); received " << received
                       << ", reconnecting within " << span.count() << " ms";
  Error last = why;
  for (;;) {
    {
      MutexLock lock(fd_mu_);
      if (closing_) return false;
    }
    auto r = reconnect(received, deadline, [this] {
      MutexLock lock(fd_mu_);
      return closing_;
    });
    if (r) {
      uint64_t resent = 0;
      bool refused = false, resent_all = true;
      {
        MutexLock wlock(write_mu_);
        const uint64_t peer_has = r->second;
        const uint64_t kept_from = sent_ - sent_log_.size();
        if (peer_has > sent_ || peer_has < kept_from) {
          refused = true;
          last = Error{Errc::kProtocol, "the peer's resume says it received " + std::to_string(peer_has) +
                                            " of this end's " + std::to_string(sent_) + " messages: refused"};
        } else {
          int fd = -1;
          {
            MutexLock flock(fd_mu_);
            if (closing_) return false;
            fd_ = std::move(r->first);
            fd = fd_.get();
          }
          net::detect_dead_peer_within(fd, FailoverChannel::kSilentLinkAfter);
          for (uint64_t i = peer_has - kept_from; i < sent_log_.size() && resent_all; ++i, ++resent) {
            resent_all = static_cast<bool>(transport::send_message(fd, sent_log_[i]));
          }
        }
      }
      if (refused) break;
      if (resent_all) {
        const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started);
        LOG_INFO("failover") << "control connection resumed after " << took.count() << " ms (resent " << resent
                             << ")";
        failovers_.fetch_add(1);
        if (on_failover) on_failover(why.message, took, resent);
        return true;
      }
      last = Error{Errc::kUnavailable, "resending on the new control connection failed"};
      MutexLock flock(fd_mu_);
      ::shutdown(fd_.get(), SHUT_RDWR);
    } else {
      last = r.error();
      if (last.code == Errc::kPermissionDenied) break;  // the peer refused: it is over
    }
    {
      MutexLock lock(mu_);
      ++recovery_tries_;
      recovery_last_ = last;
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  MutexLock lock(mu_);
  closed_ = Error{Errc::kUnavailable, "control connection lost (" + why.message + ") and not back within " +
                                          std::to_string(span.count()) + " ms (" + last.message + ")"};
  // Over before anyone is told: a reader woken by closed_ finds no failover under way (Done's
  // reset, after this lock is let go, came too late for one in run C3).
  recovery_why_.reset();
  recovering_.store(false);
  cv_.notify_all();
  return false;
}

std::optional<std::string> ControlLink::recovery_state() const {
  MutexLock lock(mu_);
  if (!recovery_why_) return std::nullopt;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                        recovery_started_);
  std::string tries = recovery_tries_ == 0 ? "its first try under way"
                                           : std::to_string(recovery_tries_) + (recovery_tries_ == 1 ? " try" : " tries") +
                                                 ", the last: " + (recovery_last_ ? recovery_last_->message : "?");
  return "control connection lost (" + recovery_why_->message + "), failing over for " + std::to_string(ms.count()) +
         " ms (" + tries + ")";
}

void ControlLink::reader_loop() {
  for (;;) {
    int fd = -1;
    {
      MutexLock flock(fd_mu_);
      fd = fd_.get();
    }
    auto m = transport::recv_message(fd, std::chrono::hours(24 * 365));
    if (!m) {
      const Error why = m.error();
      if (recover(why)) continue;
      MutexLock lock(mu_);
      if (!closed_) closed_ = why.with_context("control connection");
      cv_.notify_all();
      return;
    }
    MutexLock lock(mu_);
    ++received_;
    if (session::is(m.value(), session::MessageKind::kAbort)) peer_aborted_ = true;
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
