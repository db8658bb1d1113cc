"""The agent's REST surface tried as an attacker and an unlucky client would (issue 11): bodies
over the limit in every framing, malformed framing (bad, duplicate or over-limit Content-Length,
Content-Length with Transfer-Encoding, other codings, bad chunk sizes, over-long header lines:
each refused within a second, the connection closed), deep nesting, bad UTF-8 in body, path, query and headers,
Authorization tricks, over-long request lines, wrong types for every create field, buffer
budgets, and concurrent creates racing for the last slot. Every case must end with a JSON error
that names its cause, the agent serving, and its memory bounded (RSS before/after printed).
A source's target.endpoint that the dial policy refuses (issue 38) is tried on an agent alone in
a network namespace of the test's own, where any connection attempt would be seen and counted.

Real agent, raw sockets (so the bytes on the wire are exactly the hostile ones) and small QMP
stand-ins on unix sockets where a create needs a QEMU to answer (no guest boots here).

Run: RDMIG_AGENT=build/agent/rdmig-agent python3 tests/integration/test_agent_hostile_http.py -v
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from rdmiglab import Agent, parse_prometheus  # noqa: E402
from rdmiglab import wireproof  # noqa: E402
from rdmiglab.netns import LoopbackNetns, NetnsAgent  # noqa: E402
from rdmiglab.wireproof import PROTOCOL, control_proof, send_frame, recv_frame  # noqa: E402,F401
from rdmiglab import timed  # noqa: E402


def raw_request(port, data, timeout=10.0, read_all=True):
    """Sends `data` (bytes) as is; returns (status, parsed JSON body or None, raw reply)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent answered and closed before taking everything: read the answer
        reply = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
            if not read_all and b"\r\n\r\n" in reply:
                head, _, body = reply.partition(b"\r\n\r\n")
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
                if length and len(body) >= length[0]:
                    break
    finally:
        s.close()
    if not reply.startswith(b"HTTP/1.1 "):
        return None, None, reply
    status = int(reply[9:12])
    body = reply.partition(b"\r\n\r\n")[2]
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    return status, parsed, reply


def timed_answer(sock, data, wait=5.0):
    """Sends `data` on `sock` (plain or TLS) and keeps the connection open, never sending what
    the request announced. Returns (status, parsed JSON body, seconds until the whole answer
    arrived, whether the agent then closed the connection); status None when no whole answer
    came within `wait` s (before the front checked the framing: 30 s, the request deadline)."""
    t0 = time.monotonic()
    sock.settimeout(wait)
    sock.sendall(data)
    reply = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
            head, sep, body = reply.partition(b"\r\n\r\n")
            length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            if sep and length and len(body) >= length[0]:
                break
    except (socket.timeout, ConnectionResetError):
        pass
    took = time.monotonic() - t0
    if not reply.startswith(b"HTTP/1.1 ") or b"\r\n\r\n" not in reply:
        return None, None, took, False
    closed = False
    try:
        sock.settimeout(2.0)
        closed = sock.recv(1) == b""
    except (socket.timeout, ConnectionResetError, ssl_errors()):
        closed = not isinstance(sys.exc_info()[1], socket.timeout)
    try:
        parsed = json.loads(reply.partition(b"\r\n\r\n")[2])
    except ValueError:
        parsed = None
    return int(reply[9:12]), parsed, took, closed


def ssl_errors():
    import ssl
    return ssl.SSLError


class FakeIncomingQemu:
    """A QMP peer that looks like `qemu -incoming defer`: greeting (after `delay` s), then {} or
    the status an incoming QEMU gives for every command."""

    def __init__(self, path, delay=0.0):
        self.path, self.delay = path, delay
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(path)
        self.srv.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(c,), daemon=True).start()

    STATUS = {"status": "inmigrate", "running": False}

    def answer(self, cmd):
        """The `return` value for one command (subclasses act on commands here)."""
        return self.STATUS if cmd.get("execute") == "query-status" else {}

    def _client(self, c):
        try:
            time.sleep(self.delay)
            c.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n')
            for line in c.makefile("rb"):
                cmd = json.loads(line)
                c.sendall(json.dumps({"return": self.answer(cmd), "id": cmd.get("id")}).encode() + b"\n")
        except (OSError, ValueError):
            pass
        finally:
            c.close()

    def close(self):
        self.srv.close()


class FakeRunningQemu(FakeIncomingQemu):
    """A QMP peer that looks like a running QEMU with no migration: enough for a source create."""
    STATUS = {"status": "running", "running": True}


def control_hello(sock, hello, token):
    """Sends a control hello (a source nonce added when it has none) and answers the target's
    challenge; returns the target's answer, a welcome with "challengeNonce" (the target's nonce)
    and "sourceNonce" added: with the session they make the channel key."""
    hello = dict(hello)
    hello.setdefault("nonce", wireproof.nonce())
    send_frame(sock, hello)
    reply = recv_frame(sock)
    if reply and reply.get("type") == "challenge":
        target_nonce = reply["nonce"]
        send_frame(sock, {"type": "auth", "proof": control_proof(token, target_nonce, hello["migrationId"],
                                                                 hello["nonce"])})
        reply = recv_frame(sock)
        if reply is not None and reply.get("type") == "welcome":
            reply = dict(reply, challengeNonce=target_nonce, sourceNonce=hello["nonce"])
    return reply


def channel_key_of(welcome, token):
    """The channel key of the session a control hello opened (control_hello's answer)."""
    return wireproof.channel_key(token, welcome["sourceNonce"], welcome["challengeNonce"], welcome["session"])


class FakeSource:
    """Plays a source agent towards a target job on `agent`: a control and a data connection
    through the challenge, up to `start`/`ready` when `start`. `chunk` and `depth` must match
    the target's."""

    def __init__(self, agent, target, chunk, depth, start=True):
        self.ctl = socket.create_connection(("127.0.0.1", agent.data_port), timeout=10)
        hello = {"type": "hello", "protocol": PROTOCOL, "migrationId": target["id"], "channels": 1,
                 "chunkSize": chunk, "ringDepth": depth, "transport": "tcp"}
        welcome = control_hello(self.ctl, dict(hello, kind="control"), target["token"])
        assert welcome["type"] == "welcome", welcome
        self.data, answer = wireproof.open_channel(
            agent.data_port, dict(hello, kind="data", session=welcome["session"], index=0),
            channel_key_of(welcome, target["token"]))
        assert answer["type"] == "welcome", answer
        if start:
            send_frame(self.ctl, {"type": "start"})
            assert recv_frame(self.ctl)["type"] == "ready"

    def send_chunk(self, n=4096):
        """One DATA frame (type 1, length): the target connects to its QEMU on the first."""
        import struct
        self.data.sendall(struct.pack("<II", 1, n) + b"\0" * n)

    def close(self):
        self.ctl.close()
        self.data.close()


class StallingTargetAgent:
    """A data-plane peer that plays a target agent up to `stage` and then goes silent:
    'hello' (never answers the control hello), or 'ready' (welcomes control and data, never
    sends 'ready')."""

    def __init__(self, stage):
        self.stage = stage
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        self.port = self.srv.getsockname()[1]
        self.conns = []
        self.seen = []  # the types of the messages received, in order
        self.frames = []  # the hellos and auth answers received, whole
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._client, args=(c,), daemon=True).start()

    def _client(self, c):
        try:
            hello = recv_frame(c)
            if hello is not None:
                self.seen.append(hello.get("kind"))
                self.frames.append(hello)
            if hello is None or self.stage == "hello":
                return
            if hello.get("kind") == "control":
                send_frame(c, {"type": "challenge", "nonce": "cd" * 16})
                auth = recv_frame(c)
                if auth is None:
                    return
                self.frames.append(auth)
                # It holds the token ("t" * 32, create_source's): its channels prove the key.
                self.key = wireproof.channel_key("t" * 32, hello.get("nonce", ""), "cd" * 16, "ab" * 16)
                send_frame(c, {"type": "welcome", "session": "ab" * 16, "transport": "tcp"})
                if self.stage in ("full", "ready"):  # answer 'start' with 'ready'; then carry nothing
                    while True:
                        m = recv_frame(c)
                        if m is None:
                            return
                        self.seen.append(m.get("type"))
                        if m.get("type") == "start" and self.stage == "full":
                            send_frame(c, {"type": "ready"})
            else:
                wireproof.accept_channel(c, hello, self.key)
        except OSError:
            pass

    def close(self):
        self.srv.close()
        for c in self.conns:
            c.close()


