"""Runs in both VMs of run-two-vms.sh: path checks between two nodes, each with its own kernel,
network stack, rxe device and rdmig-agent (docs/pathcheck.md), with the agents' RDMA address on
the port's own netdev and on the interfaces a RoCE node stacks above it (pathcheck-two-nodes.sh
makes them: eth0.100, VLAN 100, and mv100, a macvlan over it).

Node a: the source agent (rxea); it drives each check through both agents' REST APIs, as the
controller does. Node b: the target agent (rxeb); it answers node a through the shared folder (its
agent's port and token, the GID index its sysfs lists for its address, its counters).
Cases, one pair of agents each:
  eth0         rdma.device, 10.99.1.N (the GID of eth0's address)
  vlan-ipv4    rdma.netdev eth0.100 (no device: the shared-device plugin's way), 10.100.0.N
  vlan-ipv6    rdma.address fd00:100::N (no device, no netdev), data plane on IPv6 too
  macvlan      rdma.netdev mv100, 10.101.0.N
  multus       rdma.network only (docs/deploy.md "Multus mode"): each agent reads a network-status
               file (the downward API file of a pod's k8s.v1.cni.cncf.io/network-status), empty at
               start and written 2 s later, whose entry for rdmig-system/rdma-net (named bare, with
               POD_NAMESPACE) names eth0.100, lists fd00:100::N before 10.100.0.N and the device
               in device-info: the agent waits for it, takes the IPv4 address and carries the check
               over RDMA from it
Checked for each: both agents chose the GID whose sysfs entry holds their address on that netdev
with type RoCE v2 (never index 0), and report it (the path check's localRdma/peerRdma gid and
gidIndex, the rdmig_rdma_selected gauge's labels, the agent's start-up log line). Where RDMA
carries: the pair passes over RDMA (auto-both-rdma) with every byte verified on node b, and rxea
sent / rxeb received at least the packets the bytes need. On the macvlan, rxe (Debian 12's 6.1, 13's 6.12)
drops every RoCE v2 packet for a macvlan's address (it takes a packet only from its netdev or a
VLAN of it, rxe_udp_encap_recv, and only for a GID of the interface it arrived on, rxe_chk_dgid):
the check must fail cleanly naming the RDMA channel, every CM packet rxea sent reaching node b's
IP stack (an nftables counter of UDP 4791) and none counted by rxeb. A kernel whose rxe carries it fails this case on purpose.
Last, RDMA between the nodes breaks mid-stream (eth0 again; node b drops RoCE v2 with nftables
while a long check runs): the check fails within seconds, long before its timeoutSeconds, with an
error that names the stalled path, both ends end, and once the link is back a new check passes.
Node a alone, last: an agent inside a network namespace standing for a Multus pod (a macvlan
net1 over eth0 moved into it, 10.102.0.1, no device-info: the shared-device way), given only
rdma.network and a network-status file naming net1: it sees rxea from there (shared netns mode),
and chooses net1, 10.102.0.1 and the GID the kernel gave that address on net1. No path check runs
from there: rxe (Debian 12's 6.1, 13's 6.12) opens its UDP sockets and looks up its routes in the initial
namespace only, so RoCE v2 to or from an interface in another namespace never reaches it (a
ConnectX VF moved into a pod by the rdma CNI carries RDMA there in hardware); the multus case
above is the one that moves bytes, from the initial namespace.
  python3 test_pathcheck_rdma_two_nodes.py  (RDMIG_AGENT, RDMIG_TOOLS, RDMIG_NODE, RDMIG_OUT)
"""
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_agent_rdma_two_nodes import (ADDR, CONNECT_TIMEOUT, DEV, NODE, PEER_ADDR, PeerAgent, await_,  # noqa: E402
                                       cut_rdma, hw_counters, post, uncut_rdma)
from rdmiglab import Agent, parse_prometheus  # noqa: E402
from rdmiglab import timed  # noqa: E402

BYTES = 128 << 20
SMALL = 32 << 20
N, PEER_N = (1, 2) if NODE == "a" else (2, 1)
PORT_DIR = "/sys/class/infiniband/%s/ports/1" % DEV


