#include "transport/wire.h"

#include <poll.h>

#include <array>

#include "common/hmac.h"
#include "common/net.h"
#include "common/units.h"
#include "common/json_limits.h"
#include "transport/channel_proof.h"
#include "session/protocol.h"

namespace rdmig::transport {

using nlohmann::json;

// The version is the codec's (session/protocol.h); this header keeps its name for its callers.
static_assert(kProtocolVersion == session::kDataPlaneProtocol);

Status send_message(int fd, const json& message) {
  // Invalid UTF-8 (a peer's field echoed in a reject) is replaced, never thrown.
  const std::string body = message.dump(-1, ' ', false, json::error_handler_t::replace);
  if (body.size() > kMaxMessageBytes) return Error{Errc::kInternal, "control message too large"};
  std::array<std::byte, 4> len{};
  const auto n = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) len[static_cast<size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  iovec iov[2] = {{len.data(), len.size()}, {const_cast<char*>(body.data()), body.size()}};
  return net::writev_all(fd, iov, 2);
}

void send_reject(int fd, const std::string& code, const std::string& message) {
  (void)send_message(fd, session::message(session::MessageKind::kReject, json{{"code", code}, {"message", message}}));
}

Result<json> recv_message(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto wait = [&]() -> Status {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::max<long>(0, left.count())));
    if (rc == 0) return Error{Errc::kTimeout, "no control message within " + std::to_string(timeout.count()) + " ms"};
    if (rc < 0 && errno != EINTR) return errno_error("poll", errno);
    return ok_status();
  };
  RDMIG_TRY(wait());
  std::array<std::byte, 4> len{};
  auto r = net::read_exact(fd, len);
  if (!r) return r.error();
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(len[static_cast<size_t>(i)]) << (8 * i);
  if (n == 0 || n > kMaxMessageBytes) {
    return Error{Errc::kProtocol, "control message length " + std::to_string(n) + " out of range"};
  }
  std::string body(n, '\0');
  RDMIG_TRY(wait());
  auto b = net::read_exact(fd, std::as_writable_bytes(std::span(body.data(), body.size())));
  if (!b) return b.error();
  json j = parse_json_bounded(body);
  if (j.is_discarded() || !j.is_object()) {
    return Error{Errc::kProtocol, "control message is not a JSON object"};
  }
  return j;
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

Result<std::string> get_string(const json& j, const char* key, const std::string& where,
                               size_t max_len) {
  return session::get_string(j, key, where, max_len);
}

Result<uint64_t> get_uint(const json& j, const char* key, const std::string& where, uint64_t min,
                          uint64_t max) {
  return session::get_uint(j, key, where, min, max);
}

std::string control_proof(const std::string& token, const std::string& nonce, const std::string& migration_id,
                          const std::string& source_nonce) {
  return hmac_sha256_hex(token, "rdmig-control\n" + nonce + "\n" + migration_id + "\n" + source_nonce);
}

json rails_to_json(const std::vector<RailAddress>& rails) {
  json a = json::array();
  for (const auto& r : rails) {
    json j{{"rail", r.rail}, {"address", r.address}};
    if (r.mtu != 0) j["mtu"] = r.mtu;
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
    rails.push_back(RailAddress{static_cast<uint32_t>(rail.value()), address.value(), mtu});
  }
  return rails;
}

std::string tls_mismatch(bool source_on, bool target_on) {
  auto name = [](bool on) { return on ? "on" : "off"; };
  return std::string("dataPlane.tls mismatch: the source agent has it ") + name(source_on) + ", the target agent " +
         name(target_on) + " (both must agree; a channel is never carried in clear instead)";
}

