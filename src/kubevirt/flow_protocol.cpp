#include "kubevirt/flow_protocol.h"

#include "common/hmac.h"
#include "common/units.h"
#include "transport/wire.h"

namespace rdmig::kubevirt {

using nlohmann::json;

json FlowHello::to_json() const {
  json j{{"kind", "flow"},
         {"protocol", transport::kProtocolVersion},
         {"session", session},
         {"mode", mode},
         {"migrationUid", migration_uid},
         {"sourceNode", source_node},
         {"targetNode", target_node},
         {"chunkSize", chunk_size},
         {"ringDepth", ring_depth},
         {"transport", transport},
         {"transportRequired", transport_required}};
  if (!vmi.name.empty()) j["vmi"] = json{{"namespace", vmi.namespace_}, {"name", vmi.name}, {"uid", vmi.uid}};
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
  auto proto = get_uint(j, "protocol", "hello", 0, 1000);
  if (!proto) return proto.error();
  if (proto.value() != transport::kProtocolVersion) {
    return Error{Errc::kInvalidArgument, "hello.protocol: this agent speaks " +
                                             std::to_string(transport::kProtocolVersion) + ", got " +
                                             std::to_string(proto.value())};
  }
  auto session = get_string(j, "session", "hello", 32);
  if (!session) return session.error();
  if (session->size() != 32 || !is_hex(session.value())) {
    return Error{Errc::kInvalidArgument, "hello.session: must be 32 lowercase hex characters"};
  }
  h.session = session.value();
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
  return h;
}

std::string flow_mac(const std::string& token, const std::string& nonce, const std::string& session) {
  return hmac_sha256_hex(token, nonce + session);
}

}  // namespace rdmig::kubevirt
