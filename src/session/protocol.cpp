#include "session/protocol.h"

#include <array>
#include <algorithm>
#include <utility>

#include "common/units.h"

namespace rdmig::session {

using nlohmann::json;

namespace {

// The wire names, indexed by the enums' values.
constexpr std::array<std::string_view, kMessageKinds> kMessageNames = {
    "hello",  "challenge", "auth", "welcome", "reject", "fallback", "fallback-ok", "start", "ready",     "ping",
    "pong",   "stream",    "result", "goodbye", "open", "end",      "stats",       "heartbeat", "abort",
    "resume", "resume-ok", "recover", "recover-ready", "postcopy-switch", "postcopy-switch-ok"};
static_assert(kMessageNames.size() == static_cast<size_t>(MessageKind::kPostcopySwitchOk) + 1);

constexpr std::array<std::string_view, 7> kHelloNames = {"control",   "data",      "pathcheck-control", "pathcheck-data",
                                                         "flow",      "flow-data", "probe"};
static_assert(kHelloNames.size() == static_cast<size_t>(HelloKind::kProbe) + 1);

}  // namespace

std::string_view name(MessageKind kind) { return kMessageNames[static_cast<size_t>(kind)]; }
std::string to_string(MessageKind kind) { return std::string(name(kind)); }

std::optional<MessageKind> parse_kind(std::string_view wire) {
  for (size_t i = 0; i < kMessageNames.size(); ++i) {
    if (kMessageNames[i] == wire) return static_cast<MessageKind>(i);
  }
  return std::nullopt;
}

std::optional<MessageKind> kind_of(const json& message) {
  if (!message.is_object()) return std::nullopt;
  const auto it = message.find("type");
  if (it == message.end() || !it->is_string()) return std::nullopt;
  return parse_kind(it->get_ref<const std::string&>());
}

bool is(const json& message, MessageKind kind) { return kind_of(message) == kind; }

json message(MessageKind kind, json fields) {
  if (!fields.is_object()) fields = json::object();
  fields["type"] = name(kind);
  return fields;
}

bool says(const json& message, const char* field) {
  if (!message.is_object()) return false;
  const auto it = message.find(field);
  return it != message.end() && it->is_boolean() && it->get<bool>();
}

bool offers_postcopy_switch_agreement(const json& message) { return says(message, kPostcopySwitchAgreementField); }

std::string_view name(HelloKind kind) { return kHelloNames[static_cast<size_t>(kind)]; }
std::string to_string(HelloKind kind) { return std::string(name(kind)); }

std::optional<HelloKind> parse_hello_kind(std::string_view wire) {
  for (size_t i = 0; i < kHelloNames.size(); ++i) {
    if (kHelloNames[i] == wire) return static_cast<HelloKind>(i);
  }
  return std::nullopt;
}

Purpose purpose_of(HelloKind kind) {
  switch (kind) {
    case HelloKind::kControl:
    case HelloKind::kData:
      return Purpose::kMigration;
    case HelloKind::kPathcheckControl:
    case HelloKind::kPathcheckData:
      return Purpose::kPathCheck;
    case HelloKind::kFlow:
    case HelloKind::kFlowData:
      return Purpose::kFlow;
    case HelloKind::kProbe:
      break;
  }
  return Purpose::kProbe;
}

std::string_view name(Purpose purpose) {
  switch (purpose) {
    case Purpose::kMigration:
      return "migration";
    case Purpose::kPathCheck:
      return "pathcheck";
    case Purpose::kFlow:
      return "flow";
    case Purpose::kProbe:
      break;
  }
  return "probe";
}

bool is_channel(HelloKind kind) {
  return kind == HelloKind::kData || kind == HelloKind::kPathcheckData || kind == HelloKind::kFlowData;
}

uint64_t protocol_of(Purpose purpose) { return purpose == Purpose::kFlow ? kFlowProtocol : kDataPlaneProtocol; }

Result<uint64_t> check_hello_protocol(const json& hello, Purpose purpose) {
  const uint64_t mine = protocol_of(purpose);
  if (purpose == Purpose::kFlow) {
    auto proto = get_uint(hello, "protocol", "hello", 0, 1000);
    if (!proto) return proto.error();
    if (proto.value() != mine) {
      return Error{Errc::kInvalidArgument,
                   "hello.protocol: this agent speaks " + std::to_string(mine) + ", got " + std::to_string(proto.value())};
    }
    return proto;
  }
  auto proto = get_uint(hello, "protocol", "hello", 1, 1000);
  if (!proto) return proto.error();
  if (proto.value() != mine) {
    return Error{Errc::kProtocol, "hello.protocol: peer speaks version " + std::to_string(proto.value()) +
                                      ", this agent " + std::to_string(mine)};
  }
  return proto;
}

Result<std::string> get_string(const json& j, const char* key, const std::string& where, size_t max_len) {
  const std::string field = where + "." + key;
  auto it = j.find(key);
  if (it == j.end()) return Error{Errc::kInvalidArgument, field + ": required"};
  if (!it->is_string()) return Error{Errc::kInvalidArgument, field + ": must be a string"};
  auto s = it->get<std::string>();
  if (s.size() > max_len) {
    return Error{Errc::kInvalidArgument, field + ": longer than " + std::to_string(max_len)};
  }
  return s;
}

Result<uint64_t> get_uint(const json& j, const char* key, const std::string& where, uint64_t min, uint64_t max) {
  const std::string field = where + "." + key;
  auto it = j.find(key);
  if (it == j.end()) return Error{Errc::kInvalidArgument, field + ": required"};
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0)) {
    return Error{Errc::kInvalidArgument, field + ": must be a non-negative integer"};
  }
  const auto v = it->get<uint64_t>();
  if (v < min || v > max) {
    return Error{Errc::kInvalidArgument, field + ": must be between " + std::to_string(min) + " and " +
                                             std::to_string(max) + ", got " + std::to_string(v)};
  }
  return v;
}

