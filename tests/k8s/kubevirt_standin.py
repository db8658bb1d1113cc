"""A KubeVirt stand-in for the controller's tests: reacts to VirtualMachineInstanceMigrations in
the API server double the way virt-controller and virt-handler do, as far as rdmig-controller
can see it.

For each new VMIM it adds KubeVirt's finalizer (kubevirt.io/migrationJobFinalize), checks the
VMI (missing or not Running: Failed), moves the VMIM through Pending, Scheduling, Scheduled,
PreparingTarget, TargetReady, Running and Succeeded/Failed with phaseTransitionTimestamps, and
keeps the VMI's status.migrationState (migrationUid, sourceNode, targetNode, targetPod,
startTimestamp, endTimestamp, completed, failed, failureReason, mode, abortStatus) and, on
success, status.nodeName. Deleting a running VMIM aborts it (KubeVirt's abort): the performer is
stopped, migrationState says failed with abortStatus Succeeded, the VMI stays on its node, and
the finalizer goes only then.

The migration itself is done by a pluggable performer (FakePerformer and AgentPairPerformer
below): today two real QEMU guests through two real rdmig agents
over their bare-QEMU REST API; a KubeVirt-shaped harness with real libvirt will replace it.
rdmig's own figures (GET /v1/kubevirt/migrations) come from FigureServer, a stand-in HTTP server
per node that answers the agents' contract from what the performer observed. The agent side of
that contract is tested in the agent's own tests, not here.
"""
import datetime
import http.server
import json
import os
import sys
import threading
import time
import urllib.parse
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from rdmiglab import start_migration  # noqa: E402

FINALIZER = "kubevirt.io/migrationJobFinalize"
VMI, VMIM = "virtualmachineinstances", "virtualmachineinstancemigrations"
AGENT_TERMINAL = ("Succeeded", "Failed", "Cancelled")
PHASES_BEFORE_RUNNING = ("Pending", "Scheduling", "Scheduled", "PreparingTarget", "TargetReady")


def now_rfc3339():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Migration:
    """What a performer gets: the KubeVirt objects' names, the nodes, and an abort flag."""

    def __init__(self, uid, namespace, vmi, source_node, target_node):
        self.uid, self.namespace, self.vmi = uid, namespace, vmi
        self.source_node, self.target_node = source_node, target_node
        self.abort = threading.Event()


class FakePerformer:
    """Takes `seconds` (or until aborted), then ends as told. `record(m)` returns rdmig's record
    (an item of the agents' contract) for FigureServer, or None (rdmig did not see it)."""

    def __init__(self, seconds=0.5, ok=True, reason=None, record=None, target="node-b"):
        self.seconds, self.ok, self.reason, self.record, self.target = seconds, ok, reason, record, target
        self.started = threading.Event()

    def target_node(self, source_node, vmim):
        return self.target

    def perform(self, m, figures):
        self.started.set()
        if m.abort.wait(self.seconds):
            return False, "aborted"
        if self.record:
            item = self.record(m)
            if item:
                figures.publish(m.source_node, item)
        return self.ok, self.reason


class AgentPairPerformer:
    """Moves a real guest: POSTs target then source on two real agents (as the bare-QEMU path
    does) and publishes rdmig's record for the source node on FigureServer as it goes."""

    def __init__(self, agents, src_qmp, dst_qmp, target, **source_options):
        self.agents, self.src_qmp, self.dst_qmp, self.target = agents, src_qmp, dst_qmp, target
        self.options = dict(source_options)
        self.started = threading.Event()

    def target_node(self, source_node, vmim):
        return self.target

    def record(self, m, s, t, phase):
        p, r = s.get("progress", {}), s.get("result") or {}
        return {"migrationUid": m.uid, "vmi": {"namespace": m.namespace, "name": m.vmi, "uid": ""},
                "role": "source", "sourceNode": m.source_node, "targetNode": m.target_node, "mode": "hook",
                "carried": True, "reason": None, "phase": phase, "transport": s.get("transport"),
                "transportReason": s.get("transportReason"), "connections": s.get("channels"),
                "bytesSent": p.get("transferredBytes"), "bytesReceived": 0, "chunksSent": p.get("chunksSent"),
                "chunksReceived": (t or {}).get("progress", {}).get("chunksReceived"),
                "throughputBytesPerSecond": p.get("throughputBytesPerSecond"),
                "libvirt": ({"downtimeMs": r["downtimeMs"], "totalTimeMs": r.get("totalTimeMs"),
                             "dataTotalBytes": p.get("totalBytes")} if "downtimeMs" in r else None),
                "switchoverMs": r.get("switchoverMs"), "startedAtMs": int(time.time() * 1000), "finishedAtMs": None}

    def perform(self, m, figures):
        src, dst = self.agents[m.source_node], self.agents[m.target_node]
        target, source = start_migration(src, dst, self.src_qmp, self.dst_qmp, vm=m.namespace + "/" + m.vmi,
                                         **self.options)
        self.started.set()
        while True:
            s = src.get(source["id"])
            figures.publish(m.source_node, self.record(m, s, None, "Carrying"))
            if s["phase"] in AGENT_TERMINAL:
                break
            if m.abort.is_set():
                src.cancel(source["id"])
            time.sleep(0.2)
        t = dst.wait(target["id"], timeout=60)
        ok = s["phase"] == "Succeeded" and t["phase"] == "Succeeded"
        figures.publish(m.source_node, self.record(m, s, t, "Succeeded" if ok else "Failed"))
        return ok, None if ok else "rdmig: " + str((s.get("result") or {}).get("reason"))


