"""Runs in both VMs of run-two-vms.sh: a path check between two nodes, each with its own kernel,
network stack, rxe device and rdmig-agent (docs/pathcheck.md).

Node a: the source agent (rxea, 10.99.1.1); it drives the check through both agents' REST APIs,
as the controller does. Node b: the target agent (rxeb, 10.99.1.2); it answers node a through the
shared folder (its agent's port and token, its rxe counters).
Checked: the pair passes over RDMA (auto-both-rdma) with every byte verified on node b; each end
reports its own device, port, GID (the RoCE v2 GID of its own address) and MTU; both agents count
the bytes under traffic="pathcheck"; and rxea sent / rxeb received at least the packets the bytes
need, so the stream crossed between the two devices.
Then RDMA between the nodes breaks mid-stream (node b drops RoCE v2 with nftables while a long
check runs): the check fails within seconds, long before its timeoutSeconds, with an error that
names the stalled path, both ends end, the agents keep serving, and once the link is back a new check passes.
  python3 test_pathcheck_rdma_two_nodes.py  (RDMIG_AGENT, RDMIG_TOOLS, RDMIG_NODE, RDMIG_OUT)
"""
import ipaddress
import os
import shutil
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_agent_rdma_two_nodes import (ADDR, DEV, NODE, PEER_ADDR, PeerAgent, await_, cut_rdma,  # noqa: E402
                                       hw_counters, post, uncut_rdma)
from rdmiglab import Agent, parse_prometheus  # noqa: E402

BYTES = 128 << 20


def agent_config():
    return {"transport": "auto", "rdma": {"device": DEV}, "api": {"address": "0.0.0.0"},
            "dataPlane": {"address": ADDR, "advertiseAddress": ADDR, "rdmaPort": 0}}


def gid_of(ip):
    """The RoCE v2 GID of an IPv4 address, as sysfs writes GIDs."""
    raw = b"\0" * 10 + b"\xff\xff" + ipaddress.IPv4Address(ip).packed
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def pathcheck_bytes(agent, direction):
    samples, _ = parse_prometheus(agent.metrics())
    return samples.get(("rdmig_transferred_bytes_total",
                        frozenset({"transport": "rdma", "direction": direction, "traffic": "pathcheck"}.items())), 0)


def serve_target():
    tmp = tempfile.mkdtemp(prefix="rdmig-pc-b-")
    agent = Agent(tmp, "agent-b", config=agent_config(), log_level="debug")
    ok = True
    try:
        post("agent-b", {"port": agent.api_port, "token": agent.token})
        for seq in range(2):
            await_("want-counters-%d" % seq, 600)
            post("counters-%d" % seq, hw_counters())
        # The link breaks mid-stream, then comes back.
        await_("want-cut", 600)
        cut_rdma()
        post("cut", True)
        await_("want-uncut", 600)
        post("uncut", uncut_rdma())
        await_("done", 300)
    except Exception as e:  # noqa: BLE001 - report and tell node a
        print("node b: %s: %s" % (type(e).__name__, e))
        post("failed-b", str(e))
        ok = False
    finally:
        print(agent.log_text()[-3000:])
        agent.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


class TwoNodePathCheckTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-pc-a-")
        cls.a = Agent(cls.tmp, "agent-a", config=agent_config(), log_level="debug")
        b = await_("agent-b", 300)
        cls.b = PeerAgent(PEER_ADDR, b["port"], b["token"])

    @classmethod
    def tearDownClass(cls):
        post("done", True)
        cls.a.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def start(self, nbytes, **extra):
        """Starts a check of `nbytes` from node a to node b, as the controller does; returns the
        source's and the target's ids."""
        spec = dict({"bytes": nbytes, "chunkSize": "1Mi", "channels": 2}, **extra)
        t = self.b.call("POST", "/v1/pathchecks", dict(spec, role="target"))
        s = self.a.call("POST", "/v1/pathchecks", dict(spec, role="source", target={
            "endpoint": t["endpoint"], "checkId": t["checkId"], "token": t["token"]}))
        return s["id"], t["id"]

    def settle(self, agent, check_id, timeout=300):
        deadline = time.monotonic() + timeout
        while True:
            st = agent.call("GET", "/v1/pathchecks/" + check_id)
            if st["phase"] in ("Succeeded", "Failed", "Cancelled") or time.monotonic() > deadline:
                return st
            time.sleep(0.2)

    def test_a_pair_between_two_rdma_devices_passes_and_names_each_end(self):
        post("want-counters-0", True)
        b_before = await_("counters-0")
        a_before = hw_counters()
        sent_before = pathcheck_bytes(self.a, "sent")
        sid, tid = self.start(BYTES)
        src = self.settle(self.a, sid)
        dst = self.b.call("GET", "/v1/pathchecks/" + tid)
        a_after = hw_counters()
        post("want-counters-1", True)
        b_after = await_("counters-1")
        print("\nsource:", src, "\ntarget:", dst)
        self.assertEqual(src["phase"], "Succeeded", src)
        self.assertEqual(dst["phase"], "Succeeded", dst)
        self.assertEqual((src["transport"], src["transportReason"]), ("rdma", "auto-both-rdma"))
        self.assertEqual(dst["bytesVerified"], BYTES)
        self.assertGreater(src["throughputBytesPerSecond"], 0)
        self.assertGreater(src["rttMicroseconds"], 0)
        self.assertEqual(src["localRdma"]["device"], DEV)
        self.assertEqual(src["localRdma"]["gid"], gid_of(ADDR))
        self.assertEqual(src["peerRdma"]["gid"], gid_of(PEER_ADDR))
        self.assertNotEqual(src["peerRdma"]["device"], DEV)  # rxeb: the other node's device
        self.assertEqual(dst["localRdma"], src["peerRdma"])
        self.assertEqual(src["localRdma"]["mtu"], src["peerRdma"]["mtu"])
        self.assertGreaterEqual(pathcheck_bytes(self.a, "sent") - sent_before, BYTES)
        sent, rcvd = a_after["sent"] - a_before["sent"], b_after["rcvd"] - b_before["rcvd"]
        print("rxea sent_pkts +%d, rxeb rcvd_pkts +%d for %d bytes" % (sent, rcvd, BYTES))
        self.assertGreaterEqual(sent, BYTES // 4096, "rxea sent too few packets")
        self.assertGreaterEqual(rcvd, BYTES // 4096, "rxeb received too few packets")

    def test_b_rdma_broken_mid_stream_fails_the_check_within_its_deadline_naming_why(self):
        timeout = 60
        sid, tid = self.start(64 << 30, timeoutSeconds=timeout)  # far more than fits in the time
        deadline = time.monotonic() + 120
        while self.a.call("GET", "/v1/pathchecks/" + sid).get("bytesSent", 0) < (8 << 20):
            self.assertLess(time.monotonic(), deadline, "the check never got going")
            time.sleep(0.1)
        post("want-cut", True)
        await_("cut", 60)
        t0 = time.monotonic()
        src = self.settle(self.a, sid, timeout + 30)
        took = time.monotonic() - t0
        dst = self.settle(self.b, tid, 30)
        post("want-uncut", True)
        dropped = await_("uncut", 60)
        print("\nRoCE v2 dropped mid-stream (%d packets): source %s after %.1f s (%s), target %s (%s)"
              % (dropped, src["phase"], took, src.get("error"), dst["phase"], dst.get("error")))
        self.assertEqual(src["phase"], "Failed", src)
        # Not the deadline: the stall, named, within seconds (pathcheck::kStallLimit, 10 s).
        self.assertLess(took, 30, "the check waited for its deadline instead of naming the stall")
        self.assertIn("stalled", src["error"])
        self.assertIn("rdma path", src["error"])
        self.assertIn(dst["phase"], ("Failed", "Cancelled"), dst)
        self.assertTrue(dst.get("error"), dst)
        self.assertGreater(dropped, 0)
        self.assertLess(src["bytesSent"], 64 << 30)
        # Both agents serve on; with the link back, a new check passes over RDMA.
        sid, tid = self.start(16 << 20)
        src = self.settle(self.a, sid)
        self.assertEqual((src["phase"], src["transport"]), ("Succeeded", "rdma"), src)
        self.assertEqual(self.settle(self.b, tid)["bytesVerified"], 16 << 20)


if __name__ == "__main__":
    if NODE == "b":
        sys.exit(serve_target())
    result = unittest.main(verbosity=2, exit=False).result
    if not result.wasSuccessful():
        post("failed-a", "tests failed")
        sys.exit(1)
