#!/usr/bin/env python3
"""Baseline QEMU-to-QEMU migration over a unix socket (no rdmig involved): the control for every
byte-exact row that runs through the agents.

Source: 256 MiB guest dirtying 16 MiB per iteration (see MEM_MIB below). Target: -incoming defer -S, so it
stays paused after the migration and both memories can be compared byte for byte.

Two QEMUs: Debian 13's QEMU 10.0 (run from the cached launcher root, rdmiglab.qemu.trixie_qemu), on
which the bare-QEMU byte-exact rows through the agents run, in each shape they use (no multifd, 4
multifd channels) and in the shape where the host's QEMU 7.2 left pages different even directly (2
multifd channels and a 24 MiB/s cap). And the host's QEMU 7.2 without multifd, the shape of
test_agent_migration.py's 7.2 row: 7.2 is not byte-exact even here (seen on 2026-12-04: the digests
differed in this row with nothing but QEMU on the path), so this row checks that the migration
completes and the guest continues, and prints how many pages differ; memory equality is required
on QEMU 10 only.
Run from the repository root:  python3 tests/integration/test_direct_migration.py -v
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

from rdmiglab import QemuVm, ensure_guest, migrate_direct  # noqa: E402
from rdmiglab.qemu import differing_pages, guest_fate, qemu_version, trixie_qemu  # noqa: E402
from rdmiglab import timed  # noqa: E402

MEM_MIB = 256
# 256 MiB dirtying 16 MiB/s: a 512 MiB guest dirtying 64 MiB/s under QEMU 7.2 TCG (Debian
# 1:7.2+dfsg-7+deb12u18) arrived with a few differing pages (5 of 131072) on the direct
# QEMU-to-QEMU path too, and at 16 MiB/s a 512 MiB guest still did once through the agents
# (byte counts equal, stream loaded), so byte-exact checks use the size the harness of
# tests/kubevirt uses, at which no run here has differed.
DIRTY_MIB = 16


class DirectMigrationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if shutil.which("qemu-system-x86_64") is None:
            raise unittest.SkipTest("qemu-system-x86_64 not installed")
        cls.kernel, cls.initrd = ensure_guest()
        cls.qemu10 = trixie_qemu()
        assert qemu_version(*cls.qemu10)[0] >= 10, "the launcher root's QEMU is not 10.x"

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="rdmig-direct-")
        self.vms = []

    def tearDown(self):
        for vm in self.vms:
            try:
                vm.stop(timeout=5)
            except Exception:
                vm.kill()
        if os.environ.get("RDMIG_KEEP_TMP"):
            print("kept %s" % self.tmp, file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _vm(self, name, qemu10=True, **kw):
        if qemu10:
            kw.update(qemu_binary=self.qemu10[0], env=self.qemu10[1])
        else:
            kw.setdefault("qemu_binary", "qemu-system-x86_64")  # the host's 7.2, whatever the default
        vm = QemuVm(self.tmp, name=name, mem_mib=MEM_MIB, kernel=self.kernel,
                    initrd=self.initrd, start=False, **kw)
        self.vms.append(vm)
        vm.start()
        return vm

    def _migrate_and_check(self, channels, qemu10=True, **migrate_kw):
        src = self._vm("src", qemu10, dirty_mib=DIRTY_MIB, interval=1)
        dst = self._vm("dst", qemu10, dirty_mib=DIRTY_MIB, interval=1,
                       incoming_defer=True, paused=True)
        self.assertEqual(dst.status(), "inmigrate")
        # Guest is up and has dirtied memory at least twice.
        src.wait_for_counter(2, timeout=120)

        res = migrate_direct(src, dst, multifd_channels=channels, timeout=300, **migrate_kw)
        report = {k: v for k, v in res.items() if k not in ("source_info", "ram")}
        report["ram_mbps"] = res["ram"].get("mbps")
        report["dirty_sync_count"] = res["ram"].get("dirty-sync-count")
        print("\n[direct qemu %s channels=%d] %s" % ("10" if qemu10 else "7.2", channels,
                                                     json.dumps(report, sort_keys=True)),
              file=sys.stderr)
        self.assertEqual(res["status"], "completed", res.get("error"))
        self.assertEqual(res["target_status"], "paused")
        self.assertEqual(dst.status(), "paused")
        self.assertEqual(src.status(), "postmigrate")

        src_last = src.last_counter()
        self.assertIsNotNone(src_last)
        diff = []
        if qemu10:
            self.assertEqual(src.memory_digest(), dst.memory_digest(), "guest memory differs after migration")
        else:
            diff = differing_pages(src, dst)
            print("[direct qemu 7.2] %d pages differ%s" % (len(diff), (": %s" % diff[:16]) if diff else ""),
                  file=sys.stderr)

        dst.cont()
        if diff:
            # QEMU 7.2's TCG itself left the target's memory different (no rdmig in this path): the
            # guest may crash on it (seen once: 23 pages, the guest gone). Reported, not required.
            print("[direct qemu 7.2] guest after the move: %s" % guest_fate(dst, src_last), file=sys.stderr)
            return
        self.assertEqual(dst.wait_for_status("running", timeout=10), "running")
        got = dst.wait_for_counter(src_last + 1, timeout=120)
        self.assertGreater(got, src_last)

    def test_direct_no_multifd(self):
        self._migrate_and_check(0)

    def test_direct_multifd_4(self):
        self._migrate_and_check(4)

    def test_direct_multifd_2_with_a_bandwidth_cap(self):
        # The shape in which QEMU 7.2 left 4-15 pages different on this path in 3 of 3 runs.
        self._migrate_and_check(2, max_bandwidth=24 << 20)

    def test_direct_no_multifd_on_the_hosts_qemu_7_2(self):
        self._migrate_and_check(0, qemu10=False)


if __name__ == "__main__":
    timed.main()
