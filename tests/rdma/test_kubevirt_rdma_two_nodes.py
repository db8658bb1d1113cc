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
With two rails, rail 1 is cut mid-flow (node b drops RoCE v2 arriving on eth1 only) while the
connections carry (each paced at RAIL_CUT_RATE, so the cut lands in connection 1, on rail 1):
without failover the flow fails naming the channel, the connections reset; with
dataPlane.failover on both agents (transport auto, failoverPaths [rail, address, tcp]) rail 1's channels are
re-dialled over rail 0 and resume there (nothing over TCP; node b's rail-0 device receives their
packets), and with both rails cut they resume over TCP; then (both nodes with VLAN 100 on eth0, a
second address and GID of rail 0's device listed as its alternateAddresses; node a's failoverPaths
[address, rail, tcp]) rail 0's own address cut moves rail 0's channels to the VLAN addresses of the
same devices; every connection arrives byte-exact, and both records and rdmig_failovers_total name
the failover and where it went. Last, post-copy's traffic (no launchers here: libvirt and QEMU
cannot run in these VMs): the VMI allows post-copy, node a's agent carries it (carryPostCopy), the
connections carry at once while node b's stand-in asks for pages on each one's return path
(kv_streams.py --page-requests), and rail 1 is cut: every page arrives intact and in time.
Both agents run unprivileged as the chart runs them in KubeVirt mode with RDMA (rdmiglab.profile,
"chart": DAC_OVERRIDE, IPC_LOCK, NET_ADMIN, SYS_ADMIN, SYS_PTRACE and no other capability, seccomp
RuntimeDefault, a read-only root), checked once started from their /proc status.
  python3 test_kubevirt_rdma_two_nodes.py REPO  (RDMIG_AGENT, RDMIG_NODE, RDMIG_OUT, RDMIG_IP)
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

REPO = os.path.abspath(sys.argv.pop(1)) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else \
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tests", "rdma"))
from rdmiglab import Agent, parse_prometheus  # noqa: E402
from rdmiglab.kvhook import vmi_json  # noqa: E402
from rdmiglab.kvpod import wait_for  # noqa: E402
from rdmiglab import timed  # noqa: E402
from test_agent_rdma_two_nodes import (ADDR, ADDR2, ALT_ADDR, DEV, DEVS, NODE, PEER_ADDR, PEER_ALT_ADDR,  # noqa: E402
                                       RAIL_CUT_TABLE, RDMA_CUT_RULE, PeerAgent, add_vlan_alternate, await_,
                                       await_any, counters_delta, cut_rdma, hw_counters, post, rail_counters,
                                       rail_cut_rule, transferred_bytes, uncut_rdma)

