"""Live rdmig for the dashboard checks: two real agents and a real controller loading the configs
the chart renders, carrying a real QEMU migration (tests/deploy/test_dashboard_metrics.py and
test_dashboard_prometheus.py).

The agents ("node-a", "node-b") load the agent.yaml that `helm template` puts into the agent
ConfigMap, with only the listen addresses, ports, token file and state dir changed for this
machine; the controller loads the chart's controller.yaml against the API server double of
tests/k8s. With the chart's HTTPS on (agent.tls), the certificate, key and CA of the rendered
Secret are written here and the configs point at them instead of /etc/rdmig/tls (`self.tls`: the
CA and name a scraper checks, None for plain HTTP). `migrate()` runs one RdmaMigration of a real QEMU guest end to end (node-a to node-b),
then a migration with a wrong data-plane token, so that the agents count a failure and a
transport error; neither VM is touched by the second; then one RdmaPathCheck from node-a to node-b
over TCP (`pathcheck()`, no guest), so that the controller has its per-node-pair path check series,
and an executing RdmaDrainPlan of node-a over that path (no VMI is on node-a: it completes with
none), so that the controller has its per-plan series.

`KubevirtLab(stack)` adds KubeVirt mode beside it (tests/kubevirt's lab, tools/rdmiglab/kubevirt.py):
two more agents in KubeVirt mode ("kv-a", "kv-b", the node hook on a unix socket, the stack's token
and certificate, registered as agent pods with the API server double), two launcher pods with real
libvirt and QEMU ($RDMIG_KV_LAUNCHER, default KubeVirt 1.9's non-root trixie launcher), one small
VMI, and the KubeVirt stand-in of tests/k8s moving VirtualMachineInstanceMigrations. `migrate()`
runs one RdmaMigration naming the VMI (the controller creates the VMIM, the stand-in has the
harness migrate it with the source proxy calling the node hook: carried by rdmig), then one drain
with post-copy allowed straight through the harness (the hook declines: not carried, post_copy).
"""
import base64
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "k8s"))
sys.path.insert(0, os.path.join(REPO, "tools"))
for _var, _rel in (("RDMIG_AGENT", "build-deploy/agent/rdmig-agent"),
                   ("RDMIG_CONTROLLER", "build-deploy/controller/rdmig-controller")):
    os.environ.setdefault(_var, os.path.join(REPO, _rel))
from deploylib import embedded_config, one, render  # noqa: E402
from rdmiglab import Agent, QemuVm, ensure_guest, start_migration  # noqa: E402
from apiserver_double import ApiServerDouble  # noqa: E402
from controllerlab import Controller, wait_for  # noqa: E402

CRD = os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml")
AGENT_NS, VM_NS = "rdmig-system", "vms"
MIGRATION_NAME = "dashboard-check"
PATHCHECK_NAME = "dashboard-pathcheck"
DRAINPLAN_NAME = "dashboard-drain"
VM = VM_NS + "/" + MIGRATION_NAME  # the controller names a bare-QEMU migration's VM namespace/name
BAD_TOKEN_VM = "bad-token"
KV_NODES = ("kv-a", "kv-b")
KV_NS, KV_VMI = "kv-prod", "dash-vmi"
KV_MIGRATION_NAME = "dashboard-kv-check"


