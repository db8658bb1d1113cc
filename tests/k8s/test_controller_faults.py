"""rdmig-controller against hostile and unlucky RdmaMigration objects and agents (issue 11).
Most tests use agent stand-ins (agent_standin.py: late answers, migrations that never end) and
the API server double's fault hooks, so they need no guest; two move real QEMU guests with real
agents. MetricsAuthTest and MetricsDefaultsTest check /metrics' authentication and authorization
(TokenReview, SubjectAccessReview against the double's RBAC) and its local-only mode (issue 42).
Run from the repository root after building:
    python3 tests/k8s/test_controller_faults.py -v        (ctest -R k8s_controller_faults)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from agent_standin import AgentStandin  # noqa: E402
from controllerlab import Controller, controller_binary, wait_for  # noqa: E402
from test_controller import AGENT_NS, NS, TERMINAL, Cluster, migration  # noqa: E402

FINALIZER = "rdmig.io/cancel-on-delete"


class StandinCluster:
    """The double, stand-in agents on nodes, and one controller (maxConcurrentPerNode 1)."""

    def __init__(self, tmp, controller_config=None):
        self.cluster = Cluster(tmp)
        self.token = "agent-token-" + os.urandom(8).hex()
        self.token_file = os.path.join(tmp, "agent.token")
        with open(self.token_file, "w") as f:
            f.write(self.token + "\n")
        self.standins = {}
        cfg = {"maxConcurrentPerNode": 1, "qemu": {"allowedNamespaces": [NS]},
               "agents": {"requestTimeoutSeconds": 2, "unreachableTimeoutSeconds": 3}}
        cfg.update(controller_config or {})
        self.controller = Controller(tmp, "ctl", self.cluster.kubeconfig, self.token_file, config=cfg)
        wait_for(lambda: self.controller.metric("rdmig_controller_leader") == 1, 30, "the controller to lead")

    def standin(self, node, **kw):
        s = AgentStandin(self.token, name=node, **kw)
        self.standins[node] = s
        pod = "rdmig-agent-%d" % len(self.standins)
        self.cluster.api.add_agent_pod(AGENT_NS, pod, node, s.port)
        return s

    def stop(self):
        self.controller.stop()
        for s in self.standins.values():
            s.stop()
        self.cluster.api.stop()


class ControllerFaultsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-k8s-faults-")
        cls.env = StandinCluster(cls.tmp)
        cls.cluster, cls.store = cls.env.cluster, cls.env.cluster.store
        for node in ("node-s1", "node-s2", "node-s3", "node-s4", "node=s,5"):
            cls.env.standin(node)
        cls.env.standin("node-slow", post_delay=4.0)  # twice requestTimeoutSeconds
        cls.env.standin("node-h1")  # a source of its own for the hold test (others count calls on theirs)
        # Agents without RDMA devices, as a real pair reports a migration that asked for auto.
        cls.env.standin("node-tcp1", transport="tcp", transport_reason="auto-no-peer-rdma")
        cls.env.standin("node-tcp2", transport="tcp", transport_reason="auto-no-peer-rdma")
        # Agents configured for TCP: no fallback.
        cls.env.standin("node-req1", transport="tcp", transport_reason="requested")
        cls.env.standin("node-req2", transport="tcp", transport_reason="requested")
        # Agents on two rails each, the target's third rail down at start; the source
        # also lists 40 junk rails, as a broken agent might.
        def rail(i, dev, addr, peer, channels, sent, received):
            return {"rail": i, "device": dev, "gid": "::ffff:" + addr, "address": addr, "peerAddress": peer,
                    "channels": channels, "bytesSent": sent, "bytesReceived": received,
                    "chunksSent": sent >> 20, "chunksReceived": received >> 20,
                    "throughputBytesPerSecond": (sent + received) // 3}
        junk = [{"rail": 100 + i, "device": "x" * 100} for i in range(40)]
        cls.env.standin("node-rail1", transport="rdma", transport_reason="auto-both-rdma", status_extra={
            "rails": [rail(0, "mlx5_0", "10.0.0.1", "10.0.0.2", [0, 2, 4, 6, 8], 5 << 20, 40),
                      rail(1, "mlx5_1", "10.1.0.1", "10.1.0.2", [1, 3, 5, 7], 4 << 20, 32)] + junk,
            "railsLeftOut": []})
        cls.env.standin("node-rail2", transport="rdma", transport_reason="auto-both-rdma", status_extra={
            "rails": [rail(0, "mlx5_2", "10.0.0.2", "10.0.0.1", [0, 2, 4, 6, 8], 40, 5 << 20),
                      rail(1, "mlx5_3", "10.1.0.2", "10.1.0.1", [1, 3, 5, 7], 32, 4 << 20)],
            "railsLeftOut": [{"rail": 2, "reason": "no-device",
                              "message": "RDMA device mlx5_4 port 1 is not active (link down?)"}]})

        # Agents with dataPlane.failover on: the source reports its failovers as the test sets them.
        cls.env.standin("node-fo1", transport="tcp", transport_reason="requested",
                        status_extra={"failover": {"enabled": True, "failovers": 0, "last": None}})
        cls.env.standin("node-fo2", transport="tcp", transport_reason="requested",
                        status_extra={"failover": {"enabled": True, "failovers": 0, "last": None}})

    @classmethod
    def tearDownClass(cls):
        cls.env.stop()
        if not os.environ.get("RDMIG_KEEP_TMP"):
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.store.on_status_write = None
        self.cluster.api.refuse_lists.clear()

    def tearDown(self):
        self.store.on_status_write = None
        self.cluster.api.refuse_lists.clear()
        for obj in self.store.objects_of("rdmamigrations"):
            self.store.delete("rdmamigrations", NS, obj["metadata"]["name"])
        wait_for(lambda: not self.store.objects_of("rdmamigrations"), 30, "every object to go")
        result = getattr(self._outcome, "result", None)
        if result and any(t is self for t, _ in result.errors + result.failures):
            print("---- controller log (tail) ----\n" + self.env.controller.log_text()[-8000:])

    def create(self, name, src="node-s1", dst="node-s2", **spec):
        return self.cluster.create(migration(name, src, dst, "/run/src.qmp", "/run/dst.qmp", **spec))

    def assert_nothing_runs_on_standins(self):
        for node, s in self.env.standins.items():
            wait_for(lambda: not s.running(), 10, "nothing running on the stand-in of " + node)

    def gone(self, name, timeout=30):
        wait_for(lambda: self.cluster.get(name) is None, timeout, name + " to be gone")

    def condition(self, name, type_):
        obj = self.cluster.get(name)
        for c in (obj or {}).get("status", {}).get("conditions", []):
            if c["type"] == type_:
                return c
        return None

    # -- finalizer and garbage collection ---------------------------------------------------
    def test_finished_object_drops_its_finalizer(self):
        self.create("ends", src="node-s1", dst="node-nowhere")
        obj = self.cluster.wait_phase("ends", TERMINAL, timeout=30)
        self.assertEqual(obj["status"]["phase"], "Failed")
        wait_for(lambda: FINALIZER not in self.cluster.get("ends")["metadata"].get("finalizers", []), 20,
                 "the finalizer to go from a finished object")
        # With the controller gone (uninstalled), a delete still completes at once.
        self.env.controller.stop()
        try:
            code, body = self.store.delete("rdmamigrations", NS, "ends")
            self.assertEqual(code, 200, body)
            self.assertIsNone(self.cluster.get("ends"), "a finished object must not wait for a controller")
        finally:
            self.env.controller.start()
            wait_for(lambda: self.env.controller.metric("rdmig_controller_leader") == 1, 30, "the controller to lead")

    def test_ttl_seconds_after_finished_deletes_finished_objects(self):
        t0 = time.monotonic()
        self.create("ttl-2", src="node-s1", dst="node-nowhere", ttlSecondsAfterFinished=2)
        self.create("ttl-0", src="node-s1", dst="node-nowhere", ttlSecondsAfterFinished=0)
        self.create("ttl-default", src="node-s1", dst="node-nowhere")
        self.gone("ttl-0", timeout=20)
        self.gone("ttl-2", timeout=30)
        self.assertGreaterEqual(time.monotonic() - t0, 1.0)
        self.assertEqual(self.cluster.get("ttl-default")["status"]["phase"], "Failed",
                         "the default (a day) keeps it")
        self.assertIn("ttlSecondsAfterFinished over", self.env.controller.log_text())
        # The schema refuses a negative time-to-live.
        code, body = self.store.create("rdmamigrations", NS, migration(
            "ttl-neg", "node-s1", "node-s2", "/a", "/b", ttlSecondsAfterFinished=-1))
        self.assertEqual(code, 422, body)

    # -- deletes and cancels at every phase -------------------------------------------------
    def test_delete_at_every_phase_ends_with_the_object_gone_and_nothing_running(self):
        # Migrating (on the stand-ins, which never finish by themselves).
        self.create("del-migrating")
        self.cluster.wait_phase("del-migrating", "Migrating", timeout=30)
        # Pending: node-s1 is taken (maxConcurrentPerNode 1).
        self.create("del-pending")
        wait_for(lambda: (self.condition("del-pending", "Admitted") or {}).get("reason") == "WaitingForNodeSlot", 20,
                 "WaitingForNodeSlot")
        self.store.delete("rdmamigrations", NS, "del-pending")
        self.gone("del-pending")
        self.store.delete("rdmamigrations", NS, "del-migrating")
        self.gone("del-migrating")
        self.assert_nothing_runs_on_standins()
        # PreparingTarget: the delete lands in the same instant as the phase change.
        def delete_when_preparing(plural, ns, name, new):
            if name == "del-preparing" and new["status"].get("phase") == "PreparingTarget":
                new["metadata"]["deletionTimestamp"] = new["metadata"].get("deletionTimestamp") or "2024-01-01T00:00:00Z"
        self.store.on_status_write = delete_when_preparing
        self.create("del-preparing", src="node-s3", dst="node-s4")
        self.gone("del-preparing")
        self.assert_nothing_runs_on_standins()
        # Finished.
        self.create("del-finished", src="node-s1", dst="node-nowhere")
        self.cluster.wait_phase("del-finished", "Failed", timeout=30)
        self.store.delete("rdmamigrations", NS, "del-finished")
        self.gone("del-finished")
        self.assertTrue(self.env.controller.alive())
        self.assertNotIn("unexpected:", self.env.controller.log_text())

    def test_cancel_right_after_preparing_target_ends_cancelled(self):
        def cancel_when_preparing(plural, ns, name, new):
            if name == "cancel-early" and new["status"].get("phase") == "PreparingTarget":
                new["spec"]["cancel"] = True
                new["metadata"]["generation"] += 1
        self.store.on_status_write = cancel_when_preparing
        self.create("cancel-early", src="node-s3", dst="node-s4")
        obj = self.cluster.wait_phase("cancel-early", TERMINAL, timeout=30)
        self.assertEqual(obj["status"]["phase"], "Cancelled", obj["status"])
        self.assertIn("knows no migration", obj["status"]["failureReason"])
        self.assert_nothing_runs_on_standins()
        self.assertNotIn("unexpected:", self.env.controller.log_text())

    # -- a target that answers after the request timeout -----------------------------------
    def test_slow_target_answer_is_cancelled_on_the_target(self):
        slow = self.env.standins["node-slow"]
        deletes_before = slow.count("DELETE")
        self.create("slow-target", src="node-s3", dst="node-slow")
        obj = self.cluster.wait_phase("slow-target", TERMINAL, timeout=60)
        self.assertEqual(obj["status"]["phase"], "Failed")
        self.assertEqual(obj["status"]["reason"], "TargetTimeout", obj["status"])
        self.assertIn("agents.requestTimeoutSeconds", obj["status"]["failureReason"])
        self.assertGreater(slow.count("DELETE"), deletes_before, "the controller must cancel on the target")
        wait_for(lambda: not slow.running(), 10, "the late target job to be cancelled")
        self.assertEqual(self.env.standins["node-s3"].count("POST"), 0, "the source must never start")

    # -- the per-node slot follows what runs ------------------------------------------------
    def test_editing_a_running_objects_target_node_keeps_its_slot(self):
        self.create("slot-holder", src="node-s1", dst="node-s2")
        self.cluster.wait_phase("slot-holder", "Migrating", timeout=30)
        # An API server without CEL (before Kubernetes 1.25) lets the spec change.
        schema, self.store.crd_schema = self.store.crd_schema, None
        try:
            self.cluster.update_spec("slot-holder", target={"qemu": {"node": "node-s3", "qmpSocket": "/run/dst.qmp"}})
        finally:
            self.store.crd_schema = schema
        self.create("slot-waiter", src="node-s4", dst="node-s2")
        wait_for(lambda: (self.condition("slot-waiter", "Admitted") or {}).get("reason") == "WaitingForNodeSlot", 20,
                 "slot-waiter to wait for node-s2")
        time.sleep(1.5)  # several polls (250 ms): it must keep waiting, not just be late
        self.assertEqual(self.cluster.get("slot-waiter")["status"]["phase"], "Pending")
        self.store.delete("rdmamigrations", NS, "slot-holder")
        self.cluster.wait_phase("slot-waiter", "Migrating", timeout=30)

    # -- status and events that explain a migration (issue 12) -------------------------------
    def events_of(self, name, reason):
        return [(t, r) for t, r in self.cluster.event_reasons(name) if r == reason]

    def test_a_migration_held_by_the_node_limit_says_so_once(self):
        self.create("slot-taker", src="node-s1", dst="node-s2")
        self.cluster.wait_phase("slot-taker", "Migrating", timeout=30)
        self.create("held", src="node-h1", dst="node-s1")
        wait_for(lambda: (self.condition("held", "Admitted") or {}).get("reason") == "WaitingForNodeSlot", 20,
                 "the hold in the Admitted condition")
        self.cluster.wait_event("held", ("Normal", "WaitingForNodeSlot"))
        st = self.cluster.get("held")["status"]
        self.assertEqual((st["phase"], st["reason"]), ("Pending", "WaitingForNodeSlot"), st)
        self.assertIn("waiting for a migration slot on node 'node-s1'", self.condition("held", "Admitted")["message"])
        self.assertIn("maxConcurrentPerNode=1", self.condition("held", "Admitted")["message"])
        self.assertEqual(self.condition("held", "Succeeded")["status"], "Unknown")
        time.sleep(1.5)  # several polls (250 ms) that find the node busy again
        self.assertEqual(self.events_of("held", "WaitingForNodeSlot"), [("Normal", "WaitingForNodeSlot")],
                         "one Event per hold, not one per poll")
        self.store.delete("rdmamigrations", NS, "slot-taker")
        obj = self.cluster.wait_phase("held", "Migrating", timeout=30)
        self.assertNotIn("reason", obj["status"], "admitted: nothing holds it any more")
        self.assertEqual(self.condition("held", "Admitted")["status"], "True")
        self.assertEqual(len(self.events_of("held", "WaitingForNodeSlot")), 1)

    def test_succeeded_is_unknown_while_running_and_the_tcp_fallback_is_explained_once(self):
        self.create("fallback", src="node-tcp1", dst="node-tcp2", transport="auto")
        wait_for(lambda: self.cluster.get("fallback").get("status", {}).get("transportReason"), 30, "transportReason in status")
        st = self.cluster.get("fallback")["status"]
        self.assertEqual((st["phase"], st["transport"], st["transportReason"]), ("Migrating", "tcp", "auto-no-peer-rdma"))
        c = self.condition("fallback", "Succeeded")
        self.assertEqual((c["status"], c["reason"]), ("Unknown", "Migrating"))
        self.cluster.wait_event("fallback", ("Warning", "TransportFallback"))
        (ev,) = [e for e in self.cluster.api.events("fallback") if e["reason"] == "TransportFallback"]
        self.assertIn("auto-no-peer-rdma: the target agent has no usable RDMA device", ev["message"])
        time.sleep(1.5)  # several polls, each copying the same transport again
        self.assertEqual(len(self.events_of("fallback", "TransportFallback")), 1, "one Event per migration")
        # Asked for TCP (the agents' config or spec.transport: tcp): not a fallback.
        self.create("tcp-asked", src="node-req1", dst="node-req2")
        wait_for(lambda: self.cluster.get("tcp-asked").get("status", {}).get("transportReason"), 30, "transportReason")
        time.sleep(1.0)
        self.assertEqual(self.events_of("tcp-asked", "TransportFallback"), [])

    def test_failovers_reach_the_status_and_each_new_one_is_an_event(self):
        self.create("flappy", src="node-fo1", dst="node-fo2")
        wait_for(lambda: self.cluster.get("flappy").get("status", {}).get("failover"), 30, "failover in status")
        self.assertEqual(self.cluster.get("flappy")["status"]["failover"], {"enabled": True, "failovers": 0})
        src = self.env.standins["node-fo1"]
        mid = self.cluster.get("flappy")["status"]["migrationId"]
        last = "channel 1: channel 1: recv: Connection reset by peer; resumed on tcp 10.0.0.2:7471 after 3 ms, 4 chunk(s) resent"

        def report(n):  # what the source agent's GET says from now on
            with src.lock:
                src.migrations[mid]["failover"] = {"enabled": True, "failovers": n, "last": last}

        report(2)
        self.cluster.wait_event("flappy", ("Warning", "FailedOver"))
        (ev,) = [e for e in self.cluster.api.events("flappy") if e["reason"] == "FailedOver"]
        self.assertIn("failed 2 data channel(s) over to a new link (2 in all)", ev["message"])
        self.assertIn("resumed on tcp 10.0.0.2:7471", ev["message"])
        time.sleep(1.0)  # several polls with the same count: no new Event
        self.assertEqual(len(self.events_of("flappy", "FailedOver")), 1)
        report(3)
        wait_for(lambda: len(self.events_of("flappy", "FailedOver")) == 2, 30, "a second FailedOver Event")
        self.assertEqual(self.cluster.get("flappy")["status"]["failover"]["failovers"], 3)

    def test_the_rails_both_agents_used_and_left_out_reach_the_status(self):
        self.create("railed", src="node-rail1", dst="node-rail2", transport="auto")
        wait_for(lambda: self.cluster.get("railed").get("status", {}).get("railsLeftOut"), 30, "rails in status")
        st = self.cluster.get("railed")["status"]
        self.assertEqual(st["transport"], "rdma")
        self.assertEqual(st["rails"], [
            {"rail": 0, "channels": [0, 2, 4, 6, 8], "bytes": 5 << 20, "chunks": 5,
             "throughputBytesPerSecond": ((5 << 20) + 40) // 3, "sourceDevice": "mlx5_0",
             "sourceGid": "::ffff:10.0.0.1", "sourceAddress": "10.0.0.1", "targetAddress": "10.0.0.2",
             "targetDevice": "mlx5_2", "targetGid": "::ffff:10.0.0.2"},
            {"rail": 1, "channels": [1, 3, 5, 7], "bytes": 4 << 20, "chunks": 4,
             "throughputBytesPerSecond": ((4 << 20) + 32) // 3, "sourceDevice": "mlx5_1",
             "sourceGid": "::ffff:10.1.0.1", "sourceAddress": "10.1.0.1", "targetAddress": "10.1.0.2",
             "targetDevice": "mlx5_3", "targetGid": "::ffff:10.1.0.2"}])
        self.assertEqual(st["railsLeftOut"], [{"side": "target", "rail": 2, "reason": "no-device",
                                               "message": "RDMA device mlx5_4 port 1 is not active (link down?)"}])
        # (The API server double refuses a status write the CRD's schema does not allow, unknown
        # fields included, so these fields got there through the schema.)

    def end_on_standins(self, name, source, target):
        """Ends `name`'s migration on its two stand-ins: source/target = (phase, reason, extra result)."""
        st = self.cluster.wait_phase(name, "Migrating", timeout=30)["status"]
        mid = st["migrationId"]
        for agent, (phase, reason, extra) in ((st["sourceAgent"], source), (st["targetAgent"], target)):
            if phase:
                self.env.standins[agent["node"]].end(mid, phase, reason, **extra)
        return self.cluster.wait_phase(name, TERMINAL, timeout=30)["status"]

    def test_each_way_a_migration_ends_on_the_agents_has_its_own_reason(self):
        cases = [
            ("ends-ok", ("Succeeded", None, {"downtimeMs": 17}), ("Succeeded", None, {"targetState": "running"}),
             "Succeeded", "Succeeded", "True"),
            ("ends-source", ("Failed", "QEMU error: migration failed: Unable to write to socket", {}), (None, None, {}),
             "Failed", "SourceFailed", "False"),
            ("ends-target", (None, None, {}), ("Failed", "target QEMU: incoming migration failed: load failed", {}),
             "Failed", "TargetFailed", "False"),
            ("ends-agent-cancel", ("Cancelled", "agent shutting down", {}), (None, None, {}),
             "Cancelled", "CancelledOnAgent", "False"),
        ]
        for name, source, target, phase, reason, cond in cases:
            self.create(name)
            st = self.end_on_standins(name, source, target)
            self.assertEqual((st["phase"], st["reason"]), (phase, reason), st)
            c = self.condition(name, "Succeeded")
            self.assertEqual((c["status"], c["reason"]), (cond, reason), c)
            if phase == "Failed":
                self.cluster.wait_event(name, ("Warning", reason))
            self.store.delete("rdmamigrations", NS, name)
            self.gone(name)

    def test_a_vm_left_paused_on_the_source_fails_with_its_own_reason_and_a_warning(self):
        # The source agent's words when the target's verdict was lost after QEMU handed the VM
        # over (src/migration/source_job.cpp); the target, asked afterwards, runs the VM.
        words = ("source QEMU completed but the target agent did not confirm (control link: no message within 30 s); "
                 "the source VM is left paused (postmigrate) so the VM cannot run twice: check the target and "
                 "'cont' the source only if the target does not run the VM")
        self.create("paused")
        st = self.end_on_standins("paused", ("Failed", words, {}), ("Succeeded", None, {"targetState": "running"}))
        self.assertEqual((st["phase"], st["reason"]), ("Failed", "VMPausedOnSource"), st)
        c = self.condition("paused", "Succeeded")
        self.assertEqual((c["status"], c["reason"]), ("False", "VMPausedOnSource"))
        self.assertTrue(st["failureReason"].startswith(
            "VM left paused on the source node node-s1: the source agent could not learn the target's verdict"),
            st["failureReason"])
        self.assertIn("the target agent reports Succeeded (target VM running) on node node-s2", st["failureReason"])
        self.assertIn("runbook RdmigVmPausedOnSource", st["failureReason"])
        self.assertIn(words, st["failureReason"])
        self.cluster.wait_event("paused", ("Warning", "VMPausedOnSource"))

    # -- API server answers -----------------------------------------------------------------
    def test_a_rotated_agent_token_is_used_without_a_restart(self):
        # The token Secret changes: kubelet swaps the mounted file; agents take the new token and
        # still accept the old one for a while. The controller must send the new one without a
        # restart: after the grace, agents refuse the old token (before: every call got 401).
        new, old = "agent-token-rotated-" + os.urandom(8).hex(), self.env.token
        for s in self.env.standins.values():
            s.previous_token, s.token = old, new
        with open(self.env.token_file + ".new", "w") as f:
            f.write(new + "\n")
        os.rename(self.env.token_file + ".new", self.env.token_file)
        rotated_at = time.monotonic()
        self.env.token = new
        for node in ("node-rot1", "node-rot2"):  # stand-ins of its own: others count calls on theirs
            if node not in self.env.standins:
                self.env.standin(node)
        for s in self.env.standins.values():
            s.previous_token, s.token = old, new
        self.create("rot-1", src="node-rot1", dst="node-rot2")  # within the grace: either token works
        st = self.end_on_standins("rot-1", ("Succeeded", None, {"downtimeMs": 5}),
                                  ("Succeeded", None, {"targetState": "running"}))
        self.assertEqual(st["phase"], "Succeeded", st)
        # The controller looks at its token file at most once a second; then the grace ends.
        time.sleep(max(0.0, 1.2 - (time.monotonic() - rotated_at)))
        src = self.env.standins["node-rot1"]
        seen = len(src.tokens_seen)
        for s in self.env.standins.values():
            s.previous_token = None
        self.create("rot-2", src="node-rot1", dst="node-rot2")
        st = self.end_on_standins("rot-2", ("Succeeded", None, {"downtimeMs": 5}),
                                  ("Succeeded", None, {"targetState": "running"}))
        self.assertEqual(st["phase"], "Succeeded", st)
        used = src.tokens_seen[seen:]
        self.assertTrue(used and all(t == new for t in used), used)
        for name in ("rot-1", "rot-2"):
            self.store.delete("rdmamigrations", NS, name)
            self.gone(name)

    def test_a_controller_that_sees_the_new_token_first_asks_again_with_the_previous_one(self):
        # Secret volumes are synced per node: the controller's may change before an agent's.
        # The agent refuses the new token (401, nothing done); the controller asks once more
        # with the previous one (before: the migration failed on the 401).
        new, old = "agent-token-early-" + os.urandom(8).hex(), self.env.token
        for node in ("node-early1", "node-early2"):
            if node not in self.env.standins:
                self.env.standin(node)
        for s in self.env.standins.values():
            s.previous_token, s.token = None, old  # no agent has the new Secret yet
        with open(self.env.token_file + ".new", "w") as f:
            f.write(new + "\n")
        os.rename(self.env.token_file + ".new", self.env.token_file)
        time.sleep(1.2)  # the controller looks at its token file at most once a second
        try:
            src = self.env.standins["node-early1"]
            seen = len(src.tokens_seen)
            self.create("early-1", src="node-early1", dst="node-early2")
            st = self.end_on_standins("early-1", ("Succeeded", None, {"downtimeMs": 5}),
                                      ("Succeeded", None, {"targetState": "running"}))
            self.assertEqual(st["phase"], "Succeeded", st)
            used = src.tokens_seen[seen:]
            self.assertIn(new, used, "the controller presented the new token first")
            self.assertIn(old, used, "and the previous one after the refusal")
        finally:
            self.env.token = new
            for s in self.env.standins.values():
                s.previous_token, s.token = old, new
        self.store.delete("rdmamigrations", NS, "early-1")
        self.gone("early-1")

    def test_node_names_are_escaped_in_field_selectors(self):
        # The agent pod on node "node=s,5" is found: the selector said exactly that node.
        self.create("odd-node", src="node=s,5", dst="node-s2")
        self.cluster.wait_phase("odd-node", "Migrating", timeout=30)
        self.assertEqual(self.cluster.get("odd-node")["status"]["sourceAgent"]["node"], "node=s,5")
        self.store.delete("rdmamigrations", NS, "odd-node")
        self.gone("odd-node")
        # A node without an agent fails with the reason, instead of 400s retried forever.
        self.create("odd-missing", src="x,spec.nodeName=y", dst="node-s2")
        st = self.cluster.wait_phase("odd-missing", TERMINAL, timeout=30)["status"]
        self.assertEqual(st["reason"], "AgentNotFound", st)
        self.assertIn("node 'x,spec.nodeName=y'", st["failureReason"])

    def test_api_server_4xx_ends_retries_with_a_reason(self):
        self.cluster.api.refuse_lists["pods"] = (403, "Forbidden", 'pods is forbidden: User "rdmig" cannot list pods')
        self.create("forbidden", src="node-s1", dst="node-s2")
        st = self.cluster.wait_phase("forbidden", TERMINAL, timeout=30)["status"]
        self.assertEqual((st["phase"], st["reason"]), ("Failed", "ApiServerRefused"), st)
        self.assertIn("cannot list pods", st["failureReason"])

    # -- text -------------------------------------------------------------------------------
    def test_long_unicode_node_names_do_not_abort_the_controller(self):
        src = "\U0001F600" * 253  # schema-valid: maxLength counts characters; 1012 bytes
        dst = "\u00e9" * 253
        self.create("unicode", src=src, dst=dst)
        st = self.cluster.wait_phase("unicode", TERMINAL, timeout=30)["status"]
        self.assertEqual(st["reason"], "AgentNotFound")
        self.assertIn(src, st["failureReason"])
        self.cluster.wait_event("unicode", ("Warning", "AgentNotFound"))
        self.assertTrue(self.env.controller.alive(), self.env.controller.log_text()[-3000:])
        self.assertNotIn("unexpected:", self.env.controller.log_text())

    # -- metrics ----------------------------------------------------------------------------
    def test_vmi_series_go_when_the_owning_object_is_garbage_collected(self):
        # A vmi-kind object whose VMI does not exist ends Failed; a VMIM it owns (as if it had
        # started one) gets per-VMI series; TTL deletion of the object takes the VMIM (owner
        # garbage collection) and the series with it, in a real scrape of /metrics.
        body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
                "metadata": {"name": "vmi-owner", "namespace": NS},
                "spec": {"source": {"vmi": {"name": "vm-gc"}}, "ttlSecondsAfterFinished": 315360000}}
        owner = self.cluster.create(body)
        self.cluster.wait_phase("vmi-owner", "Failed", timeout=30)
        vmim = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
                "metadata": {"name": "vmim-gc", "namespace": NS,
                             "ownerReferences": [{"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
                                                  "name": "vmi-owner", "uid": owner["metadata"]["uid"],
                                                  "controller": True}]},
                "spec": {"vmiName": "vm-gc"}, "status": {"phase": "Running"}}
        code, created = self.store.create("virtualmachineinstancemigrations", NS, vmim)
        self.assertEqual(code, 201, created)
        ctl = self.env.controller
        active = ("rdmig_controller_vmi_migration_active", frozenset({"namespace": NS, "name": "vm-gc"}.items()))
        wait_for(lambda: active in ctl.metrics(), 20, "the VMI's series in /metrics")
        self.cluster.update_spec("vmi-owner", ttlSecondsAfterFinished=0)
        self.gone("vmi-owner")
        self.assertEqual(self.store.objects_of("virtualmachineinstancemigrations"), [])
        wait_for(lambda: not any(k[0].startswith("rdmig_controller_vmi_") and ("name", "vm-gc") in k[1]
                                 for k in ctl.metrics()), 20, "the VMI's series to go from /metrics")


TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


def review_count(api, path):
    return sum(1 for m, p, ua, _ in list(api.requests) if m == "POST" and p == path and ua.startswith("rdmig-controller/"))


class MetricsAuthTest(unittest.TestCase):
    """The controller's /metrics as the chart runs it (metrics.secure, the default): HTTPS, every
    scrape's bearer token checked with a TokenReview and a SubjectAccessReview that the API
    server double answers from its tokens and the RBAC objects stored in it (the chart's own
    metrics-reader ClusterRole and its binding to Prometheus' ServiceAccount)."""

    @classmethod
    def setUpClass(cls):
        from apiserver_double import make_tls_material
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-k8s-metrics-auth-")
        cls.cluster = Cluster(cls.tmp)
        cls.api = cls.cluster.api
        tls_dir = os.path.join(cls.tmp, "metrics-tls")
        os.makedirs(tls_dir)
        cls.ca, crt, key = make_tls_material(tls_dir)  # a certificate for localhost / 127.0.0.1
        token_file = os.path.join(cls.tmp, "agent.token")
        with open(token_file, "w") as f:
            f.write("agent-token-" + os.urandom(8).hex() + "\n")
        cls.ctl = Controller(cls.tmp, "ctl", cls.cluster.kubeconfig, token_file, config={
            "metrics": {"secure": True, "address": "127.0.0.1", "port": 0, "authCacheEntries": 3,
                        "tls": {"certFile": crt, "keyFile": key}}})
        # The chart's metrics-reader ClusterRole and its binding to Prometheus' ServiceAccount
        # (controller.metrics.reader.subjects), stored as they render.
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "deploy"))
        from deploylib import find, render
        docs = render("--set-json", 'controller.metrics.reader.subjects=[{"kind":"ServiceAccount",'
                      '"name":"prometheus","namespace":"monitoring"}]')
        cls.chart_docs = docs
        for kind, plural in (("ClusterRole", "clusterroles"), ("ClusterRoleBinding", "clusterrolebindings")):
            for d in find(docs, kind, "rdmig-metrics-reader"):
                code, body = cls.api.store.create(plural, None, d)
                assert code == 201, body
        cls.prometheus = cls.api.add_service_account_token("monitoring", "prometheus")
        wait_for(lambda: cls.ctl.https_get("/metrics", cafile=cls.ca)[0], 20, "the metrics port to answer")

    @classmethod
    def tearDownClass(cls):
        cls.ctl.stop()
        cls.api.stop()
        if not os.environ.get("RDMIG_KEEP_TMP"):
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.api.review_fault = None

    def get(self, token=None, path="/metrics"):
        return self.ctl.https_get(path, token=token, cafile=self.ca)

    def test_an_anonymous_scrape_gets_401_and_costs_no_api_call(self):
        before = review_count(self.api, TOKEN_REVIEWS)
        code, headers, body = self.get()
        self.assertEqual(code, 401, body)
        self.assertEqual(headers.get("WWW-Authenticate"), "Bearer")
        self.assertEqual(json.loads(body)["error"]["code"], "unauthenticated")
        self.assertNotIn("rdmig_controller", body)
        self.assertEqual(review_count(self.api, TOKEN_REVIEWS), before)

    def test_a_token_the_api_server_does_not_know_gets_401(self):
        before = review_count(self.api, TOKEN_REVIEWS)
        code, _, body = self.get("not-a-token-" + os.urandom(6).hex())
        self.assertEqual(code, 401, body)
        self.assertIn("the token is not valid", body)
        self.assertEqual(review_count(self.api, TOKEN_REVIEWS), before + 1, "checked with a TokenReview")

    def test_a_valid_token_without_the_role_gets_403(self):
        token = self.api.add_service_account_token("monitoring", "grafana")
        before = review_count(self.api, ACCESS_REVIEWS)
        code, _, body = self.get(token)
        self.assertEqual(code, 403, body)
        self.assertEqual(json.loads(body)["error"]["code"], "permission_denied")
        self.assertIn("system:serviceaccount:monitoring:grafana", body)
        self.assertEqual(review_count(self.api, ACCESS_REVIEWS), before + 1)

    def test_prometheus_bound_to_the_charts_reader_role_gets_the_metrics_once_reviewed(self):
        code, headers, body = self.get(self.prometheus)
        self.assertEqual(code, 200, body)
        self.assertTrue(headers["Content-Type"].startswith("text/plain; version=0.0.4"))
        self.assertIn("rdmig_controller_leader", body)
        self.assertIn("rdmig_controller_reconciles_total", body)
        tr, sar = review_count(self.api, TOKEN_REVIEWS), review_count(self.api, ACCESS_REVIEWS)
        for _ in range(5):
            self.assertEqual(self.get(self.prometheus)[0], 200)
        self.assertEqual((review_count(self.api, TOKEN_REVIEWS), review_count(self.api, ACCESS_REVIEWS)), (tr, sar),
                         "repeated scrapes are answered from the cache, not with two API calls each")
        # The grant is what decides: a Group binding lets a token of that group in too.
        token = self.api.add_token("jane", groups=["metrics-scrapers"])
        self.assertEqual(self.get(token)[0], 403)
        self.api.grant("scrapers", [{"nonResourceURLs": ["/metr*"], "verbs": ["get"]}],
                       [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "metrics-scrapers"}])
        token2 = self.api.add_token("joe", groups=["metrics-scrapers"])
        self.assertEqual(self.get(token2)[0], 200)

    def test_other_paths_and_plain_http_get_nothing(self):
        self.assertEqual(self.get(self.prometheus, path="/healthz")[0], 404)
        self.assertEqual(self.get(self.prometheus, path="/metrics/../debug")[0], 404)
        with self.assertRaises(Exception):  # the port speaks TLS only
            urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.ctl.port, timeout=5).read()
        self.assertEqual(self.ctl.probe_get("/readyz")[0], 200, "probes stay on their own plain-HTTP port")

    def test_api_server_errors_give_500_or_503_never_200(self):
        token = self.api.add_service_account_token("monitoring", "prometheus-2")
        self.api.grant("prometheus-2", [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
                       [{"kind": "ServiceAccount", "name": "prometheus-2", "namespace": "monitoring"}])
        self.api.review_fault = (500, "InternalError", "etcdserver: request timed out")
        code, _, body = self.get(token)
        self.assertEqual(code, 503, body)  # a 5xx from the API server: unavailable
        self.assertIn("TokenReview failed", body)
        self.api.review_fault = (403, "Forbidden", 'cannot create resource "tokenreviews"')
        code, _, body = self.get(token)
        self.assertEqual(code, 500, body)
        self.assertIn("needs create on tokenreviews", body)
        self.api.review_fault = None
        self.assertEqual(self.get(token)[0], 200, "failures are not cached")

    def test_the_cache_is_bounded(self):
        # authCacheEntries 3: four new tokens push the first out; it is reviewed again.
        tokens = [self.api.add_token("bounded-%d" % i, groups=["metrics-scrapers-b"]) for i in range(4)]
        self.api.grant("bounded", [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
                       [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "metrics-scrapers-b"}])
        for t in tokens:
            self.assertEqual(self.get(t)[0], 200)
        before = review_count(self.api, TOKEN_REVIEWS)
        self.assertEqual(self.get(tokens[3])[0], 200)
        self.assertEqual(review_count(self.api, TOKEN_REVIEWS), before, "the newest is held")
        self.assertEqual(self.get(tokens[0])[0], 200)
        self.assertEqual(review_count(self.api, TOKEN_REVIEWS), before + 1, "the oldest was dropped")

    def test_the_controller_may_make_the_reviews_by_the_charts_rbac(self):
        import rbac_check
        self.assertEqual(self.get(self.prometheus)[0], 200)
        calls = rbac_check.calls_from_log(self.api.requests, "rdmig-controller/")
        problems = rbac_check.compare(calls, rbac_check.chart_rules(),
                                      unused_of={"tokenreviews", "subjectaccessreviews"})
        self.assertEqual(problems, [], "\n".join(problems))

    def test_zz_with_the_api_server_gone_a_new_token_gets_503(self):
        token = self.api.add_token("late", groups=["system:masters"])
        cached = self.prometheus
        self.assertEqual(self.get(cached)[0], 200)
        self.api.stop()
        code, _, body = self.get(token)
        self.assertEqual(code, 503, body)
        self.assertTrue(self.ctl.alive())


class MetricsDefaultsTest(unittest.TestCase):
    """Without metrics.tls the secure port serves a certificate it made at start; metrics.secure
    false serves plain HTTP on 127.0.0.1 only, and refuses any other address."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-k8s-metrics-defaults-")
        cls.cluster = Cluster(cls.tmp)
        cls.token_file = os.path.join(cls.tmp, "agent.token")
        with open(cls.token_file, "w") as f:
            f.write("agent-token-" + os.urandom(8).hex() + "\n")

    @classmethod
    def tearDownClass(cls):
        cls.cluster.api.stop()
        if not os.environ.get("RDMIG_KEEP_TMP"):
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_the_secure_default_serves_a_self_signed_certificate(self):
        import socket
        import ssl
        ctl = Controller(self.tmp, "selfsigned", self.cluster.kubeconfig, self.token_file,
                         config={"metrics": {"secure": True, "address": "127.0.0.1", "port": 0}})
        try:
            with self.assertRaises(urllib.error.URLError) as refused:  # no CA vouches for it
                ctl.https_get("/metrics", cafile=self.cluster.api.ca_file)
            self.assertIsInstance(refused.exception.reason, ssl.SSLCertVerificationError)
            ctx = ssl._create_unverified_context()
            with socket.create_connection(("127.0.0.1", ctl.port), timeout=5) as raw:
                with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                    der = tls.getpeercert(binary_form=True)
                    self.assertIn(tls.version(), ("TLSv1.2", "TLSv1.3"))
            pem = ssl.DER_cert_to_PEM_cert(der)
            text = subprocess.run(["openssl", "x509", "-noout", "-subject", "-issuer", "-ext", "subjectAltName"],
                                  input=pem, capture_output=True, text=True, check=True).stdout
            self.assertIn("subject=CN = rdmig-controller", text)
            self.assertIn("issuer=CN = rdmig-controller", text)
            self.assertIn("DNS:localhost", text)
            self.assertEqual(ctl.https_get("/metrics")[0], 401)
            self.assertEqual(ctl.https_get("/metrics", token=self.cluster.api.add_token("x", ["system:masters"]))[0], 200)
        finally:
            ctl.stop()

    def test_local_only_metrics_listen_on_loopback_alone(self):
        before = review_count(self.cluster.api, TOKEN_REVIEWS)
        ctl = Controller(self.tmp, "local", self.cluster.kubeconfig, self.token_file,
                         config={"metrics": {"secure": False, "address": None, "port": 0}})  # no address: 127.0.0.1
        try:
            self.assertEqual(listen_addresses(ctl.port), ["127.0.0.1"])
            code, body = ctl.http_get("/metrics")
            self.assertEqual(code, 200)
            self.assertIn("rdmig_controller_leader", body)
            self.assertEqual(review_count(self.cluster.api, TOKEN_REVIEWS), before, "no review in local-only mode")
            self.assertIn("local only", ctl.log_text())
        finally:
            ctl.stop()
        # Any address other than a loopback one is refused at start, naming the key.
        cfg = os.path.join(self.tmp, "open.yaml")
        with open(cfg, "w") as f:
            json.dump({"agents": {"tokenFile": self.token_file}, "metrics": {"secure": False, "address": "0.0.0.0"}}, f)
        r = subprocess.run([controller_binary(), "--check-config", cfg], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("config key 'metrics.address'", r.stderr)
        self.assertIn("loopback", r.stderr)


def listen_addresses(port):
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    import socket
    import struct
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                addr, port_hex = fields[1].split(":")
                if fields[3] == "0A" and int(port_hex, 16) == port:
                    raw = bytes.fromhex(addr)
                    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
                    found.append(socket.inet_ntop(family, words))
    return found


if __name__ == "__main__":
    unittest.main()
