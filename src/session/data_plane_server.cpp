#include "session/data_plane_server.h"

#include <sys/socket.h>

#include <cstdlib>

#include "common/log.h"
#include "common/net.h"
#include "transport/rdma/device.h"
#include "transport/rdma/network_status.h"
#include "transport/wire.h"

namespace rdmig::session {

using nlohmann::json;
using namespace std::chrono_literals;

std::string choose_advertise_host(const AgentConfig& config) {
  if (!config.data_plane.advertise_address.empty()) return config.data_plane.advertise_address;
  // The pod's IP: the node's on the host network, its own on the pod network (Multus mode).
  if (const char* pod_ip = std::getenv("POD_IP"); pod_ip && *pod_ip) return pod_ip;
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
                 "config key 'transport': rdma is required but RDMA cannot be used (" + rdma_.reason_code + "): " +
                     rdma_.reason + "; fix the rdma keys (device, netdev, address, resourceEnv, network) or set transport: auto"};
  }
  return ok_status();
}

void DataPlaneServer::stop() {
  if (stopping_.exchange(true)) return;
  rdma_listeners_.clear();
  if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  // Hello threads end within kHelloTimeout (their reads have that deadline) and handlers
  // return at once (they hand the connection over).
  MutexLock lock(pending_mu_);
  while (pending_ != 0) lock.wait(pending_cv_);
}

transport::rdma::RdmaOptions rdma_options(const RdmaRailConfig& config, const std::string& key) {
  transport::rdma::RdmaOptions o;
  o.key = key;
  o.device = config.device;
  o.netdev = config.netdev;
  o.address = config.address;
  o.resource_env = config.resource_env;
  o.traffic_class = config.traffic_class;
  return o;
}

std::string RdmaRail::endpoint() const { return net::Endpoint{ip, port}.to_string(); }

std::string RdmaSupport::summary() const {
  if (!available) return "rdma=unavailable (" + reason_code + ": " + reason + ")";
  std::string line = "rdma=" + device + " port=" + std::to_string(device_port) + " netdev=" + netdev +
                     " gid_index=" + std::to_string(gid_index) + " gid_type=" + gid_type + " mtu=" +
                     std::to_string(mtu) + " address=" + net::format_endpoint(ip, port) + " traffic_class=" +
                     (traffic_class < 0 ? std::string("default") : std::to_string(traffic_class));
  if (rails.size() > 1 || !down.empty()) {
    line += " rails=" + std::to_string(rails.size()) + " (";
    for (size_t i = 0; i < rails.size(); ++i) {
      line += (i ? ", " : "") + std::to_string(rails[i].rail) + ":" + rails[i].device + " " + rails[i].endpoint();
    }
    for (const auto& d : down) line += ", " + std::to_string(d.rail) + ":down " + d.reason_code;
    line += ")";
  }
  return line;
}

