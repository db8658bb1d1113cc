#include "transport/rdma/rdma_listener.h"

#include <netdb.h>

#include <cstring>

#include "common/log.h"

namespace rdmig::transport::rdma {

using namespace std::chrono_literals;

Result<std::unique_ptr<RdmaListener>> RdmaListener::create(const std::string& ip, uint16_t port, Lookup lookup,
                                                           int tos) {
  EventChannelPtr events(rdma_create_event_channel());
  if (!events) {
    auto e = errno_error("rdma_create_event_channel", errno);
    e.code = Errc::kUnavailable;
    return e;
  }
  rdma_cm_id* raw = nullptr;
  if (rdma_create_id(events.get(), &raw, nullptr, RDMA_PS_TCP) != 0) return errno_error("rdma_create_id", errno);
  CmIdPtr id(raw);
  RDMIG_TRY(set_tos(id.get(), tos));
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* ai = nullptr;
  const std::string p = std::to_string(port);
  if (getaddrinfo(ip.c_str(), p.c_str(), &hints, &ai) != 0 || !ai) {
    return Error{Errc::kInvalidArgument, "rdma listener: bad address '" + ip + "'"};
  }
  const int rc = rdma_bind_addr(id.get(), ai->ai_addr);
  const int err = errno;
  freeaddrinfo(ai);
  if (rc != 0) return errno_error("rdma_bind_addr " + ip + ":" + p, err);
  if (rdma_listen(id.get(), 64) != 0) return errno_error("rdma_listen", errno);
  std::unique_ptr<RdmaListener> l(new RdmaListener(std::move(events), std::move(id), std::move(lookup)));
  l->tos_ = tos;
  l->port_ = ntohs(rdma_get_src_port(l->listen_id_.get()));
  l->thread_ = std::thread([p2 = l.get()] { p2->loop(); });
  return l;
}

RdmaListener::RdmaListener(EventChannelPtr events, CmIdPtr id, Lookup lookup)
    : events_(std::move(events)), listen_id_(std::move(id)), lookup_(std::move(lookup)) {}

RdmaListener::~RdmaListener() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void RdmaListener::loop() {
  while (!stop_.load()) {
    auto ev = next_cm_event(events_.get(), 200ms);
    if (!ev) {
      if (ev.error().code != Errc::kTimeout) {
        LOG_WARN("rdma") << "listener: " << ev.error().message;
        std::this_thread::sleep_for(100ms);
      }
      continue;
    }
    if (ev->type == RDMA_CM_EVENT_CONNECT_REQUEST) {
      on_connect_request(ev.value());
    } else {
      LOG_DEBUG("rdma") << "listener: ignoring " << rdma_event_str(ev->type);
    }
  }
}

void RdmaListener::on_connect_request(const CmEvent& ev) {
  CmIdPtr id(ev.id);
  auto reject = [&](const std::string& why) {
    LOG_WARN("rdma") << "rejected an RDMA connection: " << why;
    std::string msg = why.substr(0, 140);
    rdma_reject(id.get(), msg.c_str(), static_cast<uint8_t>(msg.size() + 1));
  };
  if (auto st = set_tos(id.get(), tos_); !st) return reject(st.error().message);
  auto req = ConnectRequest::decode(ev.private_data);
  if (!req) return reject(req.error().message);
  auto plan = lookup_(req.value());
  if (!plan) return reject(plan.error().message);
  // Give the connection its own event channel so its channel's poller sees its events.
  EventChannelPtr own(rdma_create_event_channel());
  if (!own) return reject("rdma_create_event_channel failed");
  if (rdma_migrate_id(id.get(), own.get()) != 0) return reject(std::string("rdma_migrate_id: ") + std::strerror(errno));
  auto ch = RdmaChannel::accept(std::move(own), std::move(id), req.value(), plan->params, *plan->metrics,
                                plan->key);
  if (!ch) {
    LOG_WARN("rdma") << "accepting channel " << req->index << ": " << ch.error().message;
    plan->deliver(ch.error());
    return;
  }
  plan->deliver(std::unique_ptr<Channel>(std::move(ch.value())));
}

}  // namespace rdmig::transport::rdma
