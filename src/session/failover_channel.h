// A data channel that survives its link (docs/failover.md): wraps the channel of one QEMU
// connection between two agents and, when that channel's link fails (a reset, a connection
// closed without an abort, a transport error; never a deliberate abort of either end, a protocol
// error or a lack of memory), re-establishes it through `Reconnect` (another path, or the same
// one again), agrees with the peer on where each direction stopped, resends what the peer has not
// taken, and carries on. QEMU's socket stays open: the pump above sees a stall, not an error.
//
// Exactly once, in order. Each direction numbers its elements (every chunk, then the eof). The
// receiving end counts the elements it has *taken* (handed to the pump by receive(): a taken chunk
// is written to QEMU in full, the link's fate aside); the resume exchange (resume.h) tells each end
// the other's count, and each resends from there. A chunk taken off the old link after its count
// was given is dropped, never delivered: the peer resends it on the new link.
//
// What is kept: every chunk sent and not yet known taken. A credit proves the peer released a chunk,
// and a sender holds at most `depth` chunks without credit, so the last `depth` chunks are all that
// may be needed: a ring of `depth` chunk copies (mapped when first written, ChunkMemory), one
// memcpy per chunk sent. A peer that answers a resume with a count this end cannot have sent, or
// one older than the ring holds, is refused: the channel fails naming both numbers, never
// continues with a hole or a repeat.
//
// Bounded: the first failure starts a deadline; reconnecting is retried (every path `Reconnect`
// knows, each try) until it passes, and then the channel fails with the first failure and every
// try's reason. abort() ends a failover at once.
//
// Threading as transport::Channel: one sending thread (acquire/send/unacquire/send_eof/drain), one
// receiving thread (receive/release), abort() from any. The failover runs on whichever of the two
// met the failure first (or on the watcher, after interrupt()); the other waits for it. A watcher thread
// notices a link that failed while neither was in a call (an end whose directions are both done
// while its peer still waits for credits) within kWatchEvery and fails it over itself. A failover's
// resend never waits for a credit: it resends at most `depth` chunks on a link with `depth` fresh
// credits. A chunk the sender adds while a failover runs is sent by the sender after it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/chunk_memory.h"
#include "common/result.h"
#include "transport/channel.h"

namespace rdmig::session {

// A link re-established by Reconnect: the new channel (same index and chunk size, fresh credits)
// and the peer's count of this end's elements taken, from the resume exchange.
struct Resumed {
  std::unique_ptr<transport::Channel> channel;
  uint64_t peer_taken = 0;
  std::string path;  // what the new link runs over, for logs and status ("tcp 10.0.0.2:7471")
  std::optional<uint32_t> rail{};  // the rail (its number) the new link runs on; none over TCP
  // The paths of dataPlane.failoverPaths tried before this one, each with why it failed ("" when
  // the first path took it): an operator sees why a preferred path was passed over.
  std::string passed_over{};
};

// One failover, as reported to the owner.
// rdmig_failovers_total's `to` for a path a channel resumed on (Resumed::path): "address" (an
// alternate address of a rail's device), "rail" (a rail's own address), "tcp".
std::string failover_destination(const std::string& path);

struct FailoverEvent {
  uint32_t index = 0;
  std::string reason;  // the failure that started it
  std::string path;    // the path it resumed on
  uint64_t resent = 0;  // elements resent
  std::chrono::milliseconds took{0};
  std::string from;  // the transport of the link that failed ("rdma", "tcp")
  std::optional<uint32_t> rail{};  // the rail it resumed on (Resumed::rail); none over TCP
  std::string passed_over{};       // Resumed::passed_over
};

// The words a record and a log give a failover: "channel 3: <why>; resumed on <path> after N ms,
// K chunk(s) resent", then the paths passed over before it, if any.
std::string failover_words(const FailoverEvent& ev);

class FailoverChannel final : public transport::Channel {
 public:
  static constexpr std::chrono::milliseconds kWatchEvery{100};
  // Every link it runs over notices going silent within this (Channel::notice_silent_link_within):
  // TCP's keepalive and user timeout; the RDMA acknowledgement watch's bound is the same.
  static constexpr std::chrono::milliseconds kSilentLinkAfter{5000};
  // Called with this end's taken count (to give the peer), the failure, the deadline, and a
  // predicate that turns true when the channel is aborted meanwhile (return then). One call is one
  // try over one path; it is called again (after a short pause) until the deadline.
  using Reconnect = std::function<Result<Resumed>(uint64_t taken, const Error& why,
                                                  std::chrono::steady_clock::time_point deadline,
                                                  const std::function<bool()>& stopped)>;
  using OnFailover = std::function<void(const FailoverEvent&)>;

