#include "common/log.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace rdmig::log {
namespace {
std::atomic<int> g_level{static_cast<int>(Level::kInfo)};
std::mutex g_write_mu;

const char* level_name(Level level) {
  switch (level) {
    case Level::kDebug: return "DEBUG";
    case Level::kInfo: return "INFO";
    case Level::kWarn: return "WARN";
    case Level::kError: return "ERROR";
  }
  return "?";
}
}  // namespace

std::optional<Level> parse_level(std::string_view name) {
  if (name == "debug") return Level::kDebug;
  if (name == "info") return Level::kInfo;
  if (name == "warn" || name == "warning") return Level::kWarn;
  if (name == "error") return Level::kError;
  return std::nullopt;
}

void set_level(Level level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

bool enabled(Level level) {
  return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

void write(Level level, std::string_view component, const std::string& message) {
  using namespace std::chrono;
  const auto now = system_clock::now();
  const auto secs = system_clock::to_time_t(now);
  const auto ms = duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char ts[64];
  std::snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms));
  std::lock_guard lock(g_write_mu);
  std::fprintf(stderr, "%s %-5s %.*s %s\n", ts, level_name(level),
               static_cast<int>(component.size()), component.data(), message.c_str());
  std::fflush(stderr);
}

}  // namespace rdmig::log
