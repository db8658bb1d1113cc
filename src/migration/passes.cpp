#include "migration/passes.h"

#include <algorithm>

namespace rdmig::migration {

uint64_t PassCounter::observe(const qemu::MigrationInfo& info) {
  if (info.dirty_sync_count == 0 || info.total_bytes == 0 || info.page_size == 0) return info.dirty_sync_count;
  const uint64_t sent = info.normal_pages + info.duplicate_pages;
  if (need_pages_ == 0 && rounds_done_ == 0) need_pages_ = info.total_bytes / info.page_size;  // the first pass
  if (need_pages_ > 0 && sent >= base_pages_ && sent - base_pages_ >= need_pages_ - need_pages_ / 100) {
    ++rounds_done_;
    base_pages_ = sent;
    need_pages_ = info.remaining_bytes / info.page_size;  // 0: nothing left, no further round counted
  }
  return std::min(info.dirty_sync_count, 1 + rounds_done_);
}

}  // namespace rdmig::migration
