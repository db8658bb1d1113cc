"""A network namespace of a test's own that holds only loopback: an agent runs in it, the test
makes its sockets in it, and an nftables counter says whether anything tried to connect.

What it shows: that the agent did not dial an address. Every address the namespace holds on
``lo`` (127.0.0.0/8, ::1 and the ``addresses`` given: e.g. 169.254.169.254) reaches the test's
own listener there; every other destination is routed to ``lo`` too (default routes), so its SYN
is at least emitted and counted by ``syn_count(port)`` before the kernel drops it. Nothing leaves
the namespace. Needs root (``ip netns``, nft).

    ns = LoopbackNetns(addresses=["169.254.169.254", "192.0.2.1"])
    agent = NetnsAgent(ns, workdir, "a", config=...)      # rdmiglab.Agent inside the namespace
    lst = ns.run(ns.listen)                               # a dual-stack listener in it
    ns.count_syns(port); ...; ns.syn_count(port)
"""
import ctypes
import os
import queue
import socket
import subprocess
import threading

from .agent import Agent

CLONE_NEWNET = 0x40000000
IP = os.environ.get("RDMIG_IP", "ip")


def _sh(*argv, check=True):
    res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False)
    if check and res.returncode != 0:
        raise RuntimeError("%s: rc %d: %s" % (" ".join(argv), res.returncode, res.stderr.strip()))
    return res.stdout


class LoopbackNetns:
    def __init__(self, addresses=()):
        self.name = "rdmig-lo-%s" % os.urandom(3).hex()
        self.path = "/run/netns/" + self.name
        self._q = queue.Queue()
        self._thread = None
        _sh(IP, "netns", "add", self.name)
        try:
            self.exec_("ip", "link", "set", "lo", "up")
            for a in addresses:
                self.exec_("ip", "addr", "add", a + ("/128" if ":" in a else "/32"), "dev", "lo")
            self.exec_("ip", "route", "add", "default", "dev", "lo")
            self.exec_("ip", "-6", "route", "add", "default", "dev", "lo", check=False)
            self.exec_("nft", "add", "table", "inet", "rdmiglab")
            self.exec_("nft", "add", "chain", "inet", "rdmiglab", "out",
                       "{ type filter hook output priority 0; policy accept; }")
            self._start_thread()
        except BaseException:
            self.close()
            raise

    def exec_(self, *argv, check=True):
        """Runs a command inside the namespace (``ip netns exec``)."""
        if argv[0] == "ip":
            argv = (IP,) + argv[1:]
        return _sh(IP, "netns", "exec", self.name, *argv, check=check)

    # -- a thread inside the namespace: sockets made on it belong to the namespace ----------
    def _start_thread(self):
        ready = queue.Queue()

        def loop():
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(self.path, os.O_RDONLY)
            rc = libc.setns(fd, CLONE_NEWNET)  # this thread only
            os.close(fd)
            ready.put(None if rc == 0 else OSError(ctypes.get_errno(), "setns " + self.path))
            if rc != 0:
                return
            while True:
                item = self._q.get()
                if item is None:
                    return
                fn, args, kw, out = item
                try:
                    out.put((True, fn(*args, **kw)))
                except BaseException as e:  # handed to the caller
                    out.put((False, e))

        self._thread = threading.Thread(target=loop, daemon=True, name="netns-" + self.name)
        self._thread.start()
        err = ready.get(timeout=10)
        if err:
            raise err

    def run(self, fn, *args, **kw):
        """fn(*args, **kw) on the namespace's thread; its result, or its exception raised here."""
        out = queue.Queue()
        self._q.put((fn, args, kw, out))
        ok, value = out.get()
        if not ok:
            raise value
        return value

    @staticmethod
    def listen():
        """A dual-stack TCP listener on [::]:<free port> (IPv4 too); call through run()."""
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        s.listen(64)
        return s

    # -- what tried to connect ---------------------------------------------------------------
    def count_syns(self, port):
        """From now on counts TCP SYNs (connection attempts, retries included) sent to `port`
        from inside the namespace, to any address."""
        self.exec_("nft", "add", "rule", "inet", "rdmiglab", "out", "tcp", "dport", str(port),
                   "tcp", "flags", "&", "(syn|ack)", "==", "syn", "counter")

    def syn_count(self, port):
        text = self.exec_("nft", "list", "chain", "inet", "rdmiglab", "out")
        for line in text.splitlines():
            if "dport %d " % port in line and "counter packets" in line:
                return int(line.split("counter packets")[1].split()[0])
        raise RuntimeError("no SYN counter for port %d: %s" % (port, text))

    def wrapper(self, binary, workdir):
        """A script that runs `binary` inside the namespace (for Agent(binary=...))."""
        path = os.path.join(workdir, "in-%s.sh" % self.name)
        with open(path, "w") as f:
            f.write('#!/bin/sh\nexec %s netns exec %s %s "$@"\n' % (IP, self.name, binary))
        os.chmod(path, 0o755)
        return path

    def close(self):
        if self._thread:
            self._q.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        _sh(IP, "netns", "del", self.name, check=False)


class NetnsAgent(Agent):
    """An rdmiglab.Agent running inside `netns` (a LoopbackNetns); its REST calls are made from
    inside the namespace too."""

    def __init__(self, netns, workdir, name="agent", binary=None, **kw):
        from .agent import agent_binary
        self.netns = netns
        os.makedirs(workdir, exist_ok=True)
        super().__init__(workdir, name, binary=netns.wrapper(binary or agent_binary(), workdir), **kw)

    def request(self, *args, **kw):
        return self.netns.run(super().request, *args, **kw)
