// Interception inside one virt-handler network namespace: a listener on 127.0.0.1 (and
// [::1]) that only that namespace can reach, and rdmig's nftables table redirecting the
// proxy's connections to it. One thread accepts and hands each connection, with its original
// destination, to `on_connection` in accept order (the order the proxy dialled).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include "common/mutex.h"
#include "kubevirt/intercept/netns.h"
#include "kubevirt/intercept/nft_rules.h"

namespace rdmig::kubevirt {

class InterceptPoint {
 public:
  using OnConnection = std::function<void(UniqueFd fd, const net::Endpoint& original_destination, const NetNs& ns)>;

  // Every accepted connection is a same-node hop: its buffers are bounded to `hop_window`
  // (net::bound_local_hop) before anything reads it.
  static Result<std::unique_ptr<InterceptPoint>> create(std::shared_ptr<NetNs> ns, PassMark mark, size_t hop_window,
                                                        OnConnection on_connection);
  ~InterceptPoint();  // retire(), unless done
  // Stops accepting and removes the table now (once; the destructor then leaves the namespace
  // alone). The relay retires a stale point while its namespace is marked busy, so the removal
  // can never take the table of a newer point in the same namespace with it, whoever drops the
  // last reference later.
  void retire();
  InterceptPoint(const InterceptPoint&) = delete;
  InterceptPoint& operator=(const InterceptPoint&) = delete;

  const NetNs& ns() const { return *ns_; }
  std::shared_ptr<NetNs> ns_ptr() const { return ns_; }
  const NftRules& rules() const { return rules_; }
  // Serialises changes of this point's carry elements with the relay's record of who owns them
  // (KubevirtRelay::armed_): a hook call holds it from its first carry until its elements are
  // recorded (or removed again), the maintenance loop while it checks that an element an ended
  // session leaves has no newer owner and removes it. Without it a session that ended could
  // remove the element a newer migration to the same address and port had just armed, and that
  // migration's connections would go straight to the destination (seen in a suite run). Held
  // across nftables; taken before the relay's mu_, never under it.
  Mutex& elements_mu() const { return elements_mu_; }
  // Installs the table again (after it vanished), redirecting to the same listeners; its
  // elements are added back by their owners' next refresh.
  Status reinstall();

 private:
  InterceptPoint(std::shared_ptr<NetNs> ns, UniqueFd l4, UniqueFd l6, NftRules rules, OnConnection cb,
                 uint16_t port4, uint16_t port6, PassMark mark, size_t hop_window);
  void loop();

  std::shared_ptr<NetNs> ns_;
  UniqueFd listen4_;
  UniqueFd listen6_;
  NftRules rules_;
  mutable Mutex elements_mu_;
  OnConnection on_connection_;
  uint16_t port4_ = 0, port6_ = 0;
  PassMark mark_;
  size_t hop_window_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> retired_{false};
  std::thread thread_;
};

}  // namespace rdmig::kubevirt
