// Network namespaces of other processes (virt-handler's pod on this node), entered per call
// on a short-lived thread: setns(CLONE_NEWNET) changes only the calling thread, so the agent's
// own threads stay in the host namespace. Sockets keep the namespace they were created in,
// so a listener or a connection made inside can be used from any thread afterwards.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/net.h"
#include "common/result.h"

namespace rdmig::kubevirt {

class NetNs {
 public:
  // The network namespace of process `pid` (/proc/<pid>/ns/net; needs CAP_SYS_ADMIN and
  // ptrace access to the process, i.e. hostPID and SYS_PTRACE in a pod).
  static Result<NetNs> of_pid(pid_t pid);

  // Runs `fn` inside the namespace and returns what it returns.
  Status run(const std::function<Status()>& fn) const;
  Result<UniqueFd> make_socket(const std::function<Result<UniqueFd>()>& fn) const;

  uint64_t inode() const { return inode_; }
  pid_t pid() const { return pid_; }
  std::string describe() const;

 private:
  NetNs(UniqueFd fd, uint64_t inode, pid_t pid) : fd_(std::move(fd)), inode_(inode), pid_(pid) {}
  UniqueFd fd_;
  uint64_t inode_ = 0;
  pid_t pid_ = 0;
};

// The network namespace inode of process `pid`, without entering it (0 when unreadable).
uint64_t netns_inode(pid_t pid);

// Processes whose /proc/<pid>/comm is `comm` (virt-handler's binary sets it to its name).
std::vector<pid_t> processes_named(const std::string& comm);

// Processes whose command line has an argument whose basename starts with `program` and the
// pair `flag value` (virt-launcher-monitor ... --uid <vmiUID>).
std::vector<pid_t> processes_with_arg(const std::string& program, const std::string& flag, const std::string& value);

// `path` as seen inside the root of process `pid`, following symbolic links inside that root
// (an absolute link such as /var/run -> /run must not escape to the agent's own root, as it
// does through /proc/<pid>/root). The result starts with /proc/<pid>/root.
Result<std::string> path_in_process_root(pid_t pid, const std::string& path);

// True when one of `pids` in network namespace `ns` holds a TCP socket listening on `port`
// (its /proc/<pid>/net/tcp{,6} LISTEN entries matched to its own fds): what virt-handler's
// migration proxy does on each port it publishes for a migration.
bool listens_on(const std::vector<pid_t>& pids, const NetNs& ns, uint16_t port);

// True when `ip` is an address of an interface in `ns` (bind() succeeds there).
bool address_is_local(const NetNs& ns, const std::string& ip);

// The original destination of a connection redirected by nftables (SO_ORIGINAL_DST /
// IP6T_SO_ORIGINAL_DST, from conntrack).
Result<net::Endpoint> original_destination(int fd);

// Makes the next close() send a RST instead of a FIN (SO_LINGER 0): the peer fails at once.
void arm_reset(int fd);

// Marks a socket so that rdmig's own nftables rules let it through (SO_MARK, CAP_NET_ADMIN):
// kubevirt.socketMark, matched under kubevirt.socketMarkMask.
struct PassMark {
  uint32_t value = 0x2000;
  uint32_t mask = 0x2000;
};
Status set_pass_mark(int fd, PassMark mark);

}  // namespace rdmig::kubevirt
