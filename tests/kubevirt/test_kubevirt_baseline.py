#!/usr/bin/env python3
"""KubeVirt's own live-migration data path, without rdmig: real libvirt 9.0 peer to peer,
through the virt-handler migration-proxy stand-in (tools/rdmiglab/kvproxy.py), between two
launcher pods (mount/UTS/PID namespaces) and two handler network namespaces.

One VMI (256 MiB, dirtying 8 MiB/s) goes back and forth between the two nodes.
Needs root, libvirt-daemon-driver-qemu, python3-libvirt, python3-grpcio
(scripts/install-deps.sh --test). Run from the repository root:
    python3 tests/kubevirt/test_kubevirt_baseline.py -v
"""
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
from rdmiglab.system_python import reexec_with_system_python as _reexec_with_system_python  # noqa: E402


if __name__ == "__main__":
    _reexec_with_system_python()

from rdmiglab import kvhook  # noqa: E402

MEM_MIB = 256
# 8 MiB/s: at 16 MiB/s a guest migrated with 8 multifd connections to a running target died
# after the migration in a full CI run (KubeVirt's path without rdmig: QEMU 7.2 TCG multifd,
# the machine also busy with builds), failing every later test on this VMI.
DIRTY_MIB = 8
QEVM = "5145564d"      # QEMU_VM_FILE_MAGIC: the main migration channel starts with it
MULTIFD = "11223344"   # MULTIFD_MAGIC: each multifd channel starts with it
TLS_HANDSHAKE = "16"   # TLS record type handshake: what a TLS wire starts with


def missing_prereq():
    if os.geteuid() != 0:
        return "needs root (namespaces, libvirtd)"
    for tool in ("qemu-system-x86_64", "nsenter", "unshare", "openssl", "ip"):
        if shutil.which(tool) is None:
            return "%s not installed" % tool
    if not os.access("/usr/sbin/libvirtd", os.X_OK):
        return "libvirtd not installed (scripts/install-deps.sh --test)"
    try:
        import grpc  # noqa: F401
        import libvirt  # noqa: F401
    except ImportError as e:
        return "%s (python3-libvirt, python3-grpcio)" % e
    return None


class KubevirtChecks:
    """What KubeVirt's path must look like after a migration (shared with the rdmig tests)."""

    def _report(self, name, r):
        print("\n[kubevirt %s] %s" % (name, json.dumps(r.summary(), sort_keys=True)),
              file=sys.stderr)

    def _pairs(self, r, carried=False):
        """(source record, target record) per forwarded connection. Direct: joined on the TCP
        4-tuple (the source's dialed local address is the target's accepted peer). Carried by
        rdmig: the target proxy's peer is the target agent, so join on the class and the order
        within it, which the carrier must keep."""
        src, dst = r.proxy_logs["source"], r.proxy_logs["target"]
        self.assertIsNotNone(src)
        self.assertIsNotNone(dst)
        if carried:
            by_key = {(c["class"], c["class_index"]): c for c in dst["connections"]}
            key = lambda c: (c["class"], c["class_index"])  # noqa: E731
        else:
            by_key = {c["accepted"]["peer"]: c for c in dst["connections"]}
            key = lambda c: c["dialed"]["local"]  # noqa: E731
        pairs = []
        for c in src["connections"]:
            self.assertIsNone(c["error"], c)
            self.assertIsNotNone(c["dialed"], c)
            self.assertIn(key(c), by_key, "target never saw %s" % (key(c),))
            pairs.append((c, by_key[key(c)]))
        self.assertEqual(len(pairs), len(dst["connections"]))
        return pairs

    def assertConnectionsAsKubevirtMakesThem(self, r, parallel, tls, carried=False):
        pairs = self._pairs(r, carried)
        memory = 1 + parallel
        for role in ("source", "target"):
            conns = sorted(r.proxy_logs[role]["connections"], key=lambda c: c["index"])
            classes = [c["class"] for c in conns]
            self.assertEqual(classes.count(0), 1, "%s: one libvirt control connection" % role)
            self.assertEqual(classes.count(49152), memory, "%s: 1 main + %d multifd" % (role, parallel))
            self.assertEqual(len(classes), 1 + memory)
            self.assertEqual(classes[0], 0, "%s: libvirt's control connection comes first" % role)
            self.assertTrue(all(not c["open"] for c in conns), "%s: connections left open" % role)
        for s, t in pairs:
            self.assertEqual(s["class"], t["class"])
            # Order survives the proxies: the n-th memory connection QEMU made is the n-th
            # the target QEMU accepted.
            self.assertEqual(s["class_index"], t["class_index"])
            # Bytes: what the source QEMU/libvirt wrote is what the target read, and back.
            self.assertEqual(s["accepted"]["rx_sha256"], t["dialed"]["tx_sha256"])
            self.assertEqual(t["dialed"]["rx_sha256"], s["accepted"]["tx_sha256"])
            self.assertEqual(s["accepted"]["rx_bytes"], t["dialed"]["tx_bytes"])
            # The wire: both ends of each TCP connection saw the same bytes.
            self.assertEqual(s["dialed"]["tx_sha256"], t["accepted"]["rx_sha256"])
            self.assertEqual(t["accepted"]["tx_sha256"], s["dialed"]["rx_sha256"])
            self.assertEqual(s["dialed"]["tx_bytes"], t["accepted"]["rx_bytes"])
            if tls:
                self.assertTrue(t["accepted"]["rx_head"].startswith(TLS_HANDSHAKE), t["accepted"])
                self.assertNotEqual(s["dialed"]["tx_sha256"], s["accepted"]["rx_sha256"])
            else:
                self.assertEqual(s["dialed"]["tx_sha256"], s["accepted"]["rx_sha256"])
            if s["class"] == 49152:
                magic = QEVM if s["class_index"] == 0 else MULTIFD
                self.assertTrue(t["dialed"]["tx_head"].startswith(magic),
                                "memory connection %d should start with %s: %s"
                                % (s["class_index"], magic, t["dialed"]["tx_head"]))
        self.assertGreater(sum(s["accepted"]["rx_bytes"] for s, _ in pairs), MEM_MIB << 18,
                           "too few bytes for a %d MiB guest" % MEM_MIB)

    def assertGuestContinuedOnTarget(self, r):
        self.assertTrue(r.success, r.error)
        self.assertEqual(self.cluster.vmi.node, r.target_node)
        self.assertIsNotNone(r.counter_before)
        self.assertGreater(r.counter_after, r.counter_before)
        self.assertIsNotNone(r.downtime_ms, "no downtime in libvirt's completed job stats")
        self.assertIsNotNone(r.total_time_ms)

    def _migrate_paused_and_compare(self, name, parallel, tls, require_equal_memory):
        r = self.cluster.migrate(parallel=parallel, tls=tls, target_paused=True, timeout=120)
        self._report(name, r)
        self.assertGuestContinuedOnTarget(r)
        self.assertConnectionsAsKubevirtMakesThem(r, parallel, tls)
        self.assertIsNotNone(r.memory["source_sha256"], "source memory not read")
        if require_equal_memory:
            self.assertTrue(r.memory["equal"], "guest memory differs: %s" % r.memory)
        return r



