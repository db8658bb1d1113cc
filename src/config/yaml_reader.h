// Strict reading of YAML configuration: every error names the key ("config key
// 'migration.chunkSize': ..."), unknown keys are refused. Shared by the agent's and the
// controller's configuration.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <set>
#include <string>

#include "common/result.h"

namespace rdmig::yaml_reader {

Error bad(const std::string& key, const std::string& what);
std::string join(const std::string& prefix, const std::string& key);

// Refuses keys that are not in `allowed`, listing the known ones.
Status check_keys(const YAML::Node& node, const std::string& prefix, const std::set<std::string>& allowed);

// Each reader leaves `out` untouched when the key is absent (or null, for strings).
Status read_string(const YAML::Node& parent, const std::string& prefix, const char* key, std::string& out);
Status read_u64(const YAML::Node& parent, const std::string& prefix, const char* key, uint64_t& out,
                uint64_t min, uint64_t max);
Status read_seconds(const YAML::Node& parent, const std::string& prefix, const char* key, double& out,
                    double min, double max);
Status read_bool(const YAML::Node& parent, const std::string& prefix, const char* key, bool& out);

template <typename T>
Status read_uint(const YAML::Node& parent, const std::string& prefix, const char* key, T& out, uint64_t min,
                 uint64_t max) {
  uint64_t v = out;
  RDMIG_TRY(read_u64(parent, prefix, key, v, min, max));
  out = static_cast<T>(v);
  return ok_status();
}

}  // namespace rdmig::yaml_reader
