"""rdmig-agent start-up: configuration errors stop it with a message naming the key, and the
transport choice when this machine has no RDMA (the case on these test machines)."""
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from rdmiglab import Agent  # noqa: E402
from rdmiglab.agent import agent_binary  # noqa: E402
from rdmiglab import timed  # noqa: E402


def rdma_present():
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


class AgentStartupTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="rdmig-start-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.token = os.path.join(self.tmp, "token")
        with open(self.token, "w") as f:
            f.write("0123456789abcdef0123\n")

    def run_agent(self, text, timeout=20):
        path = os.path.join(self.tmp, "agent.yaml")
        with open(path, "w") as f:
            f.write(text)
        return subprocess.run([agent_binary(), "--config", path], capture_output=True, text=True, timeout=timeout)

    def base(self, extra=""):
        return ("api: {address: 127.0.0.1, port: 0, probePort: 0, tokenFile: %s}\n"
                "dataPlane: {address: 127.0.0.1, port: 0}\nstateDir: %s\n%s" % (self.token, self.tmp, extra))

    def test_post_copy_records_that_are_damaged_changed_stale_or_whose_qemu_is_gone_are_named_and_removed(self):
        # An agent restarted during post-copy takes a migration up only from a record it can trust
        # (migration/postcopy_record.h, docs/api.md); these it names in its log, removes, and serves.
        a = Agent(self.tmp, "agent-records", start=False)
        self.addCleanup(a.stop)
        os.makedirs(a.state_dir, 0o700, exist_ok=True)
        self.addCleanup(subprocess.run, ["rm", "-rf", a.state_dir])
        now_ms = int(time.time() * 1000)

        def record(mid, **kw):
            body = {"version": 1, "id": mid, "role": "target", "vm": "vm-x",
                    "qmpSocket": os.path.join(os.path.realpath(tempfile.gettempdir()), "rdmig-gone-%s.sock" % mid),
                    "peer": "127.0.0.1", "session": "a" * 32, "channelKey": "b" * 64, "chunkSize": 1 << 20,
                    "ringDepth": 16, "verifyChunks": False, "postCopyMode": "requested",
                    "completionTimeoutSeconds": 600, "noProgressTimeoutSeconds": 60, "state": "recovering",
                    "switchedAtMs": now_ms - 5000, "recoveries": 0, "recoverySeconds": 300, "aliveAtMs": now_ms}
            body.update(kw)
            # The agent's digest: HMAC-SHA256 under its fixed label over the compact, key-sorted body.
            body["digest"] = hmac.new(b"rdmig-postcopy-record-v1", json.dumps(
                body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()
            return json.dumps(body)

        files = {
            "m-cut": record("m-cut")[:100],
            "m-big": record("m-big") + " " * 5000,
            "m-edited": record("m-edited").replace('rdmig-gone-m-edited.sock', 'rdmig-other.sock'),
            "m-stale": record("m-stale", aliveAtMs=now_ms - 301 * 1000),
            "m-gone": record("m-gone"),
        }
        for mid, text in files.items():
            path = os.path.join(a.state_dir, mid + ".postcopy.json")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(text)
        a.start()
        log = a.log_text()
        expect = {"m-cut": "postcopy record: document: not a JSON object",
                  "m-big": "size: ",
                  "m-edited": "postcopy record: digest: does not match",
                  "m-stale": "older than its recovery deadline",
                  "m-gone": "qmpSocket"}
        for mid, words in expect.items():
            line = [ln for ln in log.splitlines() if mid + ".postcopy.json not acted on, removed" in ln]
            self.assertEqual(len(line), 1, log)
            self.assertIn(words, line[0])
        self.assertEqual([n for n in os.listdir(a.state_dir) if "postcopy" in n], [])
        self.assertEqual(a.call("GET", "/v1/migrations")["items"], [])

    def test_unknown_key_stops_agent_naming_it(self):
        r = self.run_agent(self.base("migration: {chunksize: 4Mi}\n"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("migration.chunksize", r.stderr)

    def test_bad_chunk_size_stops_agent_naming_it(self):
        r = self.run_agent(self.base("migration: {chunkSize: 3Mi}\n"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("migration.chunkSize", r.stderr)
        self.assertIn("power of two", r.stderr)

    def test_missing_token_file_names_the_key(self):
        r = self.run_agent(self.base().replace(self.token, "/nonexistent/token"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("api.tokenFile", r.stderr)

    def test_version_and_check_config_on_both_programs(self):
        programs = {"rdmig-agent": agent_binary()}
        controller = os.environ.get("RDMIG_CONTROLLER")
        if controller:
            programs["rdmig-controller"] = controller
        version = {}
        for name, binary in programs.items():
            r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertRegex(r.stdout, r"^%s \d+\.\d+\.\d+ \(revision ([0-9a-f]{7,}|unknown)\)\n$" % name)
            version[name] = r.stdout.strip()
        good = os.path.join(self.tmp, "good.yaml")
        with open(good, "w") as f:
            f.write(self.base())
        bad = os.path.join(self.tmp, "bad.yaml")
        with open(bad, "w") as f:
            f.write(self.base("migration: {chunksize: 4Mi}\n"))
        r = subprocess.run([agent_binary(), "--check-config", good], capture_output=True, text=True, timeout=10)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("is valid", r.stdout)
        r = subprocess.run([agent_binary(), "--check-config", bad], capture_output=True, text=True, timeout=10)
        self.assertEqual(r.returncode, 2)
        self.assertIn("migration.chunksize", r.stderr)
        if controller:
            cgood = os.path.join(self.tmp, "controller.yaml")
            with open(cgood, "w") as f:
                f.write("agents: {tokenFile: %s}\n" % self.token)
            r = subprocess.run([controller, "--check-config", cgood], capture_output=True, text=True, timeout=10)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(cgood, "w") as f:
                f.write("agents: {tokenFile: %s, colour: blue}\n" % self.token)
            r = subprocess.run([controller, "--check-config", cgood], capture_output=True, text=True, timeout=10)
            self.assertEqual(r.returncode, 2)
            self.assertIn("colour", r.stderr)
        # A running agent: the version in its first log line and in rdmig_build_info.
        a = Agent(self.tmp, "version")
        try:
            first = a.log_text().splitlines()[0]
            self.assertIn(version["rdmig-agent"] + " starting", first)
            number, revision = version["rdmig-agent"].split()[1], version["rdmig-agent"].split()[-1].rstrip(")")
            self.assertIn('rdmig_build_info{revision="%s",version="%s"} 1' % (revision, number), a.metrics())
        finally:
            a.stop()

    @unittest.skipIf(rdma_present(), "this machine has an RDMA device")
    def test_required_rdma_without_a_device_stops_agent_with_the_reason(self):
        r = self.run_agent(self.base("transport: rdma\n"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("'transport'", r.stderr)
        self.assertIn("RDMA cannot be used (no-device)", r.stderr)
        self.assertIn("fix the rdma keys", r.stderr)

    def test_a_rails_device_error_names_its_place_in_rdma_devices(self):
        # Each rail of rdma.devices is named by its place (issue 38), never as the single rail's keys.
        r = self.run_agent(self.base("transport: rdma\nrdma:\n  devices:\n    - device: rdmig-nosuch0\n"
                                     "    - device: rdmig-nosuch1\n"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("config key 'rdma.devices[0].device': no RDMA device 'rdmig-nosuch0'", r.stderr)
        self.assertIn("config key 'rdma.devices[1].device': no RDMA device 'rdmig-nosuch1'", r.stderr)
        self.assertNotIn("'rdma.device'", r.stderr)

    @unittest.skipIf(rdma_present(), "this machine has an RDMA device")
    def test_auto_without_a_device_serves_and_reports_why(self):
        a = Agent(self.tmp, "auto", config={"transport": "auto"})
        try:
            self.assertEqual(a.request("GET", "/readyz", token=None)[0], 200)
            self.assertIn("rdma=unavailable (no-device: ", a.log_text())
            self.assertIn("rdmig_rdma_devices 0", a.metrics())
            self.assertIn('rdmig_rdma_selected{address="",device="",device_port="",gid_index="",gid_type="",'
                          'netdev="",reason="no-device"} 0', a.metrics())
        finally:
            a.stop()

    def test_invalid_percent_encoding_and_utf8_in_paths_are_answered_not_fatal(self):
        # These aborted the agent (a JSON exception while writing the error), token or not.
        import http.client
        a = Agent(self.tmp, "paths")
        try:
            for path, token in (("/%ff", False), ("/v1/migrations/%ff%fe", True), ("/v1/%c3%28", True),
                                ("/v1/kubevirt/migrations?name=%ff", True)):
                conn = http.client.HTTPConnection("127.0.0.1", a.api_port, timeout=10)
                headers = {"Authorization": "Bearer " + a.token} if token else {}
                conn.request("GET", path, headers=headers)
                resp = conn.getresponse()
                body = json.loads(resp.read())  # valid JSON whatever the path held
                conn.close()
                self.assertIn(resp.status, (400, 401, 404), (path, resp.status, body))
                self.assertIn("error", body)
            self.assertTrue(a.alive(), "the agent is still running")
            self.assertEqual(a.request("GET", "/healthz", token=None)[0], 200)
        finally:
            a.stop()

    def test_kubevirt_records_with_kubevirt_mode_off_answer_404_with_reason_kubevirt_mode_off(self):
        # The controller tells "this agent runs without KubeVirt mode" (AgentNotInKubevirtMode) by the
        # reason field; the message stays for controllers from before it. The k8s tests' stand-in
        # (tests/k8s/kubevirt_standin.py, style "current") answers exactly this.
        a = Agent(self.tmp, "kv-off")
        try:
            status, body = a.request("GET", "/v1/kubevirt/migrations?migrationUid=0a1b-2c3d")
            self.assertEqual(status, 404, body)
            self.assertEqual(body, {"error": {"code": "not_found", "reason": "KubevirtModeOff",
                                              "message": "KubeVirt mode is off on this agent (kubevirt.enabled)"}})
            # Any other 404 carries no reason.
            status, body = a.request("GET", "/v1/migrations/no-such-migration")
            self.assertEqual(status, 404, body)
            self.assertNotIn("reason", body["error"])
        finally:
            a.stop()

    def fake_qmp(self, name, before_greeting=1, greet=True):
        """A QMP peer on a unix socket: `before_greeting` events, then (if `greet`) a greeting and
        answers for an incoming QEMU; without a greeting it sends an event every 0.2 s forever."""
        import socket
        import threading
        path = os.path.join(self.tmp, name + ".qmp")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(path)
        srv.listen(4)
        event = b'{"event": "RESUME", "timestamp": {"seconds": 1, "microseconds": 0}}\n'
        answers = {"qmp_capabilities": {}, "query-status": {"status": "inmigrate", "running": False},
                   "query-migrate": {}}

        def serve():
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                try:
                    for _ in range(before_greeting):
                        c.sendall(event)
                    if not greet:
                        while True:
                            c.sendall(event)
                            threading.Event().wait(0.2)
                    c.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n')
                    f = c.makefile("rb")
                    for line in f:
                        cmd = json.loads(line)
                        c.sendall(json.dumps({"return": answers.get(cmd["execute"], {}), "id": cmd.get("id")}).encode()
                                  + b"\n")
                except OSError:
                    pass
        threading.Thread(target=serve, daemon=True).start()
        self.addCleanup(srv.close)
        return path

    def test_qmp_events_before_the_greeting_and_event_floods_are_handled(self):
        import time
        a = Agent(self.tmp, "qmp")
        try:
            # An event queued ahead of the greeting (QEMU 7.2 does this) is skipped.
            ok = a.request("POST", "/v1/migrations", {"role": "target", "qmpSocket": self.fake_qmp("early", 2)})
            self.assertEqual(ok[0], 201, ok)
            # A peer that only ever sends events never greets: a gateway timeout (504, docs/api.md)
            # within the connect timeout, naming the field.
            t0 = time.monotonic()
            bad = a.request("POST", "/v1/migrations", {"role": "target", "qmpSocket": self.fake_qmp("flood", 1, False)})
            self.assertLess(time.monotonic() - t0, 10.0, "each event must not restart the deadline")
            self.assertEqual(bad[0], 504, bad)
            self.assertIn("qmpSocket", json.dumps(bad[1]))
            self.assertTrue(a.alive())
        finally:
            a.stop()


if __name__ == "__main__":
    timed.main()
