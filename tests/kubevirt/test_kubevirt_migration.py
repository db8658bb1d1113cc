#!/usr/bin/env python3
"""rdmig carrying KubeVirt's own live migration: the KubeVirt-shaped harness (real libvirt 9.0
peer to peer, real QEMU, the virt-handler migration-proxy stand-in with mTLS, two handler
network namespaces; tools/rdmiglab/kubevirt.py) with a real rdmig agent per node. The source
proxy calls the agent's node hook (real gRPC) the way virt-handler does; the agent installs
its nftables redirect in the source handler's namespace and carries the memory connections to
the target node's agent, which dials the target proxy from inside the target handler's
namespace. libvirt's control connection stays on KubeVirt's TCP.

Transport here: TCP (this machine has no RDMA device; the relay over RDMA runs in the
Soft-RoCE VM, tests/rdma/kubevirt-tests.sh).
The agents run unprivileged with exactly the chart's KubeVirt-mode capabilities (rdmiglab.profile).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, HERE)

import test_kubevirt_baseline as base  # noqa: E402  (its checks of KubeVirt's connections)
from rdmiglab.kvagents import FINAL_PHASES, KubevirtAgents  # noqa: E402
from rdmiglab.kvpod import wait_for  # noqa: E402
from rdmiglab import timed  # noqa: E402

NODES = ("node-a", "node-b")
UFFD_SYSCTL = "/proc/sys/vm/unprivileged_userfaultfd"

# The root row (kubevirt_migration_root): the host's QEMU 7.2 under TCG, whose dirty tracking
# loses guest writes made during a migration (the TCG TLB is not brought up to date when the
# migration clears dirty bits in bulk; fixed upstream in QEMU 9.0, "physmem: Fix migration dirty
# bitmap coherency with TCG memory access"). Every write lost is a page the target runs with stale
# contents, rdmig in the path or not (tests/kubevirt/README.md). This row's guest (writing 8 MiB/s,
# so every migration iterated) died in 2 of the last 12 whole runs: once on the target after a
# migration on a busy machine, once after the killed-agent case's failed 8-connection migration and
# the one after it, with the row alone. On this row the guest only runs its counter (the kernel's
# own writes still happen during every migration: fewer passes, fewer writes lost), and the
# killed-agent case runs on the trixie row only; on QEMU 7.2 it is measured by
# tests/kubevirt/failure_tries.py (docs/kubevirt.md, 10 of 10 tries each way).
ROOT_ROW = (os.environ.get("RDMIG_KV_LAUNCHER") or "trixie-nonroot") == "bookworm-root"




class KubevirtMigrationTest(base.KubevirtChecks, unittest.TestCase):
    cluster = None

    @classmethod
    def setUpClass(cls):
        reason = base.missing_prereq()
        if reason:
            raise unittest.SkipTest(reason)
        from rdmiglab.kubevirt import KubevirtCluster
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-kvmig-")
        cls.kv = None
        cls.cluster = KubevirtCluster().__enter__()
        try:
            # The agents unprivileged as the chart runs them in KubeVirt mode (rdmiglab.profile:
            # DAC_OVERRIDE, NET_ADMIN, SYS_ADMIN, SYS_PTRACE and no other capability, seccomp
            # RuntimeDefault, a read-only root but for stateDir and the hook socket's directory),
            # checked at every (re)start: every carry below runs under that profile.
            cls.kv = KubevirtAgents(cls.tmp, NODES, profile="chart")
            cls.agents = cls.kv.agents
            cls.cluster.define_and_start_vmi("testvm", "default", mem_mib=base.MEM_MIB,
                                             dirty_mib=0 if ROOT_ROW else base.DIRTY_MIB, boot_counter=2)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.kv is not None:
            cls.kv.close()
        if cls.cluster is not None:
            cls.cluster.close()

    def tearDown(self):
        failed = any(e for t, e in self._outcome.result.errors + self._outcome.result.failures if t is self) \
            if hasattr(self._outcome, "result") else False
        if failed:
            for n, a in self.agents.items():
                print("---- agent %s log (tail) ----\n%s" % (n, a.log_text()[-6000:]), file=sys.stderr)
            # Each node's QEMU as the failure left it (its run and migration state, the serial
            # tail, libvirt's log of it: why a QEMU that is gone ended). W34 (2026-12-07) saw one
            # post-copy case fail with the target domain gone and only the agents' logs to read.
            for n in NODES:
                try:
                    print("---- QEMU on %s: %s" % (n, self.cluster.guest_diagnosis(n)), file=sys.stderr)
                except Exception as e:  # noqa: BLE001 - no VMI yet, or its pod gone: say so
                    print("---- QEMU on %s: not read (%s)" % (n, e), file=sys.stderr)
        base.KubevirtChecks.tearDown(self)  # also KubevirtBlockMigrationTest's (it borrows this method)

    def setUp(self):
        self.cluster.migration_config_overrides = {}
        for n in NODES:
            if not self.agents[n].alive():
                self.kv.start(n)

    def record(self, node, mig_uid, phases=FINAL_PHASES, timeout=30):
        return self.kv.record(node, mig_uid, phases, timeout)

    def migrate(self, **kw):
        src = self.cluster.vmi.node
        kw.setdefault("hook_socket", self.agents[src].hook_socket)
        kw.setdefault("hook_timeout", 5)
        return self.cluster.migrate(**kw)

    def carried(self, node, migration_uid):
        """The records of `migration_uid` on `node`'s agent that carry all 9 connections (8
        parallel, the main one) and have sent more than 8 MiB: mid-migration."""
        items = self.agents[node].call("GET", "/v1/kubevirt/migrations?migrationUid=" + migration_uid)["items"]
        return [i for i in items if i["connections"] == 9 and i["bytesSent"] > (8 << 20)]

    def when_carried(self, node, ctx, action):
        """On a thread of its own: once ctx's migration is carried mid-stream on `node`'s agent
        (carried()), calls action(its record); nothing when that does not happen within 30 s (the
        test then finds its action never ran)."""
        def run():
            try:
                items = wait_for(lambda: self.carried(node, ctx.migration_uid), 30, "the migration to be carried",
                                 interval=0.02)
            except TimeoutError:
                return
            action(items[0])
        threading.Thread(target=run, daemon=True).start()

    def assertCarried(self, r, parallel):
        src = self.record(r.source_node, r.migration_uid)
        dst = self.record(r.target_node, r.migration_uid)
        print("\n[kubevirt+rdmig] %s\n  source record: %s" % (json.dumps(r.summary(), sort_keys=True),
                                                            json.dumps(src, sort_keys=True)), file=sys.stderr)
        self.assertTrue(src["carried"], src)
        self.assertEqual(src["phase"], "Succeeded", src)
        self.assertEqual(dst["phase"], "Succeeded", dst)
        self.assertEqual(src["connections"], 1 + parallel, "the memory connections, not libvirt's control")
        self.assertEqual(src["transport"], "tcp")
        self.assertEqual(src["vmi"]["uid"], r.vmi_uid)
        # Every memory byte libvirt's source wrote went through the agents.
        memory_bytes = sum(c["dialed"]["tx_bytes"] for c in r.proxy_logs["source"]["connections"]
                           if c["class"] == 49152)
        self.assertEqual(src["bytesSent"], memory_bytes)
        self.assertEqual(dst["bytesReceived"], memory_bytes)
        # libvirt's own downtime, read by the target agent and handed to the source's record.
        self.assertIsNotNone(src["libvirt"], src)
        self.assertEqual(src["libvirt"]["downtimeMs"], r.downtime_ms)
        self.assertEqual(src["libvirt"]["totalTimeMs"], r.total_time_ms)
        self.assertFailureActionFitsTheLaunchersQemu(src)
        return src

    def assertFailureActionFitsTheLaunchersQemu(self, src):
        # kubevirt.multifdOnFailure "auto": the source agent asked the launcher's libvirt for
        # its QEMU, and drains the multifd connections on every QEMU: QEMU 10 (trixie, KubeVirt
        # 1.9) wedged once with every connection reset, QEMU 7.2 (bookworm, the Root row) needs
        # the drain too (bench/results/kubevirt-failures/).
        of = src.get("onFailure") or {}
        want = ("drain", "qemu 10.") if self.cluster.flavor == "trixie-nonroot" else ("drain", "qemu 7.2.")
        self.assertEqual(of.get("multifd"), want[0], src)
        self.assertTrue((of.get("by") or "").startswith(want[1]), src)

    # ---- behaviours ----

    def test_eight_parallel_tls_connections_carried_in_order(self):
        # A running target: memory-checked (paused) runs with 8 connections left a guest that
        # died after resume on KubeVirt's path without rdmig too (QEMU 7.2 multifd started by
        # libvirt 9.0; tests/kubevirt/README.md). Bytes are proven on the wire instead: the
        # ciphertext hashes of every connection are equal on both proxies' legs.
        r = self.migrate(parallel=8, tls=True)
        self.assertGuestContinuedOnTarget(r)
        self.assertConnectionsAsKubevirtMakesThem(r, 8, True, carried=True)
        self.assertCarried(r, 8)

    def test_single_plain_connection_carried_with_bytes_checked_per_leg(self):
        r = self.migrate(parallel=0, tls=False, target_paused=True)
        self.assertGuestContinuedOnTarget(r)
        self.assertConnectionsAsKubevirtMakesThem(r, 0, False, carried=True)
        self.assertCarried(r, 0)
        # Reported, not required: the same migration without rdmig (test_kubevirt_baseline)
        # once differed too (QEMU 7.2 TCG); the per-leg hashes above prove rdmig's part.
        self.assertIsNotNone(r.memory["source_sha256"], "source memory not read: %s" % r.source_memory_error)
        print("[kubevirt+rdmig] 1 connection, memory equal: %s" % r.memory["equal"], file=sys.stderr)

    def test_post_copy_allowed_is_left_to_kubevirt(self):
        self.cluster.migration_config_overrides = {"allowPostCopy": True}
        r = self.migrate(parallel=0, tls=True)
        self.assertGuestContinuedOnTarget(r)
        rec = self.record(r.source_node, r.migration_uid)
        self.assertFalse(rec["carried"])
        self.assertIn("post-copy", rec["reason"])

    @unittest.skipIf(ROOT_ROW, "runs on the trixie row (kubevirt_migration); on QEMU 7.2 it is measured by "
                     "tests/kubevirt/failure_tries.py (docs/kubevirt.md)")
    def test_killed_target_agent_fails_fast_source_keeps_vm_next_goes_kubevirts_way(self):
        source = self.cluster.vmi.node
        target = NODES[1 - NODES.index(source)]
        killed = {}

        def kill_when_carrying(ctx):
            def kill(_item):
                killed["at"] = time.monotonic()
                self.agents[target].proc.send_signal(signal.SIGKILL)
            self.when_carried(source, ctx, kill)

        t0 = time.monotonic()
        r = self.migrate(parallel=8, tls=True, expect_success=False, before_dial=kill_when_carrying,
                         check_counter=False)
        self.assertIn("at", killed, "the migration was never carried")
        self.assertFalse(r.success, "the migration should fail when its carrier dies")
        returned_after = time.monotonic() - killed["at"]
        # rdmig's part: the source QEMU's migration fails at once (the source agent resets its
        # legs), not after KubeVirt's 150 s progress timeout. libvirt's call itself can then
        # wait on the target's Finish: a target QEMU 7.2 blocked in a multifd sync on a
        # connection KubeVirt's proxy keeps open never answers it, without rdmig too, until
        # KubeVirt deletes the target pod (the harness does that 5 s after the source failed).
        self.assertIsNotNone(r.source_failed_at, "the source QEMU's migration never failed")
        failed_after = r.source_failed_at - killed["at"]
        print("\n[kubevirt+rdmig] target agent killed: the source QEMU's migration failed %.1fs later; "
              "libvirt returned %.1fs later%s (%s)"
              % (failed_after, returned_after,
                 ", after the harness deleted the target pod" if r.target_pod_deleted_at else "", r.error),
              file=sys.stderr)
        self.assertLess(failed_after, 15.0, "the source must fail fast, not after a 150 s progress timeout")
        self.assertLess(returned_after, 30.0)
        # The VM runs in exactly one place: the source.
        self.assertEqual(self.cluster.vmi.node, source)
        self.assertEqual(self.cluster.domain(source).isActive(), 1)
        before = self.cluster.serial_counter(source)
        try:
            self.cluster.wait_for_counter(source, (before or 0) + 1, 60)
        except TimeoutError as e:
            dom = self.cluster.domain(source)
            raise AssertionError("the source guest stopped advancing: libvirt state %s, job %s; %s"
                                 % (dom.state(), dom.jobInfo(), e))
        # What libvirt left on the target (the harness then deletes it, as KubeVirt deletes the
        # target pod): at most an incoming domain that never ran.
        self.assertNotEqual(r.target_cleanup, "running", "the VM must not run on the target too")
        rec = self.record(source, r.migration_uid, phases=("Failed",))
        self.assertIn(target, rec["reason"])
        self.assertFailureActionFitsTheLaunchersQemu(rec)
        # The next migration goes KubeVirt's own way (the target agent is still down) and works.
        # One connection: on KubeVirt's path alone, an 8-connection migration right after a
        # failed one has ended with the guest panicking on the target (a full CI run; QEMU 7.2
        # TCG multifd, tests/kubevirt/README.md); which path carries it is what is checked here.
        r2 = self.migrate(parallel=0, tls=True)
        self.assertGuestContinuedOnTarget(r2)
        rec2 = self.record(source, r2.migration_uid)
        self.assertFalse(rec2["carried"], rec2)
        print("[kubevirt+rdmig] next migration not carried: %s (%.1fs after the kill)"
              % (rec2["reason"], time.monotonic() - t0), file=sys.stderr)

    def restart_agents(self, **data_plane):
        """Both agents restarted with these dataPlane keys (this test's), then as before."""
        def restart(dp):
            self.kv.data_plane = dp
            for n in NODES:
                if self.agents[n].alive():
                    self.agents[n].stop()
                self.kv.start(n)
        before = dict(self.kv.data_plane)
        restart(dict(before, **data_plane))
        self.addCleanup(restart, before)

    @unittest.skipIf(ROOT_ROW, "runs on the trixie row (kubevirt_migration): failover lives between the agents, "
                     "whatever the launcher, and this row keeps QEMU 7.2's migrations few (ROOT_ROW above)")
    def test_data_channels_reset_mid_stream_with_failover_libvirt_completes_through_rdmig(self):
        # dataPlane.failover on both agents (docs/failover.md): while the migration is carried,
        # the agents' data channels are reset again and again (ss -K: the link's state dropped).
        # Each is re-dialled and resumed byte-exact; KubeVirt's proxies, libvirt and both QEMUs
        # see a stall: the migration succeeds through rdmig and the guest runs on the target.
        # Without failover the first reset fails the migration (VM on the source).
        from rdmiglab import linkcut
        self.restart_agents(failover="on")
        source = self.cluster.vmi.node
        target = NODES[1 - NODES.index(source)]
        cuts = {"n": 0}

        def reset_while_carrying(ctx):
            def reset(_item):
                # Three rounds a little apart, each resetting every channel that carried 1 MiB.
                for _ in range(3):
                    cuts["n"] += linkcut.cut_data_channels(self.kv.ports[target], min_bytes=1 << 20)
                    time.sleep(0.3)  # the rounds' pace, not a wait for anything
            self.when_carried(source, ctx, reset)

        r = self.migrate(parallel=8, tls=True, before_dial=reset_while_carrying, check_counter=True)
        print("\n[kubevirt+rdmig] %d channel reset(s) mid-migration" % cuts["n"], file=sys.stderr)
        self.assertGreaterEqual(cuts["n"], 1, "no channel was reset while carried: the test proves nothing")
        self.assertGuestContinuedOnTarget(r)
        src = self.assertCarried(r, 8)
        dst = self.record(r.target_node, r.migration_uid)
        print("[kubevirt+rdmig] failover source %s target %s" % (src["failover"], dst["failover"]), file=sys.stderr)
        self.assertGreaterEqual(src["failover"]["failovers"], 1, src)
        from rdmiglab.agent import parse_prometheus
        m = parse_prometheus(self.agents[source].metrics())[0]
        self.assertGreaterEqual(sum(v for (name, labels), v in m.items() if name == "rdmig_failovers_total"
                                    and ("role", "source") in labels), 1)

    def test_sigterm_to_the_source_agent_while_it_carries_lets_libvirt_finish_through_the_agents(self):
        # An upgrade reaching the source node mid-migration: the agent drains (issue 42).
        source = self.cluster.vmi.node
        target = NODES[1 - NODES.index(source)]
        sent = {}

        def term_when_carrying(ctx):
            def term(item):
                sent["at"], sent["phase"], sent["bytes"] = time.monotonic(), item["phase"], item["bytesSent"]
                self.agents[source].proc.send_signal(signal.SIGTERM)
            self.when_carried(source, ctx, term)

        r = self.migrate(parallel=8, tls=True, before_dial=term_when_carrying, check_counter=True)
        self.assertIn("at", sent, "the migration was never carried")
        self.assertEqual(sent["phase"], "Carrying", "the signal must come while the migration runs")
        self.assertGuestContinuedOnTarget(r)
        # Carried to the end through both agents: the target's record (the source agent exits
        # once drained, its records with it).
        dst = self.record(target, r.migration_uid)
        memory_bytes = sum(c["dialed"]["tx_bytes"] for c in r.proxy_logs["source"]["connections"]
                           if c["class"] == 49152)
        self.assertEqual((dst["carried"], dst["phase"]), (True, "Succeeded"), dst)
        self.assertEqual(dst["bytesReceived"], memory_bytes)
        agent = self.agents[source]
        agent.proc.wait(timeout=60)
        self.assertEqual(agent.proc.returncode, 0)
        self.assertIn("drained: nothing runs any more", agent.log_text())
        print("\n[kubevirt+rdmig] source agent SIGTERM after %.1f MiB carried: libvirt completed through the "
              "agents (%s), the agent exited by itself %.1fs after the signal"
              % (sent["bytes"] / 1048576.0, r.error or "ok", time.monotonic() - sent["at"]), file=sys.stderr)

    def test_rules_of_a_killed_source_agent_expire_and_kubevirt_migrates_alone(self):
        source = self.cluster.vmi.node
        state = {}

        def kill_after_arming(ctx):
            agent = self.agents[source]
            rules = subprocess.run(["ip", "netns", "exec", ctx.handler_netns["source"], "nft", "list", "table",
                                    "inet", "rdmig"], capture_output=True, text=True).stdout
            state["armed"] = "%s . " % ctx.target_address in rules
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait()
            t = time.monotonic()
            wait_for(lambda: "%s . " % ctx.target_address not in subprocess.run(
                ["ip", "netns", "exec", ctx.handler_netns["source"], "nft", "list", "table", "inet", "rdmig"],
                capture_output=True, text=True).stdout, 15, "the redirect to expire")
            state["expired_after"] = time.monotonic() - t

        r = self.migrate(parallel=8, tls=True, before_dial=kill_after_arming)
        self.assertTrue(state.get("armed"), "the hook armed a redirect")
        self.assertGuestContinuedOnTarget(r)
        self.assertConnectionsAsKubevirtMakesThem(r, 8, True)
        print("\n[kubevirt+rdmig] rules expired %.1fs after the agent died; KubeVirt migrated alone"
              % state["expired_after"], file=sys.stderr)


class KubevirtBlockMigrationTest(base.KubevirtChecks, base.BlockChecks, unittest.TestCase):
    """KubeVirt's block migration (a VMI with a local disk the guest writes without end:
    VIR_MIGRATE_NON_SHARED_INC, the disk's NBD connection on the 49153 class first, then
    memory on 49152) with the agents carrying both classes."""
    cluster = None
    setUp = KubevirtMigrationTest.setUp
    tearDown = KubevirtMigrationTest.tearDown
    record = KubevirtMigrationTest.record
    migrate = KubevirtMigrationTest.migrate
    tearDownClass = KubevirtMigrationTest.__dict__["tearDownClass"]

    @classmethod
    def setUpClass(cls):
        reason = base.missing_prereq()
        if reason:
            raise unittest.SkipTest(reason)
        if (os.environ.get("RDMIG_KV_LAUNCHER") or "trixie-nonroot") == "bookworm-root":
            # The host's QEMU 7.2 (the root row) hangs TCG guests after block migrations by itself:
            # a whole run with nothing beside it lost its disk guest after the first move and all
            # five cases with it. Block migration is proven on the trixie row (QEMU 10, libvirt 11,
            # non-root launchers, as KubeVirt 1.9 ships): kubevirt_migration runs this class.
            raise unittest.SkipTest("block migration runs on the trixie row (kubevirt_migration), not on QEMU 7.2")
        from rdmiglab.kubevirt import KubevirtCluster
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-kvblk-")
        cls.kv = None
        cls.cluster = KubevirtCluster().__enter__()
        try:
            # The agents unprivileged as the chart runs them in KubeVirt mode (rdmiglab.profile:
            # DAC_OVERRIDE, NET_ADMIN, SYS_ADMIN, SYS_PTRACE and no other capability, seccomp
            # RuntimeDefault, a read-only root but for stateDir and the hook socket's directory),
            # checked at every (re)start: every carry below runs under that profile.
            cls.kv = KubevirtAgents(cls.tmp, NODES, profile="chart")
            cls.agents = cls.kv.agents
            cls.cluster.define_and_start_vmi("diskvm", "default", mem_mib=base.MEM_MIB,
                                             dirty_mib=base.DIRTY_MIB, boot_counter=2,
                                             disk_mib=base.DISK_MIB)
        except BaseException:
            cls.tearDownClass()
            raise

    @staticmethod
    def expected_main_connection(r, tls):
        """The agent's index of QEMU's main memory channel as the proxies' logs show it: the
        carried connections (49152/49153) in the order the target agent delivered them (the
        target proxy's accept order); with TLS the first 49152 one, without TLS the one whose
        unix leg got QEMU's stream header first."""
        carried = sorted((c for c in r.proxy_logs["target"]["connections"] if c["class"] != 0),
                         key=lambda c: c["accept_index"])
        for i, c in enumerate(carried):
            if c["class"] != 49152:
                continue
            if tls or c["dialed"]["tx_head"].startswith(base.QEVM):
                return i
        return None

    def assertBlockCarried(self, r, parallel, tls):
        src = self.record(r.source_node, r.migration_uid)
        dst = self.record(r.target_node, r.migration_uid)
        print("\n[kubevirt+rdmig block] %s\n  disk: %s\n  source record: %s"
              % (json.dumps(r.summary(), sort_keys=True), json.dumps(r.disk, sort_keys=True),
                 json.dumps(src, sort_keys=True)), file=sys.stderr)
        self.assertTrue(src["carried"], src)
        self.assertEqual(src["phase"], "Succeeded", src)
        self.assertEqual(dst["phase"], "Succeeded", dst)
        self.assertEqual(src["connections"], 1 + parallel + 1, "memory + block connections, not libvirt's control")
        carried_bytes = sum(c["dialed"]["tx_bytes"] for c in r.proxy_logs["source"]["connections"]
                            if c["class"] in (49152, 49153))
        self.assertEqual(src["bytesSent"], carried_bytes)
        self.assertEqual(dst["bytesReceived"], carried_bytes)
        self.assertGreater(src["bytesSent"], base.DISK_MIB << 20, "the disk went through the agents")
        index = self.expected_main_connection(r, tls)
        self.assertIsNotNone(index)
        self.assertNotEqual(index, 0, "the NBD connection comes first")
        self.assertEqual(src["mainConnection"], {"index": index, "by": "order" if tls else "magic"}, src)
        self.assertIsNotNone(src["libvirt"], src)
        self.assertEqual(src["libvirt"]["downtimeMs"], r.downtime_ms)
        return src

    def _block_migrate(self, parallel, tls):
        r = self.migrate(parallel=parallel, tls=tls, target_paused=True, timeout=180)
        self.assertGuestContinuedOnTarget(r)
        self.assertConnectionsAsKubevirtMakesThem(r, parallel, tls, carried=True, block=1)
        self.assertBlockCarried(r, parallel, tls)
        self.assertBlockMigrated(r)  # memory required on QEMU 10 (base.BlockChecks)
        print("[kubevirt+rdmig block] %d connections, tls %s: disk equal %s, memory equal %s"
              % (parallel, tls, r.disk["equal"], r.memory["equal"]), file=sys.stderr)
        return r

    def test_block_single_tls_connection_carried_disk_and_memory_equal(self):
        self._block_migrate(0, True)

    def test_block_eight_parallel_tls_connections_carried_disk_equal(self):
        self._block_migrate(8, True)

    def test_block_eight_parallel_plain_connections_main_channel_by_magic(self):
        self._block_migrate(8, False)

    def _kill_target_agent_when(self, phase):
        """Block migration with 8 TLS connections; SIGKILLs the target agent once the source
        agent carried 4 MiB over the NBD connection and no memory connection exists yet
        ("disk"), or
        once the first memory connection is carried ("memory"). Then: libvirt fails within
        seconds, the VM runs on the source only, the VMI block-migrates again."""
        source = self.cluster.vmi.node
        target = self.cluster.other(source)
        killed = {}

        def kill(ctx):
            def carrying():
                items = self.agents[source].call(
                    "GET", "/v1/kubevirt/migrations?migrationUid=" + ctx.migration_uid)["items"]
                # disk: the NBD connection carried and some MiB of the disk through it
                want = (lambda i: i["connections"] == 1 and i["bytesSent"] > (4 << 20)) if phase == "disk" \
                    else (lambda i: i["connections"] >= 2)
                return any(i["phase"] in ("Armed", "Carrying") and want(i) for i in items)

            def run():
                try:
                    wait_for(carrying, 60, "the %s phase to be carried" % phase, interval=0.01)
                except TimeoutError:
                    return
                killed["at"] = time.monotonic()
                self.agents[target].proc.send_signal(signal.SIGKILL)
            threading.Thread(target=run, daemon=True).start()

        disk_before = self.cluster.disk_counter(source)
        r = self.migrate(parallel=8, tls=True, expect_success=False, before_dial=kill, check_counter=False,
                         timeout=180)
        self.assertIn("at", killed, "the %s phase was never carried" % phase)
        self.assertFalse(r.success, "the migration should fail when its carrier dies")
        returned_after = time.monotonic() - killed["at"]
        memory_conns = [c for c in r.proxy_logs["source"]["connections"] if c["class"] == 49152]
        print("\n[kubevirt+rdmig block] target agent killed in the %s phase: libvirt returned %.1fs later%s, "
              "source QEMU failed %s; %d memory connections at the source proxy (%s)"
              % (phase, returned_after,
                 ", after the harness deleted the target pod" if r.target_pod_deleted_at else "",
                 "%.1fs later" % (r.source_failed_at - killed["at"]) if r.source_failed_at else "-",
                 len(memory_conns), r.error), file=sys.stderr)
        if phase == "disk":
            # libvirt starts QEMU's memory migration only once the mirror is in sync.
            self.assertEqual(memory_conns, [], "a memory connection existed when the disk copy was cut")
        else:
            self.assertTrue(memory_conns)
            self.assertIsNotNone(r.source_failed_at, "the source QEMU's migration never failed")
            self.assertLess(r.source_failed_at - killed["at"], 15.0)
        self.assertLess(returned_after, 30.0, "libvirt must fail fast, not after a 150 s progress timeout")
        # The VM runs in exactly one place: the source, still writing its disk.
        self.assertEqual(self.cluster.vmi.node, source)
        self.assertEqual(self.cluster.domain(source).isActive(), 1)
        import libvirt
        self.assertEqual(self.cluster.domain(source).state()[0], libvirt.VIR_DOMAIN_RUNNING)
        before = self.cluster.serial_counter(source)
        self.cluster.wait_for_counter(source, (before or 0) + 1, 60)
        wait_for(lambda: (self.cluster.disk_counter(source) or -1) > (disk_before or 0), 60,
                 "the source guest's disk writer to go on")
        self.assertNotEqual(r.target_cleanup, "running", "the VM must not run on the target too")
        tconn = self.cluster.connect(target)
        try:
            self.assertEqual([d.name() for d in tconn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)], [])
        finally:
            tconn.close()
        rec = self.record(source, r.migration_uid, phases=("Failed",))
        self.assertIn(target, rec["reason"])
        # The target agent back; the next block migration works. The source agent may still
        # hold the peer unhealthy for a moment: then it goes KubeVirt's own way.
        self.kv.start(target)
        r2 = self.migrate(parallel=8, tls=True, target_paused=True, timeout=180)
        self.assertGuestContinuedOnTarget(r2)
        self.assertBlockMigrated(r2, require_equal_memory=False)
        rec2 = self.record(source, r2.migration_uid)
        self.assertEqual(rec2["phase"], "Succeeded" if rec2["carried"] else "NotCarried", rec2)
        self.assertConnectionsAsKubevirtMakesThem(r2, 8, True, carried=rec2["carried"], block=1)
        if rec2["carried"]:
            self.assertEqual(rec2["connections"], 10, rec2)
        print("[kubevirt+rdmig block] next block migration: carried %s (%s), disk equal %s, memory equal %s"
              % (rec2["carried"], rec2.get("reason"), r2.disk["equal"], r2.memory["equal"]), file=sys.stderr)

    def test_block_killed_target_agent_while_disks_copy_source_keeps_vm(self):
        self._kill_target_agent_when("disk")

    def test_block_killed_target_agent_while_memory_moves_source_keeps_vm(self):
        self._kill_target_agent_when("memory")


