#include "transport/channel_proof.h"

#include <algorithm>

#include "common/hmac.h"
#include "common/units.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::transport {

using nlohmann::json;

std::string derive_session_key(const std::string& token, std::string_view purpose, const std::string& source_nonce,
                               const std::string& target_nonce, const std::string& session) {
  return hmac_sha256_hex(token, std::string(purpose) + "\n" + source_nonce + "\n" + target_nonce + "\n" + session);
}

std::array<uint8_t, 32> channel_mac(const ChannelTerms& terms, ProofBy by, std::string_view fresh) {
  std::string msg = "rdmig-channel\n";
  msg += by == ProofBy::kDialler ? "dial" : "accept";
  msg += "\n" + terms.session + "\n" + std::to_string(terms.index) + "\n";
  msg += fresh;
  return hmac_sha256(terms.key, msg);
}

bool mac_equal(std::span<const uint8_t> got, std::span<const uint8_t> want) {
  if (got.empty() || got.size() != want.size()) return false;
  return constant_time_equal(std::string_view(reinterpret_cast<const char*>(got.data()), got.size()),
                             std::string_view(reinterpret_cast<const char*>(want.data()), want.size()));
}

bool is_channel_nonce(const std::string& s) {
  return s.size() == kChannelNonceChars &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

namespace {

std::string tcp_fresh(const std::string& dialler_nonce, const std::string& acceptor_nonce) {
  return dialler_nonce + "\n" + acceptor_nonce;
}

std::string hex_mac(const ChannelTerms& terms, ProofBy by, const std::string& dialler_nonce,
                    const std::string& acceptor_nonce) {
  const auto mac = channel_mac(terms, by, tcp_fresh(dialler_nonce, acceptor_nonce));
  return to_hex(mac.data(), mac.size());
}

// The control link re-dialled to fail it over proves over its own index (no data channel has it).
std::string channel_name(const ChannelTerms& terms) {
  return terms.index == session::kControlIndex ? std::string("control link") : "channel " + std::to_string(terms.index);
}

}  // namespace

Status prove_channel(int fd, json hello, const ChannelTerms& terms, std::chrono::milliseconds timeout) {
  const std::string mine = random_hex(kChannelNonceChars / 2);
  hello["nonce"] = mine;
  RDMIG_TRY(send_message(fd, hello));
  auto refused = [&](const json& reply) {
    return Error{Errc::kPermissionDenied, channel_name(terms) + " refused: " + reply.value("message", std::string("?"))};
  };
  auto challenge = recv_message(fd, timeout);
  if (!challenge) return challenge.error().with_context(channel_name(terms));
  if (!session::is(*challenge, session::MessageKind::kChallenge)) return refused(challenge.value());
  auto theirs = get_string(challenge.value(), "nonce", session::to_string(session::MessageKind::kChallenge), kChannelNonceChars);
  if (!theirs) return theirs.error().with_context(channel_name(terms));
  if (!is_channel_nonce(theirs.value())) {
    return Error{Errc::kProtocol, channel_name(terms) + ": challenge.nonce: must be 32 lowercase hex characters"};
  }
  RDMIG_TRY(send_message(fd, session::message(session::MessageKind::kAuth, json{{"proof", hex_mac(terms, ProofBy::kDialler, mine, theirs.value())}})));
  auto welcome = recv_message(fd, timeout);
  if (!welcome) return welcome.error().with_context(channel_name(terms));
  if (!session::is(*welcome, session::MessageKind::kWelcome)) return refused(welcome.value());
  auto proof = get_string(welcome.value(), "proof", session::to_string(session::MessageKind::kWelcome), 64);
  if (!proof || !constant_time_equal(proof.value(), hex_mac(terms, ProofBy::kAcceptor, mine, theirs.value()))) {
    return Error{Errc::kPermissionDenied,
                 channel_name(terms) + ": the target agent's welcome does not prove the session's key (welcome.proof)"};
  }
  return ok_status();
}

Result<std::string> check_channel(int fd, const ChannelTerms& terms, const std::string& dialler_nonce,
                                  std::chrono::milliseconds timeout) {
  auto refuse = [&](const std::string& why) -> Result<std::string> {
    send_reject(fd, "permission_denied", channel_name(terms) + ": " + why);
    return Error{Errc::kPermissionDenied, channel_name(terms) + ": " + why};
  };
  if (!is_channel_nonce(dialler_nonce)) return refuse("hello.nonce: must be 32 lowercase hex characters");
  const std::string mine = random_hex(kChannelNonceChars / 2);
  RDMIG_TRY(send_message(fd, session::message(session::MessageKind::kChallenge, json{{"nonce", mine}})));
  auto auth = recv_message(fd, timeout);
  if (!auth) return refuse("no answer to the challenge (" + auth.error().message + ")");
  auto proof = get_string(auth.value(), "proof", session::to_string(session::MessageKind::kAuth), 64);
  if (!session::is(*auth, session::MessageKind::kAuth) || !proof) return refuse("auth.proof: required");
  if (!constant_time_equal(proof.value(), hex_mac(terms, ProofBy::kDialler, dialler_nonce, mine))) {
    return refuse("auth.proof: does not prove the session's key");
  }
  return hex_mac(terms, ProofBy::kAcceptor, dialler_nonce, mine);
}

bool ProofLedger::first_use(std::span<const uint8_t> mac) {
  std::string k(reinterpret_cast<const char*>(mac.data()), mac.size());
  std::lock_guard lock(mu_);
  // A session has at most kMaxChannels channels and few retries: a ledger this full is being
  // flooded with good proofs, which only a key holder can make; refusing them is safe.
  if (seen_.size() >= kMaxEntries) return false;
  return seen_.insert(std::move(k)).second;
}

}  // namespace rdmig::transport
