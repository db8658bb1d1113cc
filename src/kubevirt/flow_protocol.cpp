#include "kubevirt/flow_protocol.h"

#include "common/hmac.h"
#include "common/units.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

using nlohmann::json;

// The version is the codec's (session/protocol.h); this header keeps its name for its callers.
static_assert(kFlowProtocolVersion == session::kFlowProtocol);

json FlowHello::to_json() const {
  json j{{"kind", session::to_string(session::HelloKind::kFlow)},
         {"protocol", kFlowProtocolVersion},
         {"session", session},
         {"nonce", nonce},
         {"mode", mode},
         {"migrationUid", migration_uid},
         {"sourceNode", source_node},
         {"targetNode", target_node},
         {"chunkSize", chunk_size},
         {"ringDepth", ring_depth},
         {"transport", transport},
         {"transportRequired", transport_required}};
  if (!vmi.name.empty()) j["vmi"] = json{{"namespace", vmi.namespace_}, {"name", vmi.name}, {"uid", vmi.uid}};
  if (!rdma_rails.empty()) j["rdmaRails"] = transport::rails_to_json(rdma_rails);
  if (failover) j["failover"] = true;
  return j;
}

namespace {
bool is_hex(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}
}  // namespace

Result<FlowHello> FlowHello::parse(const json& j) {
  using transport::get_string;
  using transport::get_uint;
  FlowHello h;
  auto proto = session::check_hello_protocol(j, session::Purpose::kFlow);
  if (!proto) return proto.error();
  for (auto [key, out] : {std::pair{"session", &h.session}, std::pair{"nonce", &h.nonce}}) {
    auto v = get_string(j, key, "hello", 32);
    if (!v) return v.error();
    if (v->size() != 32 || !is_hex(v.value())) {
      return Error{Errc::kInvalidArgument, std::string("hello.") + key + ": must be 32 lowercase hex characters"};
    }
    *out = v.value();
  }
  auto mode = get_string(j, "mode", "hello", 16);
  if (!mode) return mode.error();
  if (mode.value() != "hook" && mode.value() != "static") {
    return Error{Errc::kInvalidArgument, "hello.mode: must be hook or static"};
  }
  h.mode = mode.value();
  auto uid = get_string(j, "migrationUid", "hello", 128);
  auto src = get_string(j, "sourceNode", "hello", 253);
  auto dst = get_string(j, "targetNode", "hello", 253);
  if (!uid) return uid.error();
  if (!src) return src.error();
  if (!dst) return dst.error();
  h.migration_uid = uid.value();
  h.source_node = src.value();
  h.target_node = dst.value();
  if (auto v = j.find("vmi"); v != j.end()) {
    if (!v->is_object()) return Error{Errc::kInvalidArgument, "hello.vmi: must be an object"};
    auto ns = get_string(*v, "namespace", "hello.vmi", 253);
    auto name = get_string(*v, "name", "hello.vmi", 253);
    auto vuid = get_string(*v, "uid", "hello.vmi", 128);
    if (!ns) return ns.error();
    if (!name) return name.error();
    if (!vuid) return vuid.error();
    h.vmi = VmiRef{ns.value(), name.value(), vuid.value()};
  }
  auto terms = transport::parse_session_terms(j, "hello");
  if (!terms) return terms.error();
  h.chunk_size = terms->chunk_size;
  h.ring_depth = terms->ring_depth;
  h.transport = terms->transport;
  h.transport_required = terms->transport_required;
  auto rails = transport::parse_rails(j, "rdmaRails", "hello");
  if (!rails) return rails.error();
  h.rdma_rails = std::move(rails.value());
  if (const auto v = j.find("failover"); v != j.end()) {
    if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.failover: expected a boolean"};
    h.failover = v->get<bool>();
  }
  return h;
}

std::string flow_proof(const std::string& token, const std::string& role, const FlowHello& hello,
                       const std::string& target_nonce) {
  return hmac_sha256_hex(token, "rdmig-flow-proof\n" + role + "\n" + hello.nonce + "\n" + target_nonce + "\n" +
                                    hello.to_json().dump());
}

std::string flow_session_key(const std::string& token, const FlowHello& hello, const std::string& target_nonce) {
  return transport::derive_session_key(token, "rdmig-flow-key", hello.nonce, target_nonce, hello.session);
}

std::string flow_channel_key(const std::string& token, const FlowHello& hello, const std::string& target_nonce) {
  return transport::channel_key(token, hello.nonce, target_nonce, hello.session);
}

json FlowDataHello::to_json() const {
  json j{{"kind", session::to_string(session::HelloKind::kFlowData)}, {"protocol", kFlowProtocolVersion}, {"session", session}, {"index", index}};
  if (!nonce.empty()) j["nonce"] = nonce;
  if (tls) j["tls"] = true;
  if (resume) j["resume"] = true;
  return j;
}

Result<FlowDataHello> FlowDataHello::parse(const json& j) {
  using transport::get_string;
  using transport::get_uint;
  auto proto = session::check_hello_protocol(j, session::Purpose::kFlow);
  if (!proto) return proto.error();
  FlowDataHello h;
  auto session = get_string(j, "session", "hello", 32);
  if (!session) return session.error();
  if (session->size() != 32 || !is_hex(session.value())) {
    return Error{Errc::kInvalidArgument, "hello.session: must be 32 lowercase hex characters"};
  }
  h.session = session.value();
  auto index = get_uint(j, "index", "hello", 0, transport::kMaxChannels - 1);
  if (!index) return index.error();
  h.index = static_cast<uint32_t>(index.value());
  auto nonce = get_string(j, "nonce", "hello", transport::kChannelNonceChars);
  if (!nonce) return nonce.error();
  h.nonce = nonce.value();
  if (const auto v = j.find("tls"); v != j.end()) {
    if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.tls: expected a boolean"};
    h.tls = v->get<bool>();
  }
  if (const auto v = j.find("resume"); v != j.end()) {
    if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.resume: expected a boolean"};
    h.resume = v->get<bool>();
  }
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
