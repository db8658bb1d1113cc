"""Processes killed (SIGKILL) or frozen (SIGSTOP) mid-migration (issue 11): either agent and the
source QEMU, while a real guest migrates through two real agents; and either agent sent SIGTERM
mid-migration (issue 42): it drains, the migration succeeds, a second signal or the end of
shutdownGraceSeconds cancels. Each case ends with the
surviving agents serving, a failure that names its cause, and the VM running in exactly one
place (or, when its own QEMU was killed, nowhere twice). The target QEMU killed mid-migration is
in test_agent_migration.py.

Run from the repository root after building:
    python3 tests/integration/test_agent_faults.py -v      (ctest -R integration_agent_faults)
"""
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from rdmiglab import Agent, QemuVm, ensure_guest, start_migration  # noqa: E402
from rdmiglab import timed  # noqa: E402

MEM_MIB = 256
DIRTY_MIB = 8


class AgentFaultsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ensure_guest()

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="rdmig-faults-")
        self.src_agent = Agent(self.tmp, "src-agent", log_level="debug")
        self.dst_agent = Agent(self.tmp, "dst-agent", log_level="debug")
        self.vms = []
        self.frozen = []

    def tearDown(self):
        for pid in self.frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        for vm in self.vms:
            vm.kill()
        failed = any(e for _, e in (self._outcome.result.errors + self._outcome.result.failures)
                     if _ is self) if hasattr(self._outcome, "result") else False
        for a in (self.src_agent, self.dst_agent):
            if failed:
                print("---- %s log (tail) ----\n%s" % (a.name, a.log_text()[-3000:]))
            a.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def migrating(self, bandwidth=8 << 20, **options):
        """A throttled migration (8 MiB/s: it cannot converge against the guest's 8 MiB/s of dirty
        memory, so it is still running when we act), in Migrating with a few MiB moved."""
        src = QemuVm(self.tmp, "src", mem_mib=MEM_MIB, dirty_mib=DIRTY_MIB)
        dst = QemuVm(self.tmp, "dst", mem_mib=MEM_MIB, dirty_mib=DIRTY_MIB, incoming_defer=True)
        self.vms += [src, dst]
        src.wait_for_counter(2, timeout=90)
        target, source = start_migration(self.src_agent, self.dst_agent, src.agent_qmp_path, dst.agent_qmp_path,
                                          vm="vm-faults", maxBandwidthBytesPerSecond=bandwidth, **options)
        deadline = time.monotonic() + 60
        while self.src_agent.get(source["id"])["progress"]["transferredBytes"] < (4 << 20):
            self.assertLess(time.monotonic(), deadline, "migration made no progress")
            time.sleep(0.1)
        self.assertEqual(self.src_agent.get(source["id"])["phase"], "Migrating")
        return src, dst, target, source

    def freeze(self, pid):
        os.kill(pid, signal.SIGSTOP)
        self.frozen.append(pid)

    def thaw(self, pid):
        os.kill(pid, signal.SIGCONT)
        self.frozen.remove(pid)

    def assert_runs_in_one_place(self, src, dst, expect):
        running = [name for name, vm in (("source", src), ("target", dst)) if vm.runs()]
        self.assertEqual(running, [expect], "the VM must run in exactly one place")

    def assert_serving(self, *agents):
        for a in agents:
            self.assertTrue(a.alive(), "%s died" % a.name)
            self.assertEqual(a.request("GET", "/v1/migrations")[0], 200)

    def report(self, case, s=None, t=None):
        print("\n[faults] %s: source %s (%s); target %s (%s)" % (
            case, s and s["phase"], s and s["result"]["reason"], t and t["phase"], t and t["result"]["reason"]),
            file=sys.stderr)

    def test_target_agent_killed(self):
        src, dst, target, source = self.migrating()
        before = src.last_counter()
        self.dst_agent.proc.kill()
        s = self.src_agent.wait(source["id"], timeout=90)
        self.report("target agent SIGKILL", s)
        self.assertEqual(s["phase"], "Failed")
        self.assertIn(s["result"]["failureKind"], ("peer_lost", "io", "qemu"))
        src.wait_for_counter(before + 1, timeout=60)
        self.assert_runs_in_one_place(src, dst, "source")
        self.assert_serving(self.src_agent)

    def test_source_agent_killed(self):
        src, dst, target, source = self.migrating()
        before = src.last_counter()
        self.src_agent.proc.kill()
        t = self.dst_agent.wait(target["id"], timeout=90)
        self.report("source agent SIGKILL", t=t)
        self.assertEqual(t["phase"], "Failed")
        self.assertIn("the source agent went away", t["result"]["reason"])  # not "target QEMU" first
        # The source QEMU's migration broke with the agent's socket: it keeps the VM.
        deadline = time.monotonic() + 60
        while src.status() != "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        src.wait_for_counter(before + 1, timeout=60)
        self.assert_runs_in_one_place(src, dst, "source")
        self.assert_serving(self.dst_agent)

    def test_target_agent_frozen_fails_on_no_progress_and_recovers(self):
        src, dst, target, source = self.migrating(noProgressTimeoutSeconds=10)
        before = src.last_counter()
        self.freeze(self.dst_agent.proc.pid)
        t0 = time.monotonic()
        s = self.src_agent.wait(source["id"], timeout=120)
        took = time.monotonic() - t0
        self.report("target agent SIGSTOP (%.1f s)" % took, s)
        self.assertEqual(s["phase"], "Failed")
        self.assertLess(took, 60, "a frozen peer must not hold the migration for the completion timeout")
        src.wait_for_counter(before + 1, timeout=60)
        self.thaw(self.dst_agent.proc.pid)
        t = self.dst_agent.wait(target["id"], timeout=60)
        self.report("target agent thawed", t=t)
        self.assertIn(t["phase"], ("Failed", "Cancelled"))
        self.assert_runs_in_one_place(src, dst, "source")
        self.assert_serving(self.src_agent, self.dst_agent)

    def test_source_agent_frozen_target_fails_on_no_progress_and_the_vm_stays_on_the_source(self):
        # The target has a no-progress deadline of its own: a frozen source agent no longer holds
        # the target QEMU and a slot until completionTimeoutSeconds (before: Migrating for 10 min).
        src, dst, target, source = self.migrating(target_options={"noProgressTimeoutSeconds": 8})
        before = src.last_counter()
        self.freeze(self.src_agent.proc.pid)
        t0 = time.monotonic()
        t = self.dst_agent.wait(target["id"], timeout=120)
        took = time.monotonic() - t0
        self.report("source agent SIGSTOP (%.1f s)" % took, t=t)
        self.assertEqual(t["phase"], "Failed", t)
        self.assertIn("noProgressTimeoutSeconds", t["result"]["reason"])
        self.assertLess(took, 30, "the target must not wait for the completion timeout")
        self.thaw(self.src_agent.proc.pid)
        s = self.src_agent.wait(source["id"], timeout=90)
        self.report("source agent thawed", s)
        self.assertEqual(s["phase"], "Failed", s)
        src.wait_for_counter(before + 1, timeout=60)
        self.assert_runs_in_one_place(src, dst, "source")
        self.assert_serving(self.src_agent, self.dst_agent)

    def test_source_agent_frozen_briefly_the_migration_still_completes(self):
        # A few seconds of a stopped agent (CPU starvation, a debugger) is not a failure.
        src, dst, target, source = self.migrating(bandwidth=48 << 20)  # converges in seconds
        self.freeze(self.src_agent.proc.pid)
        time.sleep(5)
        self.thaw(self.src_agent.proc.pid)
        s = self.src_agent.wait(source["id"], timeout=240)
        t = self.dst_agent.wait(target["id"], timeout=60)
        self.report("source agent SIGSTOP 5 s", s, t)
        self.assertEqual((s["phase"], t["phase"]), ("Succeeded", "Succeeded"))
        self.assert_runs_in_one_place(src, dst, "target")
        self.assert_serving(self.src_agent, self.dst_agent)

    # -- SIGTERM: the agent drains (issue 42; docs/deploy.md "Stopping an agent") -----------
    def assert_draining(self, agent):
        """Right after its SIGTERM: not ready, and new work refused with 503, Retry-After and
        the reason AgentDraining; what already runs is not touched by asking."""
        def readyz():
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/readyz" % agent.probe_port, timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code
        deadline = time.monotonic() + 10
        while readyz() != 503:
            self.assertLess(time.monotonic(), deadline, "readiness did not turn false")
            time.sleep(0.05)
        body = json.dumps({"role": "target", "qmpSocket": "/nonexistent.qmp", "vm": "late"}).encode()
        req = urllib.request.Request(agent.url + "/v1/migrations", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer " + agent.token})
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen(req, timeout=10)
        self.assertEqual(cm.exception.code, 503)
        self.assertEqual(cm.exception.headers.get("Retry-After"), "30")
        err = json.loads(cm.exception.read())["error"]
        self.assertEqual((err["code"], err.get("reason")), ("unavailable", "AgentDraining"), err)
        self.assertIn("agent draining", err["message"])
        code, body = agent.request("POST", "/v1/pathchecks", {"role": "target", "bytes": "8Mi"})
        self.assertEqual(code, 503, body)
        self.assertIn("agent draining", body["error"]["message"])

    def drained_and_succeeded(self, signalled, other, src, dst, target, source):
        last = src.last_counter()
        t0 = time.monotonic()
        signalled.proc.send_signal(signal.SIGTERM)
        self.assert_draining(signalled)
        # The other agent's record; the signalled one exits once nothing runs (its log says how
        # its side ended).
        mine, theirs = (source, target) if signalled is self.src_agent else (target, source)
        st = other.wait(theirs["id"], timeout=120)
        self.report("%s SIGTERM mid-migration (drained)" % signalled.name,
                    *((None, st) if signalled is self.src_agent else (st, None)))
        self.assertEqual(st["phase"], "Succeeded", st)
        # Nothing runs any more: the signalled agent exits by itself, well within its grace.
        signalled.proc.wait(timeout=60)
        self.assertEqual(signalled.proc.returncode, 0)
        log = signalled.log_text()
        self.assertIn("migration=%s role=%s vm=vm-faults phase=Succeeded" % (
            mine["id"], "source" if signalled is self.src_agent else "target"), log)
        self.assertIn("drained: nothing runs any more", log)
        print("[faults] %s exited %.1fs after its SIGTERM" % (signalled.name, time.monotonic() - t0), file=sys.stderr)
        self.assertGreater(dst.wait_for_counter(last + 1, timeout=90), last)
        self.assert_runs_in_one_place(src, dst, "target")
        self.assert_serving(other)

    def test_sigterm_to_the_source_agent_lets_the_running_migration_finish(self):
        # 48 MiB/s against 8 MiB/s of dirtying: converges in seconds, still running at the signal.
        src, dst, target, source = self.migrating(bandwidth=48 << 20)
        self.drained_and_succeeded(self.src_agent, self.dst_agent, src, dst, target, source)

    def test_sigterm_to_the_target_agent_lets_the_running_migration_finish(self):
        src, dst, target, source = self.migrating(bandwidth=48 << 20)
        self.drained_and_succeeded(self.dst_agent, self.src_agent, src, dst, target, source)

    def test_drain_time_running_out_cancels_and_the_vm_stays_on_the_source(self):
        self.src_agent.stop()
        self.src_agent = Agent(self.tmp, "src-agent-grace", log_level="debug", config={"shutdownGraceSeconds": 3})
        src, dst, target, source = self.migrating()  # 8 MiB/s: never converges
        before = src.last_counter()
        t0 = time.monotonic()
        self.src_agent.proc.send_signal(signal.SIGTERM)
        self.assert_draining(self.src_agent)
        self.src_agent.proc.wait(timeout=30)
        took = time.monotonic() - t0
        self.assertGreaterEqual(took, 3.0, "the drain lasts shutdownGraceSeconds")
        self.assertIn("drain time (shutdownGraceSeconds) ran out", self.src_agent.log_text())
        self.cancelled_vm_on_source("source agent SIGTERM, grace 3 s ran out (exited after %.1fs)" % took,
                                    src, dst, target, before)
        self.assert_serving(self.dst_agent)

    def test_a_second_sigterm_cancels_at_once(self):
        src, dst, target, source = self.migrating()  # never converges; the grace is 300 s
        before = src.last_counter()
        self.src_agent.proc.send_signal(signal.SIGTERM)
        self.assert_draining(self.src_agent)
        t0 = time.monotonic()
        self.src_agent.proc.send_signal(signal.SIGTERM)
        self.src_agent.proc.wait(timeout=30)
        took = time.monotonic() - t0
        self.assertLess(took, 15.0, "the second signal must not wait for the drain")
        self.assertIn("while draining: cancelling what still runs now", self.src_agent.log_text())
        self.cancelled_vm_on_source("source agent SIGTERM twice (exited %.1fs after the second)" % took,
                                    src, dst, target, before)

    def cancelled_vm_on_source(self, case, src, dst, target, before):
        """The source agent cancelled on its way out: the target's side failed, the source QEMU
        resumed the guest, which runs there and only there."""
        t = self.dst_agent.wait(target["id"], timeout=90)
        self.report(case, t=t)
        self.assertEqual(t["phase"], "Failed")
        deadline = time.monotonic() + 60
        while src.status() != "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        src.wait_for_counter(before + 1, timeout=60)
        self.assert_runs_in_one_place(src, dst, "source")

    def test_source_qemu_killed(self):
        src, dst, target, source = self.migrating()
        src.kill()
        s = self.src_agent.wait(source["id"], timeout=90)
        t = self.dst_agent.wait(target["id"], timeout=90)
        self.report("source QEMU SIGKILL", s, t)
        self.assertEqual(s["phase"], "Failed")
        self.assertIn("QEMU", s["result"]["reason"])
        # Not "left paused": the source QEMU is gone, so no operator should look for a paused VM.
        self.assertEqual(s["result"]["failureKind"], "qemu", s["result"]["reason"])
        self.assertIn("no VM can be resumed here", s["result"]["reason"])
        self.assertRegex(s["result"]["reason"], r"its process \d+ (has exited|still runs)",
                         "the reason names the source QEMU's process state")
        self.assertEqual(t["phase"], "Failed")
        # The VM's own process is gone: it must not appear on the target either.
        self.assertFalse(dst.runs(), "a half-migrated VM must not run")
        self.assert_serving(self.src_agent, self.dst_agent)


if __name__ == "__main__":
    timed.main(verbosity=2)
