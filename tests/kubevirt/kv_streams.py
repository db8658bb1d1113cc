"""Stand-ins for the two ends of virt-handler's migration proxy, for the relay tests, each run
inside a "virt-handler" network namespace (ip netns exec) and named virt-handler (comm), as
rdmig finds KubeVirt's node agent:

  sink   (target side): listens on [::]:0, writes {"port": p} to --ready, then for every
         connection in accept order reads "<index>\\n" and the payload until EOF, answers the
         SHA-256 of what it read and closes (a head line "<index> rp <MS>": post-copy's shape,
         below). Logs one JSON line per connection to --log.
  dial   (source side): optionally calls the node hook (real gRPC, like virt-handler), then
         opens --count connections to --dest one after the other (like the proxy's dials for
         QEMU's main and multifd connections), sends "<index>\\n" + --bytes random bytes on
         each, half-closes, and checks the answer. Prints a JSON summary.
         --block-dest/--block-count: the first connections go to a block (NBD) port instead,
         as libvirt copies disks before memory. --magic: every memory connection starts with
         QEMU's first bytes (the main one, --main-at, with the stream's "QEVM" header, the others
         with the multifd magic), as they cross the wire when KubeVirt's TLS is off. --rate: each
         connection's payload goes at most this many bytes a second (QEMU's max-bandwidth), so
         that a fault injected mid-stream lands while it carries.
         --page-requests MS: post-copy's shape (below): every connection at once, each with
         a return path.

Post-copy's shape (--page-requests): after the switch QEMU's target sends page requests on the
return path of the main connection (small messages, MIG_RP_MSG_REQ_PAGES) while the source
streams the rest, and answers each by sending that page ahead of the background stream; a page
fault waits for it, so a request held anywhere (a relay filling a chunk) stalls the guest. Here
the dial's head line is "<index> rp <MS>\n" (MS taken as 1 to 1000) and its stream is records:
b"D" + u32 length + data (the payload), b"P" + u32 id + the 4096 bytes of page `id`
(page_bytes), b"E" (the payload ended). The sink, from the head line on, sends b"R" + u32 id
every MS ms until it sees b"E", checks every page against its id and times each request to its
page; once every request has its page it answers b"A" + u32 length + a JSON summary (the
payload's SHA-256, requests, pages, bad pages, latency percentiles). The dial answers each request ahead of its next 64 KiB of payload, keeps
answering after b"E" until the summary comes, and is ok when the digest matches and every request
got its page intact.
"""
import argparse
import ctypes
import hashlib
import json
import os
import queue
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))


QEMU_MAIN_HEAD = b"QEVM\x00\x00\x00\x03"        # QEMU_VM_FILE_MAGIC, version 3
QEMU_MULTIFD_HEAD = b"\x11\x22\x33\x44\x00\x00\x00\x01"  # MULTIFD_MAGIC, version 1
TLS_RECORD_HEAD = b"\x16\x03\x01\x02\x00\x01"  # a TLS handshake record (ClientHello), as KubeVirt's proxy starts
MAGICS = (QEMU_MAIN_HEAD[:4], QEMU_MULTIFD_HEAD[:4])
PAGE = 4096
RP_PIECE = 64 << 10   # the payload between two chances to answer a page request
RP_MAX_RECORD = 1 << 20
RP_DRAIN_SECONDS = 30  # after b"E": how long the sink waits for the pages still asked for


def page_bytes(page_id):
    """Page `page_id`'s content: anything else arriving as that page is a corruption."""
    return hashlib.sha256(b"page %d" % page_id).digest() * (PAGE // 32)


def read_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        b = conn.recv(n - len(buf))
        if not b:
            raise EOFError("EOF after %d of %d bytes" % (len(buf), n))
        buf += b
    return bytes(buf)


def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100.0 * (len(v) - 1))))]


