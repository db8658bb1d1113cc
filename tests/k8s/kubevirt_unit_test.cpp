// Unit tests for the KubeVirt side of the controller: the vmi kind of the spec, the VMI
// checks, the VMIM rdmig creates, the mapping of KubeVirt's and rdmig's figures into status,
// the printer-column strings, the qemu opt-in, and the bounded per-VMI metrics.
#include <gtest/gtest.h>

#include "controller/config.h"
#include "controller/controller_metrics.h"
#include "controller/kubevirt.h"
#include "controller/migration_spec.h"
#include "controller/status_mapping.h"

using nlohmann::json;
using namespace rdmig;

namespace {
json vmi_spec() { return json{{"source", {{"vmi", {{"name", "web-1"}}}}}}; }
json running_vmi() {
  return json{{"metadata", {{"namespace", "prod"}, {"name", "web-1"}}},
              {"status",
               {{"phase", "Running"},
                {"nodeName", "node-a"},
                {"conditions", json::array({{{"type", "LiveMigratable"}, {"status", "True"}}})}}}};
}
}  // namespace

TEST(VmiSpec, SourceKindIsQemuOrVmiAndNothingElse) {
  EXPECT_EQ(controller::source_kind(vmi_spec()).value(), controller::SourceKind::kVmi);
  json q{{"source", {{"qemu", {{"node", "a"}, {"qmpSocket", "/q"}}}}}};
  EXPECT_EQ(controller::source_kind(q).value(), controller::SourceKind::kQemu);
  json both{{"source", {{"qemu", json::object()}, {"vmi", json::object()}}}};
  EXPECT_EQ(controller::source_kind(both).error().message,
            "spec.source: must name exactly one kind of endpoint; supported: qemu, vmi");
  EXPECT_EQ(controller::source_kind(json{{"target", json::object()}}).error().message, "spec.source: required");
}

TEST(VmiSpec, ParsesNameNodeSelectorAndCancel) {
  json s = vmi_spec();
  s["target"] = {{"nodeSelector", {{"rdma", "true"}}}};
  s["cancel"] = true;
  auto r = controller::parse_vmi_spec(s);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->name, "web-1");
  EXPECT_EQ(r->node_selector.at("rdma"), "true");
  EXPECT_TRUE(r->cancel);
}

TEST(VmiSpec, ErrorsNameTheField) {
  auto msg = [](json s) { return controller::parse_vmi_spec(s).error().message; };
  json no_name{{"source", {{"vmi", json::object()}}}};
  EXPECT_EQ(msg(no_name), "spec.source.vmi.name: required");
  json qemu_target = vmi_spec();
  qemu_target["target"] = {{"qemu", {{"node", "b"}, {"qmpSocket", "/q"}}}};
  EXPECT_EQ(msg(qemu_target).rfind("spec.target.qemu: not allowed with spec.source.vmi", 0), 0u);
  json bad_sel = vmi_spec();
  bad_sel["target"] = {{"nodeSelector", {{"rdma", 1}}}};
  EXPECT_EQ(msg(bad_sel), "spec.target.nodeSelector.rdma: must be a string");
  json tunable = vmi_spec();
  tunable["chunkSize"] = "4Mi";
  EXPECT_EQ(msg(tunable).rfind("spec.chunkSize: only for spec.source.qemu", 0), 0u);
  json extra = vmi_spec();
  extra["source"]["vmi"]["namespace"] = "other";
  EXPECT_EQ(msg(extra).rfind("spec.source.vmi.namespace: unknown field", 0), 0u);
}

TEST(VmiChecks, RefusesNotRunningNotMigratableAndAlreadyMigrating) {
  std::string code;
  EXPECT_EQ(controller::vmi_refusal(running_vmi(), code), "");
  json stopped = running_vmi();
  stopped["status"]["phase"] = "Scheduling";
  EXPECT_EQ(controller::vmi_refusal(stopped, code), "VirtualMachineInstance prod/web-1 is Scheduling, not Running");
  EXPECT_EQ(code, "VMINotRunning");
  json pinned = running_vmi();
  pinned["status"]["conditions"][0] = {{"type", "LiveMigratable"}, {"status", "False"},
                                       {"reason", "DisksNotLiveMigratable"}, {"message", "PVC web-1 is not shared"}};
  EXPECT_EQ(controller::vmi_refusal(pinned, code),
            "VirtualMachineInstance prod/web-1 is not live-migratable: DisksNotLiveMigratable: PVC web-1 is not shared");
  EXPECT_EQ(code, "NotLiveMigratable");
  json busy = running_vmi();
  busy["status"]["migrationState"] = {{"migrationUid", "u1"}, {"sourceNode", "node-a"}};
  EXPECT_NE(controller::vmi_refusal(busy, code).find("already migrating (migration u1"), std::string::npos);
  EXPECT_EQ(code, "AlreadyMigrating");
  busy["status"]["migrationState"]["completed"] = true;
  EXPECT_EQ(controller::vmi_refusal(busy, code), "");
}

