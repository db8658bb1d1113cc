#include "transport/framing.h"

#include <string>

namespace rdmig::transport {
namespace {
void put_u32(std::byte* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
uint32_t get_u32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
}  // namespace

std::array<std::byte, kFrameHeaderSize> encode_frame_header(FrameHeader h) {
  std::array<std::byte, kFrameHeaderSize> raw{};
  put_u32(raw.data(), static_cast<uint32_t>(h.type));
  put_u32(raw.data() + 4, h.length);
  return raw;
}

Result<FrameHeader> decode_frame_header(const std::array<std::byte, kFrameHeaderSize>& raw,
                                        uint32_t chunk_size, uint32_t depth) {
  const uint32_t type = get_u32(raw.data());
  const uint32_t length = get_u32(raw.data() + 4);
  auto protocol = [](const std::string& m) { return Error{Errc::kProtocol, m}; };
  switch (static_cast<FrameType>(type)) {
    case FrameType::kData:
      if (length == 0 || length > chunk_size) {
        return protocol("data frame of " + std::to_string(length) + " bytes (chunk size " +
                        std::to_string(chunk_size) + ")");
      }
      break;
    case FrameType::kCredit:
      if (length == 0 || length > depth) {
        return protocol("credit frame returning " + std::to_string(length) + " slots (depth " +
                        std::to_string(depth) + ")");
      }
      break;
    case FrameType::kEof:
      if (length != 0) return protocol("eof frame with a payload");
      break;
    case FrameType::kAbort:
      if (length > kMaxAbortReason) return protocol("abort reason too long");
      break;
    default:
      return protocol("unknown frame type " + std::to_string(type));
  }
  return FrameHeader{static_cast<FrameType>(type), length};
}

Result<bool> CreditGate::take() {
  bool waited = false;
  uint32_t s = state_.load();
  for (;;) {
    if (s & kAborted) return abort_error();
    if (s != 0) {
      if (state_.compare_exchange_weak(s, s - 1)) return waited;
      continue;  // s reloaded
    }
    waited = true;
    // Counted before waiting: give() reads waiters_ after changing state_, and wait(0) returns
    // at once if state_ changed since it was read, so no credit or abort is missed between them.
    waiters_.fetch_add(1);
    state_.wait(0);
    waiters_.fetch_sub(1);
    s = state_.load();
  }
}

Status CreditGate::give(uint32_t n) {
  uint32_t s = state_.load();
  for (;;) {
    const uint32_t free = s & ~kAborted;
    if (static_cast<uint64_t>(free) + n > depth_) {
      return Error{Errc::kProtocol, "peer returned more credits than slots (" +
                                        std::to_string(static_cast<uint64_t>(free) + n) + " > " +
                                        std::to_string(depth_) + ")"};
    }
    if (state_.compare_exchange_weak(s, s + n)) break;  // s reloaded on failure
  }
  wake();
  return ok_status();
}

void CreditGate::untake() {
  uint32_t s = state_.load();
  while ((s & ~kAborted) < depth_ && !state_.compare_exchange_weak(s, s + 1)) {
  }
  wake();
}

void CreditGate::wake() {
  // Only a sender that waits is woken (a futex call per credit batch otherwise); no lock is held,
  // so the woken thread does not wake only to wait for one.
  if (waiters_.load() > 0) state_.notify_all();
}

Status CreditGate::wait_all() {
  uint32_t s = state_.load();
  while ((s & ~kAborted) != depth_ && !(s & kAborted)) {
    waiters_.fetch_add(1);
    state_.wait(s);
    waiters_.fetch_sub(1);
    s = state_.load();
  }
  if ((s & ~kAborted) == depth_) return ok_status();
  return abort_error();
}

void CreditGate::abort(const Error& reason) {
  {
    std::lock_guard lock(abort_mu_);
    if (!aborted_) aborted_ = reason;
  }
  state_.fetch_or(kAborted);
  state_.notify_all();
}

Error CreditGate::abort_error() const {
  std::lock_guard lock(abort_mu_);
  return *aborted_;
}

uint32_t CreditGate::waiters() const { return waiters_.load(); }

uint32_t CreditGate::available() const { return state_.load() & ~kAborted; }

}  // namespace rdmig::transport