def serve_return_path(conn, interval):
    """The sink's end of one post-copy-shaped connection (module docstring): returns its summary."""
    send_lock = threading.Lock()
    asked = {}          # id -> monotonic time the request was sent, until its page comes
    latencies = []
    state = {"ended": False, "bad": 0, "next": 0, "error": None}
    cv = threading.Condition()

    def requester():
        while True:
            with cv:
                if state["ended"] or state["error"]:
                    return
                pid = state["next"]
                state["next"] += 1
                asked[pid] = time.monotonic()
            try:
                with send_lock:
                    conn.sendall(b"R" + struct.pack(">I", pid))
            except OSError as e:
                with cv:
                    state["error"] = "sending request %d: %s" % (pid, e)
                    cv.notify_all()
                return
            with cv:
                cv.wait(interval)
    h = hashlib.sha256()
    total = 0
    t = threading.Thread(target=requester, daemon=True)
    t.start()
    drain_until = None
    try:
        while True:
            with cv:
                if state["ended"] and not asked:
                    break
                if drain_until and time.monotonic() > drain_until:
                    raise TimeoutError("%d page request(s) unanswered %d s after the payload ended"
                                       % (len(asked), RP_DRAIN_SECONDS))
            kind = read_exact(conn, 1)
            if kind == b"D":
                (n,) = struct.unpack(">I", read_exact(conn, 4))
                if n > RP_MAX_RECORD:
                    raise ValueError("data record of %d bytes" % n)
                b = read_exact(conn, n)
                h.update(b)
                total += n
            elif kind == b"P":
                (pid,) = struct.unpack(">I", read_exact(conn, 4))
                body = read_exact(conn, PAGE)
                now = time.monotonic()
                with cv:
                    sent = asked.pop(pid, None)
                    if sent is None or body != page_bytes(pid):
                        state["bad"] += 1
                    else:
                        latencies.append(now - sent)
            elif kind == b"E":
                with cv:
                    state["ended"] = True
                    cv.notify_all()
                drain_until = time.monotonic() + RP_DRAIN_SECONDS
                conn.settimeout(RP_DRAIN_SECONDS)
            else:
                raise ValueError("unknown record %r after %d payload bytes" % (kind, total))
        t.join()
        ms = [x * 1000.0 for x in latencies]
        summary = {"sha256": h.hexdigest(), "bytes": total, "requests": state["next"], "pages": len(latencies),
                   "badPages": state["bad"], "p50Ms": percentile(ms, 50), "p99Ms": percentile(ms, 99),
                   "maxMs": max(ms) if ms else None, "error": state["error"]}
        body = json.dumps(summary).encode()
        with send_lock:
            conn.sendall(b"A" + struct.pack(">I", len(body)) + body)
        # The dial closes once it has the summary.
        conn.settimeout(RP_DRAIN_SECONDS)
        while conn.recv(4096):
            pass
        return summary
    finally:
        with cv:
            state["ended"] = True
            cv.notify_all()


def name_process(name):
    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


def sink(args):
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("::", 0))
    srv.listen(64)
    with open(args.ready + ".tmp", "w") as f:
        json.dump({"port": srv.getsockname()[1], "pid": os.getpid()}, f)
    os.rename(args.ready + ".tmp", args.ready)
    order = [0]
    lock = threading.Lock()

    def serve(conn, accepted):
        h = hashlib.sha256()
        head = first = b""
        total = 0
        summary = None
        try:
            # The head line, a byte at a time (at most 64, after QEMU's first bytes where they
            # come): "<index> rp <MS>" is post-copy's shape, whose records follow at once.
            while not head.endswith(b"\n") and len(head) < 64:
                b = conn.recv(1)
                if not b:
                    break
                head += b
            first = (head[8:] if head[:4] in MAGICS else head).split(b"\n")[0]
            words = first.split(b" ")
            if len(words) == 3 and words[1] == b"rp":
                first = words[0]
                summary = serve_return_path(conn, max(1.0, min(float(words[2]), 1000.0)) / 1000.0)
                digest, total, err = summary["sha256"], summary["bytes"], summary["error"]
            else:
                h.update(head)
                total += len(head)
                while True:
                    b = conn.recv(1 << 20)
                    if not b:
                        break
                    h.update(b)
                    total += len(b)
                digest = h.hexdigest()
                conn.sendall(digest.encode() + b"\n")
                err = None
        except (OSError, EOFError, ValueError) as e:
            digest, err = None, "%s: %s" % (type(e).__name__, e)
        conn.close()
        line = {"accepted": accepted, "index": first.decode(errors="replace"),
                "bytes": total, "sha256": digest, "error": err, "t": time.time()}
        if summary is not None:
            line["returnPath"] = summary
        with lock, open(args.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as Go's net does (KubeVirt's proxy)
        with lock:
            accepted = order[0]
            order[0] += 1
        threading.Thread(target=serve, args=(conn, accepted), daemon=True).start()


