// The control connection between the two agents of one migration, after the hello:
// JSON messages (start, ready, result, abort) in both directions. A reader thread queues
// what arrives; the job's worker thread takes it with next(). Closed by the destructor.
//
// Failover (fail_over_with(), dataPlane.failover; docs/failover.md): when the connection is lost
// (a read fails and neither this end closed it nor the peer aborted), the reader re-establishes it
// through `Reconnect` until a deadline, as a data channel does (failover_channel.h): each end counts
// the messages it has received, the two counts are exchanged (and proved) on the new connection,
// and each end resends what the other has not received. Every message sent is kept for that (a
// migration sends a handful) until the owner says the peer has it (acknowledged(): a KubeVirt
// flow's heartbeats). A send while the link is down is kept and goes after the resume.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/fd.h"
#include "common/mutex.h"
#include "common/result.h"

namespace rdmig::session {

class ControlLink {
 public:
  explicit ControlLink(UniqueFd fd);
  ~ControlLink();
  ControlLink(const ControlLink&) = delete;
  ControlLink& operator=(const ControlLink&) = delete;

  // One try to re-establish the connection: a fresh connection that proved the session, and the
  // peer's count of this end's messages (after the resume exchange, given this end's `received`).
  // An error with kPermissionDenied (the peer refused: it no longer knows the session) ends the tries.
  // `stopped` turns true when this end closes the link meanwhile (return then).
  using Reconnect = std::function<Result<std::pair<UniqueFd, uint64_t>>(
      uint64_t received, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& stopped)>;
  // One failover done: the loss, how long it took, how many messages were resent.
  using OnFailover = std::function<void(const std::string& reason, std::chrono::milliseconds took, uint64_t resent)>;
  // From now on a lost connection is failed over. Only messages sent from now on are kept: call it
  // before the first message.
  void fail_over_with(Reconnect reconnect, std::chrono::milliseconds deadline, OnFailover on_failover = {})
      EXCLUDES(mu_, fd_mu_);
  // Undoes fail_over_with() (the peer turned out not to fail this link over): nothing more is
  // kept, and a lost connection is lost.
  void stop_failing_over() EXCLUDES(mu_, write_mu_);
  // The peer re-dialled (its side saw the loss first): this end's connection, maybe half-open, is
  // given up now and the reader fails over. No-op without failover. Called before the re-dial is
  // handed to the failover (RedialSlots::hand_over): after, it may shut down the new connection.
  void interrupt() EXCLUDES(fd_mu_);
  // Failover's state, for an owner that watches the peer's silence itself (a KubeVirt flow's
  // heartbeats): true while the reader re-establishes the connection; failovers done so far.
  bool recovering() const { return recovering_.load(); }
  // While the reader re-establishes the connection: what was lost, for how long it has tried and
  // how ("control connection lost (recv: ...), failing over for 1900 ms (2 tries, the last: ...)");
  // nullopt otherwise. For an owner whose session fails meanwhile for another reason (the peer
  // gave up on the link first and aborted over a data channel): its reason names this end's
  // failover too, not only the peer's view of it.
  std::optional<std::string> recovery_state() const EXCLUDES(mu_);
  uint64_t failovers() const { return failovers_.load(); }
  // The messages received so far (what this end would give in a resume exchange).
  uint64_t received() EXCLUDES(mu_);
  // The peer said it has received `peer_has` of this end's messages: those are no longer kept for
  // a resend (a flow's heartbeats carry the count; without it every message sent stays kept). A
  // count beyond what was sent is ignored.
  void acknowledged(uint64_t peer_has) EXCLUDES(write_mu_);

  Status send(const nlohmann::json& message) EXCLUDES(write_mu_);
  // Next message, waiting up to `timeout`: nullopt on timeout, an error once the peer is gone.
  Result<std::optional<nlohmann::json>> next(std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // Waits for a message of `type` (other messages: an "abort" fails, the rest are skipped).
  Result<nlohmann::json> expect(const std::string& type, std::chrono::milliseconds timeout);
  // Puts a message taken with next() back in front, for a later next() or expect().
  void unread(nlohmann::json message) EXCLUDES(mu_);
  void close() EXCLUDES(fd_mu_);
  // The connection's socket now (a failover replaces it).
  int fd() const EXCLUDES(fd_mu_);

 private:
  void reader_loop();
  // The connection was lost with `why`: re-establishes it (true) or gives up (false, closed_ set).
  bool recover(const Error& why) EXCLUDES(mu_, fd_mu_, write_mu_);

  // fd_mu_ guards fd_ and closing_: the socket is replaced by a failover (under write_mu_ too, so
  // that no send writes to a socket being closed) and shut down by close() or interrupt(). Never
  // held across a blocking call; innermost.
  mutable Mutex fd_mu_;
  UniqueFd fd_ GUARDED_BY(fd_mu_);
  bool closing_ GUARDED_BY(fd_mu_) = false;
  // write_mu_ serialises send() so two threads' messages (the worker's, and an abort sent from a
  // REST or cancel thread) never interleave on the socket, and guards the kept messages. Held
  // across the socket write. Callers may hold their own lock around send() (PathCheck::mu_, the
  // jobs' locks). Order: write_mu_ -> fd_mu_; never taken together with mu_.
  Mutex write_mu_;
  std::deque<nlohmann::json> sent_log_ GUARDED_BY(write_mu_);  // every message sent, with failover
  uint64_t sent_ GUARDED_BY(write_mu_) = 0;
  // Guards queue_ and closed_; cv_ signals either changing. Taken by reader_ (queueing each
  // message, or the close; the failover's progress) and by next()/unread() (the owner's worker
  // thread) and recovery_state(). Never held across a socket read.
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::deque<nlohmann::json> queue_ GUARDED_BY(mu_);
  std::optional<Error> closed_ GUARDED_BY(mu_);
  uint64_t received_ GUARDED_BY(mu_) = 0;  // messages queued, ever
  bool peer_aborted_ GUARDED_BY(mu_) = false;
  Reconnect reconnect_ GUARDED_BY(mu_);
  OnFailover on_failover_ GUARDED_BY(mu_);
  std::chrono::milliseconds deadline_ GUARDED_BY(mu_){0};
  // The failover under way (recover()): the loss, its start, the tries that failed so far and
  // the last one's error. recovery_why_ is set only while recover() runs.
  std::optional<Error> recovery_why_ GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point recovery_started_ GUARDED_BY(mu_){};
  uint32_t recovery_tries_ GUARDED_BY(mu_) = 0;
  std::optional<Error> recovery_last_ GUARDED_BY(mu_);
  std::atomic<bool> failover_on_{false};  // set once, with the three above
  std::atomic<bool> recovering_{false};   // the reader is in recover()
  std::atomic<uint64_t> failovers_{0};    // recover() calls that resumed the connection
  std::thread reader_;
};

}  // namespace rdmig::session
