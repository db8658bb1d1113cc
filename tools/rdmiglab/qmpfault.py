"""A QMP stand-in in front of a real QEMU monitor, for fault injection.

QmpFaultProxy listens on a unix socket (give its path to the agent as qmpSocket), opens one
connection to the real QEMU monitor per client and copies lines both ways, except what the
fault says to hold back. The fault implemented: once QEMU has announced one of ``trigger``
states in a MIGRATION event (e.g. "device": the final stop-and-copy has begun), replies to the
commands in ``stall`` (e.g. query-migrate) are never delivered, the way a QEMU whose monitor
stalls during completion looks to its client. Everything else (other replies, events) flows.

A second fault, ``drop=True``: once triggered, the connection is closed both ways, the way
a monitor lost at that moment looks (QEMU itself goes on). ``on_trigger`` is called once, in
the proxy's thread, as the trigger is seen (e.g. to freeze another process at that moment).

Reusable from any test: ``with QmpFaultProxy(path, upstream, stall={"query-migrate"}) as p``;
``p.swallowed`` lists the commands whose replies were held back, ``p.triggered`` says whether
the trigger was seen.
"""
import json
import os
import socket
import threading


def _shut_both(*socks):
    """Ends both directions of a proxied pair: the other copier sees EOF and stops too."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class QmpFaultProxy:
    def __init__(self, path, upstream, stall=("query-migrate",), trigger=("device", "completed"), drop=False,
                 on_trigger=None):
        self.path, self.upstream = path, upstream
        self.stall, self.trigger = set(stall), set(trigger)
        self.drop, self.on_trigger = drop, on_trigger
        self.swallowed = []
        self.triggered = False
        self._lock = threading.Lock()
        self._socks = []
        if os.path.exists(path):
            os.unlink(path)
        self._srv = socket.socket(socket.AF_UNIX)
        self._srv.bind(path)
        self._srv.listen(4)
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for s in [self._srv] + self._socks:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self):
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX)
            try:
                up.connect(self.upstream)
            except OSError:
                client.close()
                continue
            self._socks += [client, up]
            pending = {}  # command id -> name, for the replies
            threading.Thread(target=self._down, args=(client, up, pending), daemon=True).start()
            threading.Thread(target=self._up, args=(up, client, pending), daemon=True).start()

    def _down(self, client, up, pending):
        """client -> QEMU: remembers which command each id is."""
        try:
            for line in client.makefile("rb"):
                try:
                    msg = json.loads(line)
                    if isinstance(msg, dict) and "id" in msg:
                        with self._lock:
                            pending[json.dumps(msg["id"])] = msg.get("execute")
                except ValueError:
                    pass
                up.sendall(line)
        except OSError:
            pass
        finally:
            _shut_both(up, client)

    def _up(self, up, client, pending):
        """QEMU -> client: holds back replies to stalled commands once triggered."""
        try:
            for line in up.makefile("rb"):
                try:
                    msg = json.loads(line)
                except ValueError:
                    msg = None
                if isinstance(msg, dict):
                    if msg.get("event") == "MIGRATION" and msg.get("data", {}).get("status") in self.trigger:
                        first = not self.triggered
                        self.triggered = True
                        if first and self.on_trigger:
                            self.on_trigger()
                        if self.drop:
                            break  # the finally below closes both ends: the monitor is lost
                    if "id" in msg:
                        with self._lock:
                            name = pending.pop(json.dumps(msg["id"]), None)
                        if self.triggered and name in self.stall:
                            self.swallowed.append(name)
                            continue
                client.sendall(line)
        except OSError:
            pass
        finally:
            _shut_both(up, client)
