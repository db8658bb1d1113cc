#include <gtest/gtest.h>

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
}
