"""KubeVirt mode of rdmig-agent, real where it can be: two network namespaces standing in for the
virt-handler pods, real nftables rules (libnftables) installed by the agent inside the source
one, the node hook called over real gRPC by a process named virt-handler, two real agents
carrying the intercepted connections over TCP. The far end is a byte sink standing in for the
target proxy (the whole KubeVirt path with libvirt and QEMU is test_kubevirt_migration.py).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
from rdmiglab.agent import Agent  # noqa: E402
from rdmiglab import kvnet  # noqa: E402
from rdmiglab.agent import parse_prometheus  # noqa: E402

STREAMS = os.path.join(HERE, "kv_streams.py")


def wait_for(pred, timeout, what, interval=0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError("timed out after %ss waiting for %s" % (timeout, what))
        time.sleep(interval)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def vmi_json(uid, mig_uid, target_addr, port, source="node-a", target="node-b", post_copy=False):
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "web-1", "namespace": "prod", "uid": uid},
        "status": {"nodeName": source, "migrationState": {
            "migrationUid": mig_uid, "sourceNode": source, "targetNode": target,
            "targetNodeAddress": target_addr, "mode": "PreCopy",
            "targetDirectMigrationNodePorts": {str(port): 49152, "1": 0},
            "migrationConfiguration": {"allowPostCopy": post_copy}}},
    }


class KubevirtRelayTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-kvrelay-")
        cls.net = kvnet.HandlerNetwork(["node-a", "node-b"]).setup()

    @classmethod
    def tearDownClass(cls):
        cls.net.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.procs = []
        self.agents = []
        token = "tok-" + os.urandom(16).hex()
        self.hook_socket = os.path.join(tempfile.mkdtemp(prefix="rdmig-hk-", dir="/tmp"), "hook.sock")
        self.dst = self.agent("node-b", token, peers=[])
        self.src = self.agent("node-a", token, peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}],
                              hook=self.hook_socket)
        self.sink_log = os.path.join(self.tmp, "sink-%s.log" % self._testMethodName)
        ready = os.path.join(self.tmp, "sink-%s.json" % self._testMethodName)
        self.spawn(["ip", "netns", "exec", self.net.netns["node-b"], sys.executable, STREAMS, "sink",
                    "--ready", ready, "--log", self.sink_log])
        self.sink_port = wait_for(lambda: os.path.exists(ready) and read_json(ready)["port"], 10, "the sink")

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for a in self.agents:
            a.stop()
        if any(e for t, e in self._outcome.result.errors + self._outcome.result.failures if t is self) \
                if hasattr(self._outcome, "result") else False:
            for a in self.agents:
                print("---- %s log ----\n%s" % (a.name, a.log_text()[-3000:]))

    def agent(self, node, token, peers, hook="", rule_timeout=3):
        a = Agent(self.tmp, name="%s-%s" % (node, self._testMethodName[-12:]), token=token, config={
            "kubevirt": {"enabled": True, "nodeName": node, "hookSocket": hook, "peers": peers,
                         "ruleTimeoutSeconds": rule_timeout, "sessionIdleSeconds": 1}})
        self.agents.append(a)
        return a

    def spawn(self, argv, **kw):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.procs.append(p)
        return p

    def dial(self, count, nbytes, vmi=None, hook=True, hold=0, wait=True):
        argv = ["ip", "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "dial",
                "--dest", "%s:%d" % (self.net.ip4["node-b"], self.sink_port), "--count", str(count),
                "--bytes", str(nbytes)]
        if hook:
            path = os.path.join(self.tmp, "vmi-%s.json" % self._testMethodName)
            with open(path, "w") as f:
                json.dump(vmi, f)
            argv += ["--hook-socket", self.hook_socket, "--vmi", path]
        if hold:
            argv += ["--hold", str(hold)]
        p = self.spawn(argv)
        if not wait:
            return p
        out, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 0, err)
        return json.loads(out)

    def records(self, agent, **params):
        q = "&".join("%s=%s" % kv for kv in params.items())
        return agent.call("GET", "/v1/kubevirt/migrations" + ("?" + q if q else ""))["items"]

    def nft(self, node):
        return subprocess.run(["ip", "netns", "exec", self.net.netns[node], "nft", "list", "table", "inet", "rdmig"],
                              capture_output=True, text=True).stdout

    def sink_lines(self):
        if not os.path.exists(self.sink_log):
            return []
        with open(self.sink_log) as f:
            return [json.loads(line) for line in f if line.strip()]

    # ---- behaviours ----

    def test_hook_arms_redirect_and_agents_carry_connections_in_order(self):
        mig = "mig-" + os.urandom(4).hex()
        vmi = vmi_json("vmi-uid-1", mig, self.net.ip4["node-b"], self.sink_port)
        res = self.dial(9, 2 << 20, vmi=vmi)
        self.assertTrue(res["hook"]["ok"], res["hook"])
        self.assertLess(res["hook"]["duration_s"], 1.0, "the hook must decide within a second")
        self.assertTrue(all(c["ok"] for c in res["connections"]), res["connections"])
        rules = self.nft("node-a")
        self.assertIn("%s . %d" % (self.net.ip4["node-b"], self.sink_port), rules)
        self.assertIn("redirect to :", rules)
        # The sink saw the connections in the dialler's order, each byte-exact.
        lines = wait_for(lambda: len(self.sink_lines()) == 9 and self.sink_lines(), 10, "the sink's log")
        self.assertEqual([int(l["index"]) for l in sorted(lines, key=lambda l: l["accepted"])], list(range(9)))
        src = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Succeeded"],
                       20, "the source record to end")[0]
        self.assertTrue(src["carried"])
        self.assertEqual(src["transport"], "tcp")
        self.assertEqual(src["connections"], 9)
        self.assertEqual(src["vmi"], {"namespace": "prod", "name": "web-1", "uid": "vmi-uid-1"})
        self.assertGreaterEqual(src["bytesSent"], 9 * (2 << 20))
        dst = wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] == "Succeeded"],
                       20, "the target record to end")[0]
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])
        self.assertEqual(dst["role"], "target")
        vm = frozenset({("namespace", "prod"), ("name", "web-1"), ("role", "source")})
        m = wait_for(lambda: (lambda m: ("rdmig_kubevirt_migration_carried", vm) in m and m)(
            parse_prometheus(self.src.metrics())[0]), 5, "the per-VMI metrics")
        self.assertEqual(m.get(("rdmig_kubevirt_hook_calls_total", frozenset({("decision", "carried")}))), 1.0)
        self.assertEqual(m.get(("rdmig_kubevirt_migration_carried", vm)), 1.0)
        self.assertEqual(m.get(("rdmig_kubevirt_migration_bytes", vm | {("direction", "sent")})), src["bytesSent"])

    def test_post_copy_and_same_node_migrations_are_not_touched(self):
        for i, (kw, why) in enumerate([({"post_copy": True}, "post-copy"), ({"target": "node-a"}, "same-node")]):
            mig = "mig-skip-%d" % i
            vmi = vmi_json("vmi-uid-2", mig, self.net.ip4["node-b"], self.sink_port, **kw)
            res = self.dial(2, 4096, vmi=vmi)
            self.assertTrue(res["hook"]["ok"], "the hook never fails KubeVirt's migration")
            self.assertTrue(all(c["ok"] for c in res["connections"]), res["connections"])
            rec = self.records(self.src, migrationUid=mig)
            self.assertEqual(len(rec), 1)
            self.assertFalse(rec[0]["carried"])
            self.assertEqual(rec[0]["phase"], "NotCarried")
            self.assertIn(why, rec[0]["reason"])
        self.assertNotIn("%s . %d" % (self.net.ip4["node-b"], self.sink_port), self.nft("node-a"))
        self.assertEqual(self.records(self.dst), [], "the target agent saw nothing")

    def test_unarmed_destination_is_not_intercepted(self):
        # No hook call: the proxy's connection goes straight to the target.
        res = self.dial(1, 65536, hook=False)
        self.assertTrue(res["connections"][0]["ok"])
        self.assertEqual(self.records(self.src), [])

    def test_killed_target_agent_resets_every_connection_within_two_seconds(self):
        mig = "mig-kill"
        vmi = vmi_json("vmi-uid-3", mig, self.net.ip4["node-b"], self.sink_port)
        p = self.dial(3, 1 << 20, vmi=vmi, hold=20, wait=False)
        wait_for(lambda: any(r["connections"] == 3 for r in self.records(self.src, migrationUid=mig)), 20,
                 "three carried connections")
        killed_at = time.time()
        self.dst.proc.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        res = json.loads(out)
        for c in res["connections"]:
            self.assertIsNotNone(c.get("ended_at"), c)
            self.assertNotIn("still open", c["error"])
            self.assertLess(c["ended_at"] - killed_at, 2.0, c)
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Failed"], 10,
                       "the source record to fail")[0]
        self.assertIn("node-b", rec["reason"])
        # The path is now unhealthy: the next migration is left to KubeVirt's own path.
        vmi2 = vmi_json("vmi-uid-3", mig + "-retry", self.net.ip4["node-b"], self.sink_port)
        res2 = self.dial(2, 65536, vmi=vmi2)
        self.assertTrue(all(c["ok"] for c in res2["connections"]), res2)
        rec2 = self.records(self.src, migrationUid=mig + "-retry")
        self.assertEqual(rec2[0]["phase"], "NotCarried")
        self.assertIn("unhealthy", rec2[0]["reason"])

    def test_rules_expire_when_the_source_agent_is_killed(self):
        mig = "mig-expire"
        vmi = vmi_json("vmi-uid-4", mig, self.net.ip4["node-b"], self.sink_port)
        # Arm, but do not dial yet: the element is in place.
        from rdmiglab import kvhook
        p = subprocess.run(["ip", "netns", "exec", self.net.netns["node-a"], sys.executable, "-c",
                            "import sys,json; sys.path.insert(0,%r); from rdmiglab import kvhook; "
                            "print(json.dumps(kvhook.call_node_hook(%r,'PreMigrationSource',%r,'node-a')))"
                            % (os.path.join(HERE, "..", "..", "tools"), self.hook_socket, json.dumps(vmi))],
                           capture_output=True, text=True, timeout=30)
        self.assertTrue(json.loads(p.stdout)["ok"], p.stderr)
        self.assertIn("%s . %d" % (self.net.ip4["node-b"], self.sink_port), self.nft("node-a"))
        self.src.proc.send_signal(signal.SIGKILL)
        self.src.proc.wait()
        wait_for(lambda: "%s . %d" % (self.net.ip4["node-b"], self.sink_port) not in self.nft("node-a"), 10,
                 "the redirect element to expire")
        res = self.dial(1, 65536, hook=False)
        self.assertTrue(res["connections"][0]["ok"], "KubeVirt's own path works again")


if __name__ == "__main__":
    unittest.main()
