"""Runs in both VMs of run-two-vms.sh: KubeVirt mode's relay between two nodes, each with its
own kernel, network stack, rxe device and rdmig-agent, and a network namespace standing in for
its virt-handler pod (its own address on a pod subnet, routed between the nodes over the link,
as a CNI routes pod IPs).

Node a: the source agent (rxea, 10.99.1.1; its hook socket) and "virt-handler" in pod
10.98.1.10, which calls the node hook with the VMI's migration (real gRPC) and then dials the
target proxy at 10.98.2.10 as KubeVirt's proxy does (4 connections, 8 MiB each); the agent's
nftables redirect in that namespace hands the connections to it. Node b: the target agent
(rxeb, 10.99.1.2), which dials the proxy stand-in inside node b's virt-handler namespace (a
sink that answers the SHA-256 of each connection).
Checked: every connection arrives byte-exact (the sink's digests); both agents' records say
carried and Succeeded over rdma (auto chose it); both agents counted the bytes as rdma, none as
tcp; rxea sent and rxeb received at least one packet per 4096 bytes carried, so the bytes
crossed between the two devices over RDMA. With two rails per node (run-two-vms.sh --rails 2:
rxea/rxeb on eth0, rxea2/rxeb2 on eth1; both agents list both under rdma.devices) the four
connections are striped over both (connection i on rail i mod 2, in both records), and on each
rail node a's device sent, and node b's received, the packets that rail's bytes need.
Then node b drops RoCE v2 (UDP 4791, nftables; TCP still works): the next migration is carried
over TCP, byte-exact, both records naming auto-no-peer-rdma:unreachable.
Both agents run unprivileged as the chart runs them in KubeVirt mode with RDMA (rdmiglab.profile,
"chart": DAC_OVERRIDE, IPC_LOCK, NET_ADMIN, SYS_ADMIN, SYS_PTRACE and no other capability, seccomp
RuntimeDefault, a read-only root), checked once started from their /proc status.
  python3 test_kubevirt_rdma_two_nodes.py REPO  (RDMIG_AGENT, RDMIG_NODE, RDMIG_OUT, RDMIG_IP)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

REPO = os.path.abspath(sys.argv.pop(1)) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else \
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tests", "rdma"))
from rdmiglab import Agent  # noqa: E402
from rdmiglab.kvhook import vmi_json  # noqa: E402
from rdmiglab.kvpod import wait_for  # noqa: E402
from test_agent_rdma_two_nodes import (ADDR, DEV, DEVS, NODE, PEER_ADDR, PeerAgent, await_, counters_delta,  # noqa: E402
                                       cut_rdma, hw_counters, post, rail_counters, transferred_bytes, uncut_rdma)

IP = os.environ.get("RDMIG_IP", "ip")
STREAMS = os.path.join(REPO, "tests", "kubevirt", "kv_streams.py")
HANDLER_NS = "virt-handler-pod"
# Each node's virt-handler pod: its address, and the node-side address its namespace routes via.
POD_IP = {"a": "10.98.1.10", "b": "10.98.2.10"}
POD_GW = {"a": "10.98.1.1", "b": "10.98.2.1"}
PEER = "b" if NODE == "a" else "a"
COUNT, BYTES = 4, 8 << 20
CASES = 2  # node a's tests, in name order: carried over rdma, then with RoCE v2 dropped on node b


def sh(*argv, ns=None):
    cmd = ([IP, "netns", "exec", ns] if ns else []) + list(argv)
    subprocess.run(cmd, check=True)


def virt_handler_pod():
    """This node's virt-handler pod network: a namespace with its own address on the pod subnet,
    and a route to the other node's pod subnet over the link (forwarding on)."""
    sh(IP, "netns", "add", HANDLER_NS)
    sh(IP, "link", "add", "vhpod0", "type", "veth", "peer", "name", "eth0", "netns", HANDLER_NS)
    sh(IP, "addr", "add", POD_GW[NODE] + "/24", "dev", "vhpod0")
    sh(IP, "link", "set", "vhpod0", "up")
    sh(IP, "link", "set", "lo", "up", ns=HANDLER_NS)
    sh(IP, "addr", "add", POD_IP[NODE] + "/24", "dev", "eth0", ns=HANDLER_NS)
    sh(IP, "link", "set", "eth0", "up", ns=HANDLER_NS)
    sh(IP, "route", "add", "default", "via", POD_GW[NODE], ns=HANDLER_NS)
    sh(IP, "route", "add", POD_GW[PEER].rsplit(".", 1)[0] + ".0/24", "via", PEER_ADDR)
    with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
        f.write("1\n")