class KubevirtPostCopyTest(base.KubevirtChecks, unittest.TestCase):
    """kubevirt.carryPostCopy (docs/kubevirt.md "Post-copy"): a migration KubeVirt allows to
    switch to post-copy (allowPostCopy), carried by the agents with failover on, libvirt's switch
    made as KubeVirt's launcher makes it (MigrateStartPostCopy). After the switch the guest runs
    on the target and pulls its missing pages through the agents, so no dump can be compared:
    the guest's memory verifier (tools/guest/verify.c) checks every page against its own
    description, before, during and after, and must find no mismatch. The trixie row only
    (libvirt 11, QEMU 10, non-root launchers, as KubeVirt 1.9 ships); one connection, since
    QEMU 10.0 refuses multifd together with post-copy (10.1 lifts it: KubevirtPostCopyMultifdTest)."""
    cluster = None
    uffd_before = None
    LAUNCHER_QEMU = None  # the trixie root's QEMU 10.0 (KubevirtPostCopyMultifdTest: 11.1)
    setUp = KubevirtMigrationTest.setUp
    tearDown = KubevirtMigrationTest.tearDown
    record = KubevirtMigrationTest.record
    migrate = KubevirtMigrationTest.migrate
    restart_agents = KubevirtMigrationTest.restart_agents

    @classmethod
    def tearDownClass(cls):
        try:
            KubevirtMigrationTest.__dict__["tearDownClass"].__func__(cls)
        finally:
            if getattr(cls, "uffd_before", None) is not None:
                with open(UFFD_SYSCTL, "w") as f:
                    f.write(cls.uffd_before)

    @classmethod
    def setUpClass(cls):
        reason = base.missing_prereq()
        if reason:
            raise unittest.SkipTest(reason)
        if ROOT_ROW:
            raise unittest.SkipTest("post-copy runs on the trixie row (kubevirt_migration): libvirt 11 and QEMU 10 as "
                                    "KubeVirt 1.9 ships them")
        from rdmiglab.kubevirt import KubevirtCluster
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-kvpc-")
        cls.kv = None
        # The node prerequisite of KubeVirt's non-root post-copy (docs/kubevirt.md "Post-copy"):
        # QEMU as uid 107 without capabilities may handle kernel page faults only with
        # vm.unprivileged_userfaultfd = 1 (else libvirt fails with "Postcopy is not supported:
        # Userfaultfd not available: Operation not permitted", with or without rdmig). Set for
        # this class, restored after it.
        cls.cluster = KubevirtCluster(launcher_qemu=cls.LAUNCHER_QEMU).__enter__()
        try:
            with open(UFFD_SYSCTL) as f:
                cls.uffd_before = f.read().strip()
            with open(UFFD_SYSCTL, "w") as f:
                f.write("1")
            cls.kv = KubevirtAgents(cls.tmp, NODES, profile="chart", data_plane={"failover": "on"},
                                    kubevirt={"carryPostCopy": True})
            cls.agents = cls.kv.agents
            # 64 MiB of self-describing pages rewritten at 16 MiB/s: the first pass never catches
            # up with all of it, and after the switch the target faults on pages it lacks.
            cls.cluster.define_and_start_vmi("pcvm", "default", mem_mib=base.MEM_MIB, dirty_mib=0,
                                             boot_counter=2, verify_mib=64, verify_rate_mib=16)
            cls.cluster.wait_for_verifier(cls.cluster.vmi.node, 2, min_scans=1, timeout=120)
        except BaseException:
            cls.tearDownClass()
            raise

    def postcopy_migrate(self, parallel=0, **kw):
        self.cluster.migration_config_overrides = {"allowPostCopy": True}
        before = self.cluster.verifier(self.cluster.vmi.node)
        self.assertEqual(before["mismatches"], 0, before)
        r = self.migrate(parallel=parallel, tls=True, postcopy=True, **kw)
        print("\n[kubevirt+rdmig post-copy] %s postcopy %s; source job: postcopy requests %s, total %s ms, "
              "downtime %s ms" % (json.dumps(r.summary(), sort_keys=True), r.postcopy,
                                  (r.source_job or {}).get("memory_postcopy_requests"),
                                  (r.source_job or {}).get("time_elapsed"), (r.source_job or {}).get("downtime")),
              file=sys.stderr)
        self.assertTrue(r.success, r.error)
        self.assertTrue(r.postcopy["switched"], "libvirt did not switch to post-copy: %s" % r.postcopy)
        self.assertEqual(self.cluster.vmi.node, r.target_node)
        return r, before

    def assertVerifierWentOnClean(self, r, before):
        # The counters live in guest memory: on the target they go on from the source's, and a
        # full scan after the move checks every page the target pulled or received.
        after = self.cluster.wait_for_verifier(r.target_node, before["counter"] + 3, min_scans=before["scans"] + 2,
                                               timeout=120)
        print("[kubevirt+rdmig post-copy] verifier before %s after %s" % (before, after), file=sys.stderr)
        self.assertEqual(after["mismatches"], 0, after)
        self.assertEqual(after["mismatch_lines"], [], after)

    def assertCarriedPostCopy(self, r):
        src = self.record(r.source_node, r.migration_uid)
        dst = self.record(r.target_node, r.migration_uid)
        print("[kubevirt+rdmig post-copy] source record: %s" % json.dumps(src, sort_keys=True), file=sys.stderr)
        self.assertTrue(src["carried"], src)
        self.assertEqual(src["phase"], "Succeeded", src)
        self.assertEqual(dst["phase"], "Succeeded", dst)
        self.assertTrue(src["failover"]["enabled"], src)
        pc = src["postCopy"]
        self.assertIsNotNone(pc, src)
        self.assertTrue(pc["allowed"], pc)
        self.assertTrue(pc["switched"], "the source agent did not see libvirt's switch: %s" % pc)
        self.assertGreater(pc["switchedAtMs"], src["startedAtMs"], pc)
        self.assertLessEqual(pc["switchedAtMs"], src["finishedAtMs"], pc)
        # Every memory byte both ways went through the agents: the stream, and after the switch
        # the target's page requests on the return path.
        mem = [c for c in r.proxy_logs["source"]["connections"] if c["class"] == 49152]
        self.assertEqual(src["bytesSent"], sum(c["dialed"]["tx_bytes"] for c in mem))
        self.assertEqual(src["bytesReceived"], sum(c["dialed"]["rx_bytes"] for c in mem))
        self.assertEqual(dst["bytesReceived"], src["bytesSent"])
        # libvirt 11.3 keeps no completed job on the target after post-copy: the source agent takes
        # the figures from its own launcher's completed job, which the harness read too.
        self.assertIsNotNone(r.source_job, "the harness read no completed job on the source")
        self.assertIsNotNone(src["libvirt"], src)
        self.assertEqual(src["libvirt"]["downtimeMs"], r.source_job["downtime"])
        self.assertEqual(src["libvirt"]["totalTimeMs"], r.source_job["time_elapsed"])
        self.assertEqual(pc["pageRequests"], r.source_job["memory_postcopy_requests"])
        self.assertGreater(pc["pageRequests"], 0, "the target pulled no page: no post-copy phase to speak of")
        from rdmiglab.agent import parse_prometheus
        m = parse_prometheus(self.agents[r.source_node].metrics())[0]
        self.assertGreaterEqual(sum(v for (name, labels), v in m.items() if name == "rdmig_postcopy_switches_total"
                                    and ("trigger", "kubevirt") in labels), 1)
        self.assertGreaterEqual(sum(v for (name, labels), v in m.items()
                                    if name == "rdmig_postcopy_page_requests_total"), pc["pageRequests"])
        return src, dst

    def test_a_post_copy_migration_is_carried_libvirt_switches_and_the_verifier_stays_clean(self):
        r, before = self.postcopy_migrate()
        src, _ = self.assertCarriedPostCopy(r)
        self.assertVerifierWentOnClean(r, before)
        self.assertEqual(src["failover"]["failovers"], 0, src)

    def test_data_channels_reset_after_the_switch_fail_over_and_the_migration_completes(self):
        # After the switch the guest runs on the target: a reset that failed the session now
        # would pause the VM on both nodes. The channel is re-dialled and resumed byte-exact
        # instead; the target's vCPUs wait on their page requests meanwhile.
        from rdmiglab import linkcut
        source = self.cluster.vmi.node
        target = NODES[1 - NODES.index(source)]
        cuts = {"n": 0, "switched_seen": False}

        def reset_after_the_switch(ctx):
            def run():
                def switched():
                    items = self.agents[source].call("GET", "/v1/kubevirt/migrations?migrationUid=" + ctx.migration_uid)
                    return [i for i in items["items"] if (i.get("postCopy") or {}).get("switched")
                            and i["phase"] == "Carrying"]
                try:
                    wait_for(switched, 60, "the source agent to see the switch", interval=0.02)
                except (TimeoutError, OSError):  # OSError: the agent's API gone (a failed case's restart)
                    return
                cuts["switched_seen"] = True
                for _ in range(2):
                    cuts["n"] += linkcut.cut_data_channels(self.kv.ports[target], min_bytes=1 << 20)
                    time.sleep(0.3)  # the rounds' pace, not a wait for anything
            threading.Thread(target=run, daemon=True).start()

        # The background copy after the switch held to 32 MiB/s, so the post-copy phase lasts seconds.
        r, before = self.postcopy_migrate(before_dial=reset_after_the_switch, postcopy_bandwidth_mib=32)
        print("[kubevirt+rdmig post-copy] %d channel reset(s) after the switch" % cuts["n"], file=sys.stderr)
        self.assertTrue(cuts["switched_seen"], "the source agent never showed the switch while carrying")
        self.assertGreaterEqual(cuts["n"], 1, "no channel was reset after the switch: the test proves nothing")
        src, dst = self.assertCarriedPostCopy(r)
        self.assertGreaterEqual(src["failover"]["failovers"], 1, src)
        self.assertVerifierWentOnClean(r, before)

    def test_a_target_agent_that_does_not_fail_over_gets_no_post_copy_migration(self):
        # The target agent runs without failover (an agent from before it, or failover off): the
        # source agent does not carry a migration that may switch, KubeVirt's own path moves it
        # (post-copy, direct), the record says why.
        source = self.cluster.vmi.node
        target = NODES[1 - NODES.index(source)]
        self.kv.data_plane = {}
        self.kv.kubevirt.pop("carryPostCopy")
        self.agents[target].stop()
        self.kv.start(target)

        def restore():
            self.kv.data_plane = {"failover": "on"}
            self.kv.kubevirt["carryPostCopy"] = True
            self.agents[target].stop()
            self.kv.start(target)
        self.addCleanup(restore)
        r, before = self.postcopy_migrate()
        rec = self.record(r.source_node, r.migration_uid)
        self.assertFalse(rec["carried"], rec)
        self.assertEqual(rec["phase"], "NotCarried", rec)
        self.assertIn("did not confirm failover", rec["reason"])
        self.assertVerifierWentOnClean(r, before)


