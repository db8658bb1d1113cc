#include "kubevirt/intercept/intercept.h"

#include <poll.h>
#include <sys/socket.h>

#include "common/log.h"

namespace rdmig::kubevirt {

InterceptPoint::InterceptPoint(std::shared_ptr<NetNs> ns, UniqueFd l4, UniqueFd l6, NftRules rules, OnConnection cb,
                               uint16_t port4, uint16_t port6, PassMark mark, size_t hop_window)
    : ns_(std::move(ns)), listen4_(std::move(l4)), listen6_(std::move(l6)), rules_(std::move(rules)),
      on_connection_(std::move(cb)), port4_(port4), port6_(port6), mark_(mark), hop_window_(hop_window) {
  thread_ = std::thread([this] { loop(); });
}

Result<std::unique_ptr<InterceptPoint>> InterceptPoint::create(std::shared_ptr<NetNs> ns, PassMark mark,
                                                               size_t hop_window, OnConnection cb) {
  auto l4 = ns->make_socket([] { return net::tcp_listen("127.0.0.1", 0, 256); });
  if (!l4) return l4.error().with_context("interception listener in " + ns->describe());
  auto p4 = net::local_port(l4->get());
  if (!p4) return p4.error();
  uint16_t p6 = 0;
  auto l6 = ns->make_socket([] { return net::tcp_listen("::1", 0, 256); });
  if (l6) {
    auto port = net::local_port(l6->get());
    if (port) p6 = port.value();
  } else {
    LOG_INFO("kubevirt") << "no IPv6 loopback in " << ns->describe() << ": IPv6 connections are not intercepted";
  }
  auto rules = NftRules::install(*ns, p4.value(), p6, mark);
  if (!rules) return rules.error();
  LOG_INFO("kubevirt") << "intercepting in " << ns->describe() << " via 127.0.0.1:" << p4.value()
                       << (p6 ? " and [::1]:" + std::to_string(p6) : std::string());
  return std::unique_ptr<InterceptPoint>(new InterceptPoint(ns, std::move(l4.value()),
                                                            l6 ? std::move(l6.value()) : UniqueFd(),
                                                            std::move(rules.value()), std::move(cb), p4.value(), p6,
                                                            mark, hop_window));
}

Status InterceptPoint::reinstall() {
  // A retired point's namespace may hold a newer point's table by now: never touch it.
  if (retired_.load()) return Error{Errc::kCancelled, "the interception point in " + ns_->describe() + " was retired"};
  auto rules = NftRules::install(*ns_, port4_, port6_, mark_);
  if (!rules) return rules.error();
  return ok_status();
}

InterceptPoint::~InterceptPoint() { retire(); }

void InterceptPoint::retire() {
  if (retired_.exchange(true)) return;
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (auto st = rules_.remove(); !st) {
    LOG_WARN("kubevirt") << "removing the nftables table: " << st.error().message;
  }
}

void InterceptPoint::loop() {
  while (!stop_.load()) {
    pollfd p[2] = {{listen4_.get(), POLLIN, 0}, {listen6_.valid() ? listen6_.get() : -1, POLLIN, 0}};
    const int rc = ::poll(p, 2, 200);
    if (rc <= 0) continue;
    for (auto& e : p) {
      if (e.fd < 0 || !(e.revents & POLLIN)) continue;
      UniqueFd fd(::accept4(e.fd, nullptr, nullptr, SOCK_CLOEXEC));
      if (!fd.valid()) continue;
      auto dst = original_destination(fd.get());
      if (!dst) {
        LOG_WARN("kubevirt") << "intercepted a connection without an original destination: " << dst.error().message;
        continue;
      }
      net::tune_tcp_for_bulk(fd.get());
      net::bound_local_hop(fd.get(), hop_window_);
      on_connection_(std::move(fd), dst.value(), *ns_);
    }
  }
}

}  // namespace rdmig::kubevirt
