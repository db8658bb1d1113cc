#include "controller/metrics_auth.h"

#include <openssl/sha.h>

#include <cstdio>

#include "common/log.h"

namespace rdmig::controller {

using nlohmann::json;

namespace {

constexpr const char* kTokenReviews = "/apis/authentication.k8s.io/v1/tokenreviews";
constexpr const char* kAccessReviews = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

std::string sha256_hex(const std::string& text) {
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), md);
  std::string hex;
  hex.reserve(2 * sizeof md);
  char byte[3];
  for (unsigned char c : md) {
    std::snprintf(byte, sizeof byte, "%02x", c);
    hex += byte;
  }
  return hex;
}

// A review the API server did not answer: 503 when it could not be reached (or is overloaded),
// else 500. Never 200.
MetricsAuthDecision failed(const char* which, const Error& e) {
  const bool unavailable = e.code == Errc::kUnavailable || e.code == Errc::kTimeout || e.code == Errc::kResourceExhausted;
  std::string hint;
  if (e.code == Errc::kPermissionDenied) {
    hint = std::string(" (the controller's ServiceAccount needs create on ") +
           (std::string(which) == "TokenReview" ? "tokenreviews" : "subjectaccessreviews") + ")";
  }
  return {unavailable ? 503 : 500, "", std::string(which) + " failed: " + e.message + hint};
}

}  // namespace

MetricsAuth::MetricsAuth(k8s::KubeClient& kube, size_t max_entries, Clock clock)
    : kube_(kube), max_entries_(max_entries < 1 ? 1 : max_entries), clock_(std::move(clock)) {}

MetricsAuthDecision MetricsAuth::check(const std::string& authorization, const std::string& path) {
  const std::string prefix = "Bearer ";
  if (authorization.size() <= prefix.size() || authorization.compare(0, prefix.size(), prefix) != 0) {
    return {401, "", "Authorization: a bearer token is required (a ServiceAccount token allowed to get /metrics)"};
  }
  const std::string token = authorization.substr(prefix.size());
  const std::string key = sha256_hex(token) + " " + path;
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      if (clock_() < it->second.expires) {
        lru_.splice(lru_.begin(), lru_, it->second.use);
        return it->second.decision;
      }
      lru_.erase(it->second.use);
      entries_.erase(it);
    }
  }
  MetricsAuthDecision d = review(token, path);
  if (d.status == 200 || d.status == 401 || d.status == 403) remember(key, d);
  return d;
}

MetricsAuthDecision MetricsAuth::review(const std::string& token, const std::string& path) {
  const json token_review = {{"apiVersion", "authentication.k8s.io/v1"},
                             {"kind", "TokenReview"},
                             {"spec", {{"token", token}}}};
  auto tr = kube_.create(kTokenReviews, token_review);
  if (!tr) return failed("TokenReview", tr.error());
  const json status = tr->value("status", json::object());
  if (!status.is_object()) return {500, "", "TokenReview: the answer carries no status"};
  if (!status.value("authenticated", false)) {
    const std::string why = status.value("error", "");
    return {401, "", "Authorization: the token is not valid" + (why.empty() ? std::string() : " (" + why + ")")};
  }
  const json user = status.value("user", json::object());
  const std::string username = user.is_object() ? user.value("username", "") : "";
  if (username.empty()) return {500, "", "TokenReview: authenticated, but the answer names no user"};

  json spec = {{"user", username}, {"nonResourceAttributes", {{"path", path}, {"verb", "get"}}}};
  if (user.contains("uid") && user["uid"].is_string()) spec["uid"] = user["uid"];
  if (user.contains("groups") && user["groups"].is_array()) spec["groups"] = user["groups"];
  if (user.contains("extra") && user["extra"].is_object()) spec["extra"] = user["extra"];
  const json access_review = {{"apiVersion", "authorization.k8s.io/v1"},
                              {"kind", "SubjectAccessReview"},
                              {"spec", spec}};
  auto sar = kube_.create(kAccessReviews, access_review);
  if (!sar) return failed("SubjectAccessReview", sar.error());
  const json sar_status = sar->value("status", json::object());
  if (!sar_status.is_object()) return {500, username, "SubjectAccessReview: the answer carries no status"};
  if (!sar_status.value("allowed", false)) {
    const std::string reason = sar_status.value("reason", "");
    return {403, username,
            "user '" + username + "' may not get " + path + (reason.empty() ? std::string() : ": " + reason) +
                " (bind a ClusterRole with get on the non-resource URL " + path + ", e.g. the chart's metrics-reader)"};
  }
  return {200, username, ""};
}

void MetricsAuth::remember(const std::string& key, const MetricsAuthDecision& d) {
  const auto now = clock_();
  const auto ttl = d.status == 200 ? std::chrono::steady_clock::duration(kAllowTtl)
                   : d.status == 403 ? std::chrono::steady_clock::duration(kDenyTtl)
                                     : std::chrono::steady_clock::duration(kUnauthenticatedTtl);
  std::lock_guard lock(mu_);
  if (auto it = entries_.find(key); it != entries_.end()) {  // asked twice at once: keep the newer
    lru_.erase(it->second.use);
    entries_.erase(it);
  }
  if (entries_.size() >= max_entries_) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.expires <= now) {
        lru_.erase(it->second.use);
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }
  while (entries_.size() >= max_entries_) {
    entries_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(key);
  entries_.emplace(key, Entry{d, now + ttl, lru_.begin()});
}

size_t MetricsAuth::cached() {
  std::lock_guard lock(mu_);
  return entries_.size();
}

}  // namespace rdmig::controller
