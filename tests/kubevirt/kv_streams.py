"""Stand-ins for the two ends of virt-handler's migration proxy, for the relay tests, each run
inside a "virt-handler" network namespace (ip netns exec) and named virt-handler (comm), as
rdmig finds KubeVirt's node agent:

  sink   (target side): listens on [::]:0, writes {"port": p} to --ready, then for every
         connection in accept order reads "<index>\\n" and the payload until EOF, answers the
         SHA-256 of what it read and closes. Logs one JSON line per connection to --log.
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
"""
import argparse
import ctypes
import hashlib
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))


QEMU_MAIN_HEAD = b"QEVM\x00\x00\x00\x03"        # QEMU_VM_FILE_MAGIC, version 3
QEMU_MULTIFD_HEAD = b"\x11\x22\x33\x44\x00\x00\x00\x01"  # MULTIFD_MAGIC, version 1
TLS_RECORD_HEAD = b"\x16\x03\x01\x02\x00\x01"  # a TLS handshake record (ClientHello), as KubeVirt's proxy starts
MAGICS = (QEMU_MAIN_HEAD[:4], QEMU_MULTIFD_HEAD[:4])


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
        head = b""
        total = 0
        try:
            while True:
                b = conn.recv(1 << 20)
                if not b:
                    break
                if b"\n" not in head:
                    head += b[:64]
                    if head[:4] in MAGICS:  # QEMU's first bytes before the index line
                        head = head[8:]
                h.update(b)
                total += len(b)
            digest = h.hexdigest()
            conn.sendall(digest.encode() + b"\n")
            conn.close()
            err = None
        except OSError as e:
            digest, err = None, str(e)
        line = {"accepted": accepted, "index": head.split(b"\n")[0].decode(errors="replace"),
                "bytes": total, "sha256": digest, "error": err, "t": time.time()}
        with lock, open(args.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    while True:
        conn, _ = srv.accept()
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
        try:
            s = socket.create_connection(split(args.block_dest if block else args.dest), timeout=args.timeout)
            s.sendall(head + ("%d\n" % i).encode())
        except OSError as e:
            # Refused or reset at once (e.g. redirected to an agent whose session just failed):
            # that connection's result, as a QEMU would see it; the others still run.
            socks.append((i, None, "%s: %s" % (type(e).__name__, e), None))
            continue
        socks.append((i, s, hashlib.sha256(head + ("%d\n" % i).encode() + payload).hexdigest(), payload))
    t0 = time.monotonic()

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

    if args.hold:
        # Every connection is held at once, as QEMU's are: each one's end is seen when it comes.
        results = [None] * len(socks)

        def held(k, item):
            results[k] = run(*item)
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
    args = p.parse_args()
    name_process("virt-handler")
    sink(args) if args.cmd == "sink" else dial(args)


if __name__ == "__main__":
    main()
