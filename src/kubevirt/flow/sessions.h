// The two ends of a carried KubeVirt migration.
//   SourceSession: made when the hook arms a migration (or, in static mode, when the first
//     connection to a peer handler arrives); each intercepted connection becomes one channel,
//     in accept order, and is told apart as QEMU's main channel, multifd or block.
//   TargetSession: made by the data-plane server for a "flow" hello; dials each channel's
//     original destination from inside the target virt-handler's network namespace that owns
//     it (never from the host's), in the source's order, and reports libvirt's figures.
//     Nothing depends on that order being QEMU's: KubeVirt's proxies dial in no fixed order,
//     and QEMU 8+ tells its channels apart by their first bytes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <optional>
#include <set>
#include <thread>

#include "common/net.h"
#include "config/agent_config.h"
#include "kubevirt/flow/flow_protocol.h"
#include "kubevirt/flow/flow_session.h"
#include "kubevirt/intercept/netns.h"
#include "kubevirt/peers/peers.h"
#include "common/token_source.h"
#include "session/data_plane_server.h"
#include "session/rail_failover.h"
#include "session/redial_slots.h"
#include "transport/rdma/rdma_listener.h"

namespace rdmig::kubevirt {

// A KubeVirt flow's ring depth: kubevirt.ringDepth when set, else enough chunks of
// migration.chunkSize for kFlowInFlightBytes (4 MiB), at least 4: four of the default 1 MiB
// chunks; sixteen of 256 KiB, where four stalled a single channel on credits (bench/relay_floor.py).
inline constexpr uint64_t kFlowInFlightBytes = 4ull << 20;
inline uint32_t flow_ring_depth(uint32_t configured, uint64_t chunk_size) {
  if (configured != 0) return configured;
  const uint64_t chunks = chunk_size == 0 ? 4 : (kFlowInFlightBytes + chunk_size - 1) / chunk_size;
  return static_cast<uint32_t>(chunks < 4 ? 4 : chunks);
}

// Chunk buffers held against migration.bufferBudget; released when the last copy goes.
using BufferTicket = std::shared_ptr<void>;

struct SessionContext {
  const AgentConfig& config;
  Metrics& metrics;
  const session::RdmaSupport& rdma;
  // The agents' shared API token (HMAC key of the session challenge); follows its file.
  std::shared_ptr<TokenSource> token;
  // Takes `bytes` of the agent's buffer budget for one channel (`what` names it in the error),
  // beside the bare-QEMU jobs' buffers; kResourceExhausted when they do not fit.
  std::function<Result<BufferTicket>(uint64_t bytes, const std::string& what)> take_buffers;
};

// A flow channel's buffers on one agent: its ring each way (as a bare-QEMU job counts them), and
// with failover the ring of chunks kept until the peer took them (docs/failover.md): x 3.
inline uint64_t flow_channel_buffers(uint64_t chunk_size, uint32_t ring_depth, bool failover = false) {
  return chunk_size * ring_depth * (failover ? 3 : 2);
}

class SourceSession final : public FlowSession {
 public:
  // With multifd connections that drain (set_multifd_on_failure: drain, or auto), a failure
  // resets QEMU's main channel and drains the other memory connections for up to this long
  // (ChannelPump::drain_on_failure): QEMU 7.2 fails on its main channel and ends its multifd
  // threads itself. KubeVirt's proxy never passes QEMU's
  // close on to this side, so a drain normally ends at QEMU's silence (kMultifdDrainIdle).
  static constexpr std::chrono::milliseconds kMultifdDrainLimit = session::kMultifdDrainLimit;
  // Connects to the peer agent, proves the shared token and agrees on the transport.
  static Result<std::unique_ptr<SourceSession>> open(const SessionContext& ctx, const PeerInfo& peer, FlowRecord record,
                                                     std::chrono::milliseconds timeout);
  // The classes of the target's published ports (targetDirectMigrationNodePorts). Without
  // them (static mode) every connection counts as memory. Call before the first connection.
  void set_port_classes(std::vector<PublishedPort> ports) { port_classes_ = std::move(ports); }
  // Carries one intercepted connection as the next channel. What a failure does to it
  // depends on what it carries: QEMU's main memory channel is reset (QEMU fails there at
  // once), the other memory connections (multifd) drain, block (NBD) connections are reset.
  // The main channel is the memory connection whose first bytes are QEMU's stream header
  // ("QEVM", visible when KubeVirt's TLS is off), else the first one to the memory port: in a
  // block migration the disks' connections come first, and KubeVirt's proxy dials each
  // connection in its own goroutine, so "connection 0" means nothing.
  Status add_connection(UniqueFd fd, const net::Endpoint& destination);
  // What a failure does to the multifd connections (kubevirt.multifdOnFailure; for "auto"
  // decided once the source launcher's QEMU version is known). Until then they drain. With
  // `drain` false every connection, those carried already included, is reset on a failure
  // with the main channel. `by` says why, for the record and the log.
  void set_multifd_on_failure(bool drain, const std::string& by);
  // Tells the target the migration is over; waits (bounded) for libvirt's figures. After a switch
  // to post-copy the target's libvirt has none: `own_figures` (when given) then reads the source's
  // completed job, and the record takes those.
  using OwnFigures = std::function<Result<LibvirtJobStats>()>;
  void finish(const OwnFigures& own_figures = {});
  const std::string& peer_node() const { return peer_.node; }
  ~SourceSession() override;

