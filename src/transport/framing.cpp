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
  std::unique_lock lock(mu_);
  bool waited = false;
  while (credits_ == 0 && !aborted_) {
    waited = true;
    ++waiters_;
    cv_.wait(lock);
    --waiters_;
  }
  if (aborted_) return *aborted_;
  --credits_;
  return waited;
}

Status CreditGate::give(uint32_t n) {
  std::lock_guard lock(mu_);
  if (static_cast<uint64_t>(credits_) + n > depth_) {
    return Error{Errc::kProtocol, "peer returned more credits than slots (" +
                                      std::to_string(credits_ + n) + " > " + std::to_string(depth_) + ")"};
  }
  credits_ += n;
  cv_.notify_all();
  return ok_status();
}

void CreditGate::untake() {
  std::lock_guard lock(mu_);
  if (credits_ < depth_) ++credits_;
  cv_.notify_all();
}

Status CreditGate::wait_all() {
  std::unique_lock lock(mu_);
  ++waiters_;
  cv_.wait(lock, [&] { return credits_ == depth_ || aborted_.has_value(); });
  --waiters_;
  if (credits_ == depth_) return ok_status();
  return *aborted_;
}

void CreditGate::abort(const Error& reason) {
  std::lock_guard lock(mu_);
  if (!aborted_) aborted_ = reason;
  cv_.notify_all();
}

uint32_t CreditGate::waiters() const {
  std::lock_guard lock(mu_);
  return waiters_;
}

uint32_t CreditGate::available() const {
  std::lock_guard lock(mu_);
  return credits_;
}

}  // namespace rdmig::transport
