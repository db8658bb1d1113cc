// The resume exchange of a data channel that fails over (failover_channel.h, docs/failover.md):
// on a new connection (or RDMA channel) that has just proved its session (transport/channel_proof.h), before its TLS
// handshake, each end tells the other how many of the other's elements (chunks, then the eof) it
// has taken, and proves the two counts under the session's channel key over fresh nonces, so that
// no one without the key can make an end skip or repeat a byte:
//   dialler  -> acceptor  {type:"resume", taken: Td, nonce: Nd}
//   acceptor -> dialler   {type:"resume", taken: Ta, nonce: Na, proof: MAC(accept)}  | reject
//   dialler  -> acceptor  {type:"resume-ok", proof: MAC(dial)}
//   MAC(by) = channel_mac(terms, by, "resume\n" Nd "\n" Na "\n" Td "\n" Ta), hex.
// Whether a count is one the receiving end can accept (not beyond what it sent, not older than what
// it keeps) is the FailoverChannel's check, not this exchange's.
#pragma once

#include <chrono>
#include <cstdint>

#include "common/result.h"
#include "transport/channel.h"
#include "transport/channel_proof.h"

namespace rdmig::session {

// Counts are below 2^53 (JSON numbers stay exact).
inline constexpr uint64_t kMaxResumeCount = (uint64_t{1} << 53) - 1;

// The dialler's side: sends `taken`, returns the acceptor's count once both proofs hold.
Result<uint64_t> resume_as_dialler(int fd, const transport::ChannelTerms& terms, uint64_t taken,
                                   std::chrono::milliseconds timeout);
// The acceptor's side: reads the dialler's count, answers with `taken`, returns the dialler's count
// once its proof holds. A bad message or proof is refused (a reject is sent) and fails.
Result<uint64_t> resume_as_acceptor(int fd, const transport::ChannelTerms& terms, uint64_t taken,
                                    std::chrono::milliseconds timeout);

// The same exchange on a re-dialled RDMA channel (a rail failover: no TCP connection to carry it),
// before the FailoverChannel takes it: each message is one chunk, released once read, so the
// channel's credits are all back (or on their way) when its resend starts. `timeout` bounds the
// whole exchange: past it the channel is aborted (its calls have no timeout of their own).
Result<uint64_t> resume_as_dialler(transport::Channel& ch, const transport::ChannelTerms& terms, uint64_t taken,
                                   std::chrono::milliseconds timeout);
Result<uint64_t> resume_as_acceptor(transport::Channel& ch, const transport::ChannelTerms& terms, uint64_t taken,
                                    std::chrono::milliseconds timeout);

}  // namespace rdmig::session
