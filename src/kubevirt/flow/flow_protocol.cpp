#include "kubevirt/flow/flow_protocol.h"

#include "common/hmac.h"
#include "common/units.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

using nlohmann::json;

// The version is the codec's (session/protocol.h); this header keeps its name for its callers.
static_assert(kFlowProtocolVersion == session::kFlowProtocol);

std::string flow_proof(const std::string& token, const std::string& role, const session::Hello& hello,
                       const std::string& target_nonce) {
  return hmac_sha256_hex(token, "rdmig-flow-proof\n" + role + "\n" + hello.nonce + "\n" + target_nonce + "\n" +
                                    hello.to_json().dump());
}

std::string flow_session_key(const std::string& token, const session::Hello& hello, const std::string& target_nonce) {
  return transport::derive_session_key(token, "rdmig-flow-key", hello.nonce, target_nonce, hello.session);
}

std::string flow_channel_key(const std::string& token, const session::Hello& hello, const std::string& target_nonce) {
  return transport::channel_key(token, hello.nonce, target_nonce, hello.session);
}

session::Hello flow_data_hello(const std::string& session, uint32_t index, bool tls, bool resume) {
  return session::channel_hello(session::HelloKind::kFlowData, "", session, index, tls, resume);
}

session::Hello flow_control_hello(const std::string& session) {
  session::Hello h = flow_data_hello(session, 0, /*tls=*/false, /*resume=*/true);
  h.control = true;
  return h;
}

FlowSigner::FlowSigner(std::string key, std::string own, std::string peer)
    : key_(std::move(key)), own_(std::move(own)), peer_(std::move(peer)) {}

std::string FlowSigner::mac_of(const std::string& label, const json& message) const {
  return hmac_sha256_hex(key_, label + "\n" + message.dump());
}

json FlowSigner::sign(json message) {
  message.erase("mac");
  message["seq"] = sent_++;
  message["mac"] = mac_of(own_, message);
  return message;
}

Result<json> FlowSigner::verify(const json& message) {
  if (!message.is_object()) return Error{Errc::kProtocol, "control message: not an object"};
  auto mac = transport::get_string(message, "mac", "control message", 64);
  if (!mac) return mac.error();
  json body = message;
  body.erase("mac");
  auto seq = body.find("seq");
  if (seq == body.end() || !seq->is_number_unsigned() || seq->get<uint64_t>() != received_) {
    return Error{Errc::kPermissionDenied, "control message " + std::to_string(received_) + ": out of sequence"};
  }
  if (!constant_time_equal(mac.value(), mac_of(peer_, body))) {
    return Error{Errc::kPermissionDenied, "control message " + std::to_string(received_) + ": its MAC does not match"};
  }
  ++received_;
  body.erase("seq");
  return body;
}

}  // namespace rdmig::kubevirt
