"""RdmaDrainPlan end to end (docs/drain.md): the API server double (the CRD's schema and CEL
rules enforced, status subresource), rdmig-controller, KubeVirt VMIs as objects (their memory in
the spec, their dirty rate in annotations), path checks read from the store or run by the
controller with two real rdmig-agents over TCP. No guest boots.

Executing plans (spec.execute true): the controller's RdmaMigrations become
VirtualMachineInstanceMigrations as in tests/k8s/test_kubevirt.py, and the KubeVirt stand-in
(kubevirt_standin.py) migrates them: DrainPerformer below takes a set time per VMI (or fails
it), publishes rdmig's record with libvirt's figures (the time it took, 30 ms of downtime) on
the FigureServer that stands in for nodes d to h's agents, and keeps each run's interval, the
truth the concurrency checks read beside the plan's own timestamps.

Run from the repository root after building:
    RDMIG_AGENT=build/agent/rdmig-agent RDMIG_CONTROLLER=build/controller/rdmig-controller \\
        python3 tests/k8s/test_drainplan.py -v
"""
import os
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
from controllerlab import AgentsAndControllerTest, Controller, wait_for  # noqa: E402
from kubevirt_standin import VMIM, FigureServer, KubevirtStandin  # noqa: E402

NS = "ops"
VM_NS = "vms"
AGENT_NS = "rdmig-system"
MiB = 1 << 20
GiB = 1 << 30


PLAN_UID_LABEL = "rdmig.io/drain-plan-uid"
EXEC_NODES = ("node-d", "node-f", "node-g", "node-h", "node-i", "node-j",  # one for each of the tests below
              "node-k", "node-l", "node-m", "node-n")
TARGET = "node-e"


class DrainPerformer:
    """The stand-in's migration of one VMI: `seconds[vmi]` long (default 0.4), failed for the VMIs
    in `fail`; publishes rdmig's record (the agents' contract, as AgentPairPerformer does) with
    libvirt's total time (what it took) and downtime (30 ms); `runs` holds (vmi, start, end)."""

    def __init__(self):
        self.seconds, self.fail, self.runs, self.lock = {}, set(), [], threading.Lock()

    def target_node(self, source_node, vmim):
        return TARGET

    def perform(self, m, figures):
        t0 = time.time()
        aborted = m.abort.wait(self.seconds.get(m.vmi, 0.4))
        t1 = time.time()
        with self.lock:
            self.runs.append((m.vmi, t0, t1))
        if aborted:
            return False, "aborted"
        ok = m.vmi not in self.fail
        figures.publish(m.source_node, {
            "migrationUid": m.uid, "vmi": {"namespace": m.namespace, "name": m.vmi, "uid": ""}, "role": "source",
            "sourceNode": m.source_node, "targetNode": m.target_node, "mode": "hook", "carried": True,
            "reason": None, "phase": "Succeeded" if ok else "Failed", "transport": "tcp",
            "transportReason": "requested", "connections": 1, "bytesSent": 1 << 20, "bytesReceived": 0,
            "chunksSent": 1, "chunksReceived": 1, "throughputBytesPerSecond": 1 << 30,
            "libvirt": {"downtimeMs": 30, "totalTimeMs": int((t1 - t0) * 1000), "dataTotalBytes": 1 << 20}
            if ok else None, "switchoverMs": 10, "startedAtMs": int(t0 * 1000), "finishedAtMs": int(t1 * 1000)})
        return ok, None if ok else "injected failure of " + m.vmi


def most_at_once(intervals):
    """The most intervals (start, end) that hold one instant."""
    return max((sum(1 for s, e in intervals if s <= t < e) for t, _ in intervals), default=0)


def plan(name, node, **spec):
    body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaDrainPlan",
            "metadata": {"name": name, "namespace": NS}, "spec": {"node": node}}
    body["spec"].update(spec)
    return body


