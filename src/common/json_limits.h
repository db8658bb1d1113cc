#pragma once
// Bounds on JSON read from outside (REST bodies, data-plane hellos, QMP, the KubeVirt hook):
// documents nested deeper than kMaxJsonDepth are refused before they are parsed.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string_view>

namespace rdmig {

inline constexpr size_t kMaxJsonDepth = 32;  // every document rdmig reads is a few levels deep

// The longest post-copy page-fault wait (µs) taken from a peer's document (the target agent's
// verdict, an agent's status read by the controller): an hour. Anything longer, negative or not
// a number is not a wait and is left out rather than shown.
inline constexpr double kMaxPageLatencyUs = 3.6e9;

inline bool page_latency_us_in_bounds(const nlohmann::json& v) {
  return v.is_number() && v.get<double>() >= 0 && v.get<double>() <= kMaxPageLatencyUs;
}

// Deepest nesting of arrays and objects in `text` (strings skipped); stops counting once it
// passes `stop_after`. Not a validator: the parser still checks the syntax.
inline size_t json_nesting_depth(std::string_view text, size_t stop_after = kMaxJsonDepth) {
  size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest && (deepest = depth) > stop_after) return deepest;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

// Parses without throwing; a document that is not JSON, or nested deeper than `max_depth`,
// comes back discarded (is_discarded()).
inline nlohmann::json parse_json_bounded(std::string_view text, size_t max_depth = kMaxJsonDepth) {
  if (json_nesting_depth(text, max_depth) > max_depth) return nlohmann::json(nlohmann::json::value_t::discarded);
  return nlohmann::json::parse(text, nullptr, false);
}

}  // namespace rdmig