TEST(VmiChecks, TheVmimRdmigCreatesIsOwnedAndCarriesTheNodeSelector) {
  json cr{{"metadata", {{"name", "move-web-1"}, {"namespace", "prod"}, {"uid", "cr-uid"}}}};
  auto vmim = controller::vmim_for(cr, "web-1", {{"rdma", "true"}});
  EXPECT_EQ(vmim["metadata"]["name"], "rdmig-move-web-1");
  EXPECT_EQ(vmim["spec"]["vmiName"], "web-1");
  EXPECT_EQ(vmim["spec"]["addedNodeSelector"]["rdma"], "true");
  EXPECT_TRUE(controller::owned_by_rdma_migration(vmim, "cr-uid"));
  EXPECT_FALSE(controller::owned_by_rdma_migration(vmim, "other-uid"));
  EXPECT_FALSE(controller::vmim_for(cr, "web-1", {})["spec"].contains("addedNodeSelector"));
  json vmi = running_vmi();
  vmi["status"]["migrationState"] = {{"migrationUid", "m1"}};
  EXPECT_TRUE(controller::migration_state_for(vmi, "m1").is_object());
  EXPECT_TRUE(controller::migration_state_for(vmi, "m2").is_null());
}

TEST(VmiStatus, MapsVmimPhases) {
  for (const char* p : {"Pending", "Scheduling", "Scheduled", "PreparingTarget", "TargetReady"}) {
    EXPECT_EQ(controller::phase_for_vmim_phase(p), "PreparingTarget") << p;
  }
  EXPECT_EQ(controller::phase_for_vmim_phase("Running"), "Migrating");
  EXPECT_EQ(controller::phase_for_vmim_phase("Succeeded"), "Succeeded");
  EXPECT_EQ(controller::phase_for_vmim_phase("Failed"), "Failed");
  EXPECT_EQ(controller::phase_for_vmim_phase("WaitingForSync"), "");
}

TEST(VmiStatus, CopiesKubevirtStateAndRdmigRecord) {
  json status = json::object();
  json vmim{{"metadata", {{"name", "rdmig-x"}, {"uid", "u"}}},
            {"status",
             {{"phase", "Running"},
              {"phaseTransitionTimestamps",
               json::array({{{"phase", "Pending"}, {"phaseTransitionTimestamp", "2026-01-01T00:00:00Z"}}})}}}};
  json ms{{"sourceNode", "node-a"}, {"targetNode", "node-b"}, {"targetPod", "virt-launcher-web-1-x"},
          {"mode", "PreCopy"}, {"completed", false}};
  controller::copy_kubevirt_state(status, vmim, ms);
  EXPECT_EQ(status["sourceNode"], "node-a");
  EXPECT_EQ(status["targetNode"], "node-b");
  EXPECT_EQ(status["kubevirt"]["migrationPhase"], "Running");
  EXPECT_EQ(status["kubevirt"]["targetPod"], "virt-launcher-web-1-x");
  EXPECT_EQ(status["kubevirt"]["phaseTransitionTimestamps"].size(), 1u);
  json item{{"migrationUid", "u"}, {"carried", true}, {"transport", "rdma"}, {"transportReason", "auto-both-rdma"},
            {"connections", 9}, {"bytesSent", 537000000}, {"chunksSent", 600}, {"chunksReceived", 10},
            {"throughputBytesPerSecond", 2.1e9}, {"libvirt", {{"downtimeMs", 17}, {"totalTimeMs", 2400},
                                                              {"dataTotalBytes", 540000000}}},
            {"switchoverMs", nullptr}};
  controller::copy_kubevirt_record(status, item);
  EXPECT_EQ(status["transport"], "rdma");
  EXPECT_EQ(status["transportReason"], "auto-both-rdma");
  EXPECT_EQ(status["channels"], 9);
  EXPECT_EQ(status["progress"]["transferredBytes"], 537000000);
  EXPECT_EQ(status["progress"]["totalBytes"], 540000000);
  EXPECT_EQ(status["downtimeMs"], 17);
  EXPECT_EQ(status["totalTimeMs"], 2400);
  EXPECT_FALSE(status.contains("switchoverMs")) << "null figures are left out";
  EXPECT_FALSE(status.contains("rails")) << "no rails in the record: none in the status";
  // A target agent's record over two rails: its side and the source's address on each.
  json rails_status;
  controller::copy_kubevirt_record(
      rails_status,
      json{{"carried", true}, {"role", "target"},
           {"rails", {{{"rail", 1}, {"device", "rxeb2"}, {"address", "10.1.0.2"}, {"peerAddress", "10.1.0.1"},
                       {"channels", {1}}, {"bytesSent", 10}, {"bytesReceived", 4096}}}}});
  EXPECT_EQ(rails_status["rails"], (json{{{"rail", 1}, {"channels", {1}}, {"bytes", 4096}, {"targetDevice", "rxeb2"},
                                          {"targetAddress", "10.1.0.2"}, {"sourceAddress", "10.1.0.1"}}}));
  controller::update_display(status);
  EXPECT_EQ(status["display"]["downtime"], "17ms");
  EXPECT_EQ(status["display"]["bytes"], "537MB");
  EXPECT_EQ(status["display"]["throughput"], "2.1GB/s");
  EXPECT_EQ(status["display"]["progress"], "537MB sent");
  EXPECT_FALSE(status["display"].contains("switchover"));
  status["progress"]["percent"] = 57;
  status["switchoverMs"] = 40;
  controller::update_display(status);
  EXPECT_EQ(status["display"]["progress"], "57%");
  EXPECT_EQ(status["display"]["switchover"], "40ms");
}