class FigureServer:
    """Stand-in for GET /v1/kubevirt/migrations on each node's agent (bearer token checked).
    legacy=True answers 404 for everything, like an agent older than the endpoint."""

    def __init__(self, token):
        self.token = token
        self.items = {}      # node -> [item]
        self.legacy = set()  # nodes whose "agent" predates the endpoint
        # node -> how its agent, running without KubeVirt mode, answers /v1/kubevirt/migrations:
        # "current" as rdmig-agent does (404, reason KubevirtModeOff and the message; checked against
        # the real agent in tests/integration/test_agent_startup.py), "text" as agents before the
        # reason field did (the message only), "reason" with the field and other words.
        self.mode_off = {}
        self.servers = {}
        self.requests = []   # (node, path)

    def start(self, node):
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.requests.append((node, self.path))
                url = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(url.query))
                if self.headers.get("Authorization") != "Bearer " + outer.token:
                    return self._send(401, {"error": {"code": "unauthenticated", "message": "bad token"}})
                if node in outer.mode_off and url.path == "/v1/kubevirt/migrations":
                    # What rdmig-agent answers with kubevirt.enabled false (src/api/rest_server.cpp).
                    style = outer.mode_off[node]
                    error = {"code": "not_found", "message": "KubeVirt mode is off on this agent (kubevirt.enabled)"}
                    if style in ("current", "reason"):
                        error["reason"] = "KubevirtModeOff"
                    if style == "reason":
                        error["message"] = "this agent serves no KubeVirt node hook"
                    return self._send(404, {"error": error})
                if node in outer.legacy or url.path != "/v1/kubevirt/migrations":
                    return self._send(404, {"error": {"code": "not_found", "message": "no route " + url.path}})
                items = [i for i in outer.items.get(node, [])
                         if ("migrationUid" not in q or i["migrationUid"] == q["migrationUid"])
                         and ("name" not in q or (i["vmi"]["namespace"], i["vmi"]["name"]) == (q.get("namespace"), q["name"]))]
                self._send(200, {"items": items})

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        self.servers[node] = srv
        return srv.server_address[1]

    def publish(self, node, item):
        lst = self.items.setdefault(node, [])
        lst[:] = [i for i in lst if i["migrationUid"] != item["migrationUid"]] + [item]

    def stop(self):
        for s in self.servers.values():
            s.shutdown()
            s.server_close()


