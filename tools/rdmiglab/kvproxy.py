#!/usr/bin/env python3
"""Stand-in for KubeVirt's virt-handler migration proxy (pkg/virt-handler/migration-proxy).

Written from KubeVirt v1.9's behaviour, not its code:
  target  one TCP listener per class on [::]:0 (dual stack); each accepted connection is
          forwarded to a unix socket in the target launcher: class 0 to libvirt's socket,
          49152/49153 to <base>/migrationproxy/<uid>-<class>-source.sock. Ports are
          published ({"<port>": class}) to --ports-file once all listeners are up.
  source  one unix listener per published port in <base>/migrationproxy/: <uid>-source.sock
          (class 0) and <uid>-<class>-source.sock; each accepted connection becomes exactly
          one TCP (TLS unless --disable-tls) connection to the target address and port.
          Before reporting ready (--ready-file) it calls the PreMigrationSource node hook
          when --hook-socket is given.
Copying is plain both ways; on the first direction to end only the accepted leg is closed
(a TLS accepted leg sends close_notify first), as handleConnection's `defer fd.Close()`.
The dialed leg is closed once both directions have ended (Go leaves it to the GC).
Dial order (--dial-order), both roles alike:
  concurrent  (default) as KubeVirt: migrationProxy.Start's accept loop hands each accepted
              connection to `go m.handleConnection(fd)`, which dials (source: tls.Dial, TCP
              connect and handshake; target: net.Dial of the unix socket) and then copies;
              so dials of connections accepted close together race and their order at the
              next hop is not the accept order.
  shuffle     test only, harder than KubeVirt: connections accepted (on any listener) within
              --shuffle-window-ms (50) of a batch's first accept are connected one after
              another in a random order that is never the accept order for 2 or more (the
              source's TLS handshakes then run per connection, concurrently).
  accept      the old, kinder order: each listener dials before it accepts the next, so
              order survives the proxy (QEMU 7.2 takes the first memory connection as the
              main channel and fails "received packet magic 5145564d expected 11223344"
              when a multifd channel comes first).

Test-only: --hold-control (source) holds libvirt's control bytes towards the target once
the memory connections have started, until SIGUSR1: the source QEMU then stays paused
and alive after its part is done, so its memory can be read before libvirt stops it.

Every forwarded connection is logged on both legs (accept order, class, bytes, SHA-256 and first 16
bytes each way; on TCP legs of what crossed the wire, ciphertext with TLS) to --log as JSON,
rewritten whenever a connection ends and at exit. Order fields: per connection "index" =
"accept_index" (accept order over all listeners), "class_index" (accept order within its
class), "dial_index" / "class_dial_index" (order in which outbound connects returned; null if
none; with concurrent, connects that return close together may reach the next hop in another
order), "accepted_at", "dial_started_at", "dialed_at"; top level "dial_order",
"dial_sequence" (accept indices in dial order), "reordered" (dial_sequence differs from
accept order) and, with shuffle, "shuffle": {"window_ms", "seed", "batches": [{"accepted":
[index...], "dialed": [index...]}]}. The process names itself
"virt-handler" (/proc/<pid>/comm). SIGTERM/SIGINT stop it.

Run as: python3 -m rdmiglab.kvproxy {target,source} ... (PYTHONPATH=<repo>/tools)
"""
import argparse
import ctypes
import hashlib
import json
import os
import random
import signal
import socket
import ssl
import sys
import threading
import time

CHUNK = 256 * 1024
HEAD = 16
CLIENT_CN = "kubevirt.io:system:client:migration"
SERVER_CN = "kubevirt.io:system:node:virt-handler"


