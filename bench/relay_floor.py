#!/usr/bin/env python3
"""rdmig's relay against its floor: the simplest relay with the same hops, side by side in one run.

  python3 bench/relay_floor.py [--path bare|kubevirt] [--runs 5] [--bytes 1Gi] [--channels 1,4,9]
                               [--chunks 256Ki,1Mi,4Mi] [--out bench/results/relay-floor[-kubevirt]]
                               [--baseline OLD-rdmig-relay-cpu] [--kinds rdmig,floor,...]
                               [--reader-rate 256Mi]
  (kinds: rdmig, floor, rdmig-splice, floor-splice, floor-framed, rdmig-tls; on --path kubevirt
  also floor-bounded, floor-splice-bounded, floor-framed-bounded, rdmig-unbounded,
  rdmig-unbounded-deep)

Both relays run inside rdmig-relay-cpu with the same QEMU stand-ins (a writer and a reader thread
on unix sockets, every byte checked, their CPU taken out) and the same hops: QEMU's unix socket ->
one loopback TCP connection per channel -> the peer's unix socket.
  rdmig          two ChannelPumps and TcpChannels, as the agents run them with tcp.splice off (copying)
  floor          per connection and direction one thread per agent: read up to a chunk, write it on
                 (its buffer the same memory as rdmig's chunk buffers: ChunkMemory, huge pages)
  rdmig-splice   rdmig with tcp.splice on: what the agents run by default (tcp.splice auto splices
                 on these sockets)
  floor-splice   the floor with splice(2) through a pipe
  floor-framed   floor-splice with rdmig's framing and nothing else of rdmig: an 8-byte header
                 (MSG_MORE) before each payload, what one splice took, read apart at the target
  rdmig-tls      rdmig with dataPlane.tls on: every channel TLS 1.3 (kernel TLS when the kernel takes
                 both directions, else through OpenSSL in user space; results.json says which), its
                 ratio to plain rdmig (rdmig-tls / rdmig) is TLS's cost per GiB
--path kubevirt: the hops of KubeVirt's path through the agents instead. The stand-ins are the
migration proxies: loopback TCP connections to the agents (as the source proxy's connections are
intercepted and the target agent dials the target proxy), the source writing the stream in
16406-byte pieces, a full TLS 1.3 record each (KubeVirt's proxies carry TLS; rdmig relays the
records as bytes). The floor relays the same bytes over the same hops. rdmig runs as the agents
carry a KubeVirt connection: the proxy hops bounded to a chunk each way (net::bound_local_hop),
the flow's ring depth by the chunk size (about 4 MiB in flight, at least 4 chunks). The floor
keeps autotuning on those hops; floor-bounded and floor-splice-bounded are the floors with
rdmig's bound on them, so that what the bound costs (more, smaller hops: fewer bytes in flight
between the QEMUs, for downtime) is told apart from what rdmig's code costs; floor-framed-bounded
is the framed floor so bounded, rdmig-unbounded rdmig without the bound (not what the agents run)
and rdmig-unbounded-deep that with 64 chunks in flight instead of about 4 MiB. With the framed
kinds in the run, results.md gives the steps from the splice floor to rdmig's default, each
paired against the one before it (framing, bound, the rest of rdmig).
rdmig / cheapest-floor (`rdmig/cheapest-floor` in each JSON row): the agents' default mode
(rdmig-splice) against the cheaper of the two floors per row, as medians and paired per run.
--baseline: an rdmig-relay-cpu built from an earlier revision runs as one more kind, "baseline"
(its rdmig relay in the agents' default mode, as rdmig-splice), so a change to the relay is
measured before and after in the same run: its column, baseline / floor-splice and
rdmig-splice / baseline (paired per run) sit beside rdmig-splice's.
Kinds are interleaved (every run of every row takes each kind in turn, the order rotating), rows
give medians and min-max spreads of CPU seconds per GiB (user and system apart) and the ratios
rdmig / floor and rdmig-splice / floor-splice: the ratio of the medians, and the median of the
paired ratios with their quartiles (run i of rdmig over run i of floor, taken in the same round
within seconds of each other, so a drift of the machine cancels; --kinds rdmig,floor leaves the
splice kinds out, for more runs of the main pair in the same time); results.json keeps every
run's figures; "node" is the agents' and the stand-ins' CPU together (the kernel charges a
hop's wake-ups to whichever side runs them, so the agents' figure alone can move work to or from
QEMU's side), and rdmig's chunks per GiB say how full its chunks were.
--reader-rate: the target stand-in reads as QEMU's QEMUFile does, 32 KiB at a time, at most this
many bytes a second over all connections: a target QEMU slower than the link, as a real one is
when the link is fast (on this machine QEMU sends and loads 100-250 MB/s). Every hop then fills,
each chunk meets a full socket at the target, and what waits between the two QEMUs is measured
(inflightSteadyBytes: the mean once half the stream is read; see rdmig-relay-cpu). Without it the
stand-in reads 1 MiB at a time as fast as it can, and the relay is the slowest stage.
Syscalls per GiB come from `strace -c -f` on a short run of each kind (channels 4, chunk 1Mi;
strace slows the run, so only the counts are used).
Writes OUT/results.json and OUT/results.md. Never fails on speed.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELAY_CPU = os.path.join(REPO, "build", "bench", "stream", "rdmig-relay-cpu")
sys.path.insert(0, os.path.join(REPO, "bench"))
from run import machine  # noqa: E402  (the machine as bench/run.py names it)
KINDS = {"rdmig": ["--relay", "rdmig", "--splice", "off"], "floor": ["--relay", "floor"],
         "rdmig-splice": ["--relay", "rdmig", "--splice", "on"], "floor-splice": ["--relay", "floor-splice"],
         "rdmig-tls": ["--relay", "rdmig", "--splice", "off", "--tls"],
         "floor-bounded": ["--relay", "floor", "--bound-floor"],
         "floor-splice-bounded": ["--relay", "floor-splice", "--bound-floor"],
         "floor-framed": ["--relay", "floor-framed"],
         "floor-framed-bounded": ["--relay", "floor-framed", "--bound-floor"],
         "rdmig-unbounded": ["--relay", "rdmig", "--splice", "on", "--unbounded"],
         "rdmig-unbounded-deep": ["--relay", "rdmig", "--splice", "on", "--unbounded", "--depth", "64"]}
# Only on the KubeVirt path (TCP ends, whose hops the agents bound).
KUBEVIRT_ONLY = ("floor-bounded", "floor-splice-bounded", "floor-framed-bounded", "rdmig-unbounded", "rdmig-unbounded-deep")
PAIRS = (("rdmig", "floor"), ("rdmig-splice", "floor-splice"), ("rdmig-tls", "rdmig"),
         ("rdmig-splice", "floor-splice-bounded"), ("floor-framed", "floor-splice"),
         ("floor-framed-bounded", "floor-framed"), ("rdmig-splice", "floor-framed-bounded"),
         ("rdmig-splice", "floor-framed"), ("rdmig-unbounded", "floor-framed"), ("rdmig-unbounded-deep", "floor-framed"))
# What rdmig's default costs above the splice floor, step by step (the decomposition table): each
# step's kind against the one before it, paired per run.
STEPS = (("floor-framed", "floor-splice", "the framing (an 8-byte header a chunk, read apart)"),
         ("floor-framed-bounded", "floor-framed", "the hop bound (KubeVirt path: SO_RCVBUF and TCP_NOTSENT_LOWAT of a chunk)"),
         ("rdmig-splice", "floor-framed-bounded", "the rest of rdmig (window of credits, threads, metrics)"),
         ("rdmig-unbounded-deep", "floor-framed", "rdmig without the bound, 64 chunks deep, against the framed floor"))
DEFAULT_KIND = "rdmig-splice"  # tcp.splice's default, auto, splices unix and TCP sockets
FLOORS = ("floor", "floor-splice")
PATHS = {"bare": [], "kubevirt": ["--ends", "tcp", "--write", "16406"]}


def path_flags(path, chunk):
    """The path's flags; on the KubeVirt path the ring depth the agents give a flow by default
    (flow_ring_depth in src/config/agent_config.h: about 4 MiB in flight, at least 4 chunks)."""
    if path != "kubevirt":
        return PATHS[path]
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    size = int(chunk[:-2]) * units[chunk[-2:]] if chunk[-2:] in units else int(chunk)
    return PATHS[path] + ["--depth", str(max(4, -(-(4 << 20) // size)))]
TITLES = {"bare": "bare-QEMU path: QEMU's unix socket -> one loopback TCP connection per channel -> the peer's "
                  "unix socket",
          "kubevirt": "KubeVirt path: the source proxy's TCP connection -> one loopback TCP connection per channel -> "
                      "the target proxy's TCP connection, written in TLS 1.3 records (16406 bytes)"}


BASELINE = None  # --baseline: another build's rdmig-relay-cpu, kind "baseline"
READER = []  # --reader-rate: the flags that pace the target stand-in


def one(kind, channels, chunk, nbytes, path="bare"):
    binary, flags = (BASELINE, KINDS[DEFAULT_KIND]) if kind == "baseline" else (RELAY_CPU, KINDS[kind])
    out = subprocess.run([binary, "--bytes", nbytes, "--channels", str(channels), "--chunk", chunk]
                         + path_flags(path, chunk) + flags + READER,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError("rdmig-relay-cpu %s failed: %s" % (kind, out.stderr))
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["verified"]:
        raise RuntimeError("unverified run")
    gib = r["bytes"] / float(1 << 30)
    # The stand-ins' threads are measured apart and taken out; a few ms of rounding may show as a
    # small negative user figure: clamp it at 0.
    user = max(r["agentsUserSeconds"], 0.0) / gib
    system = max(r["agentsSystemSeconds"], 0.0) / gib
    # The node's CPU: the agents' and the QEMU stand-ins' together. How the kernel's work of a hop
    # (a wake-up, freeing what the peer read) is charged between the two sides of a socket depends
    # on which side sleeps where, so a relay can look cheaper by making QEMU's side dearer.
    node = (r["agentsUserSeconds"] + r["agentsSystemSeconds"] + r["qemuUserSeconds"] + r["qemuSystemSeconds"]) / gib
    return {"user": user, "system": system, "cpu": user + system, "node": node, "MBps": r["bytesPerSecond"] / 1e6,
            "chunks": r.get("chunks", 0) / gib, "tls": r.get("tls", "off"),
            "inflightMiB": r.get("inflightSteadyBytes", 0) / float(1 << 20)}


def syscalls_per_gib(kind, nbytes="256Mi", path="bare"):
    binary, flags = (BASELINE, KINDS[DEFAULT_KIND]) if kind == "baseline" else (RELAY_CPU, KINDS[kind])
    """strace -c -f of a short run: syscalls per GiB, all threads (the stand-ins' included, the
    same for every kind: compare kinds, not absolute figures)."""
    if not shutil.which("strace"):
        return None
    with tempfile.NamedTemporaryFile(suffix=".strace") as f:
        out = subprocess.run(["strace", "-c", "-f", "-o", f.name, binary, "--bytes", nbytes, "--channels", "4",
                              "--chunk", "1Mi"] + path_flags(path, "1Mi") + flags + READER, capture_output=True, text=True,
                             timeout=600)
        if out.returncode != 0:
            return None
        text = open(f.name).read()
    # strace -c columns: % time, seconds, usecs/call, calls, [errors], syscall (the last line: total).
    total, top = None, []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5 or not parts[3].isdigit():
            continue
        if parts[-1] == "total":
            total = int(parts[3])
        else:
            top.append((parts[-1], int(parts[3])))
    if total is None:
        return None
    top.sort(key=lambda t: -t[1])
    gib = 256 / 1024.0
    return {"total": total / gib, "top": [(n, c / gib) for n, c in top[:4]]}


def quartile(xs, q):
    """The q-quantile of sorted xs, interpolated between neighbours."""
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", choices=sorted(PATHS), default="bare")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bytes", default="1Gi")
    ap.add_argument("--channels", default="1,4,9")
    ap.add_argument("--chunks", default="256Ki,1Mi,4Mi")
    ap.add_argument("--out")
    ap.add_argument("--baseline", help="an earlier build's rdmig-relay-cpu, run as the kind 'baseline'")
    ap.add_argument("--kinds", help="which of %s to run (default: all the path has)" % ", ".join(KINDS))
    ap.add_argument("--reader-rate", help="pace the target stand-in: bytes a second over all connections (256Mi)")
    args = ap.parse_args()
    if args.reader_rate:
        READER.extend(["--reader-rate", args.reader_rate])
    if not args.kinds:
        args.kinds = ",".join(k for k in KINDS if args.path == "kubevirt" or k not in KUBEVIRT_ONLY)
    chosen = args.kinds.split(",")
    if not chosen or any(k not in KINDS for k in chosen):
        ap.error("--kinds: a comma-separated list of %s" % ", ".join(KINDS))
    global BASELINE
    if args.baseline:
        if not os.access(args.baseline, os.X_OK):
            ap.error("--baseline %s is not an executable" % args.baseline)
        BASELINE = os.path.abspath(args.baseline)
    if not args.out:
        args.out = os.path.join(REPO, "bench", "results", "relay-floor" + ("" if args.path == "bare" else "-" + args.path))
    rows = [(int(c), k) for c in args.channels.split(",") for k in args.chunks.split(",")]
    kinds = [k for k in KINDS if k in chosen] + (["baseline"] if BASELINE else [])
    pairs = [(a, b) for a, b in PAIRS + ((("baseline", "floor-splice"), (DEFAULT_KIND, "baseline")) if BASELINE else ()) if a in kinds and b in kinds]
    runs = {(row, kind): [] for row in rows for kind in kinds}
    for i in range(args.runs):
        for row in rows:
            order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]
            for kind in order:
                runs[(row, kind)].append(one(kind, row[0], row[1], args.bytes, args.path))
        print("run %d of %d done" % (i + 1, args.runs), flush=True)
    table = []
    for row in rows:
        entry = {"channels": row[0], "chunk": row[1]}
        for kind in kinds:
            rs = runs[(row, kind)]
            entry[kind] = {"cpu": statistics.median(r["cpu"] for r in rs), "min": min(r["cpu"] for r in rs),
                           "max": max(r["cpu"] for r in rs), "user": statistics.median(r["user"] for r in rs),
                           "system": statistics.median(r["system"] for r in rs),
                           "node": statistics.median(r["node"] for r in rs),
                           "chunks": statistics.median(r["chunks"] for r in rs),
                           "MBps": statistics.median(r["MBps"] for r in rs),
                           "inflightMiB": statistics.median(r["inflightMiB"] for r in rs)}
        for a, b in pairs:
            entry["%s/%s" % (a, b)] = entry[a]["cpu"] / entry[b]["cpu"] if entry[b]["cpu"] > 0 else None
            entry["%s/%s node" % (a, b)] = entry[a]["node"] / entry[b]["node"] if entry[b]["node"] > 0 else None
            paired = sorted(x["cpu"] / y["cpu"] for x, y in zip(runs[(row, a)], runs[(row, b)]) if y["cpu"] > 0)
            entry["%s/%s paired" % (a, b)] = {"median": statistics.median(paired), "q1": quartile(paired, 0.25),
                                              "q3": quartile(paired, 0.75)} if paired else None
        if DEFAULT_KIND in kinds and all(f in kinds for f in FLOORS):
            # The default mode against the cheaper floor of the row (medians), and run by run.
            entry["cheapest-floor"] = min(FLOORS, key=lambda f: entry[f]["cpu"])
            cheapest = entry[entry["cheapest-floor"]]["cpu"]
            entry["rdmig/cheapest-floor"] = entry[DEFAULT_KIND]["cpu"] / cheapest if cheapest > 0 else None
            # The node's CPU (the stand-ins' with the agents'): the kernel charges a hop's wake-ups
            # to whichever side runs them, so a relay that sleeps less can look cheaper or dearer.
            node_floor = entry[entry["cheapest-floor"]]["node"]
            entry["rdmig/cheapest-floor node"] = entry[DEFAULT_KIND]["node"] / node_floor if node_floor > 0 else None
            paired = sorted(x["cpu"] / min(y["cpu"], z["cpu"]) for x, y, z in
                            zip(runs[(row, DEFAULT_KIND)], runs[(row, FLOORS[0])], runs[(row, FLOORS[1])])
                            if min(y["cpu"], z["cpu"]) > 0)
            entry["rdmig/cheapest-floor paired"] = {"median": statistics.median(paired), "q1": quartile(paired, 0.25),
                                                    "q3": quartile(paired, 0.75), "max": paired[-1]} if paired else None
        entry["runs"] = {kind: runs[(row, kind)] for kind in kinds}
        table.append(entry)
        print("channels %d chunk %-5s: %s" % (row[0], row[1], "  ".join(
            "%s %.3f" % (k, entry[k]["cpu"]) for k in kinds)), flush=True)
    sc = {kind: syscalls_per_gib(kind, path=args.path) for kind in kinds}
    m = machine()
    results = {"machine": "nproc %d (%s), %.1f GiB, kernel %s, %s" % (m["cpus"], m["cpu"], m["mem_gib"], m["kernel"],
                                                                     m["date"]), "command": "python3 bench/relay_floor.py " + " ".join(sys.argv[1:]),
               "path": args.path, "runs": args.runs, "bytes": args.bytes, "readerRate": args.reader_rate,
               "rows": table, "syscalls": sc,
               "baseline": BASELINE, "default": DEFAULT_KIND}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    kinds_md = [k for k in kinds if k != "baseline"]
    main_pairs = [(a, b) for a, b in pairs if "baseline" not in (a, b)]
    pairs_md = []
    for a, b in main_pairs:
        pairs_md += ["%s / %s" % (a, b), "%s / %s paired (quartiles)" % (a, b)]
    cheap = [e for e in table if e.get("rdmig/cheapest-floor")]
    summary = []
    if cheap:
        summary = ["**The agents' default (%s) against the cheaper floor of each row:** ratio of the medians %.2f-%.2f "
                   "over the rows; paired per run, medians %.2f-%.2f (the worst run of any row %.2f)." % (
                       DEFAULT_KIND, min(e["rdmig/cheapest-floor"] for e in cheap),
                       max(e["rdmig/cheapest-floor"] for e in cheap),
                       min(e["rdmig/cheapest-floor paired"]["median"] for e in cheap),
                       max(e["rdmig/cheapest-floor paired"]["median"] for e in cheap),
                       max(e["rdmig/cheapest-floor paired"]["max"] for e in cheap)), "",
                   "| channels | chunk | %s | cheapest floor | %s / cheapest floor | paired (quartiles) | node: %s / "
                   "that floor |" % (DEFAULT_KIND, DEFAULT_KIND, DEFAULT_KIND), "|---|---|---|---|---|---|---|"]
        for e in cheap:
            p = e["rdmig/cheapest-floor paired"]
            summary.append("| %d | %s | %.3f | %s %.3f | **%.2f** | %.2f (%.2f-%.2f) | %.2f |" % (
                e["channels"], e["chunk"], e[DEFAULT_KIND]["cpu"], e["cheapest-floor"], e[e["cheapest-floor"]]["cpu"],
                e["rdmig/cheapest-floor"], p["median"], p["q1"], p["q3"], e["rdmig/cheapest-floor node"]))
        summary.append("")
    steps = [st for st in STEPS if st[0] in kinds and st[1] in kinds]
    if steps:
        summary += ["**Where the default's cost above the splice floor goes** (paired per run, medians of the rows' "
                    "paired medians with their range over the rows; each step against the kind before it):", "",
                    "| step | kinds | per row (paired medians) | median over the rows |", "|---|---|---|---|"]
        for a, b, what in steps:
            meds = [e["%s/%s paired" % (a, b)]["median"] for e in table if e.get("%s/%s paired" % (a, b))]
            summary.append("| %s | %s / %s | %s | **%.2f** |" % (what, a, b, ", ".join("%.2f" % x for x in meds),
                                                               statistics.median(meds)))
        summary.append("")
    paced = []
    if args.reader_rate:
        paced = ["The target stand-in reads 32 KiB at a time at %s bytes a second in all (`--reader-rate`): a target "
                 "QEMU slower than the link." % args.reader_rate, "",
                 "What waits between the two QEMUs behind it (MiB, the median of each row's steady means):", "",
                 "| channels | chunk | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
        for e in table:
            paced.append("| %d | %s | %s |" % (e["channels"], e["chunk"], " | ".join("%.1f" % e[k]["inflightMiB"]
                                                                                    for k in kinds)))
        paced.append("")
    lines = ["# rdmig's relay against its floor", "", "Hops: %s." % TITLES[args.path], ""] + paced + summary + [
             "Machine: %s. Command: `%s`. %d interleaved runs of %s per kind and row; CPU seconds per GiB of "
             "both agents (the QEMU stand-ins' threads taken out), medians with min-max. A / B: the ratio of the "
             "medians; paired: the median of run i's A / run i's B, with the quartiles." % (
                 results["machine"], results["command"], args.runs, args.bytes), "",
             "| channels | chunk | " + " | ".join(kinds_md) + " | " + " | ".join(pairs_md) + " | "
             + " | ".join("%s user / system" % k for k in kinds_md[:2]) + " | node: rdmig / floor | rdmig chunks per GiB |",
             "|---|---|" + "---|" * (len(kinds_md) + len(pairs_md) + len(kinds_md[:2]) + 2)]
    for e in table:
        def cell(k):
            return "%.3f (%.3f-%.3f)" % (e[k]["cpu"], e[k]["min"], e[k]["max"])

        def ratios(a, b):
            p = e["%s/%s paired" % (a, b)]
            return "**%.2f** | %.2f (%.2f-%.2f)" % (e["%s/%s" % (a, b)], p["median"], p["q1"], p["q3"])
        uk = kinds_md[:2]
        node = ("%.3f / %.3f = %.2f" % (e["rdmig"]["node"], e["floor"]["node"], e["rdmig/floor node"])
                if "rdmig/floor node" in e else "-")
        lines.append("| %d | %s | %s | %s | %s | %s | %s |" % (
            e["channels"], e["chunk"], " | ".join(cell(k) for k in kinds_md),
            " | ".join(ratios(a, b) for a, b in main_pairs),
            " | ".join("%.3f / %.3f" % (e[k]["user"], e[k]["system"]) for k in uk), node,
            "%.0f" % e["rdmig"]["chunks"] if "rdmig" in e else "-"))
    if BASELINE:
        d = DEFAULT_KIND
        lines += ["", "Before and after: `baseline` is %s, an earlier build, run interleaved with the others "
                  "(in the default mode, as %s):" % (os.path.basename(BASELINE), d), "",
                  "| channels | chunk | baseline | %s | floor-splice | baseline / floor-splice | %s / floor-splice "
                  "| %s / baseline | paired (quartiles) |" % (d, d, d),
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in table:
            p = e["%s/baseline paired" % d]
            lines.append("| %d | %s | %.3f (%.3f-%.3f) | %.3f (%.3f-%.3f) | %.3f | %.2f | %.2f | **%.2f** | %.2f (%.2f-%.2f) |" % (
                e["channels"], e["chunk"], e["baseline"]["cpu"], e["baseline"]["min"], e["baseline"]["max"],
                e[d]["cpu"], e[d]["min"], e[d]["max"], e["floor-splice"]["cpu"], e["baseline/floor-splice"],
                e["%s/floor-splice" % d], e["%s/baseline" % d], p["median"], p["q1"], p["q3"]))
        lines += [""]
    tls_modes = sorted({r["tls"] for e in table for r in e["runs"].get("rdmig-tls", [])})
    if tls_modes:
        lines += ["", "rdmig-tls: TLS 1.3 (TLS_AES_128_GCM_SHA256, PSK with ECDHE) done in: %s (\"kernel\" is kTLS both "
                  "ways; \"user space\" is OpenSSL's SSL_read/SSL_write, splice off). TLS's cost: rdmig-tls / rdmig." %
                  ", ".join(tls_modes)]
    lines += ["", "Syscalls per GiB (strace -c -f, 256 MiB, channels 4, chunk 1Mi; all threads, the stand-ins' "
              "included, so compare the kinds):", ""]
    for kind, s in sc.items():
        lines.append("- %s: %s" % (kind, "strace unavailable or failed" if not s else "%.0f in all; most: %s" % (
            s["total"], ", ".join("%s %.0f" % t for t in s["top"]))))
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %s/results.md" % args.out)


if __name__ == "__main__":
    main()
