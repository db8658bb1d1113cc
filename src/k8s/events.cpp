#include "k8s/events.h"

#include "common/log.h"
#include "common/text.h"
#include "common/units.h"
#include "k8s/time_format.h"

namespace rdmig::k8s {

using nlohmann::json;

namespace {
// "<object>.<16 hex>", at most 253 characters (a DNS subdomain), whatever the object's name length.
std::string event_name(const std::string& object_name) {
  std::string base = object_name.substr(0, 253 - 17);
  while (!base.empty() && (base.back() == '.' || base.back() == '-')) base.pop_back();
  return base + "." + random_hex(8);
}
}  // namespace

void EventRecorder::record(const json& object, const std::string& type, const std::string& reason,
                           const std::string& message) {
  const auto& md = object.value("metadata", json::object());
  const std::string ns = md.value("namespace", "default");
  const std::string name = md.value("name", "");
  const std::string now = format_time(Clock::now());
  json event{{"apiVersion", "v1"},
             {"kind", "Event"},
             {"metadata", {{"name", event_name(name)}, {"namespace", ns}}},
             {"involvedObject",
              {{"apiVersion", object.value("apiVersion", "")},
               {"kind", object.value("kind", "")},
               {"name", name},
               {"namespace", ns},
               {"uid", md.value("uid", "")},
               {"resourceVersion", md.value("resourceVersion", "")}}},
             {"reason", reason},
             {"message", utf8_prefix(message, 1024)},
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