Result<RdmaRail> DataPlaneServer::init_rail(uint32_t index, const RdmaRailConfig& config,
                                            std::chrono::steady_clock::time_point network_deadline) {
  // A rail of rdma.devices is named by its place there; the single rail is `rdma` itself.
  const std::string key = config_.rdma.devices.empty() ? "rdma" : "rdma.devices[" + std::to_string(index) + "]";
  auto options = rdma_options(config, key);
  if (!config.network.empty()) {
    // Multus mode: the network's entry in the pod's network-status names interface, address and
    // device (transport/rdma/network_status.h). Not there in time: no device for this rail.
    const char* ns = std::getenv("POD_NAMESPACE");
    auto entry = transport::rdma::wait_for_network_attachment(
        config_.rdma.network_status_file, config.network, ns ? ns : "", network_deadline,
        [this] { return stopping_.load(); }, key);
    if (!entry) {
      // kUnavailable: the entry is there but lists no usable address (no IPAM on the network).
      const auto& e = entry.error();
      const bool waited = e.code == Errc::kNotFound;
      return Error{e.code, std::string(e.code == Errc::kUnavailable ? transport::rdma::kNoAddress
                                                                     : transport::rdma::kNoDevice) +
                               ": " + e.message +
                               (waited ? " (waited " + std::to_string(config_.rdma.network_wait_seconds) +
                                             " s, rdma.networkWaitSeconds)"
                                       : "")};
    }
    options = transport::rdma::options_for_attachment(options, entry.value(), config_.rdma.network_status_file);
    LOG_INFO("dataplane") << "rail " << index << ": network " << entry->name << " from "
                          << config_.rdma.network_status_file << ": interface=" << entry->interface
                          << " address=" << options.address
                          << " rdma-device=" << (entry->rdma_device.empty() ? "-" : entry->rdma_device)
                          << " pci-address=" << (entry->pci_address.empty() ? "-" : entry->pci_address);
  }
  auto sel = transport::rdma::select_device(options, transport::rdma::process_environment(),
                                            transport::rdma::SysfsView{});
  if (!sel.ok()) return Error{sel.error.code, sel.reason + ": " + sel.error.message};
  const auto& dev = *sel.device;
  // Every rail listens on its own address; with a fixed rdmaPort they share the port number.
  auto listener = rail_listener(dev.ip, index, 0, options.traffic_class);
  if (!listener) {
    return Error{listener.error().code, std::string("listener-failed: rdma_cm listener on ") + dev.ip + " (" +
                                            dev.name + "): " + listener.error().message};
  }
  RdmaRail rail;
  rail.rail = index;
  rail.device = dev.name;
  rail.device_port = dev.port;
  rail.netdev = dev.netdev;
  rail.ip = dev.ip;
  rail.port = listener.value()->port();
  rail.gid_index = dev.gid_index;
  rail.gid = dev.gid;
  rail.gid_type = dev.gid_type;
  rail.traffic_class = options.traffic_class;
  rail.mtu = transport::rdma::port_active_mtu(dev.name, dev.port);
  rdma_listeners_.push_back(std::move(listener.value()));
  LOG_INFO("dataplane") << "rail " << index << ": " << dev.name << " port=" << dev.port << " netdev=" << dev.netdev
                        << " gid=" << dev.gid << " address=" << rail.endpoint() << " (device chosen by " << dev.how
                        << ")";
  init_alternates(rail, config, key);
  return rail;
}

Result<std::unique_ptr<transport::rdma::RdmaListener>> DataPlaneServer::rail_listener(const std::string& ip,
                                                                                      uint32_t index, uint32_t slot,
                                                                                      int traffic_class) {
  return transport::rdma::RdmaListener::create(
      ip, config_.data_plane.rdma_port,
      [this, index, slot](const transport::rdma::ConnectRequest& request) {
        transport::rdma::ConnectRequest on_rail = request;
        on_rail.rail = index;  // the rail this listener serves
        on_rail.address = slot;
        return resolve_rdma(on_rail);
      },
      traffic_class);
}

void DataPlaneServer::init_alternates(RdmaRail& rail, const RdmaRailConfig& config, const std::string& key) {
  for (size_t k = 0; k < config.alternate_addresses.size(); ++k) {
    const std::string item = key + ".alternateAddresses[" + std::to_string(k) + "]";
    const auto& address = config.alternate_addresses[k];
    // The same device, any of its netdevs (a VLAN or macvlan on its port): the address's own GID.
    transport::rdma::RdmaOptions options;
    options.key = item;
    options.device = rail.device;
    options.address = address;
    options.traffic_class = rail.traffic_class;
    auto sel = transport::rdma::select_device(options, transport::rdma::process_environment(),
                                              transport::rdma::SysfsView{});
    std::string why;
    if (!sel.ok()) {
      why = sel.reason + ": " + sel.error.message;
    } else if (sel.device->ip == rail.ip) {
      why = "it is the rail's own address";
    }
    std::unique_ptr<transport::rdma::RdmaListener> listener;
    if (why.empty()) {
      auto l = rail_listener(sel.device->ip, rail.rail, static_cast<uint32_t>(k + 1), rail.traffic_class);
      if (l) {
        listener = std::move(l.value());
      } else {
        why = "listener-failed: " + l.error().message;
      }
    }
    if (!why.empty()) {
      // The rail works without it: the failover paths it would have given are missing (logged).
      LOG_WARN("dataplane") << "rail " << rail.rail << ": alternate address " << address << " (" << item
                            << ") left out: " << why;
      continue;
    }
    const auto& dev = *sel.device;
    RdmaRail alt;
    alt.rail = rail.rail;
    alt.device = dev.name;
    alt.device_port = dev.port;
    alt.netdev = dev.netdev;
    alt.ip = dev.ip;
    alt.port = listener->port();
    alt.gid_index = dev.gid_index;
    alt.gid = dev.gid;
    alt.gid_type = dev.gid_type;
    alt.traffic_class = rail.traffic_class;
    alt.mtu = transport::rdma::port_active_mtu(dev.name, dev.port);
    rdma_listeners_.push_back(std::move(listener));
    LOG_INFO("dataplane") << "rail " << rail.rail << ": alternate address " << k << ": " << dev.name
                          << " netdev=" << dev.netdev << " gid=" << dev.gid << " address=" << alt.endpoint();
    rail.alternates.push_back(std::move(alt));
    rail.alternate_slots.push_back(static_cast<uint32_t>(k));
  }
}