def set_comm(name):
    """prctl(PR_SET_NAME): /proc/<pid>/comm of the calling (main) thread; threads started
    afterwards inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME)")


def write_json_atomic(path, obj):
    tmp = "%s.tmp.%d.%d" % (path, os.getpid(), threading.get_ident())
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _addr(a):
    if isinstance(a, tuple):
        host = a[0][7:] if a[0].startswith("::ffff:") else a[0]
        return "%s:%d" % (host, a[1]) if ":" not in host else "[%s]:%d" % (host, a[1])
    return a or ""


class Leg:
    """One socket of a forwarded connection, metered on what crosses that socket."""

    def __init__(self, sock, kind):
        self.sock = sock
        self.kind = kind
        self.local = _addr(sock.getsockname())
        try:
            self.peer = _addr(sock.getpeername())
        except OSError:
            self.peer = ""
        self.rx_bytes = self.tx_bytes = 0
        self.rx_head = self.tx_head = b""  # first bytes each way (QEMU's channel magic)
        self._rx_sha = hashlib.sha256()
        self._tx_sha = hashlib.sha256()
        self._send_lock = threading.Lock()
        self.closed = False

    def _wire_recv(self, n):
        data = self.sock.recv(n)
        if data:
            self.rx_bytes += len(data)
            self._rx_sha.update(data)
            if len(self.rx_head) < HEAD:
                self.rx_head += data[:HEAD - len(self.rx_head)]
        return data

    def _wire_send(self, data):
        self.sock.sendall(data)
        self.tx_bytes += len(data)
        self._tx_sha.update(data)
        if len(self.tx_head) < HEAD:
            self.tx_head += data[:HEAD - len(self.tx_head)]

    def handshake(self):
        pass

    def recv(self, n):
        return self._wire_recv(n)

    def sendall(self, data):
        with self._send_lock:
            self._wire_send(data)

    def close_like_go(self):
        """What Go's Close on the accepted leg does: FIN to the peer and wake readers."""
        self.shutdown()

    def shutdown(self):
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def record(self):
        return {"kind": self.kind, "local": self.local, "peer": self.peer,
                "rx_bytes": self.rx_bytes, "tx_bytes": self.tx_bytes,
                "rx_sha256": self._rx_sha.hexdigest(), "tx_sha256": self._tx_sha.hexdigest(),
                "rx_head": self.rx_head.hex(), "tx_head": self.tx_head.hex()}


class TlsLeg(Leg):
    """TLS over memory BIOs, so the ciphertext that crosses the socket is what is metered."""

    def __init__(self, sock, ctx, server_side, peer_cn):
        super().__init__(sock, "tcp")
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=server_side)
        self.server_side = server_side
        self._ssl_lock = threading.Lock()  # SSL_read and SSL_write never run at once
        self._peer_cn = peer_cn
        self.peer_cn_seen = None

    def _flush(self):
        with self._send_lock:  # keeps ciphertext in the order the SSL object produced it
            with self._ssl_lock:
                data = self._out.read()
            if data:
                self._wire_send(data)

    def _fill(self):
        data = self._wire_recv(CHUNK)
        with self._ssl_lock:
            if data:
                self._in.write(data)
            else:
                self._in.write_eof()
        return bool(data)

    def handshake(self):
        while True:
            try:
                with self._ssl_lock:
                    self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionError("TLS handshake: peer closed")
        self._flush()
        cert = self._obj.getpeercert() or {}
        cn = [v for rdn in cert.get("subject", ()) for (k, v) in rdn if k == "commonName"]
        self.peer_cn_seen = cn[0] if cn else None
        if self.peer_cn_seen != self._peer_cn:
            raise ConnectionError("common name is invalid, got %s" % self.peer_cn_seen)

    def recv(self, n):
        eof = False
        while True:
            try:
                with self._ssl_lock:
                    return self._obj.read(n)
            except ssl.SSLWantReadError:
                if eof:
                    return b""
                self._flush()
                eof = not self._fill()  # at EOF the next read raises or wants more
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    def sendall(self, data):
        with self._send_lock:
            with self._ssl_lock:
                self._obj.write(data)
                out = self._out.read()
            self._wire_send(out)

    def close_like_go(self):
        if not self.closed:
            try:  # tls.Conn.Close: close_notify alert, then close
                with self._ssl_lock:
                    try:
                        self._obj.unwrap()
                    except (ssl.SSLWantReadError, ssl.SSLError):
                        pass
                self._flush()
            except OSError:
                pass
        self.shutdown()


