"""rdmig-controller's KubeVirt path end to end: RdmaMigration objects naming a VMI, against the
API server double, the KubeVirt stand-in (kubevirt_standin.py) and, for the migrations that
really move a guest, two real rdmig agents carrying two real QEMU guests.

What is real and what stands in: the controller binary and its calls are real; KubeVirt is the
stand-in; the migration is two QEMU guests through two real agents' bare-QEMU REST API; rdmig's
figures per KubeVirt migration (GET /v1/kubevirt/migrations) come from FigureServer, which
answers the agents' contract from what the performer observed, so every outcome (not carried,
no record, KubeVirt failing) can be set up. The same controller path with the real KubeVirt-
shaped migration (real libvirt, agents carrying it, real agent records) is
tests/kubevirt/test_kubevirt_controller.py.
Run: python3 tests/k8s/test_kubevirt.py -v   (ctest -L k8s)
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
if not os.environ.get("RDMIG_AGENT"):
    os.environ["RDMIG_AGENT"] = os.path.join(REPO, "build-k8s", "agent", "rdmig-agent")
from rdmiglab import Agent, QemuVm, ensure_guest  # noqa: E402
from rdmiglab import timed  # noqa: E402
from apiserver_double import ApiServerDouble  # noqa: E402
from controllerlab import Controller, wait_for  # noqa: E402
from kubevirt_standin import VMIM, AgentPairPerformer, FakePerformer, FigureServer, KubevirtStandin  # noqa: E402
import rbac_check  # noqa: E402  (tests/k8s)

CRD = os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml")
NS, AGENT_NS = "prod", "rdmig-system"
TERMINAL = ("Succeeded", "Failed", "Cancelled")


def vmi_migration(name, vmi, **spec):
    body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
            "metadata": {"name": name, "namespace": NS}, "spec": {"source": {"vmi": {"name": vmi}}}}
    body["spec"].update(spec)
    return body


class KubevirtPathTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="k8s-kubevirt-")
        cls.api = ApiServerDouble(os.path.join(cls.tmp, "apiserver"), tls=True, crd_path=CRD)
        cls.store = cls.api.store
        kubeconfig = cls.api.write_kubeconfig(os.path.join(cls.tmp, "kubeconfig"))
        token = "agent-token-" + os.urandom(12).hex()
        cls.figures = FigureServer(token)
        for node in ("node-a", "node-b"):
            cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-" + node, node, cls.figures.start(node))
        cls.token = token
        cls.token_file = os.path.join(cls.tmp, "agent.token")
        with open(cls.token_file, "w") as f:
            f.write(token + "\n")
        cls.standin = KubevirtStandin(cls.store, FakePerformer(), cls.figures)
        cls.controller = Controller(cls.tmp, "ctl", kubeconfig, cls.token_file,
                                    config={"kubevirt": {"figuresWaitSeconds": 3}})
        wait_for(lambda: cls.controller.metric("rdmig_controller_leader") == 1, 30, "the controller to lead")
        cls.real = None

    @classmethod
    def tearDownClass(cls):
        cls.controller.stop()
        cls.standin.stop()
        cls.figures.stop()
        if cls.real:
            for x in cls.real:
                x.kill() if hasattr(x, "kill") else x.stop()
        cls.api.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def tearDown(self):
        result = getattr(self._outcome, "result", None)
        if result and any(t is self for t, _ in result.errors + result.failures):
            print("---- controller log (tail) ----\n" + self.controller.log_text()[-6000:])

    # -- helpers ---------------------------------------------------------------------------
    def create(self, body):
        code, obj = self.store.create("rdmamigrations", NS, body)
        self.assertEqual(code, 201, obj)
        return obj

    def get(self, name):
        code, obj = self.store.get("rdmamigrations", NS, name)
        return obj if code == 200 else None

    def wait_phase(self, name, phases, timeout=60.0):
        phases = (phases,) if isinstance(phases, str) else phases
        try:
            return wait_for(lambda: (lambda o: o if o and o.get("status", {}).get("phase") in phases else None)(
                self.get(name)), timeout, "%s to reach %s" % (name, phases))
        except TimeoutError:
            raise AssertionError("%s did not reach %s; now: %s" % (name, phases, self.get(name)))

    def events(self, kind, name):
        evs = [e for e in self.store.objects_of("events")
               if e["involvedObject"]["kind"] == kind and e["involvedObject"]["name"] == name]
        return [(e["type"], e["reason"], e["message"]) for e in sorted(evs, key=lambda e: int(e["metadata"]["resourceVersion"]))]

    def vmi_metric(self, metric, vmi):
        return self.controller.metrics().get((metric, frozenset({("namespace", NS), ("name", vmi)})))

    def vmims_for(self, vmi):
        return [o for o in self.store.objects_of(VMIM) if o["spec"]["vmiName"] == vmi]

    def columns(self, obj, wide=False):
        """kubectl get's columns, from the CRD's additionalPrinterColumns (jsonPath evaluated here)."""
        import yaml
        with open(CRD) as f:
            cols = yaml.safe_load(f)["spec"]["versions"][0]["additionalPrinterColumns"]
        out = {}
        for c in cols:
            if c.get("priority", 0) and not wide:
                continue
            v = obj
            for part in c["jsonPath"].strip(".").split("."):
                v = v.get(part) if isinstance(v, dict) else None
            out[c["name"]] = v
        return out

    def real_pair(self):
        """Two real agents and QEMU guests (booted once for the tests that move a guest)."""
        if not KubevirtPathTest.real:
            ensure_guest()
            a = Agent(self.tmp, "agent-a", token=self.token)
            b = Agent(self.tmp, "agent-b", token=self.token)
            KubevirtPathTest.real = [a, b]
        return {"node-a": KubevirtPathTest.real[0], "node-b": KubevirtPathTest.real[1]}

    def guests(self, tag, paused_target=False):
        src = QemuVm(self.tmp, tag + "-src", mem_mib=256, dirty_mib=8)  # see test_controller.py pair()
        dst = QemuVm(self.tmp, tag + "-dst", mem_mib=256, incoming_defer=True, paused=paused_target)
        KubevirtPathTest.real += [src, dst]
        src.wait_for_counter(2, timeout=90)
        return src, dst

    # -- the minimal CR, really migrated -----------------------------------------------------
    def test_minimal_cr_succeeds_with_nodes_downtime_switchover_transport_bytes_and_events(self):
        agents = self.real_pair()
        src, dst = self.guests("kv-ok")
        self.standin.performer = AgentPairPerformer(agents, src.agent_qmp_path, dst.agent_qmp_path, "node-b",
                                                    maxBandwidthBytesPerSecond=1 << 30)
        self.standin.add_vmi(NS, "web-1", "node-a")
        self.create(vmi_migration("move-web-1", "web-1"))
        seen = set()

        def done():
            o = self.get("move-web-1")
            seen.add(o.get("status", {}).get("phase"))
            return o if o.get("status", {}).get("phase") in TERMINAL else None
        obj = wait_for(done, 240, "move-web-1 to finish")
        st = obj["status"]
        self.assertEqual(st["phase"], "Succeeded", st)
        self.assertTrue({"PreparingTarget", "Migrating"} <= seen, seen)
        self.assertEqual((st["sourceNode"], st["targetNode"]), ("node-a", "node-b"))
        self.assertEqual(st["transport"], "tcp")
        self.assertEqual(st["transportReason"], "requested")  # the test agents' config says tcp: no fallback
        self.assertGreater(st["progress"]["transferredBytes"], 64 << 20)  # of a 256 MiB guest
        self.assertIsInstance(st["downtimeMs"], int)
        self.assertIsInstance(st["switchoverMs"], int)
        self.assertEqual(st["channels"], 1)
        self.assertEqual(st["progress"]["percent"], 100)
        kv = st["kubevirt"]
        vmim = self.vmims_for("web-1")[0]
        self.assertEqual(kv["migrationUid"], vmim["metadata"]["uid"])
        self.assertEqual(vmim["metadata"]["ownerReferences"][0]["uid"], obj["metadata"]["uid"])
        self.assertEqual([t["phase"] for t in kv["phaseTransitionTimestamps"]],
                         ["Pending", "Scheduling", "Scheduled", "PreparingTarget", "TargetReady", "Running", "Succeeded"])
        self.assertTrue(kv["targetPod"].startswith("virt-launcher-web-1-"))
        self.assertEqual((kv["mode"], kv["completed"], kv["failed"]), ("PreCopy", True, False))
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual((conds["CarriedByRdmig"]["status"], conds["CarriedByRdmig"]["reason"]), ("True", "Carried"))
        self.assertEqual(conds["Succeeded"]["status"], "True")
        # The guest runs on the target; the VMI says so.
        self.assertEqual(dst.status(), "running")
        self.assertEqual(self.standin.vmi(NS, "web-1")["status"]["nodeName"], "node-b")
        # kubectl get columns, and -o wide.
        cols = self.columns(obj)
        self.assertEqual((cols["Phase"], cols["Source"], cols["Target"], cols["Reason"], cols["Transport"]),
                         ("Succeeded", "node-a", "node-b", "Succeeded", "tcp"))
        self.assertEqual(cols["Progress"], "100%")
        self.assertEqual(cols["Downtime"], "%dms" % st["downtimeMs"])
        wide = self.columns(obj, wide=True)
        self.assertEqual(wide["Switchover"], "%dms" % st["switchoverMs"])
        self.assertRegex(wide["Throughput"], r"^[0-9.]+[kMG]B/s$")
        self.assertRegex(wide["Bytes"], r"^[0-9.]+MB$")
        self.assertEqual(wide["Transport Reason"], "requested")
        # Events in order, on the RdmaMigration; none on the VMI (its migration has a CR).
        wait_for(lambda: any(r == "Succeeded" for _, r, _ in self.events("RdmaMigration", "move-web-1")), 10, "event")
        self.assertEqual([r for _, r, _ in self.events("RdmaMigration", "move-web-1")],
                         ["Pending", "PreparingTarget", "Migrating", "Succeeded"])
        self.assertEqual(self.events("VirtualMachineInstance", "web-1"), [])
        # Metrics by VMI for it too.
        wait_for(lambda: self.vmi_metric("rdmig_controller_vmi_migration_carried", "web-1") == 1, 10, "vmi metrics")
        self.assertAlmostEqual(self.vmi_metric("rdmig_controller_vmi_migration_downtime_seconds", "web-1"),
                               st["downtimeMs"] / 1000.0)

    def test_cancel_mid_migration_deletes_the_vmim_and_the_vm_stays_on_the_source(self):
        agents = self.real_pair()
        src, dst = self.guests("kv-cancel", paused_target=True)
        perf = AgentPairPerformer(agents, src.agent_qmp_path, dst.agent_qmp_path, "node-b",
                                  maxBandwidthBytesPerSecond=8 << 20)
        self.standin.performer = perf
        self.standin.add_vmi(NS, "web-2", "node-a")
        self.create(vmi_migration("move-web-2", "web-2"))
        self.wait_phase("move-web-2", "Migrating")
        wait_for(lambda: self.get("move-web-2")["status"].get("progress", {}).get("transferredBytes", 0) > (4 << 20),
                 60, "bytes moving")
        before = src.last_counter()
        obj = self.get("move-web-2")
        obj["spec"]["cancel"] = True
        self.assertEqual(self.store.replace("rdmamigrations", NS, "move-web-2", obj)[0], 200)
        obj = self.wait_phase("move-web-2", TERMINAL)
        self.assertEqual(obj["status"]["phase"], "Cancelled", obj["status"])
        self.assertEqual(obj["status"]["reason"], "Cancelled")
        self.assertEqual(self.vmims_for("web-2"), [], "the VMIM is deleted (KubeVirt's abort)")
        self.assertTrue(any(m == "DELETE" and "/virtualmachineinstancemigrations/rdmig-move-web-2" in p
                            for m, p, _, _ in self.api.requests))
        vmi = self.standin.vmi(NS, "web-2")
        self.assertEqual(vmi["status"]["nodeName"], "node-a")
        self.assertEqual(vmi["status"]["migrationState"]["abortStatus"], "Succeeded")
        self.assertEqual(src.status(), "running")
        src.wait_for_counter(before + 1, timeout=60)
        self.assertFalse(dst.runs(), "the VM must not run in two places")

    # -- refusals before anything is created --------------------------------------------------
    def test_vmi_missing_not_running_not_migratable_or_migrating_fails_without_creating_anything(self):
        self.standin.add_vmi(NS, "stopped", "node-a", phase="Scheduling")
        self.standin.add_vmi(NS, "pinned", "node-a", migratable=False, reason="DisksNotLiveMigratable",
                             message="cannot migrate VMI: PVC data is not shared, live migration requires that all PVCs must be shared")
        self.standin.add_vmi(NS, "busy", "node-a", migration_state={"migrationUid": "other", "sourceNode": "node-a",
                                                                    "completed": False, "failed": False})
        expect = {"ghost": ("VMINotFound", "spec.source.vmi.name: VirtualMachineInstance prod/ghost not found"),
                  "stopped": ("VMINotRunning", "is Scheduling, not Running"),
                  "pinned": ("NotLiveMigratable", "not live-migratable: DisksNotLiveMigratable: cannot migrate VMI: PVC"),
                  "busy": ("AlreadyMigrating", "already migrating (migration other")}
        for vmi in expect:
            self.create(vmi_migration("move-" + vmi, vmi))
        for vmi, (reason, text) in expect.items():
            st = self.wait_phase("move-" + vmi, TERMINAL)["status"]
            self.assertEqual((st["phase"], st["reason"]), ("Failed", reason), st)
            self.assertIn(text, st["failureReason"])
            self.assertEqual(self.vmims_for(vmi), [], "nothing is created for " + vmi)
            self.assertNotIn("kubevirt", st)
            wait_for(lambda: ("Warning", reason) in [(t, r) for t, r, _ in self.events("RdmaMigration", "move-" + vmi)],
                     10, "the Warning event for " + vmi)

    def test_an_active_vmim_for_the_vmi_refuses_a_second_one(self):
        self.standin.performer = FakePerformer(seconds=30)
        self.standin.add_vmi(NS, "drained", "node-a")
        code, _ = self.store.create(VMIM, NS, {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
                                               "metadata": {"name": "drain-1"}, "spec": {"vmiName": "drained"}})
        self.assertEqual(code, 201)
        wait_for(lambda: (self.store.get(VMIM, NS, "drain-1")[1].get("status") or {}).get("phase") == "Running", 20,
                 "the drain's migration to run")
        self.create(vmi_migration("move-drained", "drained"))
        st = self.wait_phase("move-drained", TERMINAL)["status"]
        self.assertEqual(st["reason"], "AlreadyMigrating")
        self.assertEqual(len(self.vmims_for("drained")), 1)
        self.store.delete(VMIM, NS, "drain-1")

    # -- KubeVirt's own outcomes ----------------------------------------------------------------
    def test_kubevirt_failing_the_migration_fails_the_object_with_kubevirts_reason(self):
        self.standin.performer = FakePerformer(seconds=0.3, ok=False,
                                               reason="Live migration failed: target virt-launcher pod crashed")
        self.standin.add_vmi(NS, "web-3", "node-a")
        self.store.conflict_once.add(("rdmamigrations", NS, "move-web-3"))  # one status write meets a 409
        self.create(vmi_migration("move-web-3", "web-3"))
        st = self.wait_phase("move-web-3", TERMINAL)["status"]
        self.assertEqual((st["phase"], st["reason"]), ("Failed", "MigrationFailed"))
        self.assertEqual(st["failureReason"], "KubeVirt: Live migration failed: target virt-launcher pod crashed")
        self.assertEqual(st["kubevirt"]["failed"], True)
        self.assertEqual(self.standin.vmi(NS, "web-3")["status"]["nodeName"], "node-a")
        self.assertNotIn(("rdmamigrations", NS, "move-web-3"), self.store.conflict_once, "the 409 happened")
        self.assertTrue(any(mth == "GET" and p.endswith("/rdmamigrations/move-web-3") for mth, p, _, _ in self.api.requests),
                        "after a 409 the controller re-reads the object")

    def test_not_carried_by_rdmig_still_succeeds_and_the_condition_says_why(self):
        def post_copy(m):
            return {"migrationUid": m.uid, "vmi": {"namespace": m.namespace, "name": m.vmi, "uid": ""},
                    "role": "source", "sourceNode": m.source_node, "targetNode": m.target_node, "mode": "hook",
                    "carried": False, "phase": "NotCarried",
                    "reason": "post-copy is allowed for this migration: never carried"}
        self.standin.performer = FakePerformer(seconds=0.3, record=post_copy)
        self.standin.add_vmi(NS, "web-4", "node-a")
        self.create(vmi_migration("move-web-4", "web-4", target={"nodeSelector": {"rdma": "true"}}))
        st = self.wait_phase("move-web-4", TERMINAL)["status"]
        self.assertEqual((st["phase"], st["reason"]), ("Succeeded", "NotCarriedByRdmig"), st)
        c = {c["type"]: c for c in st["conditions"]}["CarriedByRdmig"]
        self.assertEqual((c["status"], c["reason"]), ("False", "NotCarried"))
        self.assertIn("post-copy is allowed for this migration: never carried", c["message"])
        self.assertNotIn("transport", st)
        self.assertEqual(self.vmims_for("web-4")[0]["spec"]["addedNodeSelector"], {"rdma": "true"})
        # No hook at all: the source's agent predates the endpoint (404), the target's has no record.
        self.figures.legacy.add("node-a")
        try:
            self.standin.performer = FakePerformer(seconds=0.3)
            self.standin.add_vmi(NS, "web-5", "node-a")
            self.create(vmi_migration("move-web-5", "web-5"))
            st = self.wait_phase("move-web-5", TERMINAL)["status"]
        finally:
            self.figures.legacy.discard("node-a")
        self.assertEqual((st["phase"], st["reason"]), ("Succeeded", "NotCarriedByRdmig"), st)
        c = {c["type"]: c for c in st["conditions"]}["CarriedByRdmig"]
        self.assertEqual((c["status"], c["reason"]), ("False", "PluginMissing"))
        self.assertIn("kubevirt.plugin.enabled=true", c["message"])
        # One missing piece: the Succeeded condition (and Event) name it by its reason, once.
        done = {c["type"]: c for c in st["conditions"]}["Succeeded"]["message"]
        self.assertIn("; not carried by rdmig: PluginMissing: no Plugin object registers", done)
        self.assertEqual(done.count("PluginMissing"), 1, done)
        asked = [n for n, p in self.figures.requests if st["kubevirt"]["migrationUid"] in p]
        self.assertEqual(sorted(set(asked)), ["node-a", "node-b"], "source first, then the target")

    def test_a_migration_not_carried_names_exactly_what_is_missing(self):
        """With no record on the agents, the condition says which piece is missing, read from the
        cluster: the agent's KubeVirt mode, the Plugin API, a Plugin, KubeVirt's Plugins gate."""
        plugin = {"apiVersion": "plugin.kubevirt.io/v1alpha1", "kind": "Plugin", "metadata": {"name": "rdmig"},
                  "spec": {"nodeHooks": [{"socket": "/var/run/rdmig/hooks/agent.sock",
                                          "permittedHooks": ["PreMigrationSource"], "failureStrategy": "Ignore"}]}}
        kv = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
              "spec": {"configuration": {"developerConfiguration": {"featureGates": ["LiveMigration"]}}}}

        def run(n):
            self.standin.performer = FakePerformer(seconds=0.2)
            self.standin.add_vmi(NS, "miss-%d" % n, "node-a")
            self.create(vmi_migration("move-miss-%d" % n, "miss-%d" % n))
            st = self.wait_phase("move-miss-%d" % n, TERMINAL)["status"]
            self.assertEqual((st["phase"], st["reason"]), ("Succeeded", "NotCarriedByRdmig"), st)
            c = {c["type"]: c for c in st["conditions"]}["CarriedByRdmig"]
            self.assertEqual(c["status"], "False")
            return c["reason"], c["message"]

        # 1. The source node's agent runs without KubeVirt mode. The controller reads the agent's
        # reason field (KubevirtModeOff), and still the words of an agent from before it (an upgrade
        # replaces the agents node by node).
        for n, style in ((1, "current"), (11, "text"), (12, "reason")):
            self.figures.mode_off["node-a"] = style
            try:
                reason, msg = run(n)
            finally:
                del self.figures.mode_off["node-a"]
            self.assertEqual(reason, "AgentNotInKubevirtMode", "%s: %s" % (style, msg))
            self.assertIn("kubevirt.enabled=true", msg)
        # 2. The cluster serves no Plugin API (an older KubeVirt).
        self.api.refuse_lists["plugins"] = (404, "NotFound", "the server could not find the requested resource")
        try:
            reason, msg = run(2)
        finally:
            del self.api.refuse_lists["plugins"]
        self.assertEqual(reason, "PluginApiMissing", msg)
        # 3. The Plugin exists but KubeVirt's Plugins gate is off: the message holds the command.
        self.assertEqual(self.store.create("plugins", None, plugin)[0], 201)
        self.assertEqual(self.store.create("kubevirts", "kubevirt", kv)[0], 201)
        try:
            reason, msg = run(3)
            self.assertEqual(reason, "PluginsGateOff", msg)
            self.assertIn("kubectl patch kubevirt kubevirt -n kubevirt --type json", msg)
            self.assertIn('"value":"Plugins"', msg)
            # 4. Everything is in place and still no record: say so, and where to look.
            code, stored = self.store.get("kubevirts", "kubevirt", "kubevirt")
            stored["spec"]["configuration"]["developerConfiguration"]["featureGates"].append("Plugins")
            self.assertEqual(self.store.replace("kubevirts", "kubevirt", "kubevirt", stored)[0], 200)
            reason, msg = run(4)
            self.assertEqual(reason, "NoAgentRecord", msg)
            self.assertIn("the Plugin exists and the Plugins gate is on", msg)
        finally:
            self.store.delete("plugins", None, "rdmig")
            self.store.delete("kubevirts", "kubevirt", "kubevirt")

    def test_with_the_defaults_every_missing_piece_is_named_at_once(self):
        """The chart's defaults: agents without KubeVirt mode, no Plugin, and a KubeVirt whose
        config has no featureGates list yet. One migration names all three, each with how to turn it
        on, in the condition, the status message and the Event; the reason is the first of them."""
        kv = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kv", "namespace": "virt"},
              "spec": {"configuration": {}}}
        self.assertEqual(self.store.create("kubevirts", "virt", kv)[0], 201)
        self.figures.mode_off["node-a"] = "current"
        try:
            self.standin.performer = FakePerformer(seconds=0.2)
            self.standin.add_vmi(NS, "defaults-1", "node-a")
            self.create(vmi_migration("move-defaults-1", "defaults-1"))
            st = self.wait_phase("move-defaults-1", TERMINAL)["status"]
        finally:
            del self.figures.mode_off["node-a"]
            self.store.delete("kubevirts", "virt", "kv")
        self.assertEqual((st["phase"], st["reason"]), ("Succeeded", "NotCarriedByRdmig"), st)
        conds = {c["type"]: c for c in st["conditions"]}
        c = conds["CarriedByRdmig"]
        self.assertEqual((c["status"], c["reason"]), ("False", "AgentNotInKubevirtMode"), c)
        # No featureGates list to append to: a merge patch makes it (a JSON patch "add .../-" fails there).
        gate = ("kubectl patch kubevirt kv -n virt --type merge -p "
                "'{\"spec\":{\"configuration\":{\"developerConfiguration\":{\"featureGates\":[\"Plugins\"]}}}}'")
        wait_for(lambda: any(r == "Succeeded" for _, r, _ in self.events("RdmaMigration", "move-defaults-1")), 10, "event")
        events = [m for t, r, m in self.events("RdmaMigration", "move-defaults-1") if r == "Succeeded"]
        self.assertEqual(len(events), 1, self.events("RdmaMigration", "move-defaults-1"))
        for where, text in (("condition", c["message"]), ("status", conds["Succeeded"]["message"]), ("Event", events[0])):
            for needle in ("AgentNotInKubevirtMode", "kubevirt.enabled=true", "PluginMissing", "kubevirt.plugin.enabled=true",
                           "PluginsGateOff", gate):
                self.assertIn(needle, text, where)
            self.assertEqual(text.count("AgentNotInKubevirtMode"), 1, where)
            self.assertLess(text.index("kubevirt.enabled=true"), text.index("kubevirt.plugin.enabled=true"), where)
            self.assertLess(text.index("kubevirt.plugin.enabled=true"), text.index("PluginsGateOff"), where)

    def test_a_tcp_fallback_is_in_status_and_one_warning_event(self):
        def fell_back(m):
            return {"migrationUid": m.uid, "vmi": {"namespace": m.namespace, "name": m.vmi, "uid": ""},
                    "role": "source", "sourceNode": m.source_node, "targetNode": m.target_node, "mode": "hook",
                    "carried": True, "reason": None, "phase": "Succeeded", "transport": "tcp",
                    "transportReason": "auto-no-peer-rdma", "connections": 9, "bytesSent": 537000000,
                    "libvirt": {"downtimeMs": 25, "totalTimeMs": 3100, "dataTotalBytes": 540000000}, "switchoverMs": None}
        self.standin.performer = FakePerformer(seconds=0.3, record=fell_back)
        self.standin.add_vmi(NS, "web-7", "node-a")
        self.create(vmi_migration("move-web-7", "web-7"))
        obj = self.wait_phase("move-web-7", TERMINAL)
        st = obj["status"]
        self.assertEqual((st["phase"], st["transport"], st["transportReason"]), ("Succeeded", "tcp", "auto-no-peer-rdma"))
        self.assertEqual(self.columns(obj, wide=True)["Transport Reason"], "auto-no-peer-rdma")
        wait_for(lambda: any(r == "TransportFallback" for _, r, _ in self.events("RdmaMigration", "move-web-7")), 10,
                 "the TransportFallback event")
        fallback = [e for e in self.events("RdmaMigration", "move-web-7") if e[1] == "TransportFallback"]
        self.assertEqual(len(fallback), 1, fallback)
        self.assertEqual(fallback[0][0], "Warning")
        self.assertIn("auto-no-peer-rdma: the target agent has no usable RDMA device", fallback[0][2])

    # -- migrations without an RdmaMigration ------------------------------------------------------
    def test_a_vmim_made_without_a_cr_is_reported_on_the_vmi_and_in_metrics(self):
        def carried(m):
            return {"migrationUid": m.uid, "vmi": {"namespace": m.namespace, "name": m.vmi, "uid": ""},
                    "role": "source", "sourceNode": m.source_node, "targetNode": m.target_node, "mode": "hook",
                    "carried": True, "reason": None, "phase": "Succeeded", "transport": "rdma",
                    "transportReason": "auto-both-rdma", "connections": 9, "bytesSent": 537000000,
                    "libvirt": {"downtimeMs": 31, "totalTimeMs": 2400, "dataTotalBytes": 540000000}, "switchoverMs": 44}
        self.standin.performer = FakePerformer(seconds=0.5, record=carried)
        self.standin.add_vmi(NS, "db-1", "node-a")
        code, _ = self.store.create(VMIM, NS, {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
                                               "metadata": {"name": "kubevirt-evacuation-x1"}, "spec": {"vmiName": "db-1"}})
        self.assertEqual(code, 201)
        wait_for(lambda: [r for _, r, _ in self.events("VirtualMachineInstance", "db-1")] ==
                 ["MigrationStarted", "MigrationSucceeded"], 30, "start and end Events on the VMI")
        (_, _, msg), = [e for e in self.events("VirtualMachineInstance", "db-1") if e[1] == "MigrationSucceeded"]
        self.assertIn("from node node-a to node node-b; downtime 31 ms; carried by rdmig over rdma", msg)
        m, vm = self.controller, self.vmi_metric
        self.assertEqual(vm("rdmig_controller_vmi_migration_active", "db-1"), 0)
        self.assertEqual(vm("rdmig_controller_vmi_migration_carried", "db-1"), 1)
        self.assertAlmostEqual(vm("rdmig_controller_vmi_migration_downtime_seconds", "db-1"), 0.031)
        self.assertEqual(vm("rdmig_controller_vmi_migration_transferred_bytes", "db-1"), 537000000)
        self.assertAlmostEqual(vm("rdmig_controller_vmi_migration_duration_seconds", "db-1"), 2.4)  # libvirt's total time
        self.assertGreaterEqual(m.metric("rdmig_controller_kubevirt_migrations_total", result="Succeeded", carried="true"), 1)
        self.assertEqual([o for o in self.store.objects_of("rdmamigrations") if o["spec"]["source"].get("vmi", {}).get("name") == "db-1"], [])
        # Forgotten (KubeVirt garbage-collected the VMIM): the VMI's series go.
        self.store.delete(VMIM, NS, "kubevirt-evacuation-x1")
        wait_for(lambda: vm("rdmig_controller_vmi_migration_active", "db-1") is None, 10, "series removed")
        self.assertIsNone(vm("rdmig_controller_vmi_migration_downtime_seconds", "db-1"))

    # -- the bare-QEMU kind is an opt-in --------------------------------------------------------
    def test_the_qemu_kind_is_refused_where_the_config_does_not_allow_it(self):
        self.create({"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
                     "metadata": {"name": "raw-qemu", "namespace": NS},
                     "spec": {"source": {"qemu": {"node": "node-a", "qmpSocket": "/run/a.qmp"}},
                              "target": {"qemu": {"node": "node-b", "qmpSocket": "/run/b.qmp"}}}})
        st = self.wait_phase("raw-qemu", TERMINAL)["status"]
        self.assertEqual((st["phase"], st["reason"]), ("Failed", "QemuKindNotAllowed"))
        self.assertIn("qemu.allowedNamespaces", st["failureReason"])

    # -- admission: what the CEL rules refuse ----------------------------------------------------
    def test_the_api_refuses_two_kinds_and_spec_changes_other_than_cancel(self):
        both = vmi_migration("both", "web-1")
        both["spec"]["source"]["qemu"] = {"node": "node-a", "qmpSocket": "/q"}
        code, body = self.store.create("rdmamigrations", NS, both)
        self.assertEqual(code, 422)
        self.assertIn("name exactly one kind", body["message"])
        self.standin.performer = FakePerformer(seconds=30)
        self.standin.add_vmi(NS, "web-6", "node-a")
        self.create(vmi_migration("move-web-6", "web-6"))
        obj = self.wait_phase("move-web-6", "Migrating")
        succeeded = {c["type"]: c for c in obj["status"]["conditions"]}["Succeeded"]
        self.assertEqual((succeeded["status"], succeeded["reason"]), ("Unknown", "Migrating"))
        obj["spec"]["source"]["vmi"]["name"] = "web-1"
        code, body = self.store.replace("rdmamigrations", NS, "move-web-6", obj)
        self.assertEqual(code, 422)
        self.assertIn("spec is immutable except spec.cancel", body["message"])
        # Deletion aborts through the VMIM and the finalizer goes after it.
        self.store.delete("rdmamigrations", NS, "move-web-6")
        wait_for(lambda: self.get("move-web-6") is None, 30, "move-web-6 to go")
        self.assertEqual(self.vmims_for("web-6"), [])
        self.assertEqual(self.standin.vmi(NS, "web-6")["status"]["nodeName"], "node-a")

    # -- RBAC: the chart grants exactly what the controller used ---------------------------------
    def test_zz_rbac_in_the_chart_covers_exactly_the_calls_the_controller_made(self):
        # A finished object with ttlSecondsAfterFinished 0: the controller deletes it (the one
        # call no other test here makes).
        gone = vmi_migration("gc-after-finish", "no-such-vmi")
        gone["spec"]["ttlSecondsAfterFinished"] = 0
        self.create(gone)
        wait_for(lambda: self.get("gc-after-finish") is None, 60,
                 "the controller to delete the finished object (ttlSecondsAfterFinished 0)")
        calls = rbac_check.calls_from_log(self.api.requests, "rdmig-controller/")
        granted = rbac_check.chart_rules()
        # RdmaPathCheck's grants (and nodes: list, for its targets.selector) are exercised by
        # tests/k8s/test_pathcheck.py (its own RBAC check), the token and access reviews of the
        # HTTPS /metrics by tests/k8s/test_controller_faults.py (MetricsAuthTest): this
        # controller serves its metrics locally.
        # RdmaDrainPlan's (its list of VMIs, its create of RdmaMigrations) by tests/k8s/test_drainplan.py.
        granted = rbac_check.without(granted, "virtualmachineinstances", "list")
        granted = rbac_check.without(granted, "rdmamigrations", "create")
        others = {res for _, r in granted for res in r["resources"]
                  if not res.startswith("rdmapathchecks") and not res.startswith("rdmadrainplans")
                  and res not in ("nodes", "tokenreviews", "subjectaccessreviews")}
        problems = rbac_check.compare(calls, granted, unused_of=others)
        self.assertEqual(problems, [], "\n".join(problems))


if __name__ == "__main__":
    timed.main()