  FailoverChannel(std::unique_ptr<transport::Channel> first, uint32_t depth, std::chrono::milliseconds deadline,
                  Reconnect reconnect, OnFailover on_failover = {});
  ~FailoverChannel() override;

  Result<std::span<std::byte>> acquire() override;
  Status send(size_t n) override;
  void unacquire() override;
  Status send_eof() override;
  Status drain() override;
  Result<transport::ChunkView> receive() override;
  Status release() override;
  void abort(const Error& reason) override;
  bool link_failed() const override { return false; }  // its own failures are final
  uint32_t index() const override { return index_; }
  size_t chunk_size() const override { return chunk_size_; }
  const char* transport() const override;

  // The link is known gone (the peer re-dialled this channel): the watcher fails it over at once,
  // as if a call had failed with `why`. Never blocks; no-op while a failover runs or after the
  // channel failed, and dropped when a failover ends before the watcher gets to it (the link's own
  // error started one, which took the re-dial this announced: failing over again would drop the
  // new link, and the peer would fail over a second time for nothing). Called before the re-dial is
  // handed to the failover (RedialSlots::hand_over), never after: that failover may have made it
  // the live link by then.
  void interrupt(const Error& why);

  // True once the channel failed for good (aborted, refused, out of time): nothing resumes it.
  bool failed() const;
  uint64_t failovers() const;
  std::optional<std::string> last_failover() const;
  // Elements this end has taken / sent (tests).
  uint64_t taken() const;
  uint64_t sent() const;
  // The channel currently carried over (for reports); valid while the caller holds no other call.
  std::string path() const;

 private:
  using Clock = std::chrono::steady_clock;
  // The live channel and its generation; waits while a failover runs. Error once failed.
  Result<std::pair<transport::Channel*, uint64_t>> current();
  // A call on generation `gen` failed with `e`: fails over (or waits for the failover another
  // thread runs). OK when the channel carries on (on a newer generation).
  Status recover(uint64_t gen, const Error& e);
  // The failover itself, on the calling thread; failing_ is set and mu_ not held.
  Status fail_over(const Error& first);
  // Resends elements [from, upto) on `ch`; never waits for a credit (at most depth of them).
  Status resend(transport::Channel& ch, uint64_t from, uint64_t upto);
  Status send_kept(transport::Channel& ch, uint64_t seq);
  // Runs `op` on the live channel (pinned while it runs), failing over and trying again on the next
  // link when it fails, until it succeeds, the channel fails, or a failover's resend has covered
  // element `covered` (then `op` is not owed).
  Status on_live(std::optional<uint64_t> covered, const std::function<Status(transport::Channel&)>& op);
  void fail_locked(const Error& e);
  void prune_locked();  // frees retired channels nothing refers to any more
  void watch();         // the watcher thread

  const uint32_t index_;
  const size_t chunk_size_;
  const uint32_t depth_;
  const std::chrono::milliseconds deadline_;
  Reconnect reconnect_;
  OnFailover on_failover_;

  // Guards every member below (the ring's bytes are written by the sending thread under it only
  // for chunks the failover may read: see send()). cv_ signals the end of a failover, a failure
  // and an abort. Never held across a call into a channel or into reconnect_.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<transport::Channel> cur_;
  uint64_t gen_ = 0;
  std::string path_;
  // Channels of earlier generations, kept while an acquired buffer or a received view is theirs.
  std::deque<std::pair<uint64_t, std::unique_ptr<transport::Channel>>> retired_;
  bool failing_ = false;
  bool aborted_ = false;
  std::optional<Error> failed_;
  uint64_t failovers_ = 0;
  std::optional<std::string> last_reason_;

  // Sending: elements numbered from 0; sent_ counts them (chunks and the eof). The ring keeps the
  // last depth_ chunks: chunk s at slot s % depth_, its size in sizes_.
  ChunkMemory ring_;
  std::vector<size_t> sizes_;
  uint64_t sent_ = 0;
  std::optional<uint64_t> eof_seq_;
  // The acquired buffer the pump fills: its generation (nullopt: none held).
  std::optional<uint64_t> acq_gen_;
  std::span<std::byte> acq_buf_;
  // Elements the last failover's resend covered ([.., resent_upto_) went on generation gen_).
  uint64_t resent_upto_ = 0;

  // Receiving: elements taken; the held view's generation (nullopt: none).
  uint64_t taken_ = 0;
  std::optional<uint64_t> view_gen_;
  bool closing_ = false;  // the destructor runs: the watcher ends
  std::optional<Error> interrupt_;  // interrupt() asked the watcher to fail over
  uint64_t interrupt_gen_ = 0;       // the link (generation) interrupt_ was raised for

  std::thread watcher_;  // last: started once everything above exists
};

}  // namespace rdmig::session
