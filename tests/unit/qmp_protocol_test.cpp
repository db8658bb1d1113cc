#include <gtest/gtest.h>

#include <limits>
#include <sys/mman.h>

#include <cstdio>
#include <cstring>

#include "qemu/guest_ram.h"
#include "qemu/qmp_protocol.h"

using namespace rdmig;
using namespace rdmig::qemu;

TEST(QmpProtocol, ParsesGreetingReturnErrorAndEvent) {
  auto g = parse_qmp_message(R"({"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": ["oob"]}})");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->kind, QmpMessageKind::kGreeting);

  auto r = parse_qmp_message(R"({"return": {"status": "running", "running": true}, "id": 3})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->kind, QmpMessageKind::kReturn);
  EXPECT_EQ(r->id, 3);
  EXPECT_EQ(r->value["status"], "running");

  auto e = parse_qmp_message(R"({"id": 4, "error": {"class": "GenericError", "desc": "no migration"}})");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->kind, QmpMessageKind::kError);
  EXPECT_EQ(e->error_desc, "no migration");

  auto ev = parse_qmp_message(
      R"({"timestamp": {"seconds": 1700000000, "microseconds": 123456}, "event": "STOP"})");
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->kind, QmpMessageKind::kEvent);
  EXPECT_EQ(ev->event, "STOP");
  EXPECT_EQ(ev->timestamp_us, 1700000000123456);
}

TEST(QmpProtocol, RejectsGarbage) {
  EXPECT_EQ(parse_qmp_message("not json").error().code, Errc::kProtocol);
  EXPECT_FALSE(parse_qmp_message("[1,2]").ok());
  EXPECT_FALSE(parse_qmp_message(R"({"something": 1})").ok());
  EXPECT_FALSE(parse_qmp_message(R"({"event": 5})").ok());
}

TEST(QmpProtocol, EncodesCommandsAsOneLine) {
  const auto line = encode_qmp_command("migrate", {{"uri", "unix:/x"}}, 9);
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1);
  auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["execute"], "migrate");
  EXPECT_EQ(j["arguments"]["uri"], "unix:/x");
  EXPECT_EQ(j["id"], 9);
  EXPECT_FALSE(nlohmann::json::parse(encode_qmp_command("query-status", {}, 1)).contains("arguments"));
}

TEST(QmpProtocol, ParsesQueryMigrateOfQemu72) {
  // Shape of a real QEMU 7.2 reply after completion.
  auto j = nlohmann::json::parse(R"({"status": "completed", "setup-time": 4, "downtime": 17,
    "total-time": 2400, "ram": {"transferred": 146800640, "remaining": 0, "total": 537395200,
    "duplicate": 100, "normal": 35000, "normal-bytes": 143360000, "dirty-sync-count": 3,
    "page-size": 4096, "multifd-bytes": 0, "pages-per-second": 1000, "precopy-bytes": 1,
    "downtime-bytes": 2, "postcopy-bytes": 0, "dirty-pages-rate": 16384, "mbps": 800.5}})");
  auto info = parse_migration_info(j);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->status, "completed");
  EXPECT_EQ(info->downtime_ms, 17);
  EXPECT_EQ(info->total_time_ms, 2400);
  EXPECT_EQ(info->transferred_bytes, 146800640u);
  EXPECT_EQ(info->total_bytes, 537395200u);
  EXPECT_EQ(info->dirty_sync_count, 3u);
  EXPECT_EQ(info->normal_pages, 35000u);
  EXPECT_EQ(info->duplicate_pages, 100u);
  EXPECT_DOUBLE_EQ(info->throughput_bytes_per_second, 800.5e6 / 8);
  EXPECT_EQ(info->dirty_pages_rate, 16384u);
  EXPECT_TRUE(migration_status_terminal(info->status));
}

TEST(QmpProtocol, QueryMigrateBeforeAnyMigrationHasNoStatus) {
  auto info = parse_migration_info(nlohmann::json::object());
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->status, "none");
  EXPECT_EQ(info->downtime_ms, -1);
  EXPECT_FALSE(parse_migration_info(nlohmann::json::array()).ok());
  EXPECT_FALSE(parse_migration_info(nlohmann::json{{"status", 3}}).ok());
}

