"""rdmig-agent's REST API over HTTPS (api.tls), with certificates made by openssl in a temp dir
(tools/rdmiglab/pki.py: a CA and a certificate for the DNS name "rdmig-agent", as the chart makes).

- the API port serves HTTPS only: /v1 with the token, /healthz and /metrics, with the configured
  certificate; a plain-HTTP request on that port gets no HTTP answer and the agent keeps serving;
- the probe port stays plain HTTP (the kubelet has no CA);
- a client that does not trust the CA is refused by its own check (the certificate is the agent's);
- bad request framing (a Content-Length that is not a length, a chunk size past the body limit) is
  refused within a second over HTTPS too;
- a renewed certificate written over the files is served without a restart; a half-written
  update (a key that does not match) keeps the old one serving;
- a missing certificate or key, a file that holds no PEM, a key that belongs to another
  certificate or an unknown key under api.tls stops the agent at start and fails --check-config,
  naming the config key.

Run: python3 tests/integration/test_agent_tls.py -v     (ctest -L integration)
"""
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from rdmiglab import Agent, make_agent_pki  # noqa: E402
from rdmiglab.agent import agent_binary, agent_tls_context  # noqa: E402
from rdmiglab import timed  # noqa: E402


def served_certificate(port, ca, server_name="rdmig-agent"):
    """The DER certificate the agent presents on `port`, checked against `ca` and the name."""
    ctx = agent_tls_context(ca, server_name)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw) as s:
            return s.getpeercert(binary_form=True)


def der(pem_path):
    with open(pem_path) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


class AgentTlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-tls-")
        cls.pki = make_agent_pki(os.path.join(cls.tmp, "pki"))
        cls.agent = Agent(cls.tmp, "https", tls={"cert": cls.pki["cert"], "key": cls.pki["key"], "ca": cls.pki["ca"]})

    @classmethod
    def tearDownClass(cls):
        cls.agent.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_api_metrics_and_health_are_served_over_https_with_the_certificate(self):
        self.assertTrue(self.agent.url.startswith("https://"))
        self.assertEqual(self.agent.request("GET", "/healthz")[0], 200)
        status, body = self.agent.request("GET", "/v1/migrations")
        self.assertEqual(status, 200, body)
        self.assertEqual(self.agent.request("GET", "/v1/migrations", token="wrong-token-0123456789")[0], 403)
        self.assertIn("rdmig_", self.agent.metrics())
        self.assertEqual(served_certificate(self.agent.api_port, self.pki["ca"]), der(self.pki["cert"]))
        self.assertIn("HTTPS", self.agent.log_text())

    def test_plain_http_on_the_api_port_gets_no_answer_and_the_agent_keeps_serving(self):
        with socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: rdmig-agent\r\nConnection: close\r\n\r\n")
            got = b""
            try:
                while True:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            except (ConnectionResetError, socket.timeout):
                pass
        self.assertNotIn(b"HTTP/1.", got, "a plain-HTTP request must get no HTTP answer")
        self.assertNotIn(b"ok", got.lower())
        with self.assertRaises((urllib.error.URLError, ConnectionError, http_client_errors())):
            urllib.request.urlopen("http://127.0.0.1:%d/v1/migrations" % self.agent.api_port, timeout=10).read()
        self.assertTrue(self.agent.alive())
        self.assertEqual(self.agent.request("GET", "/healthz")[0], 200)

    def test_probe_port_stays_plain_http(self):
        with urllib.request.urlopen("http://127.0.0.1:%d/healthz" % self.agent.probe_port, timeout=5) as r:
            self.assertEqual(r.status, 200)

    def test_a_client_that_does_not_trust_the_ca_or_wants_another_name_is_refused(self):
        for ca, name, why in ((self.pki["other_ca"], "rdmig-agent", "unable to get local issuer"),
                              (self.pki["ca"], "other-name", "Hostname mismatch")):
            with self.assertRaises(ssl.SSLCertVerificationError) as e:
                served_certificate(self.agent.api_port, ca, name)
            self.assertIn(why, str(e.exception))

    def test_a_renewed_certificate_is_served_without_a_restart(self):
        d = os.path.join(self.tmp, "renew")
        os.makedirs(d)
        first = make_agent_pki(os.path.join(d, "first"))
        second = make_agent_pki(os.path.join(d, "second"))
        cert, key = os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")
        shutil.copy(first["cert"], cert)
        shutil.copy(first["key"], key)
        agent = Agent(self.tmp, "renew", tls={"cert": cert, "key": key, "ca": first["ca"]})
        try:
            pid = agent.proc.pid
            self.assertEqual(served_certificate(agent.api_port, first["ca"]), der(first["cert"]))
            # Half an update: the new certificate beside the old key. The old pair keeps serving.
            shutil.copy(second["cert"], cert + ".new")
            os.replace(cert + ".new", cert)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                self.assertEqual(served_certificate(agent.api_port, first["ca"]), der(first["cert"]))
                time.sleep(0.2)
            # The key arrives: the new pair is served from the next check on.
            shutil.copy(second["key"], key + ".new")
            os.replace(key + ".new", key)
            deadline = time.monotonic() + 10
            while True:
                try:
                    if served_certificate(agent.api_port, second["ca"]) == der(second["cert"]):
                        break
                except ssl.SSLCertVerificationError:
                    pass  # still the first one
                self.assertLess(time.monotonic(), deadline, "the renewed certificate was not served within 10 s")
                time.sleep(0.2)
            self.assertEqual(agent.proc.pid, pid)
            self.assertTrue(agent.alive())
            log = agent.log_text()
            self.assertIn("cannot be used, still serving the previous certificate", log)
            self.assertIn("serving a new certificate", log)
        finally:
            agent.stop()

    def test_bad_framing_over_https_is_refused_at_once(self):
        # The same front checks the framing over TLS (test_agent_hostile_http.py has every case):
        # a bad Content-Length in the head, and a chunk size past the limit in the body, each
        # answered within a second and the connection closed (before: 30 s, the request deadline).
        from test_agent_hostile_http import timed_answer
        head = ("POST /v1/migrations HTTP/1.1\r\nHost: rdmig-agent\r\nAuthorization: Bearer %s\r\n"
                % self.agent.token)
        for extra, want, words in (("Content-Length: -5\r\n\r\n", 400, "header 'Content-Length'"),
                                   ("Transfer-Encoding: chunked\r\n\r\n100000\r\n", 413, "api.maxBodyBytes")):
            ctx = agent_tls_context(self.pki["ca"])
            with socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=5) as raw:
                with ctx.wrap_socket(raw) as s:
                    status, parsed, took, closed = timed_answer(s, (head + extra).encode())
            print("\n[tls] %r -> %s in %.3f s" % (extra.split("\r\n")[0], status, took), file=sys.stderr)
            self.assertEqual(status, want, parsed)
            self.assertIn(words, parsed["error"]["message"])
            self.assertLess(took, 1.0)
            self.assertTrue(closed)

    # -- start-up errors name the key ------------------------------------------------------
    def start_fails(self, tls_cfg, *needles):
        name = "bad-%d" % int(time.monotonic() * 1e6)
        agent = Agent(self.tmp, name, config={"api": {"tls": tls_cfg}}, start=False)
        r = subprocess.run([agent_binary(), "--check-config", agent.config_file], capture_output=True, text=True,
                           timeout=20)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        for n in needles:
            self.assertIn(n, r.stderr)
        with self.assertRaises(RuntimeError) as e:
            agent.start(timeout=20)
        for n in needles:
            self.assertIn(n, str(e.exception))
        self.assertFalse(agent.alive())

    def test_bad_certificate_or_key_paths_stop_the_agent_naming_the_key(self):
        missing = os.path.join(self.tmp, "missing.pem")
        garbage = os.path.join(self.tmp, "garbage.pem")
        with open(garbage, "w") as f:
            f.write("not a certificate\n")
        self.start_fails({"certFile": missing, "keyFile": self.pki["key"]}, "api.tls.certFile", missing)
        self.start_fails({"certFile": self.pki["cert"], "keyFile": missing}, "api.tls.keyFile", missing)
        self.start_fails({"certFile": garbage, "keyFile": self.pki["key"]}, "api.tls.certFile", "no PEM certificate")
        self.start_fails({"certFile": self.pki["cert"], "keyFile": garbage}, "api.tls.keyFile", "no PEM private key")
        self.start_fails({"certFile": self.pki["cert"], "keyFile": self.pki["other_key"]},
                         "api.tls.keyFile", "does not belong to the certificate")
        self.start_fails({"certFile": self.pki["cert"]}, "api.tls.keyFile")
        self.start_fails({"certFile": self.pki["cert"], "keyFile": self.pki["key"], "caFile": self.pki["ca"]},
                         "api.tls.caFile")

    def test_check_config_accepts_a_good_pair(self):
        agent = Agent(self.tmp, "check-ok", tls={"cert": self.pki["cert"], "key": self.pki["key"],
                                                 "ca": self.pki["ca"]}, start=False)
        r = subprocess.run([agent_binary(), "--check-config", agent.config_file], capture_output=True, text=True,
                           timeout=20)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("rdmig-agent", r.stdout)


def http_client_errors():
    import http.client
    return http.client.HTTPException


if __name__ == "__main__":
    timed.main()
