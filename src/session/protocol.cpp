#include "session/protocol.h"

#include <array>
#include <utility>

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

bool offers_postcopy_switch_agreement(const json& message) {
  if (!message.is_object()) return false;
  const auto it = message.find(kPostcopySwitchAgreementField);
  return it != message.end() && it->is_boolean() && it->get<bool>();
}

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

HelloKind as_migration(HelloKind kind) {
  if (kind == HelloKind::kPathcheckControl) return HelloKind::kControl;
  if (kind == HelloKind::kPathcheckData) return HelloKind::kData;
  return kind;
}

HelloKind as_pathcheck(HelloKind kind) {
  if (kind == HelloKind::kControl) return HelloKind::kPathcheckControl;
  if (kind == HelloKind::kData) return HelloKind::kPathcheckData;
  return kind;
}

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
