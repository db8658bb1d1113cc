// rdmig's nftables table inside one network namespace (virt-handler's pod), written through
// libnftables (no shell-out). It redirects TCP connections that virt-handler's migration
// proxy makes to the agent's listener in that namespace:
//   carry4/carry6: "address . port" elements, one per armed KubeVirt migration port (hook mode)
//   peers4/peers6: peer virt-handler addresses (static mode, no hook)
// Every element has a timeout that the agent refreshes while it is healthy, so a dead
// agent's redirects expire and KubeVirt's own path comes back by itself. Sockets carrying
// rdmig's mark (kubevirt.socketMark under its mask) are never redirected. The table is replaced whole at creation.
#pragma once

#include <chrono>
#include <string>

#include "common/result.h"
#include "kubevirt/intercept/netns.h"

namespace rdmig::kubevirt {

inline constexpr const char* kNftTable = "rdmig";

class NftRules {
 public:
  // Installs (replacing any earlier one) the table redirecting to 127.0.0.1:port4 and [::1]:port6
  // (port6 = 0: no IPv6 rules).
  static Result<NftRules> install(const NetNs& ns, uint16_t port4, uint16_t port6, PassMark mark);

  // Adds the element or restarts its timeout.
  Status carry(const std::string& ip, uint16_t port, std::chrono::seconds timeout) const;
  Status uncarry(const std::string& ip, uint16_t port) const;
  Status peer(const std::string& ip, std::chrono::seconds timeout) const;
  // Removes the whole table (orderly agent stop).
  Status remove() const;
  // Start-up sweep: removes a table an earlier agent left in `ns` (killed, OOM, crashed: its
  // elements would redirect to a dead listener until they time out). True when one was there.
  static Result<bool> remove_leftover(const NetNs& ns);
  // `nft list table inet rdmig` output, for diagnostics and tests.
  Result<std::string> list() const;

 private:
  NftRules(const NetNs& ns) : ns_(&ns) {}
  Result<std::string> run(const std::string& commands) const;
  const NetNs* ns_;
};

// Validates an IP literal; returns 4 or 6, or an error naming `field`.
Result<int> ip_family(const std::string& ip, const std::string& field);

}  // namespace rdmig::kubevirt
