// rdmig-controller's own Prometheus metrics (prometheus-cpp registry, served by main).
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <string>

namespace rdmig::controller {

class ControllerMetrics {
 public:
  ControllerMetrics();

  void reconciled(const std::string& result);  // success, error
  void agent_request(const std::string& code);  // HTTP status or "error"
  void set_leader(bool leading);
  // Objects by status.phase ("" counts as Pending); every phase is always exported.
  void set_phase_counts(const std::map<std::string, int>& counts);
  std::string serialize() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& reconciles_;
  prometheus::Family<prometheus::Gauge>& migrations_;
  prometheus::Gauge& leader_;
  prometheus::Family<prometheus::Counter>& agent_requests_;
};

}  // namespace rdmig::controller