TEST(ControllerConfigKubevirt, QemuKindIsOptInPerNamespace) {
  auto none = controller::parse_controller_config("");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->qemu.allowed("vms"));
  EXPECT_TRUE(none->kubevirt.enabled);
  auto some = controller::parse_controller_config("qemu: {allowedNamespaces: [vms]}\nkubevirt: {maxReportedVmis: 3}");
  ASSERT_TRUE(some.ok()) << some.error().message;
  EXPECT_TRUE(some->qemu.allowed("vms"));
  EXPECT_FALSE(some->qemu.allowed("prod"));
  EXPECT_EQ(some->kubevirt.max_reported_vmis, 3u);
  EXPECT_TRUE(controller::parse_controller_config("qemu: {allowedNamespaces: ['*']}")->qemu.allowed("any"));
  auto bad = controller::parse_controller_config("qemu: {allowedNamespaces: vms}");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("qemu.allowedNamespaces"), std::string::npos);
  auto typo = controller::parse_controller_config("kubevirt: {enable: true}");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.error().message.find("kubevirt.enable"), std::string::npos);
}

TEST(ControllerMetricsKubevirt, PerVmiSeriesAreBoundedAndRemovedWhenForgotten) {
  controller::ControllerMetrics m;
  m.set_max_vmis(2);
  controller::ControllerMetrics::VmiFigures f;
  f.active = true;
  m.set_vmi("prod", "a", f);
  m.set_vmi("prod", "b", f);
  m.set_vmi("prod", "c", f);  // drops a, the least recently updated
  std::string text = m.serialize();
  EXPECT_EQ(text.find("name=\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("rdmig_controller_vmi_migration_active{name=\"c\",namespace=\"prod\"} 1"), std::string::npos)
      << text;
  f.active = false;
  f.downtime_seconds = 0.017;
  f.carried = false;
  m.set_vmi("prod", "b", f);
  text = m.serialize();
  EXPECT_NE(text.find("rdmig_controller_vmi_migration_downtime_seconds{name=\"b\",namespace=\"prod\"} 0.017"),
            std::string::npos) << text;
  EXPECT_NE(text.find("rdmig_controller_vmi_migration_carried{name=\"b\",namespace=\"prod\"} 0"), std::string::npos);
  m.forget_vmi("prod", "b");
  text = m.serialize();
  EXPECT_EQ(text.find("name=\"b\""), std::string::npos) << text;
}

TEST(VmiStatus, NullsFromAgentsAndKubevirtReadAsAbsent) {
  json item{{"migrationUid", "u"}, {"transport", nullptr}, {"reason", nullptr}, {"libvirt", nullptr},
            {"nested", {{"a", nullptr}, {"b", 1}}}, {"list", json::array({{{"x", nullptr}}})}};
  json clean = controller::without_nulls(item);
  EXPECT_EQ(clean.value("transport", std::string("?")), "?");  // would throw with the null kept
  EXPECT_FALSE(clean.contains("libvirt"));
  EXPECT_EQ(clean["nested"], (json{{"b", 1}}));
  EXPECT_EQ(clean["list"][0], json::object());
  json vmi = running_vmi();
  vmi["status"]["migrationState"] = {{"migrationUid", "m1"}, {"failureReason", nullptr}};
  EXPECT_EQ(controller::migration_state_for(vmi, "m1").value("failureReason", std::string("none")), "none");
}
