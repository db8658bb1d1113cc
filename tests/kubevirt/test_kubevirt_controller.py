#!/usr/bin/env python3
"""The whole KubeVirt path with every piece that can run here real: an RdmaMigration naming a
VMI, the real rdmig-controller against the API server double, the KubeVirt stand-in
(tests/k8s/kubevirt_standin.py) moving the VMIM through KubeVirt's phases, and the migration
itself done the KubeVirt way by the KubeVirt-shaped harness (real libvirt 9.0 peer to peer, a real
QEMU guest, the virt-handler proxy stand-in with mTLS) and carried by two real rdmig agents in
KubeVirt mode (node hook, nftables redirect). The controller reads rdmig's figures from the
real agents' GET /v1/kubevirt/migrations.
"""
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "k8s"))
sys.path.insert(0, os.path.join(REPO, "tools"))

import test_kubevirt_baseline as base  # noqa: E402
from rdmiglab import timed  # noqa: E402

NODES = ("node-a", "node-b")
NS, AGENT_NS = "prod", "rdmig-system"


class HarnessPerformer:
    """Performs the stand-in's VMIM with the KubeVirt-shaped harness, carried by the agents."""

    def __init__(self, cluster, agents):
        self.cluster, self.agents, self.results = cluster, agents, []

    def target_node(self, source_node, vmim):
        return NODES[1 - NODES.index(source_node)]

    def perform(self, m, figures):
        r = self.cluster.migrate(parallel=8, tls=True, hook_socket=self.agents[m.source_node].hook_socket,
                                 hook_timeout=5, migration_uid=m.uid, expect_success=False)
        self.results.append(r)
        return r.success, None if r.success else r.error


class KubevirtControllerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = base.missing_prereq()
        if reason:
            raise unittest.SkipTest(reason)
        from apiserver_double import ApiServerDouble
        from controllerlab import Controller, wait_for
        from kubevirt_standin import KubevirtStandin
        from rdmiglab.kubevirt import KubevirtCluster
        from rdmiglab.kvagents import KubevirtAgents
        cls.wait_for = staticmethod(wait_for)
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-kvctl-")
        cls.cluster, cls.kv, cls.agents, cls.controller, cls.standin, cls.api = None, None, {}, None, None, None
        try:
            cls.api = ApiServerDouble(os.path.join(cls.tmp, "apiserver"), tls=True,
                                      crd_path=os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml"))
            cls.kv = KubevirtAgents(cls.tmp, NODES)
            cls.agents = cls.kv.agents
            token = cls.kv.token
            for n in NODES:
                cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-" + n, n, cls.agents[n].api_port)
            cls.cluster = KubevirtCluster().__enter__()
            cls.cluster.define_and_start_vmi("web-1", NS, mem_mib=base.MEM_MIB, dirty_mib=base.DIRTY_MIB)
            cls.performer = HarnessPerformer(cls.cluster, cls.agents)
            cls.standin = KubevirtStandin(cls.api.store, cls.performer, None)
            cls.standin.add_vmi(NS, "web-1", "node-a")
            token_file = os.path.join(cls.tmp, "agent.token")
            with open(token_file, "w") as f:
                f.write(token + "\n")
            cls.controller = Controller(cls.tmp, "ctl", cls.api.write_kubeconfig(os.path.join(cls.tmp, "kc")),
                                        token_file, config={"kubevirt": {"figuresWaitSeconds": 15}})
            wait_for(lambda: cls.controller.metric("rdmig_controller_leader") == 1, 30, "the controller to lead")
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for x in (cls.controller, cls.standin):
            if x is not None:
                x.stop()
        if cls.kv is not None:
            cls.kv.close()
        if cls.cluster is not None:
            cls.cluster.close()
        if cls.api is not None:
            cls.api.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def tearDown(self):
        result = getattr(self._outcome, "result", None)
        if result and any(t is self for t, _ in result.errors + result.failures):
            print("---- controller log ----\n" + self.controller.log_text()[-5000:], file=sys.stderr)
            for n, a in self.agents.items():
                print("---- agent %s log ----\n%s" % (n, a.log_text()[-3000:]), file=sys.stderr)

    def test_minimal_cr_is_carried_by_rdmig_and_shows_libvirts_downtime(self):
        code, obj = self.api.store.create("rdmamigrations", NS, {
            "apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
            "metadata": {"name": "move-web-1", "namespace": NS}, "spec": {"source": {"vmi": {"name": "web-1"}}}})
        self.assertEqual(code, 201, obj)

        def done():
            c, o = self.api.store.get("rdmamigrations", NS, "move-web-1")
            return o if c == 200 and o.get("status", {}).get("phase") in ("Succeeded", "Failed", "Cancelled") else None
        st = self.wait_for(done, 240, "move-web-1 to finish")["status"]
        r = self.performer.results[-1]
        print("\n[controller+kubevirt+rdmig] status: %s" % {k: st.get(k) for k in (
            "phase", "sourceNode", "targetNode", "transport", "transportReason", "downtimeMs", "display")},
            file=sys.stderr)
        self.assertEqual(st["phase"], "Succeeded", st)
        self.assertTrue(r.success, r.error)
        self.assertEqual((st["sourceNode"], st["targetNode"]), ("node-a", "node-b"))
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual((conds["CarriedByRdmig"]["status"], conds["CarriedByRdmig"]["reason"]), ("True", "Carried"),
                         conds["CarriedByRdmig"])
        self.assertEqual(st["transport"], "tcp")
        # libvirt's downtime, read by the target agent, handed to the source agent, mirrored here.
        self.assertEqual(st["downtimeMs"], r.downtime_ms)
        self.assertGreater(st["progress"]["transferredBytes"], 50 << 20)
        self.assertEqual(st["kubevirt"]["migrationUid"], r.migration_uid)
        self.assertEqual(self.cluster.vmi.node, "node-b")


if __name__ == "__main__":
    base._reexec_with_system_python()
    timed.main()