class DrainPlanControllerTest(AgentsAndControllerTest):
    PLURAL, NS, AGENT_NS, TMP_PREFIX = "rdmadrainplans", NS, AGENT_NS, "rdmig-k8s-dp-"

    @classmethod
    def lab_setup(cls):
        # Nodes whose agents stand in through FigureServer, for the executing plans.
        cls.figures = FigureServer(cls.token)
        for node in EXEC_NODES + (TARGET,):
            cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-" + node, node, cls.figures.start(node))
        cls.performer = DrainPerformer()
        cls.standin = KubevirtStandin(cls.store, cls.performer, cls.figures)

    @classmethod
    def lab_teardown(cls):
        cls.standin.stop()
        cls.figures.stop()

    # -- helpers ---------------------------------------------------------------------------
    def add_vmi(self, name, node, memory=None, dirty=None, labels=None, ns=VM_NS, resident=None):
        domain = {"devices": {}}
        if memory:
            domain["memory"] = {"guest": memory}
        md = {"name": name, "namespace": ns, "labels": dict(labels or {}, **{"kubevirt.io/nodeName": node})}
        if dirty is not None:
            md["annotations"] = {"rdmig.io/dirty-rate-bytes-per-second": str(dirty),
                                 "rdmig.io/dirty-rate-time": "2026-12-05T09:00:00Z"}
        if resident is not None:  # as a recording job copies kubevirt_vmi_memory_resident_bytes
            md.setdefault("annotations", {}).update({"rdmig.io/resident-memory-bytes": resident,
                                                     "rdmig.io/resident-memory-time": "2026-12-05T09:01:00Z"})
        code, obj = self.store.create("virtualmachineinstances", ns, {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": md,
            "spec": {"domain": domain}})
        self.assertEqual(code, 201, obj)
        obj["status"] = {"phase": "Running", "nodeName": node}
        code, obj = self.store.replace("virtualmachineinstances", ns, name, obj, subresource="status")
        self.assertEqual(code, 200, obj)

    def add_checked_path(self, name, source, target, throughput, when="2026-12-05T08:00:00Z"):
        # With its status from the start: the controller would otherwise run a check it sees without one.
        code, obj = self.store.create_with_status("rdmapathchecks", NS, {
            "apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaPathCheck", "metadata": {"name": name, "namespace": NS},
            "spec": {"source": source, "targets": {"nodes": [target]}},
            "status": {"phase": "Succeeded", "completionTime": when, "pairs": [
                {"source": source, "target": target, "phase": "Passed", "transport": "rdma",
                 "throughputBytesPerSecond": throughput, "rttMicroseconds": 0, "bytes": GiB, "bytesVerified": GiB}]}})
        self.assertEqual(code, 201, obj)

    def migrations_of(self, obj):
        uid = obj["metadata"]["uid"]
        return [m for m in self.store.objects_of("rdmamigrations")
                if m["metadata"].get("labels", {}).get(PLAN_UID_LABEL) == uid]

    def plan_metric(self, metric, plan_name, **labels):
        key = frozenset(dict(labels, namespace=NS, name=plan_name).items())
        return self.controller.metrics().get((metric, key))

    def runs_of(self, vmis):
        with self.performer.lock:
            return [r for r in self.performer.runs if r[0] in vmis]

    def check_concurrency(self, st, vmis, limit):
        """At most `limit` at once by the plan's timestamps (its start, the end it saw) and by the
        stand-in's runs; returns the most at once by the plan's timestamps."""
        from datetime import datetime
        def t(text):
            return datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp() \
                if "." in text else datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S%z").timestamp()
        executed = [v for v in st["vms"] if "migration" in v]
        plan_intervals = [(t(v["startTime"]), t(v["finishTime"])) for v in executed]
        self.assertLessEqual(most_at_once(plan_intervals), limit, executed)
        runs = self.runs_of(vmis)
        self.assertLessEqual(most_at_once([(s, e) for _, s, e in runs]), limit, runs)
        return most_at_once(plan_intervals)

    # -- cases -----------------------------------------------------------------------------
    def test_forecast_from_the_latest_path_check_with_hand_computed_figures(self):
        # node-c -> node-a measured at 1 GiB/s (an older check said 4 GiB/s).
        self.add_checked_path("c-old", "node-c", "node-a", 4.0 * GiB, when="2026-12-04T08:00:00Z")
        self.add_checked_path("c-new", "node-c", "node-a", 1.0 * GiB)
        self.add_vmi("steady", "node-c", memory="1Gi", dirty=256 * MiB)   # one pass: 1.27 s, downtime 0.27 s
        self.add_vmi("idle", "node-c", memory="512Mi", dirty=0)           # 0.5 + 0.02 s
        self.add_vmi("hot", "node-c", memory="1Gi", dirty=2 * GiB)        # never converges
        self.add_vmi("nomem", "node-c", dirty=0)                          # no memory in its spec
        self.add_vmi("unmeasured", "node-c", memory="256Mi")              # no dirty rate: 0.25 + 0.02 s
        self.add_vmi("elsewhere", "node-b", memory="1Gi", dirty=0)        # another node
        # 2 GiB of which its QEMU holds 128 MiB resident (Prometheus' spelling): pass 0 moves 128 MiB,
        # 0.125 + 0.02 s; a resident figure that does not read counts as the memory: 0.25 + 0.02 s.
        self.add_vmi("young", "node-c", memory="2Gi", dirty=0, resident="1.34217728e+08")
        self.add_vmi("badres", "node-c", memory="256Mi", dirty=0, resident="lots")
        self.create(plan("drain-c", "node-c", maxConcurrentPerPair=1, maxDowntime="300ms"))
        obj = self.wait_phase("drain-c", ("Forecast", "Failed"))
        st = obj["status"]
        print("\nstatus:", st)
        self.assertEqual(st["phase"], "Forecast", st)
        self.assertEqual(st["path"]["pathCheck"], NS + "/c-new")
        self.assertEqual(st["path"]["throughputBytesPerSecond"], 1.0 * GiB)
        s = st["summary"]
        self.assertEqual((s["vms"], s["withinLimits"], s["notConverging"], s["noInput"], s["unmeasuredDirtyRate"]),
                         (7, 5, 1, 1, 1))
        self.assertAlmostEqual(s["predictedDrainSeconds"], 1.27 + 0.52 + 0.27 + 0.145 + 0.27, places=3)
        # What the planned VMs move over 1 GiB/s: 1 + 0.5 + 0.25 + 0.125 (young's resident) + 0.25 GiB.
        self.assertAlmostEqual(s["lowerBoundSeconds"], 2.125, places=3)
        vms = {v["name"]: v for v in st["vms"]}
        self.assertNotIn("elsewhere", vms)
        self.assertEqual([v["name"] for v in st["vms"]][:2], ["hot", "nomem"])  # attention first
        steady = vms["steady"]
        self.assertEqual((steady["passes"], steady["totalSeconds"], steady["downtimeSeconds"]), (1, 1.27, 0.27))
        self.assertEqual(steady["order"], 0)  # longest first
        self.assertEqual(steady["dirtyRateSource"], "annotation")
        self.assertEqual(steady["dirtyRateTime"], "2026-12-05T09:00:00Z")
        self.assertTrue(steady["convergesWithinLimits"])
        hot = vms["hot"]
        self.assertFalse(hot["convergesWithinLimits"])
        self.assertIn("is not below the throughput", hot["reason"])
        self.assertEqual(hot["remedies"]["postCopy"], {"totalSeconds": 2.02, "downtimeSeconds": 0.02})
        self.assertEqual(hot["remedies"]["largerDowntime"]["maxDowntimeSeconds"], 1.02)
        self.assertIn("memory", vms["nomem"]["reason"])
        self.assertEqual(vms["unmeasured"]["dirtyRateSource"], "none")
        young = vms["young"]
        self.assertEqual((young["memorySource"], young["memoryBytes"], young["residentMemoryBytes"]),
                         ("resident", 2 * GiB, 128 * MiB))
        self.assertEqual(young["residentMemoryTime"], "2026-12-05T09:01:00Z")
        # 128 MiB fit within the downtime limit at 1 GiB/s: stopped before a pass, all of it paused.
        self.assertEqual((young["passes"], young["totalSeconds"], young["downtimeSeconds"]), (0, 0.145, 0.145))
        self.assertEqual(vms["badres"]["memorySource"], "spec")
        self.assertNotIn("residentMemoryBytes", vms["badres"])
        self.assertEqual(vms["badres"]["totalSeconds"], 0.27)
        self.assertEqual(steady["memorySource"], "spec")
        self.assertIn("no measured dirty rate", vms["unmeasured"]["reason"])
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual(conds["Forecast"]["status"], "True")
        self.assertEqual(conds["WithinLimits"]["status"], "False")
        self.assertEqual(conds["WithinLimits"]["reason"], "NotConverging")
        self.assertEqual(st["observedGeneration"], obj["metadata"]["generation"])
        wait_for(lambda: ("Warning", "Forecast") in self.reasons("drain-c"), 10, "the Forecast event")

    def test_a_path_never_checked_is_checked_first_by_the_agents(self):
        self.add_vmi("on-b", "node-b", memory="256Mi", dirty=MiB)
        self.create(plan("drain-b", "node-b", targets=["node-a"], pathCheckBytes="16Mi"))
        waiting = self.wait_phase("drain-b", ("WaitingForPathCheck", "Forecast", "Failed"))
        check = self.get("drain-b-paths", "rdmapathchecks")
        self.assertIsNotNone(check, waiting)
        self.assertEqual(check["spec"]["source"], "node-b")
        self.assertEqual(check["spec"]["targets"], {"nodes": ["node-a"]})
        self.assertEqual(check["metadata"]["ownerReferences"][0]["kind"], "RdmaDrainPlan")
        obj = self.wait_phase("drain-b", ("Forecast", "Failed"), timeout=90)
        st = obj["status"]
        self.assertEqual(st["phase"], "Forecast", st)
        self.assertEqual(st["path"]["pathCheck"], NS + "/drain-b-paths")
        self.assertEqual(st["path"]["target"], "node-a")
        self.assertGreater(st["path"]["throughputBytesPerSecond"], 0)  # what the real agents carried
        self.assertEqual(st["summary"]["withinLimits"], 1)
        self.assertIn(("Normal", "PathCheckCreated"), self.reasons("drain-b"))

    def running_path_check(self, plan_name, source):
        """Until the plan's own path check (<plan>-paths) runs a pair and bytes flow on the source
        agent: (the check, its pair's check id)."""
        def running():
            check = self.get(plan_name + "-paths", "rdmapathchecks")
            pairs = (check or {}).get("status", {}).get("pairs", [])
            return check if pairs and pairs[0].get("phase") == "Running" and pairs[0].get("checkId") else None
        check = wait_for(running, 30, plan_name + "'s path check to run")
        cid = check["status"]["pairs"][0]["checkId"]
        wait_for(lambda: self.agents[source].call("GET", "/v1/pathchecks/" + cid)["bytesSent"] > 16 * MiB, 20,
                 "bytes to flow")
        return check, cid

    def cancel_and_wait(self, name, timeout):
        """spec.cancel on plan `name`; its status once it ended, which must be Cancelled."""
        code, body = self.edit_spec(name, cancel=True)
        self.assertEqual(code, 200, body)
        st = self.wait_phase(name, ("Cancelled", "Forecast", "Executing", "Failed"), timeout=timeout)["status"]
        self.assertEqual(st["phase"], "Cancelled", st)
        return st

    def wait_stop_recorded(self, name):
        """Plan `name`'s status once it records its path check's stop (stopTime)."""
        return wait_for(lambda: (lambda s: s if "stopTime" in s.get("createdPathCheck", {}) else None)(
            self.get(name)["status"]), 20, "the stop to be recorded")

    def assert_stopped_on_the_agents(self, cid, source, target):
        src = self.agents[source].call("GET", "/v1/pathchecks/" + cid)
        dst = self.agents[target].call("GET", "/v1/pathchecks/" + cid)
        print("\nsource:", src, "\ntarget:", dst)
        self.assertEqual(src["phase"], "Cancelled", src)
        self.assertIn(dst["phase"], ("Cancelled", "Failed"))
        self.assertIn("cancelled", dst["error"])
        self.assertLess(src["bytesSent"], 48 << 30)

    def test_a_plan_cancelled_while_its_path_check_runs_stops_that_check(self):
        # node-b -> node-c was never checked: the plan runs a check of 48Gi (about half a minute
        # or more here) and is cancelled while it runs.
        self.add_vmi("on-b-cancel", "node-b", memory="256Mi", dirty=0)
        obj = self.create(plan("cancel-b", "node-b", targets=["node-c"], pathCheckBytes="48Gi", execute=True))
        try:
            check, cid = self.running_path_check("cancel-b", "b")
            self.assertEqual(self.get("cancel-b")["status"]["phase"], "WaitingForPathCheck")
            st = self.cancel_and_wait("cancel-b", timeout=20)
            # Stopped as it was cancelled, or (the check's status written under each of the delete's
            # tries: 409 on its preconditions, seen with the rows beside it) at a poll soon after.
            st = self.wait_stop_recorded("cancel-b")
            self.assertNotIn("stopError", st["createdPathCheck"])
            # The check goes (deleting it is its cancel: its finalizer cancels the pair on both agents).
            wait_for(lambda: self.get("cancel-b-paths", "rdmapathchecks") is None, 20, "the path check to go")
            self.assert_stopped_on_the_agents(cid, "b", "c")
            pc = st["createdPathCheck"]
            print("\ncancelled:", st)
            self.assertEqual(pc["name"], NS + "/cancel-b-paths")
            self.assertIn("stopTime", pc)
            self.assertEqual(pc["stopped"], "0 of 1 pair(s) ended, 1 running")
            cond = {c["type"]: c for c in st["conditions"]}["Cancelled"]
            self.assertIn("path check %s/cancel-b-paths stopped at" % NS, cond["message"])
            wait_for(lambda: ("Normal", "PathCheckStopped") in self.reasons("cancel-b"), 10, "the PathCheckStopped event")
            # None started after the cancel (the controller polls every 250 ms), and nothing migrated.
            time.sleep(3)
            self.assertEqual([c["metadata"]["name"] for c in self.store.objects_of("rdmapathchecks")
                              if c["metadata"].get("labels", {}).get(PLAN_UID_LABEL) == obj["metadata"]["uid"]
                              or c["metadata"]["name"] == "cancel-b-paths"], [])
            self.assertEqual(self.migrations_of(obj), [])
            self.assertEqual(self.get("cancel-b")["status"]["phase"], "Cancelled")
            self.assertEqual(check["metadata"]["labels"].get(PLAN_UID_LABEL), obj["metadata"]["uid"])
        finally:
            self.store.delete("rdmapathchecks", NS, "cancel-b-paths")  # not left running for the next cases

    def test_a_plan_cancelled_as_its_path_check_ends_leaves_the_check_and_its_result(self):
        # The race of a cancel with the check's end: the controller read the check Running, and its
        # DELETE reaches the API server only after the check ended and its result was written (the
        # double holds the DELETE until then: a slow request). The delete's preconditions (uid,
        # resourceVersion) no longer hold: 409, nothing deleted; the controller reads the check
        # again, finds it ended, and leaves it with its result. Without preconditions the DELETE
        # went through and the finished check was gone with its result.
        self.add_vmi("on-a-race", "node-a", memory="256Mi", dirty=0)
        self.create(plan("race-a", "node-a", targets=["node-c"], pathCheckBytes="8Gi", execute=True))
        held = []

        def hold_until_the_check_ended(path):
            if not path.split("?")[0].endswith("/rdmapathchecks/race-a-paths"):
                return
            held.append(path)
            wait_for(lambda: (self.get("race-a-paths", "rdmapathchecks") or {}).get("status", {}).get("phase")
                     not in (None, "", "Pending", "Running"), 120, "the path check to end by itself")
        try:
            _, cid = self.running_path_check("race-a", "a")
            self.api.before_delete = hold_until_the_check_ended
            st = self.cancel_and_wait("race-a", timeout=150)
            self.assertGreaterEqual(len(held), 1, "the controller's DELETE of the check")
            # Every DELETE refused by its preconditions: the first, and any the controller sent
            # again after its client gave up waiting on a held one (15 s) and read the check Running.
            deletes = [code for m, p, _, code in self.api.requests
                       if m == "DELETE" and p.split("?")[0].endswith("/rdmapathchecks/race-a-paths")]
            self.assertEqual(set(deletes), {409}, deletes)
            check = self.get("race-a-paths", "rdmapathchecks")
            print("\ncancelled:", st, "\ncheck:", check and check["status"])
            self.assertIsNotNone(check, "the ended check is kept")
            self.assertEqual(check["status"]["phase"], "Succeeded", check["status"])
            pair = check["status"]["pairs"][0]
            self.assertIn(pair["phase"], ("Passed", "FellBack"), pair)  # these agents carry TCP
            self.assertEqual(pair["bytesVerified"], 8 * GiB, pair)
            self.assertGreater(pair["throughputBytesPerSecond"], 0, pair)
            self.assertNotIn("stopTime", st.get("createdPathCheck", {}), "nothing was stopped")
            self.assertNotIn(("Normal", "PathCheckStopped"), self.reasons("race-a"))
            self.assertEqual(self.agents["a"].call("GET", "/v1/pathchecks/" + cid)["phase"], "Succeeded")
        finally:
            self.api.before_delete = None
            self.store.delete("rdmapathchecks", NS, "race-a-paths")  # its measurement is no other case's

    def test_a_cancel_whose_path_check_stop_is_refused_still_cancels_and_stops_the_check_later(self):
        # The API server refuses the controller's DELETE of the check (RBAC without delete on
        # rdmapathchecks, fixed a few seconds later): the cancel is not held up by it; the plan is
        # Cancelled at once, names the refusal, and stops the check once the delete is allowed.
        self.add_vmi("on-b-refused", "node-b", memory="256Mi", dirty=0)
        self.create(plan("refuse-b", "node-b", targets=["node-c"], pathCheckBytes="48Gi", execute=True))
        refused = []

        def forbid(path):
            if path.split("?")[0].endswith("/rdmapathchecks/refuse-b-paths"):
                refused.append(path)
                return (403, "Forbidden", 'rdmapathchecks.rdmig.io "refuse-b-paths" is forbidden: User '
                        '"system:serviceaccount:rdmig:rdmig-controller" cannot delete resource "rdmapathchecks"')
            return None
        try:
            _, cid = self.running_path_check("refuse-b", "b")
            self.api.before_delete = forbid
            st = self.cancel_and_wait("refuse-b", timeout=20)
            self.assertGreaterEqual(len(refused), 1)
            pc = st["createdPathCheck"]
            print("\ncancelled while refused:", st)
            self.assertNotIn("stopTime", pc)
            self.assertIn("forbidden", pc["stopError"])
            cond = {c["type"]: c for c in st["conditions"]}["Cancelled"]
            self.assertIn("path check %s/refuse-b-paths still runs: stopping it failed (" % NS, cond["message"])
            wait_for(lambda: ("Warning", "PathCheckStopFailed") in self.reasons("refuse-b"), 10,
                     "the PathCheckStopFailed event")
            check = self.get("refuse-b-paths", "rdmapathchecks")
            self.assertIsNotNone(check, "refused: the check runs on")
            self.assertNotIn(self.agents["b"].call("GET", "/v1/pathchecks/" + cid)["phase"],
                             ("Succeeded", "Failed", "Cancelled"), "refused: its pair runs on")
            # Tried again while refused (each poll, also of the Cancelled plan), then allowed: stopped.
            wait_for(lambda: len(refused) >= 2, 20, "the stop to be tried again")
            self.api.before_delete = None
            wait_for(lambda: self.get("refuse-b-paths", "rdmapathchecks") is None, 60, "the path check to go")
            self.assert_stopped_on_the_agents(cid, "b", "c")
            st = self.wait_stop_recorded("refuse-b")
            self.assertEqual(st["phase"], "Cancelled")
            self.assertNotIn("stopError", st["createdPathCheck"])
            self.assertEqual(st["createdPathCheck"]["stopped"], "0 of 1 pair(s) ended, 1 running")
            cond = {c["type"]: c for c in st["conditions"]}["Cancelled"]
            self.assertIn("path check %s/refuse-b-paths stopped at" % NS, cond["message"])
            self.assertNotIn("stopping it failed", cond["message"])
            wait_for(lambda: ("Normal", "PathCheckStopped") in self.reasons("refuse-b"), 10,
                     "the PathCheckStopped event")
            self.assertEqual(self.migrations_of(self.get("refuse-b")), [])
        finally:
            self.api.before_delete = None
            self.store.delete("rdmapathchecks", NS, "refuse-b-paths")
            self.store.delete("virtualmachineinstances", VM_NS, "on-b-refused")  # node-b's VMs are other cases'

    def test_a_forecast_only_plan_deleted_mid_check_takes_its_path_check_with_it(self):
        # Deleting the plan: the garbage collector deletes the check it owns (owner reference),
        # which cancels its pair on both agents; no finalizer on the plan is needed for that.
        self.add_vmi("on-a-delete", "node-a", memory="256Mi", dirty=0)
        self.create(plan("look-a", "node-a", targets=["node-c"], pathCheckBytes="48Gi"))
        try:
            check, cid = self.running_path_check("look-a", "a")
            self.assertEqual(check["metadata"]["ownerReferences"][0]["name"], "look-a")
            self.assertIn(self.store.delete("rdmadrainplans", NS, "look-a")[0], (200, 202))
            wait_for(lambda: self.get("look-a-paths", "rdmapathchecks") is None, 20, "the path check to go")
            self.assert_stopped_on_the_agents(cid, "a", "c")
        finally:
            self.store.delete("rdmapathchecks", NS, "look-a-paths")

    def test_a_node_without_an_agent_cannot_be_forecast(self):
        obj = self.wait_phase(self.create(plan("drain-x", "node-x"))["metadata"]["name"], ("Forecast", "Failed"))
        cond = {c["type"]: c for c in obj["status"]["conditions"]}["Forecast"]
        self.assertEqual((obj["status"]["phase"], cond["reason"]), ("Failed", "NoAgent"), obj["status"])
        self.assertIn("node-x", cond["message"])

    def test_an_api_server_outage_while_finding_the_agent_is_retried_not_a_failure(self):
        self.add_checked_path("i-path", "node-i", TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        self.api.refuse_lists["pods"] = (503, "ServiceUnavailable", "the API server is overloaded")
        try:
            self.create(plan("outage", "node-i"))
            wait_for(lambda: any(r[0] == "GET" and "/pods?" in r[1] and str(r[3]) == "503"
                                 and r[2].startswith("rdmig-controller/") for r in list(self.api.requests)), 30,
                     "the controller to meet the outage")
            self.assertNotEqual(self.get("outage").get("status", {}).get("phase"), "Failed")
        finally:
            self.api.refuse_lists.pop("pods", None)
        st = self.wait_phase("outage", ("Forecast", "Failed"), timeout=60)["status"]
        self.assertEqual(st["phase"], "Forecast", st)

    def edit_spec(self, name, **changes):
        """PUTs the plan with its spec changed (None removes a field), over the stored object
        (re-read on a conflict with the controller's status writes): (code, body)."""
        for _ in range(20):
            obj = self.get(name)
            spec = {k: v for k, v in dict(obj["spec"], **changes).items() if v is not None}
            code, body = self.store.replace("rdmadrainplans", NS, name, dict(obj, spec=spec))
            if code != 409:
                return code, body
        self.fail("%s: 20 conflicts in a row" % name)

    def test_the_spec_is_immutable_execute_included(self):
        obj = self.create(plan("frozen", "node-x", maxDowntime="1s"))
        for field, value in (("maxDowntime", "2s"), ("execute", True), ("selector", {"app": "web"}),
                             ("node", "node-y"), ("maxDowntime", None)):
            code, body = self.edit_spec("frozen", **{field: value})
            self.assertEqual(code, 422, (field, body))
            self.assertIn("immutable except spec.cancel", body["message"])
        # The cancel, and what it does to the running migrations, may change; a cancel is not taken back.
        code, body = self.edit_spec("frozen", runningOnCancel="Cancel")
        self.assertEqual(code, 200, body)
        code, body = self.edit_spec("frozen", cancel=True)
        self.assertEqual(code, 200, body)
        self.assertEqual(body["metadata"]["generation"], obj["metadata"]["generation"] + 2)
        code, body = self.edit_spec("frozen", runningOnCancel="Sometimes")
        self.assertEqual(code, 422, body)
        for value in (False, None):
            code, body = self.edit_spec("frozen", cancel=value)
            self.assertEqual(code, 422, body)
            self.assertIn("cannot be taken back", body["message"])
        code, body = self.store.create("rdmadrainplans", NS, plan("bad-downtime", "node-a", maxDowntime="soon"))
        self.assertEqual(code, 422, body)
        code, body = self.store.create("rdmadrainplans", NS, plan("bad-policy", "node-a", execute=True,
                                                                   notConverging="Sometimes"))
        self.assertEqual(code, 422, body)
        self.assertIn("notConverging", body["message"])

    # -- execute ---------------------------------------------------------------------------
    def test_execute_runs_the_plans_order_within_its_concurrency_and_records_actual_beside_forecast(self):
        node = "node-d"
        self.add_checked_path("d-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        sizes = {"big": 1024, "mid": 768, "small": 512, "tiny": 256}
        for name, mib in sizes.items():
            self.add_vmi(name, node, memory="%dMi" % mib, dirty=0, ns=NS)
            self.performer.seconds[name] = 0.3 + mib / 1024.0
        self.add_vmi("hot", node, memory="1Gi", dirty=2 * GiB, ns=NS)  # never converges: not started
        # A path capacity of 4 GiB/s: two at once each keep the 1 GiB/s one channel carried.
        obj = self.create(plan("drain-d", node, execute=True, maxConcurrentPerPair=2, pathCapacity="4Gi"))
        st = self.wait_phase("drain-d", ("Completed", "Failed"), timeout=120)["status"]
        print("\nexecution:", st["execution"])
        self.assertEqual(st["phase"], "Completed", st)
        ex = st["execution"]
        self.assertEqual((ex["succeeded"], ex["failed"], ex["skipped"], ex["pending"], ex["running"]), (4, 0, 1, 0, 0))
        vms = {v["name"]: v for v in st["vms"]}
        self.assertEqual(vms["hot"]["outcome"], "Skipped")
        self.assertIn("postCopy", vms["hot"]["remedies"])
        # One RdmaMigration per started VMI, owned by the plan and labelled with it; none for "hot".
        migrations = self.migrations_of(obj)
        self.assertEqual(sorted(m["spec"]["source"]["vmi"]["name"] for m in migrations), sorted(sizes))
        for m in migrations:
            self.assertEqual(m["metadata"]["labels"]["rdmig.io/drain-plan"], "drain-d")
            self.assertEqual(m["metadata"]["ownerReferences"][0]["uid"], obj["metadata"]["uid"])
            self.assertEqual(m["status"]["phase"], "Succeeded")
        # The plan's order: longest first, started in that order.
        executed = sorted((v for v in st["vms"] if "migration" in v), key=lambda v: v["order"])
        self.assertEqual([v["name"] for v in executed], ["big", "mid", "small", "tiny"])
        self.assertEqual([v["startTime"] for v in executed], sorted(v["startTime"] for v in executed))
        runs = sorted(self.runs_of(set(sizes)), key=lambda r: r[1])
        self.assertEqual([r[0] for r in runs], ["big", "mid", "small", "tiny"])
        # Never more than 2 at once, and the plan did run 2 at once (whether the stand-in's runs
        # overlap too depends on how fast it walks KubeVirt's phases on a busy machine).
        self.assertEqual(self.check_concurrency(st, set(sizes), 2), 2)
        # Each VM: the forecast it started with, what it took (libvirt's figures), the ratio.
        took = {vmi: end - start for vmi, start, end in runs}
        for v in executed:
            self.assertEqual(v["outcome"], "Succeeded")
            self.assertAlmostEqual(v["actualTotalSeconds"], took[v["name"]], delta=0.002)
            self.assertEqual(v["actualDowntimeSeconds"], 0.03)
            self.assertAlmostEqual(v["totalRatio"], v["actualTotalSeconds"] / v["totalSeconds"], delta=0.01)
            self.assertAlmostEqual(v["downtimeRatio"], 0.03 / v["downtimeSeconds"], delta=0.01)
        self.assertAlmostEqual(vms["big"]["totalSeconds"], 1.02, places=2)  # 1 GiB at 1 GiB/s + 20 ms
        # The node: forecast against actual.
        self.assertEqual(ex["predictedDrainSeconds"], st["summary"]["predictedDrainSeconds"])
        self.assertGreater(ex["actualDrainSeconds"], max(r[2] for r in runs) - min(r[1] for r in runs) - 0.01)
        self.assertAlmostEqual(ex["drainRatio"], ex["actualDrainSeconds"] / ex["predictedDrainSeconds"], delta=0.01)
        self.assertGreaterEqual(ex["measured"], 2)  # the later starts were re-planned on measured figures
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual((conds["Executed"]["status"], conds["Executed"]["reason"]), ("False", "VMsSkipped"))
        self.assertEqual(conds["MigrationFailed"]["status"], "False")
        wait_for(lambda: ("Warning", "DrainIncomplete") in self.reasons("drain-d"), 10, "the DrainIncomplete event")
        self.assertIn(("Normal", "DrainStarted"), self.reasons("drain-d"))
        # Metrics by plan.
        self.assertEqual(self.plan_metric("rdmig_controller_drainplan_vms", "drain-d", state="succeeded"), 4)
        self.assertEqual(self.plan_metric("rdmig_controller_drainplan_vms", "drain-d", state="skipped"), 1)
        self.assertEqual(self.plan_metric("rdmig_controller_drainplan_vms", "drain-d", state="running"), 0)
        self.assertAlmostEqual(self.plan_metric("rdmig_controller_drainplan_predicted_drain_seconds", "drain-d"),
                               ex["predictedDrainSeconds"])
        self.assertAlmostEqual(self.plan_metric("rdmig_controller_drainplan_actual_drain_seconds", "drain-d"),
                               ex["actualDrainSeconds"])

    def test_execute_a_failed_migration_is_reported_and_the_others_go_on(self):
        node = "node-f"
        self.add_checked_path("f-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        for name, mem in (("f-first", "1Gi"), ("f-broken", "512Mi"), ("f-last", "256Mi")):
            self.add_vmi(name, node, memory=mem, dirty=0)  # in another namespace than the plan
        self.performer.fail.add("f-broken")
        obj = self.create(plan("drain-f", node, execute=True, maxConcurrentPerPair=1))
        st = self.wait_phase("drain-f", ("Completed", "Failed"), timeout=120)["status"]
        self.assertEqual(st["phase"], "Completed", st)
        ex = st["execution"]
        self.assertEqual((ex["succeeded"], ex["failed"], ex["skipped"]), (2, 1, 0))
        vms = {v["name"]: v for v in st["vms"]}
        self.assertEqual(st["vms"][0]["name"], "f-broken")  # failures listed first
        broken = vms["f-broken"]
        self.assertEqual(broken["outcome"], "Failed")
        self.assertIn("injected failure of f-broken", broken["error"])
        self.assertNotIn("actualTotalSeconds", broken)
        self.assertEqual(vms["f-last"]["outcome"], "Succeeded")  # started after the failure
        self.assertLess(broken["finishTime"], vms["f-last"]["startTime"])
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual((conds["MigrationFailed"]["status"], conds["MigrationFailed"]["reason"]),
                         ("True", "MigrationFailed"))
        self.assertIn(VM_NS + "/f-broken", conds["MigrationFailed"]["message"])
        self.assertEqual((conds["Executed"]["status"], conds["Executed"]["reason"]), ("False", "MigrationsFailed"))
        wait_for(lambda: ("Warning", "DrainIncomplete") in self.reasons("drain-f"), 10, "the DrainIncomplete event")
        self.assertEqual(self.reasons("drain-f").count(("Warning", "MigrationFailed")), 1)
        # Across namespaces: labels name the plan, no owner reference.
        for m in self.migrations_of(obj):
            self.assertEqual(m["metadata"]["namespace"], VM_NS)
            self.assertNotIn("ownerReferences", m["metadata"])
        self.assertEqual(self.check_concurrency(st, {"f-first", "f-broken", "f-last"}, 1), 1)
        self.assertEqual(self.plan_metric("rdmig_controller_drainplan_vms", "drain-f", state="failed"), 1)

    def test_execute_with_not_converging_migrate_starts_those_vms_alone_after_the_planned_ones(self):
        node = "node-j"
        self.add_checked_path("j-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        self.add_vmi("j-ok-1", node, memory="512Mi", dirty=0)
        self.add_vmi("j-ok-2", node, memory="256Mi", dirty=0)
        self.add_vmi("j-hot", node, memory="1Gi", dirty=2 * GiB)  # forecast not to converge
        self.add_vmi("j-nomem", node, dirty=0)                    # no forecast at all
        self.create(plan("drain-j", node, execute=True, notConverging="Migrate", maxConcurrentPerPair=2,
                         pathCapacity="4Gi"))
        st = self.wait_phase("drain-j", ("Completed", "Failed"), timeout=120)["status"]
        self.assertEqual(st["phase"], "Completed", st)
        self.assertEqual((st["execution"]["succeeded"], st["execution"]["skipped"]), (4, 0))
        vms = {v["name"]: v for v in st["vms"]}
        self.assertEqual(sorted(vms["j-hot"]), sorted(vms["j-nomem"]))  # no forecast to compare with
        self.assertNotIn("totalRatio", vms["j-hot"])
        # The planned two first (two at once), then the others one at a time.
        runs = sorted(self.runs_of(set(vms)), key=lambda r: r[1])
        self.assertEqual({r[0] for r in runs[:2]}, {"j-ok-1", "j-ok-2"})
        self.assertEqual({r[0] for r in runs[2:]}, {"j-hot", "j-nomem"})
        last_planned = max(v["finishTime"] for n, v in vms.items() if n.startswith("j-ok"))
        unplanned = sorted((vms["j-hot"], vms["j-nomem"]), key=lambda v: v["startTime"])
        self.assertLess(last_planned, unplanned[0]["startTime"])
        self.assertLess(unplanned[0]["finishTime"], unplanned[1]["startTime"])
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual((conds["Executed"]["status"], conds["Executed"]["reason"]), ("True", "AllMigrated"))

    def test_execute_resumes_after_a_controller_restart_without_duplicating_migrations(self):
        node = "node-g"
        self.add_checked_path("g-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        names = ["g1", "g2", "g3", "g4"]
        for i, name in enumerate(names):
            self.add_vmi(name, node, memory="%dMi" % (512 - 64 * i), dirty=0)
            self.performer.seconds[name] = 1.0
        obj = self.create(plan("drain-g", node, execute=True, maxConcurrentPerPair=1))
        wait_for(lambda: len([v for v in self.store.objects_of(VMIM) if v["spec"]["vmiName"] in names]) >= 2, 60,
                 "the second migration of drain-g to reach KubeVirt")
        self.controller.stop()
        try:
            # While no controller runs, the running migration ends at KubeVirt's end.
            wait_for(lambda: all(v.get("status", {}).get("phase") in ("Succeeded", "Failed")
                                 for v in self.store.objects_of(VMIM) if v["spec"]["vmiName"] in names)
                     and len(self.runs_of(set(names))) >= 2, 60, "the running migration to end")
            self.assertEqual(len(self.migrations_of(obj)), 2)
            self.assertEqual(self.get("drain-g")["status"]["phase"], "Executing")
        finally:
            DrainPlanControllerTest.controller = Controller(self.tmp, "ctl-2", self.kubeconfig,
                                                            self.agents["a"].token_file)
        wait_for(lambda: self.controller.metric("rdmig_controller_leader") == 1, 30, "the new controller to lead")
        st = self.wait_phase("drain-g", ("Completed", "Failed"), timeout=120)["status"]
        self.assertEqual((st["phase"], st["execution"]["succeeded"]), ("Completed", 4), st)
        migrations = self.migrations_of(obj)
        self.assertEqual(sorted(m["spec"]["source"]["vmi"]["name"] for m in migrations), names)
        vmims = [v for v in self.store.objects_of(VMIM) if v["spec"]["vmiName"] in names]
        self.assertEqual(sorted(v["spec"]["vmiName"] for v in vmims), names)
        runs = sorted(self.runs_of(set(names)), key=lambda r: r[1])
        self.assertEqual([r[0] for r in runs], names)  # each once, in the plan's order (largest first)
        self.assertEqual(self.check_concurrency(st, set(names), 1), 1)

    def test_execute_false_creates_nothing_while_an_executing_plan_drains_the_same_node(self):
        node = "node-h"
        self.add_checked_path("h-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        for name in ("h1", "h2"):
            self.add_vmi(name, node, memory="256Mi", dirty=0)
        look = self.create(plan("look-h", node))
        self.assertEqual(self.wait_phase("look-h", ("Forecast", "Failed"))["status"]["phase"], "Forecast")
        go = self.create(plan("drain-h", node, execute=True))
        st = self.wait_phase("drain-h", ("Completed", "Failed"), timeout=120)["status"]
        self.assertEqual(st["phase"], "Completed", (st, [(c["metadata"]["name"], c.get("status", {}).get("pairs"))
                                                         for c in self.store.objects_of("rdmapathchecks")]))
        self.assertEqual(len(self.migrations_of(go)), 2)
        self.assertEqual(self.migrations_of(look), [])
        st = self.get("look-h")["status"]
        self.assertEqual(st["phase"], "Forecast")
        self.assertNotIn("execution", st)
        self.assertEqual(sorted(v["spec"]["vmiName"] for v in self.store.objects_of(VMIM)
                                if v["spec"]["vmiName"] in ("h1", "h2")), ["h1", "h2"])  # the executing plan's only

    # -- cancel, a spec edited while executing, a VM started once ----------------------------
    def wait_running(self, obj, vmi, timeout=60):
        """Until the plan's migration of `vmi` runs at KubeVirt (its VMIM Running)."""
        wait_for(lambda: any(v["spec"]["vmiName"] == vmi and v.get("status", {}).get("phase") == "Running"
                             for v in self.store.objects_of(VMIM)), timeout, vmi + "'s migration to run")
        self.assertEqual([m["spec"]["source"]["vmi"]["name"] for m in self.migrations_of(obj)], [vmi])

    def test_cancel_starts_nothing_more_and_lets_the_running_migration_finish(self):
        node = "node-k"
        self.add_checked_path("k-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        for name, mib in (("k-first", 1024), ("k-second", 768), ("k-third", 512)):
            self.add_vmi(name, node, memory="%dMi" % mib, dirty=0)
        self.performer.seconds["k-first"] = 4.0
        obj = self.create(plan("drain-k", node, execute=True, maxConcurrentPerPair=1))
        self.wait_running(obj, "k-first")
        code, body = self.edit_spec("drain-k", cancel=True)
        self.assertEqual(code, 200, body)
        st = self.wait_phase("drain-k", ("Cancelled", "Completed", "Failed"), timeout=60)["status"]
        print("\ncancelled:", st["execution"], st["conditions"])
        self.assertEqual(st["phase"], "Cancelled", st)
        # Nothing started after the cancel; the running one was left to finish, and did.
        self.assertEqual([m["spec"]["source"]["vmi"]["name"] for m in self.migrations_of(obj)], ["k-first"])
        self.assertEqual([r[0] for r in self.runs_of({"k-first", "k-second", "k-third"})], ["k-first"])
        ex = st["execution"]
        self.assertEqual((ex["succeeded"], ex["skipped"], ex["failed"], ex["pending"], ex["running"], ex["cancelled"]),
                         (1, 2, 0, 0, 0, 0))
        vms = {v["name"]: v for v in st["vms"]}
        self.assertEqual(vms["k-first"]["outcome"], "Succeeded")
        self.assertLess(ex["cancelTime"], vms["k-first"]["finishTime"])  # it ran on after the cancel
        for name in ("k-second", "k-third"):
            self.assertEqual((vms[name]["outcome"], vms[name]["skipReason"]), ("Skipped", "PlanCancelled"))
            self.assertNotIn("migration", vms[name])
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual((conds["Cancelled"]["status"], conds["Cancelled"]["reason"]), ("True", "Cancelled"))
        self.assertEqual((conds["Executed"]["status"], conds["Executed"]["reason"]), ("False", "Cancelled"))
        self.assertIn("2 skipped (by the cancel)", conds["Executed"]["message"])
        self.assertGreaterEqual(ex["finishTime"], vms["k-first"]["finishTime"])
        wait_for(lambda: ("Warning", "DrainCancelled") in self.reasons("drain-k"), 10, "the DrainCancelled event")
        self.assertIn(("Normal", "CancelRequested"), self.reasons("drain-k"))
        wait_for(lambda: self.plan_metric("rdmig_controller_drainplan_vms", "drain-k", state="skipped") == 2, 10,
                 "the metric to count the 2 skipped")  # exported just after the status write

    def test_cancel_with_running_on_cancel_cancels_the_running_migration(self):
        node = "node-l"
        self.add_checked_path("l-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        self.add_vmi("l-long", node, memory="1Gi", dirty=0)
        self.add_vmi("l-next", node, memory="512Mi", dirty=0)
        self.performer.seconds["l-long"] = 60.0
        obj = self.create(plan("drain-l", node, execute=True, maxConcurrentPerPair=1))
        self.wait_running(obj, "l-long")
        code, body = self.edit_spec("drain-l", cancel=True, runningOnCancel="Cancel")
        self.assertEqual(code, 200, body)
        st = self.wait_phase("drain-l", ("Cancelled", "Completed", "Failed"), timeout=60)["status"]
        self.assertEqual(st["phase"], "Cancelled", st)
        [m] = self.migrations_of(obj)
        self.assertTrue(m["spec"]["cancel"])  # the project's cancel of an RdmaMigration
        self.assertEqual(m["metadata"]["annotations"]["rdmig.io/drain-cancelled"], NS + "/drain-l")
        self.assertEqual(m["status"]["phase"], "Cancelled")
        [(_, t0, t1)] = self.runs_of({"l-long", "l-next"})
        self.assertLess(t1 - t0, 30)  # aborted, not run to its end
        vms = {v["name"]: v for v in st["vms"]}
        self.assertEqual(vms["l-long"]["outcome"], "Cancelled")
        self.assertIn("cancelled with the plan", vms["l-long"]["error"])
        self.assertEqual((vms["l-next"]["outcome"], vms["l-next"]["skipReason"]), ("Skipped", "PlanCancelled"))
        ex = st["execution"]
        self.assertEqual((ex["cancelled"], ex["failed"], ex["skipped"], ex["running"]), (1, 0, 1, 0))
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual(conds["MigrationFailed"]["status"], "False")  # a cancel is not a failure
        self.assertEqual(conds["Cancelled"]["status"], "True")
        wait_for(lambda: self.plan_metric("rdmig_controller_drainplan_vms", "drain-l", state="cancelled") == 1, 10,
                 "the metric to count the cancelled one")

    def test_a_spec_edited_while_executing_is_not_acted_on_and_is_named(self):
        # An API server that does not run the CRD's CEL rules lets the edit through; the
        # controller keeps to the spec the drain started with.
        node = "node-m"
        self.add_checked_path("m-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        names = ("m-1", "m-2", "m-3")
        for name, mib in zip(names, (1024, 768, 512)):
            self.add_vmi(name, node, memory="%dMi" % mib, dirty=0)
            self.performer.seconds[name] = 1.5
        obj = self.create(plan("drain-m", node, execute=True, maxConcurrentPerPair=1, pathCapacity="4Gi"))
        self.wait_running(obj, "m-1")
        self.store.without_transition_rules.add("rdmadrainplans")
        try:
            # Three at once, and only VMIs labelled app=none (none is): neither may take effect.
            code, body = self.edit_spec("drain-m", maxConcurrentPerPair=3, selector={"app": "none"})
            self.assertEqual(code, 200, body)
        finally:
            self.store.without_transition_rules.discard("rdmadrainplans")
        st = self.wait_phase("drain-m", ("Completed", "Failed", "Cancelled"), timeout=120)["status"]
        self.assertEqual(st["phase"], "Completed", st)
        self.assertEqual(st["execution"]["succeeded"], 3)
        self.assertEqual(sorted(m["spec"]["source"]["vmi"]["name"] for m in self.migrations_of(obj)), list(names))
        self.assertEqual(self.check_concurrency(st, set(names), 1), 1)
        self.assertEqual(st["execution"]["spec"]["maxConcurrentPerPair"], 1)
        self.assertNotIn("selector", st["execution"]["spec"])
        cond = {c["type"]: c for c in st["conditions"]}["SpecChanged"]
        self.assertEqual((cond["status"], cond["reason"]), ("True", "ChangedWhileExecuting"))
        self.assertIn("spec.maxConcurrentPerPair, spec.selector changed after the drain started", cond["message"])
        self.assertEqual(self.reasons("drain-m").count(("Warning", "SpecChanged")), 1)

    def test_a_failed_vm_whose_migration_is_deleted_is_not_started_again(self):
        node = "node-n"
        self.add_checked_path("n-path", node, TARGET, 1.0 * GiB, when="2026-12-05T11:00:00Z")
        self.add_vmi("n-broken", node, memory="1Gi", dirty=0)  # the largest: first
        self.add_vmi("n-next", node, memory="512Mi", dirty=0)
        self.performer.fail.add("n-broken")
        self.performer.seconds["n-next"] = 5.0
        obj = self.create(plan("drain-n", node, execute=True, maxConcurrentPerPair=1))

        def broken():
            return [m for m in self.migrations_of(obj) if m["spec"]["source"]["vmi"]["name"] == "n-broken"]
        wait_for(lambda: broken() and broken()[0].get("status", {}).get("phase") == "Failed", 60,
                 "n-broken's migration to fail")
        name = broken()[0]["metadata"]["name"]
        wait_for(lambda: {v["name"]: v.get("outcome") for v in self.get("drain-n")["status"].get("vms", [])}
                 .get("n-broken") == "Failed", 30, "the plan to see it failed")
        # An operator deletes the failed RdmaMigration while the plan still runs n-next.
        self.assertIn(self.store.delete("rdmamigrations", VM_NS, name)[0], (200, 202))
        wait_for(lambda: self.store.get("rdmamigrations", VM_NS, name)[0] == 404, 30, "the migration to go")
        self.assertEqual(self.get("drain-n")["status"]["phase"], "Executing")
        st = self.wait_phase("drain-n", ("Completed", "Failed", "Cancelled"), timeout=120)["status"]
        self.assertEqual(st["phase"], "Completed", st)
        self.assertEqual(sorted(r[0] for r in self.runs_of({"n-broken", "n-next"})), ["n-broken", "n-next"])
        self.assertEqual(broken(), [])  # not made again
        vms = {v["name"]: v for v in st["vms"]}
        self.assertEqual(vms["n-broken"]["outcome"], "Failed")
        self.assertIn("injected failure of n-broken", vms["n-broken"]["error"])
        self.assertEqual(vms["n-broken"]["migration"], name)
        ex = st["execution"]
        self.assertEqual((ex["succeeded"], ex["failed"]), (1, 1))
        self.assertEqual(ex["started"], [{"namespace": VM_NS, "name": "n-broken", "outcome": "Failed"},
                                         {"namespace": VM_NS, "name": "n-next", "outcome": "Succeeded"}])
        self.assertEqual(self.reasons("drain-n").count(("Warning", "MigrationFailed")), 1)

    def test_max_bandwidth_caps_each_migration_and_the_selector_narrows_the_vms(self):
        self.add_checked_path("cap-path", "node-a", "node-b", 1.0 * GiB, when="2026-12-05T10:00:00Z")
        self.add_vmi("capped", "node-a", memory="512Mi", dirty=0, labels={"app": "capped"})
        self.add_vmi("other", "node-a", memory="512Mi", dirty=0, labels={"app": "other"})
        self.create(plan("capped", "node-a", selector={"app": "capped"}, maxBandwidth="256Mi"))
        st = self.wait_phase("capped", ("Forecast", "Failed"))["status"]
        self.assertEqual(st["phase"], "Forecast", st)
        self.assertEqual([v["name"] for v in st["vms"]], ["capped"])
        vm = st["vms"][0]
        self.assertEqual(vm["throughputBytesPerSecond"], 256 * MiB)  # not the path's 1 GiB/s
        self.assertEqual(vm["totalSeconds"], 2.02)                    # 512 MiB at 256 MiB/s + 0.02

    def test_the_sample_is_valid_and_forecasts(self):
        import yaml
        with open(os.path.join(REPO, "operator-manifests", "samples", "drainplan-forecast.yaml")) as f:
            body = yaml.safe_load(f)
        body["metadata"]["namespace"] = NS
        body["spec"]["node"] = "node-c"  # its path was checked above or is checked now
        self.add_checked_path("sample-path", "node-c", "node-b", 2.0 * GiB, when="2026-12-05T09:00:00Z")
        self.add_vmi("sample-vm", "node-c", memory="2Gi", labels={"app": "sample"})
        self.create(body)
        st = self.wait_phase(body["metadata"]["name"], ("Forecast", "Failed"))["status"]
        self.assertEqual(st["phase"], "Forecast", st)
        vm = {v["name"]: v for v in st["vms"]}["sample-vm"]
        self.assertEqual((vm["dirtyRateSource"], vm["dirtyRateBytesPerSecond"]), ("assumed", 64 * MiB))

    def test_zz_rbac_in_the_chart_covers_the_calls_and_every_drainplan_grant_is_used(self):
        import rbac_check
        self.store.conflict_once.add(("rdmadrainplans", NS, "conflicted"))
        self.add_checked_path("a-path", "node-a", "node-b", 1.0 * GiB)
        self.create(plan("conflicted", "node-a"))
        self.wait_phase("conflicted", ("Forecast", "Failed"))
        calls = rbac_check.calls_from_log(self.api.requests, "rdmig-controller/")
        problems = rbac_check.compare(calls, rbac_check.chart_rules(),
                                      unused_of={"rdmadrainplans", "rdmadrainplans/status"})
        # create on rdmapathchecks and rdmamigrations, list on VMIs: the grants this kind added elsewhere.
        self.assertIn(("rdmig.io", "rdmapathchecks", "create", NS, ""), calls)
        self.assertIn(("rdmig.io", "rdmamigrations", "create", NS, ""), calls)
        self.assertIn(("kubevirt.io", "virtualmachineinstances", "list", "", ""), calls)
        self.assertEqual(problems, [], "\n".join(problems))


if __name__ == "__main__":
    unittest.main()
