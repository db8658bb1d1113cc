// The source tree, for the unit tests that read shipped files (agent/agent.yaml, controller.yaml)
// or scan sources (layering checks). Found at run time: the folder of the test binary
// (/proc/self/exe) joined with RDMIG_SOURCE_FROM_BINARY, the source tree relative to that folder
// as CMake computed it ("../../.." for a build/ inside the clone).
//
// Not the absolute path as a compile definition: it differs per clone, so the files using it
// missed ccache in every CI run (4 of 58 objects, about 30 s of a warm build).
#pragma once

#include <filesystem>
#include <string>

#ifndef RDMIG_SOURCE_FROM_BINARY
#error "RDMIG_SOURCE_FROM_BINARY must be defined (tests/unit/CMakeLists.txt, tests/k8s/CMakeLists.txt)"
#endif

namespace rdmig_test {

inline std::string source_dir() {
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe");
  return (exe.parent_path() / RDMIG_SOURCE_FROM_BINARY).lexically_normal().string();
}

}  // namespace rdmig_test
