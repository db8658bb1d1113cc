// Every data channel of every agent-to-agent session (a bare-QEMU job, a path check, a carried
// KubeVirt flow; TCP and RDMA alike) proves that it belongs to that session: a MAC under a key
// that only the two token-proven ends hold, bound to the session, the channel index, which end
// proves (the dialler or the acceptor) and something fresh. The session id itself is no secret:
// it travels in clear and only names the session.
//
// The key: HMAC-SHA256(token, purpose \n source nonce \n target nonce \n session), hex. The
// source's nonce is in its control hello, the target's in its challenge; the token never crosses
// the wire, so an observer of both nonces cannot derive it. The flow control link's key
// (purpose "rdmig-flow-key") comes from the same function; channels use "rdmig-channel-key".
//
// TCP (one exchange for every kind of data hello: "data", "pathcheck-data", "flow-data"):
//   dialler  -> acceptor  hello {kind, ..., session, index, nonce: 32 hex, fresh per connection}
//   acceptor -> dialler   {type: challenge, nonce: 32 hex, fresh per connection}  | reject
//   dialler  -> acceptor  {type:"auth", proof: hex MAC(dial)}
//   acceptor -> dialler   {type: welcome, proof: hex MAC(accept)} | reject
//   MAC(by) = HMAC-SHA256(key, "rdmig-channel\n" by "\n" session "\n" index "\n" dialler nonce
//             "\n" acceptor nonce); checked in constant time. The acceptor's nonce is fresh, so a
//   proof seen on the wire is worth nothing on another connection; the welcome's proof shows the
//   dialler that the acceptor holds the key too. Only after a good proof does the acceptor admit
//   the channel (its index, its buffers): a wrong one takes nothing and displaces nothing.
// RDMA: the proof rides in the rdma_cm connect request (transport/rdma/cm.h).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <string_view>

#include "common/result.h"

namespace rdmig::transport {

// The key of a session's channels (see above): hex HMAC-SHA256 of the token.
std::string derive_session_key(const std::string& token, std::string_view purpose, const std::string& source_nonce,
                               const std::string& target_nonce, const std::string& session);
inline std::string channel_key(const std::string& token, const std::string& source_nonce,
                               const std::string& target_nonce, const std::string& session) {
  return derive_session_key(token, "rdmig-channel-key", source_nonce, target_nonce, session);
}

// Which end proves: the dialler (the source, which connects every channel) or the acceptor.
enum class ProofBy { kDialler, kAcceptor };

// What a channel's proof binds besides the fresh part.
struct ChannelTerms {
  std::string key;      // channel_key(...)
  std::string session;  // the session id as it travels (32 hex)
  uint32_t index = 0;   // the channel index
};

// The one MAC every channel proof is: HMAC-SHA256(key, "rdmig-channel\n" by "\n" session "\n"
// index "\n" fresh), raw. `by` is "dial" or "accept".
std::array<uint8_t, 32> channel_mac(const ChannelTerms& terms, ProofBy by, std::string_view fresh);
// Constant time in the shorter length; false when the lengths differ or `got` is empty.
bool mac_equal(std::span<const uint8_t> got, std::span<const uint8_t> want);

// Fresh nonces on TCP: 16 random bytes as 32 lowercase hex characters.
inline constexpr size_t kChannelNonceChars = 32;
bool is_channel_nonce(const std::string& s);

// TCP, the dialler's side: sends `hello` with a fresh "nonce" added, answers the acceptor's
// challenge and checks the welcome's proof. Errors: the acceptor's reject (its message), a
// welcome without the acceptor's proof (kPermissionDenied), the connection's loss.
Status prove_channel(int fd, nlohmann::json hello, const ChannelTerms& terms, std::chrono::milliseconds timeout);

// TCP, the acceptor's side, for a hello that named a session whose terms are `terms` and carried
// `dialler_nonce`: challenges and checks the answer. On success, the proof for the welcome
// (a welcome {type: welcome, proof}, sent by the caller once it admitted the channel). On failure
// a reject is sent and the error is kPermissionDenied (nothing is admitted).
Result<std::string> check_channel(int fd, const ChannelTerms& terms, const std::string& dialler_nonce,
                                  std::chrono::milliseconds timeout);

// The proofs an acceptor already took (RDMA, where the dialler's fresh part cannot come from the
// acceptor): a proof is good once. Bounded; thread-safe.
class ProofLedger {
 public:
  // True the first time `mac` is seen (then it is recorded), false after.
  bool first_use(std::span<const uint8_t> mac);

 private:
  static constexpr size_t kMaxEntries = 1024;
  // Guards seen_ alone: first_use() checks and records under it (RDMA CM and accept threads
  // checking requests, possibly under the owner's lock, e.g. PathCheck::mu_). No lock under it.
  std::mutex mu_;
  std::set<std::string> seen_;
};

}  // namespace rdmig::transport
