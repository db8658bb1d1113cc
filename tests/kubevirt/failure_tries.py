#!/usr/bin/env python3
"""Failure handling of rdmig under KubeVirt's own migration, tried many times on the
KubeVirt-shaped harness (tools/rdmiglab/kubevirt.py: real libvirt peer to peer, real QEMU,
the virt-handler proxy stand-in with mTLS) with real rdmig agents (kvagents.KubevirtAgents).

For each fault kind, N carried migrations (TLS, 8 parallel connections by default) get the
fault injected mid-stream: a watcher thread started from the harness's before_dial hook polls
the source agent's record until every memory connection is carried and bytesSent passed
--fault-after-mib, then injects

  target-agent  SIGKILL of the target node's agent
  source-agent  SIGKILL of the source node's agent
  link-cut      the agents' data plane black-holed: a dedicated nftables table in the host
                namespace (`inet rdmig_test_cut`) drops tcp to/from the target agent's data
                port in prerouting (the agents talk over 127.0.0.1); always deleted after
                the try, also on errors and signals
  target-qemu   the target pod deleted mid-stream as virt-controller does: SIGKILL of the
                target QEMU (the process in the target launcher pod's mount namespace)

Per try it records: fault time -> the source QEMU's migration seen failed/cancelled
(MigrationResult.source_failed_at, polled every 0.25 s over the harness's QMP monitor) and
-> libvirt's call returned; libvirt's error; that the VM runs in exactly one place (source
domain running and its guest counter advancing; no active domain and no QEMU in the target
pod after the harness's target cleanup); the agents' records; wedges (source QEMU migration
threads still alive 15 s after the failure, `duplicate yank instance` / `There's a
migration process in progress` on the follow-up); and whether a follow-up migration
(killed agents restarted first) succeeds, carried or on KubeVirt's own path.

    RDMIG_AGENT=build/agent/rdmig-agent flock /tmp/rdmig-qemu.lock \
        /usr/bin/python3 tests/kubevirt/failure_tries.py --tries 20 --faults all --out F.md

Launcher row: $RDMIG_KV_LAUNCHER (default trixie-nonroot). Needs root (as the harness).
tests/kubevirt/test_kubevirt_failures.py runs 2 tries of each fault with assertions (ctest).
"""
import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, HERE)

from rdmiglab.system_python import reexec_with_system_python  # noqa: E402

if __name__ == "__main__":
    reexec_with_system_python()

FAULTS = ("target-agent", "source-agent", "target-qemu", "link-cut")
NODES = ("node-a", "node-b")
MEM_MIB = 256
DIRTY_MIB = 8
CUT_TABLE = "rdmig_test_cut"
WEDGE_AFTER_S = 15.0
WEDGE_ERRORS = ("duplicate yank", "migration process in progress")
# Thread names of a source QEMU's outgoing migration (libvirt sets debug-threads=on): QEMU
# <= 8 "live_migration"/"multifdsend_N"/"return path"; QEMU >= 9 "mig/src/main",
# "mig/src/send_N", "mig/src/rp_thr" (comm is cut at 15 characters).
MIGRATION_THREADS = ("live_migration", "multifdsend", "mig/src/")


def log(msg):
    print("[failure_tries %s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


# ---- the link cut: one nftables table in the host namespace, always removed ---------------
_cut_lock = threading.Lock()
_cut_installed = False


def cut_link(port):
    """Black-holes tcp to and from 127.0.0.1:<port> (both directions of every connection of
    that agent's data plane) before routing: the sender's packets leave, nothing arrives."""
    global _cut_installed
    rules = """table inet %s {
  chain pre { type filter hook prerouting priority -300; policy accept;
    tcp dport %d drop
    tcp sport %d drop
  }
}
""" % (CUT_TABLE, port, port)
    with _cut_lock:
        _cut_installed = True
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)


