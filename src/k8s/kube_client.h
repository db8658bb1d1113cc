// KubeClient: the small part of the Kubernetes API that rdmig-controller uses, as JSON over
// API paths ("/apis/rdmig.io/v1alpha1/namespaces/ns/rdmamigrations/name"). The HTTP
// implementation is http_kube_client.h; tests run it against an API server double.
//
// Errors map the HTTP status: 404 kNotFound, 409 with reason AlreadyExists kAlreadyExists,
// other 409 (stale resourceVersion) kFailedPrecondition (see is_conflict), 401 kUnauthenticated,
// 403 kPermissionDenied, 410 kFailedPrecondition with "Gone" in the message, connection
// failures kUnavailable.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "common/result.h"

namespace rdmig::k8s {

struct WatchEvent {
  std::string type;  // ADDED, MODIFIED, DELETED, BOOKMARK, ERROR
  nlohmann::json object;
};

enum class WatchEnd {
  kClosed,   // the server ended the stream (timeoutSeconds, restart): re-watch from the last RV
  kExpired,  // 410 Gone: the resourceVersion is too old: relist
  kStopped,  // the handler returned false or stop_watches() was called
};

class KubeClient {
 public:
  virtual ~KubeClient() = default;

  virtual Result<nlohmann::json> get(const std::string& path) = 0;
  virtual Result<nlohmann::json> create(const std::string& path, const nlohmann::json& body) = 0;
  virtual Result<nlohmann::json> replace(const std::string& path, const nlohmann::json& body) = 0;
  // DELETE; `options` (a DeleteOptions object, e.g. preconditions on uid and resourceVersion)
  // goes as the request's body when it is not null. A precondition that no longer holds is the
  // API server's 409 Conflict (Errc::kFailedPrecondition), and nothing is deleted.
  virtual Result<nlohmann::json> remove(const std::string& path, const nlohmann::json& options) = 0;
  Result<nlohmann::json> remove(const std::string& path) { return remove(path, nullptr); }

  // Streams `path` (which carries ?watch=1&resourceVersion=..) and calls `on_event` for each
  // event, in order, until the stream ends. ERROR events with code 410 end it with kExpired.
  virtual Result<WatchEnd> watch(const std::string& path,
                                 const std::function<bool(const WatchEvent&)>& on_event) = 0;
  // Ends every running watch() promptly (from another thread; used on shutdown).
  virtual void stop_watches() = 0;
};

// 409 from a write with a stale metadata.resourceVersion.
inline bool is_conflict(const Error& e) { return e.code == Errc::kFailedPrecondition; }

// Error for an HTTP status and a Kubernetes Status body ({"reason":..,"message":..}).
Error api_error(int http_status, const std::string& what, const nlohmann::json& body);

}  // namespace rdmig::k8s
