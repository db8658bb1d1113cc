"""rdmig-controller to rdmig-agents over HTTPS (agents' api.tls, controller's agents.tls), with real
certificates made by openssl (tools/rdmiglab/pki.py, shaped like the chart's: one DNS name,
"rdmig-agent", no IPs), the API server double, two real agents and a real QEMU guest.

- a migration completes over HTTPS, the controller dialling the agents by IP and checking the
  name it is configured with;
- a controller with the wrong CA, one with the wrong serverName, one speaking plain HTTP to
  HTTPS agents, and one speaking HTTPS to a plain-HTTP agent each fail their migration with a
  reason and a message that name the problem and the config key;
- a controller whose CA file is missing or holds no certificate refuses to start, naming the key.

Each controller watches its own namespace, so four of them share one API server double and the
agents. Run from the repository root after building:
    python3 tests/k8s/test_controller_tls.py -v        (ctest -L k8s)
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
if not os.environ.get("RDMIG_AGENT"):
    os.environ["RDMIG_AGENT"] = os.path.join(REPO, "build-k8s", "agent", "rdmig-agent")
from rdmiglab import Agent, QemuVm, ensure_guest, make_agent_pki  # noqa: E402
from apiserver_double import ApiServerDouble  # noqa: E402
from controllerlab import Controller, controller_binary, wait_for  # noqa: E402

CRD = os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml")
AGENT_NS = "rdmig-system"
TERMINAL = ("Succeeded", "Failed", "Cancelled")


def migration(name, ns, src_node, dst_node, src_qmp, dst_qmp, **spec):
    body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"source": {"qemu": {"node": src_node, "qmpSocket": src_qmp}},
                     "target": {"qemu": {"node": dst_node, "qmpSocket": dst_qmp}}, "transport": "tcp"}}
    body["spec"].update(spec)
    return body


class ControllerTlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ensure_guest()
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-k8s-tls-")
        cls.pki = make_agent_pki(os.path.join(cls.tmp, "pki"))
        tls = {"cert": cls.pki["cert"], "key": cls.pki["key"], "ca": cls.pki["ca"]}
        cls.api = ApiServerDouble(os.path.join(cls.tmp, "apiserver"), tls=True, crd_path=CRD)
        cls.kubeconfig = cls.api.write_kubeconfig(os.path.join(cls.tmp, "kubeconfig"))
        token = "agent-token-" + os.urandom(12).hex()
        cls.agent_a = Agent(cls.tmp, "agent-a", token=token, tls=tls)
        cls.agent_b = Agent(cls.tmp, "agent-b", token=token, tls=tls)
        cls.plain = Agent(cls.tmp, "agent-plain", token=token)  # no api.tls: plain HTTP
        cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-aaaaa", "node-a", cls.agent_a.api_port)
        cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-bbbbb", "node-b", cls.agent_b.api_port)
        cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-plain", "node-plain", cls.plain.api_port)
        good_tls = {"caFile": cls.pki["ca"], "serverName": "rdmig-agent"}
        # One controller per namespace; leader election off (each is alone on its namespace).
        cls.controllers = {}
        for ns, tls_cfg in (("vms", good_tls),
                            ("wrong-ca", dict(good_tls, caFile=cls.pki["other_ca"])),
                            ("wrong-name", dict(good_tls, serverName="not-rdmig-agent")),
                            ("no-tls", None),
                            ("plain-agent", good_tls)):
            agents = {"tokenFile": cls.agent_a.token_file}
            if tls_cfg:
                agents["tls"] = tls_cfg
            cls.controllers[ns] = Controller(cls.tmp, "ctl-" + ns, cls.kubeconfig, cls.agent_a.token_file, config={
                "watchNamespace": ns, "agents": agents, "leaderElection": {"enabled": False},
                "qemu": {"allowedNamespaces": [ns]}})

    @classmethod
    def tearDownClass(cls):
        for c in cls.controllers.values():
            c.stop()
        for a in (cls.agent_a, cls.agent_b, cls.plain):
            a.stop()
        cls.api.stop()
        if os.environ.get("RDMIG_KEEP_TMP"):
            print("kept", cls.tmp)
        else:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.vms = []

    def tearDown(self):
        for vm in self.vms:
            vm.kill()
        result = getattr(self._outcome, "result", None)
        if result and any(t is self for t, _ in result.errors + result.failures):
            for c in self.controllers.values():
                print("---- %s log (tail) ----\n%s" % (c.name, c.log_text()[-3000:]))
            for a in (self.agent_a, self.agent_b):
                print("---- %s log (tail) ----\n%s" % (a.name, a.log_text()[-3000:]))

    def create(self, body):
        code, obj = self.api.store.create("rdmamigrations", body["metadata"]["namespace"], body)
        self.assertEqual(code, 201, obj)
        return obj

    def wait_terminal(self, ns, name, timeout):
        def done():
            code, obj = self.api.store.get("rdmamigrations", ns, name)
            return obj if code == 200 and obj.get("status", {}).get("phase") in TERMINAL else None
        return wait_for(done, timeout, "%s/%s to end" % (ns, name))["status"]

    def test_a_migration_completes_over_https(self):
        src = QemuVm(self.tmp, "tls-src", mem_mib=256, dirty_mib=8)
        self.vms.append(src)
        dst = QemuVm(self.tmp, "tls-dst", mem_mib=256, incoming_defer=True)
        self.vms.append(dst)
        src.wait_for_counter(2, timeout=90)
        self.create(migration("web-tls", "vms", "node-a", "node-b", src.agent_qmp_path, dst.agent_qmp_path,
                              maxBandwidth="1Gi"))
        st = self.wait_terminal("vms", "web-tls", 240)
        self.assertEqual(st["phase"], "Succeeded", st)
        self.assertEqual(st["targetState"], "running")
        self.assertGreater(st["progress"]["transferredBytes"], 64 << 20)
        # Both agents carried it, over their HTTPS API only (the harness speaks https too).
        for agent, role in ((self.agent_a, "source"), (self.agent_b, "target")):
            body = agent.get(st["migrationId"])
            self.assertEqual((body["role"], body["phase"]), (role, "Succeeded"))
        last = src.last_counter()
        dst.wait_for_counter(last + 1, timeout=90)  # the guest runs on, on the target
        self.assertIn("agents over HTTPS", self.controllers["vms"].log_text())

    def failed_with(self, ns, name):
        self.create(migration(name, ns, "node-a", "node-b", "/run/vms/none-src.sock", "/run/vms/none-dst.sock"))
        st = self.wait_terminal(ns, name, 60)
        self.assertEqual(st["phase"], "Failed", st)
        # Nothing reached an agent: neither knows the migration.
        for agent in (self.agent_a, self.agent_b):
            status, _ = agent.request("GET", "/v1/migrations/" + st["migrationId"])
            self.assertEqual(status, 404)
        return st

    def test_a_controller_with_the_wrong_ca_fails_naming_the_ca(self):
        st = self.failed_with("wrong-ca", "untrusted")
        self.assertEqual(st["reason"], "AgentTLSFailed", st)
        msg = st["failureReason"]
        self.assertIn("TLS: the agent's certificate is not trusted", msg)
        self.assertIn("agents.tls.caFile '%s'" % self.pki["other_ca"], msg)
        self.assertIn("rdmig-agent-aaaaa", msg)

    def test_a_controller_with_the_wrong_server_name_fails_naming_it(self):
        st = self.failed_with("wrong-name", "misnamed")
        self.assertEqual(st["reason"], "AgentTLSFailed", st)
        self.assertIn("does not carry the name agents.tls.serverName 'not-rdmig-agent'", st["failureReason"])

    def test_a_controller_without_tls_against_https_agents_says_so(self):
        st = self.failed_with("no-tls", "cleartext")
        self.assertEqual(st["reason"], "AgentUnreachable", st)
        self.assertIn("needs agents.tls", st["failureReason"])

    def test_a_controller_with_tls_against_a_plain_http_agent_fails_the_handshake(self):
        self.create(migration("downgrade", "plain-agent", "node-plain", "node-b", "/run/vms/a.sock", "/run/vms/b.sock"))
        st = self.wait_terminal("plain-agent", "downgrade", 60)
        self.assertEqual((st["phase"], st["reason"]), ("Failed", "AgentTLSFailed"), st)
        self.assertIn("TLS: handshake failed", st["failureReason"])
        self.assertIn("rdmig-agent-plain", st["failureReason"])
        status, _ = self.plain.request("GET", "/v1/migrations/" + st["migrationId"])
        self.assertEqual(status, 404, "the plain agent got no request")

    def test_a_missing_or_empty_ca_file_stops_the_controller_naming_the_key(self):
        empty = os.path.join(self.tmp, "empty-ca.crt")
        open(empty, "w").close()
        for ca in (os.path.join(self.tmp, "no-such-ca.crt"), empty):
            c = Controller(self.tmp, "ctl-bad-" + os.path.basename(ca), self.kubeconfig, self.agent_a.token_file,
                           config={"agents": {"tls": {"caFile": ca}}, "leaderElection": {"enabled": False}},
                           start=False)
            r = subprocess.run([controller_binary(), "--check-config", c.config_file], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertIn("agents.tls.caFile", r.stderr)
            self.assertIn(ca, r.stderr)
            with self.assertRaises(RuntimeError) as e:
                c.start(timeout=20)
            self.assertIn("agents.tls.caFile", str(e.exception))
        ok = Controller(self.tmp, "ctl-check-ok", self.kubeconfig, self.agent_a.token_file,
                        config={"agents": {"tls": {"caFile": self.pki["ca"]}}}, start=False)
        r = subprocess.run([controller_binary(), "--check-config", ok.config_file], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("HTTPS, 1 CA certificate(s)", r.stdout)


if __name__ == "__main__":
    unittest.main()