def uncut_link():
    global _cut_installed
    with _cut_lock:
        subprocess.run(["nft", "delete", "table", "inet", CUT_TABLE], capture_output=True)
        _cut_installed = False


def _uncut_on_exit(*_):
    if _cut_installed:
        uncut_link()


atexit.register(_uncut_on_exit)


# ---- processes ---------------------------------------------------------------------------
def qemu_pids(pod):
    """Host pids of the QEMU processes in a launcher pod (its mount namespace)."""
    try:
        mnt = os.readlink("/proc/%d/ns/mnt" % pod.pid1)
    except OSError:
        return []
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/comm" % d) as f:
                if not f.read().startswith("qemu-system"):
                    continue
            if os.readlink("/proc/%s/ns/mnt" % d) == mnt:
                out.append(int(d))
        except OSError:
            pass
    return out


def thread_names(pid):
    names = []
    try:
        for t in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/comm" % (pid, t)) as f:
                    names.append(f.read().strip())
            except OSError:
                pass
    except OSError:
        return None
    return sorted(names)


def migration_threads(pid):
    names = thread_names(pid)
    if names is None:
        return None
    return [n for n in names if n.startswith(MIGRATION_THREADS)]


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def tolerant_cluster_class():
    """KubevirtCluster whose target cleanup survives the domain vanishing under it: libvirt
    undefines a failed incoming migration's transient domain on its own, and lookupByName then
    isActive() raced that ("Domain not found" out of migrate(), seen in the first try here)."""
    from rdmiglab.kubevirt import KubevirtCluster

    class Cluster(KubevirtCluster):
        def _delete_target_pod_domain(self, lv, target):
            for _ in range(3):
                try:
                    return super()._delete_target_pod_domain(lv, target)
                except lv.libvirtError as e:
                    if "not found" not in str(e).lower() and "no domain" not in str(e).lower():
                        raise
                    time.sleep(0.2)
            return None
    return Cluster


def private_agent_binary():
    """A private copy of $RDMIG_AGENT: the build tree may be rebuilt during a long run, and an
    agent restarted after a fault must speak the same flow protocol as its peer."""
    from rdmiglab.agent import agent_binary
    src = agent_binary()
    dst = os.path.join(tempfile.mkdtemp(prefix="rdmig-ft-bin-"), "rdmig-agent")
    shutil.copy2(src, dst)
    os.environ["RDMIG_AGENT"] = dst
    atexit.register(shutil.rmtree, os.path.dirname(dst), True)
    return src, dst


