"""Runs in both VMs of run-two-vms.sh: a bare-QEMU migration between two nodes, each with its
own kernel, network stack, rxe device, rdmig-agent and QEMU.

Node a: the source agent (rxea, 10.99.1.1) and the source QEMU; it drives the test through
both agents' REST APIs, as the controller does. Node b: the target agent (rxeb, 10.99.1.2)
and the target QEMU (``-incoming defer -S``); it answers node a through the shared folder
(the target QMP socket, the target memory's digest, its rxe counters).
Checked per migration (0 and 4 multifd channels): both agents report transport rdma; the
source QEMU's memory equals the target's, byte for byte; the target resumes; the agents'
rdma byte counters agree; and both rxe devices' hw counters rose by at least the packets the
migrated bytes need (sent on rxea, received on rxeb), so the bytes crossed between the two
devices over RDMA.
  python3 test_agent_rdma_two_nodes.py  (RDMIG_AGENT, RDMIG_TOOLS, RDMIG_NODE, RDMIG_OUT)
"""
import json
import os
import shutil
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.environ.get("RDMIG_TOOLS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")))
from rdmiglab import Agent, QemuVm, migrate_via_agents, parse_prometheus  # noqa: E402

MEM_MIB = 128
MULTIFD = (0, 4)
NODE = os.environ["RDMIG_NODE"]
PEER = "b" if NODE == "a" else "a"
DEV = os.environ["RDMIG_RDMA_DEV"]
ADDR = os.environ["RDMIG_VM_ADDR"]
PEER_ADDR = os.environ["RDMIG_VM_PEER_ADDR"]
RDV = os.path.join(os.environ["RDMIG_OUT"], "rdv")
os.makedirs(RDV, exist_ok=True)


def post(name, value):
    """Publishes NAME for the other node (written aside, then renamed: never seen half-written)."""
    tmp = os.path.join(RDV, ".%s.%s.tmp" % (name, NODE))
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.rename(tmp, os.path.join(RDV, name))


