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
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
from rdmiglab.agent import Agent  # noqa: E402
from rdmiglab.kvpod import wait_for  # noqa: E402
from rdmiglab import kvnet  # noqa: E402
from rdmiglab.agent import parse_prometheus  # noqa: E402
from rdmiglab.kvhook import vmi_json  # noqa: E402
from rdmiglab import profile as lab_profile  # noqa: E402
from rdmiglab import timed  # noqa: E402
# tests/k8s: the API server double and the RBAC check, imported by the API tests only (the
# Soft-RoCE VM runs this file without them and skips those tests).
sys.path.insert(0, os.path.join(HERE, "..", "k8s"))

STREAMS = os.path.join(HERE, "kv_streams.py")
# What an agent without each KubeVirt-mode capability says when the hook arms (the kernel's refusal).
# SYS_PTRACE: /proc/<pid>/ns/net of virt-handler (privileged, so the ptrace check wants it) is refused.
KV_NEEDS = {"NET_ADMIN": ("nftables in netns", "Operation not permitted"),
            "SYS_ADMIN": ("setns into netns", "Operation not permitted"),
            "SYS_PTRACE": ("cannot find the network namespace of virt-handler",)}
# Prefix of a `python3 -c` hook caller: it names itself as virt-handler does (comm), since the
# agent takes hook calls only from virt-handler.
AS_HANDLER = "import ctypes; ctypes.CDLL(None).prctl(15, b'virt-handler', 0, 0, 0); "
# tcp here; rdma in the Soft-RoCE VM (tests/rdma/kubevirt-tests.sh), over its rxe device.
TRANSPORT = os.environ.get("RDMIG_KV_TRANSPORT", "tcp")
# Cases whose code path is the same whatever carries the bytes (the node hook, the interception
# point and its nftables rules, tokens, floods, restarts): proven by this file's host run
# (ctest kubevirt_relay, TCP); the Soft-RoCE VM (rdma_kubevirt_relay) runs only the cases where
# the transport decides the outcome (carrying, resets, cut links, budgets, fallback).
same_on_every_transport = unittest.skipIf(
    TRANSPORT == "rdma", "does not depend on the transport: proven by the host run (ctest kubevirt_relay)")




def read_json(path):
    with open(path) as f:
        return json.load(f)


def cgroup2_root():
    """Where the unified (v2) cgroup hierarchy is mounted (pure v2 or hybrid)."""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[2] == "cgroup2":
                return parts[1]
    raise unittest.SkipTest("no cgroup2 mount")


def in_pod(uid, argv):
    """argv run inside a cgroup named as the kubelet names a pod's (systemd driver), so that
    /proc/<pid>/cgroup says it runs in pod `uid`, as a container of that pod would."""
    d = os.path.join(cgroup2_root(), "kubepods.slice", "kubepods-besteffort.slice",
                     "kubepods-besteffort-pod%s.slice" % uid.replace("-", "_"), "cri-containerd-test.scope")
    os.makedirs(d, exist_ok=True)
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', d] + argv


