"""Agents of two versions during a rolling upgrade (tests/compat/README.md): the agent of the previous
release point (tests/compat/previous-release, built from git by build-agent.sh into the cache outside
the clone) and the agent of this tree carry each kind of session to each other, in both directions:

  - a bare-QEMU migration through the two agents over TCP (a small guest, QEMU 10 under ctest), the
    guest byte-exact on the target and running on there;
  - a KubeVirt carry: two KubeVirt-mode agents, the node hook armed by a stand-in virt-handler, a few
    MiB on each of three intercepted connections carried to the stand-in target proxy;
  - a path check between the two agents (POST /v1/pathchecks on both).

Each must either work, or be refused at the hello with a reason that names both versions; a hang, a
crash or a session that fails after the hello fails the test. With the same protocol lines at both
commits, every case is expected to work.

Run from the repository root after building (ctest runs it as compat_mixed_versions, with Debian's
python3 for the node hook's gRPC):
  RDMIG_AGENT=build/agent/rdmig-agent RDMIG_TEST_QEMU=10 PYTHONDONTWRITEBYTECODE=1 \
    /usr/bin/python3 tests/compat/test_mixed_versions.py -v
RDMIG_COMPAT_AGENT=<binary> uses that old agent instead of building one; the control run (the old
agent at both ends) is RDMIG_AGENT=<the old binary> with the same command. RDMIG_COMPAT_NEW_TLS=1 (by
hand, README.md) runs the new agents with dataPlane.tls on, a switch the old agent lacks.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
from rdmiglab import Agent, QemuVm, ensure_guest, migrate_via_agents  # noqa: E402
from rdmiglab.agent import agent_binary  # noqa: E402
from rdmiglab import kvnet  # noqa: E402
from rdmiglab.kvhook import vmi_json  # noqa: E402
from rdmiglab.kvpod import wait_for  # noqa: E402
from rdmiglab import timed  # noqa: E402
from test_agent_pathcheck import start_pair, wait_check  # noqa: E402

MiB = 1 << 20
STREAMS = os.path.join(REPO, "tests", "kubevirt", "kv_streams.py")
BUILD_OLD = os.path.join(HERE, "build-agent.sh")
# A small guest: this row proves the two versions talk, not throughput (test_agent_migration does).
MEM_MIB, DIRTY_MIB, MULTIFD = 128, 4, 2
CARRY_CONNECTIONS, CARRY_BYTES = 3, 2 * MiB
# Which direction: (source version, target version).
DIRECTIONS = (("old", "new"), ("new", "old"))


def old_agent():
    """The previous release point's agent: $RDMIG_COMPAT_AGENT, else built (or found in the cache)
    by build-agent.sh. A clone without that commit fails here, naming it (never a skip)."""
    path = os.environ.get("RDMIG_COMPAT_AGENT")
    if path:
        return path
    res = subprocess.run([BUILD_OLD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise RuntimeError("the previous release point's agent could not be built:\n" + res.stderr[-4000:])
    sys.stderr.write(res.stderr)
    return res.stdout.strip().splitlines()[-1]


def read_json(path):
    with open(path) as f:
        return json.load(f)


def json_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def version_line(binary):
    return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()


def refused_at_hello_naming_both_versions(error):
    """True when ``error`` is a refusal at the hello naming two different versions (the peer's and
    this agent's), which the compatibility policy allows instead of working. Today's refusals:
    "hello.protocol: peer speaks version 3, this agent 4" (migrations, path checks) and
    "hello.protocol: this agent speaks 6, got 7" (KubeVirt flows)."""
    m = re.search(r"protocol\D{0,60}?(\d+)\D{1,60}?(\d+)", error or "")
    return bool(m) and m.group(1) != m.group(2)


class MixedVersionsTest(unittest.TestCase):
    outcomes = []  # (kind, source version, target version, outcome, seconds), printed at the end
    started_agents = 0

    @classmethod
    def setUpClass(cls):
        cls.bin = {"old": old_agent(), "new": agent_binary()}
        cls.version = {k: version_line(v) for k, v in cls.bin.items()}
        print("\nold: %s (%s)\nnew: %s (%s)" % (cls.version["old"], cls.bin["old"], cls.version["new"],
                                                cls.bin["new"]), file=sys.stderr)
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-compat-")
        cls.net = None

    @classmethod
    def tearDownClass(cls):
        if cls.net:
            cls.net.close()
        print("\nmixed versions (%s -> %s and back):" % (cls.version["old"], cls.version["new"]), file=sys.stderr)
        for kind, s, t, outcome, secs in cls.outcomes:
            print("  %-9s %s -> %s: %s (%.1f s)" % (kind, s, t, outcome, secs), file=sys.stderr)
        if os.environ.get("RDMIG_KEEP_TMP"):
            print("kept", cls.tmp, file=sys.stderr)
        else:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.cleanups_procs = []
        self.agents = []
        self.started = time.monotonic()

    def tearDown(self):
        for p in self.cleanups_procs:
            if p.poll() is None:
                p.kill()
            p.communicate()  # reaps it and closes its pipes
        for a in self.agents:
            # An agent of either version that crashed during the session fails the case.
            alive = a.alive()
            a.stop()
            self.assertTrue(alive, "%s exited (%s): %s" % (a.name, a.proc.returncode, a.log_text()[-3000:]))
        result = getattr(self._outcome, "result", None)
        if result and any(t is self for t, _ in result.errors + result.failures):
            for a in self.agents:
                print("---- %s log (tail) ----\n%s" % (a.name, a.log_text()[-4000:]), file=sys.stderr)

    def agent(self, version, role, config=None, token=None):
        type(self).started_agents += 1  # short names: the state directory's unix sockets
        if version == "new" and os.environ.get("RDMIG_COMPAT_NEW_TLS") == "1":
            # By hand only (README.md, "dataPlane.tls during an upgrade"): the new agents with a switch
            # the old one lacks; the cases then fail, each naming dataPlane.tls.
            config = dict(config or {}, dataPlane={"tls": "on"})
        a = Agent(self.tmp, "%s-%s-%d" % (role, version, self.started_agents), binary=self.bin[version],
                  config=config, token=token, log_level="debug")
        self.agents.append(a)
        return a

    def works_or_refused_at_hello(self, kind, direction, ok, error, detail):
        """The policy: a session between the two versions works, or is refused at the hello naming
        both versions; anything else (a failure after the hello) fails the case."""
        outcome = "works" if ok else ("refused at the hello: " + error
                                      if refused_at_hello_naming_both_versions(error) else "FAILED: " + str(error))
        type(self).outcomes.append((kind, direction[0], direction[1], outcome, time.monotonic() - self.started))
        self.assertFalse(outcome.startswith("FAILED"), "%s %s -> %s: %s\n%s" % (kind, direction[0], direction[1],
                                                                                 error, detail))
        return ok

    # ---- bare QEMU: a migration through the two agents over TCP ------------------------------------
    def bare_qemu(self, direction):
        ensure_guest()
        src_agent, dst_agent = self.agent(direction[0], "src"), self.agent(direction[1], "dst")
        name = "%s-to-%s" % direction
        src = QemuVm(self.tmp, name + "-src", mem_mib=MEM_MIB, dirty_mib=DIRTY_MIB)
        self.addCleanup(src.kill)
        dst = QemuVm(self.tmp, name + "-dst", mem_mib=MEM_MIB, dirty_mib=DIRTY_MIB, incoming_defer=True,
                     paused=True)
        self.addCleanup(dst.kill)
        src.wait_for_counter(2, timeout=90)
        s, t = migrate_via_agents(src_agent, dst_agent, src.agent_qmp_path, dst.agent_qmp_path,
                                  multifd_channels=MULTIFD, vm="vm-compat", timeout=240)
        ok = s["phase"] == "Succeeded" and t["phase"] == "Succeeded"
        error = (s.get("result") or {}).get("reason") or (t.get("result") or {}).get("reason")
        if not self.works_or_refused_at_hello("bare-qemu", direction, ok, error, (s, t)):
            self.assertEqual(src.status(), "running", "refused at the hello: the VM stays on the source")
            return
        self.assertEqual(s["transport"], "tcp")
        self.assertEqual(s["channels"], MULTIFD + 1)
        self.assertEqual(s["progress"]["dataBytesSent"], t["progress"]["dataBytesReceived"])
        self.assertEqual(src.status(), "postmigrate")
        self.assertEqual(dst.status(), "paused")
        self.assertEqual(src.memory_digest(), dst.memory_digest(), "guest memory differs between source and target")
        last = src.last_counter()
        dst.cont()
        self.assertEqual(dst.status(), "running")
        self.assertGreater(dst.wait_for_counter(last + 1, timeout=90), last, "the guest does not go on on the target")

    def test_bare_qemu_old_source_to_new_target(self):
        self.bare_qemu(DIRECTIONS[0])

    def test_bare_qemu_new_source_to_old_target(self):
        self.bare_qemu(DIRECTIONS[1])

    # ---- KubeVirt: the node hook, the redirect, a few MiB carried between two KubeVirt-mode agents --
    def handler_network(self):
        if type(self).net is None:
            type(self).net = kvnet.HandlerNetwork(["node-a", "node-b"]).setup()
        return type(self).net

    def spawn(self, argv):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.cleanups_procs.append(p)
        return p

    def kubevirt_carry(self, direction, data_plane=None):
        net = self.handler_network()
        token = "tok-" + os.urandom(16).hex()
        hook = os.path.join(tempfile.mkdtemp(prefix="rdmig-hk-", dir="/tmp"), "hook.sock")
        self.addCleanup(shutil.rmtree, os.path.dirname(hook), True)

        def kv(node, peers, hook_socket="", version="old"):
            config = {"kubevirt": {"enabled": True, "nodeName": node, "hookSocket": hook_socket, "peers": peers,
                                   "ruleTimeoutSeconds": 3, "sessionIdleSeconds": 1}}
            if data_plane and version == "new":
                config["dataPlane"] = data_plane  # a switch the old agent may lack
            return config
        dst_agent = self.agent(direction[1], "node-b", kv("node-b", [], version=direction[1]), token)
        src_agent = self.agent(direction[0], "node-a", kv("node-a", [{"node": "node-b", "agent": "127.0.0.1:%d" %
                                                                      dst_agent.data_port}], hook, direction[0]), token)
        sink_log = os.path.join(self.tmp, "sink-%s.log" % self._testMethodName)
        ready = os.path.join(self.tmp, "sink-%s.json" % self._testMethodName)
        self.spawn([kvnet.IP, "netns", "exec", net.netns["node-b"], sys.executable, STREAMS, "sink",
                    "--ready", ready, "--log", sink_log])
        sink_port = wait_for(lambda: os.path.exists(ready) and read_json(ready)["port"], 10, "the sink")
        mig = "mig-" + os.urandom(4).hex()
        vmi_path = os.path.join(self.tmp, "vmi-%s.json" % self._testMethodName)
        with open(vmi_path, "w") as f:
            json.dump(vmi_json("vmi-uid-compat", mig, net.ip4["node-b"], sink_port), f)
        # KubeVirt's migration TLS is on by default: each connection starts with a TLS record's head.
        p = self.spawn([kvnet.IP, "netns", "exec", net.netns["node-a"], sys.executable, STREAMS, "dial",
                        "--dest", "%s:%d" % (net.ip4["node-b"], sink_port), "--count", str(CARRY_CONNECTIONS),
                        "--bytes", str(CARRY_BYTES), "--hook-socket", hook, "--vmi", vmi_path, "--tls-head"])
        out, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 0, err)
        res = json.loads(out)

        def records(agent):
            return agent.call("GET", "/v1/kubevirt/migrations?migrationUid=" + mig)["items"]

        def ended(agent):
            return wait_for(lambda: [r for r in records(agent) if r["phase"] in ("Succeeded", "Failed")], 30,
                            "%s's record of %s to end" % (agent.name, mig))[0]
        if data_plane:
            # Not carried: the source's record says why, and KubeVirt's own path carried the bytes.
            return res, wait_for(lambda: records(src_agent), 30, "%s's record of %s" % (src_agent.name, mig))[0]
        src = ended(src_agent)
        dst = [r for r in records(dst_agent)]
        connections_ok = bool(res["hook"] and res["hook"].get("ok")) and all(c["ok"] for c in res["connections"])
        ok = connections_ok and src["phase"] == "Succeeded" and src.get("carried") is True
        error = src.get("reason") or ("" if connections_ok else json.dumps(res))
        if not self.works_or_refused_at_hello("kubevirt", direction, ok, error, (res, src, dst)):
            return
        # Every byte arrived intact: the sink answered each connection's SHA-256 (kv_streams checks it)
        # and logged them in the dialler's order.
        lines = wait_for(lambda: (lambda ls: len(ls) == CARRY_CONNECTIONS and ls)(json_lines(sink_log)), 10,
                         "the sink's log")
        # (the index line follows the TLS record's head the sink keeps)
        self.assertEqual([int(re.search(r"(\d+)$", x["index"]).group(1)) for x in sorted(lines, key=lambda x: x["accepted"])],
                         list(range(CARRY_CONNECTIONS)))
        self.assertTrue(all(x["error"] is None and x["bytes"] > CARRY_BYTES for x in lines), lines)
        self.assertEqual(src["transport"], "tcp")
        self.assertEqual(src["connections"], CARRY_CONNECTIONS)
        self.assertGreaterEqual(src["bytesSent"], CARRY_CONNECTIONS * CARRY_BYTES)
        dst = wait_for(lambda: [r for r in records(dst_agent) if r["phase"] == "Succeeded"], 20,
                       "the target record to end")[0]
        self.assertEqual(dst["role"], "target")
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])

    def test_kubevirt_carry_old_source_to_new_target(self):
        self.kubevirt_carry(DIRECTIONS[0])

    def test_kubevirt_carry_new_source_to_old_target(self):
        self.kubevirt_carry(DIRECTIONS[1])

    def test_kubevirt_carry_new_source_with_failover_to_old_target_names_failover(self):
        # docs/failover.md ("During a rolling upgrade"): a target from before KubeVirt-mode failover
        # proves the flow hello without its "failover" field, so the two refuse each other at the
        # token proof. The source says so (not "did not prove the agents' token"), declines rather
        # than marking the peer unhealthy, and KubeVirt's own path carries the migration.
        res, src = self.kubevirt_carry(DIRECTIONS[1], data_plane={"failover": "on"})
        outcome = "not carried: " + src.get("reason", "?")
        type(self).outcomes.append(("kv+fo", "new", "old", outcome, time.monotonic() - self.started))
        self.assertEqual((src["phase"], src["carried"]), ("NotCarried", False), src)
        self.assertIn("does not offer failover", src["reason"])
        self.assertIn("the agent on node-b declined: ", src["reason"])
        self.assertIn("Turn dataPlane.failover off", src["reason"])
        self.assertTrue(all(c["ok"] for c in res["connections"]), res["connections"])

    # ---- path check: POST /v1/pathchecks on both agents ---------------------------------------------
    def path_check(self, direction):
        src_agent, dst_agent = self.agent(direction[0], "src"), self.agent(direction[1], "dst")
        sid, tid = start_pair(src_agent, dst_agent, bytes="16Mi", chunkSize="256Ki", channels=2, transport="tcp")
        src, dst = wait_check(src_agent, sid), wait_check(dst_agent, tid)
        ok = src["phase"] == "Succeeded" and dst["phase"] == "Succeeded"
        if not self.works_or_refused_at_hello("pathcheck", direction, ok, src.get("error") or dst.get("error"),
                                              (src, dst)):
            return
        self.assertEqual(src["bytesSent"], 16 * MiB)
        self.assertEqual(dst["bytesVerified"], 16 * MiB)
        self.assertEqual(src["transport"], "tcp")

    def test_path_check_old_source_to_new_target(self):
        self.path_check(DIRECTIONS[0])

    def test_path_check_new_source_to_old_target(self):
        self.path_check(DIRECTIONS[1])


if __name__ == "__main__":
    timed.main()
