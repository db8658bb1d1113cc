#!/usr/bin/python3
"""KubeVirt's migration path without rdmig and with rdmig carrying it, side by side (issue 9).

  /usr/bin/python3 bench/kubevirt.py [--runs N] [--mem MiB] [--dirty MiB/s] [--quick] [--out BASE]
                                     [--agent-migration JSON] [--agent-kubevirt JSON] [--rows on/0,...]

Launcher row: $RDMIG_KV_LAUNCHER (tests/kubevirt/README.md), by default trixie-nonroot
(KubeVirt 1.9's non-root launcher: libvirt 11.3 session daemon as uid 107, QEMU 10.0,
proxies dialling in no fixed order); bookworm-root is the root launcher (libvirt 9.0, QEMU
7.2, dials in accept order). The results name the row, the machine and the launcher's own
libvirt and QEMU versions (asked of the pods' daemons), and go by default to
bench/results/kubevirt/<row>-<nproc>vcpu-tcg.{md,json}.

One VMI in the KubeVirt-shaped harness (tools/rdmiglab/kubevirt.py: two real libvirtd
launcher pods, two virt-handler network namespaces, the migration-proxy stand-in with mTLS)
goes back and forth between the two nodes:
  direct  KubeVirt's own path: source proxy -> pod network (veth) -> target proxy;
  rdmig   the same, with the PreMigrationSource node hook served by two real rdmig agents in
          KubeVirt mode, which redirect the memory connections and carry them agent to agent.
For TLS on/off x 0/8 parallel connections, with a running target (target_paused=False),
interleaved runs (the order alternates every run so drift hits both paths). Per run:
libvirt's total time and downtime (the target's completed job), throughput (data bytes /
total time), CPU seconds of the two proxy processes and of the two agents (/proc/<pid>/stat
utime+stime before and after). An rdmig run counts only if the source agent's record says
carried=true and phase Succeeded; a direct run only if no agent has a record of it.
--agent-migration: the agents' `migration` settings (their YAML config's section, as JSON, e.g.
'{"chunkSize": 4194304}'); --agent-kubevirt: extra keys of their `kubevirt` section (e.g.
'{"ringDepth": 16}': the carried connections' chunks in flight). By default the agents' defaults.
Both are named in the results. --rows: only these TLS/parallel rows (default all four:
on/0,on/8,off/0,off/8).
Writes BASE.md and BASE.json (every raw run). Never fails on speed.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
from rdmiglab.kvagents import KubevirtAgents  # noqa: E402
from rdmiglab.system_python import reexec_with_system_python  # noqa: E402

PATHS = ("direct", "rdmig")
CLK_TCK = os.sysconf("SC_CLK_TCK")
FIGURES = ("total_time_ms", "downtime_ms", "throughput_bps", "proxy_cpu_s", "agent_cpu_s", "cpu_s")


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return (a / b) if (a is not None and b not in (None, 0)) else None


def fmt(v, spec="%.0f"):
    return "-" if v is None else spec % v


def machine():
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    first = lambda argv: (subprocess.run(argv, capture_output=True, text=True).stdout.splitlines() or ["?"])[0]  # noqa: E731
    return {"nproc": os.cpu_count(), "cpu": cpu, "kernel": os.uname().release,
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "qemu": first(["qemu-system-x86_64", "--version"]), "libvirt": first(["/usr/sbin/libvirtd", "--version"]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_at_start": loadavg()}


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def cpu_busy(seconds):
    """Fraction of all CPUs busy over ``seconds`` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def other_cpu_probe():
    """(CPU seconds all CPUs were busy so far, CPU seconds of this benchmark's process tree so
    far): the difference of their deltas over a run is what everything else used (other
    processes, and kernel work not charged to a process)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    busy = (sum(v) - v[3] - v[4]) / CLK_TCK
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # utime+stime+cutime+cstime: a reaped child's time moves into its parent's.
        procs[int(pid)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / CLK_TCK)
    ours = {os.getpid()}
    for _ in range(64):  # descendants, to a fixed depth
        more = {p for p, v in procs.items() if v[0] in ours} - ours
        if not more:
            break
        ours |= more
    return busy, sum(procs[p][1] for p in ours if p in procs)


def other_cpu(before, after):
    return round((after[0] - before[0]) - (after[1] - before[1]), 2)


def run_once(cluster, kv, path, tls, parallel):
    """One migration on ``path``; returns its raw record (valid=False with a reason if it
    does not count)."""
    from rdmiglab.kubevirt import proc_cpu_seconds
    source = cluster.vmi.node
    pids = {n: kv[n].proc.pid for n in kv.nodes}
    cpu0 = {n: proc_cpu_seconds(p) for n, p in pids.items()}
    hook = {"hook_socket": kv.hook_socket(source), "hook_timeout": 5} if path == "rdmig" else {}
    out = {"path": path, "tls": tls, "parallel": parallel, "source_node": source, "valid": False,
           "loadavg_before": loadavg()}
    other0 = other_cpu_probe()
    try:
        r = cluster.migrate(parallel=parallel, tls=tls, target_paused=False, expect_success=False, **hook)
        out.update(migration_uid=r.migration_uid, success=r.success, error=r.error, wall_ms=r.wall_ms,
                   total_time_ms=r.total_time_ms, downtime_ms=r.downtime_ms, data_bytes=r.data_bytes,
                   throughput_bps=r.throughput_bps, proxy_cpu_s_each=r.handler_cpu_s,
                   counter_before=r.counter_before, counter_after=r.counter_after)
        if not r.success:
            out["invalid"] = "migration failed: %s" % r.error
            return out
        if path == "rdmig":
            rec = kv.record(source, r.migration_uid)
            out["record"] = rec
            if not (rec["carried"] and rec["phase"] == "Succeeded"):
                out["invalid"] = "source agent's record: carried=%s phase=%s reason=%s" % (
                    rec["carried"], rec["phase"], rec["reason"])
                return out
        else:
            seen = {n: kv.records(n, r.migration_uid) for n in kv.nodes}
            if any(seen.values()):
                out["invalid"] = "an agent has a record of a direct migration: %s" % seen
                return out
    except Exception as e:  # a guest that died, a record that never came: reported, not counted
        out["invalid"] = "%s: %s" % (type(e).__name__, e)
        return out
    cpu1 = {n: proc_cpu_seconds(p) for n, p in pids.items()}
    out["other_cpu_s"] = other_cpu(other0, other_cpu_probe())
    out["agent_cpu_s_each"] = {n: round(cpu1[n] - cpu0[n], 3) for n in pids
                               if cpu0[n] is not None and cpu1[n] is not None}
    out["agent_cpu_s"] = round(sum(out["agent_cpu_s_each"].values()), 3)
    out["proxy_cpu_s"] = round(sum(v for v in r.handler_cpu_s.values() if v is not None), 3)
    out["cpu_s"] = round(out["agent_cpu_s"] + out["proxy_cpu_s"], 3)
    out["valid"] = True
    return out


def summarize(runs):
    ok = [r for r in runs if r["valid"]]
    other = [r["other_cpu_s"] for r in ok if r.get("other_cpu_s") is not None]
    return dict({k: med([r.get(k) for r in ok]) for k in FIGURES}, n=len(ok), invalid=len(runs) - len(ok),
                other_cpu_max=max(other) if other else None)


def cpu_per_gib(runs):
    out = {}
    for path in PATHS:
        ok = [r for r in runs if r["valid"] and r["path"] == path]
        gib = sum(r["data_bytes"] for r in ok) / 2**30
        for what in ("proxy", "agent"):
            out["%s_%s" % (what, path)] = (sum(r[what + "_cpu_s"] for r in ok) / gib) if gib else None
    return out


def table(rows):
    mib = lambda v: None if v is None else v / 2**20  # noqa: E731
    L = ["| TLS | parallel | runs direct / rdmig | total ms direct / rdmig | ratio | downtime ms direct / rdmig | ratio "
         "| throughput MiB/s direct / rdmig | ratio | proxy CPU s direct / rdmig | agent CPU s direct / rdmig "
         "| proxies+agents CPU s | ratio | other CPU s, max |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        d, v, q = row["direct"], row["rdmig"], row["ratios"]
        L.append("| %s | %d | %d / %d | %s / %s | %s | %s / %s | %s | %s / %s | %s | %s / %s | %s / %s | %s / %s | %s | %s |" % (
            "on" if row["tls"] else "off", row["parallel"], d["n"], v["n"],
            fmt(d["total_time_ms"]), fmt(v["total_time_ms"]), fmt(q["total_time_ms"], "%.2f"),
            fmt(d["downtime_ms"]), fmt(v["downtime_ms"]), fmt(q["downtime_ms"], "%.2f"),
            fmt(mib(d["throughput_bps"]), "%.1f"), fmt(mib(v["throughput_bps"]), "%.1f"), fmt(q["throughput_bps"], "%.2f"),
            fmt(d["proxy_cpu_s"], "%.2f"), fmt(v["proxy_cpu_s"], "%.2f"),
            fmt(d["agent_cpu_s"], "%.2f"), fmt(v["agent_cpu_s"], "%.2f"),
            fmt(d["cpu_s"], "%.2f"), fmt(v["cpu_s"], "%.2f"), fmt(q["cpu_s"], "%.2f"),
            fmt(max([d.get("other_cpu_max") or 0, v.get("other_cpu_max") or 0]), "%.1f")))
    return L


def write_markdown(res, path):
    m = res["machine"]
    row = res.get("launcher") or {}
    L = ["# KubeVirt path: direct vs carried by rdmig" + (" (%s row)" % row["flavor"] if row else ""), ""]
    if row:
        L += ["Launcher row: `%s` (%s): libvirt %s and QEMU %s in the launcher pods, their daemon as uid %s; "
              "proxies dial %s." % (row["flavor"], row["stands_for"], row["libvirt"], row["qemu"], row["daemon_uid"],
                                   row["dial_order"]), ""]
    L += ["Machine: nproc %(nproc)d (%(cpu)s), %(mem_gib)s GiB, kernel %(kernel)s, host's %(qemu)s, %(libvirt)s. %(date)s." % m,
         "Command: `%s`. CPUs %s%% busy in the 2 s before it started (it wants an otherwise "
         "idle machine)." % (res["command"], fmt(100 * m["cpu_busy_before_start"] if "cpu_busy_before_start" in m else None)), "",
         "Guest: %(mem_mib)d MiB under TCG, dirtying %(dirty_mib_s)d MiB/s; running target (not paused); "
         "medians of %(runs)d interleaved runs per path (order alternating). Agents' transport: %(transport)s "
         "(no RDMA device here), data plane on 127.0.0.1; agents' migration settings: %(migration_text)s; "
         "their kubevirt settings beyond the harness's: %(kubevirt_text)s." % dict(
             res["setup"], migration_text=json.dumps(res["setup"]["agent_migration"])
             if res["setup"].get("agent_migration") else "their defaults",
             kubevirt_text=json.dumps(res["setup"]["agent_kubevirt"])
             if res["setup"].get("agent_kubevirt") else "their defaults"), "",
         "total / downtime = libvirt's completed job on the target (time_elapsed, downtime); throughput = "
         "data bytes / total time; proxy CPU = the two migration-proxy stand-in processes (Python, hashing "
         "every byte for the harness's checks: not virt-handler's cost); agent CPU = both rdmig agents, "
         "utime+stime over the migration. Ratios are rdmig / direct of the medians. Other CPU: CPU time all cores were busy during "
         "a run minus what the benchmark's own processes used (other processes, plus kernel work not charged to "
         "a process): a check that the machine was otherwise idle.", ""]
    L += table(res["rows"])
    pg = res.get("cpu_per_gib") or {}
    L += ["", "CPU seconds per GiB of libvirt data, all valid runs: proxies %s (direct) / %s (rdmig); agents %s "
          "(rdmig runs; on direct runs the agents are not involved, see the table)." % (
              fmt(pg.get("proxy_direct"), "%.1f"), fmt(pg.get("proxy_rdmig"), "%.1f"), fmt(pg.get("agent_rdmig"), "%.1f"))]
    L += ["", "Spread of the valid runs (min-max), the noise the medians sit in:", "",
          "| TLS | parallel | total ms direct | total ms rdmig | downtime ms direct | downtime ms rdmig |", "|---|---|---|---|---|---|"]
    for row in res["rows"]:
        span = lambda path, k: "%s-%s" % tuple(fmt(f(x[k] for x in res["runs"] if x["valid"] and x["path"] == path  # noqa: E731
                                                        and x["tls"] == row["tls"] and x["parallel"] == row["parallel"]))
                                                for f in (min, max))
        L.append("| %s | %d | %s | %s | %s | %s |" % ("on" if row["tls"] else "off", row["parallel"],
                                                    span("direct", "total_time_ms"), span("rdmig", "total_time_ms"),
                                                    span("direct", "downtime_ms"), span("rdmig", "downtime_ms")))
    L += ["", "What this setup is: every process on one host with %d cores: two TCG QEMUs, two libvirtd, the two "
          "proxies and the two agents compete for them. The pod network is a veth pair between two network "
          "namespaces; the agents' data plane is TCP over loopback, so with rdmig each memory byte makes two more "
          "user-space hops (source proxy -> source agent -> target agent -> target proxy) and the agents' CPU comes "
          "out of the same cores. TLS stays where KubeVirt puts it (the proxies); the agents carry its ciphertext. "
          "Nothing here measures RDMA hardware, a 25G pod network or real virt-handler: see README, "
          "\"Benchmarks\" / \"KubeVirt path\", for what that means for a cluster (reasoning, not measured)."
          % res["machine"]["nproc"]]
    deaths = res.get("guest_deaths") or {}
    L += ["", "Guest deaths right after a migration (a TCG guest panic seen with QEMU 7.2, also by bench/run.py; "
          "the run's figures count, the guest is booted again): direct %s, rdmig %s." % (
              deaths.get("direct", "-"), deaths.get("rdmig", "-"))]
    bad = [r for r in res["runs"] if not r["valid"]]
    L += ["", "Invalid runs (reported, not counted): %d." % len(bad)]
    L += ["- %s TLS=%s parallel=%d: %s" % (r["path"], r["tls"], r["parallel"], r["invalid"]) for r in bad]
    if "aborted" in res:
        L += ["", "**Stopped early**: %s" % res["aborted"]]
    L += ["", "Raw runs: `%s`." % os.path.basename(path[:-3] + ".json"), ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs per path and configuration (default 5, at least 3)")
    ap.add_argument("--mem", type=int, default=256, help="guest RAM in MiB (default 256)")
    ap.add_argument("--dirty", type=int, default=16, help="MiB the guest dirties per second (default 16)")
    ap.add_argument("--quick", action="store_true", help="smoke check: 1 run each, TLS with 8 parallel only")
    ap.add_argument("--out", help="output base name (default bench/results/kubevirt/<row>-<nproc>vcpu-tcg; "
                                  "with --quick a temporary directory)")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the .md next to JSON from its raw runs")
    ap.add_argument("--agent-migration", metavar="JSON",
                    help="the agents' migration settings, e.g. '{\"chunkSize\": 4194304}' (default: their defaults)")
    ap.add_argument("--agent-kubevirt", metavar="JSON",
                    help="extra keys of the agents' kubevirt settings, e.g. '{\"ringDepth\": 16}' (default: their defaults)")
    ap.add_argument("--rows", metavar="LIST", help="only these TLS/parallel rows, e.g. on/0,off/8 (default all four)")
    args = ap.parse_args()
    def json_object(option, text, what):
        if not text:
            return text
        try:
            value = json.loads(text)
        except ValueError as e:
            ap.error("%s: not JSON: %s" % (option, e))
        if not isinstance(value, dict):
            ap.error("%s: a JSON object of %s" % (option, what))
        return value
    args.agent_migration = json_object("--agent-migration", args.agent_migration, "the agents' migration settings")
    args.agent_kubevirt = json_object("--agent-kubevirt", args.agent_kubevirt, "keys for the agents' kubevirt section")
    if args.render:
        with open(args.render) as f:
            write_markdown(json.load(f), args.render[:-5] + ".md")
        return 0
    runs = 1 if args.quick else args.runs
    configs = [(True, 8)] if args.quick else [(True, 0), (True, 8), (False, 0), (False, 8)]
    if args.rows:
        wanted = []
        for item in args.rows.split(","):
            tls, _, par = item.partition("/")
            if tls not in ("on", "off") or not par.isdigit():
                ap.error("--rows: expected a list like on/0,off/8, got %r" % item)
            wanted.append((tls == "on", int(par)))
        configs = [c for c in configs if c in wanted] if not args.quick else configs
        if not configs:
            ap.error("--rows: none of on/0, on/8, off/0, off/8")
    flavor = os.environ.get("RDMIG_KV_LAUNCHER") or "trixie-nonroot"
    base = args.out or (os.path.join(tempfile.mkdtemp(prefix="rdmig-kvbench-"), "quick") if args.quick
                        else os.path.join(REPO, "bench", "results", "kubevirt",
                                          "%s-%dvcpu-tcg" % (flavor, os.cpu_count())))
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background

    busy = cpu_busy(2.0)
    if busy > 0.2:
        print("warning: the CPUs were %.0f%% busy before starting: something else is running" % (busy * 100), flush=True)
    res = {"machine": dict(machine(), cpu_busy_before_start=round(busy, 3)), "command": " ".join(["/usr/bin/python3", "bench/kubevirt.py"] + sys.argv[1:]),
           "setup": {"mem_mib": args.mem, "dirty_mib_s": args.dirty, "runs": runs, "transport": "tcp",
                     "target_paused": False, "agent_migration": args.agent_migration,
                     "agent_kubevirt": args.agent_kubevirt}, "runs": [], "rows": [],
           "guest_deaths": {p: 0 for p in PATHS}}
    work = tempfile.mkdtemp(prefix="rdmig-kvbench-work-")
    t0 = time.monotonic()
    try:
        measure(args, res, configs, runs, work)
    except Exception as e:  # keep what was measured; say why it stopped
        res["aborted"] = "%s: %s" % (type(e).__name__, e)
        print("ABORTED: " + res["aborted"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    if "aborted" in res:
        base += "-aborted"  # never over a complete result
    res["cpu_per_gib"] = cpu_per_gib(res["runs"])
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    write_markdown(res, base + ".md")
    print("\n" + "\n".join(table(res["rows"])))
    print("\nwrote %s.md and %s.json (%.0f s)" % (base, base, res["elapsed_s"]))
    return 1 if "aborted" in res else 0


def revive(cluster):
    """QEMU 7.2 TCG guests sometimes panic right after a migration, on KubeVirt's own path too
    (bench/run.py sees it QEMU to QEMU). If the guest is gone, boots it again where it is
    (libvirt truncates its serial file) and returns True."""
    node = cluster.vmi.node
    conn = cluster.connect(node)
    try:
        dom = conn.lookupByName(cluster.vmi.domain)
        if dom.isActive() == 1:
            return False
        dom.create()
    finally:
        conn.close()
    cluster.wait_for_counter(node, 2, 120)
    return True


def launcher_row(cluster):
    """The row this ran on, as the launcher pods' own daemon reports it."""
    conn = cluster.connect(cluster.vmi.node)
    try:
        qv, lv = conn.getVersion(), conn.getLibVersion()
    finally:
        conn.close()
    uid = None  # libvirtd's, a child of the pod's init (setpriv exec'd it)
    pid1 = cluster.pods[cluster.vmi.node].pid1
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/status" % pid) as f:
                st = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except OSError:
            continue
        if st.get("Name") == "libvirtd" and st.get("PPid") == str(pid1):
            uid = st["Uid"].split()[0]
    dial = os.environ.get("RDMIG_KV_DIAL_ORDER") or ("concurrent" if cluster.nonroot else "accept")
    return {"flavor": cluster.flavor,
            "stands_for": "KubeVirt 1.9's default non-root launcher" if cluster.nonroot
            else "the root launcher of KubeVirt's Root gate",
            "qemu": "%d.%d.%d" % (qv // 1000000, qv // 1000 % 1000, qv % 1000),
            "libvirt": "%d.%d.%d" % (lv // 1000000, lv // 1000 % 1000, lv % 1000),
            "daemon_uid": uid or "?",
            "dial_order": {"concurrent": "in no fixed order (a thread per connection, as KubeVirt's proxy)",
                           "accept": "in accept order (QEMU 7.2 needs its main channel first)",
                           "shuffle": "shuffled on purpose"}.get(dial, dial)}


def measure(args, res, configs, runs, work):
    from rdmiglab.kubevirt import KubevirtCluster
    with KubevirtCluster() as cluster, KubevirtAgents(work, cluster.nodes, transport="tcp",
                                                      migration=args.agent_migration,
                                                      kubevirt=args.agent_kubevirt) as kv:
        cluster.define_and_start_vmi("benchvm", "default", mem_mib=args.mem, dirty_mib=args.dirty, boot_counter=2)
        res["launcher"] = launcher_row(cluster)
        print("launcher row: %s" % res["launcher"], flush=True)
        print("guest up (%d MiB, dirtying %d MiB/s); agents on %s" % (
            args.mem, args.dirty, ", ".join("%s %s" % (n, kv[n].url) for n in kv.nodes)), flush=True)
        last = {"path": "direct"}  # the last migration that completed (nothing yet: boot)
        for tls, parallel in configs:
            per = {p: [] for p in PATHS}
            for i in range(runs):
                for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
                    if revive(cluster):  # gone since the last migration: counted against that one's path
                        res["guest_deaths"][last["path"]] += 1
                        last["guest_died_after"] = True
                        print("  the guest died after that %s migration (TCG guest panic); booted it again on %s"
                              % (last["path"], cluster.vmi.node), flush=True)
                    r = run_once(cluster, kv, path, tls, parallel)
                    res["runs"].append(r)
                    per[path].append(r)
                    print("TLS %-3s parallel %d run %d %-6s %s" % (
                        "on" if tls else "off", parallel, i + 1, path,
                        ("total %5.0f ms  downtime %4.0f ms  %5.1f MiB/s  proxy CPU %.2f s  agent CPU %.2f s  "
                         "other CPU %.2f s" % (r["total_time_ms"], r["downtime_ms"], r["throughput_bps"] / 2**20,
                                                      r["proxy_cpu_s"], r["agent_cpu_s"], r["other_cpu_s"])) if r["valid"] else "INVALID: " + r["invalid"]), flush=True)
                    if r.get("success"):
                        last = r
            d, v = summarize(per["direct"]), summarize(per["rdmig"])
            res["rows"].append({"tls": tls, "parallel": parallel, "direct": d, "rdmig": v,
                                "ratios": {k: ratio(v[k], d[k]) for k in FIGURES}})


if __name__ == "__main__":
    reexec_with_system_python()
    sys.exit(main())