class KubevirtBaselineTest(KubevirtChecks, unittest.TestCase):
    cluster = None

    @classmethod
    def setUpClass(cls):
        reason = missing_prereq()
        if reason:
            raise unittest.SkipTest(reason)
        from rdmiglab.kubevirt import KubevirtCluster
        cls.cluster = KubevirtCluster().__enter__()
        try:
            t0 = time.monotonic()
            cls.cluster.define_and_start_vmi("testvm", "default", mem_mib=MEM_MIB,
                                             dirty_mib=DIRTY_MIB, boot_counter=2)
            print("\n[kubevirt] pods up and guest booted in %.1fs" % (time.monotonic() - t0),
                  file=sys.stderr)
        except BaseException:
            cls.cluster.close()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.cluster is not None:
            cls.cluster.close()

    # -- tests ---------------------------------------------------------------------------
    # Memory is compared and reported, not required: a single plain connection on this path,
    # without rdmig, once arrived with differing memory in a full run on a quiet machine (QEMU
    # 7.2 TCG missing dirty pages, as tests/integration measured on the direct path); the
    # proxies' per-leg hashes prove the bytes on the wire.
    def test_tls_single_connection_forwarded_and_memory_compared(self):
        self._migrate_paused_and_compare("tls-0", 0, True, require_equal_memory=False)

    def test_disable_tls_single_connection_forwarded_and_memory_compared(self):
        self._migrate_paused_and_compare("plain-0", 0, False, require_equal_memory=False)

    def test_tls_eight_parallel_connections_forwarded_in_order_and_byte_exact(self):
        # A running target, no memory comparison: with libvirt 9.0 and QEMU 7.2 multifd, the
        # paused, memory-checked runs differed in a few bytes in most runs and sometimes left
        # a guest that died after resume (which then fails every later test on this VMI),
        # while every proxied byte is accounted for (tests/kubevirt/README.md).
        r = self.cluster.migrate(parallel=8, tls=True, timeout=120)
        self._report("tls-8", r)
        self.assertGuestContinuedOnTarget(r)
        self.assertConnectionsAsKubevirtMakesThem(r, 8, True)

    def test_disable_tls_eight_parallel_connections_over_ipv6_running_target(self):
        seen = {}

        def before_dial(ctx):  # what an rdmig agent will look for at this point
            for role in ("source", "target"):
                pid = ctx.handler_pids[role]
                with open("/proc/%d/comm" % pid) as f:
                    seen[role + "_comm"] = f.read().strip()
                seen[role + "_netns"] = (os.readlink("/proc/%d/ns/net" % pid)
                                         == "net:[%d]" % os.stat("/run/netns/" + ctx.handler_netns[role]).st_ino)
            with open("/proc/%d/cmdline" % ctx.launcher_pids["target"], "rb") as f:
                seen["monitor_cmdline"] = f.read().split(b"\0")

        r = self.cluster.migrate(parallel=8, tls=False, family="ipv6", before_dial=before_dial)
        self._report("plain-8-ipv6", r)
        self.assertIn(":", r.target_address)
        self.assertGuestContinuedOnTarget(r)
        self.assertConnectionsAsKubevirtMakesThem(r, 8, False)
        self.assertEqual(seen["source_comm"], "virt-handler")
        self.assertEqual(seen["target_comm"], "virt-handler")
        self.assertTrue(seen["source_netns"] and seen["target_netns"], seen)
        cmd = seen["monitor_cmdline"]
        self.assertTrue(any(a.endswith(b"/virt-launcher-monitor") for a in cmd), cmd)
        self.assertEqual(cmd[cmd.index(b"--uid") + 1].decode(), self.cluster.vmi.uid)
        self.assertGreater(r.downtime_ms, 0)

    def test_missing_hook_socket_with_ignore_does_not_stop_the_migration(self):
        sock = os.path.join(tempfile.gettempdir(), "rdmig-no-such-hook-%s.sock" % os.urandom(4).hex())
        t0 = time.monotonic()
        r = self.cluster.migrate(parallel=8, tls=True, hook_socket=sock, hook_timeout=3,
                                 hook_failure="Ignore")
        elapsed = time.monotonic() - t0
        self._report("hook-missing", r)
        self.assertFalse(r.hook["ok"])
        self.assertIn("dial", r.hook["error"])
        self.assertLess(r.hook["duration_s"], kvhook.CONNECT_TIMEOUT_S + 2)
        self.assertGuestContinuedOnTarget(r)
        self.assertLess(elapsed, 60)

    def test_missing_hook_socket_with_fail_keeps_the_vmi_on_the_source(self):
        sock = os.path.join(tempfile.gettempdir(), "rdmig-no-such-hook-%s.sock" % os.urandom(4).hex())
        before = self.cluster.vmi.node
        r = self.cluster.migrate(parallel=8, tls=True, hook_socket=sock, hook_timeout=3,
                                 hook_failure="Fail", expect_success=False)
        self.assertFalse(r.success)
        self.assertIn("PreMigrationSource", r.error)
        self.assertEqual(self.cluster.vmi.node, before)
        dom = self.cluster.domain(before)
        self.assertTrue(dom.isActive())
        counter = self.cluster.serial_counter(before)
        self.assertGreater(self.cluster.wait_for_counter(before, counter + 1, 30), counter)

    def test_hanging_hook_with_ignore_proceeds_after_its_timeout(self):
        tmp = tempfile.mkdtemp(prefix="rdmig-hook-")
        sock = os.path.join(tmp, "hook.sock")
        calls, release = [], threading.Event()

        def hang(request, context):
            calls.append(request)
            release.wait(60)  # longer than the hook timeout; released in cleanup

        server = kvhook.serve_node_hook(sock, hang)
        try:
            timeout = 3.0
            t0 = time.monotonic()
            r = self.cluster.migrate(parallel=8, tls=True, hook_socket=sock,
                                     hook_timeout=timeout, hook_failure="Ignore")
            elapsed = time.monotonic() - t0
        finally:
            release.set()
            server.stop(0)
            shutil.rmtree(tmp, ignore_errors=True)
        self._report("hook-hangs", r)
        self.assertEqual(r.hook["code"], "DEADLINE_EXCEEDED")
        self.assertGreaterEqual(r.hook["duration_s"], timeout)
        self.assertLess(r.hook["duration_s"], timeout + 2)
        self.assertGuestContinuedOnTarget(r)
        self.assertLess(elapsed, timeout + 60)
        # The hook saw what KubeVirt sends: hook point, node, the VMI with migrationState.
        self.assertEqual(len(calls), 1)
        self.assertEqual(calls[0]["hookPoint"], "PreMigrationSource")
        self.assertEqual(calls[0]["nodeName"], r.source_node)
        vmi = json.loads(calls[0]["vmi"])
        self.assertEqual(vmi["metadata"]["uid"], self.cluster.vmi.uid)
        ms = vmi["status"]["migrationState"]
        self.assertEqual(ms["targetNodeAddress"], r.target_address)
        self.assertEqual(ms["targetDirectMigrationNodePorts"], r.ports)
        self.assertEqual(sorted(ms["targetDirectMigrationNodePorts"].values()), [0, 49152])
        self.assertEqual(ms["migrationUid"], r.migration_uid)
        self.assertEqual(ms["sourceNode"], r.source_node)
        self.assertEqual(vmi["status"]["nodeName"], r.source_node)


if __name__ == "__main__":
    unittest.main()
