#include "session/failover_channel.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/log.h"

namespace rdmig::session {

namespace {

std::string ms_text(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

}  // namespace

FailoverChannel::FailoverChannel(std::unique_ptr<transport::Channel> first, uint32_t depth,
                                 std::chrono::milliseconds deadline, Reconnect reconnect, OnFailover on_failover)
    : index_(first->index()),
      chunk_size_(first->chunk_size()),
      depth_(std::max<uint32_t>(depth, 1)),
      deadline_(deadline),
      reconnect_(std::move(reconnect)),
      on_failover_(std::move(on_failover)),
      cur_(std::move(first)),
      sizes_(depth_, 0),
      watcher_([this] { watch(); }) {
  cur_->notice_silent_link_within(kSilentLinkAfter);
}

FailoverChannel::~FailoverChannel() {
  {
    std::lock_guard lock(mu_);
    closing_ = true;
    aborted_ = true;  // ends a failover the watcher may run
    cv_.notify_all();
  }
  watcher_.join();
}

void FailoverChannel::watch() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait_for(lock, kWatchEvery, [&] { return closing_ || interrupt_.has_value(); });
    if (closing_ || failed_) return;
    std::optional<Error> why = std::exchange(interrupt_, std::nullopt);
    if (why && interrupt_gen_ != gen_) why.reset();  // that link was failed over since (see interrupt())
    if (failing_) continue;
    if (!why) {
      if (!cur_->link_failed()) continue;
      // The link's own error says what failed ("connection reset by peer", a work completion's
      // status, the acknowledgement watch's stall).
      const std::string tag = "channel " + std::to_string(index_) + ": ";
      std::string cause = cur_->link_failure() ? cur_->link_failure()->message : std::string();
      if (cause.starts_with(tag)) cause.erase(0, tag.size());  // named once
      why = Error{Errc::kUnavailable, tag + "the link failed while the channel was idle" + (cause.empty() ? "" : ": " + cause)};
    }
    failing_ = true;
    lock.unlock();
    LOG_INFO("failover") << "channel " << index_ << ": " << why->message;
    (void)fail_over(*why);
    lock.lock();
  }
}

const char* FailoverChannel::transport() const {
  std::lock_guard lock(mu_);
  return cur_->transport();
}

std::string failover_destination(const std::string& path) {
  if (!path.starts_with("rdma")) return "tcp";
  return path.find("(alternate address ") != std::string::npos ? "address" : "rail";
}

std::string failover_words(const FailoverEvent& ev) {
  // Most reasons name the channel already ("channel 3: send: ..."): say it once.
  const std::string tag = "channel " + std::to_string(ev.index) + ": ";
  std::string what = (ev.reason.starts_with(tag) ? "" : tag) + ev.reason + "; resumed on " + ev.path + " after " +
                     std::to_string(ev.took.count()) + " ms, " + std::to_string(ev.resent) + " chunk(s) resent";
  if (!ev.passed_over.empty()) what += " (passed over: " + ev.passed_over + ")";
  return what;
}

std::string FailoverChannel::path() const {
  std::lock_guard lock(mu_);
  return path_;
}

bool FailoverChannel::failed() const {
  std::lock_guard lock(mu_);
  return failed_.has_value();
}

uint64_t FailoverChannel::failovers() const {
  std::lock_guard lock(mu_);
  return failovers_;
}

std::optional<std::string> FailoverChannel::last_failover() const {
  std::lock_guard lock(mu_);
  return last_reason_;
}

uint64_t FailoverChannel::taken() const {
  std::lock_guard lock(mu_);
  return taken_;
}

uint64_t FailoverChannel::sent() const {
  std::lock_guard lock(mu_);
  return sent_;
}

void FailoverChannel::fail_locked(const Error& e) {
  if (!failed_) failed_ = e;
  cv_.notify_all();
}

void FailoverChannel::prune_locked() {
  if (failing_) return;
  std::erase_if(retired_, [&](const auto& r) {
    return r.first != (acq_gen_ ? *acq_gen_ : gen_) && r.first != (view_gen_ ? *view_gen_ : gen_);
  });
}

