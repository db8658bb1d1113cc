"""Every metric the Grafana dashboard queries is exported by a live rdmig-agent or
rdmig-controller, and the chart's rendered agent.yaml and controller.yaml load in the real
programs.

Two real agents (one per "node", loading the agent.yaml that `helm template` puts into the agent
ConfigMap, with only the listen addresses, ports, token file and state dir changed for this
machine) and a real controller (loading the chart's controller.yaml, against the API server
double of tests/k8s) carry one RdmaMigration of a real QEMU guest end to end; then a migration
with a wrong data-plane token makes the agents count a transport error. After that both agents'
and the controller's /metrics are scraped, and each rdmig_* name in any dashboard query must
have at least one sample there (histograms as _bucket/_sum/_count). A panel that names a metric
nobody exports fails the test.

Run: python3 tests/deploy/test_dashboard_metrics.py -v   (ctest -L deploy; needs built binaries:
$RDMIG_AGENT and $RDMIG_CONTROLLER, else build-deploy/...)
"""
import json
import os
import re
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "k8s"))
sys.path.insert(0, os.path.join(REPO, "tools"))
for var, rel in (("RDMIG_AGENT", "build-deploy/agent/rdmig-agent"),
                 ("RDMIG_CONTROLLER", "build-deploy/controller/rdmig-controller")):
    os.environ.setdefault(var, os.path.join(REPO, rel))
from deploylib import dashboard_metric_names, embedded_config, one, render  # noqa: E402
from rdmiglab import Agent, QemuVm, ensure_guest, parse_prometheus, start_migration  # noqa: E402
from apiserver_double import ApiServerDouble  # noqa: E402
from controllerlab import Controller, wait_for  # noqa: E402

CRD = os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml")
AGENT_NS, VM_NS = "rdmig-system", "vms"


class DashboardMetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ensure_guest()
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-deploy-")
        docs = render()
        cls.agent_yaml = embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
        cls.controller_yaml = embedded_config(one(docs, "ConfigMap", "rdmig-controller-config"))["controller.yaml"]
        cls.vms, cls.agents, cls.controller, cls.api = [], [], None, None
        token = "deploy-token-" + os.urandom(12).hex()
        for name in ("node-a", "node-b"):
            cfg = json.loads(json.dumps(cls.agent_yaml))
            cfg["api"].update(address="127.0.0.1", port=0, probePort=0, tokenFile=os.path.join(cls.tmp, name + ".token"))
            cfg["dataPlane"].update(address="127.0.0.1", port=0, rdmaPort=0)
            del cfg["stateDir"]   # the chart's /var/run/rdmig: Agent picks a short one under /tmp
            cls.agents.append(Agent(cls.tmp, name, token=token, config=cfg))
        cls.api = ApiServerDouble(os.path.join(cls.tmp, "apiserver"), tls=True, crd_path=CRD)
        kubeconfig = cls.api.write_kubeconfig(os.path.join(cls.tmp, "kubeconfig"))
        for agent in cls.agents:
            cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-" + agent.name, agent.name, agent.api_port)
        cfg = json.loads(json.dumps(cls.controller_yaml))
        cfg["agents"]["tokenFile"] = cls.agents[0].token_file
        cfg["metrics"].update(address="127.0.0.1", port=0)
        cfg["qemu"] = {"allowedNamespaces": [VM_NS]}  # this check runs a bare-QEMU migration: opt in
        cls.controller = Controller(cls.tmp, "controller", kubeconfig, cls.agents[0].token_file, config=cfg)

    @classmethod
    def tearDownClass(cls):
        for vm in cls.vms:
            vm.kill()
        if cls.controller:
            cls.controller.stop()
        for a in cls.agents:
            a.stop()
        if cls.api:
            cls.api.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def vm(self, name, **kw):
        vm = QemuVm(self.tmp, name, mem_mib=256, dirty_mib=16, **kw)
        self.vms.append(vm)
        return vm

    def logs(self):
        return "\n".join("---- %s ----\n%s" % (p.name, p.log_text()[-3000:]) for p in self.agents + [self.controller])

    def test_every_dashboard_metric_is_exported_by_a_live_agent_or_controller(self):
        wait_for(lambda: self.controller.metric("rdmig_controller_leader") == 1, 40, "the controller to lead")
        src, dst = self.vm("src"), self.vm("dst", incoming_defer=True)
        src.wait_for_counter(2, timeout=90)
        body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
                "metadata": {"name": "dashboard-check", "namespace": VM_NS},
                "spec": {"source": {"qemu": {"node": "node-a", "qmpSocket": src.agent_qmp_path}},
                         "target": {"qemu": {"node": "node-b", "qmpSocket": dst.agent_qmp_path}},
                         "transport": "auto", "multifdChannels": 2, "maxBandwidth": "1Gi"}}
        code, obj = self.api.store.create("rdmamigrations", VM_NS, body)
        self.assertEqual(code, 201, obj)

        def finished():
            _, o = self.api.store.get("rdmamigrations", VM_NS, "dashboard-check")
            return o if o.get("status", {}).get("phase") in ("Succeeded", "Failed", "Cancelled") else None
        obj = wait_for(finished, 240, "the RdmaMigration to finish", interval=0.25)
        self.assertEqual(obj["status"]["phase"], "Succeeded", "%s\n%s" % (obj["status"], self.logs()))
        self.assertEqual(obj["status"]["transport"], "tcp", "no RDMA device here: auto falls back to TCP")

        # A wrong data-plane token: the agents count a transport error; neither VM is touched.
        spare = self.vm("spare", incoming_defer=True)
        target, source = start_migration(self.agents[0], self.agents[1], dst.agent_qmp_path, spare.agent_qmp_path,
                                         vm="bad-token", token="0" * 32)
        failed = self.agents[0].wait(source["id"], timeout=60)
        self.assertEqual(failed["phase"], "Failed")
        self.agents[1].cancel(target["id"])
        self.agents[1].wait(target["id"], timeout=30)

        exported = {}
        for who, text in [(a.name, a.metrics()) for a in self.agents] + \
                         [("controller", self.controller.http_get("/metrics")[1])]:
            samples, _ = parse_prometheus(text)
            for name, _labels in samples:
                exported.setdefault(name, set()).add(who)
        with open(os.path.join(REPO, "dashboards", "rdmig.json")) as f:
            names, exprs = dashboard_metric_names(json.load(f))
        self.assertGreater(len(names), 20, "the dashboard queries too few metrics to be the real one")
        missing = []
        for name in sorted(names):
            series = [n for n in (name, name + "_bucket", name + "_count") if n in exported]
            if not series:
                missing.append(name)
            else:
                print("  %-48s exported by %s" % (name, ", ".join(sorted(exported[series[0]]))))
        self.assertEqual(missing, [], "dashboard queries metrics that no live agent or controller exports: %s"
                         % ", ".join(missing))
        base = lambda n: re.sub(r"_(bucket|sum|count)$", "", n)  # noqa: E731
        unused = sorted({base(n) for n in exported if n.startswith("rdmig_")} - {base(m) for m in names})
        print("  exported but on no panel: %s" % (", ".join(unused) or "none"))


if __name__ == "__main__":
    unittest.main()
