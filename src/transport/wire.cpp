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

std::string tls_mismatch(bool source_on, bool target_on) {
  auto name = [](bool on) { return on ? "on" : "off"; };
  return std::string("dataPlane.tls mismatch: the source agent has it ") + name(source_on) + ", the target agent " +
         name(target_on) + " (both must agree; a channel is never carried in clear instead)";
}

}  // namespace rdmig::transport
