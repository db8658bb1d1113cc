#include "k8s/events.h"

#include "common/log.h"
#include "common/units.h"
#include "k8s/time_format.h"

namespace rdmig::k8s {

using nlohmann::json;

void EventRecorder::record(const json& object, const std::string& type, const std::string& reason,
                           const std::string& message) {
  const auto& md = object.value("metadata", json::object());
  const std::string ns = md.value("namespace", "default");
  const std::string name = md.value("name", "");
  const std::string now = format_time(Clock::now());
  json event{{"apiVersion", "v1"},
             {"kind", "Event"},
             {"metadata", {{"name", name + "." + random_hex(8)}, {"namespace", ns}}},
             {"involvedObject",
              {{"apiVersion", object.value("apiVersion", "")},
               {"kind", object.value("kind", "")},
               {"name", name},
               {"namespace", ns},
               {"uid", md.value("uid", "")},
               {"resourceVersion", md.value("resourceVersion", "")}}},
             {"reason", reason},
             {"message", message.substr(0, 1024)},
             {"type", type},
             {"source", {{"component", component_}, {"host", host_}}},
             {"reportingComponent", component_},
             {"reportingInstance", host_},
             {"firstTimestamp", now},
             {"lastTimestamp", now},
             {"count", 1}};
  if (auto r = client_.create("/api/v1/namespaces/" + ns + "/events", event); !r) {
    LOG_WARN("events") << "cannot record event " << reason << " for " << ns << "/" << name << ": "
                       << r.error().message;
  }
}

}  // namespace rdmig::k8s
