// The target agent's rdma_cm listener: one per agent, bound to the RDMA device's address.
// A connect request names a session and a channel index in its private data and proves the
// session's channel key (cm.h); `lookup` finds the migration that owns the session, checks the
// proof and says how to build the channel and where to deliver it. Unknown sessions are rejected with a reason. One thread, stopped by the
// destructor (it polls with a short timeout).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include "common/result.h"
#include "metrics/metrics.h"
#include "transport/channel.h"
#include "transport/rdma/rdma_channel.h"

namespace rdmig::transport::rdma {

struct AcceptPlan {
  RdmaChannelParams params;
  TransportMetrics* metrics = nullptr;
  std::string key;  // the session's channel key: the reply proves it (check_request was done)
  std::function<void(Result<std::unique_ptr<Channel>>)> deliver;
};

class RdmaListener {
 public:
  // Finds the session of a request, checks its proof (check_request) and only then admits the
  // channel; an error rejects the connect request before the QP is accepted.
  using Lookup = std::function<Result<AcceptPlan>(const ConnectRequest& request)>;

  // `tos` (IP ToS byte, -1 = default) is set on the listening id and on every accepted one.
  static Result<std::unique_ptr<RdmaListener>> create(const std::string& ip, uint16_t port, Lookup lookup,
                                                      int tos = -1);
  ~RdmaListener();
  RdmaListener(const RdmaListener&) = delete;
  RdmaListener& operator=(const RdmaListener&) = delete;

  uint16_t port() const { return port_; }

 private:
  RdmaListener(EventChannelPtr events, CmIdPtr id, Lookup lookup);
  void loop();
  void on_connect_request(const CmEvent& ev);

  EventChannelPtr events_;
  CmIdPtr listen_id_;
  Lookup lookup_;
  uint16_t port_ = 0;
  int tos_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace rdmig::transport::rdma