Result<std::span<std::byte>> FailoverChannel::acquire() {
  for (;;) {
    transport::Channel* ch = nullptr;
    uint64_t g = 0;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return !failing_ || failed_; });
      if (failed_) return *failed_;
      if (acq_gen_) return Error{Errc::kInternal, "channel " + std::to_string(index_) + ": acquire twice"};
      ch = cur_.get();
      g = gen_;
      acq_gen_ = g;  // pins the channel while the call runs
    }
    auto buf = ch->acquire();
    if (buf) {
      std::lock_guard lock(mu_);
      acq_buf_ = buf.value();
      return buf;
    }
    {
      std::lock_guard lock(mu_);
      acq_gen_.reset();
      prune_locked();
    }
    RDMIG_TRY(recover(g, buf.error()));
  }
}

void FailoverChannel::unacquire() {
  transport::Channel* ch = nullptr;
  {
    std::lock_guard lock(mu_);
    if (!acq_gen_) return;
    if (*acq_gen_ == gen_ && !failing_) ch = cur_.get();  // an older link's credit died with it
    if (ch == nullptr) {
      acq_gen_.reset();
      prune_locked();
      return;
    }
  }
  ch->unacquire();
  std::lock_guard lock(mu_);
  acq_gen_.reset();
  prune_locked();
}

Status FailoverChannel::send_kept(transport::Channel& ch, uint64_t seq) {
  size_t n = 0;
  bool eof = false;
  {
    std::lock_guard lock(mu_);
    eof = eof_seq_ && *eof_seq_ == seq;
    if (!eof) n = sizes_[seq % depth_];
  }
  if (eof) return ch.send_eof();
  auto buf = ch.acquire();
  if (!buf) return buf.error();
  std::memcpy(buf->data(), ring_.data() + (seq % depth_) * chunk_size_, n);
  return ch.send(n);
}

Status FailoverChannel::send(size_t n) {
  std::span<std::byte> buf;
  uint64_t g = 0;
  {
    std::lock_guard lock(mu_);
    if (failed_) return *failed_;
    if (!acq_gen_) return Error{Errc::kInternal, "channel " + std::to_string(index_) + ": send without acquire"};
    if (n == 0 || n > chunk_size_) {
      return Error{Errc::kInternal, "channel " + std::to_string(index_) + ": send of a chunk of " + std::to_string(n) +
                                        " bytes"};
    }
    if (!ring_) {
      ring_ = ChunkMemory::map(size_t{depth_} * chunk_size_);
      if (!ring_) {
        const Error e{Errc::kResourceExhausted, "channel " + std::to_string(index_) + ": out of memory for the " +
                                                    std::to_string(depth_) + " chunks kept for a failover"};
        fail_locked(e);
        return e;
      }
    }
    buf = acq_buf_;
    g = *acq_gen_;
  }
  // Unlocked: only this thread writes the ring, and a failover never reads this slot (it holds
  // chunk sent_ - depth_, which the credit this buffer took proves the peer has released).
  std::memcpy(ring_.data() + (sent_ % depth_) * chunk_size_, buf.data(), n);
  uint64_t seq = 0;
  transport::Channel* ch = nullptr;
  {
    std::lock_guard lock(mu_);
    seq = sent_++;
    sizes_[seq % depth_] = n;
    if (g == gen_ && !failing_) ch = cur_.get();  // acq_gen_ still pins it
  }
  if (ch != nullptr) {
    auto st = ch->send(n);
    {
      std::lock_guard lock(mu_);
      acq_gen_.reset();
      prune_locked();
    }
    if (st) return st;
    return recover(g, st.error());  // the failover resends `seq`: it is below sent_
  }
  // The buffer's link is gone. A failover that gave its count after `seq` was numbered resends it;
  // otherwise it goes from the ring over the live link.
  {
    std::lock_guard lock(mu_);
    acq_gen_.reset();
    prune_locked();
  }
  return on_live(seq, [&](transport::Channel& live) { return send_kept(live, seq); });
}

Status FailoverChannel::on_live(std::optional<uint64_t> covered, const std::function<Status(transport::Channel&)>& op) {
  for (;;) {
    transport::Channel* ch = nullptr;
    uint64_t g = 0;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return !failing_ || failed_; });
      if (failed_) return *failed_;
      if (covered && *covered < resent_upto_) return ok_status();
      ch = cur_.get();
      g = gen_;
      acq_gen_ = g;  // pins the channel while `op` runs
    }
    auto st = op(*ch);
    {
      std::lock_guard lock(mu_);
      acq_gen_.reset();
      prune_locked();
    }
    if (st) return st;
    RDMIG_TRY(recover(g, st.error()));
  }
}

