#include "k8s/informer.h"

#include "common/log.h"
#include "k8s/backoff.h"

namespace rdmig::k8s {

using nlohmann::json;
using namespace std::chrono_literals;

bool resource_version_newer(const std::string& a, const std::string& b) {
  auto num = [](const std::string& s) -> std::optional<unsigned long long> {
    if (s.empty() || s.size() > 19 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
    return std::stoull(s);
  };
  const auto x = num(a), y = num(b);
  return x && y && *x > *y;
}

Informer::Informer(KubeClient& client, std::string collection_path, std::string query, Handler handler)
    : client_(client), path_(std::move(collection_path)), query_(std::move(query)), handler_(std::move(handler)) {}

std::string Informer::key_of(const json& object) {
  const auto& md = object.value("metadata", json::object());
  return md.value("namespace", "") + "/" + md.value("name", "");
}

std::optional<json> Informer::get(const std::string& key) const {
  std::lock_guard lock(mu_);
  auto it = cache_.find(key);
  if (it == cache_.end()) return std::nullopt;
  return it->second;
}

std::vector<json> Informer::list() const {
  std::lock_guard lock(mu_);
  std::vector<json> out;
  out.reserve(cache_.size());
  for (const auto& [k, v] : cache_) out.push_back(v);
  return out;
}

void Informer::observe(const json& object) {
  const std::string key = key_of(object);
  {
    std::lock_guard lock(mu_);
    // Only refresh what the cache holds: an object the watch has already reported deleted
    // must not come back from a reply that raced with the DELETED event.
    auto it = cache_.find(key);
    if (it == cache_.end()) return;
    const std::string have = it->second["metadata"].value("resourceVersion", "");
    const std::string got = object["metadata"].value("resourceVersion", "");
    if (resource_version_newer(have, got)) return;
    it->second = object;
  }
}

void Informer::forget(const std::string& key) {
  std::lock_guard lock(mu_);
  cache_.erase(key);
}

void Informer::apply(const std::string& type, const json& object) {
  const std::string key = key_of(object);
  {
    std::lock_guard lock(mu_);
    if (type == "DELETED") {
      cache_.erase(key);
    } else {
      cache_[key] = object;
    }
    const std::string rv = object["metadata"].value("resourceVersion", "");
    if (!rv.empty()) resource_version_ = rv;
  }
  handler_(type, key);
}

Status Informer::relist() {
  auto listed = client_.get(path_ + (query_.empty() ? "" : "?" + query_));
  if (!listed) return listed.error();
  lists_++;
  const json& items = (*listed)["items"];
  std::map<std::string, json> fresh;
  if (items.is_array()) {
    for (const auto& item : items) fresh[key_of(item)] = item;
  }
  std::vector<std::pair<std::string, std::string>> changes;  // (type, key)
  {
    std::lock_guard lock(mu_);
    for (const auto& [k, v] : cache_) {
      if (!fresh.contains(k)) changes.emplace_back("DELETED", k);
    }
    for (const auto& [k, v] : fresh) {
      auto it = cache_.find(k);
      if (it == cache_.end()) changes.emplace_back("ADDED", k);
      else if (it->second != v) changes.emplace_back("MODIFIED", k);
    }
    cache_ = std::move(fresh);
    resource_version_ = (*listed)["metadata"].value("resourceVersion", "");
  }
  synced_ = true;
  LOG_DEBUG("k8s") << "listed " << path_ << " at resourceVersion " << resource_version_ << ": "
                   << changes.size() << " changes";
  for (const auto& [type, key] : changes) handler_(type, key);
  return ok_status();
}

bool Informer::sleep_for(std::chrono::milliseconds d) {
  std::unique_lock lock(stop_mu_);
  stop_cv_.wait_for(lock, d, [this] { return stopping_.load(); });
  return !stopping_.load();
}

void Informer::run() {
  Backoff backoff(200ms, 10s);
  bool need_list = true;
  while (!stopping_.load()) {
    if (need_list) {
      if (auto st = relist(); !st) {
        LOG_WARN("k8s") << "list " << path_ << ": " << st.error().message;
        if (!sleep_for(backoff.next())) return;
        continue;
      }
      need_list = false;
    }
    std::string rv;
    {
      std::lock_guard lock(mu_);
      rv = resource_version_;
    }
    const std::string watch_path = path_ + "?watch=1&allowWatchBookmarks=true&resourceVersion=" + rv +
                                   (query_.empty() ? "" : "&" + query_);
    auto end = client_.watch(watch_path, [this](const WatchEvent& ev) {
      if (stopping_.load()) return false;
      if (ev.type == "BOOKMARK") {
        const std::string brv = ev.object["metadata"].value("resourceVersion", "");
        std::lock_guard lock(mu_);
        if (!brv.empty()) resource_version_ = brv;
        return true;
      }
      if (ev.type == "ADDED" || ev.type == "MODIFIED" || ev.type == "DELETED") apply(ev.type, ev.object);
      return true;
    });
    if (stopping_.load()) return;
    if (!end) {
      LOG_WARN("k8s") << "watch " << path_ << ": " << end.error().message;
      if (!sleep_for(backoff.next())) return;
      continue;
    }
    backoff.reset();
    if (end.value() == WatchEnd::kExpired) {
      expired_++;
      LOG_INFO("k8s") << "watch " << path_ << ": resourceVersion " << rv << " expired (410): relisting";
      need_list = true;
    }
  }
}

void Informer::stop() {
  {
    std::lock_guard lock(stop_mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
}

}  // namespace rdmig::k8s