def agent_config(peers=None, hook=""):
    # transport auto: RDMA is what the agents choose between the two devices, TCP when RoCE v2 is
    # dropped. The data plane on eth0's address, the REST API on every address (node a calls b's).
    # With two rails (run-two-vms.sh --rails 2) both devices, in the same order on both nodes.
    rdma = {"device": DEV} if len(DEVS) == 1 else {"devices": [{"device": d} for d in DEVS]}
    return {"transport": "auto", "rdma": rdma, "api": {"address": "0.0.0.0"},
            "dataPlane": {"address": ADDR, "advertiseAddress": ADDR, "rdmaPort": 0},
            "kubevirt": {"enabled": True, "nodeName": "node-" + NODE, "hookSocket": hook, "peers": peers or [],
                         "ruleTimeoutSeconds": 30, "sessionIdleSeconds": 1}}


def settled(agent, mig):
    items = agent.call("GET", "/v1/kubevirt/migrations?migrationUid=" + mig)["items"]
    return [r for r in items if r["phase"] not in ("Armed", "Carrying")]


def serve_target():
    """Node b: virt-handler's pod with the proxy stand-in, and the target agent."""
    tmp = tempfile.mkdtemp(prefix="rdmig-kv-b-")
    ok = True
    sink = agent = None
    try:
        virt_handler_pod()
        ready = os.path.join(tmp, "sink.json")
        sink = subprocess.Popen([IP, "netns", "exec", HANDLER_NS, sys.executable, STREAMS, "sink", "--ready", ready,
                                 "--log", os.path.join(tmp, "sink.log")])
        port = wait_for(lambda: os.path.exists(ready) and json.load(open(ready))["port"], 20, "the proxy stand-in")
        agent = Agent(tmp, "agent-b", config=agent_config(), log_level="debug", profile="chart")
        post("kv-agent-b", {"api": agent.api_port, "data": agent.data_port, "token": agent.token, "sink": port})
        for seq in range(CASES):
            want = await_("kv-want-%d" % seq, 600)
            cut = want["cutRdma"]
            if cut:
                cut_rdma()
            before, rails_before = hw_counters(), rail_counters()
            post("kv-ready-%d" % seq, True)
            await_("kv-dialled-%d" % seq, 600)
            after = hw_counters()
            reply = {"sent": after["sent"] - before["sent"], "rcvd": after["rcvd"] - before["rcvd"],
                     "byDevice": counters_delta(rails_before, rail_counters())}
            if cut:
                reply["rdmaDropped"] = uncut_rdma()
            post("kv-state-%d" % seq, reply)
        await_("kv-done", 300)
    except Exception as e:  # noqa: BLE001 - report and tell node a
        print("node b: %s: %s" % (type(e).__name__, e))
        if agent:
            print(agent.log_text()[-4000:])
        post("failed-b", str(e))
        ok = False
    finally:
        if agent:
            agent.stop()
        if sink:
            sink.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


