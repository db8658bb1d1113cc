// Memory for chunk buffers: anonymous mappings of their own, given back to the system when
// freed (an agent's memory falls back after each migration instead of staying in malloc's
// arenas), and backed by transparent huge pages where a mapping spans 2 MiB (MADV_HUGEPAGE):
// a 4 MiB chunk buffer is then faulted in with 2 page faults rather than 1024. A profile of the
// relay (bench/relay_floor.py, 9 channels, 4 MiB chunks, the KubeVirt path) counted 47,000 page
// faults per GiB for rdmig against the floor relay's 21,000: the first touch of each receive
// slot, at a trap each on a paravirtualised machine (2,800 with this). Nothing is touched here:
// pages come when written, as with malloc.
#pragma once

#include <cstddef>
#include <utility>

namespace rdmig {

class ChunkMemory {
 public:
  // Mappings of at least this many bytes are 2 MiB-aligned and advised for huge pages.
  static constexpr size_t kHugePage = size_t{2} << 20;

  ChunkMemory() = default;
  // `bytes` > 0. Empty when the system refuses the mapping (errno set: ENOMEM under an
  // address-space limit, for instance).
  static ChunkMemory map(size_t bytes);
  ~ChunkMemory() { release(); }
  ChunkMemory(ChunkMemory&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  ChunkMemory& operator=(ChunkMemory&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ChunkMemory(const ChunkMemory&) = delete;
  ChunkMemory& operator=(const ChunkMemory&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }
  // True when the mapping was advised for huge pages (whether the kernel gives them is its
  // choice: transparent_hugepage "never" gives none).
  bool huge() const { return size_ >= kHugePage; }

 private:
  void release();
  std::byte* data_ = nullptr;  // the mapping: size_ bytes, page-aligned (2 MiB-aligned when huge)
  size_t size_ = 0;
};

}  // namespace rdmig
