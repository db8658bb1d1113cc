#include "common/chunk_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace rdmig {

ChunkMemory ChunkMemory::map(size_t bytes) {
  ChunkMemory m;
  if (bytes == 0) return m;
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t size = (bytes + page - 1) / page * page;
  const bool huge = size >= kHugePage;
  // For huge pages the start must be 2 MiB-aligned: map 2 MiB more and cut off both ends.
  const size_t length = huge ? size + kHugePage : size;
  // MAP_NORESERVE: a buffer is reserved for its worst case (whole chunks of chunkSize) and
  // touched only as far as chunks fill it (QEMU sends far less than 4 MiB at a time); the
  // kernel's overcommit heuristic would refuse a large one that is never filled. RLIMIT_AS
  // still applies.
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return m;
  auto* base = static_cast<std::byte*>(p);
  std::byte* data = base;
  if (huge) {
    const auto addr = reinterpret_cast<uintptr_t>(base);
    data = base + ((kHugePage - addr % kHugePage) % kHugePage);
    const size_t head = static_cast<size_t>(data - base);
    const size_t tail = length - head - size;
    if (head > 0) (void)::munmap(base, head);
    if (tail > 0) (void)::munmap(data + size, tail);
    // Advice only: a kernel without transparent huge pages (or with them "never") refuses it
    // and the buffer keeps small pages.
    (void)::madvise(data, size, MADV_HUGEPAGE);
  }
  m.data_ = data;
  m.size_ = size;
  return m;
}

void ChunkMemory::release() {
  if (data_ != nullptr) (void)::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace rdmig
