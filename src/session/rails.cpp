#include "session/rails.h"

#include <algorithm>

#include "common/log.h"
#include "common/net.h"
#include "session/protocol.h"

namespace rdmig::session {

using nlohmann::json;

std::vector<RailPair> match_rails(const std::vector<RdmaRail>& local, const std::vector<session::RailAddress>& peer) {
  std::vector<RailPair> pairs;
  for (const auto& mine : local) {  // local is in configured (index) order
    for (const auto& theirs : peer) {
      if (theirs.rail != mine.rail) continue;
      RailPair pair{mine.rail, mine, theirs.address, theirs.mtu, {}, std::nullopt};
      // Alternates by index: this agent's configured alternate k with the peer's k, both working.
      for (size_t k = 0; k < mine.alternates.size() && k < mine.alternate_slots.size(); ++k) {
        for (const auto& alt : theirs.alternates) {
          if (alt.index == mine.alternate_slots[k]) {
            pair.alternates.push_back(RailAlternate{alt.index, mine.alternates[k], alt.address});
          }
        }
      }
      pairs.push_back(std::move(pair));
    }
  }
  return pairs;
}

std::vector<session::RailAddress> rail_addresses(const RdmaSupport& rdma) {
  std::vector<session::RailAddress> out;
  for (const auto& r : rdma.rails) out.push_back({r.rail, r.ip, r.mtu});
  return out;
}

std::vector<session::RailAddress> rail_endpoints(const RdmaSupport& rdma) {
  std::vector<session::RailAddress> out;
  for (const auto& r : rdma.rails) {
    session::RailAddress a{r.rail, r.endpoint(), r.mtu, {}};
    for (size_t k = 0; k < r.alternates.size() && k < r.alternate_slots.size(); ++k) {
      a.alternates.push_back({r.alternate_slots[k], r.alternates[k].endpoint()});
    }
    out.push_back(std::move(a));
  }
  return out;
}

bool has_alternates(const RdmaSupport& rdma) {
  return std::any_of(rdma.rails.begin(), rdma.rails.end(), [](const RdmaRail& r) { return !r.alternates.empty(); });
}

std::vector<size_t> alternates_per_rail(const std::vector<RailPair>& rails) {
  std::vector<size_t> out;
  for (const auto& p : rails) out.push_back(p.alternates.size());
  return out;
}

RailPair on_alternate(const RailPair& pair, size_t k) {
  const auto& alt = pair.alternates.at(k);
  return RailPair{pair.rail, alt.local, alt.peer, pair.peer_mtu, {}, alt.index};
}

void add_rails_to_welcome(json& welcome, const RdmaSupport& rdma) {
  welcome["rdmaEndpoint"] = net::format_endpoint(rdma.ip, rdma.port);
  welcome["rdmaRails"] = session::rails_to_json(rail_endpoints(rdma));
}

// A one-device peer: its one address is this agent's first rail's partner.
static std::vector<RailPair> legacy_pair(const RdmaSupport& rdma, const std::string& peer, uint32_t peer_mtu = 0) {
  if (rdma.rails.empty()) return {};
  return {RailPair{rdma.rails.front().rail, rdma.rails.front(), peer, peer_mtu, {}, std::nullopt}};
}

Result<std::vector<RailPair>> rails_from_welcome(const json& welcome, const RdmaSupport& rdma,
                                                 const net::DialPolicy& policy) {
  auto peer = session::parse_rails(welcome, "rdmaRails", session::to_string(session::MessageKind::kWelcome));
  if (!peer) return peer.error();
  std::vector<RailPair> pairs;
  if (peer->empty()) {
    auto ep = transport::get_string(welcome, "rdmaEndpoint", session::to_string(session::MessageKind::kWelcome), 300);
    if (!ep) return ep.error();
    pairs = legacy_pair(rdma, ep.value());
  } else {
    pairs = match_rails(rdma.rails, peer.value());
  }
  for (const auto& p : pairs) {
    const std::string field = "welcome.rdmaRails[rail " + std::to_string(p.rail) + "]";
    auto ep = net::parse_endpoint(p.peer, field);
    if (!ep) return ep.error();
    if (auto ok = policy.check(ep->host, field); !ok) return ok.error();
    for (const auto& alt : p.alternates) {
      const std::string where = field + ".alternates[" + std::to_string(alt.index) + "]";
      auto alt_ep = net::parse_endpoint(alt.peer, where);
      if (!alt_ep) return alt_ep.error();
      if (auto allowed = policy.check(alt_ep->host, where); !allowed) return allowed.error();
    }
  }
  if (pairs.empty()) {
    std::string mine, theirs;
    for (const auto& r : rdma.rails) mine += (mine.empty() ? "" : ",") + std::to_string(r.rail);
    for (const auto& r : peer.value()) theirs += (theirs.empty() ? "" : ",") + std::to_string(r.rail);
    return Error{Errc::kUnavailable, "no RDMA rail in common: this agent's working rails are [" + mine +
                                         "], the target's [" + theirs + "] (rails are matched by index)"};
  }
  return pairs;
}

std::vector<RailPair> rails_from_source(const std::vector<session::RailAddress>& source, const RdmaSupport& rdma,
                                        uint32_t first_mtu) {
  if (source.empty()) return legacy_pair(rdma, "", first_mtu);
  return match_rails(rdma.rails, source);
}

std::vector<RailPair> rails_from_hello(const session::Hello& hello, const RdmaSupport& rdma) {
  return rails_from_source(hello.rdma_rails, rdma, hello.rdma_mtu);
}

std::vector<RailMtu> rail_mtus(const std::vector<session::RailAddress>& source, uint32_t first_mtu,
                               const RdmaSupport& rdma, uint32_t channels) {
  auto pairs = rails_from_source(source, rdma, first_mtu);
  if (pairs.size() > channels) pairs.resize(channels);  // channel c uses matched rail c mod n
  std::vector<RailMtu> out;
  for (const auto& p : pairs) {
    uint32_t mtu = p.peer_mtu;
    // A source that lists its rails without their MTUs gave its first rail's in "rdmaMtu".
    if (mtu == 0 && !source.empty() && source.front().rail == p.rail) mtu = first_mtu;
    out.push_back(RailMtu{p.rail, p.local.device, mtu, p.local.mtu});
  }
  return out;
}

std::vector<RailMtu> rail_mtus(const session::Hello& hello, const RdmaSupport& rdma, uint32_t channels) {
  return rail_mtus(hello.rdma_rails, hello.rdma_mtu, rdma, channels);
}

Result<std::unique_ptr<transport::rdma::RdmaChannel>> connect_on_rail(
    const std::vector<RailPair>& rails, const transport::rdma::ChannelCredentials& credentials,
    const transport::rdma::RdmaChannelParams& params, TransportMetrics& metrics, std::chrono::milliseconds timeout,
    const std::function<bool()>& cancelled) {
  if (rails.empty()) return Error{Errc::kUnavailable, "no RDMA rail to connect on"};
  return connect_over(rails[rail_of_channel(params.index, rails.size())], credentials, params, metrics, timeout,
                      cancelled);
}

Result<std::unique_ptr<transport::rdma::RdmaChannel>> connect_over(
    const RailPair& pair, const transport::rdma::ChannelCredentials& credentials,
    const transport::rdma::RdmaChannelParams& params, TransportMetrics& metrics, std::chrono::milliseconds timeout,
    const std::function<bool()>& cancelled) {
  auto ep = net::parse_endpoint(pair.peer, "rail endpoint");
  if (!ep) return ep.error();
  // Leave through this rail's device, with its traffic class.
  auto ch = transport::rdma::RdmaChannel::connect(ep.value(), credentials, params, metrics, timeout, cancelled,
                                                  {pair.local.ip, pair.local.traffic_class});
  if (!ch) {
    return ch.error().with_context("RDMA channel " + std::to_string(params.index) + " on rail " +
                                   std::to_string(pair.rail) + " (" + pair.local.device + " " + pair.local.ip +
                                   " to " + pair.peer + ")");
  }
  return ch;
}

std::vector<size_t> failover_rails(size_t rails, std::optional<size_t> current) {
  std::vector<size_t> order;
  if (rails == 0) return order;
  const size_t from = current ? *current + 1 : 0;
  for (size_t k = 0; k < rails; ++k) {
    const size_t r = (from + k) % rails;
    if (!current || r != *current) order.push_back(r);
  }
  return order;
}

std::vector<RailUsage> rail_usage(const std::vector<RailPair>& rails, uint32_t channels) {
  // Only the rails that carry a channel (one channel uses rail 0 alone).
  std::vector<RailUsage> out;
  for (uint32_t c = 0; c < channels; ++c) add_channel_to_usage(out, rails, c);
  return out;
}

static std::string rail_words(uint32_t rail, const std::string& device, const std::string& address,
                              const std::string& peer) {
  std::string text = "rail " + std::to_string(rail) + ": " + device;
  if (!address.empty()) text += " " + address;
  if (!peer.empty()) text += " to " + peer;
  return text;
}

std::string rail_of_channel_text(const std::vector<RailUsage>& rails, uint32_t channel) {
  for (const auto& r : rails) {
    if (std::find(r.channels.begin(), r.channels.end(), channel) == r.channels.end()) continue;
    return rail_words(r.rail, r.device, r.address, r.peer_address);
  }
  return {};
}

std::string rail_text(const RailPair& p) {
  std::string text = rail_words(p.rail, p.local.device, p.local.ip, p.peer);
  if (p.alternate) text += " (alternate address " + std::to_string(*p.alternate) + ")";
  return text;
}

const RailPair* find_rail(const std::vector<RailPair>& rails, uint32_t rail) {
  const auto p = std::find_if(rails.begin(), rails.end(), [&](const RailPair& r) { return r.rail == rail; });
  return p == rails.end() ? nullptr : &*p;
}

std::string arrival_rail_text(const std::vector<RailPair>& rails, uint32_t rail, uint32_t address) {
  const RailPair* p = find_rail(rails, rail);
  if (p == nullptr) return "rail " + std::to_string(rail);
  if (address == 0) return rail_text(*p);
  const auto& mine = p->local;
  for (size_t k = 0; k < mine.alternates.size() && k < mine.alternate_slots.size(); ++k) {
    if (mine.alternate_slots[k] + 1 == address) {
      return rail_words(p->rail, mine.alternates[k].device, mine.alternates[k].ip, "") + " (alternate address " +
             std::to_string(address - 1) + ")";
    }
  }
  return "rail " + std::to_string(rail) + " (alternate address " + std::to_string(address - 1) + ")";
}

void ChannelTraffic::set(uint32_t channel, uint64_t sent, uint64_t received, uint64_t chunks_out, uint64_t chunks_in) {
  for (auto* v : {&bytes_sent, &bytes_received, &chunks_sent, &chunks_received}) {
    if (v->size() <= channel) v->resize(channel + 1, 0);
  }
  bytes_sent[channel] = sent;
  bytes_received[channel] = received;
  chunks_sent[channel] = chunks_out;
  chunks_received[channel] = chunks_in;
}

static RailUsage& usage_of_rail(std::vector<RailUsage>& usage, const RailPair& p) {
  auto it = std::find_if(usage.begin(), usage.end(), [&](const RailUsage& u) { return u.rail >= p.rail; });
  if (it == usage.end() || it->rail != p.rail) {
    it = usage.insert(it, RailUsage{p.rail, p.local.device, p.local.gid, p.local.ip, p.peer, {}, 0, 0});
  }
  return *it;
}

void add_channel_to_usage(std::vector<RailUsage>& usage, const std::vector<RailPair>& rails, uint32_t channel) {
  if (rails.empty()) return;
  auto& u = usage_of_rail(usage, rails[rail_of_channel(channel, rails.size())]);
  u.channels.insert(std::upper_bound(u.channels.begin(), u.channels.end(), channel), channel);
}

static std::array<uint64_t, 4> totals_of(const ChannelTraffic& t, uint32_t c) {
  auto at = [c](const std::vector<uint64_t>& v) { return c < v.size() ? v[c] : uint64_t{0}; };
  return {at(t.bytes_sent), at(t.bytes_received), at(t.chunks_sent), at(t.chunks_received)};
}

void move_channel_off_rail(std::vector<RailUsage>& usage, const std::vector<RailPair>& rails, uint32_t channel,
                           std::optional<uint32_t> to, const ChannelTraffic& now) {
  const auto totals = totals_of(now, channel);
  for (auto& u : usage) {
    auto it = std::find(u.channels.begin(), u.channels.end(), channel);
    if (it == u.channels.end()) continue;
    const auto base = u.arrived_at.count(channel) ? u.arrived_at[channel] : std::array<uint64_t, 4>{};
    for (size_t k = 0; k < totals.size(); ++k) u.departed[k] += totals[k] > base[k] ? totals[k] - base[k] : 0;
    u.channels.erase(it);
    u.arrived_at.erase(channel);
  }
  const RailPair* p = to ? find_rail(rails, *to) : nullptr;
  if (p == nullptr) return;
  auto& u = usage_of_rail(usage, *p);
  u.channels.insert(std::upper_bound(u.channels.begin(), u.channels.end(), channel), channel);
  u.arrived_at[channel] = totals;
}

void take_channels_off_rails(std::vector<RailUsage>& usage, const ChannelTraffic& now) {
  std::vector<uint32_t> listed;
  for (const auto& u : usage) listed.insert(listed.end(), u.channels.begin(), u.channels.end());
  for (const uint32_t c : listed) move_channel_off_rail(usage, {}, c, std::nullopt, now);
}

void account_rail_traffic(std::vector<RailUsage>& rails, const ChannelTraffic& by_channel, Metrics& metrics,
                          const std::string& traffic, std::chrono::steady_clock::time_point now) {
  // What the rail's channels carried while on it: each one's totals less what it had counted
  // before it arrived, and what channels that left carried here.
  auto sum = [](const RailUsage& r, const std::vector<uint64_t>& v, size_t k) {
    uint64_t total = r.departed[k];
    for (const uint32_t c : r.channels) {
      const uint64_t carried = c < v.size() ? v[c] : 0;
      const auto base = r.arrived_at.find(c);
      const uint64_t before = base == r.arrived_at.end() ? 0 : base->second[k];
      total += carried > before ? carried - before : 0;
    }
    return total;
  };
  for (auto& r : rails) {
    const std::string label = std::to_string(r.rail);
    // Totals only grow: a channel whose pump is gone counts what it counted last.
    auto grow = [&](uint64_t& total, uint64_t now_total, const char* direction, bool chunks) {
      if (now_total <= total) return;
      if (chunks) metrics.add_rail_chunks(label, r.device, direction, traffic, now_total - total);
      else metrics.add_rail_bytes(label, r.device, direction, traffic, now_total - total);
      total = now_total;
    };
    grow(r.bytes_sent, sum(r, by_channel.bytes_sent, 0), "sent", false);
    grow(r.bytes_received, sum(r, by_channel.bytes_received, 1), "received", false);
    grow(r.chunks_sent, sum(r, by_channel.chunks_sent, 2), "sent", true);
    grow(r.chunks_received, sum(r, by_channel.chunks_received, 3), "received", true);
    if (r.counted_since == std::chrono::steady_clock::time_point{}) {
      r.counted_since = now;
    } else if (const double s = std::chrono::duration<double>(now - r.counted_since).count(); s > 0) {
      r.throughput_bytes_per_second = static_cast<uint64_t>(static_cast<double>(r.bytes_sent + r.bytes_received) / s);
    }
  }
}

}  // namespace rdmig::session
