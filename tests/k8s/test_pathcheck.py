"""RdmaPathCheck end to end (docs/pathcheck.md): the API server double (the CRD's schema and
CEL rules enforced, status subresource, finalizers), rdmig-controller, and three real
rdmig-agents carrying the checks over TCP. No guest boots.

Run from the repository root after building:
    RDMIG_AGENT=build/agent/rdmig-agent RDMIG_CONTROLLER=build/controller/rdmig-controller \\
        python3 tests/k8s/test_pathcheck.py -v
"""
import os
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
from agent_standin import AgentStandin  # noqa: E402
from controllerlab import AgentsAndControllerTest, wait_for  # noqa: E402
from test_agent_hostile_http import FakeIncomingQemu  # noqa: E402

NS = "ops"
AGENT_NS = "rdmig-system"
MiB = 1 << 20


def pathcheck(name, source, targets, **spec):
    body = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaPathCheck",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"source": source, "targets": targets}}
    body["spec"].update(spec)
    return body


class PathCheckControllerTest(AgentsAndControllerTest):
    PLURAL, NS, AGENT_NS, TMP_PREFIX = "rdmapathchecks", NS, AGENT_NS, "rdmig-k8s-pc-"

    @classmethod
    def lab_setup(cls):
        # Running and Ready, but nothing answers on its port: its agent is down.
        cls.api.add_agent_pod(AGENT_NS, "rdmig-agent-dead", "node-dead", 1)

    def tearDown(self):
        super().tearDown()
        for agent in self.agents.values():
            self.assertTrue(agent.alive(), agent.log_text()[-3000:])

    def test_every_pair_carries_its_bytes_and_reports_its_figures(self):
        self.create(pathcheck("all-pass", "node-a", {"nodes": ["node-b", "node-c"]}, bytes="32Mi",
                              transport="tcp", maxConcurrentPairs=2, chunkSize="256Ki"))
        obj = self.wait_phase("all-pass", ("Succeeded", "Failed"))
        st = obj["status"]
        print("\nstatus:", st)
        self.assertEqual(st["phase"], "Succeeded", st)
        self.assertEqual(st["summary"]["passed"], 2)
        self.assertEqual(st["summary"]["failed"], 0)
        self.assertEqual([p["target"] for p in st["pairs"]], ["node-b", "node-c"])
        for p in st["pairs"]:
            self.assertEqual(p["phase"], "Passed", p)
            self.assertEqual(p["transport"], "tcp")
            self.assertEqual(p["bytesVerified"], 32 * MiB)
            self.assertGreater(p["throughputBytesPerSecond"], 0)
            self.assertGreater(p["rttMicroseconds"], 0)
            # Over TCP no RDMA port and no rail.
            for key in ("sourceRdma", "targetRdma", "rails"):
                self.assertNotIn(key, p)
        self.assertIn("node-a->node-", st["summary"]["worst"])
        conds = {c["type"]: c for c in st["conditions"]}
        self.assertEqual(conds["Complete"]["status"], "True")
        self.assertEqual(conds["RdmaOnEveryPair"]["status"], "False")  # tcp asked for
        self.assertEqual(st["observedGeneration"], obj["metadata"]["generation"])
        wait_for(lambda: ("Normal", "Completed") in self.reasons("all-pass"), 10, "the Completed event")
        self.assertEqual(self.reasons("all-pass").count(("Normal", "PairPassed")), 2)
        # The finalizer is gone once nothing runs.
        wait_for(lambda: not self.get("all-pass")["metadata"].get("finalizers"), 10, "the finalizer to go")

    def test_auto_over_tcp_only_agents_counts_as_fell_back_with_the_reason(self):
        self.create(pathcheck("fallback", "node-a", {"nodes": ["node-b"]}, bytes="8Mi"))
        st = self.wait_phase("fallback", ("Succeeded", "Failed"))["status"]
        self.assertEqual(st["phase"], "Succeeded", st)
        self.assertEqual(st["summary"]["fellBack"], 1)
        (p,) = st["pairs"]
        self.assertEqual(p["phase"], "FellBack")
        self.assertTrue(p["reason"].startswith("auto-no-source-rdma"), p)
        self.assertIn("tcp (auto-no-source-rdma", st["summary"]["worst"])
        wait_for(lambda: ("Warning", "PairFellBack") in self.reasons("fallback"), 10, "the PairFellBack event")

    def test_a_pair_whose_target_agent_is_down_fails_naming_the_cause(self):
        started = time.monotonic()
        self.create(pathcheck("one-down", "node-a", {"nodes": ["node-b", "node-dead"]}, bytes="8Mi",
                              transport="tcp", timeoutSeconds=20))
        st = self.wait_phase("one-down", ("Succeeded", "Failed"), timeout=30)["status"]
        elapsed = time.monotonic() - started
        print("\nstatus:", st, "after %.1f s" % elapsed)
        self.assertEqual(st["phase"], "Failed")
        self.assertEqual(st["summary"], {"pairs": 2, "passed": 1, "fellBack": 0, "failed": 1,
                                         "worst": st["summary"]["worst"]})
        dead = [p for p in st["pairs"] if p["target"] == "node-dead"][0]
        self.assertEqual(dead["phase"], "Failed")
        self.assertIn("target agent node-dead (127.0.0.1:1)", dead["error"])
        self.assertIn("(attempt 4 of 4)", dead["error"])  # not answering may be a restart: tried again
        self.assertIn("node-dead", st["summary"]["worst"])
        self.assertLess(elapsed, 20)
        wait_for(lambda: ("Warning", "PairFailed") in self.reasons("one-down"), 10, "the PairFailed event")

    def test_a_pair_refused_by_a_busy_agent_is_tried_again_and_passes(self):
        # The target agent runs its 4 checks already (429). Before, the pair failed at once on
        # that refusal; it is transient, so the controller tries again (1, 2, 4 s apart).
        b, c = self.agents["b"], self.agents["c"]
        busy = []
        for _ in range(4):
            t = c.call("POST", "/v1/pathchecks", {"role": "target", "bytes": "48Gi", "transport": "tcp",
                                                 "timeoutSeconds": 120})
            s = b.call("POST", "/v1/pathchecks", {"role": "source", "bytes": "48Gi", "transport": "tcp",
                                                 "timeoutSeconds": 120, "target": {
                                                     "endpoint": t["endpoint"], "checkId": t["checkId"],
                                                     "token": t["token"]}})
            busy.append(s["id"])
        try:
            self.create(pathcheck("busy-target", "node-a", {"nodes": ["node-c"]}, bytes="8Mi", transport="tcp"))

            def refused_once():
                obj = self.get("busy-target")
                pairs = (obj or {}).get("status", {}).get("pairs", [])
                return pairs and pairs[0].get("attempts", 0) >= 1 and pairs[0]
            pair = wait_for(refused_once, 30, "the controller's first attempt")
            print("\nrefused:", pair)
            self.assertEqual(pair["phase"], "Pending", pair)
            self.assertIn("already runs 4 path checks", pair["error"])
            self.assertIn("trying again", pair["error"])
        finally:
            for sid in busy:
                b.call("DELETE", "/v1/pathchecks/" + sid)
        st = self.wait_phase("busy-target", ("Succeeded", "Failed"), timeout=60)["status"]
        (p,) = st["pairs"]
        print("then:", p)
        self.assertEqual((st["phase"], p["phase"]), ("Succeeded", "Passed"), st)
        self.assertGreaterEqual(p["attempts"], 2)
        self.assertNotIn("error", p)
        self.assertNotIn("nextAttemptTime", p)

    def test_a_check_deleted_while_it_runs_stops_everything_it_started(self):
        self.create(pathcheck("deleted", "node-a", {"nodes": ["node-c"]}, bytes="48Gi", transport="tcp",
                              timeoutSeconds=600, chunkSize="1Mi"))
        obj = wait_for(lambda: (lambda o: o if o and any(p["phase"] == "Running" for p in o.get("status", {}).get("pairs", []))
                                else None)(self.get("deleted")), 20, "the pair to run")
        cid = obj["status"]["pairs"][0]["checkId"]
        wait_for(lambda: self.agents["a"].call("GET", "/v1/pathchecks/" + cid)["bytesSent"] > 16 * MiB, 20,
                 "bytes to flow")
        code, _ = self.store.delete("rdmapathchecks", NS, "deleted")
        self.assertEqual(code, 200)
        wait_for(lambda: self.get("deleted") is None, 20, "the object to go")
        src = self.agents["a"].call("GET", "/v1/pathchecks/" + cid)
        dst = self.agents["c"].call("GET", "/v1/pathchecks/" + cid)
        print("\nsource:", src, "\ntarget:", dst)
        self.assertEqual(src["phase"], "Cancelled", src)
        self.assertIn(dst["phase"], ("Cancelled", "Failed"))
        self.assertIn("cancelled", dst["error"])
        self.assertLess(src["bytesSent"], 48 << 30)
        for agent in (self.agents["a"], self.agents["c"]):
            self.assertFalse([c for c in agent.call("GET", "/v1/pathchecks")["items"]
                              if c["phase"] not in ("Succeeded", "Failed", "Cancelled")])

    def test_a_check_is_refused_beside_a_running_migration(self):
        qmp = os.path.join(tempfile.mkdtemp(prefix="rdmig-pc-qmp-"), "dst.qmp")
        fake = FakeIncomingQemu(qmp)
        m = self.agents["b"].create({"role": "target", "qmpSocket": qmp, "completionTimeoutSeconds": 60})
        try:
            self.create(pathcheck("beside", "node-a", {"nodes": ["node-b"]}, bytes="8Mi"))
            st = self.wait_phase("beside", ("Succeeded", "Failed"))["status"]
            self.assertEqual(st["phase"], "Failed")
            self.assertIn("allowDuringMigrations", st["pairs"][0]["error"])
            self.assertIn("runs 1 migration", st["pairs"][0]["error"])
            self.create(pathcheck("beside-allowed", "node-a", {"nodes": ["node-b"]}, bytes="8Mi",
                                  allowDuringMigrations=True))
            self.assertEqual(self.wait_phase("beside-allowed", ("Succeeded", "Failed"))["status"]["phase"], "Succeeded")
        finally:
            self.agents["b"].cancel(m["id"])
            self.agents["b"].wait(m["id"], timeout=30)
            fake.close()

    def test_targets_all_takes_every_agent_node_but_the_source(self):
        self.create(pathcheck("everyone", "node-b", {"all": True}, bytes="4Mi", transport="tcp", timeoutSeconds=20,
                              maxConcurrentPairs=3))
        st = self.wait_phase("everyone", ("Succeeded", "Failed"), timeout=40)["status"]
        self.assertEqual(sorted(p["target"] for p in st["pairs"]), ["node-a", "node-c", "node-dead"])
        self.assertEqual((st["summary"]["passed"], st["summary"]["failed"]), (2, 1))

    def test_targets_by_node_labels(self):
        for name, labels in (("node-b", {"rack": "r7"}), ("node-c", {"rack": "r7"}), ("node-a", {"rack": "r7"}),
                             ("node-x", {"rack": "r8"})):
            code, body = self.store.create("nodes", None, {"apiVersion": "v1", "kind": "Node",
                                                           "metadata": {"name": name, "labels": labels}})
            self.assertIn(code, (201, 409), body)
        self.create(pathcheck("rack-r7", "node-a", {"selector": {"rack": "r7"}}, bytes="4Mi", transport="tcp",
                              maxConcurrentPairs=2))
        st = self.wait_phase("rack-r7", ("Succeeded", "Failed"))["status"]
        self.assertEqual([p["target"] for p in st["pairs"]], ["node-b", "node-c"])  # not the source, not r8
        self.assertEqual(st["phase"], "Succeeded", st)

    def test_an_rdma_pair_lists_every_rail_with_both_ports_and_a_hostile_agents_rails_are_bounded(self):
        # Agent stand-ins (no RDMA here): the source's view of a check striped over two rails,
        # then 998 more entries that a broken or hostile agent could send.
        def end(device, netdev, gid, mtu):
            return {"device": device, "port": 1, "gid": gid, "gidIndex": 3, "gidType": "RoCE v2",
                    "netdev": netdev, "mtu": mtu}
        a0, b0 = end("mlx5_0", "ens1f0v0", "g-a0", 4096), end("mlx5_4", "ens1f0v3", "g-b0", 4096)
        a1, b1 = end("mlx5_1", "ens2f0v0", "g-a1", 4096), end("mlx5_5", "ens2f0v3", "g-b1", 4096)
        rails = [{"rail": 0, "device": "mlx5_0", "gid": "g-a0", "address": "10.10.0.1", "peerAddress": "10.10.0.2:7472",
                  "channels": [0, 2], "bytesSent": 43 * MiB, "bytesReceived": 0, "localRdma": a0, "peerRdma": b0},
                 {"rail": 1, "device": "mlx5_1", "gid": "g-a1", "address": "10.10.1.1", "peerAddress": "10.10.1.2:7472",
                  "channels": [1], "bytesSent": 21 * MiB, "bytesReceived": 0, "localRdma": a1, "peerRdma": b1}]
        rails += [{"rail": 2 + i % 14, "channels": list(range(100)), "localRdma": end("x" * 300, "n", "g", 1 << 20)}
                  for i in range(998)]
        view = {"phase": "Succeeded", "transport": "rdma", "transportReason": "auto-both-rdma", "bytes": 64 * MiB,
                "bytesSent": 64 * MiB, "channels": 3, "throughputBytesPerSecond": 1e9, "rttMicroseconds": 20,
                "durationMs": 70, "localRdma": a0, "peerRdma": b0, "rails": rails}
        src = AgentStandin(self.token, name="node-rs", pathcheck_view=view)
        dst = AgentStandin(self.token, name="node-rt")
        pods = [("rdmig-agent-rs", "node-rs", src), ("rdmig-agent-rt", "node-rt", dst)]
        for pod, node, s in pods:
            self.api.add_agent_pod(AGENT_NS, pod, node, s.port)
        try:
            self.create(pathcheck("rails", "node-rs", {"nodes": ["node-rt"]}, bytes="64Mi", channels=3))
            st = self.wait_phase("rails", ("Succeeded", "Failed"))["status"]
        finally:
            for pod, _, s in pods:
                self.store.delete("pods", AGENT_NS, pod)
                s.stop()
        (p,) = st["pairs"]
        self.assertEqual(p["phase"], "Passed", p)
        self.assertEqual((p["sourceRdma"], p["targetRdma"]), (a0, b0))
        self.assertEqual(len(p["rails"]), 16, "one per rail index, at most 16")
        self.assertEqual(p["rails"][0], {"rail": 0, "channels": [0, 2], "bytes": 43 * MiB, "sourceRdma": a0,
                                         "targetRdma": b0})
        self.assertEqual(p["rails"][1], {"rail": 1, "channels": [1], "bytes": 21 * MiB, "sourceRdma": a1,
                                         "targetRdma": b1})
        for r in p["rails"][2:]:
            self.assertEqual(len(r["channels"]), 64)
            self.assertEqual(len(r["sourceRdma"]["device"]), 64)
            self.assertEqual(r["sourceRdma"]["mtu"], 4096)

    def test_a_finished_check_goes_after_its_ttl(self):
        self.create(pathcheck("short-lived", "node-a", {"nodes": ["node-b"]}, bytes="4Mi", transport="tcp",
                              ttlSecondsAfterFinished=1))
        wait_for(lambda: self.get("short-lived") is None, 30, "the object to be deleted after its TTL")

    def test_zz_rbac_in_the_chart_covers_the_calls_and_every_pathcheck_grant_is_used(self):
        import rbac_check
        # A status write that meets a conflict: the controller re-reads the object (get) and retries.
        self.store.conflict_once.add(("rdmapathchecks", NS, "conflicted"))
        self.create(pathcheck("conflicted", "node-a", {"nodes": ["node-b"]}, bytes="4Mi", transport="tcp"))
        self.wait_phase("conflicted", ("Succeeded", "Failed"))
        calls = rbac_check.calls_from_log(self.api.requests, "rdmig-controller/")
        # create: an RdmaDrainPlan runs a check of its own (tests/k8s/test_drainplan.py checks it).
        problems = rbac_check.compare(calls, rbac_check.without(rbac_check.chart_rules(), "rdmapathchecks", "create"),
                                      unused_of={"rdmapathchecks", "rdmapathchecks/status", "nodes"})
        self.assertEqual(problems, [], "\n".join(problems))

    def test_the_sample_is_valid_and_runs(self):
        import yaml
        with open(os.path.join(REPO, "operator-manifests", "samples", "pathcheck-before-drain.yaml")) as f:
            body = yaml.safe_load(f)
        body["metadata"]["namespace"] = NS
        body["spec"].update(bytes="4Mi", timeoutSeconds=10)  # small, and node-dead fails fast
        self.create(body)
        st = self.wait_phase(body["metadata"]["name"], ("Succeeded", "Failed"), timeout=40)["status"]
        # node-a -> every other agent node: node-b and node-c carry it (tcp-only agents: FellBack),
        # node-dead's agent does not answer.
        self.assertEqual(sorted(p["target"] for p in st["pairs"]), ["node-b", "node-c", "node-dead"])
        self.assertEqual((st["summary"]["fellBack"], st["summary"]["failed"]), (2, 1))

    def test_the_schema_refuses_bad_specs(self):
        bad = [
            pathcheck("two-kinds", "node-a", {"nodes": ["node-b"], "all": True}),
            pathcheck("no-kind", "node-a", {}),
            pathcheck("bad-bytes", "node-a", {"nodes": ["node-b"]}, bytes="lots"),
            pathcheck("bad-transport", "node-a", {"nodes": ["node-b"]}, transport="ib"),
            pathcheck("too-many", "node-a", {"nodes": ["n%d" % i for i in range(65)]}),
        ]
        for body in bad:
            code, reply = self.store.create("rdmapathchecks", NS, body)
            self.assertEqual(code, 422, (body["metadata"]["name"], reply))
        # And the spec cannot change once made.
        self.create(pathcheck("frozen", "node-a", {"nodes": ["node-b"]}, bytes="4Mi", transport="tcp"))
        obj = self.get("frozen")
        obj["spec"]["bytes"] = "8Mi"
        code, reply = self.store.replace("rdmapathchecks", NS, "frozen", obj)
        self.assertEqual(code, 422, reply)
        self.wait_phase("frozen", ("Succeeded", "Failed"))


if __name__ == "__main__":
    unittest.main()
