#include "migration/data_plane_server.h"

#include <sys/socket.h>

#include <cstdlib>

#include "common/log.h"
#include "common/net.h"
#include "transport/rdma/device.h"
#include "transport/wire.h"

namespace rdmig::migration {

using nlohmann::json;
using namespace std::chrono_literals;

std::string choose_advertise_host(const AgentConfig& config) {
  if (!config.data_plane.advertise_address.empty()) return config.data_plane.advertise_address;
  if (const char* node_ip = std::getenv("NODE_IP"); node_ip && *node_ip) return node_ip;
  const auto& a = config.data_plane.address;
  if (a.empty() || a == "0.0.0.0" || a == "::") return "127.0.0.1";
  return a;
}

DataPlaneServer::DataPlaneServer(const AgentConfig& config, Metrics& metrics)
    : config_(config), metrics_(metrics), advertise_host_(choose_advertise_host(config)) {}

DataPlaneServer::~DataPlaneServer() { stop(); }

void DataPlaneServer::add_handler(const std::string& kind, HelloHandler handler) {
  handlers_[kind] = std::move(handler);
}

void DataPlaneServer::add_rdma_resolver(RdmaResolver resolver) { resolvers_.push_back(std::move(resolver)); }

Status DataPlaneServer::start() {
  auto fd = net::tcp_listen(config_.data_plane.address, config_.data_plane.port);
  if (!fd) return fd.error().with_context("dataPlane listener");
  auto port = net::local_port(fd->get());
  if (!port) return port.error();
  port_ = port.value();
  listener_ = std::move(fd.value());
  acceptor_ = std::thread([this] { accept_loop(); });
  LOG_INFO("dataplane") << "listening on " << config_.data_plane.address << ":" << port_
                        << " advertise=" << advertise_host_;
  init_rdma();
  if (config_.transport == TransportKind::kRdma && !rdma_.available) {
    return Error{Errc::kFailedPrecondition,
                 "config key 'transport': rdma is required but RDMA cannot be used: " + rdma_.reason};
  }
  return ok_status();
}

void DataPlaneServer::stop() {
  if (stopping_.exchange(true)) return;
  rdma_listener_.reset();
  if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  // Hello threads end within kHelloTimeout (their reads have that deadline) and handlers
  // return at once (they hand the connection over).
  std::unique_lock lock(pending_mu_);
  pending_cv_.wait(lock, [&] { return pending_ == 0; });
}

void DataPlaneServer::init_rdma() {
  metrics_.set_rdma_devices(transport::rdma::count_usable_devices());
  if (config_.transport == TransportKind::kTcp) {
    rdma_.reason = "transport is tcp in the agent config";
    return;
  }
  auto dev = transport::rdma::select_device(config_.rdma, transport::rdma::process_environment(),
                                            transport::rdma::SysfsView{});
  if (!dev) {
    rdma_.reason = dev.error().message;
    LOG_INFO("dataplane") << "RDMA not used: " << rdma_.reason;
    return;
  }
  auto listener = transport::rdma::RdmaListener::create(
      dev->ip, config_.data_plane.rdma_port,
      [this](const std::array<uint8_t, 16>& session, uint32_t index) { return resolve_rdma(session, index); });
  if (!listener) {
    rdma_.reason = "rdma_cm listener on " + dev->ip + ": " + listener.error().message;
    LOG_WARN("dataplane") << "RDMA not used: " << rdma_.reason;
    return;
  }
  rdma_listener_ = std::move(listener.value());
  rdma_.available = true;
  rdma_.device = dev->name;
  rdma_.ip = dev->ip;
  rdma_.port = rdma_listener_->port();
  LOG_INFO("dataplane") << "RDMA device " << dev->name << " (" << dev->netdev << ", chosen by " << dev->how
                        << ") rdma_cm listening on " << rdma_.ip << ":" << rdma_.port;
}

Result<transport::rdma::AcceptPlan> DataPlaneServer::resolve_rdma(const std::array<uint8_t, 16>& session,
                                                                  uint32_t index) {
  for (auto& resolve : resolvers_) {
    auto plan = resolve(session, index);
    if (plan || plan.error().code != Errc::kPermissionDenied) return plan;
  }
  return Error{Errc::kPermissionDenied, "no migration has this session"};
}

void DataPlaneServer::accept_loop() {
  while (!stopping_.load()) {
    auto fd = net::accept_for(listener_.get(), 500ms);
    if (!fd) {
      if (fd.error().code == Errc::kTimeout) continue;
      if (stopping_.load()) return;
      LOG_WARN("dataplane") << "accept: " << fd.error().message;
      std::this_thread::sleep_for(100ms);  // e.g. EMFILE: do not spin
      continue;
    }
    std::string source = net::peer_address(fd->get());
    {
      std::lock_guard lock(pending_mu_);
      if (pending_ >= kMaxPendingHellos) {
        LOG_WARN("dataplane") << "dropped a connection from " << source << ": " << pending_ << " hellos already pending";
        continue;  // closes it
      }
      size_t& mine = pending_by_source_[source];
      if (mine >= kMaxPendingHellosPerSource) {
        LOG_WARN("dataplane") << "dropped a connection from " << source << ": " << mine
                              << " hellos from that address already pending";
        continue;
      }
      ++mine;
      ++pending_;
    }
    std::thread([this, source = std::move(source), conn = std::move(fd.value())]() mutable {
      handle(std::move(conn));
      std::lock_guard lock(pending_mu_);
      --pending_;
      if (auto it = pending_by_source_.find(source); it != pending_by_source_.end() && --it->second == 0) {
        pending_by_source_.erase(it);
      }
      pending_cv_.notify_all();
    }).detach();
  }
}

void DataPlaneServer::handle(UniqueFd fd) {
  // Each connection says hello first; bounded in size and time by recv_message.
  auto msg = transport::recv_message(fd.get(), kHelloTimeout);
  if (!msg) {
    LOG_DEBUG("dataplane") << "dropped a connection without a valid hello: " << msg.error().message;
    return;
  }
  auto kind = transport::get_string(msg.value(), "kind", "hello", 32);
  auto it = kind ? handlers_.find(kind.value()) : handlers_.end();
  if (it == handlers_.end()) {
    const std::string why = kind ? "hello.kind: unknown kind '" + kind.value() + "'" : kind.error().message;
    (void)transport::send_message(fd.get(), json{{"type", "reject"}, {"code", "invalid_argument"}, {"message", why}});
    LOG_WARN("dataplane") << "refused a hello: " << why;
    return;
  }
  if (stopping_.load()) return;
  it->second(std::move(fd), msg.value());
}

}  // namespace rdmig::migration
