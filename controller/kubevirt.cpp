#include "controller/kubevirt.h"

#include <algorithm>
#include <vector>

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

std::string rdma_migration_key_of(const nlohmann::json& vmim) {
  std::string owner;
  const auto& meta = vmim.value("metadata", nlohmann::json::object());
  for (const auto& ref : meta.value("ownerReferences", nlohmann::json::array())) {
    if (ref.value("kind", "") == "RdmaMigration") owner = meta.value("namespace", "") + "/" + ref.value("name", "");
  }
  return owner;
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
                                  const std::string& agent_namespace, const std::string& node, bool draining_ok) {
  const std::string path = "/api/v1/namespaces/" + agent_namespace + "/pods?labelSelector=" +
                           k8s::url_encode(k8s::label_selector(config.agents.labels)) +
                           "&fieldSelector=" + k8s::url_encode("spec.nodeName=" + k8s::field_selector_value(node));
  auto pods = kube.get(path);
  if (!pods) return pods.error().with_context("listing agent pods");
  auto picked = select_agent_pod(pods.value(), node, config.agents.port_name, config.agents.port, draining_ok);
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
    // A draining agent still serves its records (the migration may have run through it).
    auto agent = locate_agent(kube, config, agent_namespace, node, /*draining_ok=*/true);
    if (!agent) {
      out.problems += (out.problems.empty() ? "" : "; ") + agent.error().message;
      continue;
    }
    auto items = agents.kubevirt_migrations(agent.value(), migration_uid);
    if (!items && items.error().code == Errc::kFailedPrecondition) {
      out.reachable = true;
      out.mode_off.push_back(node);
      continue;
    }
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

namespace {

// The command that turns KubeVirt's "Plugins" gate on in `kv`: a JSON patch that appends to its
// featureGates list when it has one (a merge patch would replace the list), else a merge patch
// that makes the list (a JSON patch "add .../featureGates/-" fails on a missing list).
std::string plugins_gate_command(const nlohmann::json& kv, const std::string& name, const std::string& ns) {
  const nlohmann::json* gates = &kv;
  for (const char* key : {"spec", "configuration", "developerConfiguration", "featureGates"}) {
    gates = gates->is_object() && gates->contains(key) ? &(*gates)[key] : nullptr;
    if (gates == nullptr) break;
  }
  const std::string head = "kubectl patch kubevirt " + name + " -n " + ns;
  if (gates != nullptr && gates->is_array()) {
    return head + " --type json -p '[{\"op\":\"add\",\"path\":\"/spec/configuration/developerConfiguration/"
                  "featureGates/-\",\"value\":\"Plugins\"}]'";
  }
  return head + " --type merge -p '{\"spec\":{\"configuration\":{\"developerConfiguration\":{\"featureGates\":"
                "[\"Plugins\"]}}}}'";
}

}  // namespace

std::pair<std::string, std::string> diagnose_not_carried(k8s::KubeClient& kube, const KubevirtRecord& rec,
                                                         const std::string& source_node,
                                                         const std::string& target_node,
                                                         const std::string& migration_uid) {
  const std::string nodes = "node " + source_node + (target_node.empty() || target_node == source_node ? "" : " or " + target_node);
  const std::string own = "; KubeVirt's own transport carried it";
  // Every missing piece the cluster shows, most fundamental first: {reason, what and how to turn it on}.
  std::vector<std::pair<std::string, std::string>> missing;
  if (std::find(rec.mode_off.begin(), rec.mode_off.end(), source_node) != rec.mode_off.end()) {
    missing.emplace_back("AgentNotInKubevirtMode",
                         "the rdmig agent on source node " + source_node +
                             " runs without KubeVirt mode, so it serves no node hook: install the chart with "
                             "kubevirt.enabled=true (agent config kubevirt.enabled)");
  }
  std::string unknown;  // what could not be checked, for the last message
  auto plugins = kube.get("/apis/plugin.kubevirt.io/v1alpha1/plugins");
  const bool no_plugin_api = !plugins && plugins.error().code == Errc::kNotFound;
  if (no_plugin_api) {
    // A KubeVirt without node-hook Plugins has no Plugins gate either: nothing more to name.
    missing.emplace_back("PluginApiMissing",
                         "this cluster serves no plugin.kubevirt.io Plugin API, so nothing can register rdmig's node "
                         "hook (KubeVirt's node-hook Plugins are in KubeVirt 1.9 and newer)");
  } else if (!plugins) {
    unknown += "; could not read Plugin objects: " + plugins.error().message;
  } else {
    bool hooked = false;
    for (const auto& p : plugins.value().value("items", nlohmann::json::array())) {
      for (const auto& h : without_nulls(p).value("spec", nlohmann::json::object()).value("nodeHooks", nlohmann::json::array())) {
        for (const auto& name : h.value("permittedHooks", nlohmann::json::array())) {
          hooked = hooked || (name.is_string() && name.get<std::string>() == "PreMigrationSource");
        }
      }
    }
    if (!hooked) {
      missing.emplace_back("PluginMissing",
                           "no Plugin object registers a PreMigrationSource node hook, so virt-handler never calls "
                           "rdmig's agent: install the chart with kubevirt.plugin.enabled=true");
    }
  }
  auto kubevirts = no_plugin_api ? Result<nlohmann::json>(nlohmann::json::object())
                                 : kube.get(std::string(kKubevirtApi) + "/kubevirts");
  if (!kubevirts) {
    unknown += "; could not read the KubeVirt object: " + kubevirts.error().message;
  } else {
    for (const auto& kv : kubevirts.value().value("items", nlohmann::json::array())) {
      const nlohmann::json o = without_nulls(kv);
      const nlohmann::json gates = o.value("spec", nlohmann::json::object())
                                       .value("configuration", nlohmann::json::object())
                                       .value("developerConfiguration", nlohmann::json::object())
                                       .value("featureGates", nlohmann::json::array());
      bool on = false;
      for (const auto& g : gates) on = on || (g.is_string() && g.get<std::string>() == "Plugins");
      if (!on) {
        const auto md = o.value("metadata", nlohmann::json::object());
        const std::string name = md.value("name", "kubevirt"), ns = md.value("namespace", "kubevirt");
        missing.emplace_back("PluginsGateOff", "KubeVirt's feature gate \"Plugins\" is off in " + ns + "/" + name +
                                                   ", so virt-handler ignores rdmig's Plugin: " +
                                                   plugins_gate_command(o, name, ns));
        break;  // one KubeVirt per cluster
      }
    }
  }
  if (missing.size() == 1) return {missing[0].first, missing[0].second + unknown + own};
  if (!missing.empty()) {
    // All at once, so that turning one on does not merely uncover the next.
    std::string message = std::to_string(missing.size()) + " things keep rdmig from carrying KubeVirt's migrations:";
    for (size_t i = 0; i < missing.size(); ++i) {
      message += (i == 0 ? " (" : "; (") + std::to_string(i + 1) + ") " + missing[i].first + ": " + missing[i].second;
    }
    return {missing[0].first, message + unknown + own};
  }
  return {"NoAgentRecord",
          "no rdmig agent on " + nodes + " has a record of migration " + migration_uid +
              (unknown.empty() ? ": the Plugin exists and the Plugins gate is on; the agent's log on node " + source_node +
                                     " says whether virt-handler called its node hook"
                               : ": KubeVirt's node hook may not be installed (Plugin object, Plugins feature gate)" + unknown) +
              own};
}

}  // namespace rdmig::controller