# ---- the rig -----------------------------------------------------------------------------
class Rig:
    """Cluster + agents + one VMI. rebuild() starts everything afresh (after a wedged VM)."""

    def __init__(self, flavor=None, parallel=8, tls=True, kubevirt=None):
        """``kubevirt``: extra keys for the agents' kubevirt section (e.g. multifdOnFailure)."""
        self.flavor, self.parallel, self.tls, self.agent_kubevirt = flavor, parallel, tls, kubevirt
        self.cluster = self.kv = None
        self.tmp = None
        self.builds = 0
        self._build()

    def _build(self):
        from rdmiglab.kvagents import KubevirtAgents
        self.builds += 1
        Rig.seq += 1
        self.seq = Rig.seq
        self.tmp = tempfile.mkdtemp(prefix="rdmig-kvfail-")
        try:
            self.cluster = tolerant_cluster_class()(flavor=self.flavor).__enter__()
            self.kv = KubevirtAgents(self.tmp, NODES, kubevirt=self.agent_kubevirt)
            self.cluster.define_and_start_vmi("testvm", "default", mem_mib=MEM_MIB, dirty_mib=DIRTY_MIB,
                                              boot_counter=2)
        except BaseException:
            self.close()
            raise

    def rebuild(self):
        self.close()
        self._build()

    def close(self):
        self.save_logs()
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def ensure_agents(self):
        """Restarts dead agents; returns the nodes restarted."""
        restarted = []
        for n in NODES:
            a = self.kv.agents.get(n)
            if a is None or not a.alive():
                if a is not None:
                    shutil.rmtree(a.state_dir, ignore_errors=True)
                self.kv.start(n)
                restarted.append(n)
        return restarted

    def restart_agents(self):
        """Stops and starts both agents (a fresh agent re-creates its redirect table)."""
        self.save_logs()
        for n in NODES:
            a = self.kv.agents.get(n)
            if a is not None:
                a.stop()
                shutil.rmtree(a.state_dir, ignore_errors=True)
            self.kv.start(n)

    def save_logs(self):
        if self.tmp and self.logs_dir:
            os.makedirs(self.logs_dir, exist_ok=True)
            for n in NODES:
                src = os.path.join(self.tmp, n + ".log")
                if os.path.exists(src):
                    dst = os.path.join(self.logs_dir, "rig%d-%s.log" % (self.seq, n))
                    shutil.copyfile(src, dst)

    logs_dir = None
    seq = 0

    def record(self, node, mig_uid, timeout):
        """The agent's record of the migration once final (else as it is, or what went wrong;
        an API that does not answer within 10 s gets its threads' stacks recorded)."""
        from rdmiglab.kvagents import FINAL_PHASES
        a = self.kv.agents.get(node)
        if a is None or not a.alive():
            return None
        deadline = time.monotonic() + timeout
        items = []
        while True:
            try:
                status, body = a.request("GET", "/v1/kubevirt/migrations?migrationUid=" + mig_uid, timeout=10)
                items = body.get("items", []) if status == 200 else []
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                return {"error": "API of %s: %s: %s" % (node, type(e).__name__, e), "stacks": agent_stacks(a)}
            final = [i for i in items if i.get("phase") in FINAL_PHASES]
            if final:
                return final[0]
            if time.monotonic() > deadline:
                return items[0] if items else {"error": "no record"}
            time.sleep(0.1)

    def agent_lines(self, node, needle=None, limit=12):
        a = self.kv.agents.get(node)
        if a is None:
            return []
        lines = [l for l in a.log_text().splitlines() if needle is None or needle in l]
        return lines[-limit:]

    def agent_health(self, node):
        a = self.kv.agents.get(node)
        if a is None or not a.alive():
            return "dead"
        try:
            t = time.monotonic()
            a.call("GET", "/healthz")
            return "ok in %.2fs" % (time.monotonic() - t)
        except Exception as e:  # noqa: BLE001
            return "%s: %s" % (type(e).__name__, e)


def agent_stacks(agent):
    """gdb's backtrace of every thread of a hung agent (its API did not answer), shortened."""
    try:
        out = subprocess.run(["gdb", "-p", str(agent.proc.pid), "-batch", "-ex", "thread apply all bt 12"],
                             capture_output=True, text=True, timeout=60).stdout
    except Exception as e:  # noqa: BLE001
        return "gdb: %s" % e
    keep = [l for l in out.splitlines() if l.startswith(("Thread ", "#"))]
    return "\n".join(keep)[-12000:]


def _slim(rec):
    if not isinstance(rec, dict):
        return rec
    keys = ("role", "phase", "reason", "carried", "connections", "bytesSent", "bytesReceived", "transport",
            "transportReason", "mainConnection", "onFailure", "peer", "error", "stacks")
    return {k: rec.get(k) for k in keys if k in rec}


def inject(rig, fault, source, target):
    """Injects ``fault``; returns a short description."""
    kv, cluster = rig.kv, rig.cluster
    if fault == "target-agent":
        kv.agents[target].proc.send_signal(signal.SIGKILL)
        return "SIGKILL %s agent pid %d" % (target, kv.agents[target].proc.pid)
    if fault == "source-agent":
        kv.agents[source].proc.send_signal(signal.SIGKILL)
        return "SIGKILL %s agent pid %d" % (source, kv.agents[source].proc.pid)
    if fault == "link-cut":
        port = kv.ports[target]
        cut_link(port)
        return "nft drop tcp port %d (%s agent's data plane)" % (port, target)
    if fault == "target-qemu":
        pids = qemu_pids(cluster.pods[target])
        for p in pids:
            os.kill(p, signal.SIGKILL)
        return "SIGKILL target QEMU pid %s" % pids
    raise ValueError(fault)