class Proxy:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.connections = []
        self.listeners = []
        self.next_index = 0
        self.class_counts = {}
        self.live = []  # (record, accepted_leg)
        self.meta = {"role": args.role, "uid": args.uid, "pid": os.getpid(),
                     "tls": not args.disable_tls, "started_at": time.time(),
                     "dial_order": args.dial_order}
        self.next_dial_index = 0
        self.class_dial_counts = {}
        self.dial_sequence = []  # accept indices in the order their outbound legs connected
        # --dial-order shuffle: connections accepted within the window of the batch's first
        # accept (all listeners) are connected one after another in a random order that is
        # never the accept order (batches of 2 or more).
        self.rng = random.Random(args.shuffle_seed)
        self.batch = None  # [(rec, accepted, connect)] while a shuffle window is open
        self.batches = []  # {"accepted": [index...], "dialed": [index...]}
        if args.dial_order == "shuffle":
            self.meta["shuffle"] = {"window_ms": args.shuffle_window_ms, "seed": args.shuffle_seed}
        self.ctx = None
        # Test-only (--hold-control): once memory connections started, hold what libvirt
        # sends on the control connection (its Finish call) until SIGUSR1, so the source
        # QEMU stays paused and alive long enough for a memory digest.
        self.hold_armed = threading.Event()
        self.released = threading.Event()
        self.hold = {"held_s": 0.0, "held_chunks": 0} if args.hold_control else None
        if not args.disable_tls:
            server = args.role == "target"
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
            self.ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            self.ctx.check_hostname = False  # KubeVirt checks chain and CN, never the IP
            self.ctx.verify_mode = ssl.CERT_REQUIRED
            self.ctx.load_verify_locations(os.path.join(args.tls_dir, "ca.crt"))
            name = "server" if server else "client"
            self.ctx.load_cert_chain(os.path.join(args.tls_dir, name + ".crt"),
                                     os.path.join(args.tls_dir, name + ".key"))
            self.peer_cn = CLIENT_CN if server else SERVER_CN

    # -- log -----------------------------------------------------------------------------
    def write_log(self):
        with self.lock:
            conns = []
            for rec in self.connections:
                r = dict(rec)
                for leg in ("accepted", "dialed"):
                    if isinstance(r.get(leg), Leg):
                        r[leg] = r[leg].record()
                conns.append(r)
            doc = dict(self.meta, connections=conns, hold=self.hold and dict(self.hold),
                       open=sum(1 for r in self.connections if r["open"]),
                       dial_sequence=list(self.dial_sequence),
                       reordered=self.dial_sequence != sorted(self.dial_sequence))
            if self.args.dial_order == "shuffle":
                doc["shuffle"] = dict(self.meta["shuffle"], batches=[dict(b) for b in self.batches])
        times = os.times()
        doc["cpu_seconds"] = round(times.user + times.system, 3)
        write_json_atomic(self.args.log, doc)

    # -- forwarding ----------------------------------------------------------------------
    def _register(self, cls, accepted):
        with self.lock:
            rec = {"index": self.next_index, "class": cls,
                   "class_index": self.class_counts.get(cls, 0),
                   "accept_index": self.next_index, "dial_index": None, "class_dial_index": None,
                   "accepted": accepted, "dialed": None, "open": True, "error": None,
                   "first_end": None, "accepted_at": time.time(), "dial_started_at": None,
                   "dialed_at": None, "closed_at": None}
            self.next_index += 1
            self.class_counts[cls] = rec["class_index"] + 1
            self.connections.append(rec)
            self.live.append((rec, accepted))
            return rec

    def _finish(self, rec, accepted, error=None):
        with self.lock:
            rec["open"] = False
            rec["closed_at"] = time.time()
            if error and not rec["error"]:
                rec["error"] = error
            self.live = [(r, a) for (r, a) in self.live if r is not rec]
        self.write_log()

    def _held(self):
        """Blocks while --hold-control holds the control connection; bounded by a stop."""
        if self.hold is None or not self.hold_armed.is_set() or self.released.is_set():
            return
        t0 = time.monotonic()
        while not self.released.wait(0.2) and not self.stop.is_set():
            pass
        with self.lock:
            self.hold["held_s"] += time.monotonic() - t0
            self.hold["held_chunks"] += 1

    def _serve(self, rec, accepted, dialed):
        """handleConnection: copy both ways; first end closes the accepted leg only."""
        ended = []
        cv = threading.Condition()
        hold = rec["class"] == 0 and self.hold is not None

        def pump(src, dst, name):
            err = None
            try:
                while True:
                    data = src.recv(CHUNK)
                    if not data:
                        break
                    if hold and src is accepted:
                        self._held()
                    dst.sendall(data)
            except (OSError, ssl.SSLError, ConnectionError) as e:
                err = "%s: %s" % (name, e)
            with cv:
                ended.append((name, err))
                cv.notify_all()

        try:
            accepted.handshake()
            dialed.handshake()
        except (OSError, ssl.SSLError, ConnectionError) as e:
            accepted.close_like_go()
            dialed.shutdown()
            accepted.sock.close()
            dialed.sock.close()
            self._finish(rec, accepted, "handshake: %s" % e)
            return
        threads = [threading.Thread(target=pump, args=(dialed, accepted, "dialed->accepted"), daemon=True),
                   threading.Thread(target=pump, args=(accepted, dialed, "accepted->dialed"), daemon=True)]
        for t in threads:
            t.start()
        with cv:
            while not ended and not self.stop.is_set():
                cv.wait(0.5)
            rec["first_end"] = ended[0][0] if ended else "stop"
            first_err = ended[0][1] if ended else None
        accepted.close_like_go()
        # Wait for the other direction to end; a stop ends it too.
        with cv:
            while len(ended) < 2:
                if self.stop.is_set():
                    dialed.shutdown()
                cv.wait(0.5)
        dialed.shutdown()
        accepted.sock.close()
        dialed.sock.close()
        self._finish(rec, accepted, first_err)

    def _accept_loop(self, lsock, cls, dial):
        while not self.stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            kind = "unix" if conn.family == socket.AF_UNIX else "tcp"
            if kind == "tcp" and self.ctx is not None:
                accepted = TlsLeg(conn, self.ctx, True, self.peer_cn)
            else:
                accepted = Leg(conn, kind)
            rec = self._register(cls, accepted)
            if cls != 0:
                self.hold_armed.set()
            order = self.args.dial_order
            if order == "accept":  # dial before the next accept: order is kept
                dialed = self._dial(rec, accepted, dial)
                if dialed is not None:
                    threading.Thread(target=self._serve, args=(rec, accepted, dialed),
                                     daemon=True).start()
            elif order == "shuffle":
                self._shuffle_submit(rec, accepted, dial)
            else:  # go m.handleConnection(fd): dial and copy in a thread per connection
                threading.Thread(target=self._dial_and_serve, args=(rec, accepted, dial),
                                 daemon=True).start()

    # -- dialing -------------------------------------------------------------------------
    def _connect(self, rec, connect):
        """The outbound connect (TCP or unix; no TLS yet); numbers it in connect order."""
        rec["dial_started_at"] = time.time()
        leg = connect()
        with self.lock:
            rec["dialed"] = leg
            rec["dialed_at"] = time.time()
            rec["dial_index"] = self.next_dial_index
            self.next_dial_index += 1
            rec["class_dial_index"] = self.class_dial_counts.get(rec["class"], 0)
            self.class_dial_counts[rec["class"]] = rec["class_dial_index"] + 1
            self.dial_sequence.append(rec["index"])
        return leg

    def _dial(self, rec, accepted, connect, leg=None):
        """connect (unless done) and, on a source with TLS, the handshake: tls.Dial returns
        after it. None when it failed; then the accepted leg is closed, as Go's
        `defer fd.Close()` on handleConnection's early return."""
        try:
            if leg is None:
                leg = self._connect(rec, connect)
            if isinstance(leg, TlsLeg) and not leg.server_side:
                leg.handshake()
                leg.handshake = lambda: None
            return leg
        except (OSError, ssl.SSLError, ConnectionError) as e:
            accepted.close_like_go()
            accepted.sock.close()
            if leg is not None:
                leg.shutdown()
                leg.sock.close()
            self._finish(rec, accepted, "unable to create outbound leg: %s" % e)
            return None

    def _dial_and_serve(self, rec, accepted, connect, leg=None):
        dialed = self._dial(rec, accepted, connect, leg)
        if dialed is not None:
            self._serve(rec, accepted, dialed)

    def _shuffle_submit(self, rec, accepted, connect):
        with self.lock:
            first = self.batch is None
            if first:
                self.batch = []
            self.batch.append((rec, accepted, connect))
        if first:
            threading.Thread(target=self._shuffle_batch, daemon=True).start()

    def _shuffle_batch(self):
        time.sleep(self.args.shuffle_window_ms / 1000.0)
        with self.lock:
            batch, self.batch = self.batch, None
            order = list(range(len(batch)))
            while len(order) > 1 and order == sorted(order):
                self.rng.shuffle(order)
            self.batches.append({"accepted": [b[0]["index"] for b in batch],
                                 "dialed": [batch[i][0]["index"] for i in order]})
        for i in order:  # one connect after another, so the next hop accepts in this order
            rec, accepted, connect = batch[i]
            if self.stop.is_set():
                accepted.close_like_go()
                accepted.sock.close()
                self._finish(rec, accepted, "stopped before dialing")
                continue
            try:
                leg = self._connect(rec, connect)
            except (OSError, ssl.SSLError, ConnectionError) as e:
                accepted.close_like_go()
                accepted.sock.close()
                self._finish(rec, accepted, "unable to create outbound leg: %s" % e)
                continue
            threading.Thread(target=self._dial_and_serve, args=(rec, accepted, connect, leg),
                             daemon=True).start()

    def _listen(self, lsock, cls, dial):
        lsock.listen(64)
        self.listeners.append(lsock)
        threading.Thread(target=self._accept_loop, args=(lsock, cls, dial), daemon=True).start()

    # -- roles ---------------------------------------------------------------------------
    def start_target(self):
        a = self.args
        classes = [0, 49152] + ([49153] if a.block else [])
        ports = {}
        for cls in classes:
            path = a.libvirt_sock if cls == 0 else os.path.join(
                a.base_dir, "migrationproxy", "%s-%d-source.sock" % (a.uid, cls))

            def dial(path=path):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                return Leg(s, "unix")

            ls = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            ls.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            ls.bind(("::", 0))
            ports[str(ls.getsockname()[1])] = cls
            self._listen(ls, cls, dial)
        self.meta["ports"] = ports
        write_json_atomic(a.ports_file, {"ports": ports, "pid": os.getpid()})

    def start_source(self):
        a = self.args
        ports = json.loads(a.ports)
        sockets = {}
        for port, cls in ports.items():
            key = a.uid if cls == 0 else "%s-%d" % (a.uid, cls)
            path = os.path.join(a.base_dir, "migrationproxy", key + "-source.sock")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.lexists(path):
                os.unlink(path)
            host = a.target_address

            def dial(port=int(port)):  # the connect; _dial handshakes (tls.Dial does both)
                s = socket.create_connection((host, port))
                if self.ctx is not None:
                    return TlsLeg(s, self.ctx, False, self.peer_cn)
                return Leg(s, "tcp")

            ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ls.bind(path)
            if a.socket_owner:  # virt-handler chowns them for a non-root launcher (uid 107)
                os.chown(path, *(int(x) for x in a.socket_owner.split(":")))
            sockets[path] = cls
            self._listen(ls, cls, dial)
        self.meta["sockets"] = sockets
        hook = None
        if a.hook_socket:
            from .kvhook import call_node_hook, PRE_MIGRATION_SOURCE
            with open(a.vmi_json, "rb") as f:
                vmi = f.read()
            hook = call_node_hook(a.hook_socket, PRE_MIGRATION_SOURCE, vmi, a.node_name,
                                  timeout=a.hook_timeout)
            hook["failure_strategy"] = a.hook_failure
            hook["socket"] = a.hook_socket
            self.meta["hook"] = hook
            if not hook["ok"]:
                print("kvproxy: node hook failed (%s): %s" % (a.hook_failure, hook["error"]),
                      file=sys.stderr, flush=True)
        proceed = hook is None or hook["ok"] or a.hook_failure == "Ignore"
        self.write_log()
        write_json_atomic(a.ready_file, {"proceed": proceed, "hook": hook, "sockets": sockets,
                                         "pid": os.getpid()})

    def shutdown(self):
        self.stop.set()
        for ls in self.listeners:
            try:
                ls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ls.close()
        with self.lock:
            live = list(self.live)
        for rec, accepted in live:  # stopChan: handleConnection returns, fd.Close()
            accepted.close_like_go()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self.lock:
                if not self.live:
                    break
            time.sleep(0.02)
        if self.args.role == "source":
            for path in self.meta.get("sockets", {}):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self.write_log()


