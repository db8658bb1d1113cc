#!/usr/bin/python3
"""Plots bench/run.py's results.json (Debian's python3-matplotlib): whole-migration totals and
switchover, direct vs through the agents, and the TCP chunk-size sweep."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

res = json.load(open(sys.argv[1]))
panels = [k for k in ("whole", "sweep_tcp", "defaults") if k in res]
if not panels:
    sys.exit(0)
fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
for ax, key in zip(axes[0], panels):
    if key == "whole":
        rows = res["whole"]
        labels = ["%dM %s mf%d" % (r["mem_mib"], "idle" if r["dirty_mib_s"] == "idle" else "dirty", r["multifd"]) for r in rows]
        x = range(len(rows))
        for off, way, label in ((-0.2, "direct", "direct (unix socket)"), (0.2, "agents", "through rdmig agents (TCP)")):
            med = [r[way]["total_ms"] or 0 for r in rows]
            # The spread (min-max) as error bars and every run as a dot, where results.json has them.
            lo = [m - ((r.get("spread") or {}).get(way, {}).get("total_ms") or {"min": m})["min"] for m, r in zip(med, rows)]
            hi = [((r.get("spread") or {}).get(way, {}).get("total_ms") or {"max": m})["max"] - m for m, r in zip(med, rows)]
            ax.bar([i + off for i in x], med, 0.4, yerr=[lo, hi], capsize=3, label=label)
            for i, r in enumerate(rows):
                pts = [p["total_ms"] for p in r.get(way + "_runs", []) if p.get("total_ms") is not None]
                ax.plot([i + off] * len(pts), pts, "k.", markersize=3)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("QEMU total time (ms): median, min-max, each run")
        ax.set_title("Whole migrations")
        ax.legend(fontsize=8)
    elif key == "sweep_tcp":
        rows = res["sweep_tcp"]
        ax.plot([r["chunk"] for r in rows], [r["Bps"] / 2**20 for r in rows], marker="o", label="rdmig TCP transport")
        ax.set_ylabel("MiB/s")
        ax.set_xlabel("chunk size")
        ax.set_title("Chunk-size sweep (loopback)")
        ax.set_ylim(bottom=0)
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
    else:
        rows = res["defaults"]
        labels = ["%s x%d" % (r["chunk"], r["depth"]) for r in rows]
        ax.bar(labels, [r["switchover_ms"] or 0 for r in rows], label="switchover (STOP->RESUME)")
        ax.plot(labels, [r["downtime_ms"] or 0 for r in rows], "k^", label="QEMU downtime")
        ax.set_ylabel("ms, median")
        ax.set_title("Chunk size x ring depth (512 MiB dirtying)")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