 private:
  SourceSession(std::string id, FlowRecord record, const SessionContext& ctx, PeerInfo peer);
  // The control link's thread (from open() until the figures came or the session failed):
  // heartbeats both ways; an abort from the peer, its loss or its silence fails the session.
  void reader_loop();
  Result<std::unique_ptr<transport::Channel>> connect_channel(uint32_t index);
  // Failover (docs/failover.md): one try of channel `index`'s re-dial over the paths
  // dataPlane.failoverPaths lists (session::redial_over_paths): another rail (`current`: the rail
  // it ran over, none for TCP; set to where it resumed), then TCP.
  Result<session::Resumed> redial(uint32_t index, std::optional<session::RailSpot>& current, uint64_t taken,
                                  std::chrono::steady_clock::time_point deadline, const std::function<bool()>& stopped);
  // Over matched rail `rail`: an RDMA connect request proved as the channel's first connect, then
  // the resume exchange over the new channel (session::redial_over_rail).
  Result<session::Resumed> redial_rail(uint32_t index, session::RailSpot spot, uint64_t taken,
                                       std::chrono::steady_clock::time_point deadline, const std::function<bool()>& stopped);
  // Over TCP: the target agent's data port with a flow-data hello marked resume, proved with the
  // channel's key, resumed (this end's `taken`).
  Result<session::Resumed> redial_tcp(uint32_t index, uint64_t taken, std::chrono::steady_clock::time_point deadline);
  // The control link's failover (fail_over_control): re-dialled to the target agent with a
  // flow-data hello marked resume and control, proved over kControlIndex, resumed (this end's
  // `received`); the connection and the target's count of this end's messages.
  Result<std::pair<UniqueFd, uint64_t>> redial_control(uint64_t received, std::chrono::steady_clock::time_point deadline);
  // rdma_cm could not reach the target before any channel went over RDMA: tells the target
  // and carries this and every later connection over TCP (kPeerRdmaUnreachable); an error
  // naming why when that is not allowed (rdma required, or RDMA worked before).
  Status fall_back_to_tcp(const Error& rdma_error);
  int port_class(uint16_t port) const;
  // From a memory connection's pump thread: its first bytes name what it carries.
  void saw_first_bytes(uint32_t index, session::ChannelPump& self, std::span<const std::byte> head);