class Case:
    """One pair of agents: the rdma keys of node N's agent, the netdev and address it must choose."""

    def __init__(self, name, netdev, addr_fmt, rdma, carries=True, data_plane_on_rdma_address=False):
        self.name, self.netdev, self.carries = name, netdev, carries
        self.addr, self.peer_addr = addr_fmt % N, addr_fmt % PEER_N
        self.rdma = {k: (v % N if "%" in v else v) for k, v in rdma.items()}
        # The macvlan case's RDMA connect fails by this bound (6 s, not the default 15: rdma_cm's own
        # retry of a lost request takes about 4 s); the others connect in milliseconds.
        self.rdma["connectTimeoutSeconds"] = CONNECT_TIMEOUT
        self.data_plane = self.addr if data_plane_on_rdma_address else ADDR

    def config(self):
        return {"transport": "auto", "rdma": self.rdma, "api": {"address": "0.0.0.0"},
                "dataPlane": {"address": self.data_plane, "advertiseAddress": self.data_plane, "rdmaPort": 0}}

    def start_agent(self, tmp, name):
        return Agent(tmp, name, config=self.config(), log_level="debug")


def write_atomically(path, text):
    """As the kubelet updates a downward API file: the new content appears whole."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


class MultusCase(Case):
    """rdma.network only: the agent takes interface, address and device from its network-status
    file, empty when it starts (the kubelet's first copy, before Multus wrote the annotation)."""
    NETWORK = "rdma-net"  # in POD_NAMESPACE rdmig-system: Multus writes rdmig-system/rdma-net

    def __init__(self, name):
        super().__init__(name, "eth0.100", "10.100.0.%d", {"network": self.NETWORK})

    def network_status(self):
        return json.dumps([
            {"name": "cbr0", "interface": "eth0", "ips": [ADDR], "default": True, "dns": {}},
            {"name": "rdmig-system/" + self.NETWORK, "interface": self.netdev,
             "ips": ["fd00:100::%d" % N, self.addr], "dns": {},  # IPv6 first: the agent prefers IPv4
             "device-info": {"type": "pci", "version": "1.1.0", "pci": {"rdma-device": DEV}}}], indent=2)

    def start_agent(self, tmp, name):
        path = os.path.join(tmp, "network-status")
        open(path, "w").close()
        writer = threading.Timer(2.0, write_atomically, (path, self.network_status()))
        writer.start()
        cfg = self.config()
        cfg["rdma"] = dict(cfg["rdma"], networkStatusFile=path, networkWaitSeconds=30)
        try:
            agent = Agent(tmp, name, config=cfg, log_level="debug", env={"POD_NAMESPACE": "rdmig-system"},
                          start_timeout=60)
        finally:
            writer.join()
        log = agent.log_text()
        want = "rail 0: network rdmig-system/%s from %s: interface=%s address=%s rdma-device=%s" % (
            self.NETWORK, path, self.netdev, self.addr, DEV)
        if want not in log:
            agent.stop()
            raise AssertionError("%s: no line %r in the agent's log:\n%s" % (self.name, want, log[-3000:]))
        return agent


CASES = [
    Case("eth0", "eth0", "10.99.1.%d", {"device": DEV}),
    Case("vlan-ipv4", "eth0.100", "10.100.0.%d", {"netdev": "eth0.100"}),
    Case("vlan-ipv6", "eth0.100", "fd00:100::%d", {"address": "fd00:100::%d"}, data_plane_on_rdma_address=True),
    Case("macvlan", "mv100", "10.101.0.%d", {"netdev": "mv100"}, carries=False),
    Case("break", "eth0", "10.99.1.%d", {"device": DEV}),  # RoCE v2 dropped mid-stream
    MultusCase("multus"),
]


def start_check(a, b, nbytes, **extra):
    """Starts a check of `nbytes` from agent a to agent b, as the controller does; returns the
    source's and the target's check ids."""
    spec = dict({"bytes": nbytes, "chunkSize": "1Mi", "channels": 2}, **extra)
    t = b.call("POST", "/v1/pathchecks", dict(spec, role="target"))
    s = a.call("POST", "/v1/pathchecks", dict(spec, role="source", target={
        "endpoint": t["endpoint"], "checkId": t["checkId"], "token": t["token"]}))
    return s["id"], t["id"]


def settle(agent, check_id, timeout=300):
    deadline = time.monotonic() + timeout
    while True:
        st = agent.call("GET", "/v1/pathchecks/" + check_id)
        if st["phase"] in ("Succeeded", "Failed", "Cancelled") or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def gid_of(ip):
    """The RoCE v2 GID of an address (IPv4-mapped for IPv4), as sysfs writes GIDs."""
    a = ipaddress.ip_address(ip)
    raw = (b"\0" * 10 + b"\xff\xff" + a.packed) if a.version == 4 else a.packed
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # an unused entry's attributes cannot be read
        return None


def sysfs_gid_index(netdev, ip):
    """The index of the one GID table entry that holds ip's GID on netdev with type RoCE v2."""
    want, found, table = gid_of(ip), [], []
    for name in sorted(os.listdir(PORT_DIR + "/gids"), key=int):
        value = read("%s/gids/%s" % (PORT_DIR, name))
        if not value or value == gid_of("::"):
            continue
        ndev, kind = read("%s/gid_attrs/ndevs/%s" % (PORT_DIR, name)), read("%s/gid_attrs/types/%s" % (PORT_DIR, name))
        table.append("%s %s %s %s" % (name, value, kind, ndev))
        if value == want and ndev == netdev and kind == "RoCE v2":
            found.append(int(name))
    if len(found) != 1:
        raise AssertionError("%s: %d RoCE v2 GIDs for %s on %s; table:\n  %s" %
                             (DEV, len(found), ip, netdev, "\n  ".join(table)))
    return found[0]


def gid_table():
    return {int(n): (read("%s/gids/%s" % (PORT_DIR, n)), read("%s/gid_attrs/types/%s" % (PORT_DIR, n)),
                     read("%s/gid_attrs/ndevs/%s" % (PORT_DIR, n))) for n in os.listdir(PORT_DIR + "/gids")}


def neighbour(addr):
    """This node's neighbour entry for `addr` (ip neigh), for failure messages."""
    out = subprocess.run(["iproute2-ip", "neigh", "show", "to", addr], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip() or "no entry"


def warm_neighbour(local, peer, limit=30.0):
    """Resolves `peer`'s link-layer address from `local` before a check: a TCP connect to a closed
    port (refused: the neighbour answered). rdma_cm resolves it too, but only within the check's
    connect timeout: in one run of the macvlan case under load no CM packet left rxea at all (no
    rdma_cm event in 15 s, address resolution being the step before the first packet). Returns
    the seconds it took; a peer that never answers fails the case naming the neighbour state."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    t0 = time.monotonic()
    while True:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.bind((local, 0))
            s.connect((peer, 9))
            return time.monotonic() - t0
        except ConnectionRefusedError:
            return time.monotonic() - t0
        except OSError as e:
            if time.monotonic() - t0 > limit:
                raise AssertionError("%s does not answer from %s within %.0f s (%s; neighbour: %s)"
                                     % (peer, local, limit, e, neighbour(peer)))
        finally:
            s.close()
        time.sleep(0.5)


def counters():
    """The rxe device's packet counters and the RoCE v2 packets (UDP 4791, IPv4 and IPv6) that
    reached this node's IP stack on any interface: pathcheck-two-nodes.sh counts them with nftables."""
    c = hw_counters()
    out = subprocess.run(["nft", "list", "chain", "inet", "rdmigcount", "in"], check=True, capture_output=True,
                         text=True).stdout
    c["roce_in"] = int(re.search(r"udp dport 4791 counter packets (\d+)", out).group(1))
    return c


def pathcheck_bytes(agent, direction):
    samples, _ = parse_prometheus(agent.metrics())
    return samples.get(("rdmig_transferred_bytes_total",
                        frozenset({"transport": "rdma", "direction": direction, "traffic": "pathcheck"}.items())), 0)


def selection(agent):
    """The labels of the agent's rdmig_rdma_selected series (one series at a time)."""
    samples, _ = parse_prometheus(agent.metrics())
    series = [(dict(labels), v) for (name, labels), v in samples.items() if name == "rdmig_rdma_selected"]
    if len(series) != 1:
        raise AssertionError("rdmig_rdma_selected: %r" % series)
    return series[0]


def serve_target():
    """Node b: one target agent per case, answering node a's counter requests until it is done."""
    ok = True
    for case in CASES:
        tmp = tempfile.mkdtemp(prefix="rdmig-pc-b-")
        agent = None
        try:
            expect = sysfs_gid_index(case.netdev, case.addr)
            agent = case.start_agent(tmp, "agent-b")
            with open("/sys/class/net/eth0/address") as f:
                eth0_mac = f.read().strip()
            post("agent-b-" + case.name, {"port": agent.api_port, "token": agent.token, "gidIndex": expect,
                                          "eth0Mac": eth0_mac})
            answered, done = set(), os.path.join(os.environ["RDMIG_OUT"], "rdv", "done-" + case.name)
            deadline = time.monotonic() + 600
            cut = False
            while not os.path.exists(done):
                for seq in (0, 1):
                    want = "want-counters-%s-%d" % (case.name, seq)
                    if seq not in answered and os.path.exists(os.path.join(os.environ["RDMIG_OUT"], "rdv", want)):
                        post("counters-%s-%d" % (case.name, seq), counters())
                        answered.add(seq)
                # The link breaks mid-stream, then comes back.
                for want, act in (("want-cut", "cut"), ("want-uncut", "uncut")):
                    if act not in answered and os.path.exists(os.path.join(os.environ["RDMIG_OUT"], "rdv",
                                                                           "%s-%s" % (want, case.name))):
                        if act == "cut":
                            cut_rdma()
                            cut = True
                            post("cut-" + case.name, True)
                        else:
                            cut = False
                            post("uncut-" + case.name, uncut_rdma())
                        answered.add(act)
                if time.monotonic() > deadline:
                    raise TimeoutError("node a did not finish case %s" % case.name)
                time.sleep(0.2)
        except Exception as e:  # noqa: BLE001 - report and tell node a
            print("node b, case %s: %s: %s" % (case.name, type(e).__name__, e))
            post("failed-b", str(e))
            ok = False
        finally:
            if cut:
                uncut_rdma()
            if agent:
                print("node b, case %s, agent log:\n%s" % (case.name, agent.log_text()[-2500:]))
                agent.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        if not ok:
            break
    return 0 if ok else 1


class TwoNodePathCheckTest(unittest.TestCase):
    def run_case(self, case, nbytes):
        tmp = tempfile.mkdtemp(prefix="rdmig-pc-a-")
        a = None
        try:
            expect_a = sysfs_gid_index(case.netdev, case.addr)
            self.assertNotEqual(expect_a, 0, "index 0 is eth0's link-local GID")
            a = case.start_agent(tmp, "agent-a")
            binfo = await_("agent-b-" + case.name, 300)
            b = PeerAgent(PEER_ADDR, binfo["port"], binfo["token"])
            print("\n%s: GID table of %s: %s" % (case.name, DEV, sorted(
                (n, g) for n, g in gid_table().items() if g[1] is not None)))
            print("%s: expected GID index: node a %d, node b %d" % (case.name, expect_a, binfo["gidIndex"]))

            # Both agents chose (and report) the GID of their address on that netdev, RoCE v2.
            for agent, dev_is_mine, addr, index in ((a, True, case.addr, expect_a),
                                                    (b, False, case.peer_addr, binfo["gidIndex"])):
                labels, value = selection(agent)
                self.assertEqual(value, 1, labels)
                self.assertEqual((labels["reason"], labels["netdev"], labels["address"], labels["gid_index"],
                                  labels["gid_type"]), ("ok", case.netdev, addr, str(index), "RoCE v2"), labels)
                self.assertEqual(labels["device"] == DEV, dev_is_mine, labels)
            # An IPv6 address in brackets ([fd00:100::1]:port), as every endpoint the agent writes.
            shown = re.escape("[%s]" % case.addr if ":" in case.addr else case.addr)
            self.assertRegex(a.log_text(), r"rdma=%s port=1 netdev=%s gid_index=%d gid_type=RoCE v2 .*address=%s:\d+ " %
                             (DEV, re.escape(case.netdev), expect_a, shown))

            took = warm_neighbour(case.addr, case.peer_addr)
            if case.netdev == "mv100":
                # The peer's macvlan answered for its address, not the VLAN below it (two-node-lib.sh
                # sets arp_ignore on every interface): RoCE v2 reaches node b on mv100 in every run.
                self.assertNotIn(binfo["eth0Mac"], neighbour(case.peer_addr))
            elif case.netdev == "eth0.100":
                # And the VLAN's address by the VLAN (eth0's MAC), not by the macvlan above it.
                self.assertIn(binfo["eth0Mac"], neighbour(case.peer_addr))
            print("%s: %s answered from %s in %.1f s (%s)" % (case.name, case.peer_addr, case.addr, took,
                                                             neighbour(case.peer_addr)))
            post("want-counters-%s-0" % case.name, True)
            b_before = await_("counters-%s-0" % case.name)
            a_before = counters()
            sent_before = pathcheck_bytes(a, "sent")
            t = b.call("POST", "/v1/pathchecks", {"role": "target", "bytes": nbytes, "chunkSize": "1Mi", "channels": 2})
            s = a.call("POST", "/v1/pathchecks", {"role": "source", "bytes": nbytes, "chunkSize": "1Mi", "channels": 2,
                                                  "target": {"endpoint": t["endpoint"], "checkId": t["checkId"],
                                                             "token": t["token"]}})
            deadline = time.monotonic() + 300
            while True:
                src = a.call("GET", "/v1/pathchecks/" + s["id"])
                if src["phase"] in ("Succeeded", "Failed", "Cancelled") or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            dst = b.call("GET", "/v1/pathchecks/" + t["id"])
            a_after = counters()
            post("want-counters-%s-1" % case.name, True)
            b_after = await_("counters-%s-1" % case.name)
            print("%s: target endpoint %s\nsource: %s\ntarget: %s" % (case.name, t["endpoint"], src, dst))
            if case.data_plane != ADDR and ":" in case.peer_addr:  # node b's data plane on IPv6: bracketed
                self.assertEqual(t["endpoint"].rsplit(":", 1)[0], "[%s]" % case.peer_addr)
            sent, rcvd = a_after["sent"] - a_before["sent"], b_after["rcvd"] - b_before["rcvd"]
            b_roce_in = b_after["roce_in"] - b_before["roce_in"]
            print("%s: %s sent_pkts +%d; node b: UDP 4791 packets in +%d, rxeb rcvd_pkts +%d; for %d bytes" %
                  (case.name, DEV, sent, b_roce_in, rcvd, nbytes))
            if not case.carries:
                # The CM requests left rxea and reached node b's IP stack; rxeb took none.
                self.assertEqual(src["phase"], "Failed", src)
                self.assertIn("RDMA channel", src.get("error", ""), src)
                # Within the agents' rdma.connectTimeoutSeconds (a check's connect took a fixed 15 s
                # until 2026-12-06), plus the check's own set-up.
                self.assertLess(src["durationMs"], (CONNECT_TIMEOUT + 4) * 1000, src)
                self.assertGreater(sent, 0, "rxea sent no CM packet (neighbour: %s)" % neighbour(case.peer_addr))
                self.assertGreaterEqual(b_roce_in, sent, "the CM packets did not all reach node b")
                self.assertEqual(rcvd, 0, "rxeb received RoCE v2 on a macvlan: this kernel's rxe carries it, "
                                          "make the macvlan case one that moves bytes")
                return
            self.assertEqual(src["phase"], "Succeeded", src)
            self.assertEqual(dst["phase"], "Succeeded", dst)
            self.assertEqual((src["transport"], src["transportReason"]), ("rdma", "auto-both-rdma"))
            self.assertEqual(dst["bytesVerified"], nbytes)
            self.assertGreater(src["throughputBytesPerSecond"], 0)
            self.assertGreater(src["rttMicroseconds"], 0)
            self.assertEqual(src["localRdma"]["device"], DEV)
            self.assertEqual((src["localRdma"]["gidType"], src["localRdma"]["netdev"]), ("RoCE v2", case.netdev))
            self.assertEqual((src["peerRdma"]["gidType"], src["peerRdma"]["netdev"]), ("RoCE v2", case.netdev))
            self.assertEqual((src["localRdma"]["gid"], src["localRdma"]["gidIndex"]), (gid_of(case.addr), expect_a))
            self.assertEqual((src["peerRdma"]["gid"], src["peerRdma"]["gidIndex"]),
                             (gid_of(case.peer_addr), binfo["gidIndex"]))
            self.assertNotEqual(src["peerRdma"]["device"], DEV)  # rxeb: the other node's device
            self.assertEqual(dst["localRdma"], src["peerRdma"])
            self.assertEqual(src["localRdma"]["mtu"], src["peerRdma"]["mtu"])
            self.assertGreaterEqual(pathcheck_bytes(a, "sent") - sent_before, nbytes)
            self.assertGreaterEqual(sent, nbytes // 4096, "rxea sent too few packets")
            self.assertGreaterEqual(rcvd, nbytes // 4096, "rxeb received too few packets")
            self.assertGreaterEqual(b_roce_in, rcvd, "rxeb counted packets that node b's IP stack did not see")
        finally:
            post("done-" + case.name, True)
            if a:
                a.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    def test_1_eth0_address_of_the_device(self):
        self.run_case(CASES[0], BYTES)

    def test_2_vlan_given_as_rdma_netdev_ipv4(self):
        self.run_case(CASES[1], SMALL)

    def test_3_ipv6_address_on_the_vlan_given_as_rdma_address(self):
        self.run_case(CASES[2], SMALL)

    def test_4_macvlan_given_as_rdma_netdev(self):
        self.run_case(CASES[3], 8 << 20)

    def test_5_rdma_broken_mid_stream_fails_the_check_within_seconds_naming_why(self):
        case = CASES[4]
        tmp = tempfile.mkdtemp(prefix="rdmig-pc-a-")
        a = Agent(tmp, "agent-a", config=case.config(), log_level="debug")
        try:
            binfo = await_("agent-b-" + case.name, 300)
            b = PeerAgent(PEER_ADDR, binfo["port"], binfo["token"])
            timeout = 60
            sid, tid = start_check(a, b, 64 << 30, timeoutSeconds=timeout)  # far more than fits in the time
            deadline = time.monotonic() + 120
            while a.call("GET", "/v1/pathchecks/" + sid).get("bytesSent", 0) < (8 << 20):
                self.assertLess(time.monotonic(), deadline, "the check never got going")
                time.sleep(0.1)
            post("want-cut-" + case.name, True)
            await_("cut-" + case.name, 60)
            t0 = time.monotonic()
            src = settle(a, sid, timeout + 30)
            took = time.monotonic() - t0
            dst = settle(b, tid, 30)
            post("want-uncut-" + case.name, True)
            dropped = await_("uncut-" + case.name, 60)
            print("\nRoCE v2 dropped mid-stream (%d packets): source %s after %.1f s (%s), target %s (%s)"
                  % (dropped, src["phase"], took, src.get("error"), dst["phase"], dst.get("error")))
            self.assertEqual(src["phase"], "Failed", src)
            # Not the deadline: within seconds, the stall, named (pathcheck.stallTimeoutSeconds, 10 s),
            # or, whichever comes first, a channel whose writes went unacknowledged, named with its
            # rail: its acknowledgement watch (5 s: ack_watch.h) or its RDMA retries running out
            # (6 retries of the writes the dropped packets left unacknowledged: rdma_setup.cpp).
            self.assertLess(took, 30, "the check waited for its deadline instead of naming the stall")
            if "stalled" in src["error"]:
                self.assertIn("rdma path", src["error"])
            else:
                self.assertRegex(src["error"], r"rail 0: rxe[ab] [0-9.]+ to [0-9.]+(:\d+)?: channel \d+: "
                                 r"(work completion failed: transport retry counter exceeded|"
                                 r"the peer's RDMA NIC acknowledged nothing for \d+\.\d s)")
            self.assertIn(dst["phase"], ("Failed", "Cancelled"), dst)
            self.assertTrue(dst.get("error"), dst)
            self.assertGreater(dropped, 0)
            self.assertLess(src["bytesSent"], 64 << 30)
            # Both agents serve on; with the link back, a new check passes over RDMA.
            sid, tid = start_check(a, b, 16 << 20)
            src = settle(a, sid)
            self.assertEqual((src["phase"], src["transport"]), ("Succeeded", "rdma"), src)
            self.assertEqual(settle(b, tid)["bytesVerified"], 16 << 20)
        finally:
            post("done-" + case.name, True)
            a.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    def test_6_multus_network_status_gives_device_interface_and_address(self):
        self.run_case(CASES[5], SMALL)

    def test_7_multus_agent_inside_a_pod_network_namespace_chooses_from_the_file(self):
        """Node a only (node b serves CASES, which this is not part of)."""
        ns, netdev, addr = "rdmigpod", "net1", "10.102.0.1"
        tmp = tempfile.mkdtemp(prefix="rdmig-pc-pod-")
        agent = None
        ip = "iproute2-ip"
        try:
            for argv in ([ip, "netns", "add", ns],
                         [ip, "link", "add", "link", "eth0", "name", netdev, "type", "macvlan", "mode", "bridge"],
                         [ip, "link", "set", netdev, "netns", ns],
                         [ip, "-n", ns, "addr", "add", addr + "/24", "dev", netdev],
                         [ip, "-n", ns, "link", "set", "lo", "up"],
                         [ip, "-n", ns, "link", "set", netdev, "up"]):
                subprocess.run(argv, check=True, capture_output=True, text=True)
            # rxe gives the macvlan's address its RoCE v2 GID although net1 is in another namespace
            # (GIDs follow address events in every namespace): seen from here, ndevs names net1.
            deadline = time.monotonic() + 20
            while True:
                try:
                    expect = sysfs_gid_index(netdev, addr)
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            status = os.path.join(tmp, "network-status")
            write_atomically(status, json.dumps([
                {"name": "cbr0", "interface": "eth0", "ips": ["10.244.1.7"], "default": True},
                {"name": "rdmig-system/rdma-shared", "interface": netdev, "ips": [addr], "dns": {}}]))
            wrapper = os.path.join(tmp, "agent-in-pod")
            with open(wrapper, "w") as f:
                f.write('#!/bin/sh\nexec %s netns exec %s "%s" "$@"\n' % (ip, ns, os.environ["RDMIG_AGENT"]))
            os.chmod(wrapper, 0o755)
            agent = Agent(tmp, "agent-pod", binary=wrapper, log_level="debug", env={"POD_NAMESPACE": "rdmig-system"},
                          config={"transport": "auto", "api": {"address": "0.0.0.0"},
                                  "dataPlane": {"address": "0.0.0.0", "rdmaPort": 0},
                                  "rdma": {"network": "rdma-shared", "networkStatusFile": status,
                                           "networkWaitSeconds": 5}})
            log = agent.log_text()
            print("\nagent in namespace %s (expected GID index %d):\n%s" % (ns, expect, log[-2000:]))
            self.assertIn("rail 0: network rdmig-system/rdma-shared from %s: interface=%s address=%s rdma-device=- "
                          "pci-address=-" % (status, netdev, addr), log)
            self.assertRegex(log, r"rdma=%s port=1 netdev=%s gid_index=%d gid_type=RoCE v2 .*address=%s:\d+ " %
                             (DEV, netdev, expect, re.escape(addr)))
            self.assertNotIn("RDMA not used", log)
            # The agent runs in the namespace: its interfaces are the pod's, not the node's.
            out = subprocess.run([ip, "-n", ns, "-br", "addr"], check=True, capture_output=True, text=True).stdout
            self.assertIn(addr, out)
            self.assertEqual(os.readlink("/proc/%d/ns/net" % agent.proc.pid),
                             "net:[%d]" % os.stat("/run/netns/" + ns).st_ino, "the agent is not in " + ns)
        finally:
            if agent:
                agent.stop()
            subprocess.run([ip, "netns", "del", ns], capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if NODE == "b":
        sys.exit(serve_target())
    result = timed.main(verbosity=2, exit=False).result
    if not result.wasSuccessful():
        post("failed-a", "tests failed")
        sys.exit(1)
