#include "kubevirt/peers/peers.h"

#include "kubevirt/intercept/nft_rules.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::kubevirt {

Result<PeerDirectory> PeerDirectory::from_config(const KubevirtConfig& config) {
  return from_peers(config.peers, "config key 'kubevirt.peers");
}

Result<PeerDirectory> PeerDirectory::from_peers(const std::vector<KubevirtPeer>& peers, const std::string& prefix) {
  PeerDirectory d;
  for (size_t i = 0; i < peers.size(); ++i) {
    const auto& p = peers[i];
    const std::string where = prefix + "[" + std::to_string(i) + "]";
    auto ep = net::parse_endpoint(p.agent, where + ".agent'");
    if (!ep) return ep.error();
    for (const auto& a : p.handler_addresses) {
      auto fam = ip_family(a, where + ".handlerAddresses'");
      if (!fam) return fam.error();
    }
    d.peers_.push_back(Entry{PeerInfo{p.node, ep.value(), true, ""}, p.handler_addresses});
  }
  return d;
}

Status PeerDirectory::replace(const std::vector<KubevirtPeer>& peers) {
  auto fresh = from_peers(peers, "discovered peer");
  if (!fresh) return fresh.error();
  std::lock_guard lock(mu_);
  for (auto& e : fresh->peers_) {
    for (const auto& old : peers_) {
      if (old.info.node == e.info.node) {
        e.info.healthy = old.info.healthy;
        e.info.unhealthy_reason = old.info.unhealthy_reason;
      }
    }
  }
  peers_ = std::move(fresh->peers_);
  return ok_status();
}

PeerDirectory::PeerDirectory(const PeerDirectory& other) {
  std::lock_guard lock(other.mu_);
  peers_ = other.peers_;
}

PeerDirectory& PeerDirectory::operator=(const PeerDirectory& other) {
  if (this == &other) return *this;
  std::scoped_lock lock(mu_, other.mu_);
  peers_ = other.peers_;
  return *this;
}

std::optional<PeerInfo> PeerDirectory::by_node(const std::string& node) const {
  std::lock_guard lock(mu_);
  for (const auto& e : peers_) {
    if (e.info.node == node) return e.info;
  }
  return std::nullopt;
}

std::optional<PeerInfo> PeerDirectory::by_handler_address(const std::string& ip) const {
  std::lock_guard lock(mu_);
  for (const auto& e : peers_) {
    for (const auto& a : e.handler_addresses) {
      if (a == ip) return e.info;
    }
  }
  return std::nullopt;
}

std::vector<std::string> PeerDirectory::handler_addresses() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  for (const auto& e : peers_) out.insert(out.end(), e.handler_addresses.begin(), e.handler_addresses.end());
  return out;
}

void PeerDirectory::mark_unhealthy(const std::string& node, const std::string& reason) {
  std::lock_guard lock(mu_);
  for (auto& e : peers_) {
    if (e.info.node == node) {
      e.info.healthy = false;
      e.info.unhealthy_reason = reason;
    }
  }
}

void PeerDirectory::mark_healthy(const std::string& node) {
  std::lock_guard lock(mu_);
  for (auto& e : peers_) {
    if (e.info.node == node) {
      e.info.healthy = true;
      e.info.unhealthy_reason.clear();
    }
  }
}

std::vector<PeerInfo> PeerDirectory::unhealthy() const {
  std::lock_guard lock(mu_);
  std::vector<PeerInfo> out;
  for (const auto& e : peers_) {
    if (!e.info.healthy) out.push_back(e.info);
  }
  return out;
}

Status probe_peer(const net::Endpoint& agent, std::chrono::milliseconds timeout) {
  auto fd = net::tcp_connect(agent, timeout);
  if (!fd) return fd.error();
  session::Hello probe;
  probe.kind = session::HelloKind::kProbe;
  RDMIG_TRY(transport::send_message(fd->get(), probe.to_json()));
  auto reply = transport::recv_message(fd->get(), timeout);
  if (!reply) return reply.error();
  if (!session::is(*reply, session::MessageKind::kPong)) return Error{Errc::kProtocol, "peer answered the probe with no pong"};
  return ok_status();
}

}  // namespace rdmig::kubevirt