  SessionContext ctx_;
  std::vector<PublishedPort> port_classes_;
  PeerInfo peer_;
  std::string channel_key_;  // what every channel proves (set in open())
  std::string transport_;  // the interception thread only, after open()
  bool rdma_settled_ = false;  // a channel went over RDMA (the interception thread only)
  std::optional<Error> no_rail_;  // no RDMA rail in common with the target (set in open())
  // Where a failed channel may go (set in open(); failover_rails_ cleared by a fallback to TCP
  // before any channel exists; read by the channels' failovers).
  std::atomic<bool> failover_rails_{false};
  std::atomic<bool> failover_addresses_{false};  // another address of a rail's device ("failoverAddresses")
  bool failover_tcp_ = false;
  std::vector<BufferTicket> buffers_;  // one per channel (the interception thread only)
  uint32_t next_index_ = 0;  // the interception thread only
  bool drain_multifd_ GUARDED_BY(mu_) = true;
  // The target's answer to "end" (its "stats", or why none comes), handed from the reader to finish().
  // Guards finishing_, closing_ and reply_; reply_cv_ signals reply_. Taken by reader_ (the
  // control thread), finish() (the relay's worker that ends the session) and the destructor.
  // Held only for those fields: finish() sends "end" with it released. No lock under it.
  Mutex reply_mu_;
  std::condition_variable reply_cv_;
  bool finishing_ GUARDED_BY(reply_mu_) = false;
  bool closing_ GUARDED_BY(reply_mu_) = false;
  std::optional<Result<nlohmann::json>> reply_ GUARDED_BY(reply_mu_);
  std::thread reader_;
};

// Where a destination may be dialled from: the network namespace of the virt-handler that owns
// its address and listens on its port; an error (nothing is dialled) otherwise.
using NetnsLocator = std::function<Result<std::shared_ptr<NetNs>>(const net::Endpoint& destination)>;
// Reads libvirt's completed-job figures of the migrated VMI on this node.
using StatsReader = std::function<Result<LibvirtJobStats>(const VmiRef& vmi)>;

// Decides, once the source proved the token and before the welcome, whether a session may be
// carried here and where it may dial; an error refuses the session (nothing is dialled).
using Admission = std::function<Result<NetnsLocator>(const session::Hello& hello)>;

class TargetSession final : public FlowSession {
 public:
  // `publish` makes the session findable by its channels (the relay's session table) and runs
  // before the welcome goes out: a source may connect its first channel the moment it reads the
  // welcome. An error from it refuses the session; a welcome that cannot be sent fails the
  // published session (the relay drops ended sessions).
  using Publish = std::function<Status(const std::shared_ptr<TargetSession>&)>;
  static Result<std::shared_ptr<TargetSession>> accept(const SessionContext& ctx, UniqueFd fd, const session::Hello& hello,
                                                       const Admission& admit, StatsReader stats,
                                                       const Publish& publish = {});
  ~TargetSession() override;
  void start();
  const std::string& session_key() const { return hello_.session; }
  // A TCP channel that arrives before the source's "fallback" waits for it this long.
  static constexpr std::chrono::seconds kFallbackWait{5};
  // What channel `index` must prove before it is admitted (transport/channel_proof.h).
  transport::ChannelTerms channel_terms(uint32_t index) const { return {channel_key_, hello_.session, index}; }
  // A TCP channel whose proof was checked (`welcome_proof`: this side's answer, sent in the
  // welcome): admitted against migration.bufferBudget when its index is free.
  // `tls`: the source's hello asked for TLS (dataPlane.tls); refused ("tls_mismatch") unless this
  // agent's config says the same, then the handshake runs before the channel is made.
  Status add_tcp_channel(UniqueFd fd, uint32_t index, const std::string& welcome_proof, bool tls);
  // A TCP connection the source re-dialled to fail channel `index` over (hello resume; its proof
  // checked, `welcome_proof` the answer): admitted only when this session fails over and channel
  // `index` is live here (that channel then gives up its link and takes this one); refused
  // ("permission_denied") otherwise, displacing nothing.
  Status resume_tcp_channel(UniqueFd fd, uint32_t index, const std::string& welcome_proof, bool tls);
  // The control link the source re-dialled to fail it over (hello resume and control; its proof,
  // over kControlIndex, checked): admitted only while this session fails its control link over and
  // has not ended (the link then gives up its connection and takes this one); refused
  // ("permission_denied") otherwise, displacing nothing.
  Status resume_control_link(UniqueFd fd, const std::string& welcome_proof);
  // Checks the request's proof (before any budget or index is taken), then admits the channel; for
  // a channel that runs, only as a rail failover's re-dial where this end offered it
  // (failoverRails) and the channel is live here (kAlreadyExists, kPermissionDenied otherwise:
  // nothing displaced).
  Result<transport::rdma::AcceptPlan> rdma_plan(const transport::rdma::ConnectRequest& request);

