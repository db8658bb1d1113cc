"""The Soft-RoCE VMs' guard against their kernel's rxe (tests/rdma/console-watch.awk, run-in-vm.sh,
run-two-vms.sh), without a VM: the watcher over real and edited console text, and run-two-vms.sh's
pair logic over a stand-in for run-in-vm.sh (RDMIG_RUN_IN_VM) whose nodes exit as each case plans.

The real console is whole run W35's (2026-12-07): node b's Debian 13 6.12 kernel, a double fault in
rxe_receiver's skb allocation during the KubeVirt rail-cut cases (fixtures/rxe-double-fault.console).
"""
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
WATCH = os.path.join(HERE, "console-watch.awk")
RUN_TWO_VMS = os.path.join(HERE, "run-two-vms.sh")
with open(os.path.join(HERE, "fixtures", "rxe-double-fault.console")) as f:
    RXE_PANIC = f.read()
# The same console split: the rxe oops, and the "Kernel panic - not syncing" line after it.
RXE_OOPS = "".join(line for line in RXE_PANIC.splitlines(True) if "Kernel panic" not in line)
PANIC_LINE = "".join(line for line in RXE_PANIC.splitlines(True) if "Kernel panic" in line)
# The kernel's own format (kernel/watchdog.c: "BUG: soft lockup - CPU#%d stuck for %us! [%s:%d]").
SOFT_LOCKUP = "[  312.001122] watchdog: BUG: soft lockup - CPU#1 stuck for 26s! [ksoftirqd/1:22]\n"


