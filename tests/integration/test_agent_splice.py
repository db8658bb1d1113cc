"""The TCP transport with and without splice(2) (config tcp.splice), through two real agents
and real QEMU guests: byte-exact migrations with 0 and 4 multifd channels on each path, and
a check in the agents' logs that the path asked for is the one that carried the bytes.

Run from the repository root after building: python3 tests/integration/test_agent_splice.py -v
"""
import os
import re
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from rdmiglab import Agent, QemuVm, ensure_guest, migrate_via_agents  # noqa: E402
from rdmiglab.qemu import trixie_qemu  # noqa: E402
from rdmiglab import timed  # noqa: E402

MEM_MIB = 256
DIRTY_MIB = 16  # the size and rate test_agent_migration.py checks byte-exact (see there)
CLOSED = re.compile(r"channel (\d+) closed: splice (\w+), spliced (\d+) bytes sent and (\d+) bytes received")


def spliced_bytes(agent, mode):
    """Bytes spliced by `agent`'s channels that closed with splice `mode`: (sent, received)."""
    sent = received = 0
    for m in CLOSED.finditer(agent.log_text()):
        if m.group(2) == mode:
            sent += int(m.group(3))
            received += int(m.group(4))
    return sent, received


class SpliceMigrationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ensure_guest()
        # Debian 13's QEMU 10.0: byte-exact in these shapes QEMU to QEMU (test_direct_migration.py),
        # which the host's 7.2 is not.
        cls.qemu = dict(zip(("qemu_binary", "env"), trixie_qemu()))
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-splice-")
        cls.agents = {}
        for mode in ("on", "off"):
            cls.agents[mode] = (Agent(cls.tmp, "src-%s" % mode, log_level="debug", config={"tcp": {"splice": mode}}),
                                Agent(cls.tmp, "dst-%s" % mode, log_level="debug", config={"tcp": {"splice": mode}}))

    @classmethod
    def tearDownClass(cls):
        for pair in cls.agents.values():
            for a in pair:
                a.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.vms = []

    def tearDown(self):
        for vm in self.vms:
            vm.kill()

    def migrate(self, mode, multifd):
        src_agent, dst_agent = self.agents[mode]
        before = spliced_bytes(src_agent, mode), spliced_bytes(dst_agent, mode)
        name = "%s-%d" % (mode, multifd)
        src = QemuVm(self.tmp, name + "-src", mem_mib=MEM_MIB, dirty_mib=DIRTY_MIB, **self.qemu)
        self.vms.append(src)
        dst = QemuVm(self.tmp, name + "-dst", mem_mib=MEM_MIB, dirty_mib=DIRTY_MIB, incoming_defer=True, paused=True,
                     **self.qemu)
        self.vms.append(dst)
        src.wait_for_counter(2, timeout=90)
        s, t = migrate_via_agents(src_agent, dst_agent, src.agent_qmp_path, dst.agent_qmp_path,
                                  multifd_channels=multifd, vm="vm-" + name)
        self.assertEqual(s["phase"], "Succeeded", s["result"]["reason"])
        self.assertEqual(t["phase"], "Succeeded", t["result"]["reason"])
        self.assertEqual(s["transport"], "tcp")
        self.assertEqual(s["progress"]["dataBytesSent"], t["progress"]["dataBytesReceived"])
        self.assertEqual(src.memory_digest(), dst.memory_digest(), "guest memory differs between source and target")
        last = src.last_counter()
        dst.cont()
        self.assertGreater(dst.wait_for_counter(last + 1, timeout=90), last)
        # The channels log what they spliced when they close (after the job ends).
        sent = spliced_bytes(src_agent, mode)[0] - before[0][0]
        received = spliced_bytes(dst_agent, mode)[1] - before[1][1]
        return s["progress"]["dataBytesSent"], sent, received

    def check(self, mode, multifd):
        total, sent, received = self.migrate(mode, multifd)
        print("splice %s, %d multifd: %d bytes, %d spliced out of the source QEMU, %d into the target QEMU"
              % (mode, multifd, total, sent, received))
        if mode == "on":
            self.assertEqual(sent, total)
            # A payload the target side is slow to come for is copied instead (see tcp_channel.h).
            self.assertGreater(received, total // 2)
        else:
            self.assertEqual((sent, received), (0, 0))

    def test_splice_on_byte_exact_without_multifd(self):
        self.check("on", 0)

    def test_splice_on_byte_exact_with_4_multifd_channels(self):
        self.check("on", 4)

    def test_splice_off_byte_exact_without_multifd(self):
        self.check("off", 0)

    def test_splice_off_byte_exact_with_4_multifd_channels(self):
        self.check("off", 4)


if __name__ == "__main__":
    timed.main()
