// KubeClient over HTTPS (cpp-httplib with OpenSSL). One connection per call (calls come from
// a few threads at a low rate; a stuck call never blocks another thread), one per watch.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <set>

#include "k8s/cluster_config.h"
#include "k8s/kube_client.h"

namespace httplib {
class ClientImpl;
}

namespace rdmig::k8s {

struct HttpOptions {
  int request_timeout_seconds = 15;
  int watch_timeout_seconds = 300;  // asked of the server (timeoutSeconds); the read timeout is larger
  std::string user_agent = "rdmig-controller";
  // When set: the connect, read and write timeouts of every call (not of watches), for callers
  // that must decide quickly (the agent's VMI checks); else 5 s connect, request_timeout reads.
  std::chrono::milliseconds call_timeout{0};
};

class HttpKubeClient final : public KubeClient {
 public:
  // Checks the config (server URL, CA and client certificate readable and parseable).
  static Result<std::unique_ptr<HttpKubeClient>> create(ClusterConfig config, HttpOptions options);
  ~HttpKubeClient() override;

  Result<nlohmann::json> get(const std::string& path) override;
  Result<nlohmann::json> create(const std::string& path, const nlohmann::json& body) override;
  Result<nlohmann::json> replace(const std::string& path, const nlohmann::json& body) override;
  Result<nlohmann::json> remove(const std::string& path, const nlohmann::json& options) override;
  using KubeClient::remove;
  Result<WatchEnd> watch(const std::string& path,
                         const std::function<bool(const WatchEvent&)>& on_event) override;
  void stop_watches() override;

 private:
  HttpKubeClient(ClusterConfig config, ServerAddress address, HttpOptions options);
  Result<std::unique_ptr<httplib::ClientImpl>> make_client(int read_timeout_seconds) const;
  Result<std::unique_ptr<httplib::ClientImpl>> make_call_client() const;
  Result<std::string> bearer_token() const;
  Result<nlohmann::json> call(const char* method, const std::string& path, const nlohmann::json* body);

  ClusterConfig config_;
  ServerAddress address_;
  HttpOptions options_;
  // Guards watches_ and stopping_: watch() (each informer's thread) registers and unregisters
  // its client under it, stop_watches() (the shutdown path) sets stopping_ and stops every
  // registered client under it. Held only for those set operations, never across a request.
  std::mutex watches_mu_;
  std::set<httplib::ClientImpl*> watches_;
  bool stopping_ = false;
};

}  // namespace rdmig::k8s