IP = os.environ.get("RDMIG_IP", "ip")
STREAMS = os.path.join(REPO, "tests", "kubevirt", "kv_streams.py")
HANDLER_NS = "virt-handler-pod"
# Each node's virt-handler pod: its address, and the node-side address its namespace routes via.
POD_IP = {"a": "10.98.1.10", "b": "10.98.2.10"}
POD_GW = {"a": "10.98.1.1", "b": "10.98.2.1"}
PEER = "b" if NODE == "a" else "a"
# Node b's devices, one per rail (run-two-vms.sh names them rxe<node>, rxe<node>2).
DEVS_PEER = ["rxe" + PEER] + (["rxe%s2" % PEER] if len(DEVS) > 1 else [])
COUNT, BYTES = 4, 8 << 20
# Node a's tests, in name order: carried over rdma, then with RoCE v2 dropped on node b; with two
# rails, rail 1 cut mid-flow without failover, then with it (to rail 0), then both rails cut with it
# (to TCP), then rail 0's own address cut with it (to rail 0's alternate address on VLAN 100), then a
# migration that may switch to post-copy, its page requests flowing back, with rail 1 cut.
CASES = 7 if len(DEVS) > 1 else 2
# The rail-cut flows: each connection's payload at most this many bytes a second (as QEMU's
# max-bandwidth paces a migration), so that the connections carry for RAIL_CUT_BYTES / rate
# seconds each, one after the other, and the cut lands while connection 1 (rail 1) carries.
RAIL_CUT_RATE = 2 << 20
RAIL_CUT_BYTES = 8 << 20
# Rail 1 carries connection 1 once its device sent this many packets (1 MiB at one packet per 4096
# bytes or fewer; before it, only the connections' first bytes and rdma_cm's requests).
RAIL_CUT_AFTER_PKTS = (1 << 20) // 4096
# The post-copy case: the target's stand-in asks for a page every PAGE_REQUEST_MS ms on each
# connection's return path (kv_streams.py --page-requests) while each connection carries
# PAGE_FLOW_BYTES at PAGE_FLOW_RATE, all four at once: 2 MiB/s in all, well below what the agents
# relay in these VMs (at 8 MiB/s, about their capacity here, the stream queued between the stand-ins
# and the page requests waited 0.5-2 s behind it, 30 ms direct, with stand-ins then still with
# Nagle). Requests the relay held back (to fill a chunk) would wait for their stream's end, asked
# evenly over its 4 s: a median of about 2 s. On the rail not cut the median must stay under
# PAGE_REQUEST_P50_BOUND_MS, 3 times the slowest median seen there (309 ms, in a run whose direct
# flow was slow too); on the cut one they wait out the failover.
PAGE_REQUEST_MS = 5
PAGE_FLOW_RATE = 512 << 10
PAGE_FLOW_BYTES = 2 << 20
PAGE_REQUEST_P50_BOUND_MS = 1000
# The address case's failover deadline (both agents; each of the source's three paths gets a third):
# 8 s a path, past one retransmission of an unanswered connect request (rdma_cm on RoCE sends it
# again after 2 x 256 ms packet lifetime + 4096 ms response time, about 4.6 s). The first re-dial
# over the VLAN pair, of a channel cut while it carried, went unanswered for 5 s in W26 and W27
# (2026-12-07: "no rdma_cm event within 4994 ms", then rail 1), while the second, 10 s later, took
# 99 ms; a cold neighbour table and the cut rule were ruled out by hand (rping over the fresh pair
# with the same rule: 289 ms). With 5 s a path the channel went to rail 1, the right next path for
# the product, and this case failed; the error now names the step that waited.
ADDRESS_CASE_DEADLINE = 24


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


def agent_config(peers=None, hook="", failover=False, alternate=False, paths=None, deadline=None, post_copy=False):
    # transport auto: RDMA is what the agents choose between the two devices, TCP when RoCE v2 is
    # dropped. The data plane on eth0's address, the REST API on every address (node a calls b's).
    # With two rails (run-two-vms.sh --rails 2) both devices, in the same order on both nodes, each
    # with its address (eth0 also holds VLAN 100's); `alternate`: rail 0's alternate address there;
    # `paths`: dataPlane.failoverPaths; `deadline`: dataPlane.failoverDeadlineSeconds; `post_copy`:
    # kubevirt.carryPostCopy (which needs failover).
    devices = [{"device": d, "address": a} for d, a in zip(DEVS, [ADDR, ADDR2])]
    if alternate:
        devices[0]["alternateAddresses"] = [ALT_ADDR]
    rdma = dict(devices[0]) if len(DEVS) == 1 else {"devices": devices}
    rdma["connectTimeoutSeconds"] = 6  # RoCE v2 dropped: TCP after 6 s, not the default 15 (as in test_agent_rdma_two_nodes.py)
    data_plane = {"address": ADDR, "advertiseAddress": ADDR, "rdmaPort": 0}
    if failover:
        data_plane["failover"] = "on"
    if paths:
        data_plane["failoverPaths"] = paths
    if deadline:
        data_plane["failoverDeadlineSeconds"] = deadline
    kubevirt = {"enabled": True, "nodeName": "node-" + NODE, "hookSocket": hook, "peers": peers or [],
                "ruleTimeoutSeconds": 30, "sessionIdleSeconds": 1}
    if post_copy:
        kubevirt["carryPostCopy"] = True
    return {"transport": "auto", "rdma": rdma, "api": {"address": "0.0.0.0"},
            "dataPlane": data_plane, "kubevirt": kubevirt}


