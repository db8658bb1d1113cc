#include "session/resume.h"

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

std::string where(const transport::ChannelTerms& terms) { return "channel " + std::to_string(terms.index) + " resume"; }

Result<std::string> nonce_of(const json& m, const std::string& at) {
  auto n = get_string(m, "nonce", at, transport::kChannelNonceChars);
  if (!n) return n.error();
  if (!transport::is_channel_nonce(n.value())) {
    return Error{Errc::kProtocol, at + ".nonce: must be 32 lowercase hex characters"};
  }
  return n;
}

}  // namespace

Result<uint64_t> resume_as_dialler(int fd, const transport::ChannelTerms& terms, uint64_t taken,
                                   std::chrono::milliseconds timeout) {
  const std::string mine = random_hex(transport::kChannelNonceChars / 2);
  RDMIG_TRY(transport::send_message(fd, message(MessageKind::kResume, json{{"taken", taken}, {"nonce", mine}})));
  auto reply = transport::recv_message(fd, timeout);
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
  RDMIG_TRY(transport::send_message(
      fd, message(MessageKind::kResumeOk, json{{"proof", resume_mac(terms, transport::ProofBy::kDialler, mine,
                                                                      nonce.value(), taken, theirs.value())}})));
  return theirs.value();
}

Result<uint64_t> resume_as_acceptor(int fd, const transport::ChannelTerms& terms, uint64_t taken,
                                    std::chrono::milliseconds timeout) {
  auto refuse = [&](Errc code, const std::string& why) -> Result<uint64_t> {
    transport::send_reject(fd, code == Errc::kPermissionDenied ? "permission_denied" : "protocol", where(terms) + ": " + why);
    return Error{code, where(terms) + ": " + why};
  };
  auto m = transport::recv_message(fd, timeout);
  if (!m) return m.error().with_context(where(terms));
  if (!is(*m, MessageKind::kResume)) return refuse(Errc::kProtocol, "expected a resume message");
  auto theirs = get_uint(*m, "taken", "resume", 0, kMaxResumeCount);
  if (!theirs) return refuse(Errc::kProtocol, theirs.error().message);
  auto nonce = nonce_of(*m, "resume");
  if (!nonce) return refuse(Errc::kProtocol, nonce.error().message);
  const std::string mine = random_hex(transport::kChannelNonceChars / 2);
  RDMIG_TRY(transport::send_message(
      fd, message(MessageKind::kResume,
                  json{{"taken", taken},
                       {"nonce", mine},
                       {"proof", resume_mac(terms, transport::ProofBy::kAcceptor, nonce.value(), mine, theirs.value(),
                                            taken)}})));
  auto ok = transport::recv_message(fd, timeout);
  if (!ok) return ok.error().with_context(where(terms));
  auto proof = get_string(*ok, "proof", "resume-ok", 64);
  if (!is(*ok, MessageKind::kResumeOk) || !proof ||
      !constant_time_equal(proof.value(), resume_mac(terms, transport::ProofBy::kDialler, nonce.value(), mine,
                                                     theirs.value(), taken))) {
    return refuse(Errc::kPermissionDenied, "resume-ok.proof: does not prove the session's key");
  }
  return theirs.value();
}

}  // namespace rdmig::session
