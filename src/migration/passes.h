#pragma once
// rdmig's count of pre-copy passes over guest memory (progress.passes; what postCopy "after" and
// postCopyAfterPasses act on).
//
// QEMU's ram.dirty-sync-count was that count up to QEMU 10.0: 1 during the first pass, 2 once all
// memory was sent once, and so on. QEMU 11.1 (trixie-backports; 10.1 not tried) with postcopy-ram on
// syncs its dirty bitmap about ten times a second within a pass (seen here: 4 after 250 ms, 82 over a
// migration of 8 s, where 10.0 counted 2 after 8 s), so that count no longer says when a pass ended.
//
// So rdmig also counts rounds from the pages QEMU accounts for (ram.normal + ram.duplicate: every
// page sent, or skipped as zero): the first pass ends once they reach the guest's pages, each later
// one once the pages sent since the last end reach what was left to send then (ram.remaining), both
// less 1% (QEMU 10.0 synced at 99.3% of the guest's pages). The passes are the smaller of QEMU's count
// and this one, so that on a QEMU whose count is right nothing switches earlier than before.
#include <cstdint>

#include "qemu/qmp_protocol.h"

namespace rdmig::migration {

class PassCounter {
 public:
  // One query-migrate of the source QEMU, in order; returns the passes so far (0 before QEMU counts).
  uint64_t observe(const qemu::MigrationInfo& info);

 private:
  uint64_t rounds_done_ = 0;  // full rounds over the pages QEMU had to send
  uint64_t base_pages_ = 0;   // pages accounted for when the round under way began
  uint64_t need_pages_ = 0;   // pages that round has to send (0: not begun)
};

}  // namespace rdmig::migration
