#include "transport/rdma/cm.h"

#include <poll.h>

#include <algorithm>
#include <cstring>

#include "common/units.h"

namespace rdmig::transport::rdma {

namespace {
template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<uint8_t>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}
template <typename T>
T get(const std::vector<uint8_t>& in, size_t& pos) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(in[pos + i]) << (8 * i);
  pos += sizeof(T);
  return static_cast<T>(v);
}
}  // namespace

Error verbs_error(const std::string& what, int err) {
  auto e = errno_error(what, err);
  e.code = Errc::kUnavailable;
  return e;
}

Result<CmEvent> next_cm_event(rdma_event_channel* channel, std::chrono::milliseconds timeout,
                              const std::function<bool()>& cancelled) {
  pollfd p{channel->fd, POLLIN, 0};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int rc = 0;
  for (;;) {
    if (cancelled && cancelled()) return Error{Errc::kCancelled, "cancelled while waiting for an rdma_cm event"};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    // With a cancel check, wait in slices of 100 ms so a cancel ends the wait promptly.
    const auto slice = cancelled ? std::min(left, std::chrono::milliseconds(100)) : left;
    rc = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(slice.count(), 0)));
    if (rc != 0 || std::chrono::steady_clock::now() >= deadline) break;
  }
  if (rc == 0) return Error{Errc::kTimeout, "no rdma_cm event within " + std::to_string(timeout.count()) + " ms"};
  if (rc < 0) return errno_error("poll(rdma_cm)", errno);
  rdma_cm_event* ev = nullptr;
  if (rdma_get_cm_event(channel, &ev) != 0) return errno_error("rdma_get_cm_event", errno);
  CmEvent out;
  out.type = ev->event;
  out.status = ev->status;
  out.id = ev->id;
  if (ev->param.conn.private_data && ev->param.conn.private_data_len > 0) {
    const auto* p8 = static_cast<const uint8_t*>(ev->param.conn.private_data);
    out.private_data.assign(p8, p8 + ev->param.conn.private_data_len);
  }
  rdma_ack_cm_event(ev);
  return out;
}

Result<CmEvent> expect_cm_event(rdma_event_channel* channel, rdma_cm_event_type want,
                                std::chrono::milliseconds timeout, const std::string& what,
                                const std::function<bool()>& cancelled) {
  auto ev = next_cm_event(channel, timeout, cancelled);
  if (!ev) return ev.error().with_context(what);
  if (ev->type != want) {
    return Error{Errc::kUnavailable, what + ": expected " + rdma_event_str(want) + ", got " +
                                         rdma_event_str(ev->type) + " (status " + std::to_string(ev->status) +
                                         (ev->status < 0 ? std::string(": ") + std::strerror(-ev->status) : "") + ")"};
  }
  return ev;
}

namespace {
Status check_header(const std::vector<uint8_t>& raw, size_t& pos, const char* what, size_t need) {
  // rdma_cm may pad private data with zeros: at least our size, and the version first, so an
  // older agent's shorter request is refused naming the versions, not its length.
  if (raw.size() < 6) return Error{Errc::kProtocol, std::string(what) + ": private data too short"};
  if (get<uint32_t>(raw, pos) != kPrivateMagic) return Error{Errc::kProtocol, std::string(what) + ": not from rdmig"};
  if (const auto v = get<uint16_t>(raw, pos); v != kPrivateVersion) {
    return Error{Errc::kProtocol, std::string(what) + ": private data version " + std::to_string(v) +
                                      ", this agent speaks " + std::to_string(kPrivateVersion) +
                                      " (upgrade both agents)"};
  }
  if (raw.size() < need) return Error{Errc::kProtocol, std::string(what) + ": private data too short"};
  return ok_status();
}

ChannelTerms terms_of(const ConnectRequest& r, const std::string& key) {
  return ChannelTerms{key, to_hex(r.session.data(), r.session.size()), r.index};
}

std::string request_fresh(const ConnectRequest& r) {
  return "rdma " + std::to_string(r.ring_addr) + " " + std::to_string(r.ring_rkey) + " " + std::to_string(r.nonce);
}

Proof truncated(const std::array<uint8_t, 32>& mac) {
  Proof p{};
  std::copy_n(mac.begin(), p.size(), p.begin());
  return p;
}

Proof request_proof(const ConnectRequest& r, const std::string& key) {
  return truncated(channel_mac(terms_of(r, key), ProofBy::kDialler, request_fresh(r)));
}

Proof reply_proof(const ConnectReply& rep, const ConnectRequest& r, const std::string& key) {
  return truncated(channel_mac(terms_of(r, key), ProofBy::kAcceptor,
                               request_fresh(r) + " " + std::to_string(rep.ring_addr) + " " +
                                   std::to_string(rep.ring_rkey)));
}
}  // namespace