def canonical(obj):
    """nlohmann::json's dump() of the same object: keys sorted, compact, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


FLOW_PROTOCOL = 6


def flow_hello(session, nonce, mig, **kw):
    """A flow hello (protocol 6) with every field the agent reads, as it re-serialises them."""
    h = {"kind": "flow", "protocol": FLOW_PROTOCOL, "session": session, "nonce": nonce, "mode": "hook", "migrationUid": mig,
         "vmi": {"namespace": "prod", "name": "web-1", "uid": "u"}, "sourceNode": "node-a", "targetNode": "node-b",
         "chunkSize": 1 << 20, "ringDepth": 16, "transport": "tcp", "transportRequired": False}
    h.update(kw)
    return h


def flow_proof(token, role, hello, target_nonce):
    import hmac
    import hashlib
    msg = "rdmig-flow-proof\n%s\n%s\n%s\n%s" % (role, hello["nonce"], target_nonce, canonical(hello))
    return hmac.new(token.encode(), msg.encode(), hashlib.sha256).hexdigest()


def flow_send(sock, obj):
    import struct
    body = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def flow_recv(sock):
    import socket
    import struct
    sock.settimeout(10)
    n = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]
    return json.loads(sock.recv(n, socket.MSG_WAITALL))


def flow_sign(token, hello, target_nonce, seq, message):
    """A control message as the source agent signs it (FlowSigner)."""
    import hmac
    import hashlib
    key = hmac.new(token.encode(), ("rdmig-flow-key\n%s\n%s\n%s" % (hello["nonce"], target_nonce, hello["session"])
                                    ).encode(), hashlib.sha256).hexdigest()
    body = dict(message, seq=seq)
    body["mac"] = hmac.new(key.encode(), ("source\n" + canonical(body)).encode(), hashlib.sha256).hexdigest()
    return body


def _hmac_hex(key, msg):
    import hmac
    import hashlib
    return hmac.new(key.encode(), msg.encode(), hashlib.sha256).hexdigest()


def flow_channel_key(token, hello, target_nonce):
    """The key every channel of a session proves (transport::channel_key): only the two agents
    that proved the token over both nonces hold it."""
    return _hmac_hex(token, "rdmig-channel-key\n%s\n%s\n%s" % (hello["nonce"], target_nonce, hello["session"]))


def channel_proof(key, by, session, index, dialler_nonce, acceptor_nonce):
    """transport::channel_mac on TCP: by is "dial" (the source's auth) or "accept" (the welcome)."""
    return _hmac_hex(key, "rdmig-channel\n%s\n%s\n%d\n%s\n%s" % (by, session, index, dialler_nonce, acceptor_nonce))


CONTROL_INDEX = 65  # transport::kControlIndex: what a re-dialled control link's proofs name


def flow_channel(port, key, session, index, host="127.0.0.1", proof=None, nonce=None, resume=False, control=False,
                 extra=None):
    """Opens channel `index` of a flow session as its source agent does: the flow-data hello, the
    target's challenge, the proof of `key`. Returns (socket, challenge, answer); the answer is the
    welcome (checked to prove the key back) or the reject. `proof` replaces the right one.
    `resume`: the hello of a re-dial that fails the channel over (docs/failover.md). `control`: the
    re-dial of the session's control link (index 0 in the hello, proved over CONTROL_INDEX)."""
    import socket
    c = socket.create_connection((host, port), timeout=10)
    nonce = nonce or os.urandom(16).hex()
    hello = {"kind": "flow-data", "protocol": FLOW_PROTOCOL, "session": session, "index": index, "nonce": nonce}
    if resume or control:
        hello["resume"] = True
    if control:
        hello["control"] = True
        index = CONTROL_INDEX
    hello.update(extra or {})
    flow_send(c, hello)
    ch = flow_recv(c)
    if ch.get("type") != "challenge":
        return c, ch, ch
    good = channel_proof(key, "dial", session, index, nonce, ch["nonce"])
    flow_send(c, {"type": "auth", "proof": good if proof is None else proof})
    answer = flow_recv(c)
    if answer.get("type") == "welcome":
        assert answer.get("proof") == channel_proof(key, "accept", session, index, nonce, ch["nonce"]), answer
    return c, ch, dict(answer, sent=good if proof is None else proof, nonce=nonce)


def resume_as_dialler(sock, key, session, index, taken):
    """session/resume.h's exchange from the dialling end on a re-dial that was welcomed: sends this
    end's count, checks the acceptor's proof of both counts, proves them back. Returns the
    acceptor's count, or the reject it sent."""
    mine = os.urandom(16).hex()
    flow_send(sock, {"type": "resume", "taken": taken, "nonce": mine})
    answer = flow_recv(sock)
    if answer.get("type") != "resume":
        return answer

    def mac(by):
        fresh = "resume\n%s\n%s\n%d\n%d" % (mine, answer["nonce"], taken, answer["taken"])
        return _hmac_hex(key, "rdmig-channel\n%s\n%s\n%d\n%s" % (by, session, index, fresh))
    assert answer.get("proof") == mac("accept"), answer
    flow_send(sock, {"type": "resume-ok", "proof": mac("dial")})
    return answer["taken"]


class ControlReader:
    """Reads a flow's control link as its source would (the target's signed messages, heartbeats
    every 0.5 s) on a thread: their sequence numbers, and whether the target closed it."""

    def __init__(self, sock):
        self.sock, self.seqs, self.closed = sock, [], threading.Event()

        def run():
            try:
                while True:
                    self.seqs.append(flow_recv(sock)["seq"])
            except Exception:  # the end of the stream (a short read), a reset, a closed socket
                self.closed.set()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def more_than(self, n, timeout=5):
        """Waits until more than `n` messages came (the link is alive and answered)."""
        wait_for(lambda: len(self.seqs) > n or self.closed.is_set(), timeout, "the target's heartbeats")
        return len(self.seqs) > n


# How the stand-in proxy sees a connection the agent ended: a read that found the reset or the
# end, or a write into a reset connection (it may be writing at that moment).
RESET_ENDS = ("reset", "ended by the far side (EOF)", "BrokenPipeError: [Errno 32] Broken pipe")

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
        self.addCleanup(shutil.rmtree, os.path.dirname(self.hook_socket), True)
        self.dst = self.agent("node-b", token, peers=[])
        self.src = self.agent("node-a", token, peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}],
                              hook=self.hook_socket)
        self.sink_log = os.path.join(self.tmp, "sink-%s.log" % self._testMethodName)
        ready = os.path.join(self.tmp, "sink-%s.json" % self._testMethodName)
        self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-b"], sys.executable, STREAMS, "sink",
                    "--ready", ready, "--log", self.sink_log])
        self.sink_port = wait_for(lambda: os.path.exists(ready) and read_json(ready)["port"], 10, "the sink")

    # ---- the agent's API calls against the chart's RBAC for the agent -----------------------
    API_TESTS = ("test_peers_and_virt_handler_pods_from_the_kubernetes_api",
                 "test_a_launcher_counts_only_inside_the_vmis_launcher_pod",
                 "test_a_hook_document_the_api_does_not_confirm_arms_nothing")
    agent_api_calls = {}  # test name -> the (group, resource, verb, namespace, name) the agents called

    @staticmethod
    def agent_rbac():
        import rbac_check
        return rbac_check, rbac_check.chart_rules("--set", "kubevirt.enabled=true", sa_suffix="-agent")

    def api_double(self):
        """An API server double for this test, stopped at its end; then every call the agents made
        to it must be one the chart grants the agent's ServiceAccount."""
        from apiserver_double import ApiServerDouble
        api = ApiServerDouble(os.path.join(self.tmp, "api-" + self._testMethodName))

        def check():
            rbac_check, granted = self.agent_rbac()
            calls = rbac_check.calls_from_log(api.requests, "rdmig-agent/")
            self.assertNotEqual(calls, [], "the agents made no API call")
            problems = rbac_check.compare(calls, granted, unused_of=set())
            self.assertEqual(problems, [], "\n".join(problems))
            type(self).agent_api_calls[self._testMethodName] = calls
        self.addCleanup(check)
        self.addCleanup(api.stop)
        return api

    @unittest.skipIf(TRANSPORT == "rdma", "the API checks do not depend on the transport (the VM lacks the API double)")
    def test_zz_the_charts_agent_rbac_grants_only_what_the_agents_used(self):
        # Least privilege the other way: every (resource, verb, scope) the chart grants the agent,
        # one of the API tests above used. Runs after them (unittest sorts by name).
        missing = [t for t in self.API_TESTS if t not in self.agent_api_calls]
        if missing:
            self.skipTest("needs the API tests' calls (not run or failed): " + ", ".join(missing))
        rbac_check, granted = self.agent_rbac()
        calls = sorted({c for cs in self.agent_api_calls.values() for c in cs})
        self.assertEqual(rbac_check.compare(calls, granted), [])

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        # in_pod()'s cgroups, deepest first (empty once their processes are gone)
        top = None
        try:
            top = os.path.join(cgroup2_root(), "kubepods.slice")
        except unittest.SkipTest:
            pass
        if top and os.path.isdir(top):
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
        for a in self.agents:
            a.stop()
        if any(e for t, e in self._outcome.result.errors + self._outcome.result.failures if t is self) \
                if hasattr(self._outcome, "result") else False:
            for a in self.agents:
                print("---- %s log ----\n%s" % (a.name, a.log_text()[-3000:]))

    def agent(self, node, token, peers, hook="", rule_timeout=3, extra=None, data_plane=None, state_dir=None,
              env=None, migration=None, profile=None):
        config = {"kubevirt": dict({"enabled": True, "nodeName": node, "hookSocket": hook, "peers": peers,
                                    "ruleTimeoutSeconds": rule_timeout, "sessionIdleSeconds": 1}, **(extra or {}))}
        if migration:
            config["migration"] = migration
        if state_dir:
            os.makedirs(state_dir, exist_ok=True)
            config["stateDir"] = state_dir
        if data_plane:
            config["dataPlane"] = data_plane
        if TRANSPORT == "rdma":
            config.update({"transport": "rdma", "rdma": {"device": os.environ.get("RDMIG_RDMA_DEV", "rxe0")},
                           "dataPlane": {"rdmaPort": 0}})
        a = Agent(self.tmp, name="%s-%s-%s" % (node, self._testMethodName[-12:], len(self.agents)), token=token,
                  config=config, env=env, profile=profile)
        self.agents.append(a)
        return a

    def spawn(self, argv, **kw):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.procs.append(p)
        return p

    def dial(self, count, nbytes, vmi=None, hook=True, hold=0, wait=True, extra=()):
        argv = [kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "dial",
                "--dest", "%s:%d" % (self.net.ip4["node-b"], self.sink_port), "--count", str(count),
                "--bytes", str(nbytes)]
        if hook:
            path = os.path.join(self.tmp, "vmi-%s.json" % self._testMethodName)
            with open(path, "w") as f:
                json.dump(vmi, f)
            argv += ["--hook-socket", self.hook_socket, "--vmi", path]
        if hold:
            argv += ["--hold", str(hold)]
        argv += list(extra)
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
        return subprocess.run([kvnet.IP, "netns", "exec", self.net.netns[node], "nft", "list", "table", "inet", "rdmig"],
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
        dialled_at = time.monotonic()
        self.assertTrue(res["hook"]["ok"], res["hook"])
        # The agent's decision (the call alone): within a second. The whole, dial included,
        # also carries this Python client's gRPC start-up: it took 1.003 s once in the
        # TCG-emulated Soft-RoCE VM.
        self.assertLess(res["hook"]["call_s"], 1.0, "the hook must decide within a second")
        self.assertLess(res["hook"]["duration_s"], 3.0)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res["connections"])
        rules = self.nft("node-a")
        self.assertIn("%s . %d" % (self.net.ip4["node-b"], self.sink_port), rules)
        self.assertIn("redirect to :", rules)
        # The agent's own dials pass by kubevirt.socketMark under its mask, clear of kube-proxy's bits.
        self.assertIn("meta mark & 0x00002000 == 0x00002000 return", rules)
        # The sink saw the connections in the dialler's order, each byte-exact.
        lines = wait_for(lambda: len(self.sink_lines()) == 9 and self.sink_lines(), 10, "the sink's log")
        self.assertEqual([int(l["index"]) for l in sorted(lines, key=lambda l: l["accepted"])], list(range(9)))
        src = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Succeeded"],
                       20, "the source record to end")[0]
        # No launcher of the VMI on the target, at the start or the end: the target answers the
        # "end" without libvirt's figures at once (sessionIdleSeconds 1 + the maintenance tick),
        # instead of waiting out the 10 s it gives a launcher's job to complete (11.2 s before).
        self.assertLess(time.monotonic() - dialled_at, 8.0, "the record ended only after a wait for a launcher")
        self.assertTrue(src["carried"])
        self.assertEqual(src["transport"], TRANSPORT)
        self.assertEqual(src["transportReason"], "requested")  # both agents name their transport in the config
        self.assertEqual(src["connections"], 9)
        # TLS-like bytes (nothing to read in them): the first connection to the memory port is main.
        self.assertEqual(src["mainConnection"], {"index": 0, "by": "order"})
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

    @same_on_every_transport
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

    @same_on_every_transport
    def test_the_charts_capabilities_carry_and_without_each_kubevirt_one_kubevirt_carries(self):
        """Both agents unprivileged with the chart's KubeVirt-mode capabilities (rdmiglab.profile)
        carry; a source agent without one of NET_ADMIN, SYS_ADMIN, SYS_PTRACE arms nothing, its
        record naming what the kernel refused, and the connections go KubeVirt's way (docs/security.md
        "The agent's privileges"; DAC_OVERRIDE, for a non-root launcher's libvirt, in
        test_kubevirt_migration)."""
        chart = lab_profile.for_config({"transport": TRANSPORT, "kubevirt": {"enabled": True}})
        self.assertEqual(chart.caps, ["DAC_OVERRIDE", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"])
        for a in (self.src, self.dst):
            a.stop()
        token = self.dst.token
        self.dst = self.agent("node-b", token, peers=[], profile=chart)
        peers = [{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}]
        for i, (dropped, why) in enumerate([(None, None), ("NET_ADMIN", KV_NEEDS["NET_ADMIN"]),
                                            ("SYS_ADMIN", KV_NEEDS["SYS_ADMIN"]), ("SYS_PTRACE", KV_NEEDS["SYS_PTRACE"])]):
            if i:
                self.src.stop()
            self.src = self.agent("node-a", token, peers=peers, hook=self.hook_socket,
                                  profile=chart.without(dropped) if dropped else chart)
            for attempt in range(3):
                mig = "mig-caps-%d-%d-%s" % (i, attempt, os.urandom(3).hex())
                res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-caps", mig, self.net.ip4["node-b"], self.sink_port))
                self.assertTrue(res["hook"]["ok"], "the hook never fails KubeVirt's migration")
                self.assertTrue(all(c["ok"] for c in res["connections"]), (dropped, res["connections"]))
                rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig)
                                        if r["phase"] in ("Succeeded", "Failed", "NotCarried")], 20, "the record to end")[0]
                # The session with the target opens before the namespace is entered: on a loaded
                # machine its hello can miss the hook's deadline (800 ms), which says nothing
                # about capabilities; try that migration again.
                if not (rec.get("reason") or "").startswith("cannot reach the agent on "):
                    break
            print("[capabilities] without %s: %s, carried %s: %s" % (dropped, rec["phase"], rec["carried"],
                                                                       rec.get("reason")), file=sys.stderr)
            if dropped is None:
                self.assertEqual((rec["phase"], rec["carried"]), ("Succeeded", True), rec)
                dst = wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] == "Succeeded"],
                               20, "the target record to end")[0]
                self.assertEqual(dst["bytesReceived"], rec["bytesSent"])
            else:
                self.assertEqual((rec["phase"], rec["carried"]), ("NotCarried", False), (dropped, rec))
                for part in why:
                    self.assertIn(part, rec["reason"], dropped)
                self.assertNotIn("%s . %d" % (self.net.ip4["node-b"], self.sink_port), self.nft("node-a"))

    @same_on_every_transport
    def test_unarmed_destination_is_not_intercepted(self):
        # No hook call: the proxy's connection goes straight to the target.
        res = self.dial(1, 65536, hook=False)
        self.assertTrue(res["connections"][0]["ok"])
        self.assertEqual(self.records(self.src), [])

    def test_killed_target_agent_resets_the_main_connection_at_once_and_drains_the_others(self):
        # The first connection is QEMU's main channel: reset within 2 s, which fails QEMU's
        # migration. The others (multifd) are read to nowhere (a multifd write that fails can
        # hang QEMU 7.2's migration thread for good, tests/kubevirt/README.md) until QEMU has
        # sent nothing on them for 1 s (this stand-in holds them open and silent) or the limit.
        drain_s = 10.0  # SourceSession::kMultifdDrainLimit
        idle_s = 1.0  # migration::kMultifdDrainIdle
        mig = "mig-kill"
        vmi = vmi_json("vmi-uid-3", mig, self.net.ip4["node-b"], self.sink_port)
        p = self.dial(3, 1 << 20, vmi=vmi, hold=30, wait=False)
        wait_for(lambda: any(r["connections"] == 3 for r in self.records(self.src, migrationUid=mig)), 20,
                 "three carried connections")
        killed_at = time.time()
        self.dst.proc.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        res = json.loads(out)
        main, others = res["connections"][0], res["connections"][1:]
        self.assertIn(main["error"], RESET_ENDS, main)
        self.assertLess(main["ended_at"] - killed_at, 2.0, main)
        for c in others:
            self.assertIsNotNone(c.get("ended_at"), c)
            self.assertNotIn("still open", c["error"])
            # Drained, not reset with the main channel: it outlived the reset by the silence.
            self.assertGreater(c["ended_at"] - main["ended_at"], idle_s - 0.2,
                               "a multifd connection was not drained: %s (main: %s)" % (c, main))
            self.assertLess(c["ended_at"] - killed_at, drain_s + 3.0, c)
        print("\n[relay] after the kill: main connection ended in %.2f s, the others in %s s"
              % (main["ended_at"] - killed_at, ", ".join("%.1f" % (c["ended_at"] - killed_at) for c in others)),
              file=sys.stderr)
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Failed"], 10,
                       "the source record to fail")[0]
        self.assertIn("node-b", rec["reason"])
        # kubevirt.multifdOnFailure "auto" without a launcher to ask: the QEMU version is
        # unknown, and an unknown QEMU keeps the drain (QEMU 7.2 needs it).
        self.assertEqual(rec["onFailure"], {"multifd": "drain", "by": "qemu unknown"}, rec)
        # The path is now unhealthy: the next migration is left to KubeVirt's own path.
        vmi2 = vmi_json("vmi-uid-3", mig + "-retry", self.net.ip4["node-b"], self.sink_port)
        res2 = self.dial(2, 65536, vmi=vmi2)
        self.assertTrue(all(c["ok"] for c in res2["connections"]), res2)
        rec2 = self.records(self.src, migrationUid=mig + "-retry")
        self.assertEqual(rec2[0]["phase"], "NotCarried")
        self.assertIn("unhealthy", rec2[0]["reason"])

    def test_killed_target_agent_resets_every_connection_at_once_when_set_to_reset(self):
        # kubevirt.multifdOnFailure "reset" (what "auto" picks for a QEMU 10 launcher): no drain,
        # every carried connection is reset as soon as the session fails, the multifd ones too.
        self.src.stop()
        self.src = self.agent("node-a", self.src.token,
                              peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}],
                              hook=self.hook_socket, extra={"multifdOnFailure": "reset"})
        mig = "mig-kill-reset"
        vmi = vmi_json("vmi-uid-3r", mig, self.net.ip4["node-b"], self.sink_port)
        p = self.dial(3, 1 << 20, vmi=vmi, hold=30, wait=False)
        wait_for(lambda: any(r["connections"] == 3 for r in self.records(self.src, migrationUid=mig)), 20,
                 "three carried connections")
        killed_at = time.time()
        self.dst.proc.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        res = json.loads(out)
        ended = [c["ended_at"] - killed_at for c in res["connections"]]
        print("\n[relay] reset on failure: the connections ended %s s after the kill"
              % ", ".join("%.2f" % e for e in ended), file=sys.stderr)
        for c in res["connections"]:
            self.assertIn(c["error"], RESET_ENDS, c)
            self.assertLess(c["ended_at"] - killed_at, 4.0, "a connection was drained, not reset: %s" % c)
        # Reset together. A drain would hold the multifd ones at least 1 s longer than the main
        # channel (until 1 s of silence, migration::kMultifdDrainIdle; at most 10 s).
        self.assertLess(max(ended) - min(ended), 0.5, "a connection was drained, not reset: %s" % ended)
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Failed"], 10,
                       "the source record to fail")[0]
        self.assertEqual(rec["onFailure"], {"multifd": "reset", "by": "config"}, rec)

    @unittest.skipIf(shutil.which("nft") is None, "needs the nft command to cut the agents' link")
    def test_a_cut_link_fails_both_agents_within_the_heartbeat_timeout(self):
        # The agents' link black-holed (every packet to or from the target agent's data-plane
        # port dropped: no FIN, no RST, as a pulled cable or a partition). Only the heartbeats on
        # the session's control link can tell: both agents fail the session within
        # kubevirt.heartbeatTimeoutSeconds (3 s) and a heartbeat interval, and the source resets
        # the main connection (QEMU fails there). Without them, TCP noticed after ~25-30 s
        # (keepalive on the idle connections, TCP_USER_TIMEOUT on unacknowledged data).
        mig = "mig-cut"
        vmi = vmi_json("vmi-uid-cut", mig, self.net.ip4["node-b"], self.sink_port)
        p = self.dial(3, 1 << 20, vmi=vmi, hold=45, wait=False)
        wait_for(lambda: any(r["connections"] == 3 for r in self.records(self.src, migrationUid=mig)), 20,
                 "three carried connections")
        wait_for(lambda: any(r["connections"] == 3 for r in self.records(self.dst, migrationUid=mig)), 20,
                 "three connections on the target")
        table = "rdmig_test_cut_relay"
        rules = ("table inet %s {\n  chain pre { type filter hook prerouting priority -300; policy accept;\n"
                 "    tcp dport %d drop\n    tcp sport %d drop\n  }\n}\n") % (table, self.dst.data_port, self.dst.data_port)
        cut_at = time.time()
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
        try:
            out, err = p.communicate(timeout=90)
            src = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Failed"], 10,
                           "the source record to fail")[0]
            dst = wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] == "Failed"], 10,
                           "the target record to fail")[0]
        finally:
            subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
        main = json.loads(out)["connections"][0]
        print("\n[relay] after the cut: main connection ended in %.2f s; source: %s; target: %s"
              % (main["ended_at"] - cut_at, src["reason"], dst["reason"]), file=sys.stderr)
        self.assertIn(main["error"], RESET_ENDS, main)
        self.assertLess(main["ended_at"] - cut_at, 5.0, "the source noticed the cut too late: %s" % main)
        if TRANSPORT == "rdma":
            # Over RDMA the cut drops the control link only: both agents share one rxe device here,
            # and rxe loops traffic between its own addresses past netfilter, so the channels'
            # queue pairs stay up. Both heartbeat timers run out together; when the target's fires
            # first, its abort still crosses the channels and the source fails on that ("peer
            # aborted") a few milliseconds before its own timer. Either way it names the node.
            # The same holds the other way round for the target.
            self.assertTrue("no heartbeat" in src["reason"] or "peer aborted" in src["reason"], src)
            self.assertTrue("no heartbeat" in dst["reason"] or "peer aborted" in dst["reason"], dst)
            self.assertIn("no heartbeat", src["reason"] + dst["reason"], "neither agent noticed the silence")
        else:
            self.assertIn("no heartbeat", src["reason"])
            self.assertIn("no heartbeat", dst["reason"])
        self.assertIn("node-b", src["reason"])
        self.assertLess(src["finishedAtMs"] / 1000.0 - cut_at, 5.0, src)
        self.assertLess(dst["finishedAtMs"] / 1000.0 - cut_at, 5.0, dst)

    def test_main_channel_by_its_first_bytes_and_block_connections_reset_not_drained(self):
        # A block migration, as KubeVirt makes one: libvirt copies the disks (49153, NBD) before it
        # starts the memory migration, so the first carried connection is a disk's. With KubeVirt's
        # TLS off the agent sees QEMU's first bytes: here the main channel is the third memory
        # connection (the proxy dials in no fixed order). On a failure the disk connection and the
        # main channel are reset at once; the multifd connections drain (here until 1 s of
        # silence: the stand-in holds them open and sends nothing more).
        drain_s = 10.0  # SourceSession::kMultifdDrainLimit
        idle_s = 1.0  # migration::kMultifdDrainIdle
        ready = os.path.join(self.tmp, "sink-block-%s.json" % self._testMethodName)
        self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-b"], sys.executable, STREAMS, "sink",
                    "--ready", ready, "--log", self.sink_log + ".block"])
        block_port = wait_for(lambda: os.path.exists(ready) and read_json(ready)["port"], 10, "the block sink")
        mig = "mig-block"
        vmi = vmi_json("vmi-uid-b", mig, self.net.ip4["node-b"], self.sink_port)
        vmi["status"]["migrationState"]["targetDirectMigrationNodePorts"][str(block_port)] = 49153
        p = self.dial(5, 1 << 20, vmi=vmi, hold=30, wait=False, extra=[
            "--block-dest", "%s:%d" % (self.net.ip4["node-b"], block_port), "--block-count", "1",
            "--magic", "--main-at", "3"])
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig)
                                if r["connections"] == 5 and (r["mainConnection"] or {}).get("by") == "magic"], 20,
                       "five carried connections, the main one told by its first bytes")[0]
        self.assertEqual(rec["mainConnection"], {"index": 3, "by": "magic"}, rec)
        killed_at = time.time()
        self.dst.proc.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        conns = {c["index"]: c for c in json.loads(out)["connections"]}
        ended = {i: round(c["ended_at"] - killed_at, 2) for i, c in conns.items()}
        print("\n[relay] block migration, after the kill: connections ended in %s s" % ended, file=sys.stderr)
        for i in (0, 3):  # the disk (NBD) connection and QEMU's main channel
            self.assertIn(conns[i]["error"], RESET_ENDS, conns[i])
            self.assertLess(ended[i], 2.0, "connection %d was not reset at once: %s" % (i, conns))
        for i in (1, 2, 4):  # multifd: drained, outliving the resets by the silence
            self.assertGreater(ended[i] - max(ended[0], ended[3]), idle_s - 0.2,
                               "multifd connection %d was not drained: %s" % (i, conns))
            self.assertLess(ended[i], drain_s + 3.0, conns[i])

    @unittest.skipIf(TRANSPORT == "rdma", "a hostile peer speaking the flow protocol over TCP; the check is the same")
    def test_a_token_holder_cannot_make_the_target_dial_anything_but_a_handler_pod(self):
        # Whoever holds the agents' token (a controller pod, a reader of the Secret, root on a
        # node) speaks the flow protocol as a source agent would and asks the target agent to
        # dial a node-local service: loopback, the metadata address, an address no virt-handler
        # on the node owns. The agent dials none of them, from no namespace.
        import socket
        import struct

        send, recv = flow_send, flow_recv  # the flow protocol's framing, as a source agent speaks it

        local = socket.socket()  # a node-local service: must never see a connection
        local.bind(("0.0.0.0", 0))
        local.listen(8)
        local.settimeout(0.2)
        port = local.getsockname()[1]
        host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        token = self.dst.token
        # Another container of virt-handler's pod (same network namespace, not virt-handler)
        # listening on a port the migration never published.
        other = self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-b"], sys.executable, "-c",
                            "import socket,time; s=socket.socket(); s.bind(('0.0.0.0',0)); s.listen(8); "
                            "print(s.getsockname()[1], flush=True); time.sleep(600)"])
        sidecar_port = int(other.stdout.readline())
        targets = [(h, port) for h in ["127.0.0.1", "169.254.169.254", "::1", "0.0.0.0", "localhost"] + host_ip[:1]]
        targets.append((self.net.ip4["node-b"], sidecar_port))
        try:
            for i, (host, dport) in enumerate(targets):
                session = os.urandom(16).hex()
                hello = flow_hello(session, os.urandom(16).hex(), "mig-evil-%d" % i)
                with socket.create_connection(("127.0.0.1", self.dst.data_port), timeout=10) as c:
                    send(c, hello)
                    ch = recv(c)
                    self.assertEqual(ch["type"], "challenge", ch)
                    self.assertIn(flow_proof(token, "target", hello, ch["nonce"]), ch["proofs"],
                                  "the target proves the token over this hello")
                    send(c, {"type": "auth", "mac": flow_proof(token, "source", hello, ch["nonce"])})
                    self.assertEqual(recv(c)["type"], "welcome", "the token holder is let in")
                    send(c, flow_sign(token, hello, ch["nonce"], 0,
                                      {"type": "open", "index": 0, "host": host, "port": dport}))
                    # As a live source agent does (flow protocol 4): signed heartbeats every 0.5 s,
                    # so the session ends on the refused open, not on a silent link.
                    beating = threading.Event()

                    def beat(c=c, nonce=ch["nonce"], hello=hello):
                        seq = 1
                        while not beating.wait(0.5):
                            try:
                                send(c, flow_sign(token, hello, nonce, seq, {"type": "heartbeat"}))
                            except OSError:
                                return
                            seq += 1
                    beater = threading.Thread(target=beat, daemon=True)
                    beater.start()
                    d, _, _ = flow_channel(self.dst.data_port, flow_channel_key(token, hello, ch["nonce"]), session, 0)
                    with d:  # welcomed: the channel proved the session's key
                        rec = wait_for(lambda: [r for r in self.records(self.dst, migrationUid="mig-evil-%d" % i)
                                                if r["phase"] == "Failed"], 15, "the session to fail (%s)" % host)[0]
                    beating.set()
                    beater.join(5)
                    self.assertTrue(any(w in rec["reason"] for w in ("open.host", "refusing to dial")), rec)
                try:
                    conn, peer = local.accept()
                    conn.close()
                    self.fail("the target agent dialled %s:%d on a peer's behalf (from %s)" % (host, dport, peer))
                except socket.timeout:
                    pass
            self.assertIn("does not listen on port %d" % sidecar_port, rec["reason"])
            # A destination changed in flight (a relay on the path, no token): the signed open no
            # longer matches and the session fails before anything is dialled.
            session = os.urandom(16).hex()
            hello = flow_hello(session, os.urandom(16).hex(), "mig-evil-relay")
            with socket.create_connection(("127.0.0.1", self.dst.data_port), timeout=10) as c:
                send(c, hello)
                ch = recv(c)
                send(c, {"type": "auth", "mac": flow_proof(token, "source", hello, ch["nonce"])})
                self.assertEqual(recv(c)["type"], "welcome")
                forged = flow_sign(token, hello, ch["nonce"], 0,
                                   {"type": "open", "index": 0, "host": self.net.ip4["node-b"], "port": self.sink_port})
                forged["port"] = port
                send(c, forged)
                rec = wait_for(lambda: [r for r in self.records(self.dst, migrationUid="mig-evil-relay")
                                        if r["phase"] == "Failed"], 15, "the session to fail (forged open)")[0]
                self.assertIn("MAC does not match", rec["reason"])
        finally:
            local.close()
        self.assertEqual(self.dst.request("GET", "/healthz", token=False)[0], 200)

    def target_session_id(self, mig):
        """The id of the target's session for `mig`: it travels in clear (the flow hello, every
        channel's hello), so a third party on the path has it; here from the target's log."""
        import re
        m = wait_for(lambda: re.search(r"target: session=([0-9a-f]{32}) migration %s " % re.escape(mig),
                                       self.dst.log_text()), 10, "the target session of %s" % mig)
        return m.group(1)

    @unittest.skipIf(TRANSPORT == "rdma", "TCP channels (the RDMA request's proof: tests/unit rdma_test, the VM rows)")
    def test_a_third_party_without_the_token_cannot_attach_take_budget_or_displace_a_channel(self):
        # Issue 38: the session id is in clear, and a flow-data hello naming it and an index was
        # welcomed from anywhere: the third party's bytes went into the VM's incoming stream, the
        # real source's channel 0 was refused already_exists, and each index took 32 MiB of budget.
        # The target's budget here fits the real session's two channels and nothing more.
        import socket
        token = self.src.token
        for a in self.agents:
            a.stop()
        self.dst = self.agent("node-b", token, peers=[], migration={"bufferBudget": "64Mi"})
        self.src = self.agent("node-a", token, peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}],
                              hook=self.hook_socket, migration={"chunkSize": "1Mi"}, extra={"ringDepth": 16})
        mig = "mig-third-party"
        res = self.dial(0, 0, vmi=vmi_json("vmi-uid-3p", mig, self.net.ip4["node-b"], self.sink_port))
        self.assertTrue(res["hook"]["ok"], res["hook"])  # armed: the session is live, no channel yet
        session = self.target_session_id(mig)
        auth_errors = ("rdmig_transport_errors_total", frozenset({("transport", "tcp"), ("kind", "auth")}))
        held = []
        try:
            for index in range(17):
                c = socket.socket()
                c.bind(("127.0.0.3", 0))  # another address than the source agent's
                c.settimeout(10)
                c.connect(("127.0.0.1", self.dst.data_port))
                held.append(c)
                flow_send(c, {"kind": "flow-data", "protocol": FLOW_PROTOCOL, "session": session, "index": index,
                              "nonce": os.urandom(16).hex()})
                ch = flow_recv(c)
                self.assertEqual(ch["type"], "challenge", "channel %d: welcomed without a proof: %s" % (index, ch))
                # Without the token, the key is a guess.
                flow_send(c, {"type": "auth", "proof": os.urandom(32).hex()})
                r = flow_recv(c)
                self.assertEqual((r["type"], r.get("code")), ("reject", "permission_denied"), r)
                self.assertIn("auth.proof", r["message"])
            wait_for(lambda: parse_prometheus(self.dst.metrics())[0].get(auth_errors) == 17.0, 5,
                     "every refused channel counted (rdmig_transport_errors_total{kind=auth})")
            self.assertEqual([r["connections"] for r in self.records(self.dst, migrationUid=mig)], [0],
                             "no refused channel became a leg")
            # The real source's channels attach (indices 0 and 1: nothing took them), fit the budget
            # (nothing of it was taken) and carry byte-exact (the sink's digests).
            res = self.dial(2, 1 << 20, hook=False)
            self.assertTrue(all(c["ok"] for c in res["connections"]), res["connections"])
        finally:
            for c in held:
                c.close()
        dst = wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] == "Succeeded"],
                       20, "the target record to end")[0]
        self.assertEqual(dst["connections"], 2)
        src = [r for r in self.records(self.src, migrationUid=mig)][0]
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])
        self.assertGreaterEqual(src["bytesSent"], 2 * (1 << 20))

    @unittest.skipIf(TRANSPORT == "rdma", "TCP channels (the RDMA request's proof: tests/unit rdma_test, the VM rows)")
    def test_a_replayed_channel_proof_is_refused(self):
        # What an observer of one channel's exchange saw (hello nonce, proof) is worth nothing on
        # another connection: the target's nonce is fresh on each.
        token = self.dst.token
        hello = flow_hello(os.urandom(16).hex(), os.urandom(16).hex(), "mig-replay")
        c, nonce, reply = self.flow_handshake(hello, token, host="127.0.0.1")
        self.assertEqual(reply["type"], "welcome", reply)
        key = flow_channel_key(token, hello, nonce)
        d0, _, first = flow_channel(self.dst.data_port, key, hello["session"], 0)
        self.addCleanup(d0.close)
        self.assertEqual(first["type"], "welcome", first)
        for index in (0, 1):  # the index it proved, and a free one
            d, _, again = flow_channel(self.dst.data_port, key, hello["session"], index, proof=first["sent"],
                                       nonce=first["nonce"])
            d.close()
            self.assertEqual((again["type"], again.get("code")), ("reject", "permission_denied"), again)
            self.assertIn("auth.proof", again["message"], "refused for its proof, not for a taken index")
        # The key holder's own next channel still attaches.
        d1, _, ok = flow_channel(self.dst.data_port, key, hello["session"], 1)
        self.addCleanup(d1.close)
        self.assertEqual(ok["type"], "welcome", ok)

    @unittest.skipIf(TRANSPORT == "rdma", "ss -K resets TCP channels (an RDMA rail cut: tests/rdma)")
    def test_data_channels_reset_mid_stream_fail_over_and_the_flow_succeeds(self):
        # dataPlane.failover on both agents (docs/failover.md): each carried connection's channel
        # between the agents is reset again and again while it carries (ss -K, as a middlebox that
        # drops the connection's state), both directions (the sink's digest comes back on the
        # return path). The source re-dials each one with a proved resume hello, both agents
        # resume where each direction stopped, and the proxies' connections never see it: every
        # connection arrives byte-exact (the sink's digests) and the flow succeeds. Before, the
        # first reset failed the flow and reset the connections.
        from rdmiglab import linkcut
        token = self.src.token
        for a in self.agents:
            a.stop()
        fo = {"failover": "on"}
        self.dst = self.agent("node-b", token, peers=[], data_plane=fo)
        self.src = self.agent("node-a", token, peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}],
                              hook=self.hook_socket, data_plane=fo)
        mig = "mig-failover"
        vmi = vmi_json("vmi-uid-fo", mig, self.net.ip4["node-b"], self.sink_port)
        p = self.dial(3, 128 << 20, vmi=vmi, wait=False, extra=("--timeout", "60"))
        cuts, deadline = 0, time.monotonic() + 150
        while p.poll() is None and time.monotonic() < deadline:
            # Only channels that carried 4 MiB since their last (re)connection: never the control
            # link (a few KiB), and a resumed channel carries on before it is cut again.
            cuts += linkcut.cut_data_channels(self.dst.data_port, min_bytes=4 << 20)
            time.sleep(0.05)  # the poll's pace, not a wait for anything
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        res = json.loads(out)
        print("\n[relay] %d channel reset(s) during the flow" % cuts, file=sys.stderr)
        self.assertGreaterEqual(cuts, 1, "no channel was reset mid-stream: the test proves nothing")
        self.assertTrue(all(c["ok"] for c in res["connections"]), res["connections"])
        src = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] in ("Succeeded", "Failed")],
                       20, "the source record to end")[0]
        dst = wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] in ("Succeeded", "Failed")],
                       20, "the target record to end")[0]
        self.assertEqual((src["phase"], dst["phase"]), ("Succeeded", "Succeeded"), (src, dst))
        print("[relay] source failover: %s; target: %s" % (src["failover"], dst["failover"]), file=sys.stderr)
        self.assertTrue(src["failover"]["enabled"] and dst["failover"]["enabled"], (src, dst))
        self.assertGreaterEqual(src["failover"]["failovers"], 1, src)
        self.assertGreaterEqual(dst["failover"]["failovers"], 1, dst)
        self.assertIn("resumed on tcp 127.0.0.1:%d" % self.dst.data_port, src["failover"]["last"])
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])
        self.assertGreaterEqual(src["bytesSent"], 3 * (128 << 20))
        for agent, role in ((self.src, "source"), (self.dst, "target")):
            m = parse_prometheus(agent.metrics())[0]
            n = sum(v for (name, labels), v in m.items()
                    if name == "rdmig_failovers_total" and ("role", role) in labels and ("transport", "tcp") in labels)
            self.assertGreaterEqual(n, 1, "%s: rdmig_failovers_total" % role)

    @unittest.skipIf(TRANSPORT == "rdma", "TCP channels (the VM rows carry RDMA)")
    def test_a_resume_without_the_key_or_for_a_channel_that_does_not_fail_over_is_refused_and_displaces_nothing(self):
        # A flow-data hello marked resume takes over a live channel: only the session's key
        # holder may send one, and only for a live channel of a session that fails over.
        import select
        token = self.src.token
        for a in self.agents:
            a.stop()
        self.dst = self.agent("node-b", token, peers=[], data_plane={"failover": "on"})
        port = self.dst.data_port

        def session(failover, mig):
            hello = flow_hello(os.urandom(16).hex(), os.urandom(16).hex(), mig, **({"failover": True} if failover else {}))
            c, nonce, reply = self.flow_handshake(hello, token, host="127.0.0.1")
            self.assertEqual(reply["type"], "welcome", reply)
            self.assertEqual(reply.get("failover", False), failover, reply)
            key = flow_channel_key(token, hello, nonce)
            d0, _, first = flow_channel(port, key, hello["session"], 0)
            self.addCleanup(d0.close)
            self.assertEqual(first["type"], "welcome", first)
            return hello["session"], key, d0

        def still_open(sock):
            # Displaced, the channel's connection is closed by the target within its watch (100 ms);
            # what the channel itself sent (its credits) is read and dropped.
            readable, _, _ = select.select([sock], [], [], 0.5)
            if not readable:
                return True
            sock.setblocking(False)
            try:
                while sock.recv(1 << 16):
                    pass
                return False  # the end of the stream
            except BlockingIOError:
                return True  # nothing more yet
            except ConnectionResetError:
                return False
            finally:
                sock.settimeout(10)

        plain, plain_key, plain0 = session(False, "mig-resume-plain")
        fo, fo_key, fo0 = session(True, "mig-resume-fo")
        refusals = [
            # Without the key (a third party knows the session id: it travels in clear).
            (fo, fo_key, 0, os.urandom(32).hex(), "auth.proof"),
            # The key holder, for a session that does not fail over.
            (plain, plain_key, 0, None, "does not fail channel 0 over"),
            # The key holder, for an index that is not live in the session.
            (fo, fo_key, 5, None, "channel 5 of session %s is not live here" % fo),
        ]
        for sid, key, index, proof, why in refusals:
            d, _, r = flow_channel(port, key, sid, index, proof=proof, resume=True)
            d.close()
            self.assertEqual((r["type"], r.get("code")), ("reject", "permission_denied"), r)
            self.assertIn(why, r["message"])
        self.assertTrue(still_open(plain0), "a refused resume displaced the channel of a session without failover")
        self.assertTrue(still_open(fo0), "a refused resume displaced the channel of a session with failover")
        for rec in self.records(self.dst):
            self.assertNotEqual(rec["phase"], "Failed", rec)
            self.assertEqual(rec["failover"]["failovers"], 0, rec)
        # The control: the key holder's resume of the live channel is admitted, and the channel
        # gives its connection up for it at once.
        d, _, r = flow_channel(port, fo_key, fo, 0, resume=True)
        self.addCleanup(d.close)
        self.assertEqual(r["type"], "welcome", r)
        wait_for(lambda: not still_open(fo0), 5, "the re-dialled channel to give up its old connection")

    @unittest.skipIf(TRANSPORT == "rdma", "the VM's agents require RDMA there, which leaves failover off")
    def test_the_control_link_reset_mid_flow_fails_over_and_the_flow_succeeds_byte_exact(self):
        # dataPlane.failover on both agents (docs/failover.md): the session's control link (signed
        # messages, heartbeats both ways) is reset again and again while the flow carries (ss -K, as
        # a middlebox that drops the connection's state). The source re-dials it with a proved
        # resume hello over the control link's own index, both agents resend what the other did not
        # receive (the signers' sequences go on: a repeat or a gap would fail the session), and the
        # proxies' connections never see it: every connection arrives byte-exact and the flow
        # succeeds, the failovers counted. Before, the first reset failed the flow.
        from rdmiglab import linkcut
        token = self.src.token
        for a in self.agents:
            a.stop()
        fo = {"failover": "on"}
        self.dst = self.agent("node-b", token, peers=[], data_plane=fo)
        self.src = self.agent("node-a", token, peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}],
                              hook=self.hook_socket, data_plane=fo)
        mig = "mig-ctl-failover"
        vmi = vmi_json("vmi-uid-ctl-fo", mig, self.net.ip4["node-b"], self.sink_port)
        p = self.dial(3, 96 << 20, vmi=vmi, wait=False, extra=("--timeout", "60"))
        cuts, last_cut, deadline = 0, 0.0, time.monotonic() + 150
        while p.poll() is None and time.monotonic() < deadline:
            # Only while the three data channels carry (each past 1 MiB), so that the one connection
            # to the data port under 64 KiB is the control link (heartbeats: a few KiB); one cut
            # every 0.3 s, each on the link the last failover re-dialled.
            if time.monotonic() - last_cut >= 0.3 and len(linkcut.data_connections(self.dst.data_port, 1 << 20)) == 3:
                n = linkcut.cut_control_connection(self.dst.data_port)
                cuts += n
                if n:
                    last_cut = time.monotonic()
            time.sleep(0.05)  # the poll's pace, not a wait for anything
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        res = json.loads(out)
        print("\n[relay] %d control link reset(s) during the flow" % cuts, file=sys.stderr)
        self.assertGreaterEqual(cuts, 1, "the control link was not reset mid-flow: the test proves nothing")
        self.assertTrue(all(c["ok"] for c in res["connections"]), res["connections"])
        src = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] in ("Succeeded", "Failed")],
                       20, "the source record to end")[0]
        dst = wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] in ("Succeeded", "Failed")],
                       20, "the target record to end")[0]
        self.assertEqual((src["phase"], dst["phase"]), ("Succeeded", "Succeeded"), (src, dst))
        print("[relay] source failover: %s; target: %s" % (src["failover"], dst["failover"]), file=sys.stderr)
        for rec in (src, dst):
            self.assertGreaterEqual(rec["failover"]["failovers"], 1, rec)
            self.assertTrue(rec["failover"]["last"].startswith("control connection: "), rec["failover"])
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])
        self.assertGreaterEqual(src["bytesSent"], 3 * (96 << 20))
        for agent, role in ((self.src, "source"), (self.dst, "target")):
            m = parse_prometheus(agent.metrics())[0]
            n = sum(v for (name, labels), v in m.items()
                    if name == "rdmig_failovers_total" and ("role", role) in labels and ("transport", "tcp") in labels)
            self.assertGreaterEqual(n, 1, "%s: rdmig_failovers_total" % role)
            # Only the control link was reset: no data channel failed over.
            self.assertNotIn(" failover: channel ", agent.log_text())

    @unittest.skipIf(TRANSPORT == "rdma", "TCP control links (the same on every transport)")
    def test_a_control_link_redial_without_the_key_or_not_admissible_is_refused_and_displaces_nothing(self):
        # A flow-data hello marked resume and control takes over a session's control link: only
        # the session's key holder may send one (its proof names the control link's own index, over
        # a fresh nonce of the target's: a replay is worth nothing), only for a session that fails
        # its control link over, and the live link is displaced by nothing else. The key holder's
        # re-dial is resumed exactly: the target resends from the count this end gives, with the
        # sequence numbers going on. The target's heartbeat timeout is long here: this test is the
        # source and sends none.
        token = self.src.token
        for a in self.agents:
            a.stop()
        self.dst = self.agent("node-b", token, peers=[], data_plane={"failover": "on"},
                              extra={"heartbeatTimeoutSeconds": 60})
        port = self.dst.data_port

        def session(failover, mig):
            hello = flow_hello(os.urandom(16).hex(), os.urandom(16).hex(), mig, **({"failover": True} if failover else {}))
            c, nonce, reply = self.flow_handshake(hello, token, host="127.0.0.1")
            self.assertEqual(reply["type"], "welcome", reply)
            self.assertEqual(reply.get("failover", False), failover, reply)
            self.assertEqual(reply.get("failoverControl", False), failover, reply)
            return hello["session"], flow_channel_key(token, hello, nonce), ControlReader(c)

        plain, plain_key, plain_link = session(False, "mig-ctl-plain")
        fo, fo_key, fo_link = session(True, "mig-ctl-fo")
        refusals = [
            # Without the key (a third party knows the session id: it travels in clear).
            (fo, fo_key, os.urandom(32).hex(), None, "permission_denied", "control link: auth.proof"),
            # The key holder, for a session that does not fail its control link over.
            (plain, plain_key, None, None, "permission_denied", "does not fail its control link over"),
            # A session the target does not have.
            (os.urandom(16).hex(), fo_key, None, None, "permission_denied", "unknown data-plane session"),
            # Not a control link's re-dial: with TLS (the control link runs none), or another index.
            (fo, fo_key, None, {"tls": True}, "invalid_argument", "hello.control"),
            (fo, fo_key, None, {"index": 3}, "invalid_argument", "hello.control"),
        ]
        for sid, key, proof, extra, code, why in refusals:
            d, _, r = flow_channel(port, key, sid, 0, proof=proof, control=True, extra=extra)
            d.close()
            self.assertEqual((r["type"], r.get("code")), ("reject", code), r)
            self.assertIn(why, r["message"])
        for link in (plain_link, fo_link):
            seen = len(link.seqs)
            self.assertTrue(link.more_than(seen), "a refused control re-dial displaced a live control link")
        for rec in self.records(self.dst):
            self.assertNotEqual(rec["phase"], "Failed", rec)
            self.assertEqual(rec["failover"]["failovers"], 0, rec)
        # The key holder's re-dial: admitted; the target gives its old connection up at once and
        # resumes on the new one from the count this end gives (what it read on the old one).
        d, _, r = flow_channel(port, fo_key, fo, 0, control=True)
        self.addCleanup(d.close)
        self.assertEqual(r["type"], "welcome", r)
        self.assertTrue(fo_link.closed.wait(5), "the re-dialled control link kept its old connection")
        read = len(fo_link.seqs)
        self.assertEqual(fo_link.seqs, list(range(read)), "the old connection's messages, in order")
        theirs = resume_as_dialler(d, fo_key, fo, CONTROL_INDEX, read)
        self.assertEqual(theirs, 0, "this end sent nothing signed on the link")
        again = ControlReader(d)
        self.assertTrue(again.more_than(1), "nothing on the resumed control link")
        self.assertEqual(again.seqs[:2], [read, read + 1], "the target resent from this end's count, exactly")
        rec = wait_for(lambda: [x for x in self.records(self.dst, migrationUid="mig-ctl-fo") if x["failover"]["failovers"]],
                       5, "the failover in the target's record")[0]
        self.assertEqual(rec["failover"]["failovers"], 1, rec)
        self.assertTrue(rec["failover"]["last"].startswith("control connection: "), rec)
        # What an observer of that re-dial saw (its nonce, its proof) is worth nothing again: the
        # target's nonce is fresh. The resumed link stays.
        d2, _, replay = flow_channel(port, fo_key, fo, 0, control=True, proof=r["sent"], nonce=r["nonce"])
        d2.close()
        self.assertEqual((replay["type"], replay.get("code")), ("reject", "permission_denied"), replay)
        self.assertIn("control link: auth.proof", replay["message"])
        seen = len(again.seqs)
        self.assertTrue(again.more_than(seen), "a replayed control re-dial displaced the resumed link")
        self.assertFalse(plain_link.closed.is_set())

    @unittest.skipIf(shutil.which("nft") is None, "needs the nft command to keep the re-dials out")
    @unittest.skipIf(TRANSPORT == "rdma", "the VM's agents require RDMA there, which leaves failover off")
    def test_a_control_link_down_past_the_failover_deadline_fails_the_flow_naming_it(self):
        # The control link reset (ss -K) while every re-dial to the target agent is dropped (its SYN,
        # by nftables): past dataPlane.failoverDeadlineSeconds (2 s here) both agents fail the flow
        # naming the lost control link and the deadline, and the source resets the main connection
        # (QEMU fails there; the VM stays on the source).
        self.control_link_down_past_the_deadline(2, 2)

    @unittest.skipIf(shutil.which("nft") is None, "needs the nft command to keep the re-dials out")
    @unittest.skipIf(TRANSPORT == "rdma", "the VM's agents require RDMA there, which leaves failover off")
    def test_a_control_link_down_when_the_target_gives_up_first_the_source_names_its_failover_and_the_abort(self):
        # The same with the target's deadline 1 s and the source's 3 s: the target gives up first and
        # aborts over the data channels while the source still re-dials. The source's reason names
        # its own failover under way (ControlLink::recovery_state) and then the target's abort, not
        # only the target's view ("no re-dial ... arrived") of a link the source was re-dialling.
        self.control_link_down_past_the_deadline(3, 1)

    def control_link_down_past_the_deadline(self, src_deadline, dst_deadline):
        from rdmiglab import linkcut
        token = self.src.token
        for a in self.agents:
            a.stop()
        self.dst = self.agent("node-b", token, peers=[],
                              data_plane={"failover": "on", "failoverDeadlineSeconds": dst_deadline})
        self.src = self.agent("node-a", token, peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}],
                              hook=self.hook_socket,
                              data_plane={"failover": "on", "failoverDeadlineSeconds": src_deadline})
        mig = "mig-ctl-down"
        vmi = vmi_json("vmi-uid-ctl-down", mig, self.net.ip4["node-b"], self.sink_port)
        p = self.dial(3, 1 << 20, vmi=vmi, hold=45, wait=False)
        wait_for(lambda: any(r["connections"] == 3 for r in self.records(self.src, migrationUid=mig)), 20,
                 "three carried connections")
        wait_for(lambda: any(r["connections"] == 3 for r in self.records(self.dst, migrationUid=mig)), 20,
                 "three connections on the target")
        # Each data channel past its MiB, so that the one connection to the data port under 64 KiB
        # is the control link (cut_control_connection picks it so). Without this wait a channel
        # that had not carried yet was taken for it (seen once in a full run: the flow then failed
        # naming channel 1, not the control link).
        wait_for(lambda: len(linkcut.data_connections(self.dst.data_port, 1 << 20)) == 3, 20,
                 "the three data channels to carry their MiB")
        table = "rdmig_test_ctl_down"
        rules = ("table inet %s {\n  chain pre { type filter hook prerouting priority -300; policy accept;\n"
                 "    tcp dport %d tcp flags & (syn | ack) == syn drop\n  }\n}\n") % (table, self.dst.data_port)
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
        try:
            cut_at = time.time()
            self.assertEqual(wait_for(lambda: linkcut.cut_control_connection(self.dst.data_port), 10,
                                      "the control link to reset"), 1)
            out, err = p.communicate(timeout=90)
            src = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Failed"], 15,
                           "the source record to fail")[0]
            dst = wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] == "Failed"], 15,
                           "the target record to fail")[0]
        finally:
            subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
        main = json.loads(out)["connections"][0]
        print("\n[relay] control link down: main connection ended in %.2f s; source: %s; target: %s"
              % (main["ended_at"] - cut_at, src["reason"], dst["reason"]), file=sys.stderr)
        self.assertIn("control connection lost", src["reason"])
        self.assertIn("not back within %d ms" % (1000 * min(src_deadline, dst_deadline)), src["reason"])
        # The target's own deadline ends at the same moment: it names the link too, or the source's
        # abort that reached it first over a data channel.
        self.assertTrue("control connection lost" in dst["reason"] or "aborted" in dst["reason"], dst)
        for rec in (src, dst):
            self.assertEqual(rec["failover"]["failovers"], 0, rec)
        self.assertIn("node-b", src["reason"])
        # Both ends' deadlines run out at about the same moment. When the source's ends first its
        # reason names its own re-dials; when the target's ends first (its abort reaches the source
        # over a data channel while the source still re-dials; seen in cold run P), the source's
        # reason names its failover under way, then the target's abort.
        if dst_deadline < src_deadline or "failing over for" in src["reason"]:
            self.assertRegex(src["reason"], r"control connection lost \(.*\), failing over for \d+ ms \(.*\); "
                                            r"meanwhile .*peer aborted.*not back within %d ms" % (1000 * dst_deadline))
        else:
            self.assertIn("control link re-dialled to 127.0.0.1:%d" % self.dst.data_port, src["reason"])
        self.assertIn(main["error"], RESET_ENDS, main)
        # The deadline, then a heartbeat turn: not the 30 s TCP would take, nor the flow's hold.
        self.assertLess(main["ended_at"] - cut_at, 6.0, main)
        self.assertLess(src["finishedAtMs"] / 1000.0 - cut_at, 6.0, src)

    def test_a_session_for_another_target_node_is_refused_naming_the_field(self):
        token = self.dst.token
        hello = flow_hello(os.urandom(16).hex(), os.urandom(16).hex(), "mig-elsewhere", targetNode="node-c")
        _, _, reply = self.flow_handshake(hello, token, host="127.0.0.1")
        self.assertEqual((reply["type"], reply.get("code")), ("reject", "failed_precondition"), reply)
        self.assertIn("hello.targetNode", reply["message"])
        self.assertIn("names node 'node-c', this agent runs on 'node-b'", self.dst.log_text())
        self.assertEqual(self.records(self.dst, migrationUid="mig-elsewhere"), [])

    @same_on_every_transport
    def test_a_source_agent_that_sees_the_new_token_first_proves_the_previous_one(self):
        # Token rotation: the source agent's Secret volume changed first; the target agent still
        # has only the old token. The source's proof with the new one is refused, and it proves
        # the previous one (within api.tokenGraceSeconds) instead of leaving the migration to
        # KubeVirt's own path (before: NotCarried, "refused the session").
        new = "tok-new-" + os.urandom(16).hex()
        with open(self.src.token_file + ".new", "w") as f:
            f.write(new + "\n")
        os.rename(self.src.token_file + ".new", self.src.token_file)
        time.sleep(1.2)  # an agent looks at its token file at most once a second
        mig = "mig-rotated"
        res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-r", mig, self.net.ip4["node-b"], self.sink_port))
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] != "Armed"], 20,
                       "the source record")[0]
        self.assertTrue(rec["carried"], rec)

    @same_on_every_transport
    def test_a_hello_flood_from_one_address_leaves_room_for_real_peers(self):
        # 64 connections that never say hello, from one address (a pod on the node's network),
        # used to take every pending-hello slot of the target agent for 5 s at a time, and every
        # real migration towards it went KubeVirt's own way. Now one address gets 16 at most.
        import socket
        flood = []
        try:
            for _ in range(64):
                c = socket.socket()
                c.bind(("127.0.0.3", 0))
                c.connect(("127.0.0.1", self.dst.data_port))
                flood.append(c)
            time.sleep(0.3)  # the target accepted them all (or dropped those over the limit)
            mig = "mig-flooded"
            res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-fl", mig, self.net.ip4["node-b"], self.sink_port))
            self.assertTrue(all(c["ok"] for c in res["connections"]), res)
            rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] != "Armed"], 20,
                           "the source record")[0]
            self.assertTrue(rec["carried"], rec)
        finally:
            for c in flood:
                c.close()

    def test_flows_are_admitted_against_the_targets_buffer_budget(self):
        # The source chooses the session's chunkSize (migration.chunkSize) and ring depth
        # (kubevirt.ringDepth); the target admits what it pins against its own
        # migration.bufferBudget, as a bare-QEMU job is admitted (before: a source with
        # 64 MiB x 16 chunks made the target allocate 2 GiB per channel).
        token = self.src.token
        for a in self.agents:
            a.stop()
        self.dst = Agent(self.tmp, name="node-b-budget", token=token, config={
            "migration": {"bufferBudget": "1Gi"},
            "kubevirt": {"enabled": True, "nodeName": "node-b", "hookSocket": "", "peers": [],
                         "ruleTimeoutSeconds": 3, "sessionIdleSeconds": 1}})
        self.agents.append(self.dst)
        peers = [{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}]
        # One channel can never fit: the session is refused and KubeVirt's own path carries it.
        self.src = Agent(self.tmp, name="node-a-huge", token=token, config={
            "migration": {"chunkSize": "64Mi", "bufferBudget": "64Gi"},
            "kubevirt": {"enabled": True, "nodeName": "node-a", "hookSocket": self.hook_socket, "peers": peers,
                         "ringDepth": 16, "ruleTimeoutSeconds": 3, "sessionIdleSeconds": 1}})
        self.agents.append(self.src)
        res = self.dial(2, 65536, vmi=vmi_json("vmi-uid-bb", "mig-huge", self.net.ip4["node-b"], self.sink_port))
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        rec = self.records(self.src, migrationUid="mig-huge")[0]
        self.assertFalse(rec["carried"], rec)
        self.assertIn("migration.bufferBudget", rec["reason"])
        self.assertEqual(self.records(self.dst, migrationUid="mig-huge"), [], "nothing was pinned on the target")
        # 256 MiB per channel (16 MiB x 16 x 2): four fit in the target's 1 GiB, the fifth is refused
        # and fails the session (the connections are reset: KubeVirt's migration fails, the VM stays).
        self.src.stop()
        self.src = Agent(self.tmp, name="node-a-big", token=token, config={
            "migration": {"chunkSize": "16Mi", "bufferBudget": "64Gi"},
            "kubevirt": {"enabled": True, "nodeName": "node-a", "hookSocket": self.hook_socket, "peers": peers,
                         "ringDepth": 16, "ruleTimeoutSeconds": 3, "sessionIdleSeconds": 1}})
        self.agents.append(self.src)
        res = self.dial(5, 65536, vmi=vmi_json("vmi-uid-bb", "mig-big", self.net.ip4["node-b"], self.sink_port))
        self.assertFalse(all(c["ok"] for c in res["connections"]), res)
        rec = wait_for(lambda: [r for r in self.records(self.dst, migrationUid="mig-big") if r["phase"] == "Failed"],
                       20, "the target session to fail")[0]
        self.assertIn("migration.bufferBudget", rec["reason"])
        self.assertLessEqual(self.dst.rss_kib(), 1536 * 1024, "the target pinned more than its budget")

    @unittest.skipIf(TRANSPORT == "rdma", "dataPlane.tls is TCP only (RDMA channels are not encrypted)")
    def test_dataplane_tls_carries_flows_and_plaintext_migrations_are_carried_or_refused(self):
        token = self.src.token
        for a in self.agents:
            a.stop()
        self.dst = self.agent("node-b", token, peers=[], data_plane={"tls": "on"})
        peers = [{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}]
        self.src = self.agent("node-a", token, peers=peers, hook=self.hook_socket, data_plane={"tls": "on"})
        dest = (self.net.ip4["node-b"], self.sink_port)

        def ended(agent, mig, phase="Succeeded"):
            return wait_for(lambda: [r for r in self.records(agent, migrationUid=mig) if r["phase"] == phase], 20,
                            "the %s record of %s to end %s" % (agent.name, mig, phase))[0]

        def metric(agent, name, labels):
            return parse_prometheus(agent.metrics())[0].get((name, frozenset(labels.items())))

        # KubeVirt's TLS on (its records start 0x16 0x03): carried, TLS between the agents, byte-exact.
        res = self.dial(3, 1 << 20, vmi=vmi_json("vmi-uid-t1", "mig-tls-on", *dest), extra=["--tls-head"])
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        src, dst = ended(self.src, "mig-tls-on"), ended(self.dst, "mig-tls-on")
        self.assertEqual(src["encryption"], "tls (user space)")  # no kernel TLS on this host
        self.assertEqual(dst["encryption"], "tls (user space)")
        self.assertEqual(src["kubevirtTls"], "on")
        self.assertIsNone(src["plaintext"])
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])
        for a in (self.src, self.dst):
            self.assertEqual(metric(a, "rdmig_tls_channels_total", {"mode": "user_space"}), 3.0)
        # KubeVirt's TLS off (QEMU's stream in clear): carried (kubevirt.plaintextMigrations: carry),
        # warned naming the VMI, counted, and the record says so; the agents' TLS still covers it.
        res = self.dial(3, 1 << 20, vmi=vmi_json("vmi-uid-t2", "mig-tls-off", *dest), extra=["--magic"])
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        src = ended(self.src, "mig-tls-off")
        self.assertEqual((src["kubevirtTls"], src["plaintext"], src["encryption"]), ("off", "carried", "tls (user space)"))
        # Counted when the session is done with (the relay's sweep), soon after the record ends.
        wait_for(lambda: metric(self.src, "rdmig_kubevirt_plaintext_migrations_total", {"action": "carried"}) == 1.0,
                 10, "the carried plaintext migration to be counted")
        self.assertEqual(metric(self.src, "rdmig_kubevirt_plaintext_migrations_total", {"action": "refused"}), 0.0)
        self.assertIn("migration of prod/web-1 is in clear", self.src.log_text())
        # refuse: no byte of a plaintext migration leaves the node; the migration fails (the VM stays).
        self.src.stop()
        self.src = self.agent("node-a", token, peers=peers, hook=self.hook_socket, data_plane={"tls": "on"},
                              extra={"plaintextMigrations": "refuse"})
        res = self.dial(3, 1 << 20, vmi=vmi_json("vmi-uid-t3", "mig-refused", *dest), extra=["--magic"])
        # The main connection is refused. Connections dialled after the session failed may find the
        # redirect gone and reach the destination as without rdmig (KubeVirt's own path; seen once
        # in a suite run): none of them crossed the agents (the byte counts below).
        self.assertFalse(res["connections"][0]["ok"], res)
        src = ended(self.src, "mig-refused", "Failed")
        self.assertIn("kubevirt.plaintextMigrations is refuse", src["reason"])
        self.assertEqual((src["kubevirtTls"], src["plaintext"]), ("off", "refused"))
        wait_for(lambda: metric(self.src, "rdmig_kubevirt_plaintext_migrations_total", {"action": "refused"}) == 1.0,
                 10, "the refused plaintext migration to be counted")
        self.assertEqual(src["bytesSent"], 0, "a refused migration's bytes left the node")
        self.assertEqual([r["bytesReceived"] for r in self.records(self.dst, migrationUid="mig-refused")
                          if r["bytesReceived"]], [], "the target agent received bytes of a refused migration")
        # One agent on, the other off: refused naming the key, never carried in clear.
        self.src.stop()
        self.src = self.agent("node-a", token, peers=peers, hook=self.hook_socket)
        res = self.dial(2, 65536, vmi=vmi_json("vmi-uid-t4", "mig-tls-mix", *dest), extra=["--tls-head"])
        # The first connection fails with the session (what comes after a failed session is not
        # carried: it reaches the destination as without rdmig).
        self.assertFalse(res["connections"][0]["ok"], res)
        src = ended(self.src, "mig-tls-mix", "Failed")
        self.assertIn("dataPlane.tls mismatch", src["reason"])
        self.assertIn("dataPlane.tls mismatch", self.dst.log_text())

    @same_on_every_transport
    def test_concurrent_hook_calls_for_one_migration_make_one_session(self):
        # virt-handler may call again while the first call still arms (a retry of the same
        # attempt): one session to the target agent, never an orphan that outlives the migration.
        import socket
        import threading
        # The race needs the first call to still be arming when the others come: put the target
        # agent behind a relay that delays its answers (a peer across a slow or busy link).
        relay = socket.socket()
        relay.bind(("127.0.0.1", 0))
        relay.listen(16)
        stop = threading.Event()

        def pipe(a, b, delay):
            try:
                while True:
                    data = a.recv(1 << 16)
                    if not data:
                        break
                    time.sleep(delay)
                    b.sendall(data)
            except OSError:
                pass
            for x in (a, b):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        def serve():
            relay.settimeout(0.2)
            while not stop.is_set():
                try:
                    c, _ = relay.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return  # closed at the end of the test
                d = socket.create_connection(("127.0.0.1", self.dst.data_port))
                threading.Thread(target=pipe, args=(c, d, 0.0), daemon=True).start()
                threading.Thread(target=pipe, args=(d, c, 0.15), daemon=True).start()
        threading.Thread(target=serve, daemon=True).start()
        self.addCleanup(relay.close)
        self.addCleanup(stop.set)  # cleanups run last first: stop, then close
        token = self.src.token
        self.src.stop()
        self.src = self.agent("node-a", token, hook=self.hook_socket,
                              peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % relay.getsockname()[1]}])
        mig = "mig-concurrent"
        vmi = vmi_json("vmi-uid-c", mig, self.net.ip4["node-b"], self.sink_port)
        path = os.path.join(self.tmp, "vmi-%s.json" % self._testMethodName)
        with open(path, "w") as f:
            json.dump(vmi, f)
        code = (AS_HANDLER + "import sys,json,threading; sys.path.insert(0,%r); from rdmiglab import kvhook; "
                "data=open(%r).read(); out=[None]*6\n"
                "def call(i): out[i]=kvhook.call_node_hook(%r,'PreMigrationSource',data,'node-a',timeout=10)\n"
                "ts=[threading.Thread(target=call,args=(i,)) for i in range(6)]\n"
                "[t.start() for t in ts]; [t.join() for t in ts]; print(json.dumps(out))")
        p = subprocess.run([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, "-c",
                            code % (os.path.join(HERE, "..", "..", "tools"), path, self.hook_socket)],
                           capture_output=True, text=True, timeout=60)
        calls = json.loads(p.stdout)
        self.assertTrue(all(c["ok"] for c in calls), calls)
        res = self.dial(2, 1 << 20, hook=False)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Succeeded"], 20,
                 "the carried migration")
        self.assertEqual(len(self.records(self.src, migrationUid=mig)), 1, self.records(self.src, migrationUid=mig))
        self.assertEqual(len(self.records(self.dst, migrationUid=mig)), 1,
                         "the target agent saw more than one session: %s" % self.records(self.dst, migrationUid=mig))

    def slow_nft_env(self, match, seconds):
        """Environment for an agent whose libnftables calls containing `match` take `seconds`
        more (tests/kubevirt/nft_delay_shim.cpp, preloaded) while the returned flag file exists."""
        shim = os.environ.get("RDMIG_KV_NFT_SHIM") or os.path.join(
            HERE, "..", "..", "build", "tests", "kubevirt", "librdmig_nft_delay_shim.so")
        if not os.path.exists(shim):
            self.skipTest("the nftables delay shim is not built (%s)" % shim)
        flag = os.path.join(self.tmp, "nft-slow-" + self._testMethodName)
        self.addCleanup(lambda: [os.remove(f) for f in (flag, flag + ".held") if os.path.exists(f)])
        return flag, {"LD_PRELOAD": os.path.abspath(shim), "RDMIG_TEST_NFT_SLOW_MATCH": match,
                      "RDMIG_TEST_NFT_SLOW_SECONDS": str(seconds), "RDMIG_TEST_NFT_SLOW_FILE": flag}

    @same_on_every_transport
    def test_an_ended_sessions_clean_up_never_removes_the_redirect_a_newer_migration_armed(self):
        # Two migrations to the same address and port, one after the other (as a suite run's
        # case does; a target proxy's port can come round again). When the first session ends the
        # maintenance loop removes its nftables element; made slow here (2 s, only that removal),
        # while the second migration's hook call arms the same element. Before the fix the
        # removal ran after the arm: the second migration's connections, dialled once it had run,
        # went straight to the destination and its session waited for them (seen in cold run P:
        # test_dataplane_tls_... "record of mig-tls-off to end Succeeded: not within 20s").
        ip, port = self.net.ip4["node-b"], self.sink_port
        removal = "add element inet rdmig carry4 { %s . %d }\ndelete element inet rdmig carry4 { %s . %d }\n" % (
            ip, port, ip, port)
        flag, env = self.slow_nft_env(removal, 2)
        env["RDMIG_TEST_NFT_SLOW_WHOLE"] = "1"
        token = self.src.token
        self.src.stop()
        # ruleTimeoutSeconds 60: the refresh (every 20 s) does not put a removed element back
        # between the removal and the dial below.
        self.src = self.agent("node-a", token, hook=self.hook_socket, env=env, rule_timeout=60,
                              peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}])
        open(flag, "w").close()
        res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-re1", "mig-reuse-1", ip, port))
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        wait_for(lambda: os.path.exists(flag + ".held"), 20, "the first session's element removal (held)")
        path = os.path.join(self.tmp, "vmi-%s-2.json" % self._testMethodName)
        with open(path, "w") as f:
            json.dump(vmi_json("vmi-uid-re2", "mig-reuse-2", ip, port), f)
        code = (AS_HANDLER + "import sys,json; sys.path.insert(0,%r); from rdmiglab import kvhook; "
                "print(json.dumps(kvhook.call_node_hook(%r,'PreMigrationSource',open(%r).read(),'node-a',timeout=60)))"
                % (os.path.join(HERE, "..", "..", "tools"), self.hook_socket, path))
        hook = subprocess.run([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=90)
        self.assertEqual(hook.returncode, 0, hook.stderr)
        time.sleep(2.5)  # past the held removal
        res = self.dial(2, 1 << 20, hook=False)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid="mig-reuse-2")
                                if r["phase"] != "Armed" and r["connections"] == 2], 20,
                       "mig-reuse-2's connections to be carried (not straight to the destination)")[0]
        self.assertTrue(rec["carried"], rec)
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid="mig-reuse-2")
                                if r["phase"] == "Succeeded"], 20, "mig-reuse-2 to succeed")[0]
        self.assertGreaterEqual(rec["bytesSent"], 2 << 20, rec)

    @same_on_every_transport
    def test_rest_and_scrapes_answer_while_a_hook_call_arms_slowly(self):
        # Arming enters virt-handler's namespace and talks to nftables (the table, an element
        # per port), which can take seconds on a busy node. It once ran under the relay's lock,
        # so GET /v1/kubevirt/migrations (and interception, other hook calls, maintenance)
        # waited behind it: REST stalled over 10 s behind a hook during a link cut. Here every
        # nftables call of the agent takes 3 s more while the hook call arms.
        flag, env = self.slow_nft_env("inet rdmig", 3)
        token = self.src.token
        self.src.stop()
        self.src = self.agent("node-a", token, hook=self.hook_socket, env=env,
                              peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}])
        mig = "mig-slow-arm"
        path = os.path.join(self.tmp, "vmi-%s.json" % self._testMethodName)
        with open(path, "w") as f:
            json.dump(vmi_json("vmi-uid-sa", mig, self.net.ip4["node-b"], self.sink_port), f)
        open(flag, "w").close()
        code = (AS_HANDLER + "import sys,json; sys.path.insert(0,%r); from rdmiglab import kvhook; "
                "print(json.dumps(kvhook.call_node_hook(%r,'PreMigrationSource',open(%r).read(),'node-a',timeout=60)))"
                % (os.path.join(HERE, "..", "..", "tools"), self.hook_socket, path))
        hook = self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, "-c", code])
        wait_for(lambda: os.path.exists(flag + ".held"), 20, "the hook call to be arming in slow nftables")
        for what, token_ in (("/v1/kubevirt/migrations", True), ("/metrics", None)):
            t0 = time.monotonic()
            status, _ = self.src.request("GET", what, token=token_, timeout=60)
            took = time.monotonic() - t0
            self.assertEqual(status, 200, what)
            self.assertLess(took, 1.0, "GET %s waited %.1f s behind a hook call arming" % (what, took))
        self.assertIsNone(hook.poll(), "the hook call was still arming while REST answered")
        os.remove(flag)
        out, err = hook.communicate(timeout=60)
        self.assertTrue(json.loads(out)["ok"], err)
        res = self.dial(2, 1 << 20, hook=False)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Succeeded"], 20,
                 "the carried migration")

    def holds_netns(self, agent, node):
        """True when `agent` holds node's network namespace open through a file descriptor."""
        link = "net:[%d]" % os.stat(self.net.netns_path(node)).st_ino
        fds = "/proc/%d/fd" % agent.proc.pid
        held = False
        for fd in os.listdir(fds):
            try:
                held = held or os.readlink(os.path.join(fds, fd)) == link
            except OSError:
                pass  # closed meanwhile
        return held

    @same_on_every_transport
    def test_an_interception_point_goes_when_its_virt_handler_does(self):
        # virt-handler restarts into a new pod (a new namespace) or its pod is deleted: the
        # agent once kept the old interception point for good, its table in that namespace and
        # the namespace itself open through its fd. Once nothing is armed there, it goes; while
        # virt-handler lives it stays for the next migration.
        ready = os.path.join(self.tmp, "handler-%s.json" % self._testMethodName)
        handler = self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "sink",
                              "--ready", ready, "--log", os.path.join(self.tmp, "handler-%s.log" % self._testMethodName)])
        wait_for(lambda: os.path.exists(ready), 10, "the source virt-handler")
        for i, mig in enumerate(("mig-prune-1", "mig-prune-2")):
            res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-p", mig, self.net.ip4["node-b"], self.sink_port))
            self.assertTrue(res["hook"]["ok"] and all(c["ok"] for c in res["connections"]), res)
            wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Succeeded"], 20,
                     "the carried migration " + mig)
            if i == 0:
                # Nothing armed any more, virt-handler alive: a few maintenance turns (one a
                # second) leave the point in place.
                time.sleep(2.5)
                self.assertIn("table inet rdmig", self.nft("node-a"))
                self.assertTrue(self.holds_netns(self.src, "node-a"))
                handler.kill()
                handler.wait()
                wait_for(lambda: "table inet rdmig" not in self.nft("node-a"), 10, "the stale point's table to go")
                wait_for(lambda: not self.holds_netns(self.src, "node-a"), 10,
                         "the agent to let go of the old namespace")
        self.assertIn("no virt-handler lives in", self.src.log_text())

    @same_on_every_transport
    def test_a_stale_points_slow_removal_holds_up_no_other_namespace(self):
        # virt-handler restarts into a new pod: the old namespace's point goes (its table removed
        # through nftables, which can take seconds), while the first migration after the restart
        # needs a point in the new namespace. Before, making a point and pruning took one
        # agent-wide lock: that hook call waited for the removal in the dead namespace.
        flag, env = self.slow_nft_env("table inet rdmig\ndelete table inet rdmig\n", 6)
        env["RDMIG_TEST_NFT_SLOW_WHOLE"] = "1"  # the removal only, not the install (which starts with it)
        token = self.src.token
        self.src.stop()
        self.src = self.agent("node-a", token, hook=self.hook_socket, env=env,
                              peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}])
        ready = os.path.join(self.tmp, "handler-%s.json" % self._testMethodName)
        handler = self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "sink",
                              "--ready", ready, "--log", os.path.join(self.tmp, "handler-%s.log" % self._testMethodName)])
        wait_for(lambda: os.path.exists(ready), 10, "the old virt-handler")
        res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-sr", "mig-old-ns", self.net.ip4["node-b"], self.sink_port))
        self.assertTrue(res["hook"]["ok"] and all(c["ok"] for c in res["connections"]), res)
        wait_for(lambda: [r for r in self.records(self.src, migrationUid="mig-old-ns") if r["phase"] == "Succeeded"],
                 20, "the carried migration in the old namespace")
        # The new virt-handler's pod: a namespace of its own on this node.
        new_pod = kvnet.HandlerNetwork(["node-a-new", "unused"]).setup()
        self.addCleanup(new_pod.close)
        open(flag, "w").close()
        handler.kill()
        handler.wait()
        wait_for(lambda: os.path.exists(flag + ".held"), 20, "the old point's table removal to be held in nftables")
        path = os.path.join(self.tmp, "vmi-%s-new.json" % self._testMethodName)
        with open(path, "w") as f:
            json.dump(vmi_json("vmi-uid-sr", "mig-new-ns", self.net.ip4["node-b"], self.sink_port), f)
        code = (AS_HANDLER + "import sys,json,time; sys.path.insert(0,%r); from rdmiglab import kvhook; t=time.monotonic(); "
                "r=kvhook.call_node_hook(%r,'PreMigrationSource',open(%r).read(),'node-a',timeout=30); "
                "r['took']=time.monotonic()-t; print(json.dumps(r))"
                % (os.path.join(HERE, "..", "..", "tools"), self.hook_socket, path))
        p = subprocess.run([kvnet.IP, "netns", "exec", new_pod.netns["node-a-new"], sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=60)
        call = json.loads(p.stdout)
        self.assertTrue(call["ok"], (call, p.stderr))
        self.assertTrue(os.path.exists(flag), "the removal was still held during the call")
        self.assertLess(call["took"], 3.0, "the hook call in the new namespace waited %.1f s for the removal in the "
                        "old one" % call["took"])
        new_rules = subprocess.run([kvnet.IP, "netns", "exec", new_pod.netns["node-a-new"], "nft", "list", "table", "inet",
                                    "rdmig"], capture_output=True, text=True).stdout
        self.assertIn("%s . %d" % (self.net.ip4["node-b"], self.sink_port), new_rules, "armed in the new namespace")
        os.remove(flag)
        wait_for(lambda: "table inet rdmig" not in self.nft("node-a"), 20, "the old namespace's table to go")
        self.assertEqual(self.src.request("GET", "/healthz", token=False)[0], 200)

    @same_on_every_transport
    @same_on_every_transport
    def test_a_draining_agent_finishes_its_carried_flow_and_leaves_new_migrations_to_kubevirt(self):
        # A carried migration in progress (its connections held open, as QEMU's are).
        mig = "mig-drain-running"
        vmi = vmi_json("vmi-uid-drain", mig, self.net.ip4["node-b"], self.sink_port)
        held = self.dial(2, 1 << 20, vmi=vmi, hold=8, wait=False)
        wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["carried"]], 10,
                 "the running migration to be carried")
        signalled = time.monotonic()
        self.src.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: self.src.request("GET", "/readyz")[0] == 503, 10, "readiness to turn false")
        # A migration that starts now is not carried: KubeVirt's own path moves it.
        mig2 = "mig-drain-new"
        res = self.dial(1, 65536, vmi=vmi_json("vmi-uid-drain2", mig2, self.net.ip4["node-b"], self.sink_port))
        self.assertTrue(res["hook"]["ok"], "the hook never fails KubeVirt's migration")
        self.assertTrue(res["connections"][0]["ok"], res["connections"])
        rec = self.records(self.src, migrationUid=mig2)[0]
        self.assertEqual((rec["carried"], rec["phase"]), (False, "NotCarried"), rec)
        self.assertTrue(rec["reason"].startswith("agent draining: the rdmig agent on node-a is shutting down"), rec)
        m = parse_prometheus(self.src.metrics())[0]
        self.assertEqual(m.get(("rdmig_kubevirt_not_carried_total", frozenset({("reason", "draining")}))), 1.0)
        # The running one is not cut: its connections stay open until the dialler ends them.
        out, err = held.communicate(timeout=60)
        conns = json.loads(out)["connections"]
        self.assertEqual([c["error"] for c in conns], ["still open after 8s"] * 2,
                         "the drain must not reset a carried migration: %s" % conns)
        # Then nothing runs: the agent exits by itself, well before shutdownGraceSeconds (300).
        self.src.proc.wait(timeout=30)
        self.assertEqual(self.src.proc.returncode, 0)
        self.assertIn("drained: nothing runs any more", self.src.log_text())
        print("\n[kubevirt relay] drained: exited %.1fs after SIGTERM (carried connections held 8 s)"
              % (time.monotonic() - signalled), file=sys.stderr)

    @same_on_every_transport
    def test_a_draining_target_agent_finishes_its_session_and_declines_new_ones(self):
        mig = "mig-peer-drain-running"
        held = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-pd", mig, self.net.ip4["node-b"], self.sink_port),
                         hold=8, wait=False)
        wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig)], 10, "the target's session")
        self.dst.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: self.dst.request("GET", "/readyz")[0] == 503, 10, "the target's readiness to turn false")
        # A new migration: the target declines its session; KubeVirt's own path moves it, and the
        # target is not marked unhealthy for it (a decline is an answer).
        mig2 = "mig-peer-drain-new"
        res = self.dial(1, 65536, vmi=vmi_json("vmi-uid-pd2", mig2, self.net.ip4["node-b"], self.sink_port))
        self.assertTrue(res["hook"]["ok"])
        self.assertTrue(res["connections"][0]["ok"], res["connections"])
        rec = self.records(self.src, migrationUid=mig2)[0]
        self.assertFalse(rec["carried"], rec)
        self.assertTrue(rec["reason"].startswith("the agent on node-b declined: "), rec)
        self.assertIn("agent draining: the rdmig agent on node-b is shutting down", rec["reason"])
        m = parse_prometheus(self.src.metrics())[0]
        self.assertEqual(m.get(("rdmig_kubevirt_not_carried_total", frozenset({("reason", "peer_draining")}))), 1.0)
        # Not marked unhealthy: the next one is asked (and declined) again, not skipped unasked.
        mig3 = "mig-peer-drain-third"
        self.dial(1, 4096, vmi=vmi_json("vmi-uid-pd3", mig3, self.net.ip4["node-b"], self.sink_port))
        self.assertIn("refused the session: agent draining", self.records(self.src, migrationUid=mig3)[0]["reason"])
        out, err = held.communicate(timeout=60)
        conns = json.loads(out)["connections"]
        self.assertEqual([c["error"] for c in conns], ["still open after 8s"] * 2,
                         "the target's drain must not reset a carried migration: %s" % conns)
        self.dst.proc.wait(timeout=30)
        self.assertEqual(self.dst.proc.returncode, 0)
        self.assertIn("drained: nothing runs any more", self.dst.log_text())

    def test_rules_expire_when_the_source_agent_is_killed(self):
        mig = "mig-expire"
        vmi = vmi_json("vmi-uid-4", mig, self.net.ip4["node-b"], self.sink_port)
        # Arm, but do not dial yet: the element is in place.
        from rdmiglab import kvhook
        p = subprocess.run([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, "-c",
                            AS_HANDLER + "import sys,json; sys.path.insert(0,%r); from rdmiglab import kvhook; "
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

    @same_on_every_transport
    def test_a_restarted_agent_removes_what_a_killed_one_left_before_it_serves(self):
        # SIGKILL (or OOM) leaves the redirect in virt-handler's namespace until its elements
        # time out (ruleTimeoutSeconds, up to an hour): KubeVirt's connections would hit a dead
        # listener. The next agent on the node sweeps it away at start.
        token = self.src.token
        self.src.stop()
        # stateDir survives the agent (a hostPath in the DaemonSet): the record of what it armed.
        state = tempfile.mkdtemp(prefix="rdmig-kvstate-", dir="/tmp")
        self.addCleanup(shutil.rmtree, state, True)
        self.src = self.agent("node-a", token, hook=self.hook_socket, rule_timeout=300, state_dir=state,
                              peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}])
        # The hook caller must live on (virt-handler does): the sweep finds namespaces by it.
        ready = os.path.join(self.tmp, "handler-%s.json" % self._testMethodName)
        self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "sink",
                    "--ready", ready, "--log", os.path.join(self.tmp, "handler-%s.log" % self._testMethodName)])
        wait_for(lambda: os.path.exists(ready), 10, "the source handler")
        vmi = vmi_json("vmi-uid-s", "mig-sweep", self.net.ip4["node-b"], self.sink_port)
        self.assertTrue(self.call_hook(json.dumps(vmi).encode())["ok"])
        element = "%s . %d" % (self.net.ip4["node-b"], self.sink_port)
        self.assertIn(element, self.nft("node-a"))
        self.src.proc.send_signal(signal.SIGKILL)
        self.src.proc.wait()
        time.sleep(1.0)
        self.assertIn(element, self.nft("node-a"), "the element outlives a killed agent (300 s timeout)")
        # Another node's agent on this host (its own stateDir) never touches this namespace.
        other = self.agent("node-c", token, peers=[], rule_timeout=300)
        self.assertIn(element, self.nft("node-a"), "an agent swept a namespace it never armed")
        other.stop()
        self.src = self.agent("node-a", token, hook=self.hook_socket, rule_timeout=300, state_dir=state,
                              peers=[{"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port}])
        self.assertEqual(self.src.request("GET", "/readyz", token=False)[0], 200)
        self.assertNotIn("table inet rdmig", self.nft("node-a"), "the new agent removed the leftover table")
        res = self.dial(1, 65536, hook=False)
        self.assertTrue(res["connections"][0]["ok"], "KubeVirt's own path works at once")

    def test_a_table_flushed_under_the_agent_is_put_back_and_the_migration_carried(self):
        # Someone flushes the namespace's ruleset (a CNI restart, an operator's nft flush) after
        # the hook armed: the agent puts its table back on its next refresh instead of failing
        # every refresh with "No such file or directory" and leaving the migration uncarried.
        mig = "mig-flushed"
        vmi = vmi_json("vmi-uid-fl2", mig, self.net.ip4["node-b"], self.sink_port)
        self.assertTrue(self.call_hook(json.dumps(vmi).encode())["ok"])
        element = "%s . %d" % (self.net.ip4["node-b"], self.sink_port)
        self.assertIn(element, self.nft("node-a"))
        subprocess.run([kvnet.IP, "netns", "exec", self.net.netns["node-a"], "nft", "delete", "table", "inet", "rdmig"],
                       check=True)
        wait_for(lambda: element in self.nft("node-a"), 10, "the table and element to be back")
        res = self.dial(2, 1 << 20, hook=False)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig) if r["phase"] == "Succeeded"], 20,
                       "the carried migration")[0]
        self.assertEqual(rec["connections"], 2)

    def test_static_mode_carries_without_the_hook_and_passes_unknown_destinations_through(self):
        for a in self.agents:
            a.stop()
        token = self.src.token
        # A long-running "virt-handler" in the source namespace (the agent intercepts in its netns).
        ready = os.path.join(self.tmp, "handler-a.json")
        self.spawn([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "sink",
                    "--ready", ready, "--log", os.path.join(self.tmp, "handler-a.log")])
        wait_for(lambda: os.path.exists(ready), 10, "the source handler")
        self.dst = self.agent("node-b", token, peers=[])
        self.src = self.agent("node-a", token, hook="", extra={"staticMode": True}, peers=[
            {"node": "node-b", "agent": "127.0.0.1:%d" % self.dst.data_port,
             "handlerAddresses": [self.net.ip4["node-b"]]}])
        wait_for(lambda: self.net.ip4["node-b"] in self.nft("node-a"), 20, "the static redirect")
        res = self.dial(3, 1 << 20, hook=False)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        rec = wait_for(lambda: [r for r in self.records(self.src) if r["phase"] == "Succeeded"], 20, "a record")[0]
        self.assertEqual((rec["mode"], rec["carried"], rec["connections"], rec["targetNode"]),
                         ("static", True, 3, "node-b"))
        self.assertIsNone(rec["vmi"])
        # The peer's agent goes away (its last session had ended): the next connection cannot be
        # placed and is passed through unchanged, the peer is marked unhealthy, its element is no
        # longer refreshed and expires, and connections go KubeVirt's own way.
        self.dst.proc.send_signal(signal.SIGKILL)
        self.dst.proc.wait()
        res = self.dial(1, 65536, hook=False)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        self.assertIn("through unchanged", self.src.log_text())
        wait_for(lambda: self.net.ip4["node-b"] not in self.nft("node-a"), 20, "the static redirect to expire")
        res = self.dial(2, 65536, hook=False)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)

    @unittest.skipUnless(TRANSPORT == "rdma", "needs an RDMA device (runs in the Soft-RoCE VM)")
    def test_falls_back_to_tcp_when_the_target_agent_has_no_rdma(self):
        for a in self.agents:
            a.stop()
        token = self.src.token
        dst = self.agent("node-b", token, peers=[])
        dst.stop()
        # The target: transport auto, but no RDMA device it can use.
        dst = Agent(self.tmp, name="node-b-nordma", token=token, config={
            "transport": "auto", "rdma": {"device": "no-such-device"},
            "kubevirt": {"enabled": True, "nodeName": "node-b", "hookSocket": "", "sessionIdleSeconds": 1}})
        self.agents.append(dst)
        src = Agent(self.tmp, name="node-a-auto", token=token, config={
            "transport": "auto", "rdma": {"device": os.environ.get("RDMIG_RDMA_DEV", "rxe0")},
            "dataPlane": {"rdmaPort": 0},
            "kubevirt": {"enabled": True, "nodeName": "node-a", "hookSocket": self.hook_socket, "sessionIdleSeconds": 1,
                         "peers": [{"node": "node-b", "agent": "127.0.0.1:%d" % dst.data_port}]}})
        self.agents.append(src)
        self.src = src
        mig = "mig-fallback"
        res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-t", mig, self.net.ip4["node-b"], self.sink_port))
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        rec = wait_for(lambda: [r for r in self.records(src, migrationUid=mig) if r["phase"] == "Succeeded"], 30,
                       "the carried migration")[0]
        # The target's own reason rides after the colon: rdma.device names no device there.
        self.assertEqual((rec["transport"], rec["transportReason"]), ("tcp", "auto-no-peer-rdma:no-device"))

    @unittest.skipIf(TRANSPORT == "rdma", "discovery does not depend on the transport (the VM lacks the API double)")
    def test_peers_and_virt_handler_pods_from_the_kubernetes_api(self):
        # With discovery from the API the agents know this node's virt-handler pods: a process
        # is virt-handler only when its cgroup puts it in one of them. Any pod can name a
        # process virt-handler; before, such a process's hook call armed a redirect in its own
        # namespace, and a target agent dialled whatever such a process listened on.
        import socket
        for a in self.agents:
            a.stop()
        api = self.api_double()
        try:
            with socket.socket() as s:  # one data-plane port for both, as in a DaemonSet
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            for node, ip in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
                code, body = api.store.create("pods", "rdmig-system", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "rdmig-agent-" + node, "namespace": "rdmig-system",
                                 "labels": {"app.kubernetes.io/name": "rdmig-agent"}},
                    "spec": {"nodeName": node, "hostNetwork": True},
                    "status": {"phase": "Running", "hostIP": ip, "podIP": ip}})
                self.assertEqual(code, 201, body)
            handler_uid = {}
            for node in ("node-a", "node-b"):
                code, body = api.store.create("pods", "kubevirt", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "virt-handler-" + node, "namespace": "kubevirt",
                                 "labels": {"kubevirt.io": "virt-handler"}},
                    "spec": {"nodeName": node},
                    "status": {"phase": "Running", "podIP": self.net.ip4[node]}})
                self.assertEqual(code, 201, body)
                handler_uid[node] = body["metadata"]["uid"]
            token = self.src.token
            kc = api.write_kubeconfig(os.path.join(self.tmp, "kc.json"))
            self.src = self.agent("node-a", token, peers=[], hook=self.hook_socket, extra={
                "discovery": "kubernetes", "kubeconfig": kc, "agentNamespace": "rdmig-system"},
                data_plane={"address": "127.0.0.1", "port": port})
            self.dst = self.agent("node-b", token, peers=[], extra={
                "discovery": "kubernetes", "kubeconfig": kc, "agentNamespace": "rdmig-system"},
                data_plane={"address": "127.0.0.2", "port": port})
            # The real target proxy runs in node-b's virt-handler pod; setUp's sink (named
            # virt-handler, in the same network namespace) is in no pod.
            ready = os.path.join(self.tmp, "sink-pod-%s.json" % self._testMethodName)
            self.spawn(in_pod(handler_uid["node-b"], [kvnet.IP, "netns", "exec", self.net.netns["node-b"],
                                                      sys.executable, STREAMS, "sink", "--ready", ready,
                                                      "--log", self.sink_log + ".pod"]))
            pod_sink = wait_for(lambda: os.path.exists(ready) and read_json(ready)["port"], 10, "the pod's sink")

            def dial_as(pod, mig, sink_port, expect_ok=True):
                # KubeVirt publishes the migration in the API first; the hook's document is its copy.
                published = api.publish_migration("prod", "web-1", vmi_json(
                    "", mig, self.net.ip4["node-b"], sink_port)["status"]["migrationState"])
                vmi = vmi_json(published["metadata"]["uid"], mig, self.net.ip4["node-b"], sink_port)
                path = os.path.join(self.tmp, "vmi-%s.json" % mig)
                with open(path, "w") as f:
                    json.dump(vmi, f)
                argv = [kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "dial",
                        "--dest", "%s:%d" % (self.net.ip4["node-b"], sink_port), "--count", "2",
                        "--bytes", str(1 << 20), "--hook-socket", self.hook_socket, "--vmi", path]
                p = self.spawn(in_pod(pod, argv) if pod else argv)
                out, err = p.communicate(timeout=120)
                self.assertEqual(p.returncode, 0, err)
                res = json.loads(out)
                rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig)
                                        if r["phase"] not in ("Armed", "Carrying")], 20, "the record of " + mig)[0]
                if expect_ok is None:  # the impostor: connections fail exactly when it was carried
                    expect_ok = not rec["carried"]
                self.assertEqual(all(c["ok"] for c in res["connections"]), expect_ok, (res, rec))
                return rec

            # A process that only calls itself virt-handler, outside any pod or in another pod.
            for pod, mig, why in ((None, "mig-nopod", "runs in no pod"),
                                  ("0badc0de-0000-4000-8000-000000000001", "mig-otherpod",
                                   "not one of this node's virt-handler pods")):
                rec = dial_as(pod, mig, pod_sink)
                self.assertFalse(rec["carried"], rec)
                self.assertIn("the hook caller is not virt-handler", rec["reason"])
                self.assertIn(why, rec["reason"])
            self.assertNotIn("table inet rdmig", self.nft("node-a"), "nothing armed for them")
            # virt-handler in its pod: carried, to the proxy in node-b's virt-handler pod.
            rec = dial_as(handler_uid["node-a"], "mig-discovered", pod_sink)
            self.assertTrue(rec["carried"], rec)
            self.assertEqual(rec["phase"], "Succeeded", rec)
            self.assertEqual(rec["peer"], "127.0.0.2:%d" % port)
            self.assertTrue(any(m == "GET" and "/api/v1/namespaces/rdmig-system/pods?labelSelector=" in p
                                for m, p, _, _ in api.requests), api.requests)
            # A listener of the impostor in node-b's namespace is never dialled for a peer. The
            # property needs the migration carried: on a loaded machine the session's open can
            # miss the hook's 800 ms (then KubeVirt's own path goes there, as it would without
            # rdmig, and nothing is proven); such a try is made again, at most twice.
            for attempt in range(3):
                rec = dial_as(handler_uid["node-a"], "mig-impostor-%d" % attempt, self.sink_port,
                              expect_ok=None)
                if rec["carried"] or attempt == 2:
                    break
                print("\n[kubevirt relay] impostor try %d not carried (%s): again" % (attempt, rec["reason"]),
                      file=sys.stderr)
            self.assertTrue(rec["carried"], rec)
            self.assertEqual(rec["phase"], "Failed", rec)
            self.assertIn("does not listen on port %d" % self.sink_port, rec["reason"])
        finally:
            api.stop()

    @unittest.skipIf(TRANSPORT == "rdma", "discovery does not depend on the transport (the VM lacks the API double)")
    def test_a_launcher_counts_only_inside_the_vmis_launcher_pod(self):
        # The target agent opens libvirt connections into the root of the VMI's launcher (the
        # figures it reports; on the source, aborts). Any pod can start a process with
        # `virt-launcher... --uid <VMI UID>` in its command line; before, such a process got
        # those connections, into a socket its container chose. With the API the process must
        # run in a launcher pod of the VMI (kubevirt.io=virt-launcher, created-by the VMI).
        import socket
        for a in self.agents:
            a.stop()
        api = self.api_double()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]

        def pod(ns, name, node, labels, **status):
            code, body = api.store.create("pods", ns, {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
                "spec": {"nodeName": node}, "status": dict({"phase": "Running"}, **status)})
            self.assertEqual(code, 201, body)
            return body["metadata"]["uid"]
        for node, ip in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
            pod("rdmig-system", "rdmig-agent-" + node, node, {"app.kubernetes.io/name": "rdmig-agent"},
                hostIP=ip, podIP=ip)
        handler = {n: pod("kubevirt", "virt-handler-" + n, n, {"kubevirt.io": "virt-handler"}, podIP=self.net.ip4[n])
                   for n in ("node-a", "node-b")}
        # The VMI as KubeVirt keeps it in the API (its UID is the API server's).
        vmi_uid = api.publish_migration("prod", "web-1", vmi_json(
            "", "mig-none", self.net.ip4["node-b"], 1)["status"]["migrationState"])["metadata"]["uid"]
        launcher = pod("prod", "virt-launcher-web-1-abcde", "node-b",
                       {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": vmi_uid})
        # Another VMI's launcher pod in the same namespace, on the same node.
        other = pod("prod", "virt-launcher-other-fghij", "node-b",
                    {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": "0therv01-0000-4000-8000-00000000000b"})
        sock = os.path.join(self.tmp, "lv-%s.sock" % os.urandom(3).hex())
        kc = api.write_kubeconfig(os.path.join(self.tmp, "kc-%s.json" % self._testMethodName))
        discovery = {"discovery": "kubernetes", "kubeconfig": kc, "agentNamespace": "rdmig-system"}
        token = self.src.token
        self.src = self.agent("node-a", token, peers=[], hook=self.hook_socket, extra=discovery,
                              data_plane={"address": "127.0.0.1", "port": port})
        self.dst = self.agent("node-b", token, peers=[], extra=dict(discovery, libvirtSockets=[sock]),
                              data_plane={"address": "127.0.0.2", "port": port})
        ready = os.path.join(self.tmp, "sink-pod-%s.json" % self._testMethodName)
        self.spawn(in_pod(handler["node-b"], [kvnet.IP, "netns", "exec", self.net.netns["node-b"], sys.executable,
                                              STREAMS, "sink", "--ready", ready, "--log", self.sink_log + ".pod"]))
        pod_sink = wait_for(lambda: os.path.exists(ready) and read_json(ready)["port"], 10, "the pod's sink")
        # A stand-in launcher: named as virt-launcher's monitor, `--uid <VMI UID>`, listening on
        # the libvirt socket path the agent looks for in its root; it counts the connections.
        fake = os.path.join(self.tmp, "virt-launcher-monitor")
        with open(fake, "w") as f:
            f.write("import socket, sys\n"
                    "path, log = sys.argv[3], sys.argv[4]\n"
                    "s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(16)\n"
                    "open(log + '.ready', 'w').close()\n"
                    "while True:\n"
                    "    c, _ = s.accept()\n"
                    "    open(log, 'a').write('accepted\\n'); c.close()\n")

        def launcher_in(pod_uid, tag):
            log = os.path.join(self.tmp, "launcher-%s.log" % tag)
            if os.path.exists(sock):
                os.unlink(sock)
            argv = [sys.executable, fake, "--uid", vmi_uid, sock, log]
            p = self.spawn(in_pod(pod_uid, argv) if pod_uid else argv)
            wait_for(lambda: os.path.exists(log + ".ready"), 10, "the stand-in launcher")
            return p, log

        def migrate(mig):
            vmi = vmi_json(vmi_uid, mig, self.net.ip4["node-b"], pod_sink)
            api.publish_migration("prod", "web-1", vmi["status"]["migrationState"])
            path = os.path.join(self.tmp, "vmi-%s.json" % mig)
            with open(path, "w") as f:
                json.dump(vmi, f)
            p = self.spawn(in_pod(handler["node-a"], [
                kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "dial", "--dest",
                "%s:%d" % (self.net.ip4["node-b"], pod_sink), "--count", "2", "--bytes", str(1 << 20),
                "--hook-socket", self.hook_socket, "--vmi", path]))
            out, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, err)
            self.assertTrue(all(c["ok"] for c in json.loads(out)["connections"]), out)
            # The target reports after its libvirt look-up (up to 10 s without figures).
            return wait_for(lambda: [r for r in self.records(self.dst, migrationUid=mig) if r["phase"] == "Succeeded"],
                            30, "the target's record of " + mig)[0]

        def accepted(log):
            if not os.path.exists(log):
                return 0
            with open(log) as f:
                return len(f.read().splitlines())

        # In another VMI's launcher pod, then in no pod at all: never connected to.
        for pod_uid, tag, why in ((other, "other", "not a launcher pod of VMI " + vmi_uid), (None, "nopod", "no pod")):
            p, log = launcher_in(pod_uid, tag)
            migrate("mig-launcher-" + tag)
            self.assertEqual(accepted(log), 0, "the agent opened the impostor's libvirt socket (%s)" % tag)
            self.assertIn("process %d runs in " % p.pid, self.dst.log_text())
            self.assertIn(why, self.dst.log_text())
            p.kill()
            p.wait()
        # In the VMI's launcher pod: that one is the launcher (the stand-in speaks no libvirt, so
        # there are no figures, but the agent connects).
        p, log = launcher_in(launcher, "own")
        migrate("mig-launcher-own")
        self.assertGreater(accepted(log), 0, "the VMI's own launcher was never connected to")
        self.assertTrue(any(m == "GET" and p_.startswith("/api/v1/pods?") and "virt-launcher" in p_
                            for m, p_, _, _ in api.requests), api.requests)

    # ---- discovery kubernetes: what the API published is all that is armed and dialled ----

    def api_cluster(self):
        """Both agents with discovery from the API double (peers, virt-handler pods, VMIs) and a
        sink in node-b's virt-handler pod standing in for the target proxy. Returns the API, the
        virt-handler pod UIDs by node, and the sink's port."""
        import socket
        for a in self.agents:
            a.stop()
        api = self.api_double()
        with socket.socket() as s:  # one data-plane port for both, as in a DaemonSet
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        handler = {}
        for node, ip in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
            for ns, name, labels, status, spec in (
                    ("rdmig-system", "rdmig-agent-" + node, {"app.kubernetes.io/name": "rdmig-agent"},
                     {"hostIP": ip, "podIP": ip}, {"hostNetwork": True}),
                    ("kubevirt", "virt-handler-" + node, {"kubevirt.io": "virt-handler"},
                     {"podIP": self.net.ip4[node]}, {})):
                code, body = api.store.create("pods", ns, {
                    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
                    "spec": dict(spec, nodeName=node), "status": dict(status, phase="Running")})
                self.assertEqual(code, 201, body)
                if ns == "kubevirt":
                    handler[node] = body["metadata"]["uid"]
        kc = api.write_kubeconfig(os.path.join(self.tmp, "kc-%s.json" % self._testMethodName))
        discovery = {"discovery": "kubernetes", "kubeconfig": kc, "agentNamespace": "rdmig-system"}
        token = self.src.token
        self.src = self.agent("node-a", token, peers=[], hook=self.hook_socket, extra=discovery,
                              data_plane={"address": "127.0.0.1", "port": port})
        self.dst = self.agent("node-b", token, peers=[], extra=discovery,
                              data_plane={"address": "127.0.0.2", "port": port})
        self.dst_address = "127.0.0.2"  # node-b's data plane (node-a's is 127.0.0.1, same port)
        ready = os.path.join(self.tmp, "sink-pod-%s.json" % self._testMethodName)
        self.spawn(in_pod(handler["node-b"], [kvnet.IP, "netns", "exec", self.net.netns["node-b"], sys.executable,
                                              STREAMS, "sink", "--ready", ready, "--log", self.sink_log + ".pod"]))
        pod_sink = wait_for(lambda: os.path.exists(ready) and read_json(ready)["port"], 10, "the pod's sink")
        return api, handler, pod_sink

    def dial_from_handler(self, handler, vmi, port):
        """virt-handler on node-a (in its pod) calls the hook with `vmi`, then its proxy dials
        the target at `port`. Returns the dial's outcome and the source's settled record."""
        path = os.path.join(self.tmp, "vmi-%s.json" % vmi["status"]["migrationState"]["migrationUid"])
        with open(path, "w") as f:
            json.dump(vmi, f)
        p = self.spawn(in_pod(handler["node-a"], [
            kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, STREAMS, "dial", "--dest",
            "%s:%d" % (self.net.ip4["node-b"], port), "--count", "2", "--bytes", str(1 << 20),
            "--hook-socket", self.hook_socket, "--vmi", path]))
        out, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 0, err)
        res = json.loads(out)
        mig = vmi["status"]["migrationState"]["migrationUid"]
        rec = wait_for(lambda: [r for r in self.records(self.src, migrationUid=mig)
                                if r["phase"] not in ("Armed", "Carrying")], 20, "the record of " + mig)[0]
        return res, rec

    def assert_not_carried_and_nothing_left(self, res, rec, why):
        self.assertTrue(res["hook"]["ok"], "the hook never fails KubeVirt's migration")
        self.assertTrue(all(c["ok"] for c in res["connections"]), "KubeVirt's own path: %s" % res)
        self.assertFalse(rec["carried"], rec)
        self.assertEqual(rec["phase"], "NotCarried", rec)
        self.assertIn(why, rec["reason"])
        self.assertNotIn("table inet rdmig", self.nft("node-a"), "no rule armed")
        self.assertEqual([r for r in self.records(self.src) if r["phase"] != "NotCarried"], [], "no session")
        self.assertEqual(self.records(self.dst), [], "the target agent saw nothing")

    @unittest.skipIf(TRANSPORT == "rdma", "the API checks do not depend on the transport (the VM lacks the API double)")
    def test_a_hook_document_the_api_does_not_confirm_arms_nothing(self):
        # The hook caller's VMI document is a claim. Before, the agent armed whatever it named:
        # another VMI's UID, a migration KubeVirt never started, ports KubeVirt never published.
        api, handler, pod_sink = self.api_cluster()
        ip_b = self.net.ip4["node-b"]

        def publish(mig):
            return api.publish_migration("prod", "web-1", vmi_json("", mig, ip_b, pod_sink)["status"]["migrationState"])
        uid = publish("mig-api-uid")["metadata"]["uid"]
        forged = "0badc0de-0000-4000-8000-00000000000f"
        cases = [("mig-api-uid", vmi_json(forged, "mig-api-uid", ip_b, pod_sink), pod_sink, "metadata.uid"),
                 ("mig-api-other", vmi_json(uid, "mig-forged", ip_b, pod_sink), pod_sink, "migrationUid"),
                 ("mig-api-port", vmi_json(uid, "mig-api-port", ip_b, self.sink_port), self.sink_port,
                  "targetDirectMigrationNodePorts"),
                 ("mig-api-node", vmi_json(uid, "mig-api-node", ip_b, pod_sink, target="node-c"), pod_sink,
                  "targetNode")]
        for published_mig, doc, port, why in cases:
            publish(published_mig)
            res, rec = self.dial_from_handler(handler, doc, port)
            self.assert_not_carried_and_nothing_left(res, rec, why)
            self.assertIn("does not match the API", rec["reason"])
        # A VMI deleted meanwhile: the document that was true is refused.
        publish("mig-api-gone")
        doc = vmi_json(uid, "mig-api-gone", ip_b, pod_sink)
        code, _ = api.store.delete("virtualmachineinstances", "prod", "web-1")
        self.assertEqual(code, 200)
        res, rec = self.dial_from_handler(handler, doc, pod_sink)
        self.assert_not_carried_and_nothing_left(res, rec, "the API has no VMI prod/web-1")
        m, _ = parse_prometheus(self.src.metrics())
        self.assertEqual(m.get(("rdmig_kubevirt_hook_calls_total", frozenset({("decision", "skipped")}))), 5.0)
        # The dashboard's and the alert's reason code of each (docs/metrics.md): the API check.
        self.assertEqual(m.get(("rdmig_kubevirt_not_carried_total", frozenset({("reason", "api_check")}))), 5.0)
        self.assertTrue(any(m_ == "GET" and p_ == "/apis/kubevirt.io/v1/namespaces/prod/virtualmachineinstances/web-1"
                            and s_ == 404 for m_, p_, _, s_ in api.requests), api.requests)
        # The document the API confirms is carried (the API's UID, migration and ports).
        uid = publish("mig-api-ok")["metadata"]["uid"]
        res, rec = self.dial_from_handler(handler, vmi_json(uid, "mig-api-ok", ip_b, pod_sink), pod_sink)
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        self.assertTrue(rec["carried"], rec)
        self.assertEqual(rec["phase"], "Succeeded", rec)

    def flow_handshake(self, hello, token, host=None):
        """Speaks the flow protocol as a token holder would: hello, challenge, auth. Returns the
        connection, the target's nonce and its answer to the auth (welcome or reject)."""
        import socket
        c = socket.create_connection((host or self.dst_address, self.dst.data_port), timeout=10)
        self.addCleanup(c.close)
        flow_send(c, hello)
        ch = flow_recv(c)
        self.assertEqual(ch["type"], "challenge", ch)
        flow_send(c, {"type": "auth", "mac": flow_proof(token, "source", hello, ch["nonce"])})
        return c, ch["nonce"], flow_recv(c)

    @unittest.skipIf(TRANSPORT == "rdma", "the API checks do not depend on the transport (the VM lacks the API double)")
    def test_a_token_holder_cannot_make_the_target_dial_a_port_the_api_did_not_publish(self):
        # virt-handler listens on more than the migration's ports (its console server on 8443,
        # ...). Before, a holder of the token who opened a session for a real migration had the
        # target agent dial any port virt-handler listens on, from inside its pod.
        import socket
        api, handler, pod_sink = self.api_cluster()
        ip_b = self.net.ip4["node-b"]
        log = os.path.join(self.tmp, "console-%s.log" % os.urandom(3).hex())
        console = self.spawn(in_pod(handler["node-b"], [
            kvnet.IP, "netns", "exec", self.net.netns["node-b"], sys.executable, "-c",
            AS_HANDLER + "import socket,sys; s=socket.socket(); s.bind(('0.0.0.0',0)); s.listen(8); "
            "print(s.getsockname()[1], flush=True)\nwhile True:\n c,_=s.accept(); open(sys.argv[1],'a').write('x\\n')",
            log]))
        console_port = int(console.stdout.readline())
        vmi = api.publish_migration("prod", "web-1", vmi_json("", "mig-pub", ip_b, pod_sink)["status"]["migrationState"])
        uid = vmi["metadata"]["uid"]
        token = self.dst.token

        def hello(mig="mig-pub", name="web-1", vmi_uid=uid):
            return flow_hello(os.urandom(16).hex(), os.urandom(16).hex(), mig,
                              vmi={"namespace": "prod", "name": name, "uid": vmi_uid})
        h = hello()
        c, nonce, reply = self.flow_handshake(h, token)
        self.assertEqual(reply["type"], "welcome", "the API confirms this session's migration: %s" % reply)
        flow_send(c, flow_sign(token, h, nonce, 0, {"type": "open", "index": 0, "host": ip_b, "port": console_port}))
        # Signed heartbeats, as a live source agent sends them: the session ends on the dial,
        # not on a silent control link.
        beating = threading.Event()

        def beat():
            seq = 1
            while not beating.wait(0.5):
                try:
                    flow_send(c, flow_sign(token, h, nonce, seq, {"type": "heartbeat"}))
                except OSError:
                    return
                seq += 1
        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        self.addCleanup(beater.join, 5)
        self.addCleanup(beating.set)
        d, _, _ = flow_channel(self.dst.data_port, flow_channel_key(token, h, nonce), h["session"], 0,
                               host=self.dst_address)
        with d:
            try:
                flow_recv(d)
            except Exception:  # the target closes the channel when the session fails
                pass
            rec = wait_for(lambda: [r for r in self.records(self.dst, migrationUid="mig-pub") if r["phase"] == "Failed"],
                           15, "the session to fail")[0]
        beating.set()
        time.sleep(0.5)
        self.assertFalse(os.path.exists(log), "the target agent dialled virt-handler's unpublished port %d" % console_port)
        self.assertIn("is not what the API published for migration mig-pub", rec["reason"])
        self.assertIn("%s:[%d]" % (ip_b, pod_sink), rec["reason"])
        # Sessions the API does not confirm are refused before the welcome: nothing to dial.
        for tag, h in (("another migration", hello(mig="mig-forged")), ("another UID", hello(vmi_uid="0badc0de")),
                       ("no such VMI", hello(name="web-404"))):
            _, _, reply = self.flow_handshake(h, token)
            self.assertEqual((reply["type"], reply.get("code")), ("reject", "failed_precondition"), tag)
        self.assertIn("migrationUid is 'mig-pub', the session names 'mig-forged'", self.dst.log_text())
        # A session whose sourceNode is not the API's migrationState.sourceNode: refused naming it.
        _, _, reply = self.flow_handshake(dict(hello(), sourceNode="node-z"), token)
        self.assertEqual((reply["type"], reply.get("code")), ("reject", "failed_precondition"), reply)
        self.assertIn("hello.sourceNode", reply["message"])
        self.assertIn("the session names 'node-z'", self.dst.log_text())
        # The VMI deleted: refused.
        self.assertEqual(api.store.delete("virtualmachineinstances", "prod", "web-1")[0], 200)
        _, _, reply = self.flow_handshake(hello(), token)
        self.assertEqual((reply["type"], reply.get("code")), ("reject", "failed_precondition"))
        self.assertFalse(os.path.exists(log))
        self.assertEqual(self.dst.request("GET", "/healthz", token=False)[0], 200)

    @unittest.skipIf(TRANSPORT == "rdma", "the API checks do not depend on the transport (the VM lacks the API double)")
    def test_an_api_slow_or_down_leaves_kubevirts_path_and_the_agent_serving(self):
        api, handler, pod_sink = self.api_cluster()
        ip_b = self.net.ip4["node-b"]

        def publish(mig):
            st = vmi_json("", mig, ip_b, pod_sink)["status"]["migrationState"]
            return api.publish_migration("prod", "web-1", st)["metadata"]["uid"]

        def slow(node):
            return lambda path, agent: 3 if "virtualmachineinstances" in path and agent.endswith("/" + node) else 0
        # The source's look-up is slow: the hook answers within its bound, nothing is armed.
        uid = publish("mig-slow")
        api.delay_get = slow("node-a")
        res, rec = self.dial_from_handler(handler, vmi_json(uid, "mig-slow", ip_b, pod_sink), pod_sink)
        self.assert_not_carried_and_nothing_left(res, rec, "cannot check the hook's VMI document against the API")
        self.assertLess(res["hook"]["call_s"], 1.5, "the hook's API call is bounded")
        # The target's look-up is slow: it declines the session, the source arms nothing and
        # keeps the peer healthy.
        uid = publish("mig-slow-target")
        api.delay_get = slow("node-b")
        res, rec = self.dial_from_handler(handler, vmi_json(uid, "mig-slow-target", ip_b, pod_sink), pod_sink)
        self.assert_not_carried_and_nothing_left(res, rec, "the agent on node-b declined")
        self.assertLess(res["hook"]["call_s"], 2.0)
        # Answers again: carried.
        api.delay_get = None
        uid = publish("mig-again")
        res, rec = self.dial_from_handler(handler, vmi_json(uid, "mig-again", ip_b, pod_sink), pod_sink)
        self.assertTrue(rec["carried"], rec)
        self.assertEqual(rec["phase"], "Succeeded", rec)
        # Down: KubeVirt's own path, the agents keep serving.
        uid = publish("mig-down")
        api.stop()
        res, rec = self.dial_from_handler(handler, vmi_json(uid, "mig-down", ip_b, pod_sink), pod_sink)
        self.assertTrue(res["hook"]["ok"])
        self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        self.assertFalse(rec["carried"], rec)
        self.assertIn("cannot check the hook's VMI document against the API", rec["reason"])
        self.assertEqual([r for r in self.records(self.src, migrationUid="mig-down") if r["carried"]], [])
        for a in (self.src, self.dst):
            self.assertEqual(a.request("GET", "/healthz", token=False)[0], 200)

    # ---- hostile and broken clients ----

    def call_hook(self, vmi_bytes, timeout=5):
        code = (AS_HANDLER + "import sys,json; sys.path.insert(0,%r); from rdmiglab import kvhook; "
                "data=open(%r,'rb').read(); "
                "print(json.dumps(kvhook.call_node_hook(%r,'PreMigrationSource',data,'node-a',timeout=%r)))")
        path = os.path.join(self.tmp, "hostile-vmi.bin")
        with open(path, "wb") as f:
            f.write(vmi_bytes)
        p = subprocess.run([kvnet.IP, "netns", "exec", self.net.netns["node-a"], sys.executable, "-c",
                            code % (os.path.join(HERE, "..", "..", "tools"), path, self.hook_socket, timeout)],
                           capture_output=True, text=True, timeout=60)
        return json.loads(p.stdout)

    @same_on_every_transport
    def test_hostile_hook_calls_never_fail_kubevirt_or_the_agent(self):
        import socket
        before = self.src.rss_kib()
        good = vmi_json("vmi-uid-h", "mig-h", self.net.ip4["node-b"], self.sink_port)
        cases = {
            "not JSON": b"\xff\xfe{not json",
            "no migrationState": json.dumps({"metadata": {"name": "a", "namespace": "b", "uid": "c"}}).encode(),
            "injection in the address": json.dumps(vmi_json("u", "m1", "10.0.0.1 } ; flush ruleset ;", 1)).encode(),
            "port out of range": json.dumps(vmi_json("u", "m2", self.net.ip4["node-b"], 70000)).encode(),
            "too many ports": json.dumps(dict(good, status={"migrationState": dict(
                good["status"]["migrationState"], targetDirectMigrationNodePorts={str(i): 49152 for i in range(1, 400)})}
            )).encode(),
            "deeply nested": b"[" * 100000 + b"]" * 100000,
        }
        # A client that connects to the hook socket and says nothing must not hold others up.
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(self.hook_socket)
        try:
            for name, body in cases.items():
                res = self.call_hook(body)
                self.assertTrue(res["ok"], "%s: %s" % (name, res))
                self.assertLess(res["duration_s"], 2.0, name)
            big = self.call_hook(b"x" * (5 << 20))
            self.assertFalse(big["ok"], "a request over 4 MiB is refused by gRPC")
            self.assertEqual(big["code"], "RESOURCE_EXHAUSTED")
        finally:
            silent.close()
        self.assertNotIn("flush", self.nft("node-a"))
        self.assertEqual(self.src.request("GET", "/healthz", token=False)[0], 200)
        m, _ = parse_prometheus(self.src.metrics())
        # "not JSON" and "deeply nested" (over 32 levels, refused before parsing) never reach
        # the relay (the hook server drops them); the four others are refused by the VMI reader,
        # each counted.
        self.assertEqual(m.get(("rdmig_kubevirt_hook_calls_total", frozenset({("decision", "error")}))), 4.0)
        self.assertEqual(self.records(self.src), [], "nothing was armed")
        after = self.src.rss_kib()
        print("hostile hook calls: agent RSS %d KiB before, %d KiB after" % (before, after))
        self.assertLess(after - before, 64 * 1024, "memory stays bounded")
        # And the hook still works for a real migration.
        res = self.dial(2, 65536, vmi=good)
        self.assertTrue(res["hook"]["ok"])
        self.assertTrue(all(c["ok"] for c in res["connections"]))
        wait_for(lambda: any(r["carried"] for r in self.records(self.src, migrationUid="mig-h")), 10, "carried")

    def test_hostile_flow_hellos_are_refused_and_leak_nothing(self):
        import socket
        import struct

        def send(sock, obj):
            body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
            sock.sendall(struct.pack("<I", len(body)) + body)

        def recv(sock):
            sock.settimeout(10)
            n = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]
            return json.loads(sock.recv(n, socket.MSG_WAITALL))

        def conn():
            return socket.create_connection(("127.0.0.1", self.dst.data_port), timeout=10)

        hello = flow_hello("ab" * 16, "cd" * 16, "x")
        silent = [conn() for _ in range(8)]  # say nothing: must delay nobody
        try:
            for bad, field in [(dict(hello, chunkSize=3), "hello.chunkSize"), (dict(hello, session="zz"), "hello.session"),
                               (dict(hello, mode="evil"), "hello.mode"), (dict(hello, protocol=9), "hello.protocol"),
                               (dict(hello, protocol=3), "hello.protocol"), (dict(hello, nonce="ab"), "hello.nonce"),
                               ({"kind": "flow-data", "protocol": FLOW_PROTOCOL, "session": "cd" * 16, "index": 0,
                                 "nonce": "ef" * 16}, "unknown data-plane session"),
                               # an agent from before the channel proof: refused naming both versions
                               ({"kind": "flow-data", "protocol": 5, "session": "cd" * 16, "index": 0},
                                "hello.protocol: this agent speaks 6, got 5")]:
                with conn() as c:
                    send(c, bad)
                    r = recv(c)
                    self.assertEqual(r["type"], "reject")
                    self.assertIn(field, r["message"])
            with conn() as c:  # a wrong proof of the token
                send(c, hello)
                self.assertEqual(recv(c)["type"], "challenge")
                send(c, {"type": "auth", "mac": "00" * 32})
                r = recv(c)
                self.assertEqual(r["type"], "reject")
                self.assertIn("token", r["message"])
            with conn() as c:  # garbage length prefix
                c.sendall(b"\xff\xff\xff\xffgarbage")
                c.settimeout(10)
                try:
                    self.assertEqual(c.recv(16), b"")
                except ConnectionResetError:
                    pass  # closed with our garbage unread: a reset is the same refusal
            # Meanwhile a real carried migration goes through.
            res = self.dial(2, 1 << 20, vmi=vmi_json("vmi-uid-f", "mig-f", self.net.ip4["node-b"], self.sink_port))
            self.assertTrue(all(c["ok"] for c in res["connections"]), res)
        finally:
            for s in silent:
                s.close()
        self.assertEqual([r for r in self.records(self.dst) if r["migrationUid"] == "x"], [],
                         "a refused session leaves no record and no session behind")


if __name__ == "__main__":
    timed.main()
