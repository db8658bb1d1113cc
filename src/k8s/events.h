// Records core/v1 Events about an object (what `kubectl describe` shows). Best effort: a
// failure to record is logged, never fails the caller.
#pragma once

#include <string>

#include "k8s/kube_client.h"

namespace rdmig::k8s {

class EventRecorder {
 public:
  EventRecorder(KubeClient& client, std::string component, std::string host)
      : client_(client), component_(std::move(component)), host_(std::move(host)) {}

  // `type`: Normal or Warning. `object`: the involved object as read from the API.
  void record(const nlohmann::json& object, const std::string& type, const std::string& reason,
              const std::string& message);

 private:
  KubeClient& client_;
  std::string component_;
  std::string host_;
};

}  // namespace rdmig::k8s
