"""Minimal synchronous QMP client (stdlib only).

QMP messages are newline-terminated JSON objects. Replies to commands carry the "id" we
sent; asynchronous events ({"event": ..., "timestamp": {...}}) arriving in between are
buffered in ``QmpClient.events`` in arrival order.
"""
import json
import os
import socket
import time


class QmpError(Exception):
    """A QMP command answered with {"error": {...}}."""

    def __init__(self, command, error):
        self.command = command
        self.error = error
        super().__init__("%s: %s: %s" % (command, error.get("class"), error.get("desc")))


def event_time(event):
    """Seconds since the epoch (float) of a QMP event's timestamp."""
    ts = event["timestamp"]
    return ts["seconds"] + ts["microseconds"] / 1e6


class QmpClient:
    def __init__(self, path, timeout=30.0, alive=None):
        """Connects to the QMP unix socket at ``path``, retrying until ``timeout`` seconds
        have passed (QEMU creates the socket a moment after it starts). ``alive`` is an
        optional callable; when it returns False the wait is abandoned early."""
        self.path = path
        self.events = []
        self.greeting = None
        self._buf = b""
        self._next_id = 1
        deadline = time.monotonic() + timeout
        last_err = None
        while True:
            if alive is not None and not alive():
                raise ConnectionError("QEMU exited before its QMP socket %s came up" % path)
            if os.path.exists(path):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(path)
                    self.sock = s
                    break
                except OSError as e:
                    s.close()
                    last_err = e
            if time.monotonic() > deadline:
                raise TimeoutError("QMP socket %s not connectable within %.0fs (%s)"
                                   % (path, timeout, last_err))
            time.sleep(0.02)
        # QEMU 7.2 can queue an event (a RESUME seen in a test run) on a fresh connection ahead
        # of the greeting: keep such events, in order, and wait for the greeting itself.
        while True:
            msg = self._read_message(deadline)
            if "QMP" in msg:
                self.greeting = msg
                break
            if "event" not in msg:
                raise ConnectionError("unexpected QMP greeting: %r" % (msg,))
            self.events.append(msg)
        self.command("qmp_capabilities", timeout=max(1.0, deadline - time.monotonic()))

    # -- low level ---------------------------------------------------------------------
    def _read_message(self, deadline):
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no QMP message from %s before the deadline" % self.path)
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                raise ConnectionError("QMP connection %s closed" % self.path)
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        line = line.strip()
        if not line:
            return self._read_message(deadline)
        return json.loads(line)

    # -- commands ----------------------------------------------------------------------
    def command(self, name, args=None, timeout=60.0):
        """Runs QMP command ``name`` and returns its "return" value; raises QmpError."""
        cid = self._next_id
        self._next_id += 1
        msg = {"execute": name, "id": cid}
        if args:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read_message(deadline)
            if "event" in m:
                self.events.append(m)
                continue
            if m.get("id") != cid:
                continue  # a late reply to an earlier, timed-out command
            if "error" in m:
                raise QmpError(name, m["error"])
            return m.get("return")

    # -- events ------------------------------------------------------------------------
    def poll_events(self, timeout=0.0):
        """Reads whatever events arrive within ``timeout`` seconds into ``events``."""
        deadline = time.monotonic() + timeout
        first = True
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.strip():
                    m = json.loads(line)
                    if "event" in m:
                        self.events.append(m)
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not first:
                return
            first = False
            self.sock.settimeout(max(remaining, 0.001))
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                return
            if not chunk:
                raise ConnectionError("QMP connection %s closed" % self.path)
            self._buf += chunk

    def find_events(self, name, pred=None):
        return [e for e in self.events
                if e.get("event") == name and (pred is None or pred(e))]

    def wait_event(self, name, timeout, pred=None):
        """Returns the first buffered or newly arriving event ``name`` (matching ``pred``)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.find_events(name, pred)
            if found:
                return found[0]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("QMP event %s not seen within %.1fs" % (name, timeout))
            self.poll_events(min(remaining, 0.5))

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
