#include "controller/controller_metrics.h"

#include <prometheus/text_serializer.h>

namespace rdmig::controller {

ControllerMetrics::ControllerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      reconciles_(prometheus::BuildCounter()
                      .Name("rdmig_controller_reconciles_total")
                      .Help("Reconciles of RdmaMigration objects by result (success, error)")
                      .Register(*registry_)),
      migrations_(prometheus::BuildGauge()
                      .Name("rdmig_controller_migrations")
                      .Help("RdmaMigration objects by status phase, as this replica sees them")
                      .Register(*registry_)),
      leader_(prometheus::BuildGauge()
                  .Name("rdmig_controller_leader")
                  .Help("1 when this replica holds the leader lease and acts, else 0")
                  .Register(*registry_)
                  .Add({})),
      agent_requests_(prometheus::BuildCounter()
                          .Name("rdmig_controller_agent_requests_total")
                          .Help("Requests to agents' REST API by HTTP status code (error: no response)")
                          .Register(*registry_)) {
  reconciles_.Add({{"result", "success"}});
  reconciles_.Add({{"result", "error"}});
  set_phase_counts({});
}

void ControllerMetrics::reconciled(const std::string& result) { reconciles_.Add({{"result", result}}).Increment(); }
void ControllerMetrics::agent_request(const std::string& code) { agent_requests_.Add({{"code", code}}).Increment(); }
void ControllerMetrics::set_leader(bool leading) { leader_.Set(leading ? 1 : 0); }

void ControllerMetrics::set_phase_counts(const std::map<std::string, int>& counts) {
  for (const char* phase : {"Pending", "PreparingTarget", "Migrating", "Succeeded", "Failed", "Cancelled"}) {
    auto it = counts.find(phase);
    migrations_.Add({{"phase", phase}}).Set(it == counts.end() ? 0 : it->second);
  }
}

std::string ControllerMetrics::serialize() const {
  prometheus::TextSerializer s;
  return s.Serialize(registry_->Collect());
}

}  // namespace rdmig::controller
