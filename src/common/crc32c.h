// CRC32C (Castagnoli, the polynomial of iSCSI, ext4 and NVMe/TCP data digests): the end-to-end
// check of a chunk when a migration asks for verifyChunks. SSE4.2's crc32 instruction when the
// CPU has it, a table otherwise; both give the same value.
#pragma once

#include <cstdint>
#include <span>

namespace rdmig {

// The CRC32C of `data` continued from `crc` (0 to start; pass the last result to continue).
uint32_t crc32c(std::span<const std::byte> data, uint32_t crc = 0);

// The table-driven version, exposed so tests can hold the fast path to it.
uint32_t crc32c_portable(std::span<const std::byte> data, uint32_t crc = 0);

}  // namespace rdmig
