"""Drain forecast accuracy (issue 45, docs/drain.md): the model's predicted total time and
downtime (src/forecast, through build/bench/stream/rdmig-forecast) against what real QEMU guests
measure when migrated through two real rdmig-agents over TCP on loopback.

Each row: a guest of --mem MiB that rewrites --dirty MiB per second; the source agent measures its
dirty rate with QEMU (POST /v1/dirtyrate), a path check between the two agents measures the
throughput with the row's channels, the model predicts (accepted downtime --downtime-ms, QEMU's
limit that less the switchover, completion timeout --timeout), then the guest migrates with
those settings and the agents report its total time and downtime (a migration still iterating
at the timeout is "did not converge"). Timings need a quiet machine.

    python3 bench/drain_accuracy.py --out bench/results/drain-accuracy \\
        [--mem 128,256,512,1024] [--dirty 0,8,32,128] [--channels 1,8] [--runs 1] [--max-bandwidth B]
        [--calibrate [--calibrate-over transferred|input] [--calibrate-mem MiB] [--calibrate-fill PCT] [--calibrate-runs N]]
        [--touched] [--fill PCT[,PCT...]]

--touched: the model's memory input is the guest RAM QEMU holds resident instead of the VM's size,
as the source agent's POST /v1/dirtyrate reports it (residentRamBytes: the Rss of QEMU's RAM
mapping in /proc/<pid>/smaps): pages a guest never wrote are sent as zero-page markers, almost
free, so an idle or young guest moves far less than its size.

--fill PCT[,PCT...]: the guests hold PCT% of their RAM written (the memory verifier, tools/guest/verify.c,
over that many MiB), and their dirty rate is the verifier's rewrite rate (--dirty, MiB/s) instead
of the dirtier's per-tick passes: a guest whose memory is in use, as a VM's is, rather than the lab
guest that touches 100-150 MiB of any size. The calibration guest is filled the same way (rewriting
almost nothing). A list: the rows are made for each percentage.

--calibrate: before the rows, one idle guest (--calibrate-mem MiB, default the largest --mem; with
--fill, filled --calibrate-fill percent, default the first --fill) is migrated per channel count,
and QEMU's own send rate on this host becomes that channel count's maxBandwidth input, as an
operator would state it in a plan's spec.maxBandwidth; each row records the rate it used. The rate
is bytes over the time QEMU sent (its total time less its setup time and downtime, as query-migrate
reports them), and the bytes are, with --calibrate-over transferred (the default), what QEMU
transferred; with --calibrate-over input, the calibration guest's memory as the model takes it
(its resident RAM with --touched, else its size): the rate in the unit of the model's memory input,
which counts the zero pages QEMU sends as markers as memory moved. Rows unlike the calibration
guest (other sizes, fills, dirty rates, channel counts) then test what the model adds to it.

--calibrate-runs N: the calibration guest is migrated N times per channel count and the median
rate is taken. One migration is a noisy measure here: the same calibration guest took 1621 ms in
one run and 1015 ms in the next (2026-12-07), and every row's forecast scales with it.

Writes <out>/rows.json (one object per row: inputs, "predicted" and "actual" with totalSeconds and
downtimeSeconds, errors) and prints the table and the share of converging rows within 20%.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
from rdmiglab import Agent, QemuVm, ensure_guest, migrate_via_agents  # noqa: E402

MiB = 1 << 20


def forecast_binary():
    path = os.environ.get("RDMIG_FORECAST") or os.path.join(REPO, "build", "bench", "stream", "rdmig-forecast")
    if not os.access(path, os.X_OK):
        sys.exit("rdmig-forecast not found at %s (build it, or set RDMIG_FORECAST)" % path)
    return path


def predict(inputs):
    r = subprocess.run([forecast_binary()], input=json.dumps(inputs), capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def path_throughput(src, dst, channels, nbytes):
    t = dst.call("POST", "/v1/pathchecks", {"role": "target", "bytes": nbytes, "channels": channels,
                                            "transport": "tcp"})
    s = src.call("POST", "/v1/pathchecks", {"role": "source", "bytes": nbytes, "channels": channels,
                                            "transport": "tcp", "target": {"endpoint": t["endpoint"],
                                                                           "checkId": t["checkId"],
                                                                           "token": t["token"]}})
    deadline = time.monotonic() + 300
    while True:
        st = src.call("GET", "/v1/pathchecks/" + s["id"])
        if st["phase"] in ("Succeeded", "Failed", "Cancelled"):
            if st["phase"] != "Succeeded":
                raise RuntimeError("path check failed: %s" % st)
            return st["throughputBytesPerSecond"], st.get("rttMicroseconds", 0) / 1e6
        if time.monotonic() > deadline:
            raise TimeoutError("path check still running: %s" % st)
        time.sleep(0.1)


def err(pred, actual):
    return abs(pred - actual) / actual if actual > 0 else None


def best_possible(rows, key):
    """How many of the converged rows' actual `key` figures the best single forecast per setting
    (memory, fill, dirty rate, channels: the model's inputs) could have within 20%, when each
    setting ran more than once (--runs): a forecast F is within 20% of A when 0.8 A <= F <= 1.2 A,
    so one F covers a set of runs only if its largest figure is at most 1.5 times its smallest.
    An actual figure of 0 is within 20% of nothing (err). The bound the machine's repeatability puts
    on any forecast that gives a setting one figure; None with one run per setting."""
    groups = {}
    for r in rows:
        if r["actual"]["converged"] and r["actual"][key] is not None:
            k = (r["memMib"], r["fillPercent"], r["verifierRewriteMibPerSecond"], r["dirtyMibPerTick"], r["channels"])
            groups.setdefault(k, []).append(r["actual"][key])
    if not groups or max(len(v) for v in groups.values()) < 2:
        return None
    covered = 0
    for values in groups.values():
        v = sorted(x for x in values if x > 0)
        covered += max((sum(1 for b in v[i:] if b <= 1.5 * a) for i, a in enumerate(v)), default=0)
    return covered


def calibrate(tmp, src_agent, dst_agent, mem, fill, channels, args, n):
    """QEMU's own send rate with `channels` channels: an idle guest of `mem` MiB (filled `fill`%)
    migrated through the agents, bytes over the time it sent (total less setup and downtime): the
    bytes it transferred, or (--calibrate-over input) its memory as the model's input takes it.
    Returns (rate, query-migrate's result, the bytes counted)."""
    src, dst = guests(tmp, "cal%d" % n, mem, 0, args, fill, calibration=True)
    try:
        ready(src, args, fill)
        counted = None
        if args.calibrate_over == "input":
            counted = memory_input(src_agent, src, mem, args)
        st, _ = migrate_via_agents(src_agent, dst_agent, src.agent_qmp_path, dst.agent_qmp_path,
                                   timeout=args.timeout + 120, multifd_channels=channels - 1)
        if st["phase"] != "Succeeded":
            raise RuntimeError("calibration migration %s: %s" % (st["phase"], st.get("result")))
        res = st["result"]
        sending = (res["totalTimeMs"] - (res.get("setupTimeMs") or 0) - (res.get("downtimeMs") or 0)) / 1000.0
        if counted is None:
            counted = st["progress"]["transferredBytes"]
        return counted / sending, res, counted
    finally:
        for vm in (src, dst):
            vm.kill()


def fill_append(mem, fill, rate_mib):
    """The kernel command line words that fill `fill` % of `mem` MiB and rewrite `rate_mib` MiB/s."""
    return "rdmig.verify_mib=%d rdmig.verify_rate_mib=%s" % (max(1, mem * fill // 100), rate_mib)


def memory_input(agent, src, mem, args, dr=None):
    """The model's memory input for a guest: its resident RAM as the agent measures it (--touched),
    at most its size; else its size."""
    if not args.touched:
        return mem * MiB
    if dr is None:
        dr = agent.call("POST", "/v1/dirtyrate", {"qmpSocket": src.agent_qmp_path, "calcSeconds": 1, "samplePages": 4096})
    touched = dr.get("residentRamBytes")
    if touched is None:
        raise RuntimeError("the agent measured no resident RAM: %s" % dr.get("residentRamError"))
    return min(mem * MiB, touched)


def guests(tmp, name, mem, dirty, args, fill, calibration=False):
    """The source and the target QEMU of one row: with --fill the verifier holds the memory and its
    rewrite rate is the row's dirty rate; otherwise the dirtier rewrites `dirty` MiB per tick."""
    if fill:
        # The verifier's counter goes on only while it rewrites: an idle row rewrites almost nothing.
        append = fill_append(mem, fill, 0.01 if calibration or not dirty else dirty)
        kw = dict(mem_mib=mem, dirty_mib=0, qemu_binary=args.qemu, extra_append=append)
    else:
        kw = dict(mem_mib=mem, dirty_mib=dirty, qemu_binary=args.qemu)
    return QemuVm(tmp, name, **kw), QemuVm(tmp, name + "d", incoming_defer=True, **kw)


def ready(src, args, fill):
    if fill:
        src.wait_for_verifier(2, min_scans=1, timeout=600)  # every page written once
    else:
        src.wait_for_counter(2, timeout=120)


def run_row(tmp, src_agent, dst_agent, mem, fill, dirty, channels, args, n, max_bandwidth=None):
    src, dst = guests(tmp, "src%d" % n, mem, dirty, args, fill)
    try:
        ready(src, args, fill)
        dr = src_agent.call("POST", "/v1/dirtyrate", {"qmpSocket": src.agent_qmp_path, "calcSeconds": 1,
                                                      "samplePages": 4096})
        throughput, rtt = path_throughput(src_agent, dst_agent, channels, args.path_bytes)
        accepted, switchover = args.downtime_ms / 1000.0, args.switchover_ms / 1000.0
        inputs = {"memory": memory_input(src_agent, src, mem, args, dr), "dirtyRate": dr["dirtyRateBytesPerSecond"], "throughput": throughput,
                  "pathChannels": channels, "rttSeconds": rtt, "channels": channels,
                  "acceptedDowntime": accepted, "switchover": switchover, "completionTimeout": args.timeout,
                  "maxBandwidth": args.max_bandwidth if max_bandwidth is None else max_bandwidth}
        p = predict(inputs)
        st, _ = migrate_via_agents(src_agent, dst_agent, src.agent_qmp_path, dst.agent_qmp_path,
                                   timeout=args.timeout + 120, multifd_channels=channels - 1,
                                   maxDowntimeMs=max(1, args.downtime_ms - args.switchover_ms),
                                   completionTimeoutSeconds=int(args.timeout))
        ok = st["phase"] == "Succeeded"
        res = st.get("result") or {}
        actual = {"result": st["phase"], "converged": ok,
                  "totalSeconds": (res.get("totalTimeMs") or 0) / 1000.0 if ok else None,
                  "downtimeSeconds": (res.get("downtimeMs") or 0) / 1000.0 if ok else None,
                  "passes": (st.get("progress") or {}).get("passes"),
                  "transferredBytes": (st.get("progress") or {}).get("transferredBytes"),
                  "reason": res.get("reason", "")}
        row = {"memMib": mem, "dirtyMibPerTick": None if fill else dirty, "channels": channels,
               "fillPercent": fill, "verifierRewriteMibPerSecond": dirty if fill else None,
               "maxBandwidthInput": inputs["maxBandwidth"],
               "memoryInput": inputs["memory"],
               "residentRamBytes": dr.get("residentRamBytes"),
               "setupSeconds": (res.get("setupTimeMs") or 0) / 1000.0 if ok else None,
               "measuredDirtyRateBytesPerSecond": dr["dirtyRateBytesPerSecond"],
               "pathThroughputBytesPerSecond": throughput,
               "predicted": {"converges": p["withinLimits"], "totalSeconds": p["totalSeconds"],
                             "downtimeSeconds": p["downtimeSeconds"], "passes": p["passes"]},
               "actual": actual}
        if ok and p["withinLimits"]:
            row["errorTotal"] = err(p["totalSeconds"], actual["totalSeconds"])
            row["errorDowntime"] = err(p["downtimeSeconds"], actual["downtimeSeconds"])
        return row
    finally:
        for vm in (src, dst):
            vm.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mem", default="128,256,512,1024")
    ap.add_argument("--dirty", default="0,8,32,128")
    ap.add_argument("--channels", default="1,8")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--downtime-ms", type=int, default=300)
    ap.add_argument("--switchover-ms", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--path-bytes", default="256Mi")
    ap.add_argument("--qemu", default=None,
                    help="QEMU binary (default: Debian 13's QEMU 10 with RDMIG_TEST_QEMU=10, as the suite runs, else the host's)")
    ap.add_argument("--max-bandwidth", type=float, default=0.0,
                    help="bytes/s: QEMU's own send rate on this host, as spec.maxBandwidth states it (0: none)")
    ap.add_argument("--touched", action="store_true",
                    help="the model's memory: the guest RAM QEMU holds resident, not the VM's size (an experiment)")
    ap.add_argument("--fill", default="0",
                    help="percent of each guest's RAM its memory verifier holds written (a list: rows for each); "
                         "--dirty is then its rewrite rate in MiB/s")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure QEMU's own send rate per channel count first (an idle guest) and use it as maxBandwidth")
    ap.add_argument("--calibrate-mem", type=int, default=0, help="the calibration guest's MiB (default: the largest --mem)")
    ap.add_argument("--calibrate-fill", type=int, default=-1, help="its fill percent (default: the first --fill)")
    ap.add_argument("--calibrate-over", choices=("transferred", "input"), default="transferred",
                    help="the bytes of the calibrated rate: what QEMU transferred, or the guest's memory as the model's input")
    ap.add_argument("--calibrate-runs", type=int, default=1, help="calibration migrations per channel count (the median rate)")
    args = ap.parse_args()
    fills = [int(x) for x in args.fill.split(",")]
    if any(f < 0 or f > 95 for f in fills) or (0 in fills and len(fills) > 1):
        sys.exit("--fill: percentages from 1 to 95, or 0 alone")
    ensure_guest()
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="rdmig-drain-acc-")
    agents = [Agent(tmp, "agent-%s" % n) for n in ("a", "b")]
    rows = []
    rates = {}
    calibration = []
    try:
        n = 0
        if args.calibrate:
            cal_mem = args.calibrate_mem or max(int(x) for x in args.mem.split(","))
            cal_fill = fills[0] if args.calibrate_fill < 0 else args.calibrate_fill
            for ch in [int(x) for x in args.channels.split(",")]:
                measured = []
                for _ in range(args.calibrate_runs):
                    rate, res, counted = calibrate(tmp, agents[0], agents[1], cal_mem, cal_fill, ch, args, n)
                    n += 1
                    measured.append(rate)
                    calibration.append({"memMib": cal_mem, "fillPercent": cal_fill, "channels": ch, "over": args.calibrate_over,
                                        "bytesCounted": counted, "rateBytesPerSecond": rate, "result": res})
                    print("calibration: %d MiB idle (filled %d%%), %d channel(s): %.0f MB/s over %s (%.0f MiB; total %s ms, "
                          "setup %s ms, downtime %s ms)" % (cal_mem, cal_fill, ch, rate / 1e6, args.calibrate_over,
                                                            counted / MiB, res["totalTimeMs"], res.get("setupTimeMs"),
                                                            res.get("downtimeMs")), flush=True)
                rates[ch] = statistics.median(measured)
                if len(measured) > 1:
                    print("calibration: %d channel(s): the median, %.0f MB/s" % (ch, rates[ch] / 1e6), flush=True)
        for _ in range(args.runs):
            for mem, fill in [(int(x), f) for x in args.mem.split(",") for f in fills]:
                for dirty in [int(x) for x in args.dirty.split(",")]:
                    for ch in [int(x) for x in args.channels.split(",")]:
                        row = run_row(tmp, agents[0], agents[1], mem, fill, dirty, ch, args, n, rates.get(ch))
                        n += 1
                        rows.append(row)
                        p, a = row["predicted"], row["actual"]
                        print("%5d MiB %2d%% (in %5d) %4d MiB/%s %2d ch | predicted %s %7.2fs down %6.3fs | actual %-9s %s %s" % (
                            mem, fill, row["memoryInput"] // MiB, dirty, "s" if fill else "tick", ch, "conv" if p["converges"] else "NO  ", p["totalSeconds"],
                            p["downtimeSeconds"], a["result"],
                            "%7.2fs" % a["totalSeconds"] if a["totalSeconds"] is not None else "      -",
                            "down %6.3fs" % a["downtimeSeconds"] if a["downtimeSeconds"] is not None else ""),
                            flush=True)
    finally:
        for a in agents:
            a.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    both = [r for r in rows if "errorTotal" in r]
    within = [r for r in both if r["errorTotal"] is not None and r["errorDowntime"] is not None
              and r["errorTotal"] <= 0.2 and r["errorDowntime"] <= 0.2]
    missed = [r for r in rows if not r["actual"]["converged"] and r["predicted"]["converges"]]
    within_total = [r for r in both if r["errorTotal"] is not None and r["errorTotal"] <= 0.2]
    within_down = [r for r in both if r["errorDowntime"] is not None and r["errorDowntime"] <= 0.2]
    summary = {"rows": len(rows), "bothConverged": len(both), "within20Percent": len(within),
               "totalWithin20Percent": len(within_total), "downtimeWithin20Percent": len(within_down),
               "bestPossibleTotalWithin20Percent": best_possible(rows, "totalSeconds"),
               "bestPossibleDowntimeWithin20Percent": best_possible(rows, "downtimeSeconds"),
               "fillPercent": fills if len(fills) > 1 else fills[0],
               "nonConvergingPredictedConverging": len(missed),
               "calibratedSendRateBytesPerSecond": {str(k): v for k, v in rates.items()},
               "calibrateOver": args.calibrate_over if args.calibrate else None}
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump({"summary": summary, "calibration": calibration, "rows": rows}, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
