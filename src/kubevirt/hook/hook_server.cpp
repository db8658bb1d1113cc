#include "kubevirt/hook/hook_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "common/log.h"
#include "common/net.h"
#include "kubevirt/flow/relay.h"
#include "node_hook.grpc.pb.h"
#include "common/json_limits.h"

namespace rdmig::kubevirt {

namespace pb = ::kubevirt::hooks::plugins::v1alpha1;

constexpr int kMaxRequestBytes = 4 * 1024 * 1024;

class HookServer::Service final : public pb::NodeHookService::Service {
 public:
  explicit Service(const HookServer& owner) : owner_(owner) {}
  grpc::Status ExecuteNodeHook(grpc::ServerContext* ctx, const pb::ExecuteNodeHookRequest* req,
                               pb::ExecuteNodeHookResponse*) override {
    owner_.dispatch(req->hookpoint(), req->vmi(), req->node_context().node_name(), ctx->peer());
    return grpc::Status::OK;
  }

 private:
  const HookServer& owner_;
};

HookServer::HookServer(std::string path, UniqueFd listener, Handler handler)
    : path_(std::move(path)), listener_(std::move(listener)), handler_(std::move(handler)) {}

Result<std::unique_ptr<HookServer>> HookServer::start(const std::string& socket_path, Handler handler) {
  const auto slash = socket_path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    const std::string dir = socket_path.substr(0, slash);
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return errno_error("kubevirt.hookSocket: mkdir " + dir, errno);
  }
  ::unlink(socket_path.c_str());
  auto listener = net::unix_listen(socket_path, 64);
  if (!listener) return listener.error().with_context("kubevirt.hookSocket");
  // virt-handler runs as root: only root may call the hook.
  ::chmod(socket_path.c_str(), 0600);
  std::unique_ptr<HookServer> s(new HookServer(socket_path, std::move(listener.value()), std::move(handler)));
  struct stat bound {};
  if (::stat(socket_path.c_str(), &bound) == 0) {
    s->bound_ino_ = bound.st_ino;
    s->bound_dev_ = bound.st_dev;
  }
  s->service_ = std::make_unique<Service>(*s);
  grpc::ServerBuilder builder;
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.SetMaxSendMessageSize(1024);
  s->server_ = builder.BuildAndStart();
  if (!s->server_) return Error{Errc::kInternal, "kubevirt.hookSocket: gRPC server did not start"};
  s->acceptor_ = std::thread([p = s.get()] { p->accept_loop(); });
  LOG_INFO("kubevirt") << "node hook (gRPC NodeHookService) on " << socket_path;
  return s;
}

HookServer::~HookServer() {
  stop_ = true;
  if (acceptor_.joinable()) acceptor_.join();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  ::unlink(path_.c_str());
}

void HookServer::accept_loop() {
  while (!stop_.load()) {
    pollfd p{listener_.get(), POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    ucred cred{};
    socklen_t len = sizeof cred;
    pid_t pid = 0;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) pid = cred.pid;
    {
      std::lock_guard lock(mu_);
      callers_[fd] = pid;  // fd numbers are reused: the newest connection on an fd wins
    }
    grpc::AddInsecureChannelFromFd(server_.get(), fd);  // gRPC owns and closes the fd
  }
}

bool HookServer::serving() const {
  // A unix socket's fd has its own (sockfs) inode: the path's inode is noted when it is bound.
  struct stat on_disk {};
  if (stop_.load() || ::stat(path_.c_str(), &on_disk) != 0) return false;
  return S_ISSOCK(on_disk.st_mode) && on_disk.st_ino == bound_ino_ && on_disk.st_dev == bound_dev_;
}

pid_t HookServer::caller_of(const std::string& peer) const {
  // gRPC names a connection added by fd "fd:<n>".
  if (peer.rfind("fd:", 0) != 0) return 0;
  int fd = -1;
  try {
    fd = std::stoi(peer.substr(3));
  } catch (...) {
    return 0;
  }
  std::lock_guard lock(mu_);
  auto it = callers_.find(fd);
  return it == callers_.end() ? 0 : it->second;
}

void HookServer::dispatch(const std::string& hook_point, const std::string& vmi, const std::string& node,
                          const std::string& peer) const {
  handler_(hook_point, vmi, node, caller_of(peer));
}

Result<std::unique_ptr<HookServer>> start_hook_server(const std::string& socket_path, KubevirtRelay& relay) {
  return HookServer::start(socket_path, [&relay](const std::string& point, const std::string& vmi_text,
                                                 const std::string& node, pid_t caller) {
    if (point != "PreMigrationSource") {
      LOG_DEBUG("kubevirt") << "hook point " << point << ": nothing to do";
      return;
    }
    auto vmi = parse_json_bounded(vmi_text);
    if (vmi.is_discarded()) {
      LOG_WARN("kubevirt") << "hook: the VMI is not valid JSON; not carried";
      return;
    }
    (void)relay.pre_migration_source(vmi, node, caller);
  });
}

}  // namespace rdmig::kubevirt