def start_sink(tmp, name):
    """A proxy stand-in (kv_streams.py sink) in this node's virt-handler pod: its process and port."""
    ready = os.path.join(tmp, name + ".json")
    proc = subprocess.Popen([IP, "netns", "exec", HANDLER_NS, sys.executable, STREAMS, "sink", "--ready", ready,
                             "--log", os.path.join(tmp, name + ".log")])
    return proc, wait_for(lambda: os.path.exists(ready) and json.load(open(ready))["port"], 20, "the stand-in " + name)


def dial_argv(port, post_copy, *extra):
    """kv_streams.py dial from this node's virt-handler pod to node b's pod at `port`, COUNT
    connections shaped as the rail-cut flows, or (post_copy) as the post-copy case's."""
    shape = (["--bytes", str(PAGE_FLOW_BYTES), "--rate", str(PAGE_FLOW_RATE), "--page-requests", str(PAGE_REQUEST_MS)]
             if post_copy else ["--bytes", str(RAIL_CUT_BYTES), "--rate", str(RAIL_CUT_RATE)])
    return [IP, "netns", "exec", HANDLER_NS, sys.executable, STREAMS, "dial", "--dest", "%s:%d" % (POD_IP["b"], port),
            "--count", str(COUNT), "--timeout", "60"] + shape + list(extra)


def settled(agent, mig):
    items = agent.call("GET", "/v1/kubevirt/migrations?migrationUid=" + mig)["items"]
    return [r for r in items if r["phase"] not in ("Armed", "Carrying")]


def serve_target():
    """Node b: virt-handler's pod with the proxy stand-in, and the target agent."""
    tmp = tempfile.mkdtemp(prefix="rdmig-kv-b-")
    ok = True
    sink = direct = agent = None
    try:
        virt_handler_pod()
        sink, port = start_sink(tmp, "sink")
        # A second one on a port no migration publishes: node a's flows to it go pod to pod over
        # the link, not through the agents (the post-copy case's side-by-side baseline).
        direct, direct_port = start_sink(tmp, "direct")
        # dataPlane.failover on: only a source agent that has it on too asks for it (the last cases);
        # rail 0's alternate address listens too (only a source with one pairs with it). It waits up
        # to ADDRESS_CASE_DEADLINE s for a re-dial, as long as the address case's source tries (failover_agent).
        agent = Agent(tmp, "agent-b", config=agent_config(failover=True, alternate=True, deadline=ADDRESS_CASE_DEADLINE),
                      log_level="debug",
                      profile="chart")
        post("kv-agent-b", {"api": agent.api_port, "data": agent.data_port, "token": agent.token, "sink": port,
                            "direct": direct_port})
        for seq in range(CASES):
            want = await_("kv-want-%d" % seq, 600)
            cut, rail_cut = want["cutRdma"], False
            if cut:
                cut_rdma()
            before, rails_before = hw_counters(), rail_counters()
            post("kv-ready-%d" % seq, True)
            try:
                if want.get("cutRail"):
                    # Once node a sees rail 1 carry it asks for the cut (or says the flow ended first):
                    # RoCE v2 arriving on rail 1's link dropped, or ("all") on both rails.
                    got, _ = await_any(["kv-cut-%d" % seq, "kv-dialled-%d" % seq], 600)
                    if got.startswith("kv-cut-"):
                        # ("address"): rail 0's own address, what reaches eth0 untagged.
                        kind = want["cutRail"]
                        rule = (RDMA_CUT_RULE if kind == "all" else
                                rail_cut_rule(os.environ["RDMIG_RDMA_NETDEV"]) if kind == "address" else rail_cut_rule())
                        cut_rdma(rule, RAIL_CUT_TABLE)
                        rail_cut = True
                        post("kv-cut-applied-%d" % seq, True)
                await_("kv-dialled-%d" % seq, 600)
                after = hw_counters()
                reply = {"sent": after["sent"] - before["sent"], "rcvd": after["rcvd"] - before["rcvd"],
                         "byDevice": counters_delta(rails_before, rail_counters())}
            finally:
                if cut:
                    dropped = uncut_rdma()
                if rail_cut:
                    dropped = uncut_rdma(RAIL_CUT_TABLE)
            if cut or rail_cut:
                reply["rdmaDropped"] = dropped
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
        for p in (sink, direct):
            if p:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


