// How much of a guest's RAM its QEMU holds resident: the pages the guest (or QEMU) ever wrote.
// A page never written is sent as a zero-page marker, almost free, so an idle or young guest moves
// far less than its size: the drain forecast's memory input (docs/drain.md "Limits"). The RAM's
// size comes from QMP (query-memory-size-summary); the resident part from the Rss of QEMU's guest
// RAM mapping in /proc/<pid>/smaps, QEMU's pid from the QMP socket's peer credentials.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/result.h"
#include "qemu/qmp_client.h"

namespace rdmig::qemu {

// /proc/<pid>/smaps read at most this far (a QEMU's is some hundred KiB): a larger one is refused.
inline constexpr size_t kMaxSmapsBytes = size_t{8} << 20;
// QEMU maps a RAM block with its size plus alignment and guard pages: a mapping this much larger
// than the RAM's size still counts as the RAM.
inline constexpr uint64_t kRamMappingSlack = uint64_t{16} << 20;

struct GuestRam {
  uint64_t size = 0;      // base-memory (query-memory-size-summary), bytes
  uint64_t resident = 0;  // resident guest RAM, bytes (at most `size`)
  // Where `resident` comes from: "smaps" (the RAM mapping's Rss), or "status" where this agent may
  // not read QEMU's smaps (another user, or more capabilities than the agent's: the kernel's
  // ptrace rule; the chart's bare-QEMU agent holds none): QEMU's whole anonymous and shared
  // resident memory from /proc/<pid>/status, readable by all, an over-estimate by QEMU's own heap.
  std::string source;
};

// The Rss (bytes) of the mapping in `smaps` whose size is `ram_size` to `ram_size` plus
// kRamMappingSlack (the largest such mapping when there are several). Lines it does not know are
// skipped; a header or an Rss line it cannot read, or no such mapping, is an error naming it.
Result<uint64_t> ram_resident_from_smaps(std::string_view smaps, uint64_t ram_size);

// RssAnon plus RssShmem (bytes) of a /proc/<pid>/status; an error naming what does not read.
Result<uint64_t> resident_from_status(std::string_view status);

// The guest RAM of the QEMU behind `qmp` (its peer process): from its smaps where this agent may
// read them, else from its status (GuestRam::source).
Result<GuestRam> guest_ram(QmpClient& qmp);

}  // namespace rdmig::qemu