Status FailoverChannel::send_eof() {
  uint64_t seq = 0;
  {
    std::lock_guard lock(mu_);
    if (failed_) return *failed_;
    seq = sent_++;
    eof_seq_ = seq;
  }
  return on_live(seq, [](transport::Channel& live) { return live.send_eof(); });
}

Status FailoverChannel::drain() {
  return on_live(std::nullopt, [](transport::Channel& live) { return live.drain(); });
}

Result<transport::ChunkView> FailoverChannel::receive() {
  for (;;) {
    transport::Channel* ch = nullptr;
    uint64_t g = 0;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return !failing_ || failed_; });
      if (failed_) return *failed_;
      if (view_gen_) return Error{Errc::kInternal, "channel " + std::to_string(index_) + ": receive before release"};
      ch = cur_.get();
      g = gen_;
      view_gen_ = g;  // pins the channel while the call runs and while its view is held
    }
    auto r = ch->receive();
    bool stale = false;
    {
      std::lock_guard lock(mu_);
      // Taken after this end gave its count to the peer (a failover started): the peer resends it
      // on the new link, so this copy is dropped.
      stale = g != gen_ || failing_;
      if (r && !stale) {
        ++taken_;
        return r;
      }
    }
    if (r) (void)ch->release();
    {
      std::lock_guard lock(mu_);
      view_gen_.reset();
      prune_locked();
    }
    if (!stale) RDMIG_TRY(recover(g, r.error()));
  }
}

Status FailoverChannel::release() {
  transport::Channel* ch = nullptr;
  uint64_t g = 0;
  {
    std::lock_guard lock(mu_);
    if (!view_gen_) return Error{Errc::kInternal, "channel " + std::to_string(index_) + ": release without a chunk"};
    g = *view_gen_;
    if (g == gen_) {
      ch = cur_.get();
    } else {
      for (auto& [rg, rch] : retired_) {
        if (rg == g) ch = rch.get();
      }
    }
  }
  Status st = ch != nullptr ? ch->release() : ok_status();
  bool live = false;
  {
    std::lock_guard lock(mu_);
    view_gen_.reset();
    live = g == gen_ && !failing_;
    prune_locked();
  }
  // A credit lost with its link costs nothing: the new link starts with every credit. The chunk was
  // taken either way.
  if (!st && live) return recover(g, st.error());
  return ok_status();
}

void FailoverChannel::abort(const Error& reason) {
  std::lock_guard lock(mu_);
  aborted_ = true;
  fail_locked(reason);
  // Under the lock: a channel's abort never calls back, and nothing can free one here. It blocks
  // at most an RDMA channel's wait for the peer to acknowledge the abort (250 ms, none on a link
  // already silent that long), while the sender and receiver it ends wait for this lock.
  cur_->abort(reason);
  for (auto& r : retired_) r.second->abort(reason);
}

void FailoverChannel::interrupt(const Error& why) {
  std::lock_guard lock(mu_);
  if (failed_ || failing_) return;
  interrupt_ = why;
  interrupt_gen_ = gen_;
  cv_.notify_all();
}

Status FailoverChannel::recover(uint64_t gen, const Error& e) {
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return failed_ || gen != gen_ || !failing_; });
    if (failed_) return *failed_;
    if (gen != gen_) return ok_status();  // another thread failed over past the link that failed
    if (!cur_->link_failed()) {
      // A deliberate abort (either end), a protocol error, no memory: final, as without failover.
      fail_locked(e);
      return e;
    }
    failing_ = true;
  }
  return fail_over(e);
}