def run_try(rig, fault, index, fault_after_mib=8, followup=True):
    """One carried migration with ``fault`` injected mid-stream, then the checks and a
    follow-up migration. Returns a JSON-able dict."""
    cluster, parallel, tls = rig.cluster, rig.parallel, rig.tls
    source = cluster.vmi.node
    target = cluster.other(source)
    out = {"fault": fault, "try": index, "flavor": cluster.flavor, "parallel": parallel, "tls": tls,
           "source": source, "target": target, "restarted_before": rig.ensure_agents()}
    src_qemu = qemu_pids(cluster.pods[source])
    out["source_qemu_pid"] = src_qemu[0] if src_qemu else None
    state = {}
    stop = threading.Event()

    def watcher(ctx):
        agent = rig.kv.agents[source]
        deadline = time.monotonic() + 90
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    status, body = agent.request("GET", "/v1/kubevirt/migrations?migrationUid=" + ctx.migration_uid,
                                                 timeout=5)
                    items = body["items"] if status == 200 else []
                except Exception:  # noqa: BLE001
                    items = []
                for i in items:
                    if i.get("phase") in ("Succeeded", "Failed", "NotCarried"):
                        state["missed"] = "record %s before the fault: %s" % (i.get("phase"), i.get("reason"))
                        return
                    if i.get("connections", 0) >= 1 + parallel and i.get("bytesSent", 0) > (fault_after_mib << 20):
                        state["bytes_at_fault"] = i["bytesSent"]
                        state["at"] = time.monotonic()
                        state["what"] = inject(rig, fault, source, target)
                        return
                time.sleep(0.02)
            state.setdefault("missed", "not carried within 90 s")
        except Exception as e:  # noqa: BLE001
            state["inject_error"] = "%s: %s" % (type(e).__name__, e)

    def before_dial(ctx):
        state["dial_at"] = time.monotonic()
        threading.Thread(target=watcher, args=(ctx,), daemon=True).start()

    r = None
    try:
        r = cluster.migrate(parallel=parallel, tls=tls, hook_socket=rig.kv.hook_socket(source), hook_timeout=5,
                            expect_success=False, before_dial=before_dial, check_counter=False, timeout=150)
    finally:
        stop.set()
        returned_at = time.monotonic()
        if fault == "link-cut":
            uncut_link()
            out["cut_removed_after_s"] = round(returned_at - state["at"], 2) if "at" in state else None
    out.update({"migration_uid": r.migration_uid, "success": r.success, "error": r.error, "wall_ms": r.wall_ms,
                "injected": state.get("what"), "missed": state.get("missed"),
                "inject_error": state.get("inject_error"), "bytes_at_fault": state.get("bytes_at_fault"),
                "target_cleanup": r.target_cleanup,
                "target_pod_deleted_by_harness": r.target_pod_deleted_at is not None})
    sp = (r.proxy_logs or {}).get("source") or {}
    # Which memory connection reached the next hop first (the source agent, by the redirect):
    # with TLS the agent takes the first memory connection as QEMU's main channel.
    conns = sorted((c for c in sp.get("connections") or [] if c.get("dial_index") is not None),
                   key=lambda c: c["dial_index"])
    out["source_proxy"] = {"dial_order": sp.get("dial_order"), "reordered": sp.get("reordered"),
                           "first_memory_dialed_class_index": next(
                               (c.get("class_index") for c in conns if c.get("class") == 49152), None),
                           "dial_sequence": sp.get("dial_sequence"),
                           "errors": [c.get("error") for c in sp.get("connections") or [] if c.get("error")]}
    fault_at = state.get("at")
    failed_at = r.source_failed_at
    if fault_at is not None:
        libvirt_returned_at = state["dial_at"] + r.wall_ms / 1000.0
        out["fail_s"] = round(failed_at - fault_at, 2) if failed_at else None
        out["libvirt_return_s"] = round(libvirt_returned_at - fault_at, 2)
        if r.target_pod_deleted_at:
            out["target_pod_deleted_s"] = round(r.target_pod_deleted_at - fault_at, 2)
    # The agents' records.
    out["source_record"] = _slim(rig.record(source, r.migration_uid, 15))
    out["target_record"] = _slim(rig.record(target, r.migration_uid, 5))
    out["source_agent_log"] = rig.agent_lines(source, r.migration_uid)
    # VM in exactly one place: where libvirt says it runs (the source after a failure), its
    # guest counter advancing; the other pod without an active domain and without QEMU.
    lv = __import__("libvirt")
    home, away = (target, source) if r.success else (source, target)
    place = {"home": home}
    try:
        dom = cluster.domain(home)
        place["home_running"] = dom.isActive() == 1 and dom.state()[0] == lv.VIR_DOMAIN_RUNNING
        place["home_state"] = dom.state()[0]
    except Exception as e:  # noqa: BLE001
        place["home_running"] = False
        place["home_error"] = str(e)
    before = cluster.serial_counter(home)
    try:
        cluster.wait_for_counter(home, (before or 0) + 1, 30)
        place["home_counter_advancing"] = True
    except Exception as e:  # noqa: BLE001
        place["home_counter_advancing"] = False
        place["home_counter_error"] = str(e)[:600]
    try:
        aconn = cluster.connect(away)
        try:
            try:
                place["away_active"] = aconn.lookupByName(cluster.vmi.domain).isActive() == 1
            except lv.libvirtError:
                place["away_active"] = False
        finally:
            aconn.close()
    except Exception as e:  # noqa: BLE001
        place["away_error"] = str(e)
    place["away_qemu_pids"] = qemu_pids(cluster.pods[away])
    out["place"] = place
    out["vm_in_one_place"] = bool(place.get("home_running") and place.get("home_counter_advancing")
                                  and place.get("away_active") is False and not place["away_qemu_pids"])
    if not out["vm_in_one_place"] or not fault_at or r.success:
        for n in (source, target):
            out["agent_tail_" + n] = rig.agent_lines(n, None, 25)
            out["agent_health_" + n] = rig.agent_health(n)
    # Wedge: the source QEMU's migration threads 15 s after the failure.
    if not r.success and out["source_qemu_pid"]:
        ref = failed_at or (state["dial_at"] + r.wall_ms / 1000.0)
        time.sleep(max(0.0, ref + WEDGE_AFTER_S - time.monotonic()))
        out["source_migration_threads_15s"] = migration_threads(out["source_qemu_pid"])
    # Follow-up.
    if followup:
        out["restarted_after"] = rig.ensure_agents()
        out["followup"] = followup_migration(rig)
    wedge = []
    if out.get("source_migration_threads_15s"):
        wedge.append("threads %s" % out["source_migration_threads_15s"])
    for f in out.get("followup", {}).get("attempts", []):
        if f.get("error") and any(w in f["error"] for w in WEDGE_ERRORS):
            wedge.append("follow-up: %s" % f["error"])
    out["wedge"] = wedge
    return out


