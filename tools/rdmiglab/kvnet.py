"""Network namespaces standing in for two virt-handler pods (pod network, not host network).

    host netns ── kvh<sfx><i> ═ veth ═ host0 ── [netns kv-<sfx>-<node>] eth0 ═ veth ═ eth0 [other node]
Each namespace holds a "pod IP" on the pod link (10.213.<r>.<i+1>/24, fd52:4d49:4b56:<r>::<i+1>/64);
the two namespaces reach each other over that veth pair. The host reaches each pod IP
through an unnumbered veth (a /32 or /128 route per pod IP; the namespace's default route
points back through host0), so agents in the host netns can connect to pod IPs and setns
into the namespaces. Names carry a per-run random suffix; ``close`` removes everything.
"""
import fcntl
import os
import random
import subprocess

# iproute2's ip; the Soft-RoCE VM has it as iproute2-ip (busybox's applet shadows "ip").
IP = os.environ.get("RDMIG_IP", "ip")
V6_PREFIX = "fd52:4d49:4b56"  # ULA; kept clear of anything the host uses (checked below)


def sh(*argv, check=True, ns=None, input=None):
    if argv and argv[0] == "ip":
        argv = (IP,) + argv[1:]
    if ns:
        argv = (IP, "netns", "exec", ns) + argv
    res = subprocess.run(argv, input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, check=False)
    if check and res.returncode != 0:
        raise RuntimeError("%s: rc %d: %s" % (" ".join(argv), res.returncode, res.stderr.strip()))
    return res.stdout


class HandlerNetwork:
    """``nodes``: node names (two). After ``setup``: ``netns[node]``, ``ip4[node]``, ``ip6[node]``,
    ``netns_path(node)`` (/run/netns/<name>), ``host_if[node]``."""

    def __init__(self, nodes, suffix=None):
        self.nodes = list(nodes)
        self.suffix = suffix or os.urandom(3).hex()
        self.netns = {n: "kv-%s-%s" % (self.suffix, n) for n in self.nodes}
        self.host_if = {n: "kvh%s%d" % (self.suffix, i) for i, n in enumerate(self.nodes)}
        self.ip4, self.ip6 = {}, {}
        self.subnet = None
        self._created_ns = []
        self._created_links = []
        self._routes = []

    def netns_path(self, node):
        return "/run/netns/" + self.netns[node]

    def _pick_subnet(self):
        used = sh("ip", "-4", "route", "show", "table", "all") + sh("ip", "-4", "addr")
        used6 = sh("ip", "-6", "route", "show", "table", "all")
        free = [r for r in range(1, 255)
                if "10.213.%d." % r not in used and "%s:%x:" % (V6_PREFIX, r) not in used6]
        if not free:
            raise RuntimeError("no free 10.213.x.0/24 test subnet")
        return random.choice(free)

    def setup(self):
        # Tests run side by side (ctest -j): the subnet is picked from what the host's routes
        # leave free and then taken by adding routes, so two set-ups must not interleave.
        os.makedirs("/run/lock", exist_ok=True)
        with open("/run/lock/rdmig-kvnet.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._setup()
            except Exception:
                self.close()
                raise
        return self

    def _setup(self):
        self.subnet = r = self._pick_subnet()
        for n in self.nodes:
            sh("ip", "netns", "add", self.netns[n])
            self._created_ns.append(n)
            sh("ip", "link", "set", "lo", "up", ns=self.netns[n])
        a, b = self.nodes
        pa, pb = "kvp%sa" % self.suffix, "kvp%sb" % self.suffix
        sh("ip", "link", "add", pa, "netns", self.netns[a], "type", "veth",
           "peer", "name", pb, "netns", self.netns[b])
        for n, ifname in ((a, pa), (b, pb)):
            sh("ip", "link", "set", ifname, "name", "eth0", ns=self.netns[n])
        for i, n in enumerate(self.nodes):
            ns = self.netns[n]
            self.ip4[n] = "10.213.%d.%d" % (r, i + 1)
            self.ip6[n] = "%s:%x::%d" % (V6_PREFIX, r, i + 1)
            sh("ip", "addr", "add", self.ip4[n] + "/24", "dev", "eth0", ns=ns)
            sh("ip", "-6", "addr", "add", self.ip6[n] + "/64", "dev", "eth0", "nodad", ns=ns)
            sh("ip", "link", "set", "eth0", "up", ns=ns)
            # Host side: an unnumbered veth; the host keeps its own addresses.
            hif = self.host_if[n]
            sh("ip", "link", "add", hif, "type", "veth", "peer", "name", "host0", "netns", ns)
            self._created_links.append(hif)
            sh("ip", "link", "set", hif, "up")
            sh("ip", "link", "set", "host0", "up", ns=ns)
            # Link-local next hops, fixed and without DAD so routes work at once.
            sh("ip", "-6", "addr", "add", "fe80::1/64", "dev", hif, "nodad")
            sh("ip", "-6", "addr", "add", "fe80::2/64", "dev", "host0", "nodad", ns=ns)
            sh("ip", "route", "add", self.ip4[n] + "/32", "dev", hif)
            self._routes.append(("-4", self.ip4[n] + "/32", hif))
            sh("ip", "-6", "route", "add", self.ip6[n] + "/128", "via", "fe80::2", "dev", hif)
            self._routes.append(("-6", self.ip6[n] + "/128", hif))
            sh("ip", "route", "add", "default", "dev", "host0", ns=ns)
            sh("ip", "-6", "route", "add", "default", "via", "fe80::1", "dev", "host0", ns=ns)

    def run_in(self, node, *argv, check=True):
        return sh(*argv, check=check, ns=self.netns[node])

    def close(self):
        for fam, dst, dev in self._routes:
            sh("ip", fam, "route", "del", dst, "dev", dev, check=False)
        self._routes = []
        for link in self._created_links:
            sh("ip", "link", "del", link, check=False)  # deletes the peer in the netns too
        self._created_links = []
        for n in self._created_ns:
            sh("ip", "netns", "del", self.netns[n], check=False)
        self._created_ns = []
