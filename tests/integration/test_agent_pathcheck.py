"""Path checks between two real agents over TCP (docs/pathcheck.md): the endpoint pair on both
roles, every byte verified at the far end, the figures reported, the bounds (hostile bodies,
oversized bytes, too many at once, a check beside a running migration), a target agent that is
down, a target agent frozen mid-stream (the stall named within seconds), and a check cancelled
mid-stream that leaves nothing behind on either agent.

No QEMU boots here: the one running migration is a target-role migration held by a QMP stand-in.

Run: RDMIG_AGENT=build/agent/rdmig-agent python3 tests/integration/test_agent_pathcheck.py -v
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
sys.path.insert(0, HERE)
from rdmiglab import Agent, parse_prometheus  # noqa: E402
from test_agent_hostile_http import DialPolicyNamespace, FakeIncomingQemu, control_hello, channel_key_of  # noqa: E402
from rdmiglab import wireproof  # noqa: E402
from rdmiglab import timed  # noqa: E402

MiB = 1 << 20
TERMINAL = ("Succeeded", "Failed", "Cancelled")


def wait_check(agent, cid, phases=TERMINAL, timeout=60.0, pred=None):
    deadline = time.monotonic() + timeout
    while True:
        st = agent.call("GET", "/v1/pathchecks/" + cid)
        if st["phase"] in phases and (pred is None or pred(st)):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError("%s: path check %s still %s after %ss: %s" % (agent.name, cid, st["phase"], timeout, st))
        time.sleep(0.05)


def start_pair(src, dst, **kw):
    """Creates the target end on `dst`, then the source end on `src`; returns (source id, target id)."""
    body = dict(kw)
    t = dst.call("POST", "/v1/pathchecks", dict(body, role="target"))
    s = src.call("POST", "/v1/pathchecks",
                 dict(body, role="source", target={"endpoint": t["endpoint"], "checkId": t["checkId"],
                                                   "token": t["token"]}))
    return s["id"], t["id"]


def metric(agent, name, **labels):
    samples, _ = parse_prometheus(agent.metrics())
    return samples.get((name, frozenset(labels.items())), 0)


class PathCheckTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-pathcheck-")
        cls.a = Agent(cls.tmp, "agent-a", log_level="debug")
        cls.b = Agent(cls.tmp, "agent-b", log_level="debug")

    @classmethod
    def tearDownClass(cls):
        for agent in (cls.a, cls.b):
            agent.stop()
        if os.environ.get("RDMIG_KEEP_LOGS"):
            print("logs kept in", cls.tmp)
        else:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def tearDown(self):
        for agent in (self.a, self.b):
            self.assertTrue(agent.alive(), agent.log_text()[-3000:])
            # No check is left running after a test.
            deadline = time.monotonic() + 10
            while any(c["phase"] not in TERMINAL for c in agent.call("GET", "/v1/pathchecks")["items"]):
                self.assertLess(time.monotonic(), deadline, agent.call("GET", "/v1/pathchecks"))
                time.sleep(0.05)

    def test_a_pair_carries_and_verifies_every_byte_and_reports_the_figures(self):
        before_src = metric(self.a, "rdmig_transferred_bytes_total", transport="tcp", direction="sent", traffic="pathcheck")
        before_mig = metric(self.a, "rdmig_transferred_bytes_total", transport="tcp", direction="sent", traffic="migration")
        sid, tid = start_pair(self.a, self.b, bytes="96Mi", chunkSize="256Ki", channels=2, transport="auto")
        src = wait_check(self.a, sid)
        dst = wait_check(self.b, tid)
        print("\nsource:", src, "\ntarget:", dst)
        self.assertEqual(src["phase"], "Succeeded", src)
        self.assertEqual(dst["phase"], "Succeeded", dst)
        self.assertEqual(src["bytesSent"], 96 * MiB)
        self.assertEqual(dst["bytesVerified"], 96 * MiB)
        self.assertEqual(src["transport"], "tcp")
        # These agents run with transport: tcp, so auto falls back, with the migration's reason.
        self.assertTrue(src["transportReason"].startswith("auto-no-"), src)
        self.assertGreater(src["throughputBytesPerSecond"], 0)
        self.assertGreater(src["rttMicroseconds"], 0)
        self.assertLess(src["rttMicroseconds"], 1000000)
        self.assertNotIn("localRdma", src)  # TCP: no device to report
        # Metrics: the check's bytes under traffic="pathcheck", none under migration.
        sent = metric(self.a, "rdmig_transferred_bytes_total", transport="tcp", direction="sent", traffic="pathcheck")
        received = metric(self.b, "rdmig_transferred_bytes_total", transport="tcp", direction="received",
                          traffic="pathcheck")
        self.assertGreaterEqual(sent - before_src, 96 * MiB)
        self.assertGreaterEqual(received, 96 * MiB)
        self.assertEqual(metric(self.a, "rdmig_transferred_bytes_total", transport="tcp", direction="sent",
                                traffic="migration"), before_mig)
        self.assertGreaterEqual(metric(self.a, "rdmig_pathchecks_finished_total", role="source", result="succeeded"), 1)
        self.assertGreaterEqual(metric(self.b, "rdmig_pathchecks_finished_total", role="target", result="succeeded"), 1)

    def test_with_dataplane_tls_on_both_agents_a_check_runs_over_tls_and_one_sided_tls_is_refused(self):
        tls = [Agent(self.tmp, "agent-tls-%s" % n, config={"dataPlane": {"tls": "on"}}) for n in "ab"]
        for a in tls:
            self.addCleanup(a.stop)
        sid, tid = start_pair(tls[0], tls[1], bytes="32Mi", chunkSize="256Ki", channels=2, transport="tcp")
        src, dst = wait_check(tls[0], sid), wait_check(tls[1], tid)
        self.assertEqual((src["phase"], dst["phase"]), ("Succeeded", "Succeeded"), (src, dst))
        self.assertEqual(dst["bytesVerified"], 32 * MiB)
        self.assertEqual((src["encryption"], dst["encryption"]), ("tls (user space)", "tls (user space)"))
        self.assertEqual(metric(tls[0], "rdmig_tls_channels_total", mode="user_space"), 2)
        # One side on, the other off (either way): refused naming the key, never run in clear.
        for a, b in ((tls[0], self.b), (self.a, tls[1])):
            sid, tid = start_pair(a, b, bytes="1Mi", chunkSize="256Ki", channels=1, transport="tcp")
            src = wait_check(a, sid)
            self.assertEqual(src["phase"], "Failed", src)
            self.assertIn("dataPlane.tls mismatch", src["error"])
            b.call("DELETE", "/v1/pathchecks/" + tid)

    def test_a_target_agent_that_is_down_fails_the_check_naming_the_cause(self):
        c = Agent(self.tmp, "agent-c")
        t = c.call("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi"})
        c.stop()
        started = time.monotonic()
        s = self.a.call("POST", "/v1/pathchecks", {"role": "source", "bytes": "8Mi", "timeoutSeconds": 10,
                                                   "target": {"endpoint": t["endpoint"], "checkId": t["checkId"],
                                                              "token": t["token"]}})
        st = wait_check(self.a, s["id"], timeout=15)
        elapsed = time.monotonic() - started
        print("\ndown target:", st, "after %.2f s" % elapsed)
        self.assertEqual(st["phase"], "Failed")
        self.assertIn("target agent data plane " + t["endpoint"], st["error"])
        self.assertIn("refused", st["error"].lower())
        self.assertLess(elapsed, 10)

    def test_a_wrong_token_is_refused_by_the_target_agent(self):
        t = self.b.call("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi", "timeoutSeconds": 5})
        s = self.a.call("POST", "/v1/pathchecks", {"role": "source", "bytes": "8Mi",
                                                   "target": {"endpoint": t["endpoint"], "checkId": t["checkId"],
                                                              "token": "not-the-token"}})
        st = wait_check(self.a, s["id"], timeout=15)
        self.assertEqual(st["phase"], "Failed")
        self.assertIn("refused the check", st["error"])
        # The target end is still waiting for its real source, then gives up at its deadline.
        tst = wait_check(self.b, t["id"], timeout=15)
        self.assertEqual(tst["phase"], "Failed")
        self.assertIn("no source agent connected within 5 s", tst["error"])

    def test_a_data_channel_must_prove_the_checks_key_not_just_name_its_session(self):
        # Issue 38: the session value is in clear in the target's welcome; a pathcheck-data hello
        # naming it was welcomed from anyone who saw it. Now the channel proves a key only the two
        # token-proven ends hold, and a refused channel takes nothing.
        import socket
        t = self.b.call("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi", "channels": 1, "chunkSize": "1Mi",
                                                   "ringDepth": 16, "timeoutSeconds": 30})
        auth = ("rdmig_transport_errors_total", frozenset({("transport", "tcp"), ("kind", "auth")}))
        before = parse_prometheus(self.b.metrics())[0].get(auth, 0)
        port = int(t["endpoint"].rsplit(":", 1)[1])
        ctl = socket.create_connection(("127.0.0.1", port), timeout=10)
        held = []
        try:
            hello = {"type": "hello", "protocol": wireproof.PROTOCOL, "migrationId": t["checkId"], "channels": 1,
                     "chunkSize": 1 << 20, "ringDepth": 16, "transport": "tcp"}
            welcome = control_hello(ctl, dict(hello, kind="pathcheck-control"), t["token"])
            self.assertEqual(welcome["type"], "welcome", welcome)
            seen = dict(hello, kind="pathcheck-data", session=welcome["session"], index=0)
            s, answer = wireproof.open_channel(port, seen, "00" * 32)  # a third party's guess
            held.append(s)
            self.assertEqual((answer["type"], answer.get("code")), ("reject", "permission_denied"), answer)
            self.assertIn("auth.proof", answer["message"])
            key = channel_key_of(welcome, t["token"])
            data, ok = wireproof.open_channel(port, seen, key)  # the token holder's channel 0 is still free
            held.append(data)
            self.assertEqual(ok["type"], "welcome", ok)
            s, again = wireproof.open_channel(port, dict(seen, nonce=ok["nonce"]), key, proof=ok["sent"])  # a replay
            held.append(s)
            self.assertEqual((again["type"], again.get("code")), ("reject", "permission_denied"), again)
            self.assertIn("auth.proof", again["message"])
            # Counted once the reject is out: waited for, bounded.
            deadline = time.monotonic() + 5
            while parse_prometheus(self.b.metrics())[0].get(auth, 0) - before < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(parse_prometheus(self.b.metrics())[0].get(auth, 0) - before, 2.0)
        finally:
            for s in held:
                s.close()
            ctl.close()
            self.b.call("DELETE", "/v1/pathchecks/" + t["id"])

    def test_a_check_cancelled_mid_stream_stops_both_ends_and_frees_everything(self):
        fds_a, fds_b = self.a.fd_count(), self.b.fd_count()
        sid, tid = start_pair(self.a, self.b, bytes="48Gi", chunkSize="1Mi", timeoutSeconds=300)
        wait_check(self.a, sid, phases=("Migrating",), pred=lambda st: st["bytesSent"] > 32 * MiB, timeout=30)
        started = time.monotonic()
        st = self.a.call("DELETE", "/v1/pathchecks/" + sid)
        self.assertEqual(st["phase"], "Cancelled", st)
        tst = wait_check(self.b, tid, timeout=10)
        print("\ncancelled:", st, "\ntarget:", tst, "after %.2f s" % (time.monotonic() - started))
        self.assertIn(tst["phase"], ("Cancelled", "Failed"))
        self.assertIn("cancelled", tst["error"])
        self.assertLess(st["bytesSent"], 48 << 30)
        # Nothing left: the data-plane connections are closed on both agents and the buffers freed.
        deadline = time.monotonic() + 10
        while (self.a.fd_count() > fds_a or self.b.fd_count() > fds_b) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertLessEqual(self.a.fd_count(), fds_a)
        self.assertLessEqual(self.b.fd_count(), fds_b)
        self.assertGreaterEqual(metric(self.a, "rdmig_pathchecks_finished_total", role="source", result="cancelled"), 1)

    def test_a_stream_that_stalls_fails_naming_the_stall_not_the_deadline(self):
        # The target agent frozen mid-stream (SIGSTOP: a wedged node, or a path that stops
        # carrying): before, the source waited out timeoutSeconds and said only "deadline".
        import signal
        sid, tid = start_pair(self.a, self.b, bytes="48Gi", chunkSize="1Mi", timeoutSeconds=300)
        wait_check(self.a, sid, phases=("Migrating",), pred=lambda st: st["bytesSent"] > 32 * MiB, timeout=30)
        self.b.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            st = wait_check(self.a, sid, timeout=60)
            took = time.monotonic() - started
        finally:
            self.b.proc.send_signal(signal.SIGCONT)
        print("\nstalled:", st, "after %.1f s" % took)
        self.assertEqual(st["phase"], "Failed", st)
        self.assertIn("the tcp path to ", st["error"])
        self.assertIn("stalled: no byte sent for 10 s", st["error"])
        self.assertLess(took, 30)
        self.assertEqual(wait_check(self.b, tid, timeout=30)["phase"], "Failed")
        # Both serve on.
        sid, tid = start_pair(self.a, self.b, bytes="8Mi")
        self.assertEqual(wait_check(self.a, sid)["phase"], "Succeeded")
        self.assertEqual(wait_check(self.b, tid)["bytesVerified"], 8 * MiB)

    def test_a_check_is_refused_beside_a_running_migration_unless_allowed(self):
        qmp = os.path.join(tempfile.mkdtemp(prefix="rdmig-pc-qmp-"), "dst.qmp")
        fake = FakeIncomingQemu(qmp)
        m = self.b.create({"role": "target", "qmpSocket": qmp, "completionTimeoutSeconds": 60})
        try:
            status, body = self.b.request("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi"})
            self.assertEqual(status, 409, body)
            self.assertIn("runs 1 migration", body["error"]["message"])
            self.assertIn("allowDuringMigrations", body["error"]["message"])
            sid, tid = start_pair(self.a, self.b, bytes="8Mi", allowDuringMigrations=True)
            st = wait_check(self.a, sid)
            self.assertEqual(st["phase"], "Succeeded", st)
            self.assertEqual(wait_check(self.b, tid)["phase"], "Succeeded")
        finally:
            self.b.cancel(m["id"])
            self.b.wait(m["id"], timeout=30)
            fake.close()

    def test_hostile_requests_are_refused_naming_the_cause(self):
        cases = [
            ({"role": "target", "bytes": "65Gi"}, 400, "bytes"),
            ({"role": "target", "bytes": 0}, 400, "bytes"),
            ({"role": "target", "chunkSize": 12345}, 400, "chunkSize"),
            ({"role": "target", "channels": 1000}, 400, "channels"),
            ({"role": "target", "transport": "smoke-signals"}, 400, "transport"),
            ({"role": "observer"}, 400, "role"),
            ({"role": "source"}, 400, "target"),
            ({"role": "target", "extra": 1}, 400, "extra"),
            # Within the bounds, but never within this agent's buffer budget (2Gi by default).
            ({"role": "target", "chunkSize": "1Gi", "ringDepth": 16}, 422, "bufferBudget"),
        ]
        for body, want, word in cases:
            status, reply = self.a.request("POST", "/v1/pathchecks", body)
            self.assertEqual(status, want, (body, reply))
            self.assertIn(word, reply["error"]["message"], (body, reply))
        status, reply = self.a.request("POST", "/v1/pathchecks", raw=b"{not json")
        self.assertEqual(status, 400)
        self.assertIn("JSON", reply["error"]["message"])
        status, _ = self.a.request("POST", "/v1/pathchecks", {"role": "target"}, token=None)
        self.assertEqual(status, 401)
        status, _ = self.a.request("GET", "/v1/pathchecks", token="wrong")
        self.assertEqual(status, 403)
        status, reply = self.a.request("GET", "/v1/pathchecks/nope")
        self.assertEqual(status, 404)
        status, reply = self.a.request("DELETE", "/v1/pathchecks/nope")
        self.assertEqual(status, 404)

    def test_at_most_four_checks_run_at_once_on_an_agent(self):
        ids = []
        for _ in range(4):
            ids.append(self.a.call("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi", "timeoutSeconds": 30,
                                                               "chunkSize": "64Ki"})["id"])
        status, reply = self.a.request("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi", "chunkSize": "64Ki"})
        self.assertEqual(status, 429, reply)
        self.assertIn("at most 4", reply["error"]["message"])
        for cid in ids:
            self.assertEqual(self.a.call("DELETE", "/v1/pathchecks/" + cid)["phase"], "Cancelled")
        # Room again once they ended.
        cid = self.a.call("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi", "chunkSize": "64Ki"})["id"]
        self.a.call("DELETE", "/v1/pathchecks/" + cid)


class PathCheckLimitsTest(unittest.TestCase):
    """An agent whose pathCheck keys are set below their defaults applies them in both roles."""

    LIMITS = {"maxConcurrent": 1, "historySize": 2, "defaultBytes": "8Mi", "maxBytes": "32Gi", "maxChannels": 2,
              "defaultTimeoutSeconds": 30, "maxTimeoutSeconds": 60, "stallTimeoutSeconds": 2, "rttSamples": 3}

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-pathcheck-limits-")
        token = "tok-" + os.urandom(8).hex()
        cls.limited = Agent(cls.tmp, "agent-limited", token=token, config={"pathCheck": cls.LIMITS})
        cls.peer = Agent(cls.tmp, "agent-peer", token=token)

    @classmethod
    def tearDownClass(cls):
        for agent in (cls.limited, cls.peer):
            agent.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_requests_over_the_configured_bounds_are_refused_naming_the_key(self):
        for body, key in [({"role": "target", "bytes": "33Gi"}, "pathCheck.maxBytes"),
                          ({"role": "target", "channels": 3}, "pathCheck.maxChannels"),
                          ({"role": "target", "timeoutSeconds": 61}, "pathCheck.maxTimeoutSeconds")]:
            status, reply = self.limited.request("POST", "/v1/pathchecks", body)
            self.assertEqual(status, 400, (body, reply))
            self.assertIn(key, reply["error"]["message"], (body, reply))
        # The defaults agent/agent.yaml gives (64Gi, 16 channels) pass on the other agent.
        status, reply = self.peer.request("POST", "/v1/pathchecks", {"role": "target", "bytes": "33Gi",
                                                                      "channels": 3, "chunkSize": "64Ki"})
        self.assertEqual(status, 201, reply)
        self.peer.call("DELETE", "/v1/pathchecks/" + reply["id"])

    def test_default_bytes_max_concurrent_rtt_samples_and_history_are_the_configured_ones(self):
        cid = self.limited.call("POST", "/v1/pathchecks", {"role": "target", "chunkSize": "64Ki"})["id"]
        st = self.limited.call("GET", "/v1/pathchecks/" + cid)
        self.assertEqual(st["bytes"], 8 * MiB, st)
        status, reply = self.limited.request("POST", "/v1/pathchecks", {"role": "target", "chunkSize": "64Ki"})
        self.assertEqual(status, 429, reply)
        self.assertIn("at most 1, pathCheck.maxConcurrent", reply["error"]["message"])
        self.limited.call("DELETE", "/v1/pathchecks/" + cid)
        for _ in range(3):
            # Both ends must ask the same bytes: the peer's default is 1Gi.
            sid, tid = start_pair(self.limited, self.peer, bytes="8Mi", chunkSize="64Ki")
            self.assertEqual(wait_check(self.limited, sid)["phase"], "Succeeded")
            self.assertEqual(wait_check(self.peer, tid)["bytesVerified"], 8 * MiB)
        self.assertIn("rtt_samples=3", self.limited.log_text())
        # Every check on this agent has ended: the list keeps the last historySize (2) of them, not
        # one more until the next create (issue 38); an older one is gone for GET too.
        items = self.limited.call("GET", "/v1/pathchecks")["items"]
        self.assertEqual([c["phase"] for c in items], ["Succeeded", "Succeeded"], items)
        self.assertEqual(self.limited.request("GET", "/v1/pathchecks/" + cid)[0], 404)

    def test_a_stream_that_stalls_fails_after_the_configured_stall_timeout(self):
        import signal
        sid, tid = start_pair(self.limited, self.peer, bytes="30Gi", chunkSize="1Mi", timeoutSeconds=60)
        wait_check(self.limited, sid, phases=("Migrating",), pred=lambda st: st["bytesSent"] > 32 * MiB, timeout=30)
        self.peer.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            st = wait_check(self.limited, sid, timeout=40)
            took = time.monotonic() - started
        finally:
            self.peer.proc.send_signal(signal.SIGCONT)
        self.assertEqual(st["phase"], "Failed", st)
        self.assertIn("stalled: no byte sent for 2 s", st["error"])
        # 2 s without a byte, then up to 5 s for the frozen target's verdict; 15 s with the default.
        self.assertLess(took, 12, "the stall limit is 2 s here, not the default 10 s")
        self.assertEqual(wait_check(self.peer, tid, timeout=30)["phase"], "Failed")


class PathCheckDialPolicyTest(unittest.TestCase):
    """POST /v1/pathchecks role source names a target.endpoint the agent then dials from its host
    network: the dial policy refuses what is not a peer agent's address with 400 before anything
    is connected (issue 38, item 2)."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="rdmig-pathcheck-dial-")
        self.world = DialPolicyNamespace(self.tmp, "no-lab")

    def tearDown(self):
        self.world.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_a_source_check_never_dials_what_the_dial_policy_refuses(self):
        agent = self.world.agent

        def post(ep):
            return agent.request("POST", "/v1/pathchecks", {
                "role": "source", "bytes": "1Mi", "chunkSize": "64Ki", "timeoutSeconds": 10,
                "target": {"endpoint": ep, "checkId": "c-" + os.urandom(4).hex(), "token": "t" * 32}})
        control = self.world.assert_refused_without_dialling(self, post)
        # The listener closed the control's connection: it fails (or is cancelled) and is the only one.
        agent.call("DELETE", "/v1/pathchecks/" + control["id"])
        self.assertIn(wait_check(agent, control["id"])["phase"], ("Cancelled", "Failed"))
        self.assertEqual([c["id"] for c in agent.call("GET", "/v1/pathchecks")["items"]], [control["id"]])


