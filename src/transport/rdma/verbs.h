// RAII owners for rdma-core handles. Members of the owning classes are declared in
// dependency order (event channel, cm id, pd, comp channel, cq, mrs, qp) so that teardown
// runs in the reverse order by itself.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <memory>

namespace rdmig::transport::rdma {

struct EventChannelDeleter {
  void operator()(rdma_event_channel* c) const { if (c) rdma_destroy_event_channel(c); }
};
struct CmIdDeleter {
  void operator()(rdma_cm_id* id) const {
    if (!id) return;
    if (id->qp) rdma_destroy_qp(id);
    rdma_destroy_id(id);
  }
};
struct PdDeleter {
  void operator()(ibv_pd* p) const { if (p) ibv_dealloc_pd(p); }
};
struct CompChannelDeleter {
  void operator()(ibv_comp_channel* c) const { if (c) ibv_destroy_comp_channel(c); }
};
struct CqDeleter {
  void operator()(ibv_cq* c) const { if (c) ibv_destroy_cq(c); }
};
struct MrDeleter {
  void operator()(ibv_mr* m) const { if (m) ibv_dereg_mr(m); }
};
struct DeviceListDeleter {
  void operator()(ibv_device** l) const { if (l) ibv_free_device_list(l); }
};
struct ContextDeleter {
  void operator()(ibv_context* c) const { if (c) ibv_close_device(c); }
};

using EventChannelPtr = std::unique_ptr<rdma_event_channel, EventChannelDeleter>;
using CmIdPtr = std::unique_ptr<rdma_cm_id, CmIdDeleter>;
using PdPtr = std::unique_ptr<ibv_pd, PdDeleter>;
using CompChannelPtr = std::unique_ptr<ibv_comp_channel, CompChannelDeleter>;
using CqPtr = std::unique_ptr<ibv_cq, CqDeleter>;
using MrPtr = std::unique_ptr<ibv_mr, MrDeleter>;
using DeviceListPtr = std::unique_ptr<ibv_device*, DeviceListDeleter>;
using ContextPtr = std::unique_ptr<ibv_context, ContextDeleter>;

// Page-aligned memory for registration (freed with free()).
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, FreeDeleter>;

}  // namespace rdmig::transport::rdma
