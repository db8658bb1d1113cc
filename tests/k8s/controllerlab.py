"""Starts rdmig-controller processes against the API server double, for tests."""
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools"))
from rdmiglab import parse_prometheus  # noqa: E402


def controller_binary():
    path = os.environ.get("RDMIG_CONTROLLER") or os.path.join(REPO, "build-k8s", "controller", "rdmig-controller")
    if not os.access(path, os.X_OK):
        raise RuntimeError("rdmig-controller not found at %s (build it, or set RDMIG_CONTROLLER)" % path)
    return path


def wait_for(predicate, timeout, what, interval=0.05):
    """Polls predicate() until it returns a truthy value; raises TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("timed out after %ss waiting for %s" % (timeout, what))
        time.sleep(interval)


class Controller:
    """One rdmig-controller process; config merged over test defaults (short lease, fast polls).
    The tests read /metrics in plain HTTP on 127.0.0.1 (metrics.secure false) unless a config
    turns it back on; tests/k8s/test_controller_faults.py (MetricsAuthTest) checks the secure
    default, which answers https_get() with a bearer token."""

    def __init__(self, workdir, name, kubeconfig, agent_token_file, config=None, start=True):
        self.workdir, self.name = workdir, name
        self.config_file = os.path.join(workdir, name + ".yaml")
        self.ports_file = os.path.join(workdir, name + ".ports.json")
        self.log_file = os.path.join(workdir, name + ".log")
        cfg = {"namespace": "rdmig-system",
               "agents": {"tokenFile": agent_token_file, "unreachableTimeoutSeconds": 3,
                          "requestTimeoutSeconds": 5},
               "pollIntervalMs": 250,
               "leaderElection": {"identity": name, "leaseDurationSeconds": 3, "renewDeadlineSeconds": 2,
                                  "retryPeriodSeconds": 0.5},
               "metrics": {"secure": False, "address": "127.0.0.1", "port": 0},
               "probes": {"address": "127.0.0.1", "port": 0},
               "logLevel": "debug"}
        for k, v in (config or {}).items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
        with open(self.config_file, "w") as f:
            json.dump(cfg, f)
        self.secure = cfg["metrics"].get("secure", True)
        self.metrics_token = None  # metrics() sends it when the port is HTTPS (metrics.secure)
        self.kubeconfig = kubeconfig
        self.proc = None
        self.port = None
        self.probe_port = None
        if start:
            self.start()

    def start(self, timeout=20.0):
        if os.path.exists(self.ports_file):
            os.unlink(self.ports_file)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen([controller_binary(), "--config", self.config_file,
                                          "--kubeconfig", self.kubeconfig, "--ports-file", self.ports_file],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s: %s" % (self.name, self.proc.returncode, self.log_text()))
            return os.path.exists(self.ports_file)
        wait_for(ready, timeout, self.name + " to listen")
        with open(self.ports_file) as f:
            ports = json.load(f)
        self.port, self.probe_port = ports["metrics"], ports["probes"]
        return self

    def log_text(self):
        try:
            with open(self.log_file, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def http_get(self, path):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.port, path), timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def probe_get(self, path):
        """/healthz or /readyz on the probe port (plain HTTP, no token)."""
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.probe_port, path), timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def https_get(self, path, token=None, cafile=None, server_name="localhost"):
        """(status, headers, body) of GET over HTTPS (metrics.secure); the certificate is checked
        against `cafile` for `server_name`, or not at all (a self-signed one, as Prometheus'
        insecureSkipVerify)."""
        ctx = ssl.create_default_context(cafile=cafile) if cafile else ssl._create_unverified_context()
        req = urllib.request.Request("https://%s:%d%s" % (server_name, self.port, path))
        if token is not None:
            req.add_header("Authorization", "Bearer " + token)
        try:
            with urllib.request.urlopen(req, timeout=15, context=ctx) as r:
                return r.status, dict(r.headers), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read().decode()

    def metrics_text(self):
        if not self.secure:
            return self.http_get("/metrics")[1]
        code, _, body = self.https_get("/metrics", token=self.metrics_token)
        if code != 200:
            raise RuntimeError("%s: /metrics answered %d: %s" % (self.name, code, body))
        return body

    def metrics(self):
        samples, _ = parse_prometheus(self.metrics_text())
        return samples

    def metric(self, name, **labels):
        return self.metrics().get((name, frozenset(labels.items())))

    def stop(self, sig=signal.SIGTERM, timeout=20.0):
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        return self.proc.returncode


class AgentsAndControllerTest(unittest.TestCase):
    """A test class's lab, shared by the kinds' tests (test_pathcheck.py, test_drainplan.py): the
    API server double (the CRDs' schemas and CEL rules enforced), three real rdmig-agents
    registered as the agent pods of node-a, node-b and node-c, one rdmig-controller; helpers on
    the objects of PLURAL in NS. `lab_setup()` adds to the lab before the controller starts,
    `lab_teardown()` stops what it added."""
    PLURAL, NS, AGENT_NS, TMP_PREFIX = None, "ops", "rdmig-system", "rdmig-k8s-"

    @classmethod
    def setUpClass(cls):
        from rdmiglab import Agent
        from apiserver_double import ApiServerDouble
        cls.tmp = tempfile.mkdtemp(prefix=cls.TMP_PREFIX)
        cls.api = ApiServerDouble(os.path.join(cls.tmp, "apiserver"), tls=True,
                                  crd_path=os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml"))
        cls.store = cls.api.store
        cls.kubeconfig = cls.api.write_kubeconfig(os.path.join(cls.tmp, "kubeconfig"))
        token = cls.token = "agent-token-" + os.urandom(12).hex()
        cls.agents = {n: Agent(cls.tmp, "agent-" + n, token=token, log_level="debug") for n in ("a", "b", "c")}
        for n, agent in cls.agents.items():
            cls.api.add_agent_pod(cls.AGENT_NS, "rdmig-agent-" + n, "node-" + n, agent.api_port)
        cls.lab_setup()
        cls.controller = Controller(cls.tmp, "ctl", cls.kubeconfig, cls.agents["a"].token_file)
        wait_for(lambda: cls.controller.metric("rdmig_controller_leader") == 1, 30, "the controller to lead")

    @classmethod
    def lab_setup(cls):
        pass

    @classmethod
    def lab_teardown(cls):
        pass

    @classmethod
    def tearDownClass(cls):
        cls.controller.stop()
        cls.lab_teardown()
        for a in cls.agents.values():
            a.stop()
        cls.api.stop()
        if os.environ.get("RDMIG_KEEP_TMP"):
            print("kept", cls.tmp)
        else:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def tearDown(self):
        result = getattr(self._outcome, "result", None)
        if result and any(t is self for t, _ in result.errors + result.failures):
            print("---- controller log (tail) ----\n" + self.controller.log_text()[-6000:])

    def create(self, body):
        code, obj = self.store.create(self.PLURAL, self.NS, body)
        self.assertEqual(code, 201, obj)
        return obj

    def get(self, name, plural=None):
        code, obj = self.store.get(plural or self.PLURAL, self.NS, name)
        return obj if code == 200 else None

    def wait_phase(self, name, phases, timeout=60.0):
        def reached():
            obj = self.get(name)
            return obj if obj and obj.get("status", {}).get("phase") in phases else None
        try:
            return wait_for(reached, timeout, "%s to reach %s" % (name, phases))
        except TimeoutError:
            raise AssertionError("%s did not reach %s; now: %s" % (name, phases, self.get(name)))

    def reasons(self, name):
        return [(e["type"], e["reason"]) for e in self.api.events(name)]
