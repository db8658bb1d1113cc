#include "controller/kubevirt.h"

#include "k8s/selectors.h"

namespace rdmig::controller {

using nlohmann::json;

json without_nulls(const json& j) {
  if (j.is_object()) {
    json out = json::object();
    for (const auto& [k, v] : j.items()) {
      if (!v.is_null()) out[k] = without_nulls(v);
    }
    return out;
  }
  if (j.is_array()) {
    json out = json::array();
    for (const auto& v : j) out.push_back(without_nulls(v));
    return out;
  }
  return j;
}

std::string vmi_path(const std::string& ns, const std::string& name) {
  return std::string(kKubevirtApi) + "/namespaces/" + ns + "/virtualmachineinstances/" + name;
}

std::string vmim_path(const std::string& ns, const std::string& name) {
  return std::string(kKubevirtApi) + "/namespaces/" + ns + "/virtualmachineinstancemigrations/" + name;
}

std::string vmim_collection(const std::string& watch_namespace) {
  return watch_namespace.empty()
             ? std::string(kKubevirtApi) + "/virtualmachineinstancemigrations"
             : std::string(kKubevirtApi) + "/namespaces/" + watch_namespace + "/virtualmachineinstancemigrations";
}

std::string vmim_name_for(const json& obj) {
  std::string name = "rdmig-" + obj["metadata"].value("name", "");
  if (name.size() > 253) name.resize(253);
  while (!name.empty() && (name.back() == '-' || name.back() == '.')) name.pop_back();
  return name;
}

json vmim_for(const json& obj, const std::string& vmi_name, const std::map<std::string, std::string>& node_selector) {
  const auto& md = obj["metadata"];
  json vmim{{"apiVersion", "kubevirt.io/v1"},
            {"kind", "VirtualMachineInstanceMigration"},
            {"metadata",
             {{"name", vmim_name_for(obj)},
              {"namespace", md.value("namespace", "")},
              {"labels", {{"app.kubernetes.io/managed-by", "rdmig-controller"}}},
              // No blockOwnerDeletion: it would need update on rdmamigrations/finalizers.
              {"ownerReferences",
               json::array({{{"apiVersion", "rdmig.io/v1alpha1"},
                             {"kind", "RdmaMigration"},
                             {"name", md.value("name", "")},
                             {"uid", md.value("uid", "")},
                             {"controller", true}}})}}},
            {"spec", {{"vmiName", vmi_name}}}};
  if (!node_selector.empty()) vmim["spec"]["addedNodeSelector"] = node_selector;
  return vmim;
}

bool owned_by_rdma_migration(const json& vmim, const std::string& uid) {
  for (const auto& o : vmim.value("metadata", json::object()).value("ownerReferences", json::array())) {
    if (o.value("kind", "") == "RdmaMigration" && o.value("apiVersion", "").rfind("rdmig.io/", 0) == 0 &&
        (uid.empty() || o.value("uid", "") == uid)) {
      return true;
    }
  }
  return false;
}

bool vmim_phase_terminal(const std::string& phase) { return phase == "Succeeded" || phase == "Failed"; }

json migration_state_for(const json& vmi, const std::string& migration_uid) {
  const json ms = without_nulls(vmi.value("status", json::object()).value("migrationState", json()));
  if (!ms.is_object() || migration_uid.empty() || ms.value("migrationUid", "") != migration_uid) return json();
  return ms;
}

std::string vmi_refusal(const json& raw, std::string& reason_code) {
  const json vmi = without_nulls(raw);
  const auto& md = vmi.value("metadata", json::object());
  const std::string who = "VirtualMachineInstance " + md.value("namespace", "") + "/" + md.value("name", "");
  const json& st = vmi.value("status", json::object());
  const std::string phase = st.value("phase", "");
  if (phase != "Running") {
    reason_code = "VMINotRunning";
    return who + " is " + (phase.empty() ? "not started yet" : phase) + ", not Running";
  }
  for (const auto& c : st.value("conditions", json::array())) {
    if (c.value("type", "") == "LiveMigratable" && c.value("status", "") == "False") {
      reason_code = "NotLiveMigratable";
      return who + " is not live-migratable: " + c.value("reason", "no reason given") +
             (c.value("message", "").empty() ? "" : ": " + c.value("message", ""));
    }
  }
  const json& ms = st.value("migrationState", json());
  if (ms.is_object() && !ms.value("completed", false) && !ms.value("failed", false)) {
    reason_code = "AlreadyMigrating";
    return who + " is already migrating (migration " + ms.value("migrationUid", "?") + ", source node " +
           ms.value("sourceNode", "?") + ")";
  }
  return "";
}

Result<AgentAddress> locate_agent(k8s::KubeClient& kube, const ControllerConfig& config,
                                  const std::string& agent_namespace, const std::string& node) {
  const std::string path = "/api/v1/namespaces/" + agent_namespace + "/pods?labelSelector=" +
                           k8s::url_encode(k8s::label_selector(config.agents.labels)) +
                           "&fieldSelector=" + k8s::url_encode("spec.nodeName=" + k8s::field_selector_value(node));
  auto pods = kube.get(path);
  if (!pods) return pods.error().with_context("listing agent pods");
  auto picked = select_agent_pod(pods.value(), node, config.agents.port_name, config.agents.port);
  if (!picked) {
    return Error{picked.error().code, picked.error().message + " (namespace '" + agent_namespace +
                                          "', labelSelector '" + config.agents.label_selector + "')"};
  }
  return picked;
}

KubevirtRecord lookup_kubevirt_record(k8s::KubeClient& kube, AgentClient& agents, const ControllerConfig& config,
                                      const std::string& agent_namespace, const std::string& source_node,
                                      const std::string& target_node, const std::string& migration_uid) {
  KubevirtRecord out;
  const std::string nodes[] = {source_node, target_node};
  for (size_t i = 0; i < 2; ++i) {
    const std::string& node = nodes[i];
    if (node.empty() || (i == 1 && node == nodes[0])) continue;
    auto agent = locate_agent(kube, config, agent_namespace, node);
    if (!agent) {
      out.problems += (out.problems.empty() ? "" : "; ") + agent.error().message;
      continue;
    }
    auto items = agents.kubevirt_migrations(agent.value(), migration_uid);
    if (!items) {
      out.problems += (out.problems.empty() ? "" : "; ") + items.error().message;
      continue;
    }
    out.reachable = true;
    for (const auto& raw : items.value()) {
      const json item = without_nulls(raw);
      if (item.is_object() && item.value("migrationUid", "") == migration_uid) {
        out.item = item;
        out.where = "agent " + agent->pod + " on node " + node;
        return out;
      }
    }
  }
  return out;
}

}  // namespace rdmig::controller
