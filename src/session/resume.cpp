#include "session/resume.h"

#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "common/json_limits.h"
#include "common/units.h"
#include "session/protocol.h"
#include "transport/wire.h"

namespace rdmig::session {

using nlohmann::json;

namespace {

std::string resume_mac(const transport::ChannelTerms& terms, transport::ProofBy by, const std::string& dialler_nonce,
                       const std::string& acceptor_nonce, uint64_t dialler_taken, uint64_t acceptor_taken) {
  const auto mac = transport::channel_mac(terms, by,
                                          "resume\n" + dialler_nonce + "\n" + acceptor_nonce + "\n" +
                                              std::to_string(dialler_taken) + "\n" + std::to_string(acceptor_taken));
  return to_hex(mac.data(), mac.size());
}

std::string where(const transport::ChannelTerms& terms) {
  return (terms.index == kControlIndex ? std::string("control link") : "channel " + std::to_string(terms.index)) + " resume";
}

Result<std::string> nonce_of(const json& m, const std::string& at) {
  auto n = get_string(m, "nonce", at, transport::kChannelNonceChars);
  if (!n) return n.error();
  if (!transport::is_channel_nonce(n.value())) {
    return Error{Errc::kProtocol, at + ".nonce: must be 32 lowercase hex characters"};
  }
  return n;
}

// How the exchange's messages travel: a connection's framed JSON (wire.h), or a re-dialled
// channel's chunks (one message a chunk).
struct Pipe {
  std::function<Status(const json&)> send;
  std::function<Result<json>(std::chrono::milliseconds)> recv;
};

void send_refusal(const Pipe& pipe, const std::string& code, const std::string& why) {
  (void)pipe.send(message(MessageKind::kReject, json{{"code", code}, {"message", why}}));
}

Pipe fd_pipe(int fd) {
  return Pipe{[fd](const json& m) { return transport::send_message(fd, m); },
              [fd](std::chrono::milliseconds timeout) { return transport::recv_message(fd, timeout); }};
}

// One message a chunk on a channel nothing else uses yet; release()d once read.
Pipe channel_pipe(transport::Channel& ch) {
  return Pipe{[&ch](const json& m) -> Status {
                const std::string body = m.dump(-1, ' ', false, json::error_handler_t::replace);
                auto buf = ch.acquire();
                if (!buf) return buf.error();
                if (body.size() > buf->size()) {
                  ch.unacquire();
                  return Error{Errc::kInternal, "resume message larger than a chunk"};
                }
                std::memcpy(buf->data(), body.data(), body.size());
                return ch.send(body.size());
              },
              [&ch](std::chrono::milliseconds) -> Result<json> {
                auto view = ch.receive();
                if (!view) return view.error();
                if (view->eof || view->data.size() > transport::kMaxMessageBytes) {
                  (void)ch.release();
                  return Error{Errc::kProtocol, "expected a resume message"};
                }
                json j = parse_json_bounded(std::string_view(reinterpret_cast<const char*>(view->data.data()),
                                                             view->data.size()));
                RDMIG_TRY(ch.release());
                if (j.is_discarded() || !j.is_object()) return Error{Errc::kProtocol, "resume message is not a JSON object"};
                return j;
              }};
}

// Aborts `ch` when the exchange outlasts `timeout` (its calls block without one of their own).
class AbortAfter {
 public:
  AbortAfter(transport::Channel& ch, std::chrono::milliseconds timeout)
      : thread_([this, &ch, timeout] {
          std::unique_lock lock(mu_);
          if (!cv_.wait_for(lock, timeout, [this] { return done_; })) {
            ch.abort(Error{Errc::kTimeout, "resume: no answer within " + std::to_string(timeout.count()) + " ms"});
          }
        }) {}
  ~AbortAfter() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: started once the rest exists
};

Result<uint64_t> dial_side(const Pipe& pipe, const transport::ChannelTerms& terms, uint64_t taken,
                           std::chrono::milliseconds timeout);
Result<uint64_t> accept_side(const Pipe& pipe, const transport::ChannelTerms& terms, uint64_t taken,
                             std::chrono::milliseconds timeout);

}  // namespace

Result<uint64_t> resume_as_dialler(int fd, const transport::ChannelTerms& terms, uint64_t taken,
                                   std::chrono::milliseconds timeout) {
  return dial_side(fd_pipe(fd), terms, taken, timeout);
}

Result<uint64_t> resume_as_acceptor(int fd, const transport::ChannelTerms& terms, uint64_t taken,
                                    std::chrono::milliseconds timeout) {
  return accept_side(fd_pipe(fd), terms, taken, timeout);
}

Result<uint64_t> resume_as_dialler(transport::Channel& ch, const transport::ChannelTerms& terms, uint64_t taken,
                                   std::chrono::milliseconds timeout) {
  AbortAfter bound(ch, timeout);
  return dial_side(channel_pipe(ch), terms, taken, timeout);
}

Result<uint64_t> resume_as_acceptor(transport::Channel& ch, const transport::ChannelTerms& terms, uint64_t taken,
                                    std::chrono::milliseconds timeout) {
  AbortAfter bound(ch, timeout);
  return accept_side(channel_pipe(ch), terms, taken, timeout);
}

namespace {

Result<uint64_t> dial_side(const Pipe& pipe, const transport::ChannelTerms& terms, uint64_t taken,
                           std::chrono::milliseconds timeout) {
  const std::string mine = random_hex(transport::kChannelNonceChars / 2);
  RDMIG_TRY(pipe.send(message(MessageKind::kResume, json{{"taken", taken}, {"nonce", mine}})));
  auto reply = pipe.recv(timeout);
  if (!reply) return reply.error().with_context(where(terms));
  if (!is(*reply, MessageKind::kResume)) {
    const auto r = Reject::from(*reply);
    return Error{Errc::kPermissionDenied, where(terms) + " refused: " + r.message};
  }
  const std::string at = "resume";
  auto theirs = get_uint(*reply, "taken", at, 0, kMaxResumeCount);
  if (!theirs) return Error{Errc::kProtocol, where(terms) + ": " + theirs.error().message};
  auto nonce = nonce_of(*reply, at);
  if (!nonce) return Error{Errc::kProtocol, where(terms) + ": " + nonce.error().message};
  auto proof = get_string(*reply, "proof", at, 64);
  if (!proof || !constant_time_equal(proof.value(), resume_mac(terms, transport::ProofBy::kAcceptor, mine,
                                                                nonce.value(), taken, theirs.value()))) {
    return Error{Errc::kPermissionDenied, where(terms) + ": the peer's answer does not prove the session's key (resume.proof)"};
  }
  RDMIG_TRY(pipe.send(
      message(MessageKind::kResumeOk, json{{"proof", resume_mac(terms, transport::ProofBy::kDialler, mine,
                                                                      nonce.value(), taken, theirs.value())}})));
  return theirs.value();
}

Result<uint64_t> accept_side(const Pipe& pipe, const transport::ChannelTerms& terms, uint64_t taken,
                             std::chrono::milliseconds timeout) {
  auto refuse = [&](Errc code, const std::string& why) -> Result<uint64_t> {
    send_refusal(pipe, code == Errc::kPermissionDenied ? "permission_denied" : "protocol", where(terms) + ": " + why);
    return Error{code, where(terms) + ": " + why};
  };
  auto m = pipe.recv(timeout);
  if (!m) return m.error().with_context(where(terms));
  if (!is(*m, MessageKind::kResume)) return refuse(Errc::kProtocol, "expected a resume message");
  auto theirs = get_uint(*m, "taken", "resume", 0, kMaxResumeCount);
  if (!theirs) return refuse(Errc::kProtocol, theirs.error().message);
  auto nonce = nonce_of(*m, "resume");
  if (!nonce) return refuse(Errc::kProtocol, nonce.error().message);
  const std::string mine = random_hex(transport::kChannelNonceChars / 2);
  RDMIG_TRY(pipe.send(
      message(MessageKind::kResume,
                  json{{"taken", taken},
                       {"nonce", mine},
                       {"proof", resume_mac(terms, transport::ProofBy::kAcceptor, nonce.value(), mine, theirs.value(),
                                            taken)}})));
  auto ok = pipe.recv(timeout);
  if (!ok) return ok.error().with_context(where(terms));
  auto proof = get_string(*ok, "proof", "resume-ok", 64);
  if (!is(*ok, MessageKind::kResumeOk) || !proof ||
      !constant_time_equal(proof.value(), resume_mac(terms, transport::ProofBy::kDialler, nonce.value(), mine,
                                                     theirs.value(), taken))) {
    return refuse(Errc::kPermissionDenied, "resume-ok.proof: does not prove the session's key");
  }
  return theirs.value();
}

}  // namespace

}  // namespace rdmig::session
