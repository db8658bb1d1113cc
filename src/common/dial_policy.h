// Where the agent connects when someone else named the address: a REST client's target.endpoint
// (migrations and path checks, role source: the peer agent's data plane) and a peer agent's
// KubeVirt "open" (a virt-handler's pod address). One rule for every such dial, checked where
// the address comes in (a 400 naming the field) and again at the dial itself.
//
// The rule: an IPv4 or IPv6 address literal (a name is never resolved: what was checked is what
// is dialled) of a unicast host, never
//   - the unspecified address or 0.0.0.0/8 ("this network": Linux connects 0.0.0.0 to itself),
//   - link-local (169.254.0.0/16, where cloud metadata services answer; fe80::/10),
//   - multicast (224.0.0.0/4, ff00::/8), broadcast or reserved (240.0.0.0/4),
//   - loopback (127.0.0.0/8, ::1) unless the policy allows it (a lab: agents on one host),
//   - an IPv6 address that embeds a refused IPv4 one: IPv4-mapped (::ffff:a.b.c.d),
//     IPv4-translated (::ffff:0:a.b.c.d), IPv4-compatible (::a.b.c.d), NAT64
//     (64:ff9b::/96, 64:ff9b:1::/48) and 6to4 (2002:aabb:ccdd::/48) are judged as that IPv4
//     address.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "common/fd.h"
#include "common/net.h"
#include "common/result.h"

namespace rdmig::net {

class DialPolicy {
 public:
  // Dials to peer agents on a REST client's word. `allow_loopback`: the agent's config says it is
  // a lab (dataPlane.allowLoopbackPeers), where two agents on one host reach each other on
  // 127.0.0.1 or ::1; a refused loopback address names that key.
  static DialPolicy peer_agents(bool allow_loopback) {
    return DialPolicy(allow_loopback, "dataPlane.allowLoopbackPeers");
  }
  // Dials to pod addresses (KubeVirt flows): loopback never (in a pod's network namespace it is
  // the pod's own services, never KubeVirt's proxy).
  static DialPolicy pod_addresses() { return DialPolicy(false, ""); }

  // OK when `host` may be dialled; else kInvalidArgument "<field>: '<host>' <why>; <the rule>".
  Status check(const std::string& host, const std::string& field) const;
  // check(), then net::tcp_connect(): the dial for an address someone else named.
  Result<UniqueFd> connect(const Endpoint& ep, const std::string& field, std::chrono::milliseconds timeout,
                           const std::function<Status(int fd)>& prepare = nullptr) const;

  bool allows_loopback() const { return allow_loopback_; }

 private:
  DialPolicy(bool allow_loopback, const char* loopback_key)
      : allow_loopback_(allow_loopback), loopback_key_(loopback_key) {}
  bool allow_loopback_;
  const char* loopback_key_;  // the config key that allows loopback; "" = none does
};

}  // namespace rdmig::net