def await_(name, timeout=300.0):
    path = os.path.join(RDV, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if os.path.exists(os.path.join(RDV, "failed-" + PEER)):
            raise RuntimeError("waiting for %s: node %s failed" % (name, PEER))
        if time.monotonic() > deadline:
            raise TimeoutError("node %s did not post %s within %.0fs" % (PEER, name, timeout))
        time.sleep(0.2)
    with open(path) as f:
        return json.load(f)


def hw_counters():
    base = "/sys/class/infiniband/%s/ports/1/hw_counters/" % DEV
    with open(base + "sent_pkts") as s, open(base + "rcvd_pkts") as r:
        return {"sent": int(s.read()), "rcvd": int(r.read())}


def agent_config():
    # The REST API on every address (node a calls node b's); the data plane on eth0's address,
    # which is also what the target advertises to the source.
    return {"transport": "rdma", "rdma": {"device": DEV},
            "api": {"address": "0.0.0.0"},
            "dataPlane": {"address": ADDR, "advertiseAddress": ADDR, "rdmaPort": 0}}


class PeerAgent(Agent):
    """The agent on the other node, reached over the link through its REST API."""

    def __init__(self, host, api_port, token):  # pylint: disable=super-init-not-called
        self.name, self.host, self.api_port, self.token = "agent-" + PEER, host, api_port, token
        self.tls = self.ssl_context = self.proc = None

    @property
    def url(self):
        return "http://%s:%d" % (self.host, self.api_port)

    def alive(self):
        return True

    def log_text(self):
        return "(node %s's agent log is on its console)" % PEER


def rdma_bytes(agent, direction):
    samples, _ = parse_prometheus(agent.metrics())
    return samples.get(("rdmig_transferred_bytes_total",
                        frozenset({"transport": "rdma", "direction": direction, "traffic": "migration"}.items())), 0)


def serve_target():
    """Node b: the target side of each migration node a runs. Returns the exit status."""
    tmp = tempfile.mkdtemp(prefix="rdmig-rdma-b-")
    agent = Agent(tmp, "agent-b", config=agent_config(), log_level="debug")
    ok = True
    try:
        post("agent-b", {"port": agent.api_port, "token": agent.token})
        for seq in range(len(MULTIFD)):  # in the order node a's tests ask for them
            m = await_("want-%d" % seq, 600)
            dst = QemuVm(tmp, "dst%d" % m, mem_mib=MEM_MIB, firmware_only=True,
                         incoming_defer=True, paused=True)
            try:
                before = hw_counters()
                post("dst-%d" % m, dst.agent_qmp_path)
                outcome = await_("migrated-%d" % m, 600)
                after = hw_counters()
                reply = {"sent": after["sent"] - before["sent"], "rcvd": after["rcvd"] - before["rcvd"],
                         "status": dst.status()}
                if outcome == "ok":
                    reply["digest"] = dst.memory_digest()
                else:
                    ok = False
                    print(agent.log_text()[-4000:])
                post("dst-state-%d" % m, reply)
                if outcome == "ok":
                    await_("compared-%d" % m, 300)
                    dst.cont()
                    post("dst-resumed-%d" % m, dst.status())
            finally:
                dst.kill()
        await_("done", 300)
    except Exception as e:  # noqa: BLE001 - report and tell node a
        print("node b: %s: %s" % (type(e).__name__, e))
        print(agent.log_text()[-4000:])
        post("failed-b", str(e))
        ok = False
    finally:
        agent.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


class TwoNodeAgentRdmaTest(unittest.TestCase):
    """Node a: the source side, and the checks."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-rdma-a-")
        cls.blob = os.path.join(cls.tmp, "blob.bin")
        with open(cls.blob, "wb") as f:
            f.write(os.urandom(64 << 20))
        cls.a = Agent(cls.tmp, "agent-a", config=agent_config(), log_level="debug")
        b = await_("agent-b", 300)
        cls.b = PeerAgent(PEER_ADDR, b["port"], b["token"])

    def setUp(self):
        self.vms = []

    def tearDown(self):
        for vm in self.vms:
            vm.kill()

    @classmethod
    def tearDownClass(cls):
        post("done", True)
        cls.a.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    asked = 0

    def migrate(self, m):
        post("want-%d" % TwoNodeAgentRdmaTest.asked, m)
        TwoNodeAgentRdmaTest.asked += 1
        src = QemuVm(self.tmp, "src%d" % m, mem_mib=MEM_MIB, firmware_only=True, blob=self.blob)
        self.vms.append(src)
        outcome = "failed"
        try:
            self.assertEqual(src.status(), "running")
            dst_qmp = await_("dst-%d" % m, 300)
            before = hw_counters()
            sent_a, recv_b = rdma_bytes(self.a, "sent"), rdma_bytes(self.b, "received")
            metrics_a = self.source_metrics()
            s, t = migrate_via_agents(self.a, self.b, src.agent_qmp_path, dst_qmp,
                                      multifd_channels=m, chunk_size="1Mi", ring_depth=8,
                                      vm="two-node-vm-%d" % m, transport="rdma", timeout=400)
            after = hw_counters()
            if s["phase"] != "Succeeded":
                print(self.a.log_text()[-4000:])
            else:
                outcome = "ok"
        finally:
            post("migrated-%d" % m, outcome)
        try:
            self.assertEqual(s["phase"], "Succeeded", s["result"]["reason"])
            self.assertEqual(t["phase"], "Succeeded", t["result"]["reason"])
            self.assertEqual(s["transport"], "rdma")
            self.assertEqual(t["transport"], "rdma")
            self.assertEqual(s["channels"], m + 1)
            moved = s["progress"]["dataBytesSent"]
            self.assertEqual(moved, t["progress"]["dataBytesReceived"])
            self.assertGreater(moved, 64 << 20)
            # Both agents counted these bytes as rdma (deltas: each test stands on its own).
            self.assertGreaterEqual(rdma_bytes(self.a, "sent") - sent_a, moved)
            self.assertGreaterEqual(rdma_bytes(self.b, "received") - recv_b, moved)
            delta = {k: v - metrics_a[k] for k, v in self.source_metrics().items()}
            self.assertGreater(delta["write_latency_count"], 0)
            self.assertEqual(delta["selected_requested"], 1)
            self.assertEqual(src.status(), "postmigrate")
            dst = await_("dst-state-%d" % m, 400)
            self.assertEqual(dst["status"], "paused")
            self.assertEqual(src.memory_digest(), dst["digest"], "memory differs between the nodes")
            # rxea sent and rxeb received at least one packet per 4096 bytes (the largest RoCE MTU).
            sent = after["sent"] - before["sent"]
            print("multifd=%d: %d bytes over rdma; rxea sent_pkts +%d rcvd_pkts +%d; rxeb sent_pkts +%d rcvd_pkts +%d"
                  % (m, moved, sent, after["rcvd"] - before["rcvd"], dst["sent"], dst["rcvd"]))
            self.assertGreaterEqual(sent, moved // 4096, "rxea sent too few packets")
            self.assertGreaterEqual(dst["rcvd"], moved // 4096, "rxeb received too few packets")
        finally:
            post("compared-%d" % m, True)
        self.assertEqual(await_("dst-resumed-%d" % m, 120), "running")
        print("multifd=%d: total %s ms, downtime %s ms, %d bytes, %d chunks"
              % (m, s["result"]["totalTimeMs"], s["result"]["downtimeMs"], moved, s["progress"]["chunksSent"]))

    def source_metrics(self):
        samples, _ = parse_prometheus(self.a.metrics())

        def get(name, **labels):
            return samples.get((name, frozenset(labels.items())), 0)
        return {"write_latency_count": get("rdmig_chunk_write_latency_seconds_count", transport="rdma"),
                "selected_requested": get("rdmig_transport_selected_total", transport="rdma", reason="requested")}

    def test_migrates_between_two_nodes_without_multifd(self):
        self.migrate(0)

    def test_migrates_between_two_nodes_with_4_multifd_channels(self):
        self.migrate(4)


if __name__ == "__main__":
    if NODE == "b":
        sys.exit(serve_target())
    result = unittest.main(verbosity=2, exit=False).result
    if not result.wasSuccessful():
        post("failed-a", "tests failed")
        sys.exit(1)
