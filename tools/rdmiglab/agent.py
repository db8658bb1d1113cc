"""Starts rdmig-agent processes and drives migrations through their REST API."""
import atexit
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from . import profile as profile_mod

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TERMINAL = ("Succeeded", "Failed", "Cancelled")


def agent_binary():
    """The built rdmig-agent: $RDMIG_AGENT, else <repo>/build/agent/rdmig-agent."""
    path = os.environ.get("RDMIG_AGENT") or os.path.join(REPO, "build", "agent", "rdmig-agent")
    if not os.access(path, os.X_OK):
        raise RuntimeError("rdmig-agent not found at %s (build first, or set RDMIG_AGENT)" % path)
    return path



# Every agent's stateDir made by this process, removed when it exits (RDMIG_KEEP_TMP keeps them).
_STATE_DIRS = []


@atexit.register
def _remove_state_dirs():
    if not os.environ.get("RDMIG_KEEP_TMP"):
        for d in _STATE_DIRS:
            shutil.rmtree(d, ignore_errors=True)

class ApiError(Exception):
    def __init__(self, status, body):
        super().__init__("HTTP %s: %s" % (status, body))
        self.status = status
        self.body = body


class _NamedTlsContext(ssl.SSLContext):
    """A client context that checks the server's certificate for ``server_name`` whatever address
    was dialled (the agents' certificates name "rdmig-agent", not 127.0.0.1), as the controller does."""
    server_name = None

    def wrap_socket(self, sock, *args, server_hostname=None, **kw):
        return super().wrap_socket(sock, *args, server_hostname=self.server_name, **kw)


def agent_tls_context(ca_file, server_name="rdmig-agent"):
    """An SSL client context that trusts only ``ca_file`` and wants ``server_name``."""
    ctx = _NamedTlsContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca_file)
    ctx.server_name = server_name
    return ctx