 private:
  TargetSession(std::string id, FlowRecord record, const SessionContext& ctx, session::Hello hello, NetnsLocator locate,
                StatsReader stats);
  void reader_loop();
  // The source's "fallback": rdma_cm could not reach this agent; carry over TCP from now on.
  Status fall_back_to_tcp(const std::string& why);
  void try_start_locked(uint32_t index) REQUIRES(conn_mu_);
  // With failover: `channel` wrapped in a FailoverChannel that waits for the source's re-dial.
  std::unique_ptr<transport::Channel> for_failover(std::unique_ptr<transport::Channel> channel);
  // A channel's failover on this end: takes the source's re-dial of `index` from redials_
  // (session::RedialSlots: waits until `deadline`), resumes it and runs its TLS again.
  Result<session::Resumed> reaccept(uint32_t index, uint64_t taken, std::chrono::steady_clock::time_point deadline,
                                    const std::function<bool()>& stopped);
  // The control link's failover on this end: takes the source's re-dial from redials_ (waits until
  // `deadline`) and resumes it with this end's `received`.
  Result<std::pair<UniqueFd, uint64_t>> reaccept_control(uint64_t received, std::chrono::steady_clock::time_point deadline,
                                                         const std::function<bool()>& stopped);
  // A rail failover's re-dial of live channel `index` that arrived on this agent's rail `rail` (its
  // address `address`: 0 its own, k its alternate k-1): its channel is handed to the channel's
  // failover (redials_), which resumes it over the channel itself.
  transport::rdma::AcceptPlan rail_redial_plan(uint32_t index, uint32_t rail, uint32_t address);
  // What a first accept and a rail re-dial of channel `index` share: the session's channel key, the
  // channel's parameters (this end receives the stream, sends the return path), the RDMA metrics.
  transport::rdma::AcceptPlan accept_plan(uint32_t index);
  Result<UniqueFd> dial_in_order(uint32_t index);
  void report_and_succeed();
  void wake() override;

  SessionContext ctx_;
  session::Hello hello_;
  std::string channel_key_;  // set in accept(), read-only after
  // This end offered failoverRails in its welcome: a connect request for a live channel is its
  // rail failover's re-dial (set in accept() before the session is published, read-only after).
  bool failover_rails_ = false;
  // Likewise failoverAddresses: this agent's alternate addresses take re-dials of a rail's channels.
  bool failover_addresses_ = false;
  transport::ProofLedger rdma_proofs_;
  // Failover: the source's re-dials, until a channel's failover takes one (its own lock). Declared
  // before channels_: a channel not started yet may wait in it while channels_ is destroyed.
  session::RedialSlots redials_;
  NetnsLocator locate_;
  StatsReader stats_;
  std::string transport_ GUARDED_BY(conn_mu_);

  // Guards transport_ (set by accept() before the session is published), channels_,
  // destinations_, started_, admitting_, rdma_settled_, buffers_, next_dial_ and stopping_;
  // conn_cv_ signals the fallback, the dial turn and the stop. Taken by reader_ (open,
  // fallback), the data-plane accept threads (add_tcp_channel; released for the TLS handshake
  // only), the RDMA CM thread (rdma_plan, its deliver), each pump's dial_in_order and
  // wake()/the destructor. Lock order: conn_mu_ -> FlowSession::mu_ (fall_back_to_tcp,
  // ended(), record()) -> legs_mu_ (add_leg from try_start_locked), and conn_mu_ -> the
  // relay's budget_mu_ (take_buffers). add_tcp_channel writes the welcome to the channel's
  // socket under it. rdma_proofs_ has its own lock (ProofLedger).
  Mutex conn_mu_;
  std::condition_variable conn_cv_;
  std::vector<std::unique_ptr<transport::Channel>> channels_ GUARDED_BY(conn_mu_);  // by index, until started
  std::vector<std::optional<net::Endpoint>> destinations_ GUARDED_BY(conn_mu_);
  std::vector<bool> started_ GUARDED_BY(conn_mu_);
  std::set<uint32_t> admitting_ GUARDED_BY(conn_mu_);  // indices whose TLS handshake runs (without conn_mu_)
  bool rdma_settled_ GUARDED_BY(conn_mu_) = false;  // an RDMA channel was delivered
  std::vector<BufferTicket> buffers_ GUARDED_BY(conn_mu_);  // one per channel, held until the session goes
  uint32_t next_dial_ GUARDED_BY(conn_mu_) = 0;
  bool stopping_ GUARDED_BY(conn_mu_) = false;
  std::thread reader_;
};

}  // namespace rdmig::kubevirt
