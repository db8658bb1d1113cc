// Small text helpers shared by the agent, the controller and the Kubernetes client.
#pragma once

#include <string>
#include <string_view>

#include "common/result.h"

namespace rdmig {

// Without leading and trailing spaces, tabs and line ends.
std::string trim(std::string_view s);

// The whole file; kNotFound "<what>: cannot read '<path>'" when it cannot be opened.
Result<std::string> read_text_file(const std::string& path, const std::string& what);

}  // namespace rdmig