std::vector<uint8_t> ConnectRequest::encode() const {
  std::vector<uint8_t> out;
  put(out, kPrivateMagic);
  put(out, kPrivateVersion);
  put(out, index);
  out.insert(out.end(), session.begin(), session.end());
  put(out, ring_addr);
  put(out, ring_rkey);
  put(out, nonce);
  out.insert(out.end(), proof.begin(), proof.end());
  return out;
}

Result<ConnectRequest> ConnectRequest::decode(const std::vector<uint8_t>& raw) {
  size_t pos = 0;
  RDMIG_TRY(check_header(raw, pos, "rdma connect request", kConnectRequestBytes));
  ConnectRequest r;
  r.index = get<uint16_t>(raw, pos);
  std::memcpy(r.session.data(), raw.data() + pos, 16);
  pos += 16;
  r.ring_addr = get<uint64_t>(raw, pos);
  r.ring_rkey = get<uint32_t>(raw, pos);
  r.nonce = get<uint32_t>(raw, pos);
  std::memcpy(r.proof.data(), raw.data() + pos, r.proof.size());
  return r;
}

std::vector<uint8_t> ConnectReply::encode() const {
  std::vector<uint8_t> out;
  put(out, kPrivateMagic);
  put(out, kPrivateVersion);
  put(out, uint16_t{0});
  put(out, ring_addr);
  put(out, ring_rkey);
  out.insert(out.end(), proof.begin(), proof.end());
  return out;
}

Result<ConnectReply> ConnectReply::decode(const std::vector<uint8_t>& raw) {
  size_t pos = 0;
  RDMIG_TRY(check_header(raw, pos, "rdma connect reply", kConnectReplyBytes));
  pos += 2;
  ConnectReply r;
  r.ring_addr = get<uint64_t>(raw, pos);
  r.ring_rkey = get<uint32_t>(raw, pos);
  std::memcpy(r.proof.data(), raw.data() + pos, r.proof.size());
  return r;
}

void sign_request(ConnectRequest& request, const std::string& key) {
  uint32_t nonce = 0;
  const std::string hex = random_hex(sizeof nonce);
  for (char c : hex) nonce = nonce * 16 + static_cast<uint32_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  request.nonce = nonce;
  request.proof = request_proof(request, key);
}

Status check_request(const ConnectRequest& request, const std::string& key, ProofLedger& ledger) {
  const std::string what = "channel " + std::to_string(request.index) + ": ";
  if (!mac_equal(request.proof, request_proof(request, key))) {
    return Error{Errc::kUnauthenticated, what + "the connect request's proof does not prove the session's key"};
  }
  if (!ledger.first_use(request.proof)) {
    return Error{Errc::kUnauthenticated, what + "the connect request's proof was used before (a replay)"};
  }
  return ok_status();
}

void sign_reply(ConnectReply& reply, const ConnectRequest& request, const std::string& key) {
  reply.proof = reply_proof(reply, request, key);
}

Status check_reply(const ConnectReply& reply, const ConnectRequest& request, const std::string& key) {
  if (!mac_equal(reply.proof, reply_proof(reply, request, key))) {
    return Error{Errc::kPermissionDenied, "the target agent's connect reply does not prove the session's key"};
  }
  return ok_status();
}

Status set_tos(rdma_cm_id* id, int tos) {
  if (tos < 0) return ok_status();
  uint8_t value = static_cast<uint8_t>(tos);
  if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &value, sizeof value) != 0) {
    return verbs_error("rdma_set_option(RDMA_OPTION_ID_TOS, " + std::to_string(tos) + ")", errno);
  }
  return ok_status();
}

Result<std::array<uint8_t, 16>> session_from_hex(const std::string& hex) {
  if (hex.size() != 32) return Error{Errc::kInvalidArgument, "session: expected 32 hex characters"};
  std::array<uint8_t, 16> out{};
  for (size_t i = 0; i < 16; ++i) {
    auto nib = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    const int hi = nib(hex[2 * i]), lo = nib(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Error{Errc::kInvalidArgument, "session: not lower-case hex"};
    out[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return out;
}

}  // namespace rdmig::transport::rdma