def dial(args):
    out = {"hook": None, "connections": []}
    if args.hook_socket:
        from rdmiglab import kvhook
        with open(args.vmi) as f:
            vmi = f.read()
        out["hook"] = kvhook.call_node_hook(args.hook_socket, "PreMigrationSource", vmi, args.node,
                                           timeout=args.hook_timeout)
    def split(dest):
        host, port = dest.rsplit(":", 1)
        return host.strip("[]"), int(port)
    socks = []
    for i in range(args.count):
        payload = os.urandom(args.bytes)
        block = i < args.block_count
        head = b""
        if args.magic and not block:
            head = QEMU_MAIN_HEAD if i == args.main_at else QEMU_MULTIFD_HEAD
        elif args.tls_head and not block:
            head = TLS_RECORD_HEAD
        line = ("%d rp %g\n" % (i, args.page_requests) if args.page_requests else "%d\n" % i).encode()
        try:
            s = socket.create_connection(split(args.block_dest if block else args.dest), timeout=args.timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as Go's net does (KubeVirt's proxy)
            s.sendall(head + line)
        except OSError as e:
            # Refused or reset at once (e.g. redirected to an agent whose session just failed):
            # that connection's result, as a QEMU would see it; the others still run.
            socks.append((i, None, "%s: %s" % (type(e).__name__, e), None))
            continue
        # What the sink digests: every byte, or with page requests the payload alone.
        socks.append((i, s, hashlib.sha256(payload if args.page_requests else head + line + payload).hexdigest(),
                      payload))
    t0 = time.monotonic()

    def run_return_path(i, s, want, payload):
        """One post-copy-shaped connection (module docstring): the payload as D records paced by
        --rate, each page request answered ahead of the next piece, until the sink's summary."""
        rec = {"index": i, "ok": False, "error": None}
        asked = queue.Queue()
        summary = {}
        ended = threading.Event()  # the return path ended (the summary, EOF, an error): for good

        def reader():
            try:
                while True:
                    kind = read_exact(s, 1)
                    if kind == b"R":
                        asked.put(struct.unpack(">I", read_exact(s, 4))[0])
                    elif kind == b"A":
                        (n,) = struct.unpack(">I", read_exact(s, 4))
                        got = json.loads(read_exact(s, min(n, RP_MAX_RECORD)))
                        if not isinstance(got, dict):
                            raise ValueError("a summary that is not an object: %r" % got)
                        summary.update(got)
                        break
                    else:
                        raise ValueError("unknown return-path record %r" % kind)
            except Exception as e:  # noqa: BLE001 - any end of the reader ends the return path
                summary.setdefault("readError", "%s: %s" % (type(e).__name__, e))
            finally:
                ended.set()
                asked.put(None)  # wakes a writer waiting on the queue

        def answer(block_for):
            """Sends the page of every request waiting (waiting up to block_for s for the first);
            False once the return path ended and nothing waits."""
            try:
                pid = asked.get(timeout=block_for) if block_for > 0 else asked.get_nowait()
            except queue.Empty:
                return not ended.is_set()
            while pid is not None:
                s.sendall(b"P" + struct.pack(">I", pid) + page_bytes(pid))
                rec["pages"] = rec.get("pages", 0) + 1
                try:
                    pid = asked.get_nowait()
                except queue.Empty:
                    break
            return not ended.is_set()

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        try:
            start = time.monotonic()
            for off in range(0, len(payload), RP_PIECE):
                answer(0)
                piece = payload[off:off + RP_PIECE]
                s.sendall(b"D" + struct.pack(">I", len(piece)) + piece)
                if args.rate:
                    while True:  # the pace, answering requests meanwhile
                        ahead = start + (off + len(piece)) / args.rate - time.monotonic()
                        if ahead <= 0:
                            break
                        answer(ahead)
            s.sendall(b"E")
            # The requests still coming until the summary, at most --timeout past the payload.
            deadline = time.monotonic() + args.timeout
            while answer(max(0.01, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    summary.setdefault("readError", "no summary within %.0f s of the payload's end" % args.timeout)
                    break
            t.join(max(0.0, deadline - time.monotonic()))
            if summary.get("readError"):
                rec["error"] = summary["readError"]
            elif summary.get("sha256") != want:
                rec["error"] = "digest mismatch: %s" % summary
            elif summary.get("error") or summary.get("badPages") or summary.get("pages") != summary.get("requests"):
                rec["error"] = "page requests: %s" % summary
            else:
                rec["ok"] = True
        except OSError as e:
            rec["error"] = "reset" if isinstance(e, ConnectionResetError) else "%s: %s" % (type(e).__name__, e)
        rec["returnPath"] = summary
        rec["seconds"] = round(time.monotonic() - t0, 3)
        s.close()
        return rec

    def run(i, s, want, payload):
        if s is None:  # failed at connect: `want` holds why
            return {"index": i, "ok": False, "error": want, "seconds": 0.0}
        rec = {"index": i, "ok": False, "error": None}
        try:
            if args.rate:
                piece = 256 << 10
                start = time.monotonic()
                for off in range(0, len(payload), piece):
                    s.sendall(payload[off:off + piece])
                    ahead = start + (off + piece) / args.rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)  # the pace (bytes a second), not a wait for anything
            else:
                s.sendall(payload)
            if args.hold:
                # Keep the connection open (a migration in progress) until the far side ends it.
                s.settimeout(args.hold)
                try:
                    b = s.recv(128)
                    rec["error"] = "ended by the far side (%s)" % ("EOF" if not b else "data")
                except ConnectionResetError:
                    rec["error"] = "reset"
                except socket.timeout:
                    rec["error"] = "still open after %.0fs" % args.hold
                rec["ended_at"] = time.time()
                s.close()
                return rec
            s.shutdown(socket.SHUT_WR)
            got = b""
            while not got.endswith(b"\n"):
                b = s.recv(128)
                if not b:
                    break
                got += b
            rec["ok"] = got.strip().decode() == want
            if not rec["ok"]:
                rec["error"] = "digest mismatch or no answer: %r" % got[:80]
        except OSError as e:
            # A reset met while sending is the same reset as one met while holding (recv above):
            # name it alike (seen: the killed-target reset case in the Soft-RoCE VM, run S).
            rec["error"] = "reset" if isinstance(e, ConnectionResetError) else "%s: %s" % (type(e).__name__, e)
            if args.hold:
                rec["ended_at"] = time.time()
        rec["seconds"] = round(time.monotonic() - t0, 3)
        s.close()
        return rec

    if args.hold or args.page_requests:
        # Every connection is held at once, as QEMU's are: each one's end is seen when it comes.
        # (With page requests likewise: after the switch every connection carries at once.)
        results = [None] * len(socks)

        def held(k, item):
            results[k] = (run_return_path if args.page_requests and item[1] is not None else run)(*item)
        threads = [threading.Thread(target=held, args=(k, item)) for k, item in enumerate(socks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["connections"] = results
    else:
        out["connections"] = [run(*item) for item in socks]
    print(json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--ready", required=True)
    s.add_argument("--log", required=True)
    d = sub.add_parser("dial")
    d.add_argument("--dest", required=True)
    d.add_argument("--count", type=int, default=1)
    d.add_argument("--bytes", type=int, default=1 << 20)
    d.add_argument("--hook-socket")
    d.add_argument("--hook-timeout", type=float, default=5.0)
    d.add_argument("--vmi")
    d.add_argument("--node", default="node-a")
    d.add_argument("--timeout", type=float, default=30.0)
    d.add_argument("--hold", type=float, default=0, help="keep each connection open up to this long")
    d.add_argument("--block-dest", help="host:port of the block (NBD) class")
    d.add_argument("--block-count", type=int, default=0, help="the first N connections go to --block-dest")
    d.add_argument("--magic", action="store_true", help="memory connections start with QEMU's first bytes")
    d.add_argument("--tls-head", action="store_true",
                   help="memory connections start with a TLS record's header (KubeVirt's migration TLS on)")
    d.add_argument("--main-at", type=int, default=0, help="with --magic: the connection that is QEMU's main channel")
    d.add_argument("--rate", type=float, default=0, help="bytes a second per connection (0: as fast as it goes)")
    d.add_argument("--page-requests", type=float, default=0, metavar="MS",
                   help="post-copy's shape: the sink asks for a page every MS ms on each connection's return path")
    args = p.parse_args()
    name_process("virt-handler")
    sink(args) if args.cmd == "sink" else dial(args)


if __name__ == "__main__":
    main()
