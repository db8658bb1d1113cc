#include "config/yaml_reader.h"

namespace rdmig::yaml_reader {

Error bad(const std::string& key, const std::string& what) {
  return Error{Errc::kInvalidArgument, "config key '" + key + "': " + what};
}

std::string join(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

Status check_keys(const YAML::Node& node, const std::string& prefix, const std::set<std::string>& allowed) {
  if (!node.IsMap()) return bad(prefix.empty() ? "<root>" : prefix, "expected a mapping");
  for (const auto& kv : node) {
    const auto key = kv.first.as<std::string>();
    if (!allowed.contains(key)) {
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      return bad(join(prefix, key), "unknown key (known here: " + list + ")");
    }
  }
  return ok_status();
}

Status read_string(const YAML::Node& parent, const std::string& prefix, const char* key, std::string& out) {
  const auto n = parent[key];
  if (!n || n.IsNull()) return ok_status();
  if (!n.IsScalar()) return bad(join(prefix, key), "expected a string");
  out = n.as<std::string>();
  return ok_status();
}

Status read_u64(const YAML::Node& parent, const std::string& prefix, const char* key, uint64_t& out,
                uint64_t min, uint64_t max) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string k = join(prefix, key);
  const std::string text = n.IsScalar() ? n.as<std::string>() : "";
  // Decimal, or hexadecimal with 0x (marks and masks read better so).
  const bool hex = text.size() > 2 && text.size() <= 18 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X') &&
                   text.find_first_not_of("0123456789abcdefABCDEF", 2) == std::string::npos;
  if (!hex && (text.empty() || text.size() > 19 || text.find_first_not_of("0123456789") != std::string::npos)) {
    return bad(k, "expected a non-negative integer, got '" + text.substr(0, 64) + "'");
  }
  const uint64_t v = hex ? std::stoull(text.substr(2), nullptr, 16) : std::stoull(text);
  if (v < min || v > max) {
    return bad(k, "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got " + text);
  }
  out = v;
  return ok_status();
}

Status read_seconds(const YAML::Node& parent, const std::string& prefix, const char* key, double& out,
                    double min, double max) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string k = join(prefix, key);
  double v = 0;
  try {
    v = n.as<double>();
  } catch (const YAML::Exception&) {
    return bad(k, "expected a number of seconds");
  }
  if (!(v >= min && v <= max)) {
    return bad(k, "must be between " + std::to_string(min) + " and " + std::to_string(max));
  }
  out = v;
  return ok_status();
}

Status read_bool(const YAML::Node& parent, const std::string& prefix, const char* key, bool& out) {
  const auto n = parent[key];
  if (!n) return ok_status();
  const std::string text = n.IsScalar() ? n.as<std::string>() : "";
  if (text == "true") out = true;
  else if (text == "false") out = false;
  else return bad(join(prefix, key), "expected true or false, got '" + text + "'");
  return ok_status();
}

}  // namespace rdmig::yaml_reader