class TwoNodeKubevirtRdmaTest(unittest.TestCase):
    """Node a: the source side, and the checks."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-kv-a-")
        virt_handler_pod()
        b = await_("kv-agent-b", 300)
        cls.sink_port, cls.direct_port = b["sink"], b["direct"]
        cls.hook = os.path.join(cls.tmp, "hook.sock")
        cls.b_data = b["data"]
        cls.peers = [{"node": "node-b", "agent": "%s:%d" % (PEER_ADDR, b["data"])}]
        cls.a = Agent(cls.tmp, "agent-a", token=b["token"], log_level="debug", profile="chart",
                      config=agent_config(peers=cls.peers, hook=cls.hook))
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
        # What each of node b's devices received for two 8 MiB connections (the rail-cut cases compare).
        TwoNodeKubevirtRdmaTest.rail_rcvd = {d: b["byDevice"][d]["rcvd"] for d in DEVS_PEER}

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

    def rail_cut_flow(self, mig, cut="rail1", post_copy=False):
        """One flow of prod/web-1 whose connections are paced (RAIL_CUT_RATE), rail 1 (cut "rail1") or
        both rails ("all") cut on node b once rail 1 carried 1 MiB (the cut lasts until the dial ends).
        `post_copy`: the VMI's migration allows post-copy, and the connections carry at once with
        page requests on their return paths (PAGE_REQUEST_MS).
        Returns the dial's outcome, both agents' settled records, the agents' byte counters (moved
        during the flow) and node b's reply (its devices' hw counters, the RoCE v2 packets dropped)."""
        if len(DEVS) < 2:
            self.skipTest("one rail per node (run-two-vms.sh without --rails 2)")
        seq = TwoNodeKubevirtRdmaTest.asked
        TwoNodeKubevirtRdmaTest.asked += 1
        post("kv-want-%d" % seq, {"cutRdma": False, "cutRail": cut})
        await_("kv-ready-%d" % seq, 120)
        path = os.path.join(self.tmp, "vmi-%s.json" % mig)
        with open(path, "w") as f:
            json.dump(vmi_json("vmi-uid-2n", mig, POD_IP["b"], self.sink_port, post_copy=post_copy), f)
        bytes_before, rails_before = self.counted(), rail_counters()
        p = subprocess.Popen(dial_argv(self.sink_port, post_copy, "--hook-socket", self.hook, "--vmi", path),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # The cut rail carries once node a's device on it (rxea2 for rail 1, rxea for rail 0's
            # address) sent the packets of 1 MiB (its hw counter: live, where the records' per-rail
            # figures are refreshed when read).
            dev = DEVS[0] if cut == "address" else DEVS[1]
            deadline, flowing = time.monotonic() + 120, 0
            while flowing < RAIL_CUT_AFTER_PKTS:
                if p.poll() is not None:  # (stderr read only then: it ends with the dial)
                    self.fail("the flow ended before %s carried 1 MiB: %s" % (dev, p.stderr.read()))
                self.assertLess(time.monotonic(), deadline, "%s carried no MiB within 120 s: %d packets" % (dev, flowing))
                time.sleep(0.05)
                flowing = hw_counters(dev)["sent"] - rails_before[dev]["sent"]
            post("kv-cut-%d" % seq, True)
            await_("kv-cut-applied-%d" % seq, 60)
            t0 = time.monotonic()
            out, err = p.communicate(timeout=300)
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
            self.rails_moved = counters_delta(rails_before, rail_counters())
            post("kv-dialled-%d" % seq, True)
        self.assertEqual(p.returncode, 0, err)
        res = json.loads(out)
        src = wait_for(lambda: settled(self.a, mig), 60, "the source record of " + mig)[0]
        dst = wait_for(lambda: settled(self.b, mig), 60, "the target record of " + mig)[0]
        moved = {k: n - bytes_before[k] for k, n in self.counted().items()}
        b = await_("kv-state-%d" % seq, 120)
        print("%s: %s cut %.1f s before the dial ended (%s sent_pkts +%d at the cut; node b dropped %d RoCE v2 packets): "
              "source %s (%s), target %s (%s); connections %s; failover source %s, target %s; agents' byte counters %s"
              % (mig, cut, took, dev, flowing, b["rdmaDropped"], src["phase"], src["reason"], dst["phase"], dst["reason"],
                 [(c["index"], c["ok"], c["error"]) for c in res["connections"]], src["failover"], dst["failover"],
                 moved))
        self.assertTrue(res["hook"]["ok"], res)
        self.assertGreater(b["rdmaDropped"], 0, "node b dropped none of rail 1's RoCE v2 packets")
        return res, src, dst, moved, b

    def test_c_rail_cut_mid_flow_without_failover_fails_the_flow(self):
        # Node a's agent without dataPlane.failover: rail 1's channel stalls (its writes unacknowledged,
        # src/transport/rdma/ack_watch.h) and the flow fails on both agents, the connections reset:
        # what the failover case below is measured against.
        res, src, dst, _, _ = self.rail_cut_flow("mig-2n-railcut")
        self.assertFalse(src["failover"]["enabled"], src["failover"])
        self.assertEqual((src["phase"], dst["phase"]), ("Failed", "Failed"), (src, dst))
        self.assertRegex(src["reason"], r"rail 1: |channel [13]: ")
        self.assertNotEqual([c["ok"] for c in res["connections"]], [True] * COUNT, res)

    def failover_agent(self, kind="rails"):
        """Node a's agent with dataPlane.failover on, in place of the one running unless it is that
        kind already: "rails" (failoverPaths: the default [rail, address, tcp], no alternate address),
        "address" (rail 0's alternate address, failoverPaths [address, rail, tcp]: a channel of rail
        0 tries the same device's other address before the other rail), "postcopy" (as "rails", with
        kubevirt.carryPostCopy)."""
        if getattr(TwoNodeKubevirtRdmaTest, "fails_over", None) != kind:
            self.a.stop()
            # The address case's source gives each of its three paths ADDRESS_CASE_DEADLINE / 3 s, not
            # the default 5 s in all (see ADDRESS_CASE_DEADLINE).
            extra = ({"alternate": True, "paths": ["address", "rail", "tcp"], "deadline": ADDRESS_CASE_DEADLINE}
                     if kind == "address" else {"post_copy": True} if kind == "postcopy" else {})
            TwoNodeKubevirtRdmaTest.a = Agent(self.tmp, "agent-a-fo-" + kind[:4], token=self.b.token,
                                              log_level="debug", profile="chart",
                                              config=agent_config(peers=self.peers, hook=self.hook, failover=True,
                                                                  **extra))
            TwoNodeKubevirtRdmaTest.fails_over = kind

    def failed_over(self, mig, cut, cut_channels, to, post_copy=False):
        """The rail-cut flow with failover on both agents: every connection byte-exact, both records
        Succeeded over rdma naming the failover and where it went; returns both records, the agents'
        byte counters and node b's reply (and keeps the dial's outcome as self.dialled)."""
        self.failover_agent("postcopy" if post_copy else "address" if cut == "address" else "rails")
        seen = len(self.a.log_text().splitlines())  # the agent's log before this flow
        res, src, dst, moved, b = self.rail_cut_flow(mig, cut, post_copy)
        self.dialled = res
        self.assertEqual([c["ok"] for c in res["connections"]], [True] * COUNT, res)  # byte-exact digests
        for rec in (src, dst):
            self.assertTrue(rec["carried"], rec)
            self.assertEqual(rec["phase"], "Succeeded", rec)
            self.assertEqual(rec["connections"], COUNT, rec)
            self.assertEqual((rec["transport"], rec["transportReason"]), ("rdma", "auto-both-rdma"), rec)
            self.assertTrue(rec["failover"]["enabled"], rec)
            self.assertGreaterEqual(rec["failover"]["failovers"], 1, rec)
        self.assertGreaterEqual(src["bytesSent"], COUNT * (PAGE_FLOW_BYTES if post_copy else RAIL_CUT_BYTES))
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])
        # Only the cut rails' channels moved, each once, named by the link that failed.
        moved_lines = [line for line in self.a.log_text().splitlines()[seen:] if " failover: channel " in line]
        print("\n".join(moved_lines))
        self.moved_lines = moved_lines
        ids = [int(re.search(r" failover: channel (\d+): ", line).group(1)) for line in moved_lines]
        self.assertTrue(ids and set(ids) <= set(cut_channels) and len(ids) == len(set(ids)), moved_lines)
        self.assertEqual(src["failover"]["failovers"], len(ids))
        self.assertRegex(src["failover"]["last"], r"^channel [%s]: " % "".join(str(c) for c in cut_channels))
        for agent, role in ((self.a, "source"), (self.b, "target")):
            samples, _ = parse_prometheus(agent.metrics())
            n = sum(v for (name, labels), v in samples.items() if name == "rdmig_failovers_total" and
                    ("role", role) in labels and ("transport", "rdma") in labels and ("to", to) in labels)
            self.assertGreaterEqual(n, 1, "%s: rdmig_failovers_total{transport=rdma,to=%s}" % (role, to))
        return src, dst, moved, b

    def test_d_rail_cut_mid_flow_with_failover_moves_its_channels_to_rail_0(self):
        # dataPlane.failover on both agents (failoverPaths [rail, address, tcp]), transport auto: rail 1's
        # channels (connections 1 and 3) fail over when their link stalls, re-dialled over rail 0
        # (rdma_cm from rxea to node b's rail-0 endpoint, the proved connect request of a first
        # connect; node b's welcome offered failoverRails) and resumed there; nothing goes over TCP.
        src, dst, moved, b = self.failed_over("mig-2n-railfo", "rail1", [1, 3], "rail")
        self.assertRegex(src["failover"]["last"], r"; resumed on rdma rail 0: %s %s to %s:\d+ after \d+ ms"
                         % (re.escape(DEVS[0]), re.escape(ADDR), re.escape(PEER_ADDR)))
        # Node b names the rail the re-dial came in on, from its end (its device and address, then
        # the source's address).
        self.assertRegex(dst["failover"]["last"], r"resumed on rdma rail 0: \S+ %s to %s \(re-dialled by the source\)"
                         % (re.escape(PEER_ADDR), re.escape(ADDR)))
        self.assertEqual((moved["a/tcp"], moved["b/tcp"]), (0, 0), "nothing carried over tcp")
        self.assertGreaterEqual(moved["a/rdma"], src["bytesSent"])
        # Both records count a moved channel on the rail it carried on: rail 1 keeps what came before
        # the cut (about 1 MiB of connection 1, give or take a second of its pace), rail 0 gets the
        # rest and lists the channels it took over; every byte on exactly one rail.
        for rec, key in ((src, "bytesSent"), (dst, "bytesReceived")):
            rails = {r["rail"]: r for r in rec["rails"]}
            print("%s record: %s" % (rec["role"], [(r["rail"], r["channels"], r[key]) for r in rec["rails"]]))
            self.assertEqual(rails[0]["channels"], [0, 1, 2, 3], rec["rails"])
            self.assertEqual(rails[1]["channels"], [], rec["rails"])
            self.assertEqual(rails[0][key] + rails[1][key], rec[key], rec["rails"])
            self.assertLess(rails[1][key] * 4, rails[0][key], "rail 1 counted what rail 0 carried: %s" % rec["rails"])
        # The hw counters of node b's devices against case a's (the same four 8 MiB connections,
        # two per rail): rail 0's device (rxeb) received the packets of its own two connections and
        # of the ones it took over (connection 3 whole, the rest of connection 1: at least 1.4 times
        # case a's); rail 1's (rxeb2) only what came before the cut (under half of case a's).
        rail0_got, rail1_got = (b["byDevice"][d]["rcvd"] for d in DEVS_PEER)
        base = getattr(TwoNodeKubevirtRdmaTest, "rail_rcvd", None)
        print("node b: %s rcvd_pkts +%d, %s rcvd_pkts +%d (case a: %s)" % (DEVS_PEER[0], rail0_got, DEVS_PEER[1],
                                                                           rail1_got, base))
        self.assertGreaterEqual(rail0_got, 3 * RAIL_CUT_BYTES // 4096, "rail 0 received too few packets")
        self.assertLess(rail1_got * 4, rail0_got, "rail 1 carried its connections despite the cut")
        if base:  # case a ran in this process (not with -k)
            self.assertGreaterEqual(rail0_got, 1.4 * base[DEVS_PEER[0]], "rail 0 did not take rail 1's channels")
            self.assertLess(rail1_got, 0.5 * base[DEVS_PEER[1]], "rail 1 carried its connections despite the cut")

    def test_e_every_rail_cut_mid_flow_with_failover_moves_the_channels_to_tcp(self):
        # The same with RoCE v2 dropped on both rails: no rail takes a channel (each rail re-dial's
        # connect request goes unanswered within its share of the deadline), so each channel that
        # fails is resumed over TCP to node b's data port.
        src, dst, moved, _ = self.failed_over("mig-2n-railsfo", "all", [0, 1, 2, 3], "tcp")
        self.assertRegex(src["failover"]["last"], r"; resumed on tcp %s:%d after \d+ ms"
                         % (re.escape(PEER_ADDR), self.b_data))
        self.assertIn("resumed on tcp (re-dialled by the source)", dst["failover"]["last"])
        self.assertGreater(moved["a/tcp"], 0, "nothing went over TCP after the failover")
        self.assertGreater(moved["b/tcp"], 0, "nothing went over TCP after the failover")
        # What TCP carried counts on no rail; a channel that moved there is on no rail's list.
        for rec, key in ((src, "bytesSent"), (dst, "bytesReceived")):
            print("%s record: %s" % (rec["role"], [(r["rail"], r["channels"], r[key]) for r in rec["rails"]]))
            self.assertLess(sum(r[key] for r in rec["rails"]), rec[key], rec["rails"])

    def test_f_rail_address_cut_mid_flow_with_failover_moves_rail_0s_channels_to_its_alternate_address(self):
        # Both agents with rail 0's alternate address on VLAN 100 (eth0.100, a GID of its own on rxea /
        # rxeb), node a's failoverPaths [address, rail, tcp]: node b drops the RoCE v2 reaching eth0
        # untagged, so rail 0's channels (connections 0 and 2) lose their link while the device's VLAN
        # address works; each is re-dialled from node a's VLAN address to node b's alternate listener
        # and resumes there; rail 1's channels stay; nothing goes over TCP.
        src, dst, moved, _ = self.failed_over("mig-2n-addrfo", "address", [0, 2], "address")
        self.assertRegex(src["failover"]["last"], r"; resumed on rdma rail 0: %s %s to %s:\d+ \(alternate address 0\) "
                         r"after \d+ ms" % (re.escape(DEVS[0]), re.escape(ALT_ADDR), re.escape(PEER_ALT_ADDR)))
        self.assertRegex(dst["failover"]["last"], r"resumed on rdma rail 0: \S+ %s \(alternate address 0\) "
                         r"\(re-dialled by the source\)" % re.escape(PEER_ALT_ADDR))
        self.assertEqual((moved["a/tcp"], moved["b/tcp"]), (0, 0), "nothing carried over tcp")
        # Each channel stays counted on its rail (the same device): rail 0 keeps 0 and 2, rail 1 has 1 and 3.
        for rec, key in ((src, "bytesSent"), (dst, "bytesReceived")):
            rails = {r["rail"]: r for r in rec["rails"]}
            print("%s record: %s" % (rec["role"], [(r["rail"], r["channels"], r[key]) for r in rec["rails"]]))
            self.assertEqual((rails[0]["channels"], rails[1]["channels"]), ([0, 2], [1, 3]),
                             "%s; failovers: %s" % (rec["rails"], self.moved_lines))
            self.assertEqual(rails[0][key] + rails[1][key], rec[key], rec["rails"])

    def page_request_flow_direct(self):
        """The post-copy case's flow pod to pod over the link, no agent in its path (node b's second
        stand-in, on a port no migration publishes): the stand-ins' own latency on these VMs."""
        p = subprocess.run(dial_argv(self.direct_port, True), capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        res = json.loads(p.stdout)
        self.assertEqual([c["ok"] for c in res["connections"]], [True] * COUNT, res)
        return res

    def test_g_a_post_copy_migration_carries_its_page_requests_over_rdma_through_a_rail_cut(self):
        # kubevirt.carryPostCopy on node a (failover on both, as the agent requires): a migration
        # whose VMI allows post-copy is carried; its connections carry at once, as after the switch,
        # while the target's stand-in asks for pages on every connection's return path, each answered
        # ahead of the stream (kv_streams.py: QEMU's MIG_RP_MSG_REQ_PAGES and the page it sends back).
        # Rail 1 is cut mid-flow: its channels fail over to rail 0 with both directions resumed;
        # every page asked for arrives intact, every byte of the stream too, nothing over TCP. No
        # launcher's libvirt here, so the record cannot show the switch itself (docs/kubevirt.md).
        direct = self.page_request_flow_direct()
        src, dst, moved, _ = self.failed_over("mig-2n-postcopy", "rail1", [1, 3], "rail", post_copy=True)
        self.assertEqual((moved["a/tcp"], moved["b/tcp"]), (0, 0), "nothing carried over tcp")
        self.assertTrue(src["postCopy"] and src["postCopy"]["allowed"], src["postCopy"])
        for way, res in (("direct", direct), ("carried", self.dialled)):
            for c in res["connections"]:
                rp = c["returnPath"]
                print("%s connection %d (%.1f s): %s page requests, %s answered, p50 %s ms, p99 %s ms, max %s ms"
                      % (way, c["index"], c["seconds"], rp.get("requests"), rp.get("pages"),
                         *("%.1f" % rp[k] if isinstance(rp.get(k), (int, float)) else "-"
                           for k in ("p50Ms", "p99Ms", "maxMs"))))
        # Every request answered with its page intact, those of the cut rail's connections (1 and
        # 3) after their failover; on rail 0's (0 and 2) the median within the bound. Measured on
        # these VMs (2026-12-07, six runs): direct 6-83 ms, through the agents 55-309 ms (the
        # agents, rxe and the stand-ins share the VMs' two TCG vCPUs; the agents' target leg
        # without Nagle, tried once, changed nothing: 66-80 against 67-70), on the cut rail
        # 1.5-2.5 s (the failover's stall, about 4 s, in most of them).
        for c in self.dialled["connections"]:
            rp = c["returnPath"]
            self.assertGreater(rp["requests"], 0, c)
            self.assertEqual((rp["pages"], rp["badPages"]), (rp["requests"], 0), c)
            if c["index"] % 2 == 0:
                self.assertLess(rp["p50Ms"], PAGE_REQUEST_P50_BOUND_MS, "page requests held back on connection %d: %s"
                                % (c["index"], rp))


if __name__ == "__main__":
    add_vlan_alternate()
    if NODE == "b":
        sys.exit(serve_target())
    timed.main(verbosity=2)