class LiveStack:
    """Agents, API server double and controller in a temporary directory; stop() ends them all."""

    def __init__(self, docs=None):
        ensure_guest()
        self.tmp = tempfile.mkdtemp(prefix="rdmig-deploy-")
        self.vms, self.agents, self.controller, self.api = [], [], None, None
        try:
            self._start(docs if docs is not None else render())
        except BaseException:
            self.stop()
            raise

    def _start(self, docs):
        agent_yaml = embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
        controller_yaml = embedded_config(one(docs, "ConfigMap", "rdmig-controller-config"))["controller.yaml"]
        token = "deploy-token-" + os.urandom(12).hex()
        self.tls = None
        agent_tls = None
        if "tls" in agent_yaml["api"]:
            # The chart's own certificate (agent.tls.mode generate): the agents serve it, the
            # controller checks it against the rendered ca.crt and serverName.
            secret = one(docs, "Secret", "rdmig-agent-tls")
            tls_dir = os.path.join(self.tmp, "tls")
            os.makedirs(tls_dir)
            for key, value in secret["data"].items():
                with open(os.path.join(tls_dir, key), "wb") as f:
                    f.write(base64.b64decode(value))
            self.tls = {"ca": os.path.join(tls_dir, "ca.crt"),
                        "server_name": controller_yaml["agents"]["tls"]["serverName"]}
            agent_tls = dict(self.tls, cert=os.path.join(tls_dir, "tls.crt"), key=os.path.join(tls_dir, "tls.key"))
        self.agent_tls = agent_tls
        for name in ("node-a", "node-b"):
            cfg = json.loads(json.dumps(agent_yaml))
            cfg["api"].update(address="127.0.0.1", port=0, probePort=0,
                              tokenFile=os.path.join(self.tmp, name + ".token"))
            # Two agents on one host: a lab (the chart's false would refuse 127.0.0.1 as a target).
            cfg["dataPlane"].update(address="127.0.0.1", port=0, rdmaPort=0, allowLoopbackPeers=True)
            del cfg["stateDir"]   # the chart's /var/run/rdmig: Agent picks a short one under /tmp
            cfg["migration"].pop("qmpSocketRoots", None)  # the chart's hostPaths: the harness's QEMUs are under /tmp
            cfg["api"].pop("tls", None)  # set by Agent from agent_tls, with this machine's paths
            self.agents.append(Agent(self.tmp, name, token=token, config=cfg, tls=agent_tls))
        self.api = ApiServerDouble(os.path.join(self.tmp, "apiserver"), tls=True, crd_path=CRD)
        kubeconfig = self.api.write_kubeconfig(os.path.join(self.tmp, "kubeconfig"))
        # The agent pods carry the labels the chart's DaemonSet gives them (the controller's
        # rendered selector names the release's instance label too).
        pod_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
        self.pod_labels = dict(pod_labels)
        for agent in self.agents:
            self.api.add_agent_pod(AGENT_NS, "rdmig-agent-" + agent.name, agent.name, agent.api_port,
                                   labels=dict(pod_labels))
        cfg = json.loads(json.dumps(controller_yaml))
        cfg["agents"]["tokenFile"] = self.agents[0].token_file
        if self.tls:
            cfg["agents"]["tls"]["caFile"] = self.tls["ca"]
        # /metrics as rendered (the chart's default: HTTPS, each scrape's token checked with a
        # TokenReview and a SubjectAccessReview against the double), on 127.0.0.1. Prometheus'
        # ServiceAccount is bound to the chart's metrics-reader ClusterRole as
        # controller.metrics.reader.subjects binds it; its token is what the scrapes here send.
        cfg["metrics"].update(address="127.0.0.1", port=0)
        cfg["probes"] = {"address": "127.0.0.1", "port": 0}
        self.metrics_token = self.metrics_token_file = None
        if cfg["metrics"].get("secure", True):
            reader = render("--set-json", 'controller.metrics.reader.subjects=[{"kind":"ServiceAccount",'
                            '"name":"prometheus","namespace":"monitoring"}]')
            for kind, plural in (("ClusterRole", "clusterroles"), ("ClusterRoleBinding", "clusterrolebindings")):
                for d in reader:
                    if d["kind"] == kind and d["metadata"]["name"].endswith("-metrics-reader"):
                        code, body = self.api.store.create(plural, None, d)
                        assert code == 201, body
            self.metrics_token = self.api.add_service_account_token("monitoring", "prometheus")
            self.metrics_token_file = os.path.join(self.tmp, "prometheus.token")
            with open(self.metrics_token_file, "w") as f:
                f.write(self.metrics_token)
        cfg["qemu"] = {"allowedNamespaces": [VM_NS]}  # this check runs a bare-QEMU migration: opt in
        self.controller = Controller(self.tmp, "controller", kubeconfig, self.agents[0].token_file, config=cfg)
        self.controller.metrics_token = self.metrics_token

    def stop(self):
        for vm in self.vms:
            vm.kill()
        if self.controller:
            self.controller.stop()
        for a in self.agents:
            a.stop()
        if self.api:
            self.api.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def vm(self, name, **kw):
        # 256 MiB dirtying 8 MiB/s, as tests/k8s: a TCG guest dirtying 16 MiB/s sometimes panicked on its
        # target after a completed migration on a busy machine (its QEMU gone, the next step failed).
        vm = QemuVm(self.tmp, name, mem_mib=256, dirty_mib=8, **kw)
        self.vms.append(vm)
        return vm

    def logs(self):
        return "\n".join("---- %s ----\n%s" % (p.name, p.log_text()[-3000:]) for p in self.agents + [self.controller])

    def wait_for_leader(self):
        wait_for(lambda: self.controller.metric("rdmig_controller_leader") == 1, 40, "the controller to lead")

    def migrate(self, test):
        """The RdmaMigration of a real guest (node-a to node-b, Succeeded over TCP), then the
        wrong-token migration (Failed on the source). `test` is the unittest.TestCase asserting."""
        src, dst = self.vm("src"), self.vm("dst", incoming_defer=True)
        src.wait_for_counter(2, timeout=90)
        body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
                "metadata": {"name": MIGRATION_NAME, "namespace": VM_NS},
                "spec": {"source": {"qemu": {"node": "node-a", "qmpSocket": src.agent_qmp_path}},
                         "target": {"qemu": {"node": "node-b", "qmpSocket": dst.agent_qmp_path}},
                         "transport": "auto", "multifdChannels": 2, "maxBandwidth": "1Gi"}}
        code, obj = self.api.store.create("rdmamigrations", VM_NS, body)
        test.assertEqual(code, 201, obj)

        def finished():
            _, o = self.api.store.get("rdmamigrations", VM_NS, MIGRATION_NAME)
            return o if o.get("status", {}).get("phase") in ("Succeeded", "Failed", "Cancelled") else None
        obj = wait_for(finished, 240, "the RdmaMigration to finish", interval=0.25)
        test.assertEqual(obj["status"]["phase"], "Succeeded", "%s\n%s" % (obj["status"], self.logs()))
        test.assertEqual(obj["status"]["transport"], "tcp", "no RDMA device here: auto falls back to TCP")

        # A wrong data-plane token: the agents count a transport error; neither VM is touched.
        spare = self.vm("spare", incoming_defer=True)
        target, source = start_migration(self.agents[0], self.agents[1], dst.agent_qmp_path, spare.agent_qmp_path,
                                         vm=BAD_TOKEN_VM, token="0" * 32)
        failed = self.agents[0].wait(source["id"], timeout=60)
        test.assertEqual(failed["phase"], "Failed")
        self.agents[1].cancel(target["id"])
        self.agents[1].wait(target["id"], timeout=30)
        self.pathcheck(test)

    def pathcheck(self, test):
        """An RdmaPathCheck from node-a to node-b over TCP (no guest): the controller's per-node-pair
        path check series (the dashboard's "by node pair" panels); then an executing RdmaDrainPlan
        of node-a (no VMI there: it completes with none) for the per-plan series (Drain plans row)."""
        self.run_object(test, "rdmapathchecks", {
            "apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaPathCheck",
            "metadata": {"name": PATHCHECK_NAME, "namespace": VM_NS},
            "spec": {"source": "node-a", "targets": {"nodes": ["node-b"]}, "bytes": "8Mi", "transport": "tcp"}},
            "Succeeded", ("Succeeded", "Failed"))
        self.run_object(test, "rdmadrainplans", {
            "apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaDrainPlan",
            "metadata": {"name": DRAINPLAN_NAME, "namespace": VM_NS},
            "spec": {"node": "node-a", "targets": ["node-b"], "execute": True}},
            "Completed", ("Completed", "Failed"))

    def run_object(self, test, plural, body, wanted, ends):
        """Creates `body` and waits until its status.phase is one of `ends`; it must be `wanted`."""
        name = body["metadata"]["name"]
        code, obj = self.api.store.create(plural, VM_NS, body)
        test.assertEqual(code, 201, obj)

        def ended():
            _, o = self.api.store.get(plural, VM_NS, name)
            return o if o.get("status", {}).get("phase") in ends else None
        obj = wait_for(ended, 60, "%s %s to end" % (plural, name), interval=0.25)
        test.assertEqual(obj["status"]["phase"], wanted, "%s\n%s" % (obj["status"], self.logs()))


