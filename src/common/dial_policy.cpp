#include "common/dial_policy.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdint>

namespace rdmig::net {
namespace {

// A refused loopback address; `key`: the config key that would allow it ("" = none does).
std::string loopback_why(const char* range, const std::string& key) {
  return std::string("is loopback (") + range + ")" +
         (key.empty() ? std::string() : ", allowed only where " + key + " is true (a lab)");
}

// Why the IPv4 address `a` (host order) is refused; "" when it may be dialled.
std::string refused_v4(uint32_t a, bool allow_loopback, const std::string& loopback_key) {
  if (a == 0) return "is the unspecified address";
  if ((a >> 24) == 0) return "is in 0.0.0.0/8 (this network)";
  if ((a >> 24) == 127) return allow_loopback ? "" : loopback_why("127.0.0.0/8", loopback_key);
  if ((a >> 16) == 0xA9FE) return "is link-local (169.254.0.0/16, where cloud metadata services answer)";
  if ((a >> 28) == 0xE) return "is multicast (224.0.0.0/4)";
  if (a == 0xFFFFFFFFu) return "is the broadcast address";
  if ((a >> 28) == 0xF) return "is reserved (240.0.0.0/4)";
  return "";
}

uint32_t v4_at(const uint8_t* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

std::string v4_text(uint32_t a) {
  return std::to_string(a >> 24) + "." + std::to_string((a >> 16) & 0xFF) + "." + std::to_string((a >> 8) & 0xFF) +
         "." + std::to_string(a & 0xFF);
}

bool zero(const uint8_t* b, int from, int to) {
  return std::all_of(b + from, b + to, [](uint8_t x) { return x == 0; });
}

// The IPv4 address an IPv6 one stands for, and the form's name; nullptr when it embeds none.
const char* embedded_v4(const uint8_t* b, uint32_t& v4) {
  static constexpr uint8_t kNat64[12] = {0x00, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0};
  static constexpr uint8_t kNat64Local[6] = {0x00, 0x64, 0xff, 0x9b, 0x00, 0x01};
  auto at = [&](const uint8_t* p, const char* form) {
    v4 = v4_at(p);
    return form;
  };
  if (zero(b, 0, 10) && b[10] == 0xff && b[11] == 0xff) return at(b + 12, "IPv4-mapped, ::ffff:0:0/96");
  if (zero(b, 0, 8) && b[8] == 0xff && b[9] == 0xff && zero(b, 10, 12)) {
    return at(b + 12, "IPv4-translated, ::ffff:0:0:0/96");
  }
  if (zero(b, 0, 12)) return at(b + 12, "IPv4-compatible, ::/96");
  if (std::equal(kNat64, kNat64 + 12, b)) return at(b + 12, "NAT64, 64:ff9b::/96");
  if (std::equal(kNat64Local, kNat64Local + 6, b)) return at(b + 12, "local-use NAT64, 64:ff9b:1::/48");
  if (b[0] == 0x20 && b[1] == 0x02) return at(b + 2, "6to4, 2002::/16");
  return nullptr;
}

}  // namespace

Status DialPolicy::check(const std::string& host, const std::string& field) const {
  auto refuse = [&](const std::string& why) {
    return Error{Errc::kInvalidArgument, field + ": '" + host.substr(0, 64) + "' " + why +
                                             " (refused by the agent's dial policy, docs/security.md)"};
  };
  const std::string loopback_key = loopback_key_;
  in_addr v4{};
  in6_addr v6{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    const std::string why = refused_v4(ntohl(v4.s_addr), allow_loopback_, loopback_key);
    return why.empty() ? ok_status() : Status(refuse(why));
  }
  if (::inet_pton(AF_INET6, host.c_str(), &v6) != 1) {
    return refuse("is not an IP address literal (names are never resolved)");
  }
  const uint8_t* b = v6.s6_addr;
  if (zero(b, 0, 16)) return refuse("is the unspecified address (::)");
  if (zero(b, 0, 15) && b[15] == 1) {
    return allow_loopback_ ? ok_status() : Status(refuse(loopback_why("::1", loopback_key)));
  }
  if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80) return refuse("is link-local (fe80::/10)");
  if (b[0] == 0xff) return refuse("is multicast (ff00::/8)");
  uint32_t inner = 0;
  if (const char* form = embedded_v4(b, inner)) {
    const std::string why = refused_v4(inner, allow_loopback_, loopback_key);
    if (!why.empty()) return refuse("embeds " + v4_text(inner) + " (" + form + "), which " + why);
  }
  return ok_status();
}

Result<UniqueFd> DialPolicy::connect(const Endpoint& ep, const std::string& field, std::chrono::milliseconds timeout,
                                     const std::function<Status(int fd)>& prepare) const {
  if (auto st = check(ep.host, field); !st) return st.error();
  return tcp_connect(ep, timeout, prepare);
}

}  // namespace rdmig::net
