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
  target-qemu   SIGKILL of the target QEMU only (the process in the target launcher pod's
                mount namespace); its libvirt daemon lives on
  target-pod    the target pod deleted mid-stream as virt-controller does, at its most abrupt:
                SIGKILL of the pod's PID 1 (the kernel kills its libvirt daemon and QEMU with
                it) and of its virt-launcher-monitor; libvirt's peer-to-peer connection to the
                target daemon breaks too. After libvirt's call returned the harness starts a
                fresh pod on that node (KubeVirt schedules a new one for the next migration)

Per try it records: fault time -> the source QEMU's migration seen failed/cancelled
(MigrationResult.source_failed_at, polled every 0.25 s over the harness's QMP monitor) and
-> libvirt's call returned; libvirt's error; that the VM runs in exactly one place (source
domain running and its guest counter advancing; no active domain and no QEMU in the target
pod after the harness's target cleanup); the agents' records; wedges (source QEMU migration
threads still alive 15 s after the failure, `duplicate yank instance` / `There's a
migration process in progress` on the follow-up); whether a follow-up migration (killed
agents restarted first) succeeds, carried or on KubeVirt's own path; and what the source
agent did when its abort grace ended (its log line: libvirt's job gone by itself, left alone,
or aborted), with what libvirt itself said about the job at that moment (`source_job_at_grace`).

Tries run in batches (--batch, 5 by default), each on a cluster of its own and holding --lock
(the machine's QEMU lock) only for its own tries, so that others' VM tests run in between; the
report names each batch's time, lock wait and load average.

    RDMIG_AGENT=build/agent/rdmig-agent /usr/bin/python3 tests/kubevirt/failure_tries.py \
        --faults source-agent:20,target-pod:20 --lock /tmp/rdmig-qemu.lock --stop-at 01:00 --out F.md
    /usr/bin/python3 tests/kubevirt/failure_tries.py --summarize A.jsonl B.jsonl   # runs together

Launcher row: $RDMIG_KV_LAUNCHER (default trixie-nonroot). Needs root (as the harness).
tests/kubevirt/test_kubevirt_failures.py runs 2 tries of each fault with assertions (ctest).
"""
import argparse
import atexit
import calendar
import json
import os
import platform
import shutil
import signal
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

from failure_report import ABORT_GRACE_S, FAULTS, grace_table, markdown, summary_table  # noqa: E402

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
        deleted_pods = ()  # nodes whose launcher pod a fault deleted, until recreate_pod()

        def delete_pod(self, node):
            """Every process of the node's launcher pod SIGKILLed at once (PID 1 first: the
            kernel kills the rest of its PID namespace). Returns the host pids killed."""
            pod = self.pods[node]
            killed = [pod.pid1]
            os.kill(pod.pid1, signal.SIGKILL)
            for p in pod.monitors.values():
                if p.poll() is None:
                    p.kill()
                    killed.append(p.pid)
            self.deleted_pods = set(self.deleted_pods) | {node}
            return killed

        def recreate_pod(self, node):
            """A fresh launcher pod on ``node`` (libvirt daemon, monitor for the VMI)."""
            pod = self.pods[node]
            pod.close()
            pod.start()
            pod.stage_guest(self.kernel, self.initrd)
            pod.start_monitor(self.vmi.name, self.vmi.uid, self.vmi.namespace)
            self.deleted_pods = set(self.deleted_pods) - {node}

        def _delete_target_pod_domain(self, lv, target):
            if target in self.deleted_pods:
                return "pod deleted by the fault"
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


def qemu_diagnosis(pid):
    """Where a wedged QEMU's threads wait: gdb's backtraces of the migration threads, each
    thread's kernel wait channel, and its unix sockets' queues (ss)."""
    out = {}
    try:
        bt = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 20"],
                            capture_output=True, text=True, timeout=90).stdout
        keep, on = [], False
        for line in bt.splitlines():
            if line.startswith("Thread "):
                on = any(m in line for m in MIGRATION_THREADS)
            if on and line.startswith(("Thread ", "#")):
                keep.append(line[:240])
        out["gdb"] = "\n".join(keep)[-16000:]
    except Exception as e:  # noqa: BLE001
        out["gdb"] = "gdb: %s" % e
    wchan = {}
    for t in os.listdir("/proc/%d/task" % pid) if os.path.isdir("/proc/%d/task" % pid) else []:
        try:
            with open("/proc/%d/task/%s/comm" % (pid, t)) as f:
                name = f.read().strip()
            with open("/proc/%d/task/%s/wchan" % (pid, t)) as f:
                wchan["%s/%s" % (name, t)] = f.read().strip()
        except OSError:
            pass
    out["wchan"] = wchan
    try:
        ss = subprocess.run(["ss", "-xpn"], capture_output=True, text=True, timeout=20).stdout
        out["unix_sockets"] = [l for l in ss.splitlines() if "pid=%d," % pid in l][:40]
    except Exception as e:  # noqa: BLE001
        out["unix_sockets"] = "ss: %s" % e
    return out


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
    if fault == "target-pod":
        qemu = qemu_pids(cluster.pods[target])
        killed = cluster.delete_pod(target)
        return "SIGKILL target pod (PID 1 and monitor %s, with QEMU %s)" % (killed, qemu)
    if fault == "target-qemu":
        pids = qemu_pids(cluster.pods[target])
        for p in pids:
            os.kill(p, signal.SIGKILL)
        return "SIGKILL target QEMU pid %s" % pids
    raise ValueError(fault)


def log_time(line):
    """Wall-clock seconds of an agent log line ("2026-12-01T21:39:45.214Z INFO ..."), or None."""
    try:
        stamp = line.split(" ", 1)[0]
        t = time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")
        return calendar.timegm(t) + float("0" + stamp[19:-1])
    except (ValueError, IndexError):
        return None


ABORT_OUTCOMES = (  # what the source agent logged at the end of its abort grace
    ("aborted the migration job", "aborted"),
    ("no migration job", "no job"),
    ("a newer job", "newer job"),
    ("not ours", "older job"),
    ("abort of ", "abort refused"),
)


def abort_after_grace(rig, source, fault, vmi, mig_uid, fault_wall, dial_wall, until=None):
    """What the source agent did when its abort grace (relay_internal.h kAbortGrace) ended
    after the carried migration failed: its log line "carrying <ns>/<name> failed: ..." says
    whether libvirt's job was still there to abort ("aborted", or "abort refused" with
    libvirt's reason) or libvirt had failed it by itself ("no job"). Times are seconds from
    the fault (agent log clock against the harness's wall clock, both this host's). The line
    is waited for until ``until`` (time.monotonic()), when given."""
    if fault == "source-agent":
        return {"outcome": "source agent killed (nobody aborts)"}
    out = {}
    needle = "carrying %s/%s failed: " % (vmi.namespace, vmi.name)
    while True:
        lines = [l for l in rig.agent_lines(source, needle, 20) if (log_time(l) or 0) >= dial_wall - 0.5]
        if lines or until is None or time.monotonic() >= until:
            break
        time.sleep(0.25)
    failed_line = next((l for l in rig.agent_lines(source, "migration=" + mig_uid, 50) if " failed: " in l), None)
    if failed_line and log_time(failed_line) is not None:
        out["session_failed_s"] = round(log_time(failed_line) - fault_wall, 3)
    if not lines:
        out["outcome"] = "no abort line"
        return out
    line = lines[0]
    out["grace_end_s"] = round(log_time(line) - fault_wall, 3)
    text = line.split(needle, 1)[1]
    out["outcome"] = next((o for k, o in ABORT_OUTCOMES if k in text), "other")
    out["text"] = text[:300]
    return out


def probe_job_later(cluster, node, state, after_s):
    """In a thread: ``after_s`` after the fault, what the node's libvirt says about the VMI's
    job (virDomainGetJobStats: type, operation, elapsed), as the agent's abort check reads it
    at the end of its grace; also how long the call took. Stored in state["job_at_grace"]."""
    lv = __import__("libvirt")
    at = state["at"]

    def run():
        time.sleep(max(0.0, at + after_s - time.monotonic()))
        out = {"asked_s": round(time.monotonic() - at, 2)}
        try:
            conn = cluster.connect(node)
            try:
                dom = conn.lookupByName(cluster.vmi.domain)
                st = dom.jobStats()
                out.update({k: st.get(k) for k in ("type", "operation", "time_elapsed", "time_elapsed_net")
                            if k in st})
                out["type_name"] = {lv.VIR_DOMAIN_JOB_NONE: "none", lv.VIR_DOMAIN_JOB_BOUNDED: "bounded",
                                    lv.VIR_DOMAIN_JOB_UNBOUNDED: "unbounded"}.get(st.get("type"), st.get("type"))
            finally:
                conn.close()
        except Exception as e:  # noqa: BLE001 - an observation
            out["error"] = str(e)[:200]
        out["answered_s"] = round(time.monotonic() - at, 2)
        state["job_at_grace"] = out

    th = threading.Thread(target=run, daemon=True)
    th.start()
    state["job_probe"] = th


def run_try(rig, fault, index, fault_after_mib=8, followup=True):
    """One carried migration with ``fault`` injected mid-stream, then the checks and a
    follow-up migration. Returns a JSON-able dict."""
    cluster, parallel, tls = rig.cluster, rig.parallel, rig.tls
    source = cluster.vmi.node
    target = cluster.other(source)
    out = {"fault": fault, "try": index, "flavor": cluster.flavor, "parallel": parallel, "tls": tls,
           "source": source, "target": target, "restarted_before": rig.ensure_agents(),
           "loadavg": [round(x, 2) for x in os.getloadavg()]}
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
                        state["at_wall"] = time.time()
                        state["what"] = inject(rig, fault, source, target)
                        # The agent's grace starts when its session failed: at once after a
                        # kill, after the heartbeat timeout (3 s) after a cut.
                        probe_job_later(rig.cluster, source, state,
                                        ABORT_GRACE_S + (3.0 if fault == "link-cut" else 0.0))
                        return
                time.sleep(0.02)
            state.setdefault("missed", "not carried within 90 s")
        except Exception as e:  # noqa: BLE001
            state["inject_error"] = "%s: %s" % (type(e).__name__, e)

    def before_dial(ctx):
        state["dial_at"] = time.monotonic()
        state["dial_wall"] = time.time()
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
        if target in cluster.deleted_pods:
            # Checked before the place: the new pod must hold neither domain nor QEMU.
            t = time.monotonic()
            cluster.recreate_pod(target)
            out["pod_recreated_in_s"] = round(time.monotonic() - t, 2)
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
    if not r.success and "at_wall" in state:
        # Each connection's end, seconds from the fault (None: still open when the handler stopped).
        def rel(t):
            return round(t - state["at_wall"], 3) if t else None
        out["source_proxy"]["connections"] = [
            {"class": c.get("class"), "class_index": c.get("class_index"), "dial_index": c.get("dial_index"),
             "first_end": c.get("first_end"), "error": c.get("error"), "closed_s": rel(c.get("closed_at"))}
            for c in sp.get("connections") or []]
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
    # Wedge: the source QEMU's migration threads still alive 15 s after the failure. Polled:
    # once none is left none comes back (nothing starts a migration before the follow-up), so
    # the verdict is the one a look at 15 s gives, without waiting the whole 15 s every try.
    if not r.success and out["source_qemu_pid"]:
        ref = failed_at or (state["dial_at"] + r.wall_ms / 1000.0)
        while True:
            out["source_migration_threads_15s"] = migration_threads(out["source_qemu_pid"])
            if not out["source_migration_threads_15s"] or time.monotonic() >= ref + WEDGE_AFTER_S:
                break
            time.sleep(0.25)
        if out["source_migration_threads_15s"]:
            out["wedge_diagnosis"] = qemu_diagnosis(out["source_qemu_pid"])
    if state.get("job_probe") is not None:
        state["job_probe"].join(30)
        out["source_job_at_grace"] = state.get("job_at_grace")
    if not r.success and "at_wall" in state:
        out["abort"] = abort_after_grace(rig, source, fault, cluster.vmi, r.migration_uid, state["at_wall"],
                                         state["dial_wall"], until=fault_at + WEDGE_AFTER_S)
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


def machine_desc():
    ncpu = os.cpu_count()
    return "%s, %d vCPUs, TCG guests (%d MiB, dirtying %d MiB/s), kernel %s" % (
        platform.node(), ncpu, MEM_MIB, DIRTY_MIB, platform.release())


def stop_deadline(hhmm):
    """Epoch seconds of the next HH:MM UTC (today's, or tomorrow's if that has passed)."""
    h, m = (int(x) for x in hhmm.split(":"))
    now = time.time()
    day = now - now % 86400
    t = day + h * 3600 + m * 60
    return t if t > now else t + 86400


def past_stop(deadline):
    return deadline is not None and time.time() >= deadline


def run_batch(args, meta, emit, fault, n, injected, attempts, limit):
    """Up to ``n`` tries of ``fault`` that injected, on a cluster of their own, holding
    args.lock (so the machine's other QEMU users run between batches). Appends the batch's
    times and load averages to meta["batches"]; returns (injected, attempts) updated."""
    lockf = None
    waited = time.monotonic()
    if args.lock:
        import fcntl
        lockf = open(args.lock, "a")
        log("waiting for %s" % args.lock)
        fcntl.flock(lockf, fcntl.LOCK_EX)
    batch = {"n": len(meta["batches"]) + 1, "fault": fault, "lock_wait_s": round(time.monotonic() - waited, 1),
             "started": time.strftime("%H:%M:%S", time.gmtime()), "load_start": [round(x, 2) for x in os.getloadavg()],
             "tries": 0}
    meta["batches"].append(batch)
    rig = None
    done = 0
    try:
        Rig.logs_dir = args.logs
        rig = Rig(parallel=args.parallel, tls=not args.no_tls,
                  kubevirt={"multifdOnFailure": args.multifd_on_failure} if args.multifd_on_failure else None)
        while done < n and attempts < limit and not past_stop(args.stop_at):
            attempts += 1
            t = time.monotonic()
            try:
                row = run_try(rig, fault, attempts, args.fault_after_mib)
            except Exception as e:  # noqa: BLE001
                row = {"fault": fault, "try": attempts, "exception": "%s: %s" % (type(e).__name__, e),
                       "traceback": traceback.format_exc()[-2000:]}
            row["try_s"] = round(time.monotonic() - t, 1)
            row["batch"] = batch["n"]
            batch["tries"] += 1
            if row.get("injected") and not row.get("success"):
                injected += 1
                done += 1
            emit(row)
            log("%s #%d: fail %s s, return %s s, one place %s, again %s, wedge %s, abort %s, error %s%s" % (
                fault, attempts, row.get("fail_s"), row.get("libvirt_return_s"), row.get("vm_in_one_place"),
                row.get("followup", {}).get("ok"), row.get("wedge"), (row.get("abort") or {}).get("outcome"),
                (row.get("error") or "")[:120], (" EXCEPTION " + row["exception"]) if row.get("exception") else ""))
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
        batch["ended"] = time.strftime("%H:%M:%S", time.gmtime())
        batch["load_end"] = [round(x, 2) for x in os.getloadavg()]
        if lockf is not None:
            lockf.close()
            time.sleep(3)  # let a waiting user of the lock in before the next batch
    return injected, attempts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--faults", default="all",
                    help="comma list of %s (FAULT:N for N tries of that one), or all" % ",".join(FAULTS))
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--no-tls", action="store_true")
    ap.add_argument("--fault-after-mib", type=int, default=8)
    ap.add_argument("--out", help="markdown report (the raw JSON lines also go to OUT with .jsonl)")
    ap.add_argument("--logs", default="/tmp/rdmig-failure-tries-logs", help="the agents' logs are copied here")
    ap.add_argument("--multifd-on-failure", choices=("auto", "drain", "reset"),
                    help="the agents' kubevirt.multifdOnFailure (default: the agent's own default)")
    ap.add_argument("--lock", help="flock this file around each batch of tries (e.g. /tmp/rdmig-qemu.lock) "
                                   "instead of holding an outer lock for the whole run")
    ap.add_argument("--batch", type=int, default=5,
                    help="tries per batch: each batch builds its own cluster, holds --lock, and records the "
                         "load average before and after (0: one batch per fault kind)")
    ap.add_argument("--summarize", nargs="+", metavar="JSONL",
                    help="run nothing: print the table of the tries in these .jsonl files together (e.g. two runs "
                         "with the same setting)")
    ap.add_argument("--stop-at", metavar="HH:MM",
                    help="UTC time after which no new try starts (the report holds what ran)")
    args = ap.parse_args(argv)
    args.stop_at = stop_deadline(args.stop_at) if args.stop_at else None
    if args.summarize:
        rows = [json.loads(l) for f in args.summarize for l in open(f) if l.strip()]
        print(summary_table(rows))
        print(grace_table(rows))
        return 0
    plan = []
    for item in (FAULTS if args.faults == "all" else args.faults.split(",")):
        fault, _, count = item.partition(":")
        if fault not in FAULTS or (count and not count.isdigit()):
            ap.error("unknown fault %s (FAULT or FAULT:TRIES, FAULT one of %s)" % (item, ", ".join(FAULTS)))
        plan.append((fault, int(count) if count else args.tries))
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
            "multifd_on_failure": args.multifd_on_failure or "agent default", "batches": [],
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
        for fault, wanted in plan:
            injected = attempts = 0
            limit = wanted + max(2, wanted // 4)
            while injected < wanted and attempts < limit and not past_stop(args.stop_at):
                n = min(args.batch, wanted - injected) if args.batch else wanted - injected
                injected, attempts = run_batch(args, meta, emit, fault, n, injected, attempts, limit)
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
