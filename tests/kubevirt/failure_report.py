"""The report of tests/kubevirt/failure_tries.py: its tries (one JSON object each) summed up
per fault kind as markdown tables (bench/results/kubevirt-failures/)."""
import json
import statistics

FAULTS = ("target-agent", "source-agent", "target-qemu", "target-pod", "link-cut")
ABORT_GRACE_S = 5.0  # src/kubevirt/flow/relay_internal.h kAbortGrace


def summarize(rows):
    """One table row per fault kind."""
    out = []
    for fault in FAULTS:
        rs = [r for r in rows if r.get("fault") == fault]
        if not rs:
            continue
        inj = [r for r in rs if r.get("injected")]
        hit = [r for r in inj if not r.get("success")]
        fails = [r["fail_s"] for r in hit if r.get("fail_s") is not None]
        rets = [r["libvirt_return_s"] for r in hit if r.get("libvirt_return_s") is not None]
        errors = {}
        for r in hit:
            e = (r.get("error") or "none")
            e = e.split(": ", 1)[-1][:110]
            errors[e] = errors.get(e, 0) + 1
        out.append({
            "fault": fault, "tries": len(rs), "injected": len(inj), "failed": len(hit),
            "fail_median": statistics.median(fails) if fails else None, "fail_max": max(fails) if fails else None,
            "fail_unseen": len(hit) - len(fails),
            "ret_median": statistics.median(rets) if rets else None, "ret_max": max(rets) if rets else None,
            "pod_deleted": len([r for r in hit if r.get("target_pod_deleted_by_harness")]),
            "one_place": len([r for r in inj if r.get("vm_in_one_place")]),
            "not_carried": len([r for r in rs if not r.get("injected") and not r.get("exception")]),
            "again": len([r for r in rs if r.get("followup", {}).get("ok")]),
            "again_carried": len([r for r in rs if r.get("followup", {}).get("ok")
                                  and r["followup"].get("carried")]),
            "again_first": len([r for r in rs if r.get("followup", {}).get("attempt") == 1]),
            "on_failure": on_failure_counts(hit),
            "aborts": abort_counts(hit),
            "wedges": len([r for r in rs if r.get("wedge")]),
            "exceptions": len([r for r in rs if r.get("exception")]),
            "errors": errors,
        })
    return out


def abort_counts(rows):
    """The source agent's abort at the end of its grace, counted by outcome: {"no job": 8, ...}."""
    out = {}
    for r in rows:
        k = (r.get("abort") or {}).get("outcome", "-")
        out[k] = out.get(k, 0) + 1
    return out


def on_failure_counts(rows):
    """What the source agent's record says a failure did to the multifd connections, counted:
    {"reset by qemu 10.0.13": 9, ...} (source records only; a killed source agent keeps none)."""
    out = {}
    for r in rows:
        of = (r.get("source_record") or {}).get("onFailure")
        k = ("%s by %s" % (of.get("multifd"), of.get("by"))) if of else "-"
        out[k] = out.get(k, 0) + 1
    return out


def fmt(v):
    return "-" if v is None else ("%.2f" % v if isinstance(v, float) else str(v))