def parse_args(argv):
    p = argparse.ArgumentParser(prog="kvproxy", description=__doc__.split("\n")[0])
    p.add_argument("role", choices=("target", "source"))
    p.add_argument("--uid", required=True, help="VMI UID (the proxy key)")
    p.add_argument("--base-dir", required=True,
                   help="the launcher's kubevirt run dir, e.g. /proc/<pid>/root/run/kubevirt")
    p.add_argument("--log", required=True, help="JSON connection log written here")
    p.add_argument("--tls-dir", help="ca.crt, server.{crt,key}, client.{crt,key}")
    p.add_argument("--disable-tls", action="store_true", help="plain TCP (disableTLS: true)")
    p.add_argument("--dial-order", choices=("concurrent", "shuffle", "accept"),
                   default="concurrent",
                   help="concurrent (default, as KubeVirt): each accepted connection dials in "
                        "its own thread; shuffle (test): connections accepted within "
                        "--shuffle-window-ms are dialed one by one in a random order other "
                        "than the accept order; accept: dial before the next accept (order kept)")
    p.add_argument("--shuffle-window-ms", type=float, default=50.0,
                   help="shuffle: batch window after a batch's first accept (default 50)")
    p.add_argument("--shuffle-seed", type=int, default=None, help="shuffle: random seed")
    g = p.add_argument_group("target")
    g.add_argument("--libvirt-sock", help="the target launcher's libvirt socket")
    g.add_argument("--ports-file", help="{\"ports\": {\"<port>\": class}} written here")
    g.add_argument("--block", action="store_true", help="also the 49153 (NBD) class")
    g = p.add_argument_group("source")
    g.add_argument("--target-address", help="targetNodeAddress")
    g.add_argument("--ports", help="targetDirectMigrationNodePorts as JSON")
    g.add_argument("--ready-file", help="written once listeners are up and the hook ran")
    g.add_argument("--hook-socket", help="node hook plugin socket (PreMigrationSource)")
    g.add_argument("--hook-timeout", type=float, default=30.0, help="seconds (default 30)")
    g.add_argument("--hook-failure", choices=("Fail", "Ignore"), default="Fail")
    g.add_argument("--vmi-json", help="file with the VMI JSON sent to the hook")
    g.add_argument("--node-name", default="", help="NodeContext.node_name")
    g.add_argument("--socket-owner", metavar="UID:GID",
                   help="chown the unix listeners (a non-root launcher's QEMU and libvirt "
                        "connect to them as 107:107)")
    g.add_argument("--hold-control", action="store_true",
                   help="test only: after memory connections start, hold libvirt's control "
                        "bytes towards the target until SIGUSR1")
    a = p.parse_args(argv)
    if not a.disable_tls and not a.tls_dir:
        p.error("--tls-dir is required unless --disable-tls")
    if a.role == "target" and not (a.libvirt_sock and a.ports_file):
        p.error("target needs --libvirt-sock and --ports-file")
    if a.role == "source" and not (a.target_address and a.ports and a.ready_file):
        p.error("source needs --target-address, --ports and --ready-file")
    if a.hook_socket and not a.vmi_json:
        p.error("--hook-socket needs --vmi-json")
    return a


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    set_comm("virt-handler")
    proxy = Proxy(args)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    signal.signal(signal.SIGUSR1, lambda *_: proxy.released.set())
    if args.role == "target":
        proxy.start_target()
    else:
        proxy.start_source()
    while not done.wait(1.0):
        pass
    proxy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
