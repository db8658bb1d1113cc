"""Runs in both VMs of run-two-vms.sh: a bare-QEMU migration between two nodes, each with its
own kernel, network stack, rxe device, rdmig-agent and QEMU.

Node a: the source agent (rxea, 10.99.1.1) and the source QEMU; it drives the test through
both agents' REST APIs, as the controller does. Node b: the target agent (rxeb, 10.99.1.2)
and the target QEMU (``-incoming defer -S``); it answers node a through the shared folder
(the target QMP socket, the target memory's digest, its rxe counters).
Checked per migration (0 and 8 multifd channels; with verifyChunks, every chunk checked against
its CRC32C at the far end; the guest is paused before it migrates, see migrate()): both agents
report transport rdma; the source QEMU's memory equals the target's, byte for byte; the target resumes; the agents'
rdma byte counters agree; and both rxe devices' hw counters rose by at least the packets the
migrated bytes need (sent on rxea, received on rxeb), so the bytes crossed between the two
devices over RDMA.
With RDMA between the nodes cut (node b drops UDP 4791, RoCE v2, with nftables; TCP still
works): with transport auto the migration falls back to TCP within the RDMA connect bound and
succeeds, byte-exact, both agents naming the reason auto-no-peer-rdma:unreachable; with
transport rdma it fails with that reason, both sides end, and the VM keeps running on node a.
Rails (run-two-vms.sh --rails 2: rxea/rxeb on eth0 10.99.1.x and rxea2/rxeb2 on eth1 10.99.2.x):
both agents list both devices under rdma.devices; the 8-channel migration (main + 8 multifd)
is striped across both rails (channel i on rail i mod 2: 0,2,4,6,8 and 1,3,5,7), and on each rail
the source's device sent, and the target's received, at least the packets the bytes of that rail
need; both rails carry bytes. Then the same migration to a second agent on node b with one rail
only (2 vs 1): it uses rail 0 alone and succeeds, byte-exact. One rail cut mid-stream: an
8-channel migration of the running guest (QEMU's max-bandwidth 4 MiB/s), and once both rails carry
bytes node b drops the RoCE v2 packets reaching it on eth1 only (nftables, iifname): the migration
fails within its no-progress bound, both agents end it, the VM runs on node a and not on node b;
the reason names rail 1 and its device (Soft-RoCE runs out of no retry: the channels'
acknowledgement watch fails the stalled channel 5 s on).
With dataPlane.failover on both agents: rail 1 cut moves its channels to rail 0 (RDMA only), every
rail cut moves them to TCP, and (both nodes with VLAN 100 on eth0, eth0.100 10.100.0.N, a second
address and GID of rail 0's device, listed as its alternateAddresses) rail 0's own address cut
(node b drops the RoCE v2 reaching eth0 untagged) moves every channel of a one-rail migration to the
VLAN addresses of the same devices; each byte-exact, each move named and counted.
One rail down at start: with node a's eth1 down (rxea2's port DOWN), a second node a agent with
both devices leaves rail 1 out, naming why (its log, rdmig_rdma_rail_up{rail="1",reason="no-device"}
0); eth1 comes back, and an 8-channel migration from that agent uses rail 0 alone, byte-exact, its
status listing rail 1 under railsLeftOut with the reason.
DSCP: node a's agent has rdma.trafficClass 104; during the first migration each node captures
(tcpdump) the first 20 RoCE v2 packets reaching it: all from the other node, all IP ToS 0x68.
Every agent runs unprivileged as the chart runs it for RDMA (rdmiglab.profile, "chart": IPC_LOCK
and no other capability, no_new_privs, seccomp RuntimeDefault, a read-only root), checked once
started from its /proc status.
  python3 test_agent_rdma_two_nodes.py  (RDMIG_AGENT, RDMIG_TOOLS, RDMIG_NODE, RDMIG_OUT)
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

sys.path.insert(0, os.environ.get("RDMIG_TOOLS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")))
from rdmiglab import Agent, QemuVm, migrate_via_agents, parse_prometheus  # noqa: E402
from rdmiglab.agent import TERMINAL, start_migration  # noqa: E402
from rdmiglab import timed  # noqa: E402

MEM_MIB = 128
# Each agent as the chart runs it for RDMA (tools/rdmiglab/profile.py; the chart test checks the list).
PROFILE = "chart"
# The migrations node a asks node b for, in the order of the tests (unittest sorts them by name):
# multifd channels, and whether node b cuts RDMA (drops RoCE v2) for it.
RDMA_CUT_RULE = "udp dport 4791 counter drop"
NODE = os.environ["RDMIG_NODE"]
PEER = "b" if NODE == "a" else "a"
DEV = os.environ["RDMIG_RDMA_DEV"]
# This node's rxe devices, one per rail (rdma.devices[i]); a second one with --rails 2.
DEVS = [DEV] + ([os.environ["RDMIG_RDMA_DEV2"]] if os.environ.get("RDMIG_RDMA_DEV2") else [])
# With two rails, six more: to a node b agent with one rail, one rail cut mid-stream (without
# failover, and with it: over the other rail), every rail cut mid-stream with failover (over TCP),
# rail 0 cut during post-copy with failover (over rail 1), and from a node a agent that started
# with one rail down. Then one more whatever the rails: rail
# 0's own address cut mid-stream with failover (over its alternate address on VLAN 100).
CASES = (10 if len(DEVS) > 1 else 4) + 1
# The rail-cut migration: QEMU's max-bandwidth, so that it is still under way when rail 1 is cut.
RAIL_CUT_BANDWIDTH = 4 << 20
RAIL_CUT_NO_PROGRESS = 45  # s, both agents' noProgressTimeoutSeconds for it
# Multifd channels of the striped migrations: 8, as KubeVirt opens (main + 8 = 9 channels, 5 on
# rail 0 and 4 on rail 1).
MULTIFD = 8
ADDR = os.environ["RDMIG_VM_ADDR"]
PEER_ADDR = os.environ["RDMIG_VM_PEER_ADDR"]
# Rail 1's addresses (--rails 2).
ADDR2 = os.environ.get("RDMIG_VM_ADDR2", "")
PEER_ADDR2 = os.environ.get("RDMIG_VM_PEER_ADDR2", "")
# Rail 0's device's second address: VLAN 100 on eth0 (eth0.100, 10.100.0.1 on node a, .2 on b),
# with a RoCE v2 GID of its own on the same rxe device (add_vlan_alternate): its alternateAddresses.
ALT_NETDEV = os.environ["RDMIG_RDMA_NETDEV"] + ".100"
ALT_ADDR = "10.100.0.%d" % (1 if NODE == "a" else 2)
PEER_ALT_ADDR = "10.100.0.%d" % (2 if NODE == "a" else 1)
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


def hw_counters(dev=DEV):
    """{"sent": sent_pkts, "rcvd": rcvd_pkts} of one rxe device on this node (test_pathcheck_rdma_two_nodes too)."""
    base = "/sys/class/infiniband/%s/ports/1/hw_counters/" % dev
    with open(base + "sent_pkts") as s, open(base + "rcvd_pkts") as r:
        return {"sent": int(s.read()), "rcvd": int(r.read())}


def rail_counters():
    """hw_counters of every rxe device (rail) on this node, by device."""
    return {dev: hw_counters(dev) for dev in DEVS}


def counters_delta(before, after):
    return {dev: {k: after[dev][k] - before[dev][k] for k in ("sent", "rcvd")} for dev in after}


# Node a's agent marks its RDMA traffic with rdma.trafficClass 104 (IP ToS 0x68: DSCP 26, AF31);
# node b's sets none, so its packets carry the class only as the passive side of a's CM request.
TRAFFIC_CLASS = 104
# How long a source tries an RDMA channel before the peer counts as unreachable
# (rdma.connectTimeoutSeconds; 15 by default): above rdma_cm's own retry of a lost request (about
# 4 s), well below the default, so the RoCE-cut cases wait 6 s, not 15.
CONNECT_TIMEOUT = 6


def agent_config(rails=len(DEVS), failover=False, alternate=False):
    # The REST API on every address (node a calls node b's); the data plane on eth0's address,
    # which is also what the target advertises to the source. One rail: the single rdma keys;
    # more: rdma.devices, in the same order on both nodes (rails are matched by index). Each rail's
    # address given (eth0 also holds the VLAN's address); `alternate`: rail 0's alternate address.
    addresses = [ADDR, ADDR2]
    devices = [{"device": d, "address": addresses[i]} for i, d in enumerate(DEVS[:rails])]
    if alternate:
        devices[0]["alternateAddresses"] = [ALT_ADDR]
    rdma = dict(devices[0]) if rails == 1 else {"devices": devices}
    rdma["connectTimeoutSeconds"] = CONNECT_TIMEOUT
    if NODE == "a":
        rdma["trafficClass"] = TRAFFIC_CLASS
    data_plane = {"address": ADDR, "advertiseAddress": ADDR, "rdmaPort": 0}
    if failover:
        data_plane["failover"] = "on"
    return {"transport": "rdma", "rdma": rdma,
            "api": {"address": "0.0.0.0"},
            "dataPlane": data_plane}


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


def transferred_bytes(agent, transport, direction):
    samples, _ = parse_prometheus(agent.metrics())
    return samples.get(("rdmig_transferred_bytes_total",
                        frozenset({"transport": transport, "direction": direction, "traffic": "migration"}.items())), 0)


def rdma_bytes(agent, direction):
    return transferred_bytes(agent, "rdma", direction)


def tcp_bytes(agent, direction):
    return transferred_bytes(agent, "tcp", direction)


def nft(*args):
    subprocess.run(["nft"] + list(args), check=True)


def cut_rdma(rule=RDMA_CUT_RULE, table="rdmigcut"):
    """Node b drops every RoCE v2 packet it receives (UDP 4791); TCP keeps working. ``rule``:
    another match (one rail's interface only)."""
    nft("add", "table", "ip", table)
    nft("add", "chain", "ip", table, "in", "{ type filter hook input priority 0; }")
    nft("add", "rule", "ip", table, "in", *rule.split())


def uncut_rdma(table="rdmigcut"):
    """Removes the cut; answers how many RoCE v2 packets it dropped."""
    out = subprocess.run(["nft", "list", "table", "ip", table], check=True, capture_output=True, text=True).stdout
    nft("delete", "table", "ip", table)
    m = re.search(r"counter packets (\d+)", out)
    return int(m.group(1)) if m else -1


# One rail cut: node b drops the RoCE v2 packets reaching it on its second link (rail 1) only.
RAIL_CUT_TABLE = "rdmigrailcut"


def rail_cut_rule(netdev=None):
    return 'iifname "%s" udp dport 4791 counter drop' % (netdev or os.environ["RDMIG_RDMA_NETDEV2"])


def await_any(names, timeout=300.0):
    """The first of NAMES the other node posts (name, value)."""
    deadline = time.monotonic() + timeout
    while True:
        for name in names:
            path = os.path.join(RDV, name)
            if os.path.exists(path):
                with open(path) as f:
                    return name, json.load(f)
        if os.path.exists(os.path.join(RDV, "failed-" + PEER)):
            raise RuntimeError("waiting for %s: node %s failed" % (" or ".join(names), PEER))
        if time.monotonic() > deadline:
            raise TimeoutError("node %s posted none of %s within %.0fs" % (PEER, ", ".join(names), timeout))
        time.sleep(0.2)


def qemu_state(vm, timeout=60.0):
    """query-status of a QEMU, or how it is gone (a target whose incoming migration broke exits),
    or that it gave no answer within `timeout` s (a target QEMU whose incoming multifd sync blocks
    its main loop never answers: the rail-cut case asks with 10 s, not 60)."""
    if not vm.alive():
        return "exited (%s)" % vm.proc.returncode
    try:
        return vm.qmp("query-status", timeout=timeout)["status"]
    except Exception as e:  # noqa: BLE001 - its monitor went away as it exited, or never answered
        return "no answer (%s: %s)" % (type(e).__name__, e)


def ip(*args):
    """iproute2's ip (busybox's own applet shadows it in the VM: vm-init.sh)."""
    prog = "/usr/sbin/iproute2-ip" if os.path.exists("/usr/sbin/iproute2-ip") else "ip"
    subprocess.run([prog] + list(args), check=True)


def ip_link(*args):
    ip("link", *args)


def add_vlan_alternate():
    """VLAN 100 on eth0 with ALT_ADDR: rxe gives it a RoCE v2 GID on rail 0's device (the second
    address of the same device that the address-failover case moves channels to)."""
    netdev = os.environ["RDMIG_RDMA_NETDEV"]
    ip_link("add", "link", netdev, "name", ALT_NETDEV, "type", "vlan", "id", "100")
    ip("addr", "add", ALT_ADDR + "/24", "dev", ALT_NETDEV)
    ip_link("set", ALT_NETDEV, "up")
    wait_gid(DEV, ALT_ADDR)


def wait_port_state(dev, state, timeout=30.0):
    """Waits until port 1 of rxe device DEV is STATE (ACTIVE, DOWN): rxe follows its netdev."""
    path = "/sys/class/infiniband/%s/ports/1/state" % dev
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as f:
            now = f.read().strip()  # "4: ACTIVE", "1: DOWN"
        if now.endswith(state):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("%s port 1 is %r, not %s, after %.0f s" % (dev, now, state, timeout))
        time.sleep(0.1)


def wait_gid(dev, addr, timeout=30.0):
    """Waits until rxe device DEV lists the IPv4-mapped GID of ADDR again (the kernel adds GIDs as
    the interface and its addresses come up)."""
    want = "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x" % tuple(int(x) for x in addr.split("."))
    base = "/sys/class/infiniband/%s/ports/1/gids" % dev
    deadline = time.monotonic() + timeout
    while True:
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry)) as f:
                    if f.read().strip() == want:
                        return
            except OSError:  # an empty slot reads as EINVAL
                pass
        if time.monotonic() > deadline:
            raise TimeoutError("%s has no GID %s for %s after %.0f s" % (dev, want, addr, timeout))
        time.sleep(0.1)