TEST(QmpProtocol, ParsesPostCopyFiguresAndStates) {
  // A source in post-copy (ram.postcopy-requests) and a target with postcopy-blocktime on.
  auto src = parse_migration_info(nlohmann::json::parse(
      R"({"status": "postcopy-active", "ram": {"transferred": 1, "postcopy-requests": 412, "dirty-sync-count": 4}})"));
  ASSERT_TRUE(src.ok());
  EXPECT_EQ(src->postcopy_requests, 412);
  EXPECT_EQ(src->postcopy_blocktime_ms, -1);
  EXPECT_EQ(src->postcopy_latency_ns, -1);
  EXPECT_TRUE(migration_status_postcopy(src->status));
  EXPECT_FALSE(migration_status_terminal(src->status));
  auto dst = parse_migration_info(nlohmann::json::parse(
      R"({"status": "completed", "postcopy-blocktime": 57, "postcopy-vcpu-blocktime": [57], "postcopy-latency": 81234})"));
  ASSERT_TRUE(dst.ok());
  EXPECT_EQ(dst->postcopy_requests, -1);
  EXPECT_EQ(dst->postcopy_blocktime_ms, 57);
  EXPECT_EQ(dst->postcopy_latency_ns, 81234);
  EXPECT_FALSE(migration_status_postcopy("active"));
  EXPECT_TRUE(migration_status_postcopy("postcopy-paused"));
  EXPECT_TRUE(dst->postcopy_latency_dist.empty());  // QEMU 10.0: no distribution
}

TEST(QmpProtocol, PageLatencyPercentilesComeFromQemusPowerOfTwoBuckets) {
  // QEMU 10.1+: postcopy-latency-dist, bucket N counting faults that waited [2^N, 2^(N+1)) us.
  auto dst = parse_migration_info(nlohmann::json::parse(
      R"({"status": "completed", "postcopy-latency": 900000, "postcopy-latency-dist": [0, 0, 0, 0, 0, 0, 3, 40, 50, 6, 0, 1]})"));
  ASSERT_TRUE(dst.ok()) << dst.error().message;
  ASSERT_EQ(dst->postcopy_latency_dist.size(), 12u);
  // 100 faults: 43 in buckets up to 7, so the 50th is in bucket 8 ([256, 512) us); 93 up to 8, so the
  // 99th is in bucket 9 ([512, 1024) us).
  EXPECT_EQ(latency_dist_quantile_us(dst->postcopy_latency_dist, 0.5), 512.0);
  EXPECT_EQ(latency_dist_quantile_us(dst->postcopy_latency_dist, 0.99), 1024.0);
  EXPECT_EQ(latency_dist_quantile_us(dst->postcopy_latency_dist, 1.0), 4096.0);  // the slowest fault
  EXPECT_FALSE(latency_dist_quantile_us({}, 0.5));
  EXPECT_FALSE(latency_dist_quantile_us({0, 0, 0}, 0.99));  // no fault counted
  // Counts that would overflow a sum saturate instead of wrapping round to a small total.
  const uint64_t big = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(latency_dist_quantile_us({big, big, 1}, 0.5), 2.0);
  // Malformed: refused naming the field, not guessed at.
  for (const char* bad : {R"({"status": "completed", "postcopy-latency-dist": 7})",
                          R"({"status": "completed", "postcopy-latency-dist": [1, -2]})",
                          R"({"status": "completed", "postcopy-latency-dist": [1, "x"]})"}) {
    auto r = parse_migration_info(nlohmann::json::parse(bad));
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("postcopy-latency-dist"), std::string::npos) << r.error().message;
  }
  nlohmann::json many = nlohmann::json::parse(R"({"status": "completed"})");
  many["postcopy-latency-dist"] = std::vector<uint64_t>(65, 1);
  EXPECT_FALSE(parse_migration_info(many).ok());
}

namespace {
// A QEMU's smaps as the kernel writes it: the guest RAM (128 MiB plus 2 MiB of alignment), a
// smaller anonymous mapping, a file mapping; the fields each header is followed by.
constexpr const char* kQemuSmaps =
    "55d4a0000000-55d4a0400000 r-xp 00000000 08:01 1234 /usr/bin/qemu-system-x86_64\n"
    "Size:               4096 kB\n"
    "Rss:                2048 kB\n"
    "VmFlags: rd ex mr mw me sd\n"
    "7f3c00000000-7f3c08200000 rw-p 00000000 00:00 0 \n"
    "Size:             133120 kB\n"
    "KernelPageSize:        4 kB\n"
    "Rss:               40960 kB\n"
    "Pss:               40960 kB\n"
    "7f3c10000000-7f3c10800000 rw-p 00000000 00:00 0 \n"
    "Size:               8192 kB\n"
    "Rss:                8192 kB\n";
constexpr uint64_t kRamMiB = uint64_t{1} << 20;
}  // namespace

TEST(GuestRam, TheRamMappingsRssIsTheResidentPart) {
  auto r = qemu::ram_resident_from_smaps(kQemuSmaps, 128 * kRamMiB);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r.value(), 40 * kRamMiB);
  // No mapping of 128 MiB to 128 + 16 MiB: named.
  auto none = qemu::ram_resident_from_smaps(kQemuSmaps, 512 * kRamMiB);
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().message.find("no mapping of the guest RAM's size (512 MiB)"), std::string::npos);
  EXPECT_FALSE(qemu::ram_resident_from_smaps(kQemuSmaps, 0));
  EXPECT_FALSE(qemu::ram_resident_from_smaps("", 128 * kRamMiB));
}