// --- Session terms and rails ----------------------------------------------------------------------

json rails_to_json(const std::vector<RailAddress>& rails) {
  json a = json::array();
  for (const auto& r : rails) {
    json j{{"rail", r.rail}, {"address", r.address}};
    if (r.mtu != 0) j["mtu"] = r.mtu;
    if (!r.alternates.empty()) {
      json alts = json::array();
      for (const auto& alt : r.alternates) alts.push_back(json{{"index", alt.index}, {"address", alt.address}});
      j["alternates"] = std::move(alts);
    }
    a.push_back(std::move(j));
  }
  return a;
}

Result<std::vector<RailAddress>> parse_rails(const json& j, const char* key, const std::string& where) {
  std::vector<RailAddress> rails;
  const auto it = j.find(key);
  if (it == j.end()) return rails;
  const std::string field = where + "." + key;
  if (!it->is_array() || it->size() > kMaxRails) {
    return Error{Errc::kInvalidArgument, field + ": expected a list of at most " + std::to_string(kMaxRails) + " rails"};
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const std::string item = field + "[" + std::to_string(i) + "]";
    const auto& r = (*it)[i];
    if (!r.is_object()) return Error{Errc::kInvalidArgument, item + ": expected an object"};
    auto rail = get_uint(r, "rail", item, 0, kMaxRails - 1);
    if (!rail) return rail.error();
    auto address = get_string(r, "address", item, 300);
    if (!address) return address.error();
    for (const auto& seen : rails) {
      if (seen.rail == rail.value()) return Error{Errc::kInvalidArgument, item + ".rail: rail " + std::to_string(seen.rail) + " listed twice"};
    }
    uint32_t mtu = 0;
    if (r.contains("mtu")) {
      auto m = get_uint(r, "mtu", item, 256, 4096);
      if (!m) return m.error();
      if ((m.value() & (m.value() - 1)) != 0) {
        return Error{Errc::kInvalidArgument, item + ".mtu: must be 256, 512, 1024, 2048 or 4096, got " +
                                                 std::to_string(m.value())};
      }
      mtu = static_cast<uint32_t>(m.value());
    }
    std::vector<AlternateAddress> alternates;
    if (const auto alts = r.find("alternates"); alts != r.end()) {
      const std::string list = item + ".alternates";
      if (!alts->is_array() || alts->size() > kMaxRailAlternates) {
        return Error{Errc::kInvalidArgument, list + ": expected a list of at most " +
                                                 std::to_string(kMaxRailAlternates) + " addresses"};
      }
      for (size_t k = 0; k < alts->size(); ++k) {
        const std::string entry = list + "[" + std::to_string(k) + "]";
        const auto& a = (*alts)[k];
        if (!a.is_object()) return Error{Errc::kInvalidArgument, entry + ": expected an object"};
        auto index = get_uint(a, "index", entry, 0, kMaxRailAlternates - 1);
        if (!index) return index.error();
        auto endpoint = get_string(a, "address", entry, 300);
        if (!endpoint) return endpoint.error();
        for (const auto& seen : alternates) {
          if (seen.index == index.value()) {
            return Error{Errc::kInvalidArgument, entry + ".index: alternate " + std::to_string(seen.index) + " listed twice"};
          }
        }
        alternates.push_back(AlternateAddress{static_cast<uint32_t>(index.value()), endpoint.value()});
      }
    }
    rails.push_back(RailAddress{static_cast<uint32_t>(rail.value()), address.value(), mtu, std::move(alternates)});
  }
  return rails;
}