def watch(text, pidfile=""):
    """Runs the watcher over `text`: (what it passed on, its stderr, the reason file or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        lk = os.path.join(tmp, "lockup")
        r = subprocess.run(["mawk", "-W", "interactive", "-v", "lk=" + lk, "-v", "pf=" + pidfile, "-f", WATCH],
                           input=text, capture_output=True, text=True, timeout=30, check=True)
        if not os.path.exists(lk):
            return r.stdout, r.stderr, None
        with open(lk) as f:
            return r.stdout, r.stderr, f.read().strip()


class ConsoleWatchTest(unittest.TestCase):
    def test_a_kernel_panic_in_rdma_rxe_is_named_and_every_line_passes(self):
        out, err, reason = watch(RXE_PANIC)
        self.assertEqual(reason, "a kernel panic in rdma_rxe")
        self.assertIn("the VM's kernel reports a kernel panic in rdma_rxe: stopping it", err)
        self.assertEqual(out, RXE_PANIC)

    def test_a_soft_lockup_is_named(self):
        out, _, reason = watch("booting\n" + SOFT_LOCKUP + "more\n")
        self.assertEqual(reason, "a soft lockup")
        self.assertEqual(out, "booting\n" + SOFT_LOCKUP + "more\n")

    def test_a_panic_without_rxe_frames_is_the_scripts_result(self):
        _, err, reason = watch(RXE_PANIC.replace("[rdma_rxe]", "[virtio_net]"))
        self.assertIsNone(reason)
        self.assertEqual(err, "")

    def test_an_rxe_oops_that_does_not_panic_is_left_alone(self):
        self.assertIsNone(watch(RXE_OOPS)[2])

    def test_a_later_oops_elsewhere_that_panics_is_not_blamed_on_rxe(self):
        other = ("[  140.000001] BUG: kernel NULL pointer dereference, address: 0000000000000008\n"
                 "[  140.000002] Call Trace:\n[  140.000003]  virtnet_poll+0x10/0x20 [virtio_net]\n")
        self.assertIsNone(watch(RXE_OOPS + other + PANIC_LINE)[2])

    def test_a_6_1_kernel_bug_in_rxe_that_panics_is_named(self):
        # Debian 12's 6.1 starts a BUG_ON's report with "kernel BUG at" and "invalid opcode:" (a
        # made-up report in that shape).
        text = ("[   88.100001] kernel BUG at drivers/infiniband/sw/rxe/rxe_task.c:120!\n"
                "[   88.100002] invalid opcode: 0000 [#1] PREEMPT SMP NOPTI\n"
                "[   88.100003] Call Trace:\n"
                "[   88.100004]  rxe_run_task+0x2a/0x40 [rdma_rxe]\n"
                "[   88.100005] Kernel panic - not syncing: Fatal exception in interrupt\n")
        self.assertEqual(watch(text)[2], "a kernel panic in rdma_rxe")

    def test_it_stops_qemu_once(self):
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            with tempfile.TemporaryDirectory() as tmp:
                pf = os.path.join(tmp, "qemu.pid")
                with open(pf, "w") as f:
                    f.write("%d\n" % sleeper.pid)
                _, err, reason = watch(SOFT_LOCKUP + RXE_PANIC, pidfile=pf)
            self.assertEqual(reason, "a soft lockup")
            self.assertEqual(err.count("stopping it"), 1)
            self.assertEqual(sleeper.wait(timeout=10), -15)
        finally:
            sleeper.kill()
            sleeper.wait()


# A stand-in for run-in-vm.sh: --build-only succeeds; a node opens its link sockets (node a serves
# them, as its QEMU does) and then does what line <boot> of $PLAN_DIR/<node>.plan says: "rxe" (its
# kernel's rxe failed: the reason in its fault file, exit 123, as run-in-vm.sh does), an exit
# status (the script's own), or "sleep" (a script still running until the pair is stopped).
FAKE_RUNNER = textwrap.dedent("""\
    #!/usr/bin/env bash
    node="" links=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --build-only) exit 0 ;;
        --node) node="$2"; shift 2 ;;
        --fault-file) fault="$2"; shift 2 ;;
        --qemu-arg) case "$2" in stream,*server=on*) links+=("${2##*addr.path=}") ;; esac; shift 2 ;;
        --) break ;;
        *) shift ;;
      esac
    done
    for l in ${links[@]+"${links[@]}"}; do
      python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$l"
    done
    n=$(( $(cat "$PLAN_DIR/$node.count" 2>/dev/null || echo 0) + 1 ))
    echo "$n" >"$PLAN_DIR/$node.count"
    what="$(sed -n "${n}p" "$PLAN_DIR/$node.plan")"
    echo "node $node boot $n: $what"
    if [ "$what" = sleep ]; then sleep 300; exit 0; fi
    if [ "$what" = sleep1 ]; then sleep 1; what=rxe; fi
    if [ "$what" = rxe ]; then echo "a kernel panic in rdma_rxe" >"$fault"; exit 123; fi
    exit "$what"
    """)


class PairRebootTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="rdmig-pair-")
        self.runner = os.path.join(self.tmp, "fake-run-in-vm.sh")
        with open(self.runner, "w") as f:
            f.write(FAKE_RUNNER)
        os.chmod(self.runner, 0o755)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def pair(self, plan_a, plan_b, rails=1):
        for node, plan in (("a", plan_a), ("b", plan_b)):
            with open(os.path.join(self.tmp, node + ".plan"), "w") as f:
                f.write("\n".join(plan) + "\n")
        env = dict(os.environ, RDMIG_RUN_IN_VM=self.runner, PLAN_DIR=self.tmp, TMPDIR=self.tmp)
        t0 = time.monotonic()
        r = subprocess.run(["bash", RUN_TWO_VMS, "--rails", str(rails), "--", "/bin/true"], env=env,
                           capture_output=True, text=True, timeout=120)
        boots = {}
        for n in "ab":
            with open(os.path.join(self.tmp, n + ".count")) as f:
                boots[n] = int(f.read())
        return r.returncode, r.stdout + r.stderr, boots, time.monotonic() - t0

    def test_a_node_whose_rxe_failed_stops_both_and_the_pair_boots_again(self):
        # Node a's script still runs when node b's kernel fails: it is stopped at once, not after
        # the 30 s grace a failed script gives its peer.
        rc, out, boots, took = self.pair(["sleep", "0"], ["rxe", "0"], rails=2)
        self.assertEqual(rc, 0, out)
        self.assertEqual(boots, {"a": 2, "b": 2})
        self.assertIn("node b's kernel's rxe failed (a kernel panic in rdma_rxe)", out)
        self.assertIn("booting both VMs again (pair 2 of at most 3", out)
        self.assertLess(took, 25, out)

    def test_both_ending_together_still_counts_the_failed_kernel(self):
        rc, out, boots, _ = self.pair(["0", "0"], ["rxe", "0"])
        self.assertEqual((rc, boots), (0, {"a": 2, "b": 2}), out)

    def test_the_other_nodes_own_failure_is_named_before_the_pair_boots_again(self):
        rc, out, boots, _ = self.pair(["7", "0"], ["sleep1", "0"])
        self.assertEqual((rc, boots), (0, {"a": 2, "b": 2}), out)
        # Whether run-two-vms.sh sees node b's fault in its loop or after both nodes ended, it
        # names node a's status.
        self.assertRegex(out, r"node b's kernel's rxe failed \(a kernel panic in rdma_rxe\)[^\n]*, node a had exited 7\n")

    def test_three_pairs_in_a_row_fail_the_row(self):
        rc, out, boots, _ = self.pair(["0", "0", "0"], ["rxe", "rxe", "rxe"])
        self.assertEqual(rc, 125, out)
        self.assertEqual(boots, {"a": 3, "b": 3})
        self.assertIn("rxe failed in 3 pairs in a row", out)

    def test_a_scripts_own_failure_is_not_booted_again(self):
        rc, out, boots, _ = self.pair(["0"], ["1"])
        self.assertEqual((rc, boots), (1, {"a": 1, "b": 1}), out)
        self.assertNotIn("booting both VMs again", out)

    def test_a_scripts_own_exit_status_123_is_not_taken_for_rxe(self):
        rc, out, boots, _ = self.pair(["0"], ["123"])
        self.assertEqual((rc, boots), (123, {"a": 1, "b": 1}), out)
        self.assertNotIn("booting both VMs again", out)


if __name__ == "__main__":
    unittest.main()