RDMA_DEV = os.environ.get("RDMIG_RDMA_DEV", "")


@unittest.skipUnless(os.environ.get("RDMIG_PATHCHECK_TRANSPORT") == "rdma",
                     "needs an RDMA device: runs in the Soft-RoCE VM (tests/rdma/pathcheck-tests.sh)")
class PathCheckRdmaTest(unittest.TestCase):
    """Both agents on the VM's one rxe device (each its own rdma_cm port), a third without RDMA."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-pathcheck-rdma-")
        token = "tok-" + os.urandom(8).hex()
        rdma = {"transport": "auto", "rdma": {"device": RDMA_DEV}, "dataPlane": {"rdmaPort": 0}}
        cls.a = Agent(cls.tmp, "agent-a", token=token, config=rdma, log_level="debug")
        cls.b = Agent(cls.tmp, "agent-b", token=token, config=rdma, log_level="debug")
        # RDMA broken on this one: transport auto, but rdma.device names no device.
        cls.n = Agent(cls.tmp, "agent-nordma", token=token, log_level="debug",
                      config={"transport": "auto", "rdma": {"device": "no-such-device"}})

    @classmethod
    def tearDownClass(cls):
        for agent in (cls.a, cls.b, cls.n):
            agent.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_a_pair_over_rdma_verifies_every_byte_and_names_both_ports(self):
        before = metric(self.a, "rdmig_transferred_bytes_total", transport="rdma", direction="sent", traffic="pathcheck")
        sid, tid = start_pair(self.a, self.b, bytes="64Mi", chunkSize="1Mi", channels=2)
        src, dst = wait_check(self.a, sid, timeout=120), wait_check(self.b, tid, timeout=120)
        print("\nsource:", src, "\ntarget:", dst)
        self.assertEqual((src["phase"], dst["phase"]), ("Succeeded", "Succeeded"), (src, dst))
        self.assertEqual((src["transport"], src["transportReason"]), ("rdma", "auto-both-rdma"))
        self.assertEqual(dst["bytesVerified"], 64 * MiB)
        self.assertGreater(src["throughputBytesPerSecond"], 0)
        for end in (src["localRdma"], src["peerRdma"], dst["localRdma"]):
            self.assertEqual(end["device"], RDMA_DEV)
            self.assertIn(end["mtu"], (256, 512, 1024, 2048, 4096))
            self.assertTrue(end["gid"].startswith("0000:0000:0000:0000:0000:ffff:"), end)
        self.assertGreaterEqual(metric(self.a, "rdmig_transferred_bytes_total", transport="rdma", direction="sent",
                                       traffic="pathcheck") - before, 64 * MiB)

    def test_a_pair_whose_target_has_no_rdma_falls_back_with_the_reason_or_fails_when_rdma_is_required(self):
        sid, _ = start_pair(self.a, self.n, bytes="8Mi")
        st = wait_check(self.a, sid, timeout=60)
        self.assertEqual(st["phase"], "Succeeded", st)
        self.assertEqual((st["transport"], st["transportReason"]), ("tcp", "auto-no-peer-rdma:no-device"))
        started = time.monotonic()
        sid, tid = start_pair(self.a, self.n, bytes="8Mi", transport="rdma", timeoutSeconds=20)
        st = wait_check(self.a, sid, timeout=30)
        print("\nrdma required:", st, "after %.1f s" % (time.monotonic() - started))
        self.assertEqual(st["phase"], "Failed")
        self.assertIn("refused the check", st["error"])
        self.assertIn("rdma", st["error"].lower())
        self.assertLess(time.monotonic() - started, 20)
        self.n.call("DELETE", "/v1/pathchecks/" + tid)

    def test_tls_over_tcp_hands_its_records_to_the_kernel_when_the_kernel_has_tls(self):
        """tls.ko (and gcm(aes)'s modules) are loaded at the VM's boot (tests/rdma/build-initramfs.sh):
        both ends of a TLS check must say the kernel encrypts what they send. Then, with tls.ko removed, the same check says user
        space; the CPU both agents spent per GiB in each mode, and in clear, is printed."""
        with open("/proc/sys/net/ipv4/tcp_available_ulp") as f:
            self.assertIn("tls", f.read().split())
        tls = [Agent(self.tmp, "agent-ktls-%s" % n, config={"dataPlane": {"tls": "on"}}) for n in "ab"]
        for a in tls:
            self.addCleanup(a.stop)

        def cpu(agents):
            total = 0
            for a in agents:
                with open("/proc/%d/stat" % a.proc.pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime + stime, clock ticks
            return total / os.sysconf("SC_CLK_TCK")

        def run(pair, label):
            before = cpu(pair)
            sid, tid = start_pair(pair[0], pair[1], bytes="128Mi", chunkSize="1Mi", channels=2, transport="tcp")
            src, dst = wait_check(pair[0], sid, timeout=180), wait_check(pair[1], tid, timeout=180)
            self.assertEqual((src["phase"], dst["phase"]), ("Succeeded", "Succeeded"), (src, dst))
            self.assertEqual(dst["bytesVerified"], 128 * MiB)
            per_gib = (cpu(pair) - before) * 8  # 128 MiB
            print("\n%-16s encryption %-18s %.2f CPU-s/GiB (both agents), %.0f MiB/s" %
                  (label, src.get("encryption", "none"), per_gib, src["throughputBytesPerSecond"] / MiB))
            return src, dst, per_gib

        src, dst, kernel = run(tls, "kernel TLS")
        # Debian 12's OpenSSL 3.0 hands the kernel the sending direction of TLS 1.3 only (receiving
        # needs OpenSSL 3.2): each agent's records go out encrypted by the kernel.
        self.assertEqual((src["encryption"], dst["encryption"]), ("tls (kernel send)", "tls (kernel send)"))
        for a in tls:
            self.assertEqual(metric(a, "rdmig_tls_channels_total", mode="kernel_send"), 2)
            self.assertEqual(metric(a, "rdmig_tls_channels_total", mode="user_space"), 0)
        # Without tls.ko (and no modprobe in the VM to load it again) OpenSSL keeps the records.
        with open("/etc/rdmig-vm/modules") as f:
            ko = [line.strip() for line in f if line.strip().endswith("/tls.ko")][0]
        deadline = time.monotonic() + 10
        while subprocess.run(["rmmod", "tls"], capture_output=True).returncode != 0:
            self.assertLess(time.monotonic(), deadline, "tls.ko still in use 10 s after the check ended")
            time.sleep(0.1)
        self.addCleanup(subprocess.run, ["insmod", ko], check=True)
        src, dst, user = run(tls, "user-space TLS")
        self.assertEqual((src["encryption"], dst["encryption"]), ("tls (user space)", "tls (user space)"))
        for a in tls:
            self.assertEqual(metric(a, "rdmig_tls_channels_total", mode="user_space"), 2)
        _, _, clear = run((self.a, self.b), "clear TCP")
        print("kernel TLS / user-space TLS CPU: %.2f; kernel TLS / clear: %.2f" % (kernel / user, kernel / clear))


if __name__ == "__main__":
    timed.main()
