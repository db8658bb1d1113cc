"""RdmaDrainPlan end to end (docs/drain.md), forecast only: the API server double (the CRD's
schema and CEL rules enforced, status subresource), rdmig-controller, KubeVirt VMIs as objects
(their memory in the spec, their dirty rate in annotations), path checks read from the store or
run by the controller with two real rdmig-agents over TCP. No guest boots.

Run from the repository root after building:
    RDMIG_AGENT=build/agent/rdmig-agent RDMIG_CONTROLLER=build/controller/rdmig-controller \\
        python3 tests/k8s/test_drainplan.py -v
"""
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
from rdmiglab import Agent  # noqa: E402
from apiserver_double import ApiServerDouble  # noqa: E402
from controllerlab import Controller, wait_for  # noqa: E402

CRD = os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml")
NS = "ops"
VM_NS = "vms"
AGENT_NS = "rdmig-system"
MiB = 1 << 20
GiB = 1 << 30


def plan(name, node, **spec):
    body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaDrainPlan",
            "metadata": {"name": name, "namespace": NS}, "spec": {"node": node}}
    body["spec"].update(spec)
    return body


class DrainPlanControllerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-k8s-dp-")
        cls.api = ApiServerDouble(os.path.join(cls.tmp, "apiserver"), tls=True, crd_path=CRD)
        cls.store = cls.api.store
        kubeconfig = cls.api.write_kubeconfig(os.path.join(cls.tmp, "kubeconfig"))
        token = "agent-token-" + os.urandom(12).hex()
        cls.agents = {n: Agent(cls.tmp, "agent-" + n, token=token, log_level="debug") for n in ("a", "b", "c")}
        for n, agent in cls.agents.items():
            cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-" + n, "node-" + n, agent.api_port)
        cls.controller = Controller(cls.tmp, "ctl", kubeconfig, cls.agents["a"].token_file)
        wait_for(lambda: cls.controller.metric("rdmig_controller_leader") == 1, 30, "the controller to lead")

    @classmethod
    def tearDownClass(cls):
        cls.controller.stop()
        for a in cls.agents.values():
            a.stop()
        cls.api.stop()
        if os.environ.get("RDMIG_KEEP_TMP"):
            print("kept", cls.tmp)
        else:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def tearDown(self):
        result = getattr(self._outcome, "result", None)
        if result and any(t is self for t, _ in result.errors + result.failures):
            print("---- controller log (tail) ----\n" + self.controller.log_text()[-6000:])

    # -- helpers ---------------------------------------------------------------------------
    def add_vmi(self, name, node, memory=None, dirty=None, labels=None):
        domain = {"devices": {}}
        if memory:
            domain["memory"] = {"guest": memory}
        md = {"name": name, "namespace": VM_NS, "labels": dict(labels or {}, **{"kubevirt.io/nodeName": node})}
        if dirty is not None:
            md["annotations"] = {"rdmig.io/dirty-rate-bytes-per-second": str(dirty),
                                 "rdmig.io/dirty-rate-time": "2026-12-05T09:00:00Z"}
        code, obj = self.store.create("virtualmachineinstances", VM_NS, {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": md,
            "spec": {"domain": domain}})
        self.assertEqual(code, 201, obj)
        obj["status"] = {"phase": "Running", "nodeName": node}
        code, obj = self.store.replace("virtualmachineinstances", VM_NS, name, obj, subresource="status")
        self.assertEqual(code, 200, obj)

    def add_checked_path(self, name, source, target, throughput, when="2026-12-05T08:00:00Z"):
        code, obj = self.store.create("rdmapathchecks", NS, {
            "apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaPathCheck", "metadata": {"name": name, "namespace": NS},
            "spec": {"source": source, "targets": {"nodes": [target]}}})
        self.assertEqual(code, 201, obj)
        obj["status"] = {"phase": "Succeeded", "completionTime": when, "pairs": [
            {"source": source, "target": target, "phase": "Passed", "transport": "rdma",
             "throughputBytesPerSecond": throughput, "rttMicroseconds": 0, "bytes": GiB, "bytesVerified": GiB}]}
        code, obj = self.store.replace("rdmapathchecks", NS, name, obj, subresource="status")
        self.assertEqual(code, 200, obj)

    def create(self, body):
        code, obj = self.store.create("rdmadrainplans", NS, body)
        self.assertEqual(code, 201, obj)
        return obj

    def get(self, name, plural="rdmadrainplans"):
        code, obj = self.store.get(plural, NS, name)
        return obj if code == 200 else None

    def wait_phase(self, name, phases, timeout=60.0):
        def reached():
            obj = self.get(name)
            return obj if obj and obj.get("status", {}).get("phase") in phases else None
        try:
            return wait_for(reached, timeout, "%s to reach %s" % (name, phases))
        except TimeoutError:
            raise AssertionError("%s did not reach %s; now: %s" % (name, phases, self.get(name)))

    def reasons(self, name):
        return [(e["type"], e["reason"]) for e in self.api.events(name)]

    # -- cases -----------------------------------------------------------------------------
    def test_forecast_from_the_latest_path_check_with_hand_computed_figures(self):
        # node-c -> node-a measured at 1 GiB/s (an older check said 4 GiB/s).
        self.add_checked_path("c-old", "node-c", "node-a", 4.0 * GiB, when="2026-12-04T08:00:00Z")
        self.add_checked_path("c-new", "node-c", "node-a", 1.0 * GiB)
        self.add_vmi("steady", "node-c", memory="1Gi", dirty=256 * MiB)   # one pass: 1.27 s, downtime 0.27 s
        self.add_vmi("idle", "node-c", memory="512Mi", dirty=0)           # 0.5 + 0.02 s
        self.add_vmi("hot", "node-c", memory="1Gi", dirty=2 * GiB)        # never converges
        self.add_vmi("nomem", "node-c", dirty=0)                          # no memory in its spec
        self.add_vmi("unmeasured", "node-c", memory="256Mi")              # no dirty rate: 0.25 + 0.02 s
        self.add_vmi("elsewhere", "node-b", memory="1Gi", dirty=0)        # another node
        self.create(plan("drain-c", "node-c", maxConcurrentPerPair=1, maxDowntime="300ms"))
        obj = self.wait_phase("drain-c", ("Forecast", "Failed"))
        st = obj["status"]
        print("\nstatus:", st)
        self.assertEqual(st["phase"], "Forecast", st)
        self.assertEqual(st["path"]["pathCheck"], NS + "/c-new")
        self.assertEqual(st["path"]["throughputBytesPerSecond"], 1.0 * GiB)
        s = st["summary"]
        self.assertEqual((s["vms"], s["withinLimits"], s["notConverging"], s["noInput"], s["unmeasuredDirtyRate"]),
                         (5, 3, 1, 1, 1))
        self.assertAlmostEqual(s["predictedDrainSeconds"], 1.27 + 0.52 + 0.27, places=3)
        self.assertAlmostEqual(s["lowerBoundSeconds"], 1.75, places=3)  # 1.75 GiB planned over 1 GiB/s
        vms = {v["name"]: v for v in st["vms"]}
        self.assertNotIn("elsewhere", vms)
        self.assertEqual([v["name"] for v in st["vms"]][:2], ["hot", "nomem"])  # attention first
        steady = vms["steady"]
        self.assertEqual((steady["passes"], steady["totalSeconds"], steady["downtimeSeconds"]), (1, 1.27, 0.27))
        self.assertEqual(steady["order"], 0)  # longest first
        self.assertEqual(steady["dirtyRateSource"], "annotation")
        self.assertEqual(steady["dirtyRateTime"], "2026-12-05T09:00:00Z")
        self.assertTrue(steady["convergesWithinLimits"])
        hot = vms["hot"]
        self.assertFalse(hot["convergesWithinLimits"])
        self.assertIn("is not below the throughput", hot["reason"])
        self.assertEqual(hot["remedies"]["postCopy"], {"totalSeconds": 2.02, "downtimeSeconds": 0.02})
        self.assertEqual(hot["remedies"]["largerDowntime"]["maxDowntimeSeconds"], 1.02)
        self.assertIn("memory", vms["nomem"]["reason"])
        self.assertEqual(vms["unmeasured"]["dirtyRateSource"], "none")
        self.assertIn("no measured dirty rate", vms["unmeasured"]["reason"])
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual(conds["Forecast"]["status"], "True")
        self.assertEqual(conds["WithinLimits"]["status"], "False")
        self.assertEqual(conds["WithinLimits"]["reason"], "NotConverging")
        self.assertEqual(st["observedGeneration"], obj["metadata"]["generation"])
        wait_for(lambda: ("Warning", "Forecast") in self.reasons("drain-c"), 10, "the Forecast event")

    def test_a_path_never_checked_is_checked_first_by_the_agents(self):
        self.add_vmi("on-b", "node-b", memory="256Mi", dirty=MiB)
        self.create(plan("drain-b", "node-b", targets=["node-a"], pathCheckBytes="16Mi"))
        waiting = self.wait_phase("drain-b", ("WaitingForPathCheck", "Forecast", "Failed"))
        check = self.get("drain-b-paths", "rdmapathchecks")
        self.assertIsNotNone(check, waiting)
        self.assertEqual(check["spec"]["source"], "node-b")
        self.assertEqual(check["spec"]["targets"], {"nodes": ["node-a"]})
        self.assertEqual(check["metadata"]["ownerReferences"][0]["kind"], "RdmaDrainPlan")
        obj = self.wait_phase("drain-b", ("Forecast", "Failed"), timeout=90)
        st = obj["status"]
        self.assertEqual(st["phase"], "Forecast", st)
        self.assertEqual(st["path"]["pathCheck"], NS + "/drain-b-paths")
        self.assertEqual(st["path"]["target"], "node-a")
        self.assertGreater(st["path"]["throughputBytesPerSecond"], 0)  # what the real agents carried
        self.assertEqual(st["summary"]["withinLimits"], 1)
        self.assertIn(("Normal", "PathCheckCreated"), self.reasons("drain-b"))

    def test_a_node_without_an_agent_cannot_be_forecast(self):
        obj = self.wait_phase(self.create(plan("drain-x", "node-x"))["metadata"]["name"], ("Forecast", "Failed"))
        cond = {c["type"]: c for c in obj["status"]["conditions"]}["Forecast"]
        self.assertEqual((obj["status"]["phase"], cond["reason"]), ("Failed", "NoAgent"), obj["status"])
        self.assertIn("node-x", cond["message"])

    def test_execute_is_refused_and_the_spec_is_immutable(self):
        code, body = self.store.create("rdmadrainplans", NS, plan("exec", "node-a", execute=True))
        self.assertEqual(code, 422, body)
        self.assertIn("spec.execute", body["message"])
        obj = self.create(plan("frozen", "node-a", maxDowntime="1s"))
        obj["spec"]["maxDowntime"] = "2s"
        code, body = self.store.replace("rdmadrainplans", NS, "frozen", obj)
        self.assertEqual(code, 422, body)
        self.assertIn("immutable", body["message"])
        code, body = self.store.create("rdmadrainplans", NS, plan("bad-downtime", "node-a", maxDowntime="soon"))
        self.assertEqual(code, 422, body)

    def test_max_bandwidth_caps_each_migration_and_the_selector_narrows_the_vms(self):
        self.add_checked_path("cap-path", "node-a", "node-b", 1.0 * GiB, when="2026-12-05T10:00:00Z")
        self.add_vmi("capped", "node-a", memory="512Mi", dirty=0, labels={"app": "capped"})
        self.add_vmi("other", "node-a", memory="512Mi", dirty=0, labels={"app": "other"})
        self.create(plan("capped", "node-a", selector={"app": "capped"}, maxBandwidth="256Mi"))
        st = self.wait_phase("capped", ("Forecast", "Failed"))["status"]
        self.assertEqual(st["phase"], "Forecast", st)
        self.assertEqual([v["name"] for v in st["vms"]], ["capped"])
        vm = st["vms"][0]
        self.assertEqual(vm["throughputBytesPerSecond"], 256 * MiB)  # not the path's 1 GiB/s
        self.assertEqual(vm["totalSeconds"], 2.02)                    # 512 MiB at 256 MiB/s + 0.02

    def test_the_sample_is_valid_and_forecasts(self):
        import yaml
        with open(os.path.join(REPO, "operator-manifests", "samples", "drainplan-forecast.yaml")) as f:
            body = yaml.safe_load(f)
        body["metadata"]["namespace"] = NS
        body["spec"]["node"] = "node-c"  # its path was checked above or is checked now
        self.add_checked_path("sample-path", "node-c", "node-b", 2.0 * GiB, when="2026-12-05T09:00:00Z")
        self.add_vmi("sample-vm", "node-c", memory="2Gi", labels={"app": "sample"})
        self.create(body)
        st = self.wait_phase(body["metadata"]["name"], ("Forecast", "Failed"))["status"]
        self.assertEqual(st["phase"], "Forecast", st)
        vm = {v["name"]: v for v in st["vms"]}["sample-vm"]
        self.assertEqual((vm["dirtyRateSource"], vm["dirtyRateBytesPerSecond"]), ("assumed", 64 * MiB))

    def test_zz_rbac_in_the_chart_covers_the_calls_and_every_drainplan_grant_is_used(self):
        import rbac_check
        self.store.conflict_once.add(("rdmadrainplans", NS, "conflicted"))
        self.add_checked_path("a-path", "node-a", "node-b", 1.0 * GiB)
        self.create(plan("conflicted", "node-a"))
        self.wait_phase("conflicted", ("Forecast", "Failed"))
        calls = rbac_check.calls_from_log(self.api.requests, "rdmig-controller/")
        problems = rbac_check.compare(calls, rbac_check.chart_rules(),
                                      unused_of={"rdmadrainplans", "rdmadrainplans/status"})
        # create on rdmapathchecks and list on VMIs: the two grants this kind added elsewhere.
        self.assertIn(("rdmig.io", "rdmapathchecks", "create", NS, ""), calls)
        self.assertIn(("kubevirt.io", "virtualmachineinstances", "list", "", ""), calls)
        self.assertEqual(problems, [], "\n".join(problems))


if __name__ == "__main__":
    unittest.main()