class TwoNodeKubevirtRdmaTest(unittest.TestCase):
    """Node a: the source side, and the checks."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-kv-a-")
        virt_handler_pod()
        b = await_("kv-agent-b", 300)
        cls.sink_port = b["sink"]
        cls.hook = os.path.join(cls.tmp, "hook.sock")
        cls.a = Agent(cls.tmp, "agent-a", token=b["token"], log_level="debug", profile="chart", config=agent_config(
            peers=[{"node": "node-b", "agent": "%s:%d" % (PEER_ADDR, b["data"])}], hook=cls.hook))
        cls.b = PeerAgent(PEER_ADDR, b["api"], b["token"])

    @classmethod
    def tearDownClass(cls):
        post("kv-done", True)
        cls.a.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    asked = 0

    def counted(self):
        """The agents' byte counters: node a's sent and node b's received, by transport."""
        return {"%s/%s" % (node, t): transferred_bytes(agent, t, d)
                for node, agent, d in (("a", self.a, "sent"), ("b", self.b, "received")) for t in ("rdma", "tcp")}

    def carry(self, mig, cut_rdma=False):
        """One migration of prod/web-1 as KubeVirt runs it; returns the dial's outcome, both
        agents' settled records and the rxe packet counts of both nodes."""
        seq = TwoNodeKubevirtRdmaTest.asked
        TwoNodeKubevirtRdmaTest.asked += 1
        post("kv-want-%d" % seq, {"cutRdma": cut_rdma})
        await_("kv-ready-%d" % seq, 120)
        path = os.path.join(self.tmp, "vmi-%s.json" % mig)
        with open(path, "w") as f:
            json.dump(vmi_json("vmi-uid-2n", mig, POD_IP["b"], self.sink_port), f)
        before, bytes_before, rails_before = hw_counters(), self.counted(), rail_counters()
        try:
            p = subprocess.run([IP, "netns", "exec", HANDLER_NS, sys.executable, STREAMS, "dial", "--dest",
                                "%s:%d" % (POD_IP["b"], self.sink_port), "--count", str(COUNT), "--bytes", str(BYTES),
                                "--hook-socket", self.hook, "--vmi", path, "--timeout", "60"],
                               capture_output=True, text=True, timeout=300)
        finally:
            after, self.rails_moved = hw_counters(), counters_delta(rails_before, rail_counters())
            post("kv-dialled-%d" % seq, True)
        self.assertEqual(p.returncode, 0, p.stderr)
        res = json.loads(p.stdout)
        src = wait_for(lambda: settled(self.a, mig), 60, "the source record of " + mig)[0]
        dst = wait_for(lambda: settled(self.b, mig), 60, "the target record of " + mig)[0]
        moved = {k: n - bytes_before[k] for k, n in self.counted().items()}
        b = await_("kv-state-%d" % seq, 120)
        print("%s: transport %s (%s), %d bytes; rxea sent_pkts +%d, rxeb rcvd_pkts +%d; agents' byte counters %s"
              % (mig, src["transport"], src["transportReason"], src["bytesSent"], after["sent"] - before["sent"],
                 b["rcvd"], moved))
        self.assertTrue(res["hook"]["ok"], res)
        self.assertEqual([c["ok"] for c in res["connections"]], [True] * COUNT, res)
        for rec in (src, dst):
            self.assertTrue(rec["carried"], rec)
            self.assertEqual(rec["phase"], "Succeeded", rec)
            self.assertEqual(rec["connections"], COUNT, rec)
        self.assertGreaterEqual(src["bytesSent"], COUNT * BYTES)
        return src, dst, moved, after["sent"] - before["sent"], b

    def test_a_carried_over_rdma_between_the_two_devices(self):
        src, dst, moved, sent_a, b = self.carry("mig-2n-rdma")
        for rec in (src, dst):
            self.assertEqual((rec["transport"], rec["transportReason"]), ("rdma", "auto-both-rdma"), rec)
        carried = src["bytesSent"]
        self.assertGreaterEqual(moved["a/rdma"], carried)
        self.assertGreaterEqual(moved["b/rdma"], carried)
        self.assertEqual((moved["a/tcp"], moved["b/tcp"]), (0, 0), "nothing carried over tcp")
        self.assertGreaterEqual(sent_a, carried // 4096, "rxea sent too few packets")
        self.assertGreaterEqual(b["rcvd"], carried // 4096, "rxeb received too few packets")
        self.check_rails(src, dst, b)

    def check_rails(self, src, dst, b):
        """Connection i on rail i mod n on both agents (n = the rails both have); each rail's
        device on node a sent, and on node b received, at least the packets that rail's bytes need."""
        n = len(DEVS)
        for rec in (src, dst):
            self.assertEqual([r["rail"] for r in rec["rails"]], list(range(n)), rec["rails"])
            self.assertEqual([r["channels"] for r in rec["rails"]], [list(range(i, COUNT, n)) for i in range(n)])
        self.assertEqual(sum(r["bytesSent"] for r in src["rails"]), src["bytesSent"])
        for rs, rt in zip(src["rails"], dst["rails"]):
            sent, rcvd = self.rails_moved[rs["device"]]["sent"], b["byDevice"][rt["device"]]["rcvd"]
            print("rail %d: %d bytes; %s sent_pkts +%d, %s rcvd_pkts +%d (connections %s, %s -> %s)"
                  % (rs["rail"], rs["bytesSent"], rs["device"], sent, rt["device"], rcvd, rs["channels"],
                     rs["address"], rs["peerAddress"]))
            self.assertGreater(rs["bytesSent"], 0, "rail %d carried nothing" % rs["rail"])
            self.assertGreaterEqual(rt["bytesReceived"], rs["bytesSent"])
            self.assertGreaterEqual(sent, rs["bytesSent"] // 4096, "%s sent too few packets" % rs["device"])
            self.assertGreaterEqual(rcvd, rs["bytesSent"] // 4096, "%s received too few packets" % rt["device"])

    def test_b_roce_dropped_on_node_b_carries_over_tcp_naming_why(self):
        t0 = time.monotonic()
        src, dst, moved, _, b = self.carry("mig-2n-cut", cut_rdma=True)
        print("RoCE v2 dropped on node b: carried over tcp, %.1f s, %d RoCE v2 packets dropped"
              % (time.monotonic() - t0, b["rdmaDropped"]))
        for rec in (src, dst):
            self.assertEqual((rec["transport"], rec["transportReason"]), ("tcp", "auto-no-peer-rdma:unreachable"), rec)
        self.assertGreater(b["rdmaDropped"], 0, "node b dropped RDMA's attempts")
        self.assertEqual((src["rails"], dst["rails"]), ([], []), "over TCP no rail carries anything")
        self.assertGreaterEqual(moved["a/tcp"], src["bytesSent"])
        self.assertGreaterEqual(moved["b/tcp"], src["bytesSent"])


if __name__ == "__main__":
    if NODE == "b":
        sys.exit(serve_target())
    unittest.main(verbosity=2)