def wait_ping(addr, timeout=60.0):
    deadline = time.monotonic() + timeout
    while subprocess.run(["ping", "-c", "1", "-W", "1", addr], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError("%s does not answer ping after %.0f s" % (addr, timeout))


class Capture:
    """tcpdump of the first 20 RoCE v2 packets (UDP 4791) that reach this node on eth0."""

    def __init__(self):
        # -Z root: the VM has no tcpdump user; -t: each header line starts with "IP (tos".
        self.proc = subprocess.Popen(["tcpdump", "-Z", "root", "-Q", "in", "-t", "-i", os.environ["RDMIG_RDMA_NETDEV"],
                                      "-n", "-v", "-c", "20", "udp dst port 4791"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # wait until it listens
            line = self.proc.stderr.readline()
            self.err.append(line)
            if "listening on" in line or not line:
                break

    def result(self):
        """{tos value: count} of the captured packets from the peer node, and how many were from it."""
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        tos, from_peer = {}, 0
        for line in out.splitlines():
            m = re.match(r"IP \(tos (0x[0-9a-f]+),", line)
            if m:
                tos[m.group(1)] = tos.get(m.group(1), 0) + 1
            if re.match(r"\s*%s\.\d+ > %s\.4791: UDP" % (re.escape(PEER_ADDR), re.escape(ADDR)), line):
                from_peer += 1
        return {"tos": tos, "fromPeer": from_peer}


def serve_target():
    """Node b: the target side of each migration node a runs. Returns the exit status."""
    tmp = tempfile.mkdtemp(prefix="rdmig-rdma-b-")
    # dataPlane.failover on: only a source agent that has it on too asks for it (the failover cases);
    # rail 0's alternate address listens too (only a source with one pairs with it).
    agent = Agent(tmp, "agent-b", config=agent_config(failover=True, alternate=True), log_level="debug",
                  profile=PROFILE)
    # With two rails here: a second agent with rail 0 only, the target of the 2-vs-1 case.
    one_rail = Agent(tmp, "agent-b1", config=agent_config(rails=1), log_level="debug", profile=PROFILE) if len(DEVS) > 1 else None
    ok = True
    try:
        post("agent-b", {"port": agent.api_port, "token": agent.token})
        if one_rail:
            post("agent-b1", {"port": one_rail.api_port, "token": one_rail.token})
        for seq in range(CASES):  # in the order node a's tests ask for them
            want = await_("want-%d" % seq, 600)
            name, m = want["name"], want["multifd"]
            dst = QemuVm(tmp, "dst-%s" % name, mem_mib=MEM_MIB, firmware_only=True,
                         incoming_defer=True, paused=True)
            cut = rail_cut = False
            try:
                if want["cutRdma"]:
                    cut_rdma()
                    cut = True
                capture = Capture() if want.get("capture") else None
                before = rail_counters()
                post("dst-%s" % name, dst.agent_qmp_path)
                if want.get("cutRail"):
                    # Once node a sees bytes on both rails it asks for the cut (or tells that the
                    # migration ended without it).
                    got, _ = await_any(["cut-%s" % name, "migrated-%s" % name], 600)
                    if got.startswith("cut-"):
                        # Rail 1 only, or (cutRail "all") RoCE v2 on both rails, or ("address") rail 0's
                        # own address: what reaches eth0 untagged (VLAN 100's arrives on eth0.100).
                        kind = want["cutRail"]
                        rule = (RDMA_CUT_RULE if kind == "all" else
                                rail_cut_rule(os.environ["RDMIG_RDMA_NETDEV"]) if kind in ("address", "rail0")
                                else rail_cut_rule())
                        cut_rdma(rule, RAIL_CUT_TABLE)
                        rail_cut = True
                        post("cut-applied-%s" % name, True)
                outcome = await_("migrated-%s" % name, 600)
                # A migration that failed as the case wanted may have left the target QEMU stuck.
                reply = {"counters": counters_delta(before, rail_counters()),
                         "status": qemu_state(dst, timeout=60.0 if outcome == "ok" else 10.0)}
                if capture:
                    reply["capture"] = capture.result()
                if cut:
                    cut = False
                    reply["rdmaDropped"] = uncut_rdma()
                if rail_cut:
                    rail_cut = False
                    reply["rdmaDropped"] = uncut_rdma(RAIL_CUT_TABLE)
                if outcome == "ok":
                    reply["digest"] = dst.memory_digest(keep=True)
                elif outcome != "failed-as-expected":
                    ok = False
                    print(agent.log_text()[-4000:])
                post("dst-state-%s" % name, reply)
                if outcome == "ok":
                    if await_("compared-%s" % name, 300) == "dump":
                        # The memories differ: node a compares them page by page.
                        shutil.copyfile(os.path.join(dst.workdir, dst.name + ".mem"),
                                        os.path.join(os.environ["RDMIG_OUT"], "mismatch-%s-dst.mem" % name))
                        post("dumped-%s" % name, True)
                    dst.cont()
                    post("dst-resumed-%s" % name, dst.status())
            finally:
                if cut:
                    uncut_rdma()
                if rail_cut:
                    uncut_rdma(RAIL_CUT_TABLE)
                dst.kill()
        await_("done", 300)
    except Exception as e:  # noqa: BLE001 - report and tell node a
        print("node b: %s: %s" % (type(e).__name__, e))
        print(agent.log_text()[-4000:])
        post("failed-b", str(e))
        ok = False
    finally:
        agent.stop()
        if one_rail:
            one_rail.stop()
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
        cls.a = Agent(cls.tmp, "agent-a", config=agent_config(), log_level="debug", profile=PROFILE)
        b = await_("agent-b", 300)
        cls.b = PeerAgent(PEER_ADDR, b["port"], b["token"])
        cls.b1 = None
        if len(DEVS) > 1:
            b1 = await_("agent-b1", 300)
            cls.b1 = PeerAgent(PEER_ADDR, b1["port"], b1["token"])

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
    dumped = set()  # migrations whose memories differed: node b was asked for its dump instead

    def assert_same_memory(self, src, dst_digest, name):
        """The source's memory equals the target's (its digest); when not, node b's dump comes
        over and the failure names how many pages differ, where, and what the target has there
        (zeros, or a page the source has elsewhere: data in the wrong place)."""
        path = os.path.join(self.tmp, name + ".mem")
        if src.memory_digest(path=path, keep=True) == dst_digest:
            os.unlink(path)
            return
        TwoNodeAgentRdmaTest.dumped.add(name)
        post("compared-%s" % name, "dump")
        await_("dumped-%s" % name, 300)
        page = 4096
        with open(path, "rb") as f:
            a = f.read()
        with open(os.path.join(os.environ["RDMIG_OUT"], "mismatch-%s-dst.mem" % name), "rb") as f:
            b = f.read()
        where = {}
        for off in range(0, len(a), page):
            where.setdefault(a[off:off + page], off)
        diff = [off for off in range(0, min(len(a), len(b)), page) if a[off:off + page] != b[off:off + page]]
        detail = []
        for off in diff[:12]:
            got = b[off:off + page]
            kind = "zeros" if got == bytes(page) else (
                "the source's page at %#x" % where[got] if got in where else "no source page")
            first = next(i for i in range(page) if a[off + i] != got[i])
            detail.append("%#x (from byte %d: %s)" % (off, first, kind))
        os.unlink(path)
        self.fail("memory differs between the nodes: %d of %d pages differ, the first at %s"
                  % (len(diff), len(a) // page, ", ".join(detail)))

    def ask(self, name, m, cut_rdma=False, capture=False, cut_rail=False):
        """Tells node b which migration comes next; returns the source QEMU and the target's QMP socket.
        ``cut_rail``: node b cuts rail 1 (or with "all", every rail) when node a posts cut-NAME (see
        test_rail_cut_mid_stream...)."""
        post("want-%d" % TwoNodeAgentRdmaTest.asked, {"name": name, "multifd": m, "cutRdma": cut_rdma,
                                                      "capture": capture, "cutRail": cut_rail})
        TwoNodeAgentRdmaTest.asked += 1
        src = QemuVm(self.tmp, "src-%s" % name, mem_mib=MEM_MIB, firmware_only=True, blob=self.blob)
        self.vms.append(src)
        self.assertEqual(src.status(), "running")
        return src, await_("dst-%s" % name, 300)

    def migrate(self, m, target=None, rails=1, name=None, source=None):
        """Migrates with m multifd channels from `source` (node a's agent) to `target` (node b's)
        expecting `rails` rails used."""
        target = target or self.b
        source = source or self.a
        name = name or "rdma-%d" % m
        outcome = "failed"
        capture = None
        try:
            # On the first migration both nodes capture the RoCE v2 packets that reach them.
            src, dst_qmp = self.ask(name, m, capture=(m == 0))
            # The guest is paused first. Running, in 4 of about 17 runs of this row with multifd
            # (one in a full run with nothing else on the machine) and once without (a full run on
            # a loaded machine, 2026-12-02) the target's memory held an older version of one page
            # (0x6000, its last 128 bytes: SeaBIOS's stack, written by the idle guest's timer
            # interrupts) although both agents Succeeded and, with verifyChunks, every chunk of
            # every channel matched its CRC32C at the far end, in sequence: the bytes QEMU 7.2 wrote
            # are the bytes the target QEMU read, so the stale page is QEMU's dirty tracking under
            # nested TCG, not the transport's. Live guests migrate, memories compared, in the TCP
            # suites (integration_agent_migration, integration_agent_splice); here every byte of
            # a paused guest's RAM crosses the two RDMA devices and is compared.
            src.qmp("stop")
            self.assertEqual(src.status(), "paused")
            capture = Capture() if m == 0 else None
            before = rail_counters()
            sent_a, recv_b = rdma_bytes(source, "sent"), rdma_bytes(target, "received")
            metrics_a = self.source_metrics(source)
            s, t = migrate_via_agents(source, target, src.agent_qmp_path, dst_qmp,
                                      multifd_channels=m, chunk_size="1Mi", ring_depth=8,
                                      vm="two-node-vm-%s" % name, transport="rdma", timeout=400,
                                      verifyChunks=True)
            mine = counters_delta(before, rail_counters())
            if s["phase"] != "Succeeded":
                print(source.log_text()[-4000:])
            else:
                outcome = "ok"
        finally:
            post("migrated-%s" % name, outcome)
        try:
            self.assertEqual(s["phase"], "Succeeded", s["result"]["reason"])
            self.assertEqual(t["phase"], "Succeeded", t["result"]["reason"])
            self.assertEqual(s["transport"], "rdma")
            self.assertEqual(t["transport"], "rdma")
            self.assertEqual(s["channels"], m + 1)
            # Every chunk, both ways, checked against its CRC32C before it reached QEMU: a transport
            # that corrupts a chunk fails the migration here naming it, instead of the memories
            # differing below.
            self.assertEqual((s["verifyChunks"], t["verifyChunks"]), (True, True))
            moved = s["progress"]["dataBytesSent"]
            self.assertEqual(moved, t["progress"]["dataBytesReceived"])
            self.assertGreater(moved, 64 << 20)
            # Both agents counted these bytes as rdma (deltas: each test stands on its own).
            self.assertGreaterEqual(rdma_bytes(source, "sent") - sent_a, moved)
            self.assertGreaterEqual(rdma_bytes(target, "received") - recv_b, moved)
            delta = {k: v - metrics_a[k] for k, v in self.source_metrics(source).items()}
            self.assertGreater(delta["write_latency_count"], 0)
            self.assertEqual(delta["selected_requested"], 1)
            self.assertEqual(src.status(), "postmigrate")
            dst = await_("dst-state-%s" % name, 400)
            self.assertEqual(dst["status"], "paused")
            self.check_rails(s, t, m, rails, mine, dst["counters"], source)
            self.assert_same_memory(src, dst["digest"], name)
            if capture:
                # rdma.trafficClass 104 on node a's agent: IP ToS 0x68 (DSCP 26) on every RoCE v2 packet
                # a sent (captured on b) and on every one b sent back (captured on a: the passive side
                # takes the class from a's CM request). Without the option both are 0x0.
                caught = capture.result()
                print("RoCE v2 packets with rdma.trafficClass %d on node a: reaching b %s, reaching a %s"
                      % (TRAFFIC_CLASS, dst["capture"], caught))
                self.assertEqual(dst["capture"], {"tos": {"0x68": 20}, "fromPeer": 20})
                self.assertEqual(caught, {"tos": {"0x68": 20}, "fromPeer": 20})
        finally:
            if name not in self.dumped:
                post("compared-%s" % name, True)
        self.assertEqual(await_("dst-resumed-%s" % name, 120), "running")
        print("%s: total %s ms, downtime %s ms, %d bytes, %d chunks"
              % (name, s["result"]["totalTimeMs"], s["result"]["downtimeMs"], moved, s["progress"]["chunksSent"]))
        return s, t

    def check_rails(self, s, t, m, rails, mine, theirs, source):
        """Channel i on rail i mod n on both agents; on every rail a's device sent, and b's received,
        at least one packet per 4096 bytes (the largest RoCE MTU) of that rail's bytes."""
        self.assertEqual(len(s["rails"]), rails, s["rails"])
        self.assertEqual(len(t["rails"]), rails, t["rails"])
        self.assertEqual(sum(r["bytesSent"] for r in s["rails"]), s["progress"]["dataBytesSent"])
        samples, _ = parse_prometheus(source.metrics())
        for i, (rs, rt) in enumerate(zip(s["rails"], t["rails"])):
            self.assertEqual((rs["rail"], rt["rail"]), (i, i))
            self.assertEqual(rs["channels"], list(range(i, m + 1, rails)))
            self.assertEqual(rt["channels"], rs["channels"])
            self.assertEqual(rs["device"], DEVS[i])
            self.assertEqual(rs["bytesSent"], rt["bytesReceived"])
            self.assertGreater(rs["bytesSent"], 0, "rail %d carried nothing" % i)
            # Chunks: as many arrived as left, none larger than the chunk size; a throughput.
            self.assertEqual(rs["chunksSent"], rt["chunksReceived"])
            self.assertGreaterEqual(rs["chunksSent"] * s["chunkSize"], rs["bytesSent"])
            self.assertGreater(rs["throughputBytesPerSecond"], 0)
            sent, rcvd = mine[rs["device"]]["sent"], theirs[rt["device"]]["rcvd"]
            print("rail %d: %d bytes in %d chunks, %d B/s; %s sent_pkts +%d, %s rcvd_pkts +%d (channels %s, %s -> %s)"
                  % (i, rs["bytesSent"], rs["chunksSent"], rs["throughputBytesPerSecond"], rs["device"], sent,
                     rt["device"], rcvd, rs["channels"], rs["address"], rs["peerAddress"]))
            self.assertGreaterEqual(sent, rs["bytesSent"] // 4096, "%s sent too few packets" % rs["device"])
            self.assertGreaterEqual(rcvd, rs["bytesSent"] // 4096, "%s received too few packets" % rt["device"])
            self.assertGreaterEqual(samples.get(("rdmig_rdma_rail_bytes_total", frozenset(
                {"rail": str(i), "device": rs["device"], "direction": "sent", "traffic": "migration"}.items())), 0),
                rs["bytesSent"])
            self.assertGreaterEqual(samples.get(("rdmig_rdma_rail_chunks_total", frozenset(
                {"rail": str(i), "device": rs["device"], "direction": "sent", "traffic": "migration"}.items())), 0),
                rs["chunksSent"])

    def test_rdma_cut_auto_falls_back_to_tcp_naming_why(self):
        name = "cut-auto"
        outcome = "failed"
        try:
            src, dst_qmp = self.ask(name, 0, cut_rdma=True)
            metrics_a = self.source_metrics()
            tcp_a = tcp_bytes(self.a, "sent")
            t0 = time.monotonic()
            s, t = migrate_via_agents(self.a, self.b, src.agent_qmp_path, dst_qmp, chunk_size="1Mi", ring_depth=8,
                                      vm="two-node-vm-cut-auto", transport="auto",
                                      target_options={"transport": "auto"}, timeout=400)
            took = time.monotonic() - t0
            if s["phase"] == "Succeeded":
                outcome = "ok"
            else:
                print(self.a.log_text()[-4000:])
        finally:
            post("migrated-%s" % name, outcome)
        try:
            dst = await_("dst-state-%s" % name, 400)
            print("rdma cut, transport auto: %s in %.1f s over %s (%s); node b dropped %d RoCE v2 packets"
                  % (s["phase"], took, s["transport"], s["transportReason"], dst["rdmaDropped"]))
            self.assertEqual(s["phase"], "Succeeded", s["result"]["reason"])
            self.assertEqual(t["phase"], "Succeeded", t["result"]["reason"])
            for side in (s, t):
                self.assertEqual((side["transport"], side["transportReason"]), ("tcp", "auto-no-peer-rdma:unreachable"))
            # RDMA was tried and blocked on the wire, not skipped.
            self.assertGreater(dst["rdmaDropped"], 0)
            moved = s["progress"]["dataBytesSent"]
            self.assertGreater(moved, 64 << 20)
            self.assertEqual(moved, t["progress"]["dataBytesReceived"])
            self.assertGreaterEqual(tcp_bytes(self.a, "sent") - tcp_a, moved)
            delta = {k: v - metrics_a[k] for k, v in self.source_metrics().items()}
            self.assertEqual((delta["selected_fallback"], delta["selected_auto_rdma"]), (1, 0))
            # The RDMA connect is bounded (rdma.connectTimeoutSeconds); the TCP migration of 128 MiB takes seconds.
            self.assertLess(took, 120)
            self.assert_same_memory(src, dst["digest"], name)
        finally:
            if name not in self.dumped:
                post("compared-%s" % name, True)
        self.assertEqual(await_("dst-resumed-%s" % name, 120), "running")

    def test_rdma_cut_rdma_required_fails_naming_why_and_vm_stays(self):
        name = "cut-rdma"
        outcome = "failed"
        try:
            src, dst_qmp = self.ask(name, 0, cut_rdma=True)
            t0 = time.monotonic()
            # Only the source asks for rdma; the target would allow auto.
            s, t = migrate_via_agents(self.a, self.b, src.agent_qmp_path, dst_qmp, chunk_size="1Mi", ring_depth=8,
                                      vm="two-node-vm-cut-rdma", transport="rdma",
                                      target_options={"transport": "auto"}, timeout=400)
            took = time.monotonic() - t0
            if s["phase"] == "Failed" and t["phase"] == "Failed":
                outcome = "failed-as-expected"
        finally:
            post("migrated-%s" % name, outcome)
        dst = await_("dst-state-%s" % name, 400)
        print("rdma cut, transport rdma: source %s in %.1f s (%s), target %s (%s)"
              % (s["phase"], took, s["result"]["reason"], t["phase"], t["result"]["reason"]))
        self.assertEqual(s["phase"], "Failed")
        self.assertIn("auto-no-peer-rdma:unreachable", s["result"]["reason"])
        self.assertIn("rdma is required", s["result"]["reason"])
        self.assertEqual(t["phase"], "Failed")
        self.assertGreater(dst["rdmaDropped"], 0)
        # The source gave up after rdma.connectTimeoutSeconds (6 s here), not the default 15 s.
        self.assertLess(took, 15, "rdma.connectTimeoutSeconds %d did not bound the connect" % CONNECT_TIMEOUT)
        self.assertEqual(src.status(), "running")

    def test_rail_cut_mid_stream_fails_cleanly_and_the_vm_stays(self):
        if len(DEVS) < 2:
            self.skipTest("one rail per node (run-two-vms.sh without --rails 2)")
        name = "rail-cut"
        outcome = "failed"
        rail1 = list(range(1, MULTIFD + 1, 2))  # the channels on rail 1
        try:
            src, dst_qmp = self.ask(name, MULTIFD, cut_rail=True)
            # The guest runs (nothing is compared: the migration must fail), and QEMU sends at most
            # RAIL_CUT_BANDWIDTH, so the 64 MiB of the blob take about 16 s: the cut lands mid-stream.
            # noProgressTimeoutSeconds bounds the case should the cut not fail a channel (it must,
            # well before: the RDMA retries of rail 1's queue pairs run out within seconds).
            target, source = start_migration(self.a, self.b, src.agent_qmp_path, dst_qmp, multifd_channels=MULTIFD,
                                             chunk_size="1Mi", ring_depth=8, vm="two-node-vm-" + name,
                                             transport="rdma", maxBandwidthBytesPerSecond=RAIL_CUT_BANDWIDTH,
                                             noProgressTimeoutSeconds=RAIL_CUT_NO_PROGRESS,
                                             target_options={"noProgressTimeoutSeconds": RAIL_CUT_NO_PROGRESS})
            deadline = time.monotonic() + 120
            while True:
                st = self.a.get(source["id"])
                flowing = {r["rail"]: r["bytesSent"] for r in st.get("rails", [])}
                if flowing.get(1, 0) >= 1 << 20 and flowing.get(0, 0) > 0:
                    break
                self.assertNotIn(st["phase"], TERMINAL, "the migration ended before both rails carried bytes: %s" % st)
                self.assertLess(time.monotonic(), deadline, "rail 1 carried no MiB within 120 s: %s" % st)
                time.sleep(0.1)
            post("cut-%s" % name, True)
            await_("cut-applied-%s" % name, 60)
            t0 = time.monotonic()
            s = self.a.wait(source["id"], timeout=300)
            took = time.monotonic() - t0
            t = self.b.wait(target["id"], timeout=60)
            if s["phase"] == "Failed" and t["phase"] == "Failed":
                outcome = "failed-as-expected"
            else:
                print(self.a.log_text()[-4000:])
        finally:
            post("migrated-%s" % name, outcome)
        dst = await_("dst-state-%s" % name, 400)
        reason = s["result"]["reason"]
        # What each channel saw, and when (the source agent's warnings since the migration began).
        print("\n".join(line for line in self.a.log_text().splitlines()
                        if "WARN" in line and (source["id"] in line or "rdma" in line))[-3000:])
        print("rail 1 cut mid-stream (%s bytes on rails %s when cut; node b dropped %d RoCE v2 packets on %s): "
              "source %s %.1f s after the cut (%s); target %s (%s); source VM %s, target QEMU %s"
              % (sum(flowing.values()), flowing, dst["rdmaDropped"], os.environ.get("RDMIG_RDMA_NETDEV2"),
                 s["phase"], took, reason, t["phase"], t["result"]["reason"], src.status(), dst["status"]))
        self.assertEqual(s["phase"], "Failed", reason)
        self.assertEqual(t["phase"], "Failed", t["result"]["reason"])
        # The reason names rail 1 and its device: the source's channel on it ("data plane (rail 1:
        # rxea2 10.99.2.1 to 10.99.2.2:<port>): channel 3: work completion failed ..."), or, when
        # node b's end of rail 1 gave up first, node b's verdict naming its own ("target failed: data
        # plane (rail 1: rxeb2 10.99.2.2 to 10.99.2.1): channel 3: ...", or, once its QEMU exited,
        # "target failed: the source agent went away (data plane (rail 1: rxeb2 ...): channel 3: ...)").
        channels = "(%s)" % "|".join(str(c) for c in rail1)
        mine = r"data plane \(rail 1: %s %s to %s:\d+\): channel %s: " % (
            re.escape(DEVS[1]), re.escape(ADDR2), re.escape(PEER_ADDR2), channels)
        theirs = (r"^target (failed|agent aborted): (the source agent went away \()?"
                  r"data plane \(rail 1: rxe%s2 %s to %s(:\d+)?\): channel %s: ") % (
            PEER, re.escape(PEER_ADDR2), re.escape(ADDR2), channels)
        # On Soft-RoCE a silent drop does not exhaust rail 1's RDMA retries (none in 20 s in two
        # runs): the channels' acknowledgement watch (src/transport/rdma/ack_watch.h) fails the
        # channel whose writes the peer's NIC stopped acknowledging, 5 s on, before node b's
        # stalled QEMU makes node b fail on its monitor's 10 s timeout (which named no rail).
        self.assertRegex(reason, "^%s|%s" % (mine, theirs))
        self.assertNotIn("rail 0", reason)
        # Both rails had carried bytes (the final status keeps both, rail 1 with what it sent).
        self.assertEqual([r["rail"] for r in s["rails"]], [0, 1], s["rails"])
        self.assertGreater(s["rails"][1]["bytesSent"], 0)
        # Node b dropped RoCE v2 on rail 1's link only, and the cut ended the migration: not the
        # no-progress bound nor the completion deadline.
        self.assertGreater(dst["rdmaDropped"], 0)
        self.assertLess(took, RAIL_CUT_NO_PROGRESS)
        # The VM keeps running on node a (QMP query-status), and node b's QEMU does not run it.
        self.assertEqual(src.status(), "running")
        self.assertNotEqual(dst["status"], "running")

    def test_rail_cut_mid_stream_with_failover_and_rdma_required_moves_its_channels_to_rail_0(self):
        # dataPlane.failover on both agents (failoverPaths: the default [rail, address, tcp]) and transport
        # rdma required: rail 1's channels are re-dialled over rail 0 (rdma_cm to node b's rail-0
        # address), resume there, and the migration completes over RDMA only (no TCP data byte),
        # every byte of the paused guest's RAM compared.
        self.rail_failover("rail-failover", "rdma", cut="rail1", to="rail", agent_name="agent-a-fo-rail")

    def test_every_rail_cut_mid_stream_with_failover_moves_the_channels_to_tcp_byte_exact(self):
        # The same with transport auto and RDMA cut on both rails: no rail takes a channel, so
        # each channel that fails (both rails' channels) is resumed over TCP (docs/failover.md).
        self.rail_failover("rails-failover-tcp", "auto", cut="all", to="tcp", agent_name="agent-a-fo-tcp")

    def test_rail_address_cut_mid_stream_with_failover_moves_the_channels_to_the_alternate_address(self):
        # One rail (rxea on eth0) on the source, rail 0's alternate address on VLAN 100 on both agents
        # (rdma.alternateAddresses; failoverPaths the default [rail, address, tcp]) and transport rdma
        # required: node b drops the RoCE v2 reaching eth0 untagged, so every channel's link on rail
        # 0's own address dies while the device's VLAN address still works; each channel is
        # re-dialled from node a's VLAN address to node b's (their own GIDs on the same devices),
        # resumes there, and the migration completes over RDMA only, byte-exact.
        self.rail_failover("address-failover", "rdma", cut="address", to="address", agent_name="agent-a-fo-addr")

    def test_rail_cut_during_post_copy_with_failover_moves_the_channel_to_rail_1_byte_exact(self):
        # After the switch to post-copy the VM's state is split between the nodes: a lost rail must
        # not pause it. postCopy auto (switch after 1 s of pre-copy, early in the first pass), the
        # background copy held to 4 MiB/s (QEMU's max-postcopy-bandwidth) so the post-copy phase is
        # still under way when node b drops rail 0's RoCE v2 (one channel: no multifd, which QEMU
        # 7.2's post-copy does not know). The channel is re-dialled over rail 1 and resumed; the
        # migration completes in post-copy, RDMA only, every chunk checked, the paused guest's RAM
        # equal on both nodes byte for byte.
        if len(DEVS) < 2:
            self.skipTest("one rail per node (run-two-vms.sh without --rails 2)")
        name = "postcopy-rail"
        outcome = "failed"
        agent = Agent(self.tmp, "agent-a-fo-pc", config=agent_config(failover=True), log_level="debug", profile=PROFILE)
        try:
            try:
                src, dst_qmp = self.ask(name, 0, cut_rail="rail0")
                src.qmp("stop")
                src.qmp("migrate-set-parameters", max_postcopy_bandwidth=4 << 20)
                tcp_a = tcp_bytes(agent, "sent")
                target, source = start_migration(agent, self.b, src.agent_qmp_path, dst_qmp, multifd_channels=0,
                                                 chunk_size="1Mi", ring_depth=8, vm="two-node-vm-" + name,
                                                 transport="rdma", verifyChunks=True,
                                                 maxBandwidthBytesPerSecond=RAIL_CUT_BANDWIDTH,
                                                 noProgressTimeoutSeconds=RAIL_CUT_NO_PROGRESS,
                                                 postCopy="auto", postCopyAfterSeconds=1,
                                                 target_options={"transport": "rdma",
                                                                 "noProgressTimeoutSeconds": RAIL_CUT_NO_PROGRESS})
                deadline = time.monotonic() + 120
                while True:
                    st = agent.get(source["id"])
                    if (st.get("postCopy") or {}).get("switched") and st["progress"]["dataBytesSent"] >= 4 << 20:
                        break
                    self.assertNotIn(st["phase"], TERMINAL, "ended before post-copy carried bytes: %s" % st)
                    self.assertLess(time.monotonic(), deadline, "no switch to post-copy within 120 s: %s" % st)
                    time.sleep(0.1)
                self.assertEqual(st["transport"], "rdma")
                self.assertEqual([r["rail"] for r in st["rails"] if 0 in r["channels"]], [0], st["rails"])
                post("cut-%s" % name, True)
                await_("cut-applied-%s" % name, 60)
                t0 = time.monotonic()
                while agent.get(source["id"])["failover"]["failovers"] < 1:
                    self.assertLess(time.monotonic() - t0, 60, "no failover within 60 s of the cut")
                    self.assertNotIn(agent.get(source["id"])["phase"], TERMINAL)
                    time.sleep(0.1)
                first_s = time.monotonic() - t0
                src.qmp("migrate-set-parameters", max_postcopy_bandwidth=0)  # unlimited: the rest at once
                s = agent.wait(source["id"], timeout=300)
                t = self.b.wait(target["id"], timeout=60)
                if s["phase"] == "Succeeded" and t["phase"] == "Succeeded":
                    outcome = "ok"
                else:
                    print(agent.log_text()[-6000:])
            finally:
                post("migrated-%s" % name, outcome)
            try:
                dst = await_("dst-state-%s" % name, 400)
                print("rail 0 cut during post-copy: first failover %.1f s after the cut; source %s, target %s; "
                      "post-copy %s; node b dropped %d RoCE v2 packets; failover source %s, target %s"
                      % (first_s, s["phase"], t["phase"], s["postCopy"], dst["rdmaDropped"], s["failover"],
                         t["failover"]))
                self.assertEqual(s["phase"], "Succeeded", s["result"]["reason"])
                self.assertEqual(t["phase"], "Succeeded", t["result"]["reason"])
                self.assertTrue(s["postCopy"]["switched"], s["postCopy"])
                self.assertIsNone(s["postCopy"]["recovery"], "recovered instead of failing over: %s" % s["postCopy"])
                self.assertGreater(dst["rdmaDropped"], 0)
                self.assertEqual(s["failover"]["failovers"], 1, s["failover"])
                self.assertRegex(s["failover"]["last"], r"resumed on rdma rail 1: %s %s to %s:\d+" % (
                    re.escape(DEVS[1]), re.escape(ADDR2), re.escape(PEER_ADDR2)))
                self.assertEqual(tcp_bytes(agent, "sent") - tcp_a, 0, "RDMA only: no data byte over TCP")
                self.assertEqual(s["progress"]["dataBytesSent"], t["progress"]["dataBytesReceived"])
                self.assertEqual(src.status(), "postmigrate")
                self.assertEqual(dst["status"], "paused")
                self.assert_same_memory(src, dst["digest"], name)
            finally:
                if name not in self.dumped:
                    post("compared-%s" % name, True)
            self.assertEqual(await_("dst-resumed-%s" % name, 120), "running")
        finally:
            agent.stop()

    def rail_failover(self, name, transport, cut, to, agent_name):
        # agent_name: short (the agent's stateDir holds unix sockets: at most 40 characters).
        if len(DEVS) < 2 and cut != "address":
            self.skipTest("one rail per node (run-two-vms.sh without --rails 2)")
        outcome = "failed"
        rail1 = list(range(1, MULTIFD + 1, 2))
        cut_channels = rail1 if cut == "rail1" else list(range(MULTIFD + 1))
        # The address case: one rail (every channel on rail 0) with its alternate address.
        one_rail = cut == "address"
        config = agent_config(rails=1, failover=True, alternate=True) if one_rail else agent_config(failover=True)
        agent = Agent(self.tmp, agent_name, config=config, log_level="debug", profile=PROFILE)
        try:
            try:
                src, dst_qmp = self.ask(name, MULTIFD, cut_rail=cut)
                src.qmp("stop")
                tcp_a = tcp_bytes(agent, "sent")
                target, source = start_migration(agent, self.b, src.agent_qmp_path, dst_qmp,
                                                 multifd_channels=MULTIFD, chunk_size="1Mi", ring_depth=8,
                                                 vm="two-node-vm-" + name, transport=transport, verifyChunks=True,
                                                 maxBandwidthBytesPerSecond=RAIL_CUT_BANDWIDTH,
                                                 noProgressTimeoutSeconds=RAIL_CUT_NO_PROGRESS,
                                                 target_options={"transport": transport,
                                                                 "noProgressTimeoutSeconds": RAIL_CUT_NO_PROGRESS})
                deadline = time.monotonic() + 120
                while True:
                    st = agent.get(source["id"])
                    flowing = {r["rail"]: r["bytesSent"] for r in st.get("rails", [])}
                    if one_rail and flowing.get(0, 0) >= 1 << 20:
                        break
                    if flowing.get(1, 0) >= 1 << 20 and flowing.get(0, 0) > 0:
                        break
                    self.assertNotIn(st["phase"], TERMINAL, "ended before the rails carried bytes: %s" % st)
                    self.assertLess(time.monotonic(), deadline, "the cut rail carried no MiB within 120 s: %s" % st)
                    time.sleep(0.1)
                self.assertEqual(st["transport"], "rdma")
                self.assertTrue(st["failover"]["enabled"], st["failover"])
                post("cut-%s" % name, True)
                await_("cut-applied-%s" % name, 60)
                t0 = time.monotonic()
                # The first failover, then QEMU unthrottled: the rest goes at once.
                while agent.get(source["id"])["failover"]["failovers"] < 1:
                    self.assertLess(time.monotonic() - t0, 60, "no channel failed over within 60 s of the cut")
                    self.assertNotIn(agent.get(source["id"])["phase"], TERMINAL)
                    time.sleep(0.1)
                first_s = time.monotonic() - t0
                src.qmp("migrate-set-parameters", max_bandwidth=1 << 40)
                s = agent.wait(source["id"], timeout=300)
                t = self.b.wait(target["id"], timeout=60)
                if s["phase"] == "Succeeded" and t["phase"] == "Succeeded":
                    outcome = "ok"
                else:
                    print(agent.log_text()[-6000:])
            finally:
                post("migrated-%s" % name, outcome)
            try:
                dst = await_("dst-state-%s" % name, 400)
                moved = [line for line in agent.log_text().splitlines() if " failover: channel " in line]
                print("%s cut mid-stream with failover (transport %s): first failover %.1f s after the cut; "
                      "source %s, target %s; node b dropped %d RoCE v2 packets; failovers source %s, target %s\n%s"
                      % (cut, transport, first_s, s["phase"], t["phase"], dst["rdmaDropped"], s["failover"],
                         t["failover"], "\n".join(moved)))
                self.assertEqual(s["phase"], "Succeeded", s["result"]["reason"])
                self.assertEqual(t["phase"], "Succeeded", t["result"]["reason"])
                self.assertEqual(s["transport"], "rdma")
                self.assertGreater(dst["rdmaDropped"], 0)
                # Only the cut rails' channels moved, each once, named by its rail's failure.
                self.assertGreaterEqual(s["failover"]["failovers"], 1)
                self.assertLessEqual(s["failover"]["failovers"], len(cut_channels))
                ids = [int(re.search(r" failover: channel (\d+): ", l).group(1)) for l in moved]
                self.assertTrue(ids and set(ids) <= set(cut_channels) and len(ids) == len(set(ids)), moved)
                # The channel's own failure, or (when the watcher saw the link gone while no call ran
                # on the channel; seen once in a full run) the watcher's words for it.
                self.assertRegex(s["failover"]["last"],
                                 r"acknowledged nothing|work completion failed|disconnected|failed while the channel was idle")
                if to == "address":
                    # Resumed over rail 0's alternate: node a's VLAN address to node b's VLAN
                    # listener, the same devices; node b names its alternate it arrived on.
                    for line in moved:
                        self.assertRegex(line, r"resumed on rdma rail 0: %s %s to %s:\d+ \(alternate address 0\)" % (
                            re.escape(DEVS[0]), re.escape(ALT_ADDR), re.escape(PEER_ALT_ADDR)))
                    self.assertRegex(t["failover"]["last"],
                                     r"resumed on rdma rail 0: \S+ %s \(alternate address 0\) \(re-dialled by the source\)"
                                     % re.escape(PEER_ALT_ADDR))
                    self.assertEqual(tcp_bytes(agent, "sent") - tcp_a, 0)
                elif to == "rail":
                    # Resumed over rail 0: node a's rail-0 device to node b's rail-0 rdma_cm endpoint.
                    for line in moved:
                        self.assertRegex(line, r"resumed on rdma rail 0: %s %s to %s:\d+ " % (
                            re.escape(DEVS[0]), re.escape(ADDR), re.escape(PEER_ADDR)))
                    # The target names the rail the re-dial came in on, from its end (the rail whose
                    # rdma_cm listener took it: its device and address, then the source's address).
                    self.assertRegex(t["failover"]["last"], r"resumed on rdma rail 0: \S+ %s to %s \(re-dialled by the source\)"
                                     % (re.escape(PEER_ADDR), re.escape(ADDR)))
                    # RDMA only: no data byte went over TCP.
                    self.assertEqual(tcp_bytes(agent, "sent") - tcp_a, 0)
                else:
                    self.assertIn("resumed on tcp %s:" % PEER_ADDR, s["failover"]["last"])
                    self.assertGreater(tcp_bytes(agent, "sent") - tcp_a, 0)
                samples, _ = parse_prometheus(agent.metrics())
                self.assertEqual(samples.get(("rdmig_failovers_total", frozenset(
                    {("role", "source"), ("transport", "rdma"), ("peer", PEER_ADDR), ("to", to)})), 0), len(ids))
                # Byte-exact: every chunk checked (verifyChunks), the counts agree, the memories equal.
                moved_bytes = s["progress"]["dataBytesSent"]
                self.assertEqual(moved_bytes, t["progress"]["dataBytesReceived"])
                # Each rail counts what a channel carried on it: a moved channel's bytes before the
                # move on the rail it left, after it on the rail it moved to (which lists it), on no
                # rail over TCP; its errors would name the rail it runs on now.
                for st_, key in ((s, "bytesSent"), (t, "bytesReceived")):
                    on = {r["rail"]: r["channels"] for r in st_["rails"]}
                    print("%s rails: %s" % (key, [(r["rail"], r["channels"], r[key]) for r in st_["rails"]]))
                    counted = sum(r[key] for r in st_["rails"])
                    if to in ("rail", "address"):  # an alternate's channel stays counted on its rail
                        self.assertEqual(counted, moved_bytes, st_["rails"])
                        self.assertTrue(set(ids) <= set(on[0]) and not set(ids) & set(on.get(1, [])), on)
                    else:
                        self.assertLess(counted, moved_bytes, st_["rails"])
                        self.assertFalse(set(ids) & set(sum(on.values(), [])), on)
                self.assertEqual(src.status(), "postmigrate")
                self.assertEqual(dst["status"], "paused")
                self.assert_same_memory(src, dst["digest"], name)
            finally:
                if name not in self.dumped:
                    post("compared-%s" % name, True)
            self.assertEqual(await_("dst-resumed-%s" % name, 120), "running")
        finally:
            agent.stop()

    def test_rail_down_at_start_is_left_out_and_the_other_rail_carries_the_migration(self):
        if len(DEVS) < 2:
            self.skipTest("one rail per node (run-two-vms.sh without --rails 2)")
        netdev2 = os.environ["RDMIG_RDMA_NETDEV2"]
        agent = None
        try:
            # Node a's second link goes down: rxe takes its port down with it.
            ip_link("set", netdev2, "down")
            wait_port_state(DEVS[1], "DOWN")
            # An agent started now with both devices leaves rail 1 out; it keeps it out when the
            # link is back (rails are set up at start), and says so.
            agent = Agent(self.tmp, "agent-a-rail-down", config=agent_config(), log_level="debug", profile=PROFILE)
        finally:
            ip_link("set", netdev2, "up")
            wait_port_state(DEVS[1], "ACTIVE")
            wait_gid(DEVS[1], ADDR2)
            wait_ping(PEER_ADDR2)  # the neighbour entry again, for the cases after this one
        try:
            log = agent.log_text()
            left_out = [line for line in log.splitlines() if "rail 1 (rdma.devices[1]) left out" in line]
            print("rail 1 down at start: %s" % (left_out[0].strip() if left_out else "(no log line)"))
            self.assertTrue(left_out, log[-3000:])
            self.assertIn("left out: no-device: ", left_out[0])
            self.assertIn("RDMA device %s port 1 is not active" % DEVS[1], left_out[0])
            samples, _ = parse_prometheus(agent.metrics())
            up = {dict(labels)["rail"]: (dict(labels), value) for (metric, labels), value in samples.items()
                  if metric == "rdmig_rdma_rail_up"}
            print("rdmig_rdma_rail_up: %s" % up)
            self.assertEqual(up["0"][1], 1)
            self.assertEqual((up["0"][0]["reason"], up["0"][0]["device"]), ("ok", DEVS[0]))
            self.assertEqual(up["1"][1], 0)
            self.assertEqual(up["1"][0]["reason"], "no-device")
            # To node b's agent with both rails: rail 0 only, all 9 channels on it, byte-exact; the
            # source's status says which rail it left out and why, the target's (both up) none.
            s, t = self.migrate(MULTIFD, rails=1, name="rail-down", source=agent)
            print("railsLeftOut: source %s, target %s" % (s["railsLeftOut"], t["railsLeftOut"]))
            self.assertEqual([(r["rail"], r["reason"]) for r in s["railsLeftOut"]], [(1, "no-device")])
            self.assertIn("RDMA device %s port 1 is not active" % DEVS[1], s["railsLeftOut"][0]["message"])
            self.assertEqual(t["railsLeftOut"], [])
        finally:
            if agent:
                agent.stop()

    def source_metrics(self, agent=None):
        samples, _ = parse_prometheus((agent or self.a).metrics())

        def get(name, **labels):
            return samples.get((name, frozenset(labels.items())), 0)
        return {"write_latency_count": get("rdmig_chunk_write_latency_seconds_count", transport="rdma"),
                "selected_requested": get("rdmig_transport_selected_total", transport="rdma", reason="requested"),
                "selected_auto_rdma": get("rdmig_transport_selected_total", transport="rdma", reason="auto-both-rdma"),
                "selected_fallback": get("rdmig_transport_selected_total", transport="tcp", reason="auto-no-peer-rdma")}

    def test_migrates_between_two_nodes_without_multifd(self):
        self.migrate(0)

    def test_migrates_between_two_nodes_with_8_multifd_channels(self):
        # Striped across both rails when the nodes have two.
        self.migrate(MULTIFD, rails=len(DEVS))

    def test_migrates_to_a_node_with_fewer_rails_over_the_rails_both_have(self):
        if self.b1 is None:
            self.skipTest("one rail per node (run-two-vms.sh without --rails 2)")
        self.migrate(MULTIFD, target=self.b1, rails=1, name="rails-2-to-1")


if __name__ == "__main__":
    add_vlan_alternate()
    if NODE == "b":
        sys.exit(serve_target())
    result = timed.main(verbosity=2, exit=False).result
    if not result.wasSuccessful():
        post("failed-a", "tests failed")
        sys.exit(1)
