// Small text helpers shared by the agent, the controller and the Kubernetes client.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"

namespace rdmig {

// The items separated by `sep` ("" for none).
std::string join(const std::vector<std::string>& items, std::string_view sep = ", ");

// Without leading and trailing spaces, tabs and line ends.
std::string trim(std::string_view s);

// The longest prefix of `s` of at most `max_bytes` bytes that does not end inside a UTF-8
// character (a multi-byte sequence is kept whole or dropped whole). Bytes that are not valid
// UTF-8 are left as they are: serialise JSON with error_handler_t::replace to be safe from them.
std::string utf8_prefix(std::string_view s, size_t max_bytes);

// The whole file; kNotFound "<what>: cannot read '<path>'" when it cannot be opened.
Result<std::string> read_text_file(const std::string& path, const std::string& what);

}  // namespace rdmig
