# Per run of probe.py: libvirt's downtime and the most bytes queued at once in the TCP sockets of
# the three network namespaces (host: the agents' data plane; the two virt-handler namespaces),
# split by where they were; medians per path.
import bisect, json, statistics, sys
def load(d):
    runs = json.load(open(d + "/runs.json"))
    series = {}
    for lab in ("host", "a", "b"):
        ts, rows = [], []
        for line in open("%s/q-%s.jsonl" % (d, lab)):
            o = json.loads(line); ts.append(o["t"]); rows.append(o["s"])
        series[lab] = (ts, rows)
    out = []
    for r in runs:
        if not r.get("valid"): continue
        t0, t1 = float(r["t0"]), float(r["t1"])
        best = 0
        t = t0
        while t < t1:
            tot = 0
            for lab in series:
                ts, rows = series[lab]
                i = bisect.bisect_right(ts, t) - 1
                if i >= 0 and t - ts[i] <= 0.02: tot += sum(x[2] + x[3] for x in rows[i])
            best = max(best, tot); t += 0.005
        out.append((r["path"], r["downtime_ms"], best / 2**20))
    return out
for d in sys.argv[1:]:
    rs = load(d)
    for p in ("direct", "rdmig"):
        x = [r for r in rs if r[0] == p]
        print("%-22s %-6s runs %d  downtime ms %s (median %.0f)  most queued MiB %s (median %.1f)" % (
            d.split("/")[-1], p, len(x), " ".join("%d" % r[1] for r in x), statistics.median(r[1] for r in x),
            " ".join("%.1f" % r[2] for r in x), statistics.median(r[2] for r in x)))