def followup_migration(rig, attempts=2):
    """Migrates the VMI once more (KubeVirt would retry): up to ``attempts`` times, 5 s apart.
    Returns {"ok", "carried", "reason", "attempts": [...]}."""
    cluster = rig.cluster
    res = {"ok": False, "attempts": []}
    for i in range(attempts):
        source = cluster.vmi.node
        a = {}
        try:
            r = cluster.migrate(parallel=rig.parallel, tls=rig.tls, hook_socket=rig.kv.hook_socket(source),
                                hook_timeout=5, expect_success=False, check_counter=False, timeout=150)
            a.update({"success": r.success, "error": r.error, "wall_ms": r.wall_ms, "downtime_ms": r.downtime_ms})
            if not r.success:
                a["proxy_errors"] = {role: [c.get("error") for c in (doc or {}).get("connections") or []
                                            if c.get("error")] for role, doc in (r.proxy_logs or {}).items()}
            rec = rig.record(source, r.migration_uid, 10)
            a["source_record"] = _slim(rec)
            if not rec or rec.get("phase") not in ("Succeeded", "Failed", "NotCarried"):
                a["agent_tail"] = rig.agent_lines(source, None, 20)
                a["agent_health"] = rig.agent_health(source)
            if r.success:
                try:
                    cluster.wait_for_counter(r.target_node, (r.counter_before or 0) + 1, 60)
                    a["target_counter_advancing"] = True
                except Exception as e:  # noqa: BLE001
                    a["target_counter_advancing"] = False
                    a["error"] = "guest stopped on the target: %s" % str(e)[:600]
        except Exception as e:  # noqa: BLE001
            a["error"] = "%s: %s" % (type(e).__name__, e)
        res["attempts"].append(a)
        if a.get("success") and a.get("target_counter_advancing"):
            rec = a.get("source_record") or {}
            res.update(ok=True, carried=rec.get("carried"), reason=rec.get("reason"), attempt=i + 1)
            return res
        rig.ensure_agents()
        time.sleep(5)
    return res


