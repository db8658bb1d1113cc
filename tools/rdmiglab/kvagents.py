"""rdmig agents in KubeVirt mode, one per node of the KubeVirt-shaped harness (kubevirt.py).

Each agent serves the node hook on its own unix socket (``hook_socket(node)``, what the
source proxy is given as ``migrate(hook_socket=...)``) and knows the other node's agent as
its peer on a fixed data-plane port on 127.0.0.1. Used by tests/kubevirt, bench/kubevirt.py
and tools/demo_kubevirt.py:

    with KubevirtAgents(workdir, ("node-a", "node-b")) as agents:
        r = cluster.migrate(hook_socket=agents.hook_socket(cluster.vmi.node))
        rec = agents.record(r.source_node, r.migration_uid)   # carried, phase, bytes...
"""
import os
import shutil
import socket
import tempfile
import time

from .agent import Agent

FINAL_PHASES = ("Succeeded", "Failed", "NotCarried")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KubevirtAgents:
    """Starts one rdmig-agent per node in KubeVirt mode. ``transport``: the agents'
    ``transport`` setting ("tcp", or "auto" to let them look for an RDMA device).
    ``kubevirt``: extra keys for the agents' ``kubevirt`` section; ``migration``: their ``migration``
    section (default: none, the agents' defaults). ``token``: the agents' API and data-plane token
    (default: a random one); ``tls``: their API's certificate (rdmiglab.Agent's ``tls``; default
    plain HTTP). ``profile``: each agent's (rdmiglab.Agent's ``profile``: "chart" runs them with
    only the chart's capabilities for KubeVirt mode). Stops them on close."""

    def __init__(self, workdir, nodes, transport="tcp", log_level="info", rule_timeout_s=3,
                 session_idle_s=1, probe_interval_s=1, kubevirt=None, migration=None, start=True, token=None,
                 tls=None, profile=None, data_plane=None):
        self.workdir = workdir
        self.nodes = tuple(nodes)
        self.token = token or "tok-" + os.urandom(16).hex()
        self.tls, self.profile = tls, profile
        self.ports = {n: free_port() for n in self.nodes}
        # Hook sockets under /tmp: unix socket paths must stay short.
        self.hook_dir = tempfile.mkdtemp(prefix="rdmig-kvhook-", dir="/tmp")
        # One stateDir per node across restarts, as the DaemonSet's hostPath: a restarted agent
        # finds what its predecessor armed (the start-up sweep).
        self.state_dirs = {n: os.path.join(self.hook_dir, n, "state") for n in self.nodes}
        self.transport, self.log_level = transport, log_level
        self.kubevirt = dict({"ruleTimeoutSeconds": rule_timeout_s, "sessionIdleSeconds": session_idle_s,
                              "probeIntervalSeconds": probe_interval_s}, **(kubevirt or {}))
        self.migration = dict(migration or {})
        # Extra dataPlane keys of every agent (e.g. failover); may be changed before a start().
        self.data_plane = dict(data_plane or {})
        self.agents = {}
        if start:
            try:
                for n in self.nodes:
                    self.start(n)
            except BaseException:
                self.close()
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, node, profile=None):
        """(Re)starts the agent of ``node``; returns it (an rdmiglab.Agent with .hook_socket).
        ``profile``: this agent's, instead of the one given at construction."""
        hook = os.path.join(self.hook_dir, node, "hook.sock")
        os.makedirs(os.path.dirname(hook), exist_ok=True)
        peers = [{"node": n, "agent": "127.0.0.1:%d" % self.ports[n]} for n in self.nodes if n != node]
        os.makedirs(self.state_dirs[node], exist_ok=True)
        a = Agent(self.workdir, name=node, token=self.token, log_level=self.log_level, tls=self.tls,
                  profile=profile if profile is not None else self.profile, config={
            "transport": self.transport, "stateDir": self.state_dirs[node],
            **({"migration": self.migration} if self.migration else {}),
            "dataPlane": dict(self.data_plane, address="127.0.0.1", port=self.ports[node]),
            "kubevirt": dict(self.kubevirt, enabled=True, nodeName=node, hookSocket=hook, peers=peers)})
        a.hook_socket = hook
        self.agents[node] = a
        return a

    def __getitem__(self, node):
        return self.agents[node]

    def hook_socket(self, node):
        return self.agents[node].hook_socket

    def records(self, node, migration_uid):
        return self.agents[node].call("GET", "/v1/kubevirt/migrations?migrationUid=" + migration_uid)["items"]

    def record(self, node, migration_uid, phases=FINAL_PHASES, timeout=30.0, interval=0.05):
        """The agent's record of that migration once it reached one of ``phases``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [i for i in self.records(node, migration_uid) if i["phase"] in phases]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise TimeoutError("timed out after %ss waiting for %s's record of %s in %s"
                                   % (timeout, node, migration_uid, phases))
            time.sleep(interval)

    def close(self):
        for a in self.agents.values():
            a.stop()
            shutil.rmtree(a.state_dir, ignore_errors=True)
        shutil.rmtree(self.hook_dir, ignore_errors=True)
