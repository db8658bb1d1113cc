#include "k8s/time_format.h"

#include <cstdio>
#include <ctime>

namespace rdmig::k8s {

namespace {
std::tm utc(Clock::time_point t) {
  const std::time_t secs = Clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return tm;
}
}  // namespace

std::string format_time(Clock::time_point t) {
  const std::tm tm = utc(t);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
  return buf;
}

std::string format_micro_time(Clock::time_point t) {
  const std::tm tm = utc(t);
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count() % 1000000;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06lldZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<long long>(us));
  return buf;
}

std::optional<Clock::time_point> parse_time(const std::string& text) {
  int y = 0, mo = 0, d = 0, h = 0, mi = 0, s = 0, consumed = 0;
  if (std::sscanf(text.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d%n", &y, &mo, &d, &h, &mi, &s, &consumed) != 6 ||
      consumed != 19) {
    return std::nullopt;
  }
  size_t i = 19;
  long long micros = 0;
  if (i < text.size() && text[i] == '.') {
    ++i;
    int digits = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      if (digits < 6) {
        micros = micros * 10 + (text[i] - '0');
        ++digits;
      }
      ++i;
    }
    if (digits == 0) return std::nullopt;
    while (digits++ < 6) micros *= 10;
  }
  long offset_s = 0;
  if (i < text.size() && (text[i] == 'Z' || text[i] == 'z')) {
    ++i;
  } else if (i + 6 == text.size() && (text[i] == '+' || text[i] == '-') && text[i + 3] == ':') {
    const int oh = std::atoi(text.substr(i + 1, 2).c_str());
    const int om = std::atoi(text.substr(i + 4, 2).c_str());
    offset_s = (text[i] == '+' ? 1 : -1) * (oh * 3600 + om * 60);
    i += 6;
  } else {
    return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  std::tm tm{};
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = s;
  const std::time_t secs = timegm(&tm) - offset_s;
  return Clock::from_time_t(secs) + std::chrono::microseconds(micros);
}

}  // namespace rdmig::k8s