json Hello::to_json() const {
  json j = session::message(session::MessageKind::kHello, json{{"protocol", protocol}, {"kind", kind}, {"migrationId", migration_id}});
  if (!nonce.empty()) j["nonce"] = nonce;
  if (tls) j["tls"] = true;
  if (kind == session::name(session::HelloKind::kControl)) {
    j["channels"] = channels;
    j["chunkSize"] = chunk_size;
    j["ringDepth"] = ring_depth;
    j["transport"] = transport;
    j["transportRequired"] = transport_required;
    if (rdma_mtu != 0) j["rdmaMtu"] = rdma_mtu;
    if (!rdma_rails.empty()) j["rdmaRails"] = rails_to_json(rdma_rails);
    if (verify_chunks) j["verifyChunks"] = true;
    if (failover) j["failover"] = true;
  } else {
    j["session"] = session;
    j["index"] = index;
    if (resume) j["resume"] = true;
    if (control) j["control"] = true;
    if (recover) j["recover"] = true;
  }
  return j;
}

Result<Hello> Hello::parse(const json& j) {
  Hello h;
  auto type = get_string(j, "type", "hello");
  if (!type) return type.error();
  if (type.value() != session::name(session::MessageKind::kHello)) return Error{Errc::kProtocol, "expected a hello, got '" + type.value() + "'"};
  auto protocol = session::check_hello_protocol(j, session::Purpose::kMigration);
  if (!protocol) return protocol.error();
  auto kind = get_string(j, "kind", "hello");
  if (!kind) return kind.error();
  h.kind = kind.value();
  auto id = get_string(j, "migrationId", "hello", 63);
  if (!id) return id.error();
  h.migration_id = id.value();
  auto nonce = get_string(j, "nonce", "hello", kChannelNonceChars);
  if (!nonce) return nonce.error();
  if (!is_channel_nonce(nonce.value())) {
    return Error{Errc::kInvalidArgument, "hello.nonce: must be 32 lowercase hex characters"};
  }
  h.nonce = nonce.value();
  if (const auto v = j.find("tls"); v != j.end()) {
    if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.tls: expected a boolean"};
    h.tls = v->get<bool>();
  }
  if (h.kind == session::name(session::HelloKind::kControl)) {
    auto ch = get_uint(j, "channels", "hello", 1, kMaxChannels);
    if (!ch) return ch.error();
    h.channels = static_cast<uint32_t>(ch.value());
    auto terms = parse_session_terms(j, "hello");
    if (!terms) return terms.error();
    h.chunk_size = terms->chunk_size;
    h.ring_depth = terms->ring_depth;
    h.transport = terms->transport;
    h.transport_required = terms->transport_required;
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
    if (const auto v = j.find("verifyChunks"); v != j.end()) {
      if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.verifyChunks: expected a boolean"};
      h.verify_chunks = v->get<bool>();
    }
    if (const auto v = j.find("failover"); v != j.end()) {
      if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.failover: expected a boolean"};
      h.failover = v->get<bool>();
    }
  } else if (h.kind == session::name(session::HelloKind::kData)) {
    if (const auto v = j.find("resume"); v != j.end()) {
      if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.resume: expected a boolean"};
      h.resume = v->get<bool>();
    }
    auto session = get_string(j, "session", "hello", 128);
    if (!session) return session.error();
    h.session = session.value();
    auto index = get_uint(j, "index", "hello", 0, kMaxChannels - 1);
    if (!index) return index.error();
    h.index = static_cast<uint32_t>(index.value());
    if (const auto v = j.find("recover"); v != j.end()) {
      if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.recover: expected a boolean"};
      h.recover = v->get<bool>();
      if (h.recover && h.resume) {
        return Error{Errc::kInvalidArgument, "hello.recover: a fresh connection of a post-copy recovery, never with resume"};
      }
    }
    if (const auto v = j.find("control"); v != j.end()) {
      if (!v->is_boolean()) return Error{Errc::kInvalidArgument, "hello.control: expected a boolean"};
      h.control = v->get<bool>();
      if (h.control && ((!h.resume && !h.recover) || h.index != 0)) {
        return Error{Errc::kInvalidArgument,
                     "hello.control: only a resume or a recovery of the control connection, with index 0"};
      }
    }
  } else {
    return Error{Errc::kInvalidArgument, "hello.kind: expected control or data, got '" + h.kind + "'"};
  }
  return h;
}

}  // namespace rdmig::transport