class _HarnessPerformer:
    """Performs the stand-in's VMIM with the KubeVirt-shaped harness, the source agent's node hook
    called as virt-handler calls it (tests/kubevirt/test_kubevirt_controller.py does the same)."""

    def __init__(self, cluster, kv):
        self.cluster, self.kv, self.results = cluster, kv, []

    def target_node(self, source_node, vmim):
        return KV_NODES[1 - KV_NODES.index(source_node)]

    def perform(self, m, figures):
        r = self.cluster.migrate(parallel=0, tls=True, hook_socket=self.kv.hook_socket(m.source_node), hook_timeout=5,
                                 migration_uid=m.uid, expect_success=False)
        self.results.append(r)
        return r.success, None if r.success else r.error


class KubevirtLab:
    """KubeVirt mode beside a LiveStack (see the module's docstring); close() ends it."""

    def __init__(self, stack, mem_mib=128, dirty_mib=4):
        sys.path.insert(0, os.path.join(REPO, "tests", "kubevirt"))
        import test_kubevirt_baseline as base
        from kubevirt_standin import KubevirtStandin
        from rdmiglab.kubevirt import KubevirtCluster
        from rdmiglab.kvagents import KubevirtAgents
        missing = base.missing_prereq()
        if missing:
            raise AssertionError("the KubeVirt lab cannot run here: " + missing)
        self.stack, self.kv, self.cluster, self.standin = stack, None, None, None
        try:
            # transport auto, as the chart's agent.yaml: no RDMA device here, so TCP with an auto-no-* reason.
            self.kv = KubevirtAgents(stack.tmp, KV_NODES, transport="auto", token=stack.agents[0].token,
                                     tls=stack.agent_tls)
            for n in KV_NODES:
                stack.api.add_agent_pod(AGENT_NS, "rdmig-agent-" + n, n, self.kv[n].api_port, labels=dict(stack.pod_labels))
        except BaseException:
            self.close()
            raise
        self._cluster_class, self._standin_class = KubevirtCluster, KubevirtStandin
        self.mem_mib, self.dirty_mib = mem_mib, dirty_mib

    def start_cluster(self):
        """The launcher pods and the VMI (a TCG guest: started only when the stack's own guests are
        done, which sometimes died on a busy machine with another guest running beside them)."""
        t0 = time.monotonic()
        self.cluster = self._cluster_class(workdir=os.path.join(self.stack.tmp, "kv"), nodes=KV_NODES).__enter__()
        self.pods_seconds = time.monotonic() - t0
        self.cluster.define_and_start_vmi(KV_VMI, KV_NS, mem_mib=self.mem_mib, dirty_mib=self.dirty_mib, boot_counter=2)
        self.performer = _HarnessPerformer(self.cluster, self.kv)
        self.standin = self._standin_class(self.stack.api.store, self.performer, None)
        self.standin.add_vmi(KV_NS, KV_VMI, KV_NODES[0])

    @property
    def agents(self):
        return [self.kv[n] for n in KV_NODES]

    def close(self):
        if self.standin is not None:
            self.standin.stop()
        if self.kv is not None:
            self.kv.close()
        if self.cluster is not None:
            self.cluster.close()

    def migrate(self, test):
        """The carried migration (an RdmaMigration naming the VMI, kv-a to kv-b), then the drain
        back with post-copy allowed (not carried). Returns the two harness results."""
        body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
                "metadata": {"name": KV_MIGRATION_NAME, "namespace": KV_NS},
                "spec": {"source": {"vmi": {"name": KV_VMI}}}}
        code, obj = self.stack.api.store.create("rdmamigrations", KV_NS, body)
        test.assertEqual(code, 201, obj)

        def finished():
            _, o = self.stack.api.store.get("rdmamigrations", KV_NS, KV_MIGRATION_NAME)
            return o if o.get("status", {}).get("phase") in ("Succeeded", "Failed", "Cancelled") else None
        obj = wait_for(finished, 240, "the VMI's RdmaMigration to finish", interval=0.25)
        carried = self.performer.results[-1]
        test.assertEqual(obj["status"]["phase"], "Succeeded", "%s\n%s" % (obj["status"], self.logs()))
        test.assertTrue(carried.success, carried.error)
        record = self.kv.record(carried.source_node, carried.migration_uid)
        test.assertTrue(record["carried"], record)
        # A drain back with post-copy allowed: KubeVirt calls the hook, rdmig declines, KubeVirt's
        # own path carries it.
        self.cluster.migration_config_overrides = {"allowPostCopy": True}
        try:
            drained = self.cluster.migrate(parallel=0, tls=True, hook_socket=self.kv.hook_socket(self.cluster.vmi.node),
                                           hook_timeout=5)
        finally:
            self.cluster.migration_config_overrides = {}
        test.assertTrue(drained.success, drained.error)
        record = self.kv.record(drained.source_node, drained.migration_uid)
        test.assertEqual((record["carried"], record["phase"]), (False, "NotCarried"), record)
        return carried, drained

    def logs(self):
        return "\n".join("---- %s ----\n%s" % (a.name, a.log_text()[-3000:]) for a in self.agents) + \
            "\n---- controller ----\n" + self.stack.controller.log_text()[-3000:]