Result<SessionTerms> parse_session_terms(const json& j, const std::string& where) {
  SessionTerms t;
  auto cs = get_uint(j, "chunkSize", where, kMinChunkSize, kMaxChunkSize);
  if (!cs) return cs.error();
  RDMIG_TRY(validate_chunk_size(cs.value(), where + ".chunkSize"));
  t.chunk_size = cs.value();
  auto depth = get_uint(j, "ringDepth", where, 2, 1024);
  if (!depth) return depth.error();
  t.ring_depth = static_cast<uint32_t>(depth.value());
  auto tr = get_string(j, "transport", where, 16);
  if (!tr) return tr.error();
  if (tr.value() != "tcp" && tr.value() != "rdma") {
    return Error{Errc::kInvalidArgument, where + ".transport: unknown transport '" + tr.value() + "'"};
  }
  t.transport = tr.value();
  if (auto req = j.find("transportRequired"); req != j.end()) {
    if (!req->is_boolean()) return Error{Errc::kInvalidArgument, where + ".transportRequired: must be a boolean"};
    t.transport_required = req->get<bool>();
  }
  return t;
}

// --- The hello -------------------------------------------------------------------------------------

namespace {

constexpr size_t kHexIdChars = 32;  // a session id or a nonce: 32 lowercase hex characters

bool is_hex_id(const std::string& s) {
  return s.size() == kHexIdChars &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// An optional boolean field: false when absent; errors name "hello.<key>".
Status read_flag(const json& j, const char* key, bool& out) {
  const auto v = j.find(key);
  if (v == j.end()) return ok_status();
  if (!v->is_boolean()) return Error{Errc::kInvalidArgument, std::string("hello.") + key + ": expected a boolean"};
  out = v->get<bool>();
  return ok_status();
}

void set_terms(Hello& h, const SessionTerms& t) {
  h.chunk_size = t.chunk_size;
  h.ring_depth = t.ring_depth;
  h.transport = t.transport;
  h.transport_required = t.transport_required;
}

// control, data, pathcheck-control, pathcheck-data: {"type":"hello", ...}.
Result<Hello> parse_data_plane(const json& j, Purpose purpose) {
  Hello h;
  auto type = get_string(j, "type", "hello");
  if (!type) return type.error();
  if (type.value() != name(MessageKind::kHello)) return Error{Errc::kProtocol, "expected a hello, got '" + type.value() + "'"};
  auto protocol = check_hello_protocol(j, purpose);
  if (!protocol) return protocol.error();
  h.protocol = protocol.value();
  auto kind_name = get_string(j, "kind", "hello");
  if (!kind_name) return kind_name.error();
  const HelloKind control = purpose == Purpose::kPathCheck ? HelloKind::kPathcheckControl : HelloKind::kControl;
  const HelloKind data = purpose == Purpose::kPathCheck ? HelloKind::kPathcheckData : HelloKind::kData;
  const auto kind = parse_hello_kind(kind_name.value());
  if (kind != control && kind != data) {
    return Error{Errc::kInvalidArgument, "hello.kind: expected " + to_string(control) + " or " + to_string(data) +
                                             ", got '" + kind_name.value() + "'"};
  }
  h.kind = *kind;
  auto id = get_string(j, "migrationId", "hello", 63);
  if (!id) return id.error();
  h.migration_id = id.value();
  auto nonce = get_string(j, "nonce", "hello", kHexIdChars);
  if (!nonce) return nonce.error();
  if (!is_hex_id(nonce.value())) return Error{Errc::kInvalidArgument, "hello.nonce: must be 32 lowercase hex characters"};
  h.nonce = nonce.value();
  RDMIG_TRY(read_flag(j, "tls", h.tls));
  if (h.kind == control) {
    auto ch = get_uint(j, "channels", "hello", 1, kMaxChannels);
    if (!ch) return ch.error();
    h.channels = static_cast<uint32_t>(ch.value());
    auto terms = parse_session_terms(j, "hello");
    if (!terms) return terms.error();
    set_terms(h, terms.value());
    if (j.contains("rdmaMtu")) {
      auto mtu = get_uint(j, "rdmaMtu", "hello", 256, 4096);
      if (!mtu) return mtu.error();
      if ((mtu.value() & (mtu.value() - 1)) != 0) {
        return Error{Errc::kInvalidArgument, "hello.rdmaMtu: must be 256, 512, 1024, 2048 or 4096, got " +
                                                 std::to_string(mtu.value())};
      }
      h.rdma_mtu = static_cast<uint32_t>(mtu.value());
    }
    auto rails = parse_rails(j, "rdmaRails", "hello");
    if (!rails) return rails.error();
    h.rdma_rails = std::move(rails.value());
    RDMIG_TRY(read_flag(j, "verifyChunks", h.verify_chunks));
    RDMIG_TRY(read_flag(j, "failover", h.failover));
    RDMIG_TRY(read_flag(j, "postCopyPreempt", h.post_copy_preempt));
    return h;
  }
  RDMIG_TRY(read_flag(j, "resume", h.resume));
  auto session = get_string(j, "session", "hello", 128);
  if (!session) return session.error();
  h.session = session.value();
  auto index = get_uint(j, "index", "hello", 0, kMaxChannels - 1);
  if (!index) return index.error();
  h.index = static_cast<uint32_t>(index.value());
  RDMIG_TRY(read_flag(j, "recover", h.recover));
  if (h.recover && h.resume) {
    return Error{Errc::kInvalidArgument, "hello.recover: a fresh connection of a post-copy recovery, never with resume"};
  }
  RDMIG_TRY(read_flag(j, "control", h.control));
  if (h.control && ((!h.resume && !h.recover) || h.index != 0)) {
    return Error{Errc::kInvalidArgument, "hello.control: only a resume or a recovery of the control connection, with index 0"};
  }
  return h;
}

// flow, flow-data: {"kind", "protocol", ...} without a "type".
Result<Hello> parse_flow(const json& j) {
  Hello h;
  auto proto = check_hello_protocol(j, Purpose::kFlow);
  if (!proto) return proto.error();
  h.protocol = proto.value();
  auto kind_name = get_string(j, "kind", "hello");
  if (!kind_name) return kind_name.error();
  const auto kind = parse_hello_kind(kind_name.value());
  if (kind != HelloKind::kFlow && kind != HelloKind::kFlowData) {
    return Error{Errc::kInvalidArgument, "hello.kind: expected flow or flow-data, got '" + kind_name.value() + "'"};
  }
  h.kind = *kind;
  if (h.kind == HelloKind::kFlowData) {
    auto session = get_string(j, "session", "hello", kHexIdChars);
    if (!session) return session.error();
    if (!is_hex_id(session.value())) return Error{Errc::kInvalidArgument, "hello.session: must be 32 lowercase hex characters"};
    h.session = session.value();
    auto index = get_uint(j, "index", "hello", 0, kMaxChannels - 1);
    if (!index) return index.error();
    h.index = static_cast<uint32_t>(index.value());
    // The channel proof (transport/channel_proof.h) checks the nonce's form.
    auto nonce = get_string(j, "nonce", "hello", kHexIdChars);
    if (!nonce) return nonce.error();
    h.nonce = nonce.value();
    RDMIG_TRY(read_flag(j, "tls", h.tls));
    RDMIG_TRY(read_flag(j, "resume", h.resume));
    // A flow's control link re-dialled to fail it over (docs/failover.md): no TLS, index 0.
    RDMIG_TRY(read_flag(j, "control", h.control));
    if (h.control && (!h.resume || h.index != 0 || h.tls)) {
      return Error{Errc::kInvalidArgument, "hello.control: only a resume of the control link, with index 0 and no tls"};
    }
    return h;
  }
  for (auto [key, out] : {std::pair{"session", &h.session}, std::pair{"nonce", &h.nonce}}) {
    auto v = get_string(j, key, "hello", kHexIdChars);
    if (!v) return v.error();
    if (!is_hex_id(v.value())) {
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
    auto vname = get_string(*v, "name", "hello.vmi", 253);
    auto vuid = get_string(*v, "uid", "hello.vmi", 128);
    if (!ns) return ns.error();
    if (!vname) return vname.error();
    if (!vuid) return vuid.error();
    h.vmi = VmiRef{ns.value(), vname.value(), vuid.value()};
  }
  auto terms = parse_session_terms(j, "hello");
  if (!terms) return terms.error();
  set_terms(h, terms.value());
  auto rails = parse_rails(j, "rdmaRails", "hello");
  if (!rails) return rails.error();
  h.rdma_rails = std::move(rails.value());
  RDMIG_TRY(read_flag(j, "failover", h.failover));
  return h;
}

}  // namespace

json Hello::to_json() const {
  const uint64_t version = protocol != 0 ? protocol : protocol_of(purpose());
  json j{{"kind", name(kind)}, {"protocol", version}};
  switch (kind) {
    case HelloKind::kProbe:
      return j;
    case HelloKind::kFlow:
      j["session"] = session;
      j["nonce"] = nonce;
      j["mode"] = mode;
      j["migrationUid"] = migration_uid;
      j["sourceNode"] = source_node;
      j["targetNode"] = target_node;
      j["chunkSize"] = chunk_size;
      j["ringDepth"] = ring_depth;
      j["transport"] = transport;
      j["transportRequired"] = transport_required;
      if (!vmi.name.empty()) j["vmi"] = json{{"namespace", vmi.namespace_}, {"name", vmi.name}, {"uid", vmi.uid}};
      if (!rdma_rails.empty()) j["rdmaRails"] = rails_to_json(rdma_rails);
      if (failover) j["failover"] = true;
      return j;
    case HelloKind::kFlowData:
      j["session"] = session;
      j["index"] = index;
      if (!nonce.empty()) j["nonce"] = nonce;
      if (tls) j["tls"] = true;
      if (resume) j["resume"] = true;
      if (control) j["control"] = true;
      return j;
    case HelloKind::kControl:
    case HelloKind::kPathcheckControl:
    case HelloKind::kData:
    case HelloKind::kPathcheckData:
      break;
  }
  j["type"] = name(MessageKind::kHello);
  j["migrationId"] = migration_id;
  if (!nonce.empty()) j["nonce"] = nonce;
  if (tls) j["tls"] = true;
  if (kind == HelloKind::kControl || kind == HelloKind::kPathcheckControl) {
    j["channels"] = channels;
    j["chunkSize"] = chunk_size;
    j["ringDepth"] = ring_depth;
    j["transport"] = transport;
    j["transportRequired"] = transport_required;
    if (rdma_mtu != 0) j["rdmaMtu"] = rdma_mtu;
    if (!rdma_rails.empty()) j["rdmaRails"] = rails_to_json(rdma_rails);
    if (verify_chunks) j["verifyChunks"] = true;
    if (failover) j["failover"] = true;
    if (post_copy_preempt) j["postCopyPreempt"] = true;
  } else {
    j["session"] = session;
    j["index"] = index;
    if (resume) j["resume"] = true;
    if (control) j["control"] = true;
    if (recover) j["recover"] = true;
  }
  return j;
}

Hello channel_hello(HelloKind kind, std::string migration_id, std::string session, uint32_t index, bool tls,
                    bool resume) {
  Hello h;
  h.kind = kind;
  h.migration_id = std::move(migration_id);
  h.session = std::move(session);
  h.index = index;
  h.tls = tls;
  h.resume = resume;
  return h;
}

Result<Hello> Hello::parse(const json& j, Purpose purpose) {
  if (!j.is_object()) return Error{Errc::kProtocol, "expected a hello"};
  switch (purpose) {
    case Purpose::kMigration:
    case Purpose::kPathCheck:
      return parse_data_plane(j, purpose);
    case Purpose::kFlow:
      return parse_flow(j);
    case Purpose::kProbe:
      break;
  }
  Hello h;
  h.kind = HelloKind::kProbe;
  auto proto = check_hello_protocol(j, Purpose::kProbe);
  if (!proto) return proto.error();
  h.protocol = proto.value();
  return h;
}

json Challenge::to_json() const {
  json j = message(MessageKind::kChallenge, json{{"nonce", nonce}});
  if (!proofs.empty()) j["proofs"] = proofs;
  return j;
}

Result<Challenge> Challenge::parse(const json& j, size_t max_nonce) {
  if (!is(j, MessageKind::kChallenge)) {
    return Error{Errc::kProtocol, "expected a challenge"};
  }
  Challenge c;
  auto nonce = get_string(j, "nonce", "challenge", max_nonce);
  if (!nonce) return nonce.error();
  c.nonce = std::move(nonce.value());
  // Through the array itself: nlohmann's iterators make GCC warn of a null dereference.
  const auto* proofs = j.contains("proofs") ? j["proofs"].get_ptr<const json::array_t*>() : nullptr;
  if (proofs != nullptr && proofs->size() <= kMaxChallengeProofs) {
    for (const auto& p : *proofs) {
      if (const auto* s = p.get_ptr<const std::string*>()) c.proofs.push_back(*s);
    }
  }
  return c;
}

json Auth::to_json() const { return message(MessageKind::kAuth, json{{field, mac}}); }

Result<Auth> Auth::parse(const json& j, const char* field) {
  auto mac = get_string(j, field, "auth", 64);
  if (!mac) return mac.error();
  if (!is(j, MessageKind::kAuth)) return Error{Errc::kInvalidArgument, std::string("auth.") + field + ": required"};
  return Auth{field, std::move(mac.value())};
}

json Reject::to_json() const {
  json j = session::message(MessageKind::kReject, json{{"message", message}});
  if (!code.empty()) j["code"] = code;
  return j;
}

Reject Reject::from(const json& j) {
  Reject r;
  r.message = "?";
  if (!j.is_object()) return r;
  if (const auto c = j.find("code"); c != j.end() && c->is_string()) r.code = c->get<std::string>();
  if (const auto m = j.find("message"); m != j.end() && m->is_string()) r.message = m->get<std::string>();
  return r;
}

json Fallback::to_json() const {
  return message(MessageKind::kFallback, json{{"transport", transport}, {"error", error}});
}

}  // namespace rdmig::session
