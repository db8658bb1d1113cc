#include "common/text.h"

#include <fstream>
#include <sstream>

namespace rdmig {

std::string trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  const auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string_view::npos ? "" : std::string(s.substr(b, e - b + 1));
}

Result<std::string> read_text_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) return Error{Errc::kNotFound, what + ": cannot read '" + path + "'"};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace rdmig