TEST(GuestRam, MalformedSmapsIsRefusedNamingTheLineNeverMisread) {
  const std::string good = kQemuSmaps;
  // A header whose range does not read, an Rss not in kB, an Rss that does not read or overflows.
  for (const auto& [bad, what] : std::vector<std::pair<std::string, std::string>>{
           {"zz3c00000000-7f3c08200000 rw-p 0 00:00 0\n", "range does not read"},
           {"7f3c08200000-7f3c00000000 rw-p 0 00:00 0\n", "range does not read"},
           {"7f3c00000000-7f3c08200000 rw-p 0 00:00 0\nRss: 40960 MB\n", "Rss not in kB"},
           {"7f3c00000000-7f3c08200000 rw-p 0 00:00 0\nRss: -5 kB\n", "Rss does not read"},
           {"7f3c00000000-7f3c08200000 rw-p 0 00:00 0\nRss: 99999999999999999999999 kB\n", "Rss does not read"},
           {"7f3c00000000-7f3c08200000 rw-p 0 00:00 0\nRss: 18014398509481984 kB\n", "Rss does not read"}}) {
    auto r = qemu::ram_resident_from_smaps(bad, 128 * kRamMiB);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.error().message.find(what), std::string::npos) << bad << " -> " << r.error().message;
    EXPECT_NE(r.error().message.find("smaps line "), std::string::npos) << r.error().message;
  }
  // Cut short, or lines it does not know: skipped, never taken for the RAM.
  auto cut = qemu::ram_resident_from_smaps(good.substr(0, good.find("Rss:               40960")), 128 * kRamMiB);
  EXPECT_FALSE(cut);
  auto noisy = qemu::ram_resident_from_smaps("garbage\n\n\xff\xfe\n" + good + "THP: x\n", 128 * kRamMiB);
  ASSERT_TRUE(noisy) << noisy.error().message;
  EXPECT_EQ(noisy.value(), 40 * kRamMiB);
  // More resident than the RAM (huge pages rounding): at most the RAM's size.
  auto over = qemu::ram_resident_from_smaps("7f3c00000000-7f3c08200000 rw-p 0 00:00 0\nRss: 140000 kB\n", 128 * kRamMiB);
  ASSERT_TRUE(over);
  EXPECT_EQ(over.value(), 128 * kRamMiB);
}

TEST(GuestRam, ReadsThisProcesssOwnSmapsAsItWouldAQemus) {
  // A real smaps from the kernel: a 96 MiB anonymous mapping of which 24 MiB were written.
  // Between two inaccessible pages, so that the kernel cannot merge it with a neighbour.
  const size_t size = 96 * kRamMiB, guard = 4096;
  void* whole = ::mmap(nullptr, size + 2 * guard, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(whole, MAP_FAILED);
  char* p = static_cast<char*>(whole) + guard;
  ASSERT_EQ(::mprotect(p, size, PROT_READ | PROT_WRITE), 0);
  std::memset(p, 0x5a, 24 * kRamMiB);
  std::string text;
  {
    std::FILE* f = std::fopen("/proc/self/smaps", "r");
    ASSERT_NE(f, nullptr);
    char buf[65536];
    size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
    std::fclose(f);
  }
  auto r = qemu::ram_resident_from_smaps(text, size);
  ::munmap(whole, size + 2 * guard);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_GE(r.value(), 24 * kRamMiB);
  EXPECT_LE(r.value(), 26 * kRamMiB);  // transparent huge pages may round a little up
}

TEST(GuestRam, StatusGivesAnonymousAndSharedResidentMemoryWhereSmapsMayNotBeRead) {
  auto r = qemu::resident_from_status("Name:\tqemu-system-x86\nVmRSS:\t  200000 kB\nRssAnon:\t  150000 kB\n"
                                      "RssFile:\t   40000 kB\nRssShmem:\t   10000 kB\nThreads:\t5\n");
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r.value(), uint64_t{160000} * 1024);
  EXPECT_FALSE(qemu::resident_from_status("Name:\tqemu\n"));
  EXPECT_FALSE(qemu::resident_from_status(""));
  for (const std::string bad : {"RssAnon:\t12 MB\n", "RssAnon:\t-1 kB\n", "RssShmem:\t99999999999999999999 kB\n",
                                "RssAnon:\t18014398509481983 kB\nRssShmem:\t18014398509481983 kB\n"}) {
    auto e = qemu::resident_from_status(bad);
    ASSERT_FALSE(e) << bad;
    EXPECT_NE(e.error().message.find("status line "), std::string::npos) << e.error().message;
  }
}
