#!/usr/bin/python3
"""KubeVirt's post-copy migrations on KubeVirt's own path and carried by rdmig, side by side.

  /usr/bin/python3 bench/kubevirt_postcopy.py [--runs N] [--switch-after MiB] [--out BASE]

The KubeVirt-shaped harness (tools/rdmiglab/kubevirt.py, launcher row $RDMIG_KV_LAUNCHER,
by default trixie-nonroot: libvirt 11.3 and QEMU 10.0 as KubeVirt 1.9 ships them) moves one
VMI back and forth with VIR_MIGRATE_POSTCOPY, switched as KubeVirt's launcher does
(MigrateStartPostCopy) once --switch-after MiB went in pre-copy (default 32 of 256). The guest
runs its memory verifier (tools/guest/verify.c: 64 MiB rewritten at 16 MiB/s and checked
continuously), so after the switch it faults on pages the target lacks and waits for them.
  direct  KubeVirt's own path (the agents run, kubevirt.carryPostCopy on, but the hook is not
          called: nothing is carried);
  rdmig   the node hook armed: both agents carry every connection (kubevirt.carryPostCopy,
          dataPlane.failover on), TCP over loopback (no RDMA device here).
Interleaved runs, the order alternating. Per run, from libvirt's completed job on the source
(libvirt 11.3 keeps none on the target after post-copy): total time, downtime, page requests
(memory_postcopy_requests); the post-copy phase = the end of libvirt's call minus the switch;
the verifier's mismatches after the move. A run counts only if it switched, the guest's
verifier went on clean, and (rdmig) the source agent's record says carried and Succeeded.
Writes BASE.md and BASE.json (every raw run; default bench/results/kubevirt-postcopy/). Never
fails on speed.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
from rdmiglab.kvagents import KubevirtAgents  # noqa: E402
from rdmiglab.system_python import reexec_with_system_python  # noqa: E402

PATHS = ("direct", "rdmig")
FIGURES = ("total_ms", "downtime_ms", "postcopy_phase_ms", "page_requests", "wall_ms")
UFFD = "/proc/sys/vm/unprivileged_userfaultfd"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def span(xs):
    xs = [x for x in xs if x is not None]
    return (min(xs), max(xs)) if xs else (None, None)


def run_once(cluster, kv, path, switch_after):
    source = cluster.vmi.node
    before = cluster.verifier(source)
    hook = {"hook_socket": kv.hook_socket(source), "hook_timeout": 5} if path == "rdmig" else {}
    out = {"path": path, "source_node": source, "valid": False}
    try:
        cluster.migration_config_overrides = {"allowPostCopy": True}
        r = cluster.migrate(parallel=0, tls=True, postcopy=True, postcopy_after_mib=switch_after,
                            expect_success=False, **hook)
        job = r.source_job or {}
        out.update(migration_uid=r.migration_uid, success=r.success, error=r.error, wall_ms=r.wall_ms,
                   switched=bool(r.postcopy and r.postcopy.get("switched")),
                   switch_at_ms=(r.postcopy or {}).get("at_ms"),
                   total_ms=job.get("time_elapsed"), downtime_ms=job.get("downtime"),
                   page_requests=job.get("memory_postcopy_requests"))
        if out["switch_at_ms"] is not None:
            out["postcopy_phase_ms"] = round(r.wall_ms - out["switch_at_ms"], 1)
        if not r.success:
            out["invalid"] = "migration failed: %s" % r.error
            return out
        if not out["switched"]:
            out["invalid"] = "no switch to post-copy: %s" % r.postcopy
            return out
        after = cluster.wait_for_verifier(r.target_node, before["counter"] + 2, min_scans=before["scans"] + 1,
                                          timeout=120)
        out["verifier_mismatches"] = after["mismatches"]
        if after["mismatches"]:
            out["invalid"] = "the guest's verifier found %d mismatches" % after["mismatches"]
            return out
        if path == "rdmig":
            rec = kv.record(source, r.migration_uid)
            out["record_post_copy"] = rec.get("postCopy")
            if not (rec["carried"] and rec["phase"] == "Succeeded"):
                out["invalid"] = "source agent's record: carried=%s phase=%s reason=%s" % (
                    rec["carried"], rec["phase"], rec["reason"])
                return out
        elif any(kv.records(n, r.migration_uid) for n in kv.nodes):
            out["invalid"] = "an agent has a record of a direct migration"
            return out
    except Exception as e:  # reported, not counted
        out["invalid"] = "%s: %s" % (type(e).__name__, e)
        return out
    out["valid"] = True
    return out


def fmt(v, spec="%.0f"):
    return "-" if v is None else spec % v


def write_markdown(res, path):
    L = ["# KubeVirt post-copy: KubeVirt's own path vs carried by rdmig", "",
         "Launcher row: `%(flavor)s`, libvirt %(libvirt)s, QEMU %(qemu)s. Machine: nproc %(nproc)d, kernel %(kernel)s. "
         "%(date)s." % dict(res["machine"], **res["launcher"]),
         "Command: `%s`." % res["command"], "",
         "Guest: 256 MiB under TCG, its memory verifier rewriting 64 MiB at 16 MiB/s; one connection with "
         "KubeVirt's TLS (QEMU 10.0 refuses multifd with post-copy); switched once %d MiB went in pre-copy. "
         "Figures from libvirt's completed job on the source; post-copy phase = the end of libvirt's call "
         "minus the switch (as the harness saw both). Medians of %d interleaved runs per path, min-max in "
         "brackets; ratio = rdmig / direct of the medians." % (res["switch_after_mib"], res["runs_per_path"]), "",
         "| figure | direct | rdmig | ratio |", "|---|---|---|---|"]
    for k in FIGURES:
        d, v = res["summary"]["direct"][k], res["summary"]["rdmig"][k]
        L.append("| %s | %s [%s-%s] | %s [%s-%s] | %s |" % (
            k, fmt(d["median"]), fmt(d["min"]), fmt(d["max"]), fmt(v["median"]), fmt(v["min"]), fmt(v["max"]),
            fmt(v["median"] / d["median"] if d["median"] and v["median"] is not None else None, "%.2f")))
    bad = [r for r in res["runs"] if not r["valid"]]
    L += ["", "Valid runs: direct %d, rdmig %d; invalid (reported, not counted): %d." % (
        res["summary"]["direct"]["n"], res["summary"]["rdmig"]["n"], len(bad))]
    L += ["- %s: %s" % (r["path"], r["invalid"]) for r in bad]
    L += ["", "Every byte of the rdmig runs, both ways (the stream and the target's page requests), went "
          "through the two agents over TCP on loopback: two more user-space hops on the same 2 cores. "
          "Page requests and the post-copy phase depend on what the guest touches after the switch; "
          "read them with their spread. Raw runs: `%s`." % os.path.basename(path[:-3] + ".json"), ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per path (default 5)")
    ap.add_argument("--switch-after", type=int, default=32, help="MiB of pre-copy before the switch (default 32)")
    ap.add_argument("--out", help="output base (default bench/results/kubevirt-postcopy/<row>-<nproc>vcpu-tcg)")
    args = ap.parse_args()
    flavor = os.environ.get("RDMIG_KV_LAUNCHER") or "trixie-nonroot"
    if flavor != "trixie-nonroot":
        ap.error("post-copy runs on the trixie-nonroot row (libvirt 11, QEMU 10)")
    base = args.out or os.path.join(REPO, "bench", "results", "kubevirt-postcopy", "%s-%dvcpu-tcg" % (flavor, os.cpu_count()))
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import kubevirt as kvbench  # the machine and launcher descriptions of bench/kubevirt.py
    from rdmiglab.kubevirt import KubevirtCluster
    with open(UFFD) as f:
        uffd_before = f.read().strip()
    work = tempfile.mkdtemp(prefix="rdmig-kvpcbench-")
    res = {"command": " ".join(["/usr/bin/python3", "bench/kubevirt_postcopy.py"] + sys.argv[1:]),
           "machine": kvbench.machine(), "switch_after_mib": args.switch_after, "runs_per_path": args.runs, "runs": []}
    try:
        with open(UFFD, "w") as f:  # KubeVirt's non-root post-copy needs it (docs/kubevirt.md "Post-copy")
            f.write("1")
        with KubevirtCluster() as cluster, KubevirtAgents(work, cluster.nodes, transport="tcp",
                                                          data_plane={"failover": "on"},
                                                          kubevirt={"carryPostCopy": True}) as kv:
            cluster.define_and_start_vmi("pcbench", "default", mem_mib=256, dirty_mib=0, boot_counter=2,
                                         verify_mib=64, verify_rate_mib=16)
            cluster.wait_for_verifier(cluster.vmi.node, 2, min_scans=1, timeout=120)
            res["launcher"] = kvbench.launcher_row(cluster)
            for i in range(args.runs):
                for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
                    r = run_once(cluster, kv, path, args.switch_after)
                    res["runs"].append(r)
                    print("run %d %-6s %s" % (i + 1, path, (
                        "total %s ms  downtime %s ms  post-copy phase %s ms  page requests %s" % (
                            r["total_ms"], r["downtime_ms"], r.get("postcopy_phase_ms"), r["page_requests"]))
                        if r["valid"] else "INVALID: " + r["invalid"]), flush=True)
    finally:
        with open(UFFD, "w") as f:
            f.write(uffd_before)
        shutil.rmtree(work, ignore_errors=True)
    res["summary"] = {}
    for path in PATHS:
        ok = [r for r in res["runs"] if r["valid"] and r["path"] == path]
        res["summary"][path] = {"n": len(ok)}
        for k in FIGURES:
            xs = [r.get(k) for r in ok]
            lo, hi = span(xs)
            res["summary"][path][k] = {"median": med(xs), "min": lo, "max": hi}
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    write_markdown(res, base + ".md")
    with open(base + ".md") as f:
        print("\n" + f.read())
    return 0


if __name__ == "__main__":
    reexec_with_system_python()
    sys.exit(main())
