// Building an RdmaChannel: registering its ring and staging memory, creating the queue pair,
// and the rdma_cm handshake on both sides (connect on the source, accept on the target).
#include <fcntl.h>
#include <netdb.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "transport/rdma/rdma_channel.h"

namespace rdmig::transport::rdma {

using namespace std::chrono_literals;

namespace {

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

std::string memlock_limit_text() {
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return "unknown";
  if (rl.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(rl.rlim_cur / 1024) + " KiB";
}

// Connection parameters both sides use: rdmig posts only RDMA WRITEs (no READs). Transport
// errors (no ACK within the ack timeout) are retried 6 times, RNR (a peer with no receive
// posted) 6 times: both finite. For RNR the spec makes 7 "retry forever"; for transport errors 7
// is 7 retries on a ConnectX, but Soft-RoCE (rdma_rxe, rxe_comp.c: "if (retry_cnt != 7)
// retry_cnt--") retries for ever there too: a path that stops carrying RoCE (a cut rail, a
// dropped link) then never fails the channel, and the migration stalls until its no-progress
// timeout without naming the rail. With 6 the channel is meant to fail with "transport retry
// counter exceeded" 7 ack timeouts after the last ACK, on every device. Not seen on Soft-RoCE:
// in two runs of the two-node rail cut no channel had failed 20 s after the cut; the channel's
// acknowledgement watch (ack_watch.h) fails it there, 5 s on; see tests/rdma/README.md.
rdma_conn_param conn_param(const std::vector<uint8_t>& private_data) {
  rdma_conn_param cp{};
  cp.private_data = private_data.data();
  cp.private_data_len = static_cast<uint8_t>(private_data.size());
  cp.responder_resources = 1;
  cp.initiator_depth = 1;
  cp.retry_count = 6;
  cp.rnr_retry_count = 6;
  return cp;
}

}  // namespace

Status RdmaChannel::setup_resources() {
  ibv_context* ctx = id_->verbs;
  if (!ctx) return Error{Errc::kUnavailable, "rdma_cm id has no device"};
  pd_.reset(ibv_alloc_pd(ctx));
  if (!pd_) return verbs_error("ibv_alloc_pd", errno);
  comp_.reset(ibv_create_comp_channel(ctx));
  if (!comp_) return verbs_error("ibv_create_comp_channel", errno);
  ::fcntl(comp_->fd, F_SETFL, ::fcntl(comp_->fd, F_GETFL) | O_NONBLOCK);
  sq_cap_ = params_.send_depth + params_.recv_depth + 8;
  ack_watch_.reserve(sq_cap_);
  const uint32_t rq = params_.recv_depth + params_.send_depth + 8;
  cq_.reset(ibv_create_cq(ctx, static_cast<int>(sq_cap_ + rq), nullptr, comp_.get(), 0));
  if (!cq_) return verbs_error("ibv_create_cq", errno);

  // 2 MiB-aligned so the kernel can back the buffers with huge pages: fewer pages to pin
  // and translate at registration (and fewer MTT entries on a real RNIC).
  constexpr size_t kHuge = 2 * 1024 * 1024;
  const size_t ring_bytes = round_up(size_t{params_.recv_depth} * params_.recv_chunk, kHuge);
  const size_t staging_bytes = round_up(size_t{params_.send_depth} * params_.send_chunk, kHuge);
  recv_ring_.reset(static_cast<std::byte*>(std::aligned_alloc(kHuge, ring_bytes)));
  staging_.reset(static_cast<std::byte*>(std::aligned_alloc(kHuge, staging_bytes)));
  if (recv_ring_) ::madvise(recv_ring_.get(), ring_bytes, MADV_HUGEPAGE);
  if (staging_) ::madvise(staging_.get(), staging_bytes, MADV_HUGEPAGE);
  if (!recv_ring_ || !staging_) return Error{Errc::kUnavailable, "out of memory for the RDMA ring"};
  auto reg = [&](MrPtr& mr, std::byte* buf, size_t len, int access, const char* what) -> Status {
    mr.reset(ibv_reg_mr(pd_.get(), buf, len, access));
    if (mr) return ok_status();
    const int err = errno;
    auto e = verbs_error(std::string("ibv_reg_mr (") + what + ", " + std::to_string(len >> 20) + " MiB)", err);
    if (err == ENOMEM || err == EPERM || err == EAGAIN) {
      e.message += "; locked-memory limit (RLIMIT_MEMLOCK) is " + memlock_limit_text() +
                   ": give the agent the IPC_LOCK capability or 'ulimit -l unlimited', or lower "
                   "chunkSize x ringDepth";
    }
    return e;
  };
  RDMIG_TRY(reg(recv_mr_, recv_ring_.get(), ring_bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, "receive ring"));
  RDMIG_TRY(reg(staging_mr_, staging_.get(), staging_bytes, IBV_ACCESS_LOCAL_WRITE, "send staging"));

  ibv_qp_init_attr qa{};
  qa.send_cq = cq_.get();
  qa.recv_cq = cq_.get();
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = sq_cap_;
  qa.cap.max_recv_wr = rq;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.sq_sig_all = 0;
  if (rdma_create_qp(id_.get(), pd_.get(), &qa) != 0) return verbs_error("rdma_create_qp", errno);
  qp_.reset(id_.get());
  for (uint32_t i = 0; i < rq; ++i) RDMIG_TRY(post_recv());
  if (ibv_req_notify_cq(cq_.get(), 0) != 0) return verbs_error("ibv_req_notify_cq", errno);
  signal_every_ = std::max<uint32_t>(1, params_.send_depth / 4);
  return ok_status();
}

Result<std::unique_ptr<RdmaChannel>> RdmaChannel::connect(const net::Endpoint& ep,
                                                           const ChannelCredentials& credentials,
                                                           const RdmaChannelParams& params,
                                                           TransportMetrics& metrics,
                                                           std::chrono::milliseconds timeout,
                                                           const std::function<bool()>& cancelled,
                                                           const RdmaConnectOptions& options) {
  const std::string what = "rdma connect to " + ep.to_string() + " (channel " + std::to_string(params.index) + ")";
  // `timeout` bounds the whole connect (address, route, connection), not each step.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto left = [&] {
    return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      deadline - std::chrono::steady_clock::now()));
  };
  EventChannelPtr events(rdma_create_event_channel());
  if (!events) return verbs_error(what + ": rdma_create_event_channel", errno);
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(events.get(), &raw, nullptr, RDMA_PS_TCP) != 0) return verbs_error(what + ": rdma_create_id", errno);
  CmIdPtr id(raw);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* ai = nullptr;
  const std::string port = std::to_string(ep.port);
  if (getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &ai) != 0 || !ai) {
    return Error{Errc::kUnavailable, what + ": cannot resolve " + ep.host};
  }
  if (auto st = set_tos(id.get(), options.tos); !st) {
    freeaddrinfo(ai);
    return st.error().with_context(what);
  }
  // Bind to the chosen device's address when it is of the peer's family, so the connection
  // leaves through that device even when routing would pick another.
  addrinfo* src = nullptr;
  if (!options.source_ip.empty()) {
    addrinfo shints{};
    shints.ai_flags = AI_NUMERICHOST;
    shints.ai_family = ai->ai_family;
    shints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(options.source_ip.c_str(), nullptr, &shints, &src) != 0) src = nullptr;
  }
  const int rc = rdma_resolve_addr(id.get(), src ? src->ai_addr : nullptr, ai->ai_addr, static_cast<int>(left().count()));
  const int err = errno;
  if (src) freeaddrinfo(src);
  freeaddrinfo(ai);
  if (rc != 0) return verbs_error(what + ": rdma_resolve_addr", err);
  // Each wait names its step in the error: an address that does not resolve (no neighbour), a
  // route, or a connect request the peer never answered are different faults for an operator.
  RDMIG_TRY(expect_cm_event(events.get(), RDMA_CM_EVENT_ADDR_RESOLVED, left(), what + ": resolving the address",
                            cancelled));
  LOG_DEBUG("rdma") << what << ": address resolved";
  if (rdma_resolve_route(id.get(), static_cast<int>(left().count())) != 0) return verbs_error(what + ": rdma_resolve_route", errno);
  RDMIG_TRY(expect_cm_event(events.get(), RDMA_CM_EVENT_ROUTE_RESOLVED, left(), what + ": resolving the route",
                            cancelled));

  LOG_DEBUG("rdma") << what << ": route resolved";
  std::unique_ptr<RdmaChannel> ch(new RdmaChannel(std::move(events), std::move(id), params, metrics));
  if (auto st = ch->setup_resources(); !st) return st.error().with_context(what);
  LOG_DEBUG("rdma") << what << ": resources ready, connecting";
  ConnectRequest req;
  req.session = credentials.session;
  req.index = static_cast<uint16_t>(params.index);
  req.ring_addr = reinterpret_cast<uintptr_t>(ch->recv_ring_.get());
  req.ring_rkey = ch->recv_mr_->rkey;
  sign_request(req, credentials.key);
  const auto pd = req.encode();
  rdma_conn_param cp = conn_param(pd);
  if (rdma_connect(ch->id_.get(), &cp) != 0) return verbs_error(what + ": rdma_connect", errno);
  auto ev = next_cm_event(ch->events_.get(), left(), cancelled);
  if (!ev) return ev.error().with_context(what + ": waiting for the answer to the connect request");
  if (ev->type == RDMA_CM_EVENT_REJECTED) {
    std::string why(ev->private_data.begin(), ev->private_data.end());
    why = why.c_str();  // stop at the first NUL of the padded private data
    return Error{Errc::kPermissionDenied, what + ": target agent rejected the connection" + (why.empty() ? "" : ": " + why)};
  }
  if (ev->type != RDMA_CM_EVENT_ESTABLISHED) {
    return Error{Errc::kUnavailable, what + ": " + rdma_event_str(ev->type)};
  }
  auto reply = ConnectReply::decode(ev->private_data);
  if (!reply) return reply.error().with_context(what);
  if (auto st = check_reply(reply.value(), req, credentials.key); !st) return st.error().with_context(what);
  ch->peer_ring_addr_ = reply->ring_addr;
  ch->peer_ring_rkey_ = reply->ring_rkey;
  ch->established_ = true;
  ch->start_poller();
  LOG_DEBUG("rdma") << what << ": established";
  return ch;
}