class Agent:
    """One rdmig-agent on 127.0.0.1 with ports chosen by the kernel (port 0), configured as a lab
    (dataPlane.allowLoopbackPeers: true, so that agents on this host may be each other's target).

    ``config`` is merged over a minimal config (JSON is valid YAML, so it is written as JSON).
    ``tls``: serve the API over HTTPS, a dict with "cert" and "key" (api.tls), "ca" (what this
    harness's requests trust; e.g. make_agent_pki's paths) and optionally "server_name" (the name
    they check, default "rdmig-agent"); the harness then speaks https.
    ``profile``: run the agent unprivileged as the chart does (rdmiglab.profile): "chart" = the
    chart's capabilities for the modes this config enables (KubeVirt mode, RDMA unless transport
    is tcp) and nothing else, seccomp RuntimeDefault, a read-only root but for the state dir, the
    hook socket's directory and ``workdir`` (the ports file), no_new_privs where the chart sets it;
    a profile.Profile for another (a test that takes a capability away); None =
    $RDMIG_AGENT_PROFILE ("chart", or unset for the harness's full root). Checked once started.
    """

    def __init__(self, workdir, name="agent", token=None, config=None, log_level="info",
                 binary=None, start=True, start_timeout=20.0, env=None, tls=None, profile=None):
        """``env``: extra environment for the agent process (e.g. a faked clock)."""
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.name = name
        self.env = dict(os.environ, **(env or {}))
        self.token = token or ("tok-" + os.urandom(16).hex())
        self.binary = binary or agent_binary()
        self.token_file = os.path.join(self.workdir, name + ".token")
        self.config_file = os.path.join(self.workdir, name + ".yaml")
        self.ports_file = os.path.join(self.workdir, name + ".ports.json")
        self.log_file = os.path.join(self.workdir, name + ".log")
        # Unix socket paths must stay short: keep the state dir under /tmp. It outlives stop() (a
        # restarted agent finds its records there) and goes when this test process ends.
        self.state_dir = "/tmp/rdmig-%s-%s" % (name, os.urandom(3).hex())
        _STATE_DIRS.append(self.state_dir)
        cfg = {
            "api": {"address": "127.0.0.1", "port": 0, "probePort": 0, "tokenFile": self.token_file},
            # Agents on one host reach each other on 127.0.0.1: a lab (dataPlane.allowLoopbackPeers,
            # docs/security.md); a test of the dial policy's loopback rule sets it false.
            "dataPlane": {"address": "127.0.0.1", "port": 0, "allowLoopbackPeers": True},
            "transport": "tcp",
            "stateDir": self.state_dir,
            "logLevel": log_level,
            # The harness's QEMUs put their QMP sockets in temporary directories.
            "migration": {"qmpSocketRoots": [os.path.realpath(tempfile.gettempdir())]},
        }
        self.tls = tls
        self.ssl_context = None
        if tls:
            cfg["api"]["tls"] = {"certFile": tls["cert"], "keyFile": tls["key"]}
            self.ssl_context = agent_tls_context(tls["ca"], tls.get("server_name", "rdmig-agent"))
        for key, value in (config or {}).items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key].update(value)
            else:
                cfg[key] = value
        self.config = cfg
        self.profile = profile_mod.resolve(profile, cfg)
        with open(self.token_file, "w") as f:
            f.write(self.token + "\n")
        with open(self.config_file, "w") as f:
            json.dump(cfg, f, indent=2)
        self.proc = None
        self.api_port = None
        self.data_port = None
        self.probe_port = None
        if start:
            self.start(start_timeout)

    def start(self, timeout=20.0):
        if os.path.exists(self.ports_file):
            os.unlink(self.ports_file)
        log = open(self.log_file, "ab")
        argv = [self.binary, "--config", self.config_file, "--ports-file", self.ports_file]
        if self.profile is not None:
            # The pod's writable volumes: stateDir, the hook socket's directory; and the lab's ports file.
            hook = (self.config.get("kubevirt") or {}).get("hookSocket")
            state = self.config["stateDir"]
            os.makedirs(state, exist_ok=True)  # the kubelet makes a hostPath DirectoryOrCreate
            writable = [state, self.workdir] + ([os.path.dirname(hook)] if hook else [])
            argv = self.profile.wrap(argv, writable=writable)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s: %s" % (self.name, self.proc.returncode, self.log_text()))
            if os.path.exists(self.ports_file):
                with open(self.ports_file) as f:
                    ports = json.load(f)
                self.api_port, self.data_port = ports["api"], ports["dataPlane"]
                self.probe_port = ports.get("probe")
                if self.profile is not None:
                    self.profile.check(self.proc.pid)
                return self
            time.sleep(0.05)
        raise RuntimeError("%s did not report its ports within %ss: %s" % (self.name, timeout, self.log_text()))

    @property
    def url(self):
        return "%s://127.0.0.1:%d" % ("https" if self.tls else "http", self.api_port)

    def log_text(self):
        try:
            with open(self.log_file, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def rss_kib(self):
        """The agent process's resident memory (VmRSS), in KiB."""
        with open("/proc/%d/status" % self.proc.pid) as f:
            return int([line for line in f if line.startswith("VmRSS:")][0].split()[1])

    def fd_count(self):
        """How many file descriptors the agent process has open."""
        return len(os.listdir("/proc/%d/fd" % self.proc.pid))

    def stop(self, timeout=30.0, drain=2.0):
        """SIGTERM (the agent drains: what runs may end by itself), after ``drain`` seconds a
        second SIGTERM (it cancels what still runs, the VM staying on the source), then SIGKILL
        after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=drain)
            return self.proc.returncode
        except subprocess.TimeoutExpired:
            pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        return self.proc.returncode

    def kill(self):
        """SIGKILL: the agent dies at once, nothing drained or cancelled (a crash, the OOM killer)."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def restart(self, timeout=20.0):
        """Starts the agent again with its config, token and stateDir, on the data-plane port it had:
        a node's agent comes back on its configured port, which the peer agent dials again."""
        self.config["dataPlane"]["port"] = self.data_port
        with open(self.config_file, "w") as f:
            json.dump(self.config, f, indent=2)
        return self.start(timeout)

    # -- HTTP ---------------------------------------------------------------------------
    def request(self, method, path, body=None, token=True, raw=None, timeout=30.0):
        """Returns (status, parsed JSON or text). ``token``: True = ours, str = that, None = none."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if token is True:
            req.add_header("Authorization", "Bearer " + self.token)
        elif isinstance(token, str):
            req.add_header("Authorization", "Bearer " + token)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context) as resp:
                status, payload, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, payload, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        text = payload.decode(errors="replace")
        if "json" in ctype:
            return status, json.loads(text)
        return status, text

    def call(self, method, path, body=None, expect=(200, 201, 202)):
        status, payload = self.request(method, path, body)
        if status not in expect:
            raise ApiError(status, payload)
        return payload

    def create(self, body):
        return self.call("POST", "/v1/migrations", body)

    def get(self, mid):
        return self.call("GET", "/v1/migrations/" + mid)

    def cancel(self, mid):
        return self.call("DELETE", "/v1/migrations/" + mid)

    def metrics(self):
        status, text = self.request("GET", "/metrics", token=None)
        if status != 200:
            raise ApiError(status, text)
        return text

    def wait(self, mid, phases=TERMINAL, timeout=300.0, on_status=None, interval=0.25):
        deadline = time.monotonic() + timeout
        while True:
            st = self.get(mid)
            if on_status:
                on_status(st)
            if st["phase"] in phases:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError("%s: migration %s still %s after %ss" % (self.name, mid, st["phase"], timeout))
            if not self.alive():
                raise RuntimeError("%s died: %s" % (self.name, self.log_text()[-3000:]))
            time.sleep(interval)


def start_migration(src_agent, dst_agent, src_qmp, dst_qmp, multifd_channels=0, chunk_size=None,
                    ring_depth=None, vm="demo-vm", token=None, target_options=None, **source_options):
    """POSTs the target then the source, as the controller does. Returns (target, source) replies.
    ``target_options``: extra fields of the target's body only."""
    common = {"qmpSocket": None, "multifdChannels": multifd_channels, "vm": vm}
    if chunk_size is not None:
        common["chunkSize"] = chunk_size
    if ring_depth is not None:
        common["ringDepth"] = ring_depth
    target = dst_agent.create(dict(common, role="target", qmpSocket=dst_qmp, **(target_options or {})))
    body = dict(common, role="source", qmpSocket=src_qmp,
                target={"endpoint": target["endpoint"], "migrationId": target["migrationId"],
                        "token": token if token is not None else target["token"]})
    body.update(source_options)
    source = src_agent.create(body)
    return target, source


def migrate_via_agents(src_agent, dst_agent, src_qmp, dst_qmp, timeout=300.0, on_status=None, **kw):
    """Runs one migration to its end. Returns (source status, target status)."""
    target, source = start_migration(src_agent, dst_agent, src_qmp, dst_qmp, **kw)
    src = src_agent.wait(source["id"], timeout=timeout, on_status=on_status)
    dst = dst_agent.wait(target["id"], timeout=60.0)
    return src, dst


def parse_prometheus(text):
    """Parses the Prometheus text format into {(name, frozenset(labels)): value} and types."""
    samples, types = {}, {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(None, 3)
                types[name] = kind
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_text, value = rest.rsplit("}", 1)
            labels = []
            i = 0
            while i < len(labels_text):
                eq = labels_text.index("=", i)
                key = labels_text[i:eq].strip().lstrip(",").strip()
                j = eq + 2
                val = []
                while labels_text[j] != '"':
                    if labels_text[j] == "\\":
                        j += 1
                    val.append(labels_text[j])
                    j += 1
                labels.append((key, "".join(val)))
                i = j + 1
                while i < len(labels_text) and labels_text[i] in ", ":
                    i += 1
            samples[(name, frozenset(labels))] = float(value.split()[0])
        else:
            name, value = line.split()[:2]
            samples[(name, frozenset())] = float(value)
    return samples, types
