#include "k8s/selectors.h"

namespace rdmig::k8s {

std::string label_selector(const std::map<std::string, std::string>& labels) {
  std::string out;
  for (const auto& [k, v] : labels) {
    if (!out.empty()) out += ",";
    out += k + "=" + v;
  }
  return out;
}

namespace {
bool valid_label_part(const std::string& s, bool is_key) {
  if (s.empty()) return !is_key;  // values may be empty
  if (s.size() > (is_key ? 317u : 63u)) return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.' || (is_key && c == '/');
    if (!ok) return false;
  }
  return true;
}
std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}
}  // namespace

Result<std::map<std::string, std::string>> parse_label_selector(const std::string& text,
                                                                 const std::string& field) {
  std::map<std::string, std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string term = trim(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (term.empty()) {
      if (text.empty() && out.empty()) break;
      return Error{Errc::kInvalidArgument, field + ": empty term in selector '" + text + "'"};
    }
    const size_t eq = term.find('=');
    if (eq == std::string::npos || term.find("!=") != std::string::npos) {
      return Error{Errc::kInvalidArgument,
                   field + ": only equality terms (key=value) are supported, got '" + term + "'"};
    }
    const std::string key = trim(term.substr(0, eq));
    const size_t vstart = (eq + 1 < term.size() && term[eq + 1] == '=') ? eq + 2 : eq + 1;
    const std::string value = trim(term.substr(vstart));
    if (!valid_label_part(key, true) || !valid_label_part(value, false)) {
      return Error{Errc::kInvalidArgument, field + ": invalid label term '" + term + "'"};
    }
    out[key] = value;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string field_selector_value(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == ',' || c == '=') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

std::string url_encode(const std::string& value) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : value) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
        c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  return out;
}

}  // namespace rdmig::k8s