# ---- report ------------------------------------------------------------------------------
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
            "wedges": len([r for r in rs if r.get("wedge")]),
            "exceptions": len([r for r in rs if r.get("exception")]),
            "errors": errors,
        })
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
             "| fault | tries | injected (migration failed) | fail median s | fail max s | return median s "
             "| return max s | pod del | one place | again (1st / carried) | wedges | no fault (not carried "
             "or done first) | exceptions | multifd on failure (source record) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summ = summarize(rows)
    for s in summ:
        lines.append("| %s | %d | %d (%d) | %s | %s%s | %s | %s | %d | %d/%d | %d (%d / %d) | %d | %d | %d | %s |" % (
            s["fault"], s["tries"], s["injected"], s["failed"], fmt(s["fail_median"]), fmt(s["fail_max"]),
            (" (%d unseen)" % s["fail_unseen"]) if s["fail_unseen"] else "", fmt(s["ret_median"]),
            fmt(s["ret_max"]), s["pod_deleted"], s["one_place"], s["injected"], s["again"], s["again_first"],
            s["again_carried"], s["wedges"], s["not_carried"], s["exceptions"],
            ", ".join("%s: %d" % kv for kv in sorted(s["on_failure"].items()))))
    lines.append("")
    for s in summ:
        lines.append("libvirt errors, %s: %s" % (s["fault"], "; ".join(
            "%dx `%s`" % (n, e) for e, n in sorted(s["errors"].items(), key=lambda x: -x[1]))))
        lines.append("")
    lines += ["## Raw tries (JSON lines)", "", "```"]
    lines += [json.dumps(r, sort_keys=True) for r in rows]
    lines += ["```", ""]
    return "\n".join(lines)