def summary_table(rows):
    lines = ["| fault | tries | injected (migration failed) | fail median s | fail max s | return median s "
             "| return max s | pod del | one place | again (1st / carried) | wedges | no fault (not carried "
             "or done first) | exceptions | multifd on failure (source record) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summarize(rows):
        lines.append("| %s | %d | %d (%d) | %s | %s%s | %s | %s | %d | %d/%d | %d (%d / %d) | %d | %d | %d | %s |" % (
            s["fault"], s["tries"], s["injected"], s["failed"], fmt(s["fail_median"]), fmt(s["fail_max"]),
            (" (%d unseen)" % s["fail_unseen"]) if s["fail_unseen"] else "", fmt(s["ret_median"]),
            fmt(s["ret_max"]), s["pod_deleted"], s["one_place"], s["injected"], s["again"], s["again_first"],
            s["again_carried"], s["wedges"], s["not_carried"], s["exceptions"],
            ", ".join("%s: %d" % kv for kv in sorted(s["on_failure"].items()))))
    return "\n".join(lines)


def grace_table(rows):
    """The abort grace against what libvirt and QEMU did by themselves, per fault: how often
    the source QEMU had failed, and libvirt's call had returned, before the grace ended."""
    lines = ["| fault | failed tries with the source agent's grace line | QEMU failed before the grace ended "
             "| libvirt returned before it | at the grace's end: no job / job left alone (newer, older) / "
             "aborted / abort refused | session failed after the fault: median / max s | the agent logged its abort decision "
             "after the session failed: median / max s |", "|---|---|---|---|---|---|---|"]
    for fault in FAULTS:
        rs = [r for r in rows if r.get("fault") == fault and r.get("injected") and not r.get("success")
              and (r.get("abort") or {}).get("grace_end_s") is not None]
        if not rs:
            continue
        # The grace's end: kAbortGrace after the session failed (the agent's line can come later:
        # its libvirt calls wait while libvirt's job holds the domain).
        ends = [r["abort"].get("session_failed_s", 0.0) + ABORT_GRACE_S for r in rs]
        sess = [r["abort"]["session_failed_s"] for r in rs if r["abort"].get("session_failed_s") is not None]
        after = [r["abort"]["grace_end_s"] - r["abort"]["session_failed_s"] for r in rs
                 if r["abort"].get("session_failed_s") is not None]
        qemu_first = len([r for r, e in zip(rs, ends) if r.get("fail_s") is not None and r["fail_s"] < e])
        lv_first = len([r for r, e in zip(rs, ends) if r.get("libvirt_return_s") is not None
                        and r["libvirt_return_s"] < e])
        oc = abort_counts(rs)
        lines.append("| %s | %d | %d | %d | %d / %d / %d / %d | %s / %s | %s / %s |" % (
            fault, len(rs), qemu_first, lv_first, oc.get("no job", 0),
            oc.get("newer job", 0) + oc.get("older job", 0), oc.get("aborted", 0), oc.get("abort refused", 0),
            fmt(statistics.median(sess)) if sess else "-", fmt(max(sess)) if sess else "-",
            fmt(statistics.median(after)) if after else "-", fmt(max(after)) if after else "-"))
    return "\n".join(lines)


def markdown(rows, meta):
    lines = ["# rdmig under KubeVirt: failure tries", "",
             "Machine: %s. Launcher row: %s. %d parallel connections, TLS %s, fault after %d MiB "
             "carried. Run %s. Agent %s, git %s, kubevirt.multifdOnFailure: %s." % (
                 meta["machine"], meta["flavor"], meta["parallel"], "on" if meta["tls"] else "off",
                 meta["fault_after_mib"], meta["started"], meta.get("agent"), meta.get("git"),
                 meta.get("multifd_on_failure", "-")),
             "",
             "Times from the fault: `fail` = the source QEMU's migration seen failed/cancelled "
             "(harness QMP poll, 0.25 s steps); `return` = libvirt's migrateToURI3 returned "
             "(the harness destroys the target domain, as KubeVirt deletes the target pod, when the call "
             "outlives the source's failure by 5 s: `pod del`). `one place`: source domain running, guest "
             "counter advancing, no active domain and no QEMU in the target pod. `again`: a follow-up "
             "migration succeeded (first attempt / of which carried by rdmig). `wedge`: source QEMU "
             "migration threads alive 15 s after the failure, or `duplicate yank`/`migration process in "
             "progress` on the follow-up.", "",
             summary_table(rows)]
    summ = summarize(rows)
    lines.append("")
    if meta.get("batches"):
        lines += ["Batches (each on a cluster of its own, holding the machine's QEMU lock; load average "
                  "1/5/15 min of the whole machine, shared with other engineers' tests and builds):", "",
                  "| batch | fault | tries | UTC | lock wait s | load at start | load at end |",
                  "|---|---|---|---|---|---|---|"]
        for b in meta["batches"]:
            lines.append("| %d | %s | %d | %s-%s | %s | %s | %s |" % (
                b["n"], b["fault"], b["tries"], b["started"], b.get("ended", "?"), fmt(b["lock_wait_s"]),
                " ".join("%.2f" % x for x in b["load_start"]),
                " ".join("%.2f" % x for x in b.get("load_end") or [])))
        lines.append("")
    for s in summ:
        lines.append("Abort grace, %s (the source agent's log line when kAbortGrace ended: `no job` = libvirt "
                     "had failed the job by itself, `aborted` = it was still there and was aborted): %s" % (
                         s["fault"], ", ".join("%s: %d" % kv for kv in sorted(s["aborts"].items()))))
        lines.append("")
    lines += [grace_table(rows), ""]
    for s in summ:
        lines.append("libvirt errors, %s: %s" % (s["fault"], "; ".join(
            "%dx `%s`" % (n, e) for e, n in sorted(s["errors"].items(), key=lambda x: -x[1]))))
        lines.append("")
    lines += ["## Raw tries (JSON lines)", "", "```"]
    lines += [json.dumps(r, sort_keys=True) for r in rows]
    lines += ["```", ""]
    return "\n".join(lines)
