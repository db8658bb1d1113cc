// Minimal structured logging: one line per event, "ts level component msg key=value".
// The level is process-wide (set once from config at start-up); it is the one global in
// rdmig because every thread logs and threading a logger through every call adds nothing.
// Levels are checked before the message is formatted.
#pragma once

#include <atomic>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace rdmig::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

std::optional<Level> parse_level(std::string_view name);
void set_level(Level level);
bool enabled(Level level);
void write(Level level, std::string_view component, const std::string& message);

// Collects one line; emitted by the destructor.
class Line {
 public:
  Line(Level level, std::string_view component) : level_(level), component_(component) {}
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  ~Line() { write(level_, component_, out_.str()); }
  template <typename T>
  Line& operator<<(const T& v) {
    out_ << v;
    return *this;
  }

 private:
  Level level_;
  std::string_view component_;
  std::ostringstream out_;
};

}  // namespace rdmig::log

#define RDMIG_LOG(level, component)                                   \
  if (!::rdmig::log::enabled(::rdmig::log::Level::level)) {           \
  } else                                                              \
    ::rdmig::log::Line(::rdmig::log::Level::level, component)

#define LOG_DEBUG(component) RDMIG_LOG(kDebug, component)
#define LOG_INFO(component) RDMIG_LOG(kInfo, component)
#define LOG_WARN(component) RDMIG_LOG(kWarn, component)
#define LOG_ERROR(component) RDMIG_LOG(kError, component)