def machine_desc():
    ncpu = os.cpu_count()
    return "%s, %d vCPUs, TCG guests (%d MiB, dirtying %d MiB/s), kernel %s" % (
        platform.node(), ncpu, MEM_MIB, DIRTY_MIB, platform.release())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--faults", default="all", help="comma list of %s, or all" % ",".join(FAULTS))
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--no-tls", action="store_true")
    ap.add_argument("--fault-after-mib", type=int, default=8)
    ap.add_argument("--out", help="markdown report (the raw JSON lines also go to OUT with .jsonl)")
    ap.add_argument("--logs", default="/tmp/rdmig-failure-tries-logs", help="the agents' logs are copied here")
    ap.add_argument("--multifd-on-failure", choices=("auto", "drain", "reset"),
                    help="the agents' kubevirt.multifdOnFailure (default: the agent's own default)")
    ap.add_argument("--lock", help="flock this file per fault kind (e.g. /tmp/rdmig-qemu.lock) instead of "
                                   "holding an outer lock for the whole run")
    args = ap.parse_args(argv)
    faults = FAULTS if args.faults == "all" else tuple(args.faults.split(","))
    for f in faults:
        if f not in FAULTS:
            ap.error("unknown fault %s" % f)
    import test_kubevirt_baseline as base
    reason = base.missing_prereq()
    if reason:
        sys.exit("cannot run: %s" % reason)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: sys.exit(1))  # atexit and finally blocks run
    uncut_link()  # a table left by an earlier killed run
    agent_src, agent_copy = private_agent_binary()
    git = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip()
    meta = {"machine": machine_desc(), "flavor": os.environ.get("RDMIG_KV_LAUNCHER") or "trixie-nonroot",
            "parallel": args.parallel, "tls": not args.no_tls, "fault_after_mib": args.fault_after_mib, "git": git,
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "multifd_on_failure": args.multifd_on_failure or "agent default",
            "agent": "%s (mtime %s)" % (agent_src, time.strftime(
                "%H:%M:%S UTC", time.gmtime(os.path.getmtime(agent_copy))))}
    rows = []
    jsonl = (os.path.splitext(args.out)[0] + ".jsonl") if args.out else None

    def emit(row):
        rows.append(row)
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        if args.out:
            with open(args.out, "w") as f:
                f.write(markdown(rows, meta))

    try:
        for fault in faults:
            lockf = None
            if args.lock:
                import fcntl
                lockf = open(args.lock, "a")
                log("waiting for %s" % args.lock)
                fcntl.flock(lockf, fcntl.LOCK_EX)
            rig = None
            try:
                Rig.logs_dir = args.logs
                rig = Rig(parallel=args.parallel, tls=not args.no_tls,
                          kubevirt={"multifdOnFailure": args.multifd_on_failure} if args.multifd_on_failure else None)
                injected = attempts = 0
                while injected < args.tries and attempts < args.tries + max(2, args.tries // 4):
                    i = attempts
                    attempts += 1
                    t = time.monotonic()
                    try:
                        row = run_try(rig, fault, i + 1, args.fault_after_mib)
                    except Exception as e:  # noqa: BLE001
                        row = {"fault": fault, "try": i + 1, "exception": "%s: %s" % (type(e).__name__, e),
                               "traceback": traceback.format_exc()[-2000:]}
                    row["try_s"] = round(time.monotonic() - t, 1)
                    if row.get("injected") and not row.get("success"):
                        injected += 1
                    emit(row)
                    log("%s #%d: fail %s s, return %s s, one place %s, again %s, wedge %s, error %s%s" % (
                        fault, i + 1, row.get("fail_s"), row.get("libvirt_return_s"), row.get("vm_in_one_place"),
                        row.get("followup", {}).get("ok"), row.get("wedge"), (row.get("error") or "")[:120],
                        (" EXCEPTION " + row["exception"]) if row.get("exception") else ""))
                    if row.get("exception") or row.get("wedge") or not row.get("followup", {}).get("ok"):
                        log("rebuilding the cluster (VM may be wedged or lost)")
                        rig.rebuild()
                    elif not row.get("injected"):
                        # Not carried: e.g. the agent's redirect table was removed under it
                        # (another agent's start-up sweep) and it never re-creates it.
                        log("restarting both agents (the migration was not carried: %s)"
                            % ((row.get("source_record") or {}).get("reason") or row.get("missed")))
                        rig.restart_agents()
            finally:
                if rig is not None:
                    rig.close()
                uncut_link()
                if lockf is not None:
                    lockf.close()
    finally:
        uncut_link()
        text = markdown(rows, meta)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