class HostileHttpTest(unittest.TestCase):
    agent = None

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-hostile-")
        cls.agent = Agent(cls.tmp, "hostile", config={"migration": {"maxConcurrent": 2, "bufferBudget": "256Mi"}})
        cls.rss_start = cls.agent.rss_kib()

    @classmethod
    def tearDownClass(cls):
        if cls.agent:
            print("\n[hostile-http] agent RSS %d KiB at start, %d KiB at the end"
                  % (cls.rss_start, cls.agent.rss_kib()), file=sys.stderr)
            cls.agent.stop()

    def tearDown(self):
        # After every case: still serving, probes answer.
        self.assertTrue(self.agent.alive(), "the agent died")
        self.assertEqual(self.agent.request("GET", "/healthz", token=None)[0], 200)

    def post(self, body_bytes, headers=None, chunked=False):
        h = {"Host": "x", "Authorization": "Bearer " + self.agent.token, "Content-Type": "application/json"}
        h.update(headers or {})
        if chunked:
            h["Transfer-Encoding"] = "chunked"
        else:
            h["Content-Length"] = str(len(body_bytes))
        head = "POST /v1/migrations HTTP/1.1\r\n" + "".join("%s: %s\r\n" % kv for kv in h.items()) + "\r\n"
        return head.encode("latin-1"), body_bytes

    def assertError(self, status, body, want_status, *words):
        self.assertEqual(status, want_status, body)
        self.assertIsInstance(body, dict, "a JSON error body")
        msg = body["error"]["message"]
        for w in words:
            self.assertIn(w, msg)
        return msg

    # ---- bodies ----

    def test_chunked_body_over_the_limit_is_refused_while_reading_and_memory_stays_bounded(self):
        before = self.agent.rss_kib()
        head, _ = self.post(b"", chunked=True)
        # 6 MB in 16-byte chunks: read whole, this grew the agent by ~175 MB.
        chunk = b"10\r\n" + b'{"role":"target"' + b"\r\n"
        body = chunk * (6 * 1024 * 1024 // 16) + b"0\r\n\r\n"
        status, parsed, _ = raw_request(self.agent.api_port, head + body, timeout=60)
        after = self.agent.rss_kib()
        print("\n[hostile-http] 6 MB chunked body: %s; RSS %d -> %d KiB" % (status, before, after), file=sys.stderr)
        self.assertError(status, parsed, 413, "api.maxBodyBytes")
        self.assertLess(after - before, 16 * 1024, "RSS grew by more than 16 MiB")

    def test_content_length_over_the_limit_is_refused_before_reading(self):
        head, _ = self.post(b"x" * (65 * 1024))
        status, parsed, _ = raw_request(self.agent.api_port, head + b"x" * (65 * 1024))
        self.assertError(status, parsed, 413, "api.maxBodyBytes")

    def test_deeply_nested_body_is_refused_naming_the_depth(self):
        for depth in (33, 10000):
            text = ("[" * depth + "]" * depth).encode()
            head, body = self.post(text)
            status, parsed, _ = raw_request(self.agent.api_port, head + body)
            self.assertError(status, parsed, 400, "nested deeper than 32")
        # Brackets inside strings are not nesting.
        text = json.dumps({"role": "target", "qmpSocket": "/x/" + "[" * 60}).encode()
        head, body = self.post(text)
        status, parsed, _ = raw_request(self.agent.api_port, head + body)
        self.assertNotIn("nested", parsed["error"]["message"])  # refused later, for the socket

    def test_invalid_utf8_in_body_is_named(self):
        head, body = self.post(b'{"role": "target", "vm": "\xff\xfe"}')
        status, parsed, _ = raw_request(self.agent.api_port, head + body)
        self.assertError(status, parsed, 400, "not valid UTF-8")

    def test_wrong_types_for_every_create_field_name_the_field(self):
        base = {"role": "source", "qmpSocket": "/tmp/q.sock",
                "target": {"endpoint": "127.0.0.1:1", "migrationId": "m-1", "token": "t"}}
        wrong = {"role": 5, "id": ["a"], "vm": {"a": 1}, "qmpSocket": 7, "multifdChannels": "eight",
                 "chunkSize": [1], "ringDepth": -1, "transport": 3, "maxDowntimeMs": "x",
                 "maxBandwidthBytesPerSecond": [], "completionTimeoutSeconds": 1.5,
                 "noProgressTimeoutSeconds": True, "target": "host:1"}
        for field, value in wrong.items():
            body = dict(base, **{field: value})
            status, parsed = self.agent.request("POST", "/v1/migrations", body)
            self.assertEqual(status, 400, (field, parsed))
            self.assertIn(field, parsed["error"]["message"], (field, parsed))
        for field, value in {"endpoint": 1, "migrationId": None, "token": {"x": 1}}.items():
            body = dict(base, target=dict(base["target"], **{field: value}))
            status, parsed = self.agent.request("POST", "/v1/migrations", body)
            self.assertEqual(status, 400, (field, parsed))
            self.assertIn("target." + field, parsed["error"]["message"])

    # ---- request line and headers ----

    def test_authorization_must_be_exactly_bearer_and_the_token(self):
        tok = self.agent.token
        for value, want in (("Bearer " + tok + "x", 403), ("bearer " + tok, 401),
                            ("Bearer  " + tok, 403), ("Basic " + tok, 401), ("Bearer", 401), ("Bearer " + tok[:-1], 403)):
            req = ("GET /v1/migrations HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n\r\n" % value).encode()
            status, parsed, _ = raw_request(self.agent.api_port, req, read_all=False)
            self.assertEqual(status, want, (value, parsed))
            self.assertIn("Authorization", parsed["error"]["message"])
        # A NUL after the token, and bytes that are not UTF-8, never reach the comparison.
        for raw in (b"Bearer " + tok.encode() + b"\x00rest", b"Bearer " + tok.encode() + b"\xff"):
            req = b"GET /v1/migrations HTTP/1.1\r\nHost: x\r\nAuthorization: " + raw + b"\r\n\r\n"
            status, parsed, reply = raw_request(self.agent.api_port, req, read_all=False)
            self.assertIn(status, (400, 403), reply[:200])
            self.assertIsNotNone(parsed, reply[:200])

    def test_bad_text_in_path_query_and_headers_is_400_naming_where(self):
        cases = ((b"GET /v1/migrations/%ff HTTP/1.1\r\nHost: x\r\n\r\n", "path"),
                 (b"GET /healthz/%c3%28 HTTP/1.1\r\nHost: x\r\n\r\n", "path"),
                 (b"GET /v1/migrations/%01 HTTP/1.1\r\nHost: x\r\n\r\n", "path"),
                 (b"GET /v1/kubevirt/migrations?name=%ff HTTP/1.1\r\nHost: x\r\n\r\n", "query parameter"),
                 (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Trace: \xc0\xaf\r\n\r\n", "header X-Trace"))
        for req, where in cases:
            status, parsed, reply = raw_request(self.agent.api_port, req, read_all=False)
            self.assertError(status, parsed, 400, where)

    def test_over_long_request_line_gets_a_json_error(self):
        req = b"GET /v1/migrations/" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        status, parsed, reply = raw_request(self.agent.api_port, req, read_all=False)
        self.assertIn(status, (400, 414), reply[:200])
        self.assertIsNotNone(parsed, reply[:200])
        self.assertIn("error", parsed)

    # ---- request framing: refused at once (RFC 9112 section 6.3) ----
    # Before the front checked the framing, each of these waited for the body the head announced
    # (or for the rest of the head), holding a worker until the 30 s request deadline.

    def post_head(self, *lines, token=True):
        """A POST /v1/migrations head with these extra header lines, its empty line, no body."""
        head = ["POST /v1/migrations HTTP/1.1", "Host: x", "Content-Type: application/json"]
        if token:
            head.append("Authorization: Bearer " + self.agent.token)
        return ("\r\n".join(head + list(lines)) + "\r\n\r\n").encode("latin-1")

    def assertRefusedAtOnce(self, data, want_status, *words, label=None):
        with socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=5) as c:
            status, parsed, took, closed = timed_answer(c, data)
        label = label or data[:120]
        print("\n[hostile-http] %r -> %s in %.3f s" % (label, status, took), file=sys.stderr)
        self.assertIsNotNone(status, "%r: no answer within 5 s" % (label,))
        self.assertError(status, parsed, want_status, *words)
        self.assertEqual(parsed["error"]["code"], "invalid_argument")
        self.assertLess(took, 1.0, label)
        self.assertTrue(closed, "%r: the connection stays open after the refusal" % (label,))

    def test_invalid_content_length_is_400_at_once_naming_the_header(self):
        for value in ("-5", "+5", "abc", "", "5 5", "0x10", "5, 5"):
            self.assertRefusedAtOnce(self.post_head("Content-Length: " + value), 400, "header 'Content-Length'",
                                     label="Content-Length: " + value)

    def test_content_length_over_the_limit_is_413_at_once_however_many_digits(self):
        # Any run of digits is a length (RFC 9110 section 8.6); one past api.maxBodyBytes is too large.
        for value in ("20000000", "18446744073709551616", "99999999999999999999"):
            self.assertRefusedAtOnce(self.post_head("Content-Length: " + value), 413, "header 'Content-Length'",
                                     "api.maxBodyBytes", label="Content-Length: " + value)

    def test_duplicate_content_length_is_400_at_once_even_with_equal_values(self):
        for pair in (("5", "6"), ("5", "5")):
            self.assertRefusedAtOnce(self.post_head("Content-Length: " + pair[0], "Content-Length: " + pair[1]), 400,
                                     "header 'Content-Length': given more than once", label=pair)

    def test_content_length_with_transfer_encoding_is_400_at_once(self):
        for lines in (("Content-Length: 5", "Transfer-Encoding: chunked"),
                      ("Transfer-Encoding: chunked", "Content-Length: 99999999999999999999")):
            self.assertRefusedAtOnce(self.post_head(*lines), 400, "not allowed together with Transfer-Encoding",
                                     label=lines)

    def test_transfer_encoding_other_than_one_chunked_is_400_at_once(self):
        for value in ("gzip", "chunked, gzip", "gzip, chunked", "chunked, chunked", "identity"):
            self.assertRefusedAtOnce(self.post_head("Transfer-Encoding: " + value), 400,
                                     "header 'Transfer-Encoding'", label="Transfer-Encoding: " + value)

    def test_malformed_header_lines_are_400_at_once(self):
        # httplib skipped these lines: the request then had no length and was read until close.
        self.assertRefusedAtOnce(self.post_head("Content-Length : 5"), 400,
                                 "header 'Content-Length': whitespace before ':'", label="Content-Length : 5")
        self.assertRefusedAtOnce(self.post_head("X-A: 1", " folded"), 400, "header 'X-A': a folded line",
                                 label="X-A: 1 + folded line")

    def test_a_header_line_over_the_limits_is_431_at_once_naming_it(self):
        # A header line that never ends: the head reaches 16 KiB (before: handed on as it was).
        self.assertRefusedAtOnce(self.post_head()[:-2] + b"X-Big: " + b"a" * 20000, 431,
                                 "header 'X-Big'", "16384 bytes", label="X-Big: a*20000, no end")
        # A whole header line over 8 KiB (before: httplib's plain 400).
        self.assertRefusedAtOnce(self.post_head("X-Big: " + "a" * 9000), 431,
                                 "header 'X-Big': line longer than 8192 bytes", label="X-Big: a*9000")
        # Many short lines that never end the head.
        many = self.post_head()[:-2] + b"".join(b"X-Many: %s\r\n" % (b"b" * 100) for _ in range(200))
        self.assertRefusedAtOnce(many, 431, "request head larger than 16384 bytes", label="200 lines, no end")

    def test_a_chunk_size_over_the_limit_or_not_hex_is_answered_as_its_line_arrives(self):
        head = self.post_head("Transfer-Encoding: chunked")
        self.assertRefusedAtOnce(head + b"ffffffffffffffffffffffff\r\n", 413, "body (chunked)", "api.maxBodyBytes",
                                 label="chunk size 0xfff... (overflows 64 bits)")
        self.assertRefusedAtOnce(head + b"100000\r\n", 413, "api.maxBodyBytes", label="chunk size 1 MiB")
        self.assertRefusedAtOnce(head + b"zz\r\n", 400, "body (chunked): chunk size is not hexadecimal",
                                 label="chunk size zz")
        self.assertRefusedAtOnce(head + b"5\r\nhelloX", 400, "body (chunked): chunk data longer than its size",
                                 label="chunk data past its size")
        # Chunks that together pass the limit: refused at the size line that crosses it.
        chunks = b"".join(b"8000\r\n" + b" " * 0x8000 + b"\r\n" for _ in range(2))
        self.assertRefusedAtOnce(head + chunks + b"1\r\n", 413, "api.maxBodyBytes", label="64 KiB, then 1 byte")

    def test_a_chunk_that_arrives_after_the_head_is_checked_as_it_arrives(self):
        # A good first chunk with the head, the bad size line in a later write: the worker that
        # reads the body checks each size line as it arrives, wherever the writes split.
        with socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=5) as c:
            c.sendall(self.post_head("Transfer-Encoding: chunked") + b"2\r\n{}\r\n")
            status, parsed, took, closed = timed_answer(c, b"100000\r\n")
        print("\n[hostile-http] a 1 MiB chunk size after the first chunk -> %s in %.3f s" % (status, took),
              file=sys.stderr)
        self.assertError(status, parsed, 413, "api.maxBodyBytes")
        self.assertLess(took, 1.0)
        self.assertTrue(closed)

    def test_framing_is_refused_before_the_token_is_checked_and_body_framing_after(self):
        # Head framing depends on nothing but the bytes sent: refused without a token.
        self.assertRefusedAtOnce(self.post_head("Content-Length: -5", token=False), 400, "header 'Content-Length'",
                                 label="no token, Content-Length: -5")
        self.assertRefusedAtOnce(self.post_head("Content-Length: 20000000", token=False), 413, "api.maxBodyBytes",
                                 label="no token, Content-Length: 20000000")
        # A body is read only for a request with the token: a bad chunk without one gets 401.
        with socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=5) as c:
            status, parsed, took, _ = timed_answer(c, self.post_head("Transfer-Encoding: chunked", token=False)
                                                   + b"zz\r\n")
        self.assertError(status, parsed, 401, "Authorization")
        self.assertLess(took, 1.0)

    def test_a_request_without_content_length_or_chunked_has_no_body(self):
        # RFC 9112 section 6.3, rule 7: the request ends with its head. Before, httplib read a
        # POST's body until the client closed (or the 30 s deadline).
        self.assertRefusedAtOnce(self.post_head(), 400, "body: not valid JSON", label="POST without a length")

    # ---- slow and idle clients ----

    def slow_clients(self, port, count, stop, first=b"GET /v1/migrations HTTP/1.1\r\n", source=None):
        """`count` connections that send `first`, then one header byte a second until `stop`."""
        socks = []
        for _ in range(count):
            c = socket.create_connection(("127.0.0.1", port), timeout=5,
                                         source_address=(source, 0) if source else None)
            c.sendall(first)
            socks.append(c)

        def trickle():
            while not stop.wait(1.0):
                for c in socks:
                    try:
                        c.sendall(b"X")
                    except OSError:
                        pass
            for c in socks:
                c.close()
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        return t

    def timed_get(self, port, path, token=None):
        t0 = time.monotonic()
        req = "GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path, "Authorization: Bearer %s\r\n" % token if token else "")
        try:
            status, parsed, _ = raw_request(port, req.encode(), timeout=10, read_all=False)
        except TimeoutError:
            status = "no answer within 10 s"
        return status, time.monotonic() - t0

    def test_slow_clients_starve_neither_probes_nor_requests(self):
        # A dozen-plus clients that send their request a byte a second held all of httplib's
        # 8 default workers: /healthz on the API port (and every REST call) then waited for them.
        stop = threading.Event()
        trickling = [self.slow_clients(self.agent.api_port, 20, stop),
                     self.slow_clients(self.agent.probe_port, 100, stop, first=b"GET /hea")]
        try:
            time.sleep(1.5)  # one trickle round: every connection has sent a byte after its first line
            worst = {}
            for label, port, path, token in (("probe /healthz", self.agent.probe_port, "/healthz", None),
                                             ("probe /readyz", self.agent.probe_port, "/readyz", None),
                                             ("api /healthz", self.agent.api_port, "/healthz", None),
                                             ("api GET /v1/migrations", self.agent.api_port, "/v1/migrations",
                                              self.agent.token)):
                for _ in range(3):
                    status, took = self.timed_get(port, path, token)
                    self.assertEqual(status, 200, label)
                    worst[label] = max(worst.get(label, 0), took)
            print("\n[hostile-http] 20 slow API clients + 100 slow probe clients; slowest answers: %s"
                  % ", ".join("%s %.3fs" % kv for kv in worst.items()), file=sys.stderr)
            for label, took in worst.items():
                self.assertLess(took, 1.0, label)
        finally:
            stop.set()
            for t in trickling:
                t.join(10)

    def test_trickling_heads_from_one_address_hold_no_worker_and_end_at_the_deadline(self):
        # 100 connections from one address send their request head a byte a second. Before the
        # front, each held a worker from accept (the per-client cap counted only parsed
        # requests): 64 of them held every worker, and other clients' requests waited behind.
        stop = threading.Event()
        t0 = time.monotonic()
        socks = []
        trickler = None
        try:
            trickler = self.slow_clients(self.agent.api_port, 100, stop, source="127.0.0.2")
            time.sleep(2.5)  # two trickle rounds
            worst = 0.0
            for path, token in (("/healthz", None), ("/v1/migrations", self.agent.token)) * 3:
                status, took = self.timed_get(self.agent.api_port, path, token)
                self.assertEqual(status, 200, path)
                worst = max(worst, took)
            print("\n[hostile-http] 100 trickling heads from 127.0.0.2; slowest answer elsewhere %.3f s" % worst,
                  file=sys.stderr)
            self.assertLess(worst, 1.0)
        finally:
            stop.set()
            if trickler:
                trickler.join(10)
        # The head deadline (10 s from accept): a trickler gets 408 and its connection ends.
        c = socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=20,
                                     source_address=("127.0.0.2", 0))
        started = time.monotonic()
        c.sendall(b"GET /v1/migrations HTTP/1.1\r\n")
        reply = b""
        while True:
            try:
                c.sendall(b"X")
            except OSError:
                pass
            c.settimeout(1.0)
            try:
                chunk = c.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            reply += chunk
        c.close()
        took = time.monotonic() - started
        print("\n[hostile-http] a trickling head ended after %.1f s: %r" % (took, reply[:40]), file=sys.stderr)
        self.assertTrue(reply.startswith(b"HTTP/1.1 408 "), reply[:200])
        self.assertGreater(took, 9.0)
        self.assertLess(took, 13.0)

    def test_silent_connections_past_an_addresses_share_take_only_its_own(self):
        # 300 silent connections from one address: it keeps at most 128 open (its newest are
        # closed at once); another address is served as before.
        held = []
        try:
            for _ in range(300):
                held.append(socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=5,
                                                     source_address=("127.0.0.3", 0)))
            time.sleep(0.5)
            closed = 0
            for c in held:
                c.setblocking(False)
                try:
                    if c.recv(1) == b"":
                        closed += 1
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
            print("\n[hostile-http] 300 silent connections from one address: %d closed by the agent" % closed,
                  file=sys.stderr)
            self.assertEqual(closed, 300 - 128)
            for _ in range(3):
                status, took = self.timed_get(self.agent.api_port, "/v1/migrations", self.agent.token)
                self.assertEqual(status, 200)
                self.assertLess(took, 1.0)
        finally:
            for c in held:
                c.close()

    def test_a_connection_flood_never_pushes_out_the_kubelets_probes(self):
        # Processes on another address (a pod on the node's network) open silent connections to
        # the probe port as fast as they can for 3 s. The kubelet's probes, from their own
        # address, are answered every time (before: a full table dropped its oldest entry, and a
        # probe accepted just before a burst was dropped unanswered: a kubelet restarting the
        # agent mid-migration).
        flood = ("import socket,sys,time\n"
                 "port=int(sys.argv[1]); end=time.monotonic()+20; held=[]; n=0\n"
                 "while time.monotonic()<end:\n"
                 "  try:\n"
                 "    c=socket.socket(); c.bind(('127.0.0.2',0)); c.settimeout(1); c.connect(('127.0.0.1',port)); held.append(c); n+=1\n"
                 "  except OSError: pass\n"
                 "  if n==100: print('up', flush=True)\n"
                 "  if len(held)>300: held.pop(0).close()\n")
        procs = [subprocess.Popen([sys.executable, "-c", flood, str(self.agent.probe_port)], stdout=subprocess.PIPE,
                                  text=True) for _ in range(3)]
        try:
            for p in procs:
                self.assertEqual(p.stdout.readline().strip(), "up")  # the table is full from here on
            # 20 probes while the flood goes on (killed below; it stops by itself after 20 s): about
            # 2 s on an idle machine, longer when the suite runs another test beside this one.
            answers = []
            end = time.monotonic() + 12.0
            while len(answers) < 20 and time.monotonic() < end:
                answers.append(self.timed_get(self.agent.probe_port, "/healthz")[0])
        finally:
            for p in procs:
                p.kill()
                p.wait()
        print("\n[hostile-http] probes under a connection flood: %d asked, %d answered 200"
              % (len(answers), answers.count(200)), file=sys.stderr)
        self.assertGreater(len(answers), 10)
        self.assertEqual([a for a in answers if a != 200], [], "a probe went unanswered under the flood")

    def test_a_thousand_requests_in_a_second_from_one_address_all_get_an_answer(self):
        # A burst from one address (100 at a time): each gets 200 or 429, never a reset or silence.
        import collections
        answers = collections.Counter()
        lock = threading.Lock()

        def worker():
            for _ in range(10):
                try:
                    status, _, _ = raw_request(self.agent.api_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                                               timeout=10, read_all=False)
                    key = status if status is not None else "no answer"
                except ConnectionResetError:
                    key = "reset"
                except OSError as e:
                    key = type(e).__name__
                with lock:
                    answers[key] += 1
        t0 = time.monotonic()
        threads = [threading.Thread(target=worker) for _ in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - t0
        print("\n[hostile-http] 1000 requests from one address in %.2f s: %s" % (took, dict(answers)), file=sys.stderr)
        self.assertEqual(sum(answers.values()), 1000)
        self.assertEqual({k: v for k, v in answers.items() if k not in (200, 429)}, {}, answers)

    def test_one_client_cannot_hold_more_than_its_share_of_the_api(self):
        # 20 connections from one address send complete headers of a create, then hold back the
        # body: each holds a worker inside its handler. Past 16 at once, that client gets 429.
        head = ("POST /v1/migrations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" % self.agent.token).encode()
        held = []
        try:
            for _ in range(20):
                c = socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=5)
                c.sendall(head)
                held.append(c)
            deadline, status = time.time() + 10, None
            while time.time() < deadline:
                status, body = self.agent.request("GET", "/v1/migrations")
                if status == 429:
                    break
                time.sleep(0.05)
            print("\n[hostile-http] a 21st request from the same client: %s %s" % (status, body), file=sys.stderr)
            self.assertError(status, body, 429, "at most 16 per client")
            # Another client address is not held back by it.
            other = socket.create_connection(("127.0.0.1", self.agent.api_port), timeout=5,
                                             source_address=("127.0.0.2", 0))
            other.sendall(("GET /v1/migrations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n"
                           % self.agent.token).encode())
            self.assertIn(b" 200 ", other.recv(4096).split(b"\r\n")[0] + b" ")
            other.close()
        finally:
            for c in held:
                c.close()
        # The held requests end with their connections: the client is served again.
        deadline = time.time() + 15
        while self.agent.request("GET", "/v1/migrations")[0] != 200 and time.time() < deadline:
            time.sleep(0.1)
        self.assertEqual(self.agent.request("GET", "/v1/migrations")[0], 200)

    def test_probe_port_answers_only_probes_and_drops_silent_clients(self):
        status, parsed, _ = raw_request(self.agent.probe_port, b"GET /v1/migrations HTTP/1.1\r\n\r\n", read_all=False)
        self.assertEqual(status, 404)
        status, parsed, _ = raw_request(self.agent.probe_port, b"POST /healthz HTTP/1.1\r\n\r\n", read_all=False)
        self.assertEqual(status, 405)
        # A silent client is closed after the 2 s whole-request deadline.
        c = socket.create_connection(("127.0.0.1", self.agent.probe_port), timeout=10)
        t0 = time.monotonic()
        self.assertEqual(c.recv(100), b"")
        took = time.monotonic() - t0
        c.close()
        self.assertLess(took, 4.0)
        self.assertGreater(took, 1.0)

    # ---- data-plane hellos ----

    def hello(self, token="t" * 32, **fields):
        msg = dict({"type": "hello", "protocol": PROTOCOL, "kind": "control", "channels": 1,
                    "chunkSize": 1 << 20, "ringDepth": 16, "transport": "tcp", "nonce": wireproof.nonce()}, **fields)
        s = socket.create_connection(("127.0.0.1", self.agent.data_port), timeout=10)
        try:
            return control_hello(s, msg, token)
        finally:
            s.close()

    def test_hello_refusals_do_not_reveal_which_migrations_exist(self):
        q = FakeIncomingQemu(os.path.join(self.tmp, "reveal.qmp"))
        status, target = self.agent.request("POST", "/v1/migrations",
                                            {"role": "target", "qmpSocket": q.path, "id": "m-exists"})
        self.assertEqual(status, 201, target)
        try:
            unknown = self.hello(migrationId="m-does-not-exist")
            wrong_token = self.hello(migrationId="m-exists")
            data_unknown = self.hello(migrationId="m-exists", kind="data", session="ab" * 16, index=0)
            print("\n[hostile-http] refusals: %s" % json.dumps([unknown, wrong_token, data_unknown]), file=sys.stderr)
            self.assertEqual(unknown, wrong_token, "an unknown id and a wrong token must read the same")
            self.assertEqual(unknown, data_unknown)
            self.assertEqual(unknown["type"], "reject")
            self.assertNotIn("m-does-not-exist", json.dumps(unknown))
            self.assertNotIn("m-exists", json.dumps(wrong_token))
            # The real source can still use the token: a refused hello does not consume it.
            st = self.agent.get("m-exists")
            self.assertIn(st["phase"], ("Pending", "Connecting"), st)
        finally:
            self.agent.cancel("m-exists")
            q.close()

    def test_a_data_channel_must_prove_the_sessions_key_not_just_name_the_session(self):
        # Issue 38: the session value went to the source in clear in the target's welcome, and a
        # data hello naming it was welcomed from anyone who saw it on the data-plane network.
        q = FakeIncomingQemu(os.path.join(self.tmp, "channel-proof.qmp"))
        status, target = self.agent.request("POST", "/v1/migrations", {
            "role": "target", "qmpSocket": q.path, "chunkSize": "1Mi", "ringDepth": 16})
        self.assertEqual(status, 201, target)
        auth_errors = ("rdmig_transport_errors_total", frozenset({("transport", "tcp"), ("kind", "auth")}))
        before = parse_prometheus(self.agent.metrics())[0].get(auth_errors, 0)
        ctl = socket.create_connection(("127.0.0.1", self.agent.data_port), timeout=10)
        held = []
        try:
            hello = {"type": "hello", "protocol": PROTOCOL, "migrationId": target["id"], "channels": 1,
                     "chunkSize": 1 << 20, "ringDepth": 16, "transport": "tcp"}
            welcome = control_hello(ctl, dict(hello, kind="control"), target["token"])
            self.assertEqual(welcome["type"], "welcome", welcome)
            seen = dict(hello, kind="data", session=welcome["session"], index=0)  # all of it on the wire
            # A third party without the token: the key is a guess, and nothing is admitted.
            for guess in ("00" * 32, wireproof.channel_key("not-the-token", welcome["sourceNonce"],
                                                           welcome["challengeNonce"], welcome["session"])):
                s, answer = wireproof.open_channel(self.agent.data_port, seen, guess)
                held.append(s)
                self.assertIsNotNone(answer)
                self.assertEqual((answer["type"], answer.get("code")), ("reject", "permission_denied"), answer)
                self.assertIn("auth.proof", answer["message"])
            # The token holder's channel 0 is still free and attaches.
            key = channel_key_of(welcome, target["token"])
            data, ok = wireproof.open_channel(self.agent.data_port, seen, key)
            held.append(data)
            self.assertEqual(ok["type"], "welcome", ok)
            # Its proof seen on the wire, replayed on another connection: refused for the proof.
            s, again = wireproof.open_channel(self.agent.data_port, dict(seen, nonce=ok["nonce"]), key,
                                              proof=ok["sent"])
            held.append(s)
            self.assertEqual((again["type"], again.get("code")), ("reject", "permission_denied"), again)
            self.assertIn("auth.proof", again["message"])
            deadline = time.time() + 5  # counted once the reject is out: waited for, bounded
            while parse_prometheus(self.agent.metrics())[0].get(auth_errors, 0) - before < 3 and time.time() < deadline:
                time.sleep(0.05)
            self.assertEqual(parse_prometheus(self.agent.metrics())[0].get(auth_errors, 0) - before, 3.0,
                             "each refused channel counted")
            self.assertIn(self.agent.get(target["id"])["phase"], ("Pending", "Connecting"))
        finally:
            for s in held:
                s.close()
            ctl.close()
            self.agent.cancel(target["id"])
            q.close()

    # ---- cancel ends every handshake stage at once ----

    def create_source(self, qmp, peer, **extra):
        """A source job on the agent towards the fake target agent `peer`."""
        status, src = self.agent.request("POST", "/v1/migrations", dict({
            "role": "source", "qmpSocket": qmp.path,
            "target": {"endpoint": "127.0.0.1:%d" % peer.port, "migrationId": "m-far", "token": "t" * 32}}, **extra))
        self.assertEqual(status, 201, src)
        return src

    def assertCancelsWithinASecond(self, mid, stage, reached=lambda: True):
        # `reached`: the job is inside the stalled step (the peer saw the message before it).
        deadline = time.time() + 10
        while not reached() and time.time() < deadline:
            time.sleep(0.02)
        self.assertTrue(reached(), "the job never reached the step under test")
        st = self.agent.get(mid)
        self.assertIn(st["phase"], ("Pending", "Connecting"), st)
        t0 = time.monotonic()
        self.agent.cancel(mid)
        st = self.agent.wait(mid, timeout=60, interval=0.02)
        took = time.monotonic() - t0
        print("\n[hostile-http] cancel while %s: %s after %.3f s (%s)" % (stage, st["phase"], took,
                                                                        st["result"]["reason"]), file=sys.stderr)
        self.assertEqual(st["phase"], "Cancelled", st)
        # The stalled step's own timeout is 30 s; a cancel must not wait it out.
        self.assertLess(took, 1.0, "cancel while %s took %.1f s" % (stage, took))

    def test_cancel_ends_a_source_waiting_for_the_targets_welcome(self):
        q = FakeRunningQemu(os.path.join(self.tmp, "cancel-src-hello.qmp"))
        peer = StallingTargetAgent("hello")
        try:
            src = self.create_source(q, peer)
            self.assertCancelsWithinASecond(src["id"], "the source waits for the target's welcome",
                                            lambda: "control" in peer.seen)
        finally:
            peer.close()
            q.close()

    def test_cancel_ends_a_source_waiting_for_the_target_qemu_to_listen(self):
        q = FakeRunningQemu(os.path.join(self.tmp, "cancel-src-ready.qmp"))
        peer = StallingTargetAgent("ready")
        try:
            src = self.create_source(q, peer)
            self.assertCancelsWithinASecond(src["id"], "the source waits for 'ready'", lambda: "start" in peer.seen)
            # The one-time token never crossed the wire: the source proved it instead.
            sent = json.dumps(peer.frames)
            self.assertNotIn("t" * 32, sent)
            self.assertIn(control_proof("t" * 32, "cd" * 16, "m-far", peer.frames[0]["nonce"]), sent)
        finally:
            peer.close()
            q.close()

    def test_verify_chunks_needs_a_target_that_confirms_it(self):
        # A target agent from before verifyChunks ignores the hello's field and would hand the CRC
        # trailers to its QEMU as stream data: the source stops at the welcome, naming why, and
        # never starts QEMU's migration.
        q = FakeRunningQemu(os.path.join(self.tmp, "verify-old-target.qmp"))
        peer = StallingTargetAgent("ready")  # its welcome has no verifyChunks
        try:
            src = self.create_source(q, peer, verifyChunks=True)
            st = self.agent.wait(src["id"], timeout=30)
            self.assertEqual(st["phase"], "Failed", st)
            self.assertIn("did not confirm verifyChunks", st["result"]["reason"])
            self.assertTrue(st["verifyChunks"])
            self.assertEqual(peer.frames[0].get("verifyChunks"), True, peer.frames[0])
            self.assertNotIn("start", peer.seen)
        finally:
            peer.close()
            q.close()

    def test_cancel_ends_a_target_waiting_for_the_sources_start(self):
        q = FakeIncomingQemu(os.path.join(self.tmp, "cancel-dst-start.qmp"))
        status, target = self.agent.request("POST", "/v1/migrations", {
            "role": "target", "qmpSocket": q.path, "chunkSize": "1Mi", "ringDepth": 16})
        self.assertEqual(status, 201, target)
        source = FakeSource(self.agent, target, 1 << 20, 16, start=False)
        try:
            # Both connections are in; the target now waits for the source's 'start', which never comes.
            self.assertCancelsWithinASecond(target["id"], "the target waits for the source's 'start'")
        finally:
            source.close()
            q.close()

    # ---- only the right QEMU reaches a migration socket ----

    def test_source_migration_socket_refuses_a_process_other_than_the_jobs_qemu(self):
        # The QMP stand-in runs in this test process, so this process is "the QEMU behind
        # qmpSocket" (SO_PEERCRED pid); a child process plays another local process that reached
        # the migration socket first.
        import subprocess
        q = FakeRunningQemu(os.path.join(self.tmp, "peercred-src.qmp"))
        peer = StallingTargetAgent("full")
        try:
            src = self.create_source(q, peer)
            path = os.path.join(self.agent.state_dir, src["id"] + ".src.sock")
            deadline = time.time() + 10
            while not os.path.exists(path) and time.time() < deadline:
                time.sleep(0.05)
            self.assertTrue(os.path.exists(path), self.agent.get(src["id"]))
            self.assertEqual(os.stat(self.agent.state_dir).st_mode & 0o777, 0o700)
            probe = ("import socket,sys\n"
                     "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.settimeout(3)\n"
                     "try:\n  s.sendall(b'QEVM' + b'\\0' * 4092)\n"
                     "except OSError:\n  print('closed'); sys.exit(0)\n"  # refused before it wrote
                     "try:\n  print('closed' if s.recv(1) == b'' else 'data')\n"
                     "except socket.timeout:\n  print('open')\n"
                     "except OSError:\n  print('closed')\n")
            other = subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True, timeout=30)
            print("\n[hostile-http] another process on the source migration socket: %s" % other.stdout.strip(),
                  file=sys.stderr)
            self.assertEqual(other.stdout.strip(), "closed", other.stderr)
            # The job's own QEMU (this process) is still accepted afterwards.
            own = socket.socket(socket.AF_UNIX)
            own.connect(path)
            own.settimeout(1.0)
            try:
                own.recv(1)
                self.fail("the job's QEMU was refused")
            except socket.timeout:
                pass
            finally:
                own.close()
            self.assertIn('kind="foreign_peer"', self.agent.metrics())
            self.assertIn(self.agent.get(src["id"])["phase"], ("Migrating", "Connecting"))
        finally:
            self.agent.cancel(src["id"])
            self.agent.wait(src["id"], timeout=60)
            peer.close()
            q.close()

    def test_target_refuses_a_migration_socket_served_by_another_process(self):
        # The incoming QEMU's socket is served by a child process, not by the process behind
        # qmpSocket (this one): the target must not stream the VM into it.
        import subprocess
        children = []

        class InterloperIncomingQemu(FakeIncomingQemu):
            def answer(self, cmd):
                if cmd.get("execute") == "migrate-incoming":
                    path = cmd["arguments"]["uri"][len("unix:"):]
                    children.append(subprocess.Popen(
                        [sys.executable, "-c", "import socket,sys,time\n"
                         "s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n"
                         "c=[s.accept() for _ in range(8)]", path]))
                    deadline = time.time() + 10  # listening before 'ready'
                    while not os.path.exists(path) and time.time() < deadline:
                        time.sleep(0.02)
                return super().answer(cmd)

        q = InterloperIncomingQemu(os.path.join(self.tmp, "peercred-dst.qmp"))
        status, target = self.agent.request("POST", "/v1/migrations", {
            "role": "target", "qmpSocket": q.path, "chunkSize": "1Mi", "ringDepth": 16})
        self.assertEqual(status, 201, target)
        source = FakeSource(self.agent, target, 1 << 20, 16)
        try:
            source.send_chunk()  # the target connects to "QEMU" on the first chunk
            st = self.agent.wait(target["id"], timeout=30)
            print("\n[hostile-http] target with a foreign incoming socket: %s (%s)"
                  % (st["phase"], st["result"]["reason"]), file=sys.stderr)
            self.assertEqual(st["phase"], "Failed", st)
            self.assertIn("not the QEMU behind qmpSocket", st["result"]["reason"])
        finally:
            source.close()
            q.close()
            for ch in children:
                ch.kill()

    # ---- only QMP sockets under the configured roots ----

    def test_qmp_sockets_outside_the_roots_are_refused_after_resolving_symlinks(self):
        outside_dir = tempfile.mkdtemp(prefix="rdmig-outside-", dir="/run")  # not under /tmp, the harness's root
        inside_link = os.path.join(self.tmp, "link-out.qmp")
        try:
            outside = FakeRunningQemu(os.path.join(outside_dir, "q.sock"))
            os.symlink(outside.path, inside_link)
            dir_link = os.path.join(self.tmp, "dir-out")
            os.symlink(outside_dir, dir_link)
            cases = [
                (outside.path, 403, ["not under an allowed directory", "migration.qmpSocketRoots"]),
                (inside_link, 403, ["resolves to '%s'" % outside.path]),
                (os.path.join(dir_link, "q.sock"), 403, ["resolves to"]),
                (self.tmp + "/../.." + outside.path, 403, ["resolves to"]),
                ("/proc/self/root" + outside.path, 403, ["/proc"]),
                ("/proc/1/root/tmp/x.sock", 403, ["/proc"]),
                (os.path.join(self.tmp, "does-not-exist.qmp"), 409, ["cannot talk to QEMU"]),
            ]
            for path, want, words in cases:
                status, body = self.agent.request("POST", "/v1/migrations", {
                    "role": "source", "qmpSocket": path,
                    "target": {"endpoint": "127.0.0.1:1", "migrationId": "m-x", "token": "t" * 32}})
                msg = self.assertError(status, body, want, "qmpSocket", *words)
                print("\n[hostile-http] qmpSocket %s -> %d %s" % (path, status, msg), file=sys.stderr)
            outside.close()
        finally:
            shutil.rmtree(outside_dir, ignore_errors=True)

    def test_a_rotated_token_is_used_without_a_restart_and_the_old_one_expires(self):
        tmp = tempfile.mkdtemp(prefix="rdmig-rotate-")
        agent = Agent(tmp, "rotate", config={"api": {"tokenGraceSeconds": 2}})
        try:
            old, new = agent.token, "tok-rotated-" + os.urandom(12).hex()

            def status_with(token):
                return agent.request("GET", "/v1/migrations", token=token)[0]
            self.assertEqual(status_with(old), 200)
            self.assertEqual(status_with(new), 403)
            # As a Secret volume does: a new file, then an atomic rename over the old one.
            with open(agent.token_file + ".new", "w") as f:
                f.write(new + "\n")
            os.rename(agent.token_file + ".new", agent.token_file)
            deadline = time.time() + 5
            while status_with(new) != 200 and time.time() < deadline:
                time.sleep(0.1)
            took = 5 - (deadline - time.time())
            self.assertEqual(status_with(new), 200, "the rotated token was not picked up")
            self.assertEqual(status_with(old), 200, "the previous token must still work during the grace period")
            deadline = time.time() + 10
            while status_with(old) != 403 and time.time() < deadline:
                time.sleep(0.1)
            self.assertEqual(status_with(old), 403, "the previous token must expire after tokenGraceSeconds")
            # A broken replacement (too short) is refused; the agent keeps the token it has.
            with open(agent.token_file + ".new", "w") as f:
                f.write("short\n")
            os.rename(agent.token_file + ".new", agent.token_file)
            time.sleep(1.5)  # past the once-a-second look at the file
            self.assertEqual(status_with(new), 200)
            self.assertEqual(status_with("short"), 403)
            self.assertIn("must be at least 16 characters", agent.log_text())
            print("\n[hostile-http] rotated token used after %.1f s; old one refused after the grace" % took,
                  file=sys.stderr)
        finally:
            agent.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- an allocation failure fails the migration, never the agent ----

    def test_out_of_memory_for_chunk_buffers_fails_the_migration_not_the_agent(self):
        # An agent whose address space is capped (RLIMIT_AS) takes a target with 1 GiB chunks
        # (within its bufferBudget): the first chunk's buffer cannot be had. Before, the failed
        # allocation threw on a channel thread and aborted the whole agent.
        tmp = tempfile.mkdtemp(prefix="rdmig-oom-")
        wrapper = os.path.join(tmp, "capped-agent")
        # A fresh agent's own address space (the shared agent's has grown by then: malloc arenas
        # of the threads of every test before, enough to leave room for two buffers).
        sizer = Agent(tmp, "oom-size")
        try:
            with open("/proc/%d/status" % sizer.proc.pid) as f:
                vm_kib = int([line for line in f if line.startswith("VmSize:")][0].split()[1])
        finally:
            sizer.stop()
        cap = (vm_kib << 10) + (1536 << 20)  # room for one 1 GiB buffer, not two
        with open(wrapper, "w") as f:
            f.write("#!/bin/sh\nexec prlimit --as=%d -- %s \"$@\"\n" % (cap, self.agent.binary))
        os.chmod(wrapper, 0o755)
        agent = Agent(tmp, "oom", binary=wrapper, config={"migration": {"bufferBudget": "8Gi"}})
        children = []

        class ListeningIncomingQemu(FakeIncomingQemu):
            """Listens on the migration socket itself (so it is the QEMU behind the QMP socket)
            and never reads what arrives."""
            def answer(self, cmd):
                if cmd.get("execute") == "migrate-incoming":
                    srv = socket.socket(socket.AF_UNIX)
                    srv.bind(cmd["arguments"]["uri"][len("unix:"):])
                    srv.listen(8)
                    children.append(srv)
                return super().answer(cmd)

        q = ListeningIncomingQemu(os.path.join(tmp, "oom.qmp"))
        source = None
        try:
            status, target = agent.request("POST", "/v1/migrations", {
                "role": "target", "qmpSocket": q.path, "chunkSize": "1Gi", "ringDepth": 2})
            self.assertEqual(status, 201, target)
            source = FakeSource(agent, target, 1 << 30, 2)
            for _ in range(2):  # each DATA frame takes a chunk buffer (1 GiB) on the target
                source.send_chunk()
            st = agent.wait(target["id"], timeout=30)
            print("\n[hostile-http] 1 GiB chunks under a %d MiB address-space cap: %s (%s)"
                  % (cap >> 20, st["phase"], st["result"]["reason"]), file=sys.stderr)
            self.assertTrue(agent.alive(), "the agent died")
            self.assertEqual(st["phase"], "Failed", st)
            self.assertIn("out of memory", st["result"]["reason"])
            self.assertEqual(agent.request("GET", "/v1/migrations")[0], 200)
        finally:
            if source:
                source.close()
            q.close()
            for srv in children:
                srv.close()
            agent.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- admission ----

    def test_a_misbehaving_qmp_peer_at_create_gets_409_or_504_naming_qemu(self):
        # The QMP socket's peer is the VM's QEMU, not the agent: a QEMU that hangs up, says
        # garbage or answers nonsense cannot be migrated (409), one that says nothing is a gateway
        # timeout (504), never 500 (the agent's own fault) nor 503 (documented as "shutting
        # down"; before, a source whose QEMU answered query-status without a status got 500).
        class Peer:
            def __init__(self, path, behaviour):
                self.path, self.behaviour = path, behaviour
                self.srv = socket.socket(socket.AF_UNIX)
                self.srv.bind(path)
                self.srv.listen(8)
                self.held = []
                threading.Thread(target=self.serve, daemon=True).start()

            def serve(self):
                while True:
                    try:
                        c, _ = self.srv.accept()
                    except OSError:
                        return
                    try:
                        if self.behaviour == "silent":
                            self.held.append(c)
                            continue
                        if self.behaviour == "garbage":
                            c.sendall(b"\x00\xffnot QMP at all\n")
                        elif self.behaviour in ("bad-status", "status-not-text", "silent-after-greeting"):
                            c.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n')
                            f = c.makefile("rb")
                            for line in f:
                                cmd = json.loads(line)
                                if cmd.get("execute") == "query-status":
                                    if self.behaviour == "silent-after-greeting":
                                        self.held.append(c)
                                        break
                                    ret = {"weird": 1} if self.behaviour == "bad-status" else {"status": 7}
                                else:
                                    ret = {}
                                c.sendall(json.dumps({"return": ret, "id": cmd.get("id")}).encode() + b"\n")
                            if c in self.held:
                                continue
                        c.close()
                    except (OSError, ValueError):
                        c.close()

            def close(self):
                self.srv.close()
                for c in self.held:
                    c.close()

        # Two at a time (the agent's migration.maxConcurrent: a create holds a slot during its QMP
        # checks and frees it before it answers), so the four silent ones wait out the agent's QMP
        # timeout two by two, not one after another.
        cases = [(behaviour, want, role)
                 for behaviour, want in (("closing", 409), ("garbage", 409), ("bad-status", 409),
                                         ("status-not-text", 409), ("silent", 504), ("silent-after-greeting", 504))
                 for role in ("target", "source")]
        peers = {(b, r): Peer(os.path.join(self.tmp, "%s-%s.qmp" % (b, r)), b) for b, _, r in cases}
        seen = {}

        def create(behaviour, role):
            body = {"role": role, "qmpSocket": peers[(behaviour, role)].path}
            if role == "source":
                body["target"] = {"endpoint": "127.0.0.1:9", "migrationId": "m-x", "token": "t" * 32}
            try:
                seen[(behaviour, role)] = self.agent.request("POST", "/v1/migrations", body, timeout=60)
            except Exception as e:  # noqa: BLE001 - reported below, per case
                seen[(behaviour, role)] = (None, repr(e))
        def lane(part):
            for b, _, r in part:
                create(b, r)
        try:
            threads = [threading.Thread(target=lane, args=(cases[i::2],)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        finally:
            for p in peers.values():
                p.close()
        for behaviour, want, role in cases:
            status, parsed = seen.get((behaviour, role), (None, "no answer within 120 s"))
            self.assertNotIn(status, (500, 503), "%s QEMU, %s: %s" % (behaviour, role, parsed))
            msg = self.assertError(status, parsed, want)
            self.assertTrue("QMP" in msg or "QEMU" in msg, msg)

    def test_buffer_budget_refuses_what_can_never_fit_with_422_naming_the_figures(self):
        body = {"role": "target", "qmpSocket": "/tmp/none.sock", "chunkSize": "64Mi", "ringDepth": 16}
        status, parsed = self.agent.request("POST", "/v1/migrations", body)
        self.assertError(status, parsed, 422, "chunkSize 64Mi", "ringDepth 16", "budget 256Mi", "migration.bufferBudget")

    def test_concurrent_creates_never_exceed_max_concurrent_or_the_budget(self):
        # Eight targets at once against maxConcurrent 2, each QEMU slow to greet (0.5 s), so all
        # eight requests are inside their QMP checks together. Checked outside the lock, every
        # one of them was admitted.
        qemus = [FakeIncomingQemu(os.path.join(self.tmp, "race-%d.qmp" % i), delay=0.5) for i in range(8)]
        results = [None] * 8

        def create(i):
            results[i] = self.agent.request("POST", "/v1/migrations",
                                            {"role": "target", "qmpSocket": qemus[i].path, "chunkSize": "1Mi",
                                             "ringDepth": 16})
        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        statuses = sorted(r[0] for r in results)
        print("\n[hostile-http] 8 concurrent creates, maxConcurrent 2: %s" % statuses, file=sys.stderr)
        created = [r[1]["id"] for r in results if r[0] == 201]
        try:
            self.assertEqual(len(created), 2, results)
            for status, parsed in results:
                if status != 201:
                    self.assertError(status, parsed, 429, "maxConcurrent")
            # One slot freed, one still held (32 MiB): a migration that alone fits the budget
            # (2Mi x 16 x 4 channels x 2 = 256 MiB) does not fit beside it: 429, retry later.
            self.agent.cancel(created[0])
            self.agent.wait(created[0], timeout=30)
            q = FakeIncomingQemu(os.path.join(self.tmp, "budget.qmp"))
            status, parsed = self.agent.request("POST", "/v1/migrations",
                                                {"role": "target", "qmpSocket": q.path, "chunkSize": "2Mi",
                                                 "ringDepth": 16, "multifdChannels": 3})
            self.assertError(status, parsed, 429, "held by running migrations", "migration.bufferBudget")
            q.close()
        finally:
            for mid in created:
                try:
                    self.agent.cancel(mid)
                except Exception:  # noqa: BLE001 - best effort
                    pass
            for q in qemus:
                q.close()


# ---- the dial policy (issue 38): what a token holder can make a source agent dial ----

def refused_endpoints(port):
    """target.endpoint values the dial policy refuses on an agent that is no lab, each with a word
    its 400 must say. In a LoopbackNetns holding 169.254.169.254, every one a connect() could
    reach lands on the test's listener on `port`; every other SYN is counted there."""
    return [(ep % port, word) for ep, word in [
        ("169.254.169.254:%d", "link-local"),
        ("[::ffff:169.254.169.254]:%d", "IPv4-mapped"),
        ("[::ffff:a9fe:a9fe]:%d", "IPv4-mapped"),
        ("[::ffff:0:169.254.169.254]:%d", "IPv4-translated"),
        ("[::169.254.169.254]:%d", "IPv4-compatible"),
        ("[64:ff9b::169.254.169.254]:%d", "NAT64"),
        ("[2002:a9fe:a9fe::1]:%d", "6to4"),
        ("0.0.0.0:%d", "unspecified"),
        ("0.1.2.3:%d", "0.0.0.0/8"),
        ("[::]:%d", "unspecified"),
        ("[::ffff:0.0.0.0]:%d", "unspecified"),
        ("127.0.0.1:%d", "dataPlane.allowLoopbackPeers"),
        ("127.0.0.2:%d", "dataPlane.allowLoopbackPeers"),
        ("[::1]:%d", "dataPlane.allowLoopbackPeers"),
        ("[::ffff:127.0.0.1]:%d", "dataPlane.allowLoopbackPeers"),
        ("localhost:%d", "not an IP address literal"),
        ("224.0.0.1:%d", "multicast"),
        ("255.255.255.255:%d", "broadcast"),
        ("[ff02::1]:%d", "multicast"),
        ("[fe80::1]:%d", "link-local"),
    ]]


class DialPolicyNamespace:
    """A no-lab agent (dataPlane.allowLoopbackPeers false) alone in a network namespace of its
    own that holds only loopback, 169.254.169.254 and 192.0.2.1 (the control: an address the
    policy allows), a dual-stack listener of the test on a free port P, and a counter of every
    SYN sent to P from inside the namespace, whatever its address."""

    def __init__(self, tmp, name):
        self.ns = LoopbackNetns(addresses=["169.254.169.254", "192.0.2.1"])
        self.agent = None
        try:
            self.listener = self.ns.run(LoopbackNetns.listen)
            self.port = self.listener.getsockname()[1]
            self.ns.count_syns(self.port)
            self.agent = NetnsAgent(self.ns, tmp, name, config={"dataPlane": {"allowLoopbackPeers": False}})
        except BaseException:
            self.close()
            raise

    def accepted(self, timeout):
        """A connection that reached the listener within `timeout` s, else None."""
        import select
        ready, _, _ = select.select([self.listener], [], [], timeout)
        return self.listener.accept()[0] if ready else None

    def assert_refused_without_dialling(self, test, post):
        """POSTs every refused endpoint with post(endpoint) -> (status, body): each is a 400 naming
        target.endpoint and its rule, and no SYN went to P (nor did anything reach the listener).
        Then the control: 192.0.2.1:P is created (201) and dialled. Returns the control's body."""
        answers = [(ep, word) + tuple(post(ep)) for ep, word in refused_endpoints(self.port)]
        syns = self.ns.syn_count(self.port)
        print("\n[dial-policy] %d endpoints: %s; SYNs to port %d: %d"
              % (len(answers), ", ".join(sorted({str(a[2]) for a in answers})), self.port, syns), file=sys.stderr)
        for ep, word, status, body in answers:
            test.assertEqual(status, 400, (ep, body))
            msg = body["error"]["message"]
            test.assertTrue(msg.startswith("target.endpoint: "), (ep, msg))
            test.assertIn(word, msg, ep)
            test.assertIn("dial policy", msg, ep)
        test.assertEqual(syns, 0, "the agent tried to connect to a refused endpoint")
        test.assertIsNone(self.accepted(0), "a refused endpoint reached the listener")
        # The control: the same agent, an allowed address the namespace holds: the listener sees
        # the agent's dial and the counter counts it (so a dial would have been seen above).
        status, body = post("192.0.2.1:%d" % self.port)
        test.assertEqual(status, 201, body)
        conn = self.accepted(10)
        test.assertIsNotNone(conn, "the control endpoint was not dialled")
        conn.close()
        test.assertGreaterEqual(self.ns.syn_count(self.port), 1)
        return body

    def close(self):
        if self.agent:
            self.agent.stop()
        self.ns.close()


class DialPolicyMigrationTest(unittest.TestCase):
    """POST /v1/migrations role source names a target.endpoint the agent then dials from its host
    network: the dial policy refuses what is not a peer agent's address with 400 before anything
    is connected (issue 38, item 2)."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="rdmig-dial-")
        self.world = DialPolicyNamespace(self.tmp, "no-lab")

    def tearDown(self):
        self.world.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_a_source_migration_never_dials_what_the_dial_policy_refuses(self):
        agent = self.world.agent
        q = FakeRunningQemu(os.path.join(self.tmp, "dial.qmp"))
        try:
            def post(ep):
                return agent.request("POST", "/v1/migrations", {
                    "role": "source", "qmpSocket": q.path,
                    "target": {"endpoint": ep, "migrationId": "m-" + os.urandom(4).hex(), "token": "t" * 32}})
            control = self.world.assert_refused_without_dialling(self, post)
            agent.cancel(control["id"])
            self.assertIn(agent.wait(control["id"], timeout=30)["phase"], ("Cancelled", "Failed"))
            self.assertEqual(agent.call("GET", "/v1/migrations")["items"][0]["id"], control["id"],
                             "the refused requests created nothing")
            self.assertEqual(len(agent.call("GET", "/v1/migrations")["items"]), 1)
        finally:
            q.close()


if __name__ == "__main__":
    timed.main()
