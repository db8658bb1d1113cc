// rdmig-agent: per-node migration agent. Loads and validates its config, serves the REST API,
// /metrics and probes, and carries migrations between QEMU and peer agents. The parts and their
// wiring, threads and shutdown: agent.h.
#include <malloc.h>

#include <iostream>
#include <string>

#include "agent.h"
#include "common/log.h"
#include "common/version.h"

namespace {

constexpr const char* kUsage =
    "usage: rdmig-agent [--config PATH] [--ports-file PATH]\n"
    "       rdmig-agent --check-config PATH\n"
    "       rdmig-agent --version\n"
    "  --config PATH        agent configuration (YAML); default /etc/rdmig/agent.yaml\n"
    "  --ports-file PATH    write {\"api\":port,\"dataPlane\":port,\"probe\":port} once listening (for port 0)\n"
    "  --check-config PATH  validate the configuration and the token file it names, then exit\n"
    "                       (0: valid; 2: the message names the key)\n"
    "  --version            print the version and git revision, then exit\n";

}  // namespace

int main(int argc, char** argv) {
  // Chunk rings (64 KiB and up per slot) are freed when a migration ends. A fixed mmap
  // threshold keeps every allocation of 64 KiB or more in its own mapping, returned to the
  // kernel on free; glibc's sliding threshold would move them into heaps that never shrink.
  ::mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  std::string config_path = "/etc/rdmig/agent.yaml";
  std::string ports_file;
  bool check_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--config" || a == "-c") && i + 1 < argc) {
      config_path = argv[++i];
    } else if (a == "--check-config" && i + 1 < argc) {
      config_path = argv[++i];
      check_only = true;
    } else if (a == "--version") {
      std::cout << rdmig::version_line("rdmig-agent") << "\n";
      return 0;
    } else if (a == "--ports-file" && i + 1 < argc) {
      ports_file = argv[++i];
    } else if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    } else {
      std::cerr << "rdmig-agent: unknown argument '" << a << "'\n" << kUsage;
      return 2;
    }
  }

  auto prepared = rdmig::agent::prepare(config_path, check_only);
  if (!prepared) {
    std::cerr << "rdmig-agent: " << prepared.error().message << "\n";
    return 2;
  }
  const auto& config = prepared.value().config;
  if (check_only) {
    std::cout << "rdmig-agent: " << config_path << " is valid (token file '" << config.api.token_file << "' read, "
              << (config.kubevirt.enabled ? "KubeVirt mode on" : "KubeVirt mode off") << ", API over "
              << prepared.value().api_scheme << ")\n";
    return 0;
  }
  LOG_INFO("agent") << rdmig::version_line("rdmig-agent") << " starting, config " << config_path;
  if (config.data_plane.allow_loopback_peers) {
    LOG_WARN("agent") << "dataPlane.allowLoopbackPeers is true: a source may dial a loopback target.endpoint, "
                         "this host's own services (a lab setting, never for a node)";
  }
  const sigset_t signals = rdmig::agent::block_signals();  // before any thread starts
  rdmig::agent::Agent agent(std::move(prepared.value()));
  if (const int status = agent.start(ports_file); status != 0) return status;
  agent.run(signals);
  LOG_INFO("agent") << "stopped";
  return 0;
}
