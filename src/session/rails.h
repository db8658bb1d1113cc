// Striping one session's channels across RDMA rails (several RDMA NICs per node).
//
// The rule, the same on both agents: the rails both agents have working are matched by index
// (rdma.devices[i] on the source with rdma.devices[i] on the target), in index order; with n
// matched rails, channel c (0 = QEMU's main channel, then each multifd channel) uses matched
// rail c mod n. So with 2 rails on one node and 1 on the other, n = 1; a rail that is down on
// either node at start is left out of the match. Operators list the rails in the same order
// (same subnet per index) on every node. A peer that advertises one endpoint only (one device,
// or an agent that predates rails) is one rail, matched with this agent's first working rail.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/dial_policy.h"
#include "common/result.h"
#include "metrics/metrics.h"
#include "session/data_plane_server.h"
#include "session/transport_choice.h"
#include "session/types.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/wire.h"

namespace rdmig::session {

// An alternate address of a matched rail (rdma.devices[i].alternateAddresses[index] on both
// agents): this agent's on the device, and the peer's rdma_cm endpoint (on the source).
struct RailAlternate {
  uint32_t index = 0;
  RdmaRail local;
  std::string peer;
};

struct RailPair {
  uint32_t rail = 0;   // the index both agents configured it under
  RdmaRail local;      // this agent's device on it
  std::string peer;    // the peer's address on it (the target's rdma_cm endpoint, on the source)
  uint32_t peer_mtu = 0;  // the peer's port's active MTU on it, when the peer said (0: unknown)
  // The alternates both agents have working, by index (source side, from the target's welcome;
  // empty on the target): failover paths of this rail's channels ("address").
  std::vector<RailAlternate> alternates{};
  // Set by on_alternate: this pair is the rail over its alternate address `*alternate`.
  std::optional<uint32_t> alternate{};
};
// The same rail over its alternate `k` (an index into `pair.alternates`): the same rail number and
// device, the alternate's local address, GID and the peer's endpoint on it.
RailPair on_alternate(const RailPair& pair, size_t k);

// Whether any of this agent's working rails has an alternate address that listens.
bool has_alternates(const RdmaSupport& rdma);
// Per matched rail, how many alternates it has (session::FailoverPaths::alternates).
std::vector<size_t> alternates_per_rail(const std::vector<RailPair>& rails);

// The matched rails (rule above). `peer` empty: nothing to match (the peer has no RDMA).
std::vector<RailPair> match_rails(const std::vector<RdmaRail>& local, const std::vector<session::RailAddress>& peer);
// Index into the matched rails of the rail carrying `channel`; `rails` > 0.
inline size_t rail_of_channel(uint32_t channel, size_t rails) { return channel % rails; }

// What this agent advertises: its rails' addresses (the source's hello) or rdma_cm endpoints
// (the target's welcome).
std::vector<session::RailAddress> rail_addresses(const RdmaSupport& rdma);
std::vector<session::RailAddress> rail_endpoints(const RdmaSupport& rdma);
// The welcome's RDMA part: "rdmaRails" plus "rdmaEndpoint" (the first rail) for a one-device peer.
void add_rails_to_welcome(nlohmann::json& welcome, const RdmaSupport& rdma);

// Source side: the rails to use from the target's welcome ("rdmaRails", else "rdmaEndpoint" as
// one rail). kUnavailable when the two agents have no rail index in common. The source connects
// to these addresses on the target's word, so each passes `policy` (the agent's peer dial policy,
// common/dial_policy.h) or the welcome is refused naming the rail (kInvalidArgument).
Result<std::vector<RailPair>> rails_from_welcome(const nlohmann::json& welcome, const RdmaSupport& rdma,
                                                 const net::DialPolicy& policy);
// Target side: the same match from the source's hello (peer = the source's address on each rail).
std::vector<RailPair> rails_from_hello(const session::Hello& hello, const RdmaSupport& rdma);
// The same from the source's advertised rails as such (a KubeVirt flow hello's "rdmaRails"); a
// source that lists none is one rail, whose port MTU is `first_mtu` (0: unknown).
std::vector<RailPair> rails_from_source(const std::vector<session::RailAddress>& source, const RdmaSupport& rdma,
                                        uint32_t first_mtu = 0);

// Target side: the two ports' active MTUs on each matched rail that carries one of `channels`
// channels (source: the hello's per-rail "mtu", else its "rdmaMtu" for the source's first rail;
// target: this agent's rail), for choose_transport.
std::vector<RailMtu> rail_mtus(const session::Hello& hello, const RdmaSupport& rdma, uint32_t channels);
// The same from the source's rails as such (`first_mtu`: the MTU of the source's first rail when
// its entry gives none).
std::vector<RailMtu> rail_mtus(const std::vector<session::RailAddress>& source, uint32_t first_mtu,
                               const RdmaSupport& rdma, uint32_t channels);

// Source side: connects channel `params.index` from its rail's local address (and traffic class)
// to the peer's endpoint on that rail, proving the session's channel key; the error names the rail.
Result<std::unique_ptr<transport::rdma::RdmaChannel>> connect_on_rail(
    const std::vector<RailPair>& rails, const transport::rdma::ChannelCredentials& credentials,
    const transport::rdma::RdmaChannelParams& params, TransportMetrics& metrics, std::chrono::milliseconds timeout,
    const std::function<bool()>& cancelled);

// The same over one given rail (a rail failover's re-dial).
Result<std::unique_ptr<transport::rdma::RdmaChannel>> connect_over(
    const RailPair& rail, const transport::rdma::ChannelCredentials& credentials,
    const transport::rdma::RdmaChannelParams& params, TransportMetrics& metrics, std::chrono::milliseconds timeout,
    const std::function<bool()>& cancelled);

// The rails (indexes into the `rails` matched rails) a channel whose link failed on rail `current`
// (nullopt: it ran over TCP) is re-dialled over, in order: the rails after `current`, wrapping
// around, never `current` itself (its link just failed; a channel on the only rail has none).
std::vector<size_t> failover_rails(size_t rails, std::optional<size_t> current);

// One entry per matched rail that carries a channel, with those channels (no bytes yet).
std::vector<RailUsage> rail_usage(const std::vector<RailPair>& rails, uint32_t channels);

// The rail that carries `channel`, in words for an error: "rail 1: mlx5_1 10.10.1.1 to
// 10.10.1.2:7472"; empty when no rail lists the channel (TCP).
std::string rail_of_channel_text(const std::vector<RailUsage>& rails, uint32_t channel);
// The same words for one matched rail; over an alternate address, followed by " (alternate
// address k)".
std::string rail_text(const RailPair& rail);
// The matched rail numbered `rail` (RailPair::rail), or nullptr.
const RailPair* find_rail(const std::vector<RailPair>& rails, uint32_t rail);
// Target side: the rail a re-dial's connect request arrived on (`rail`: the index of this agent's
// rail whose listener took it), in the same words from this end ("rail 1: mlx5_1 10.10.1.2 to
// 10.10.1.1": this agent's device and address, the source's address); "rail 1" when no matched
// rail has that index.
// `address` > 0: it arrived on this agent's alternate address `address - 1` of that rail ("rail 0:
// mlx5_0 10.20.0.2 (alternate address 0)").
std::string arrival_rail_text(const std::vector<RailPair>& rails, uint32_t rail, uint32_t address = 0);
// Adds `channel` to the usage entry of its rail among `rails` (made when it is the rail's first,
// the entries kept in rail order): for sessions whose channels arrive one by one (KubeVirt's).
void add_channel_to_usage(std::vector<RailUsage>& usage, const std::vector<RailPair>& rails, uint32_t channel);

// Per-channel totals (channel c at index c); a vector shorter than the channel count counts 0.
struct ChannelTraffic {
  std::vector<uint64_t> bytes_sent, bytes_received, chunks_sent, chunks_received;
  // Channel `channel`'s totals (the vectors grown to hold it).
  void set(uint32_t channel, uint64_t sent, uint64_t received, uint64_t chunks_out, uint64_t chunks_in);
};
// A failover moved `channel` off the rail it ran on: to rail number `to` (a rail of `rails`,
// another rail of the session) or to TCP (nullopt). What the channel carried so far (`now`, its
// totals at the move) stays counted on the rail it left; what it carries from now on counts on
// `to`, and rail_of_channel_text names `to` for it (nothing, over TCP). A channel no rail lists
// (it ran over TCP) only arrives.
void move_channel_off_rail(std::vector<RailUsage>& usage, const std::vector<RailPair>& rails, uint32_t channel,
                           std::optional<uint32_t> to, const ChannelTraffic& now);
// Every channel `usage` lists leaves its rail for good (a post-copy recovery retired them all):
// move_channel_off_rail to TCP with its totals `now`, so what each carried stays counted on its
// rail and a fresh channel of the same number counts on none.
void take_channels_off_rails(std::vector<RailUsage>& usage, const ChannelTraffic& now);
// Sets each rail's byte and chunk totals from the channels it carries, adds what grew to
// rdmig_rdma_rail_bytes_total and rdmig_rdma_rail_chunks_total{traffic}, and its throughput
// (both ways, averaged since the first call for the rail, `now`).
void account_rail_traffic(std::vector<RailUsage>& rails, const ChannelTraffic& by_channel, Metrics& metrics,
                          const std::string& traffic,
                          std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());

}  // namespace rdmig::session
