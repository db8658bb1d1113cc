// Who may read the controller's /metrics (metrics.secure, the default): the scrape's bearer token
// is checked with a TokenReview (authentication.k8s.io/v1), then the user it names with a
// SubjectAccessReview (authorization.k8s.io/v1, non-resource URL /metrics, verb get), both against
// the API server, as controller-runtime's secure metrics serving does
// (filters.WithAuthenticationAndAuthorization). So Prometheus reads /metrics with its
// ServiceAccount's token once a ClusterRole with `get` on the non-resource URL /metrics is bound to
// it (the chart's <fullname>-metrics-reader).
//
// Answers: 401 without a bearer token or with one the API server does not authenticate, 403 when
// the user may not get /metrics, 200 when it may; 503 when the API server cannot be reached and
// 500 when it refuses or garbles a review (e.g. the controller may not create reviews): never 200
// without both reviews saying yes.
//
// Each token's outcome is cached so that Prometheus' scrapes do not each cost two API calls:
// allowed for kAllowTtl (the TokenReview is asked again after it, so a revoked token stops working
// within it), forbidden for kDenyTtl, unauthenticated for kUnauthenticatedTtl; failures are never
// cached. At most `max_entries` tokens are kept (by their SHA-256, never the token itself); a full
// cache drops the expired ones, then the least recently used.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>

#include "k8s/kube_client.h"

namespace rdmig::controller {

struct MetricsAuthDecision {
  int status = 500;     // 200, 401, 403, 500 or 503
  std::string user;     // the authenticated user ("" when none)
  std::string message;  // why not (for the error body and the log)
};

class MetricsAuth {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  static constexpr auto kAllowTtl = std::chrono::seconds(60);
  static constexpr auto kDenyTtl = std::chrono::seconds(30);
  static constexpr auto kUnauthenticatedTtl = std::chrono::seconds(10);

  // `kube`: the client the reviews are created with (its calls must time out; main gives it a
  // 10 s call timeout). `clock`: for tests.
  MetricsAuth(k8s::KubeClient& kube, size_t max_entries, Clock clock = &std::chrono::steady_clock::now);

  // The decision for one request: `authorization` is its Authorization header ("" when none),
  // `path` the URL path asked for (the SubjectAccessReview's nonResourceAttributes.path).
  MetricsAuthDecision check(const std::string& authorization, const std::string& path);

  size_t cached();  // entries held now (tests)

 private:
  struct Entry {
    MetricsAuthDecision decision;
    std::chrono::steady_clock::time_point expires;
    std::list<std::string>::iterator use;  // position in lru_
  };
  MetricsAuthDecision review(const std::string& token, const std::string& path);
  void remember(const std::string& key, const MetricsAuthDecision& d);

  k8s::KubeClient& kube_;
  const size_t max_entries_;
  const Clock clock_;
  // Guards entries_ and lru_: check() (the metrics server's worker threads) looks up and stores
  // under it; never held across a review (the API calls run without it, so two scrapes with one
  // new token may both ask: harmless).
  std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;  // key: hex SHA-256 of token, then the path
  std::list<std::string> lru_;                      // most recently used first
};

}  // namespace rdmig::controller
