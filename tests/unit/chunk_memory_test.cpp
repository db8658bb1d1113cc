// ChunkMemory: real mappings of this process, read back from /proc/self/smaps.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <cstdio>
#include <string>

#include "common/chunk_memory.h"
#include "common/units.h"

using namespace rdmig;

namespace {

// The smaps entry of the mapping that holds `p` (neighbouring mappings with the same flags may
// have merged with it): its lines, or "" when no mapping holds it.
std::string smaps_entry(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line, entry;
  bool in = false;
  const auto at = reinterpret_cast<uintptr_t>(p);
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    char space = 0;
    const bool header = std::sscanf(line.c_str(), "%lx-%lx%c", &lo, &hi, &space) == 3 && space == ' ';
    if (header) {
      if (in) break;
      in = lo <= at && at < hi;
    }
    if (in) entry += line + "\n";
  }
  return entry;
}

// A numeric field of an smaps entry ("AnonHugePages:   2048 kB" gives 2048); -1 when absent.
long field_kb(const std::string& entry, const std::string& name) {
  const auto at = entry.find(name);
  if (at == std::string::npos) return -1;
  return std::strtol(entry.c_str() + at + name.size(), nullptr, 10);
}

bool thp_enabled() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  return !s.empty() && s.find("[never]") == std::string::npos;
}

}  // namespace

TEST(ChunkMemory, SmallBuffersArePagesOfTheirOwn) {
  auto m = ChunkMemory::map(1000);
  ASSERT_TRUE(m);
  EXPECT_EQ(m.size(), static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
  EXPECT_FALSE(m.huge());
  std::memset(m.data(), 0xab, m.size());
  EXPECT_FALSE(smaps_entry(m.data()).empty());
  EXPECT_FALSE(ChunkMemory::map(0));
}

TEST(ChunkMemory, LargeBuffersAreAlignedAndAdvisedForHugePages) {
  auto m = ChunkMemory::map(3 * kMiB);
  ASSERT_TRUE(m);
  EXPECT_TRUE(m.huge());
  EXPECT_EQ(m.size(), 3 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m.data()) % ChunkMemory::kHugePage, 0u);
  // The whole buffer is there and writable.
  std::memset(m.data(), 0x5a, m.size());
  const std::string entry = smaps_entry(m.data());
  ASSERT_FALSE(entry.empty());
  EXPECT_EQ(smaps_entry(m.data() + m.size() - 1), entry);
  // The advice took (VmFlags "hg"); whether the kernel then had a free 2 MiB page to give is its
  // business (a fragmented machine may fall back to small pages), so that is only reported.
  EXPECT_NE(entry.find("VmFlags:"), std::string::npos) << entry;
  EXPECT_NE(entry.substr(entry.find("VmFlags:")).find(" hg"), std::string::npos) << entry;
  if (!thp_enabled()) GTEST_SKIP() << "transparent huge pages are off on this machine";
  EXPECT_EQ(field_kb(entry, "THPeligible:"), 1) << entry;
  std::printf("[chunk-memory] 3 MiB buffer written: AnonHugePages %ld kB\n", field_kb(entry, "AnonHugePages:"));
}

TEST(ChunkMemory, FreedBuffersGoBackToTheSystem) {
  void* at = nullptr;
  {
    auto m = ChunkMemory::map(4 * kMiB);
    ASSERT_TRUE(m);
    at = m.data();
    ChunkMemory moved = std::move(m);
    EXPECT_FALSE(m);  // NOLINT(bugprone-use-after-move): a moved-from buffer is empty
    EXPECT_EQ(moved.data(), at);
    std::memset(moved.data(), 1, moved.size());
  }
  EXPECT_TRUE(smaps_entry(at).empty());
  // msync on an unmapped range fails with ENOMEM.
  EXPECT_EQ(::msync(at, 4096, MS_ASYNC), -1);
  EXPECT_EQ(errno, ENOMEM);
}

TEST(ChunkMemory, RefusedMappingsAreEmptyNotFatal) {
  // In a child whose address space is capped: a 1 GiB buffer cannot be had.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit cap{size_t{512} << 20, size_t{512} << 20};
    if (::setrlimit(RLIMIT_AS, &cap) != 0) ::_exit(3);
    auto m = ChunkMemory::map(size_t{1} << 30);
    ::_exit(!m && errno == ENOMEM ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}
