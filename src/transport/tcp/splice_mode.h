// Whether TCP channels move payload between QEMU's socket and the peer with splice(2)
// (through a pipe, without copying it through user space) or copy it through a buffer.
// Header-only: the agent's config (config/) names it without linking the transport.
#pragma once

#include <optional>
#include <string_view>

namespace rdmig::transport {

enum class SpliceMode {
  kAuto,  // splice where the kernel can for the sockets at hand, else copy (logged once)
  kOn,    // splice or fail the migration (naming the socket that could not)
  kOff,   // copy through user space, as before splice existed
};

inline const char* splice_mode_name(SpliceMode m) {
  switch (m) {
    case SpliceMode::kAuto: return "auto";
    case SpliceMode::kOn: return "on";
    case SpliceMode::kOff: return "off";
  }
  return "?";
}

inline std::optional<SpliceMode> parse_splice_mode(std::string_view text) {
  if (text == "auto") return SpliceMode::kAuto;
  if (text == "on") return SpliceMode::kOn;
  if (text == "off") return SpliceMode::kOff;
  return std::nullopt;
}

}  // namespace rdmig::transport