class KubevirtStandin:
    def __init__(self, store, performer, figures, step_seconds=0.05):
        self.store, self.performer, self.figures, self.step = store, performer, figures, step_seconds
        self.handled = set()
        self.migrations = {}  # vmim uid -> Migration
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self):
        self.stopping = True
        for m in self.migrations.values():
            m.abort.set()
        self.thread.join(5)

    # -- VMIs ----------------------------------------------------------------------------
    def add_vmi(self, ns, name, node, phase="Running", migratable=True, reason="", message="",
                migration_state=None):
        code, vmi = self.store.create(VMI, ns, {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                                               "metadata": {"name": name, "namespace": ns},
                                               "spec": {"domain": {"devices": {}}}})
        assert code == 201, vmi
        cond = {"type": "LiveMigratable", "status": "True" if migratable else "False"}
        if not migratable:
            cond.update(reason=reason, message=message)
        status = {"phase": phase, "nodeName": node, "conditions": [cond]}
        if migration_state:
            status["migrationState"] = migration_state
        return self._write(VMI, ns, name, lambda o: o.update(status=status), sub="status")

    def vmi(self, ns, name):
        code, obj = self.store.get(VMI, ns, name)
        return obj if code == 200 else None

    # -- the controllers' loop -------------------------------------------------------------
    def _write(self, plural, ns, name, change, sub=None):
        for _ in range(50):
            code, obj = self.store.get(plural, ns, name)
            if code != 200:
                return None
            change(obj)
            code, body = self.store.replace(plural, ns, name, obj, sub)
            if code == 200:
                return body
            assert code == 409, body
        raise AssertionError("kubevirt stand-in: could not write %s %s/%s" % (plural, ns, name))

    def _loop(self):
        while not self.stopping:
            for vmim in self.store.objects_of(VMIM):
                uid = vmim["metadata"]["uid"]
                if uid not in self.handled:
                    self.handled.add(uid)
                    threading.Thread(target=self._migrate, args=(vmim,), daemon=True).start()
            time.sleep(self.step)

    def _vmim_gone_or_deleting(self, ns, name):
        code, obj = self.store.get(VMIM, ns, name)
        return code != 200 or "deletionTimestamp" in obj["metadata"]

    def _phase(self, ns, name, phase, **status):
        def change(o):
            st = o.setdefault("status", {})
            st["phase"] = phase
            st.setdefault("phaseTransitionTimestamps", []).append(
                {"phase": phase, "phaseTransitionTimestamp": now_rfc3339()})
            st.update(status)
        self._write(VMIM, ns, name, change, sub="status")

    def _release(self, ns, name):
        self._write(VMIM, ns, name, lambda o: o["metadata"].update(
            finalizers=[f for f in o["metadata"].get("finalizers", []) if f != FINALIZER]))

    def _migrate(self, vmim):
        md = vmim["metadata"]
        ns, name, uid = md["namespace"], md["name"], md["uid"]
        self._write(VMIM, ns, name, lambda o: o["metadata"].update(
            finalizers=o["metadata"].get("finalizers", []) + [FINALIZER]))
        vmi = self.vmi(ns, vmim["spec"]["vmiName"])
        if vmi is None or vmi.get("status", {}).get("phase") != "Running":
            self._phase(ns, name, "Failed", conditions=[{"type": "Failed", "status": "True",
                                                        "message": "VMI is not running"}])
            return self._release(ns, name)
        vmi_name, source = vmi["metadata"]["name"], vmi["status"]["nodeName"]
        target = self.performer.target_node(source, vmim)
        m = Migration(uid, ns, vmi_name, source, target)
        self.migrations[uid] = m
        for phase in PHASES_BEFORE_RUNNING:
            if self._vmim_gone_or_deleting(ns, name):
                return self._abort(m, name, started=False)
            self._phase(ns, name, phase)
            if phase == "TargetReady":
                state = {"migrationUid": uid, "sourceNode": source, "targetNode": target, "mode": "PreCopy",
                         "targetPod": "virt-launcher-%s-%s" % (vmi_name, uuid.uuid4().hex[:5]),
                         "targetNodeAddress": "127.0.0.1", "completed": False, "failed": False}
                self._write(VMI, ns, vmi_name, lambda o: o["status"].update(migrationState=state), sub="status")
            time.sleep(self.step)
        self._write(VMI, ns, vmi_name, lambda o: o["status"]["migrationState"].update(startTimestamp=now_rfc3339()),
                    sub="status")
        self._phase(ns, name, "Running")
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            out=self.performer.perform(m, self.figures)), daemon=True)
        worker.start()
        while worker.is_alive():
            if not m.abort.is_set() and self._vmim_gone_or_deleting(ns, name):
                m.abort.set()  # KubeVirt's abort: the performer cancels on the source
            worker.join(self.step)
        ok, reason = result.get("out", (False, "performer crashed"))
        if m.abort.is_set():
            return self._abort(m, name, started=True)
        end = now_rfc3339()

        def finish(o):
            ms = o["status"]["migrationState"]
            ms.update(endTimestamp=end, completed=True, failed=not ok)
            if ok:
                o["status"]["nodeName"] = target
            else:
                ms["failureReason"] = reason or "migration failed"
        self._write(VMI, ns, vmi_name, finish, sub="status")
        self._phase(ns, name, "Succeeded" if ok else "Failed")
        self._release(ns, name)  # KubeVirt drops its finalizer once the migration ended

    def _abort(self, m, name, started):
        if started:
            def aborted(o):
                o["status"]["migrationState"].update(endTimestamp=now_rfc3339(), completed=True, failed=True,
                                                     abortStatus="Succeeded", failureReason="Migration aborted")
            self._write(VMI, m.namespace, m.vmi, aborted, sub="status")
        if self.store.get(VMIM, m.namespace, name)[0] == 200:
            self._phase(m.namespace, name, "Failed")
            self._release(m.namespace, name)
