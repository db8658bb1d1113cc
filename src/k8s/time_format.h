// Kubernetes time formats: RFC 3339 "Time" (seconds) and "MicroTime" (microseconds), UTC.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace rdmig::k8s {

using Clock = std::chrono::system_clock;

std::string format_time(Clock::time_point t);        // 2024-05-01T12:00:00Z
std::string format_micro_time(Clock::time_point t);  // 2024-05-01T12:00:00.123456Z
// Accepts both forms (and a numeric offset). nullopt when it is not RFC 3339.
std::optional<Clock::time_point> parse_time(const std::string& text);

}  // namespace rdmig::k8s
