#!/usr/bin/env python3
"""Downtime of one whole-migration row, many ways side by side: QEMU direct, the floor relay
(rdmig-floor-relay), and the agents as configured by default and with one setting changed each
(tcp.splice off; ringDepth 64; ringDepth 4), interleaved run by run with the order rotating, on
one chain of guests (bench/run.py's Chain: each migration's target becomes the next source).

  python3 bench/downtime_ways.py [--mem 1024] [--dirty 0] [--multifd 4] [--runs 11] [--out FILE.json]

Prints per way the median downtime, every run's downtime sorted, and the medians of total time and
switchover (source STOP to target RESUME); --out keeps every run. Downtimes on this 2-core machine
are a few milliseconds with a long tail (a switchover that meets a busy moment of the cores takes
15-100 ms on any path), so medians of fewer than about 11 runs flip between the two modes.
Never fails on speed.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as B  # noqa: E402  (bench/run.py: Chain, FloorRelay, run_direct, run_agents)
from rdmiglab import Agent, ensure_guest  # noqa: E402  (run.py put tools/ on the path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mem", type=int, default=1024)
    ap.add_argument("--dirty", type=int, default=0, help="MiB per dirtying pass (0: idle)")
    ap.add_argument("--multifd", type=int, default=4)
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--out")
    args = ap.parse_args()
    ensure_guest()
    work = tempfile.mkdtemp(prefix="rdmig-downtime-")
    default = [Agent(work, "a-default"), Agent(work, "b-default")]
    copy = [Agent(work, "a-copy", config={"tcp": {"splice": "off"}}),
            Agent(work, "b-copy", config={"tcp": {"splice": "off"}})]
    floor = B.FloorRelay(work)
    chain = B.Chain(work, "dt", args.mem, args.dirty)
    mf = args.multifd
    ways = [("direct", lambda: chain.run("direct", B.run_direct, mf)),
            ("floor relay", lambda: chain.run("floor", B.run_direct, mf, floor)),
            ("agents", lambda: chain.run("agents", B.run_agents, default, mf)),
            ("agents, tcp.splice off", lambda: chain.run("agents", B.run_agents, copy, mf)),
            ("agents, ringDepth 64", lambda: chain.run("agents", B.run_agents, default, mf, depth=64)),
            ("agents, ringDepth 4", lambda: chain.run("agents", B.run_agents, default, mf, depth=4))]
    res = {name: [] for name, _ in ways}
    try:
        for i in range(args.runs):
            for name, go in ways[i % len(ways):] + ways[:i % len(ways)]:
                res[name].append(go())
            print("run %d of %d done" % (i + 1, args.runs), flush=True)
    finally:
        chain.close()
        floor.stop()
        for a in default + copy:
            a.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("%d MiB guest, %s, multifd %d, %d interleaved runs per way:" % (
        args.mem, "idle" if not args.dirty else "dirtying %d MiB passes" % args.dirty, mf, args.runs))
    for name, rs in res.items():
        d = sorted(r["downtime_ms"] for r in rs)
        print("  %-24s downtime median %5.1f ms %s; total median %4.0f ms; switchover median %5.1f ms" % (
            name, statistics.median(d), d, statistics.median(r["total_ms"] for r in rs),
            statistics.median(r["switchover_ms"] or 0 for r in rs)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": B.machine(), "args": vars(args), "runs": res, "deaths": B.DEATHS}, f, indent=1)


if __name__ == "__main__":
    main()