void DataPlaneServer::init_rdma() {
  metrics_.set_rdma_devices(transport::rdma::count_usable_devices());
  const auto rails = config_.rdma.rails();
  const auto rail_label = [](uint32_t i) { return std::to_string(i); };
  const auto reason_only = [](const std::string& code) {
    RdmaSelectionInfo info;
    info.reason = code;
    return info;
  };
  auto unavailable = [&](const std::string& code, const std::string& why) {
    rdma_.reason_code = code;
    rdma_.reason = why;
    metrics_.set_rdma_selection(reason_only(code));
    LOG_INFO("dataplane") << "RDMA not used: " << code << ": " << why;
  };
  rdma_.traffic_class = rails.front().traffic_class;
  if (config_.transport == TransportKind::kTcp) {
    for (uint32_t i = 0; i < rails.size(); ++i) metrics_.set_rdma_rail(rail_label(i), reason_only("transport-tcp"));
    return unavailable("transport-tcp", "transport is tcp in the agent config");
  }
  // One wait for every rail's network-status entry together (Multus writes them all at once).
  const auto network_deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(config_.rdma.network_wait_seconds);
  for (uint32_t i = 0; i < rails.size(); ++i) {
    auto rail = init_rail(i, rails[i], network_deadline);
    if (!rail) {
      // "<code>: <what to fix>": the code is the metric label.
      const std::string& msg = rail.error().message;
      const auto colon = msg.find(": ");
      RdmaRailDown down{i, msg.substr(0, colon), colon == std::string::npos ? msg : msg.substr(colon + 2)};
      metrics_.set_rdma_rail(rail_label(i), reason_only(down.reason_code));
      if (rails.size() > 1) {
        LOG_WARN("dataplane") << "rail " << i << " (rdma.devices[" << i << "]) left out: " << msg;
      }
      rdma_.down.push_back(std::move(down));
      continue;
    }
    metrics_.set_rdma_rail(rail_label(i), RdmaSelectionInfo{"ok", rail->device, std::to_string(rail->device_port),
                                                            rail->netdev, rail->ip, std::to_string(rail->gid_index),
                                                            rail->gid_type});
    rdma_.rails.push_back(std::move(rail.value()));
  }
  if (rdma_.rails.empty()) {
    // As with one device: the first rail's reason (every rail's in the log above).
    return unavailable(rdma_.down.front().reason_code, rdma_.down.front().reason);
  }
  const auto& first = rdma_.rails.front();
  rdma_.available = true;
  rdma_.reason_code.clear();
  rdma_.device = first.device;
  rdma_.device_port = first.device_port;
  rdma_.netdev = first.netdev;
  rdma_.ip = first.ip;
  rdma_.port = first.port;
  rdma_.gid_index = first.gid_index;
  rdma_.gid_type = first.gid_type;
  rdma_.traffic_class = first.traffic_class;
  rdma_.mtu = first.mtu;
  metrics_.set_rdma_selection(RdmaSelectionInfo{"ok", first.device, std::to_string(first.device_port), first.netdev,
                                                first.ip, std::to_string(first.gid_index), first.gid_type});
  LOG_INFO("dataplane") << rdma_.summary();
}

Result<transport::rdma::AcceptPlan> DataPlaneServer::resolve_rdma(const transport::rdma::ConnectRequest& request) {
  for (auto& resolve : resolvers_) {
    auto plan = resolve(request);
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
      MutexLock lock(pending_mu_);
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
      MutexLock lock(pending_mu_);
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
    transport::send_reject(fd.get(), "invalid_argument", why);
    LOG_WARN("dataplane") << "refused a hello: " << why;
    return;
  }
  if (stopping_.load()) return;
  it->second(std::move(fd), msg.value());
}

}  // namespace rdmig::session