Status FailoverChannel::fail_over(const Error& first) {
  const auto started = Clock::now();
  const auto deadline = started + deadline_;
  uint64_t taken = 0;
  std::string from;
  {
    std::lock_guard lock(mu_);
    taken = taken_;  // fixed from here: receive() drops what the old link still hands over
    from = cur_->transport();
    // No abort frame (kCancelled): the peer must see a lost link, not a deliberate end.
    cur_->abort(Error{Errc::kCancelled, "channel " + std::to_string(index_) + ": link failed, failing over"});
  }
  LOG_WARN("failover") << "channel " << index_ << ": link failed (" << first.message << "); taken " << taken
                       << ", reconnecting within " << ms_text(deadline_);
  const auto stopped = [this] {
    std::lock_guard lock(mu_);
    return aborted_;
  };
  std::vector<std::pair<std::string, int>> tries;  // each reason once, with how many tries in a row gave it
  int attempts = 0;
  Error last = first;
  for (;;) {
    auto r = reconnect_(taken, last, deadline, stopped);
    if (stopped()) {
      if (r) r->channel->abort(Error{Errc::kCancelled, "aborted"});
      std::lock_guard lock(mu_);
      failing_ = false;
      cv_.notify_all();
      return failed_.value_or(Error{Errc::kCancelled, "aborted"});
    }
    if (r) {
      uint64_t upto = 0;
      {
        std::lock_guard lock(mu_);
        upto = sent_;
        const uint64_t data = eof_seq_ ? *eof_seq_ : sent_;
        const uint64_t kept_from = data > depth_ ? data - depth_ : 0;
        if (r->peer_taken > upto || r->peer_taken < kept_from) {
          const Error e{Errc::kProtocol,
                        "channel " + std::to_string(index_) + ": the peer's resume says it took " +
                            std::to_string(r->peer_taken) + " of this end's chunks, but this end sent " +
                            std::to_string(upto) + " and keeps those from " + std::to_string(kept_from) +
                            ": refused (a stream with a hole or a repeat is never resumed)"};
          failing_ = false;
          fail_locked(e);
          r->channel->abort(e);
          cur_->abort(e);
          return e;
        }
      }
      r->channel->notice_silent_link_within(kSilentLinkAfter);
      auto st = resend(*r->channel, r->peer_taken, upto);
      if (st) {
        FailoverEvent ev{index_, first.message, r->path, upto - r->peer_taken,
                         std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started), from, r->rail,
                         r->passed_over};
        {
          std::lock_guard lock(mu_);
          retired_.emplace_back(gen_, std::move(cur_));
          cur_ = std::move(r->channel);
          ++gen_;
          resent_upto_ = upto;
          path_ = r->path;
          ++failovers_;
          last_reason_ = first.message;
          failing_ = false;
          prune_locked();
          cv_.notify_all();
        }
        LOG_INFO("failover") << "channel " << index_ << ": resumed on " << ev.path << " after " << ms_text(ev.took)
                             << " (the peer took " << r->peer_taken << ", resent " << ev.resent << ")";
        if (on_failover_) on_failover_(ev);
        return ok_status();
      }
      r->channel->abort(Error{Errc::kCancelled, "resend failed"});
      last = st.error();
    } else {
      last = r.error();
    }
    ++attempts;
    if (tries.empty() || tries.back().first != last.message) {
      tries.emplace_back(last.message, 1);
    } else {
      ++tries.back().second;
    }
    LOG_WARN("failover") << "channel " << index_ << ": try " << attempts << ": " << last.message;
    // A peer that answers and refuses (it does not know the session: it restarted, or the session
    // ended there) will not change its mind.
    const bool refused = last.code == Errc::kPermissionDenied || last.code == Errc::kProtocol ||
                         last.code == Errc::kNotFound;
    if (refused || Clock::now() >= deadline) {
      std::string msg = "channel " + std::to_string(index_) + ": link failed (" + first.message + ") and ";
      msg += refused ? "the peer refused to resume it" : "no path came back within " + ms_text(deadline_);
      msg += " (" + std::to_string(attempts) + (attempts == 1 ? " try: " : " tries: ");
      for (size_t i = 0; i < tries.size(); ++i) {
        msg += (i ? "; " : "") + tries[i].first;
        if (tries[i].second > 1) msg += " (x" + std::to_string(tries[i].second) + ")";
      }
      msg += ")";
      const Error e{refused ? last.code : Errc::kUnavailable, msg};
      std::lock_guard lock(mu_);
      failing_ = false;
      fail_locked(e);
      return e;
    }
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return aborted_; });
  }
}

Status FailoverChannel::resend(transport::Channel& ch, uint64_t from, uint64_t upto) {
  for (uint64_t s = from; s < upto; ++s) RDMIG_TRY(send_kept(ch, s));
  return ok_status();
}

}  // namespace rdmig::session