class KubevirtPostCopyMultifdTest(KubevirtPostCopyTest):
    """KubeVirt v1.9 moves a post-copy migration with multifd too (kubevirt#17106: the main
    connection and 8 parallel ones), which needs QEMU 10.1+ in the launchers: the non-root launchers
    here run libvirt 11.3 with trixie-backports' QEMU 11.1 (the launcher root's copy, launcher_root.py)
    instead of 10.0. KubeVirt 1.9's own launchers ship 10.0 on Debian 13; a release on a newer QEMU
    migrates like this."""
    LAUNCHER_QEMU = "backports"
    # The one-connection cases run on QEMU 10.0 above.
    test_a_post_copy_migration_is_carried_libvirt_switches_and_the_verifier_stays_clean = None
    test_data_channels_reset_after_the_switch_fail_over_and_the_migration_completes = None
    test_a_target_agent_that_does_not_fail_over_gets_no_post_copy_migration = None

    def test_a_post_copy_migration_with_8_parallel_connections_is_carried_and_the_verifier_stays_clean(self):
        r, before = self.postcopy_migrate(parallel=8)
        src, dst = self.assertCarriedPostCopy(r)
        self.assertVerifierWentOnClean(r, before)
        # Every connection QEMU made went through the agents (assertCarriedPostCopy counts their bytes):
        # the main one (QEMU's file magic), the 8 multifd ones (multifd's magic), and the postcopy-preempt
        # one, which libvirt turns on where QEMU has it and QEMU opens at the switch, after the others.
        mem = sorted((c for c in r.proxy_logs["source"]["connections"] if c["class"] == 49152),
                     key=lambda c: c["accept_index"])
        heads = [c["accepted"].get("rx_head", "")[:8] for c in mem]
        self.assertEqual(heads[0], "5145564d", heads)  # "QEVM"
        self.assertEqual(heads[1:9], ["11223344"] * 8, heads)
        self.assertLessEqual(len(mem), 10, heads)
        if len(mem) == 10:
            self.assertNotIn(heads[9], ("5145564d", "11223344"), heads)
        print("[kubevirt+rdmig post-copy, 8 parallel] source record: %s" % json.dumps(src, sort_keys=True), file=sys.stderr)


if __name__ == "__main__":
    base._reexec_with_system_python()
    timed.main()
