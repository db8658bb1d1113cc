// KubeVirt's node hook served by the agent: gRPC NodeHookService over a unix socket (the
// path a Plugin object names, on a hostPath virt-handler mounts). The agent accepts each
// connection itself to learn the caller's pid (SO_PEERCRED: virt-handler, whose network
// namespace is the one to intercept in), then hands the connection to gRPC.
//
// It never fails KubeVirt's migration: every answer is OK, whether rdmig carries the
// migration or not (the decision is in the agent's records and metrics). The request is
// bounded (4 MiB) and the decision takes well under the Plugin's timeout.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/result.h"

namespace grpc {
class Server;
}

namespace rdmig::kubevirt {

class KubevirtRelay;

class HookServer {
 public:
  // Handles one hook point call: (hookPoint, VMI JSON text, node name, caller pid).
  using Handler = std::function<void(const std::string& hook_point, const std::string& vmi_json,
                                     const std::string& node, pid_t caller)>;

  static Result<std::unique_ptr<HookServer>> start(const std::string& socket_path, Handler handler);
  ~HookServer();
  HookServer(const HookServer&) = delete;
  HookServer& operator=(const HookServer&) = delete;

  // True while socket_path is still this server's listening socket (same inode): false once the
  // file was removed or replaced, when KubeVirt's Plugin can no longer reach this agent.
  bool serving() const;
  // The caller pid of a gRPC peer string ("fd:<n>" for connections handed over by fd).
  pid_t caller_of(const std::string& peer) const;
  void dispatch(const std::string& hook_point, const std::string& vmi, const std::string& node,
                const std::string& peer) const;

 private:
  HookServer(std::string path, UniqueFd listener, Handler handler);
  void accept_loop();

  class Service;
  std::string path_;
  ino_t bound_ino_ = 0;
  dev_t bound_dev_ = 0;
  UniqueFd listener_;
  Handler handler_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  // Guards callers_ alone: acceptor_ records each connection's pid under it, and gRPC's
  // handler threads look one up (caller_of, from dispatch) under it. Held only for the map
  // access; never held while handler_ runs.
  mutable std::mutex mu_;
  std::map<int, pid_t> callers_;  // fd -> pid
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
};

// Wires a HookServer to the relay: PreMigrationSource arms interception; other points pass.
Result<std::unique_ptr<HookServer>> start_hook_server(const std::string& socket_path, KubevirtRelay& relay);

}  // namespace rdmig::kubevirt
