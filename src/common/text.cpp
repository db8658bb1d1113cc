#include "common/text.h"

#include <fstream>
#include <sstream>

namespace rdmig {

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += sep;
    out += items[i];
  }
  return out;
}

std::string trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  const auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string_view::npos ? "" : std::string(s.substr(b, e - b + 1));
}

std::string utf8_prefix(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t end = max_bytes;
  // Step back over continuation bytes (10xxxxxx) to the lead byte of the character cut in two.
  size_t back = end;
  while (back > 0 && (static_cast<unsigned char>(s[back]) & 0xC0) == 0x80 && end - back < 3) --back;
  if ((static_cast<unsigned char>(s[back]) & 0xC0) == 0xC0) end = back;  // s[end] continued a character
  return std::string(s.substr(0, end));
}

Result<std::string> read_text_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) return Error{Errc::kNotFound, what + ": cannot read '" + path + "'"};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace rdmig