Result<std::unique_ptr<RdmaChannel>> RdmaChannel::accept(EventChannelPtr events, CmIdPtr id,
                                                         const ConnectRequest& request,
                                                         const RdmaChannelParams& params,
                                                         TransportMetrics& metrics, const std::string& key) {
  const std::string what = "rdma accept (channel " + std::to_string(params.index) + ")";
  std::unique_ptr<RdmaChannel> ch(new RdmaChannel(std::move(events), std::move(id), params, metrics));
  if (auto st = ch->setup_resources(); !st) {
    rdma_reject(ch->id_.get(), nullptr, 0);
    return st.error().with_context(what);
  }
  ch->peer_ring_addr_ = request.ring_addr;
  ch->peer_ring_rkey_ = request.ring_rkey;
  ConnectReply rep;
  rep.ring_addr = reinterpret_cast<uintptr_t>(ch->recv_ring_.get());
  rep.ring_rkey = ch->recv_mr_->rkey;
  sign_reply(rep, request, key);
  const auto pd = rep.encode();
  rdma_conn_param cp = conn_param(pd);
  if (rdma_accept(ch->id_.get(), &cp) != 0) return verbs_error(what + ": rdma_accept", errno);
  LOG_DEBUG("rdma") << what << ": accepted";
  ch->start_poller();
  return ch;
}

}  // namespace rdmig::transport::rdma
