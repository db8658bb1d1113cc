"""Runs inside the Soft-RoCE VM: real QEMU guests migrated through two real rdmig-agents
with transport rdma over rxe0, driven through the REST API.

The guests run only their firmware (a kernel boots too slowly under nested TCG) with 64 MiB
of random data loaded into RAM, so the byte-exact memory check has content to compare.
  python3 test_agent_rdma.py  (RDMIG_AGENT points at the agent; tools/ must be importable)
"""
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.environ.get("RDMIG_TOOLS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")))
from rdmiglab import Agent, QemuVm, migrate_via_agents, parse_prometheus  # noqa: E402

MEM_MIB = 128


class AgentRdmaTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-rdma-")
        cls.blob = os.path.join(cls.tmp, "blob.bin")
        with open(cls.blob, "wb") as f:
            f.write(os.urandom(64 << 20))
        cfg = {"transport": "rdma", "rdma": {"device": os.environ.get("RDMIG_RDMA_DEV", "rxe0")},
               "dataPlane": {"rdmaPort": 0}}
        cls.a = Agent(cls.tmp, "agent-a", config=cfg, log_level="debug")
        cls.b = Agent(cls.tmp, "agent-b", config=cfg, log_level="debug")

    @classmethod
    def tearDownClass(cls):
        for agent in (cls.a, cls.b):
            agent.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.vms = []

    def tearDown(self):
        for vm in self.vms:
            vm.kill()

    def migrate(self, multifd):
        src = QemuVm(self.tmp, "src%d" % multifd, mem_mib=MEM_MIB, firmware_only=True, blob=self.blob)
        self.vms.append(src)
        dst = QemuVm(self.tmp, "dst%d" % multifd, mem_mib=MEM_MIB, firmware_only=True,
                     incoming_defer=True, paused=True)
        self.vms.append(dst)
        self.assertEqual(src.status(), "running")
        before = self.rdma_metrics()
        s, t = migrate_via_agents(self.a, self.b, src.agent_qmp_path, dst.agent_qmp_path,
                                  multifd_channels=multifd, chunk_size="1Mi", ring_depth=8,
                                  vm="rdma-vm-%d" % multifd, transport="rdma", timeout=240)
        if s["phase"] != "Succeeded":
            print(self.a.log_text()[-4000:], self.b.log_text()[-4000:])
        self.assertEqual(s["phase"], "Succeeded", s["result"]["reason"])
        self.assertEqual(t["phase"], "Succeeded", t["result"]["reason"])
        self.assertEqual(s["transport"], "rdma")
        self.assertEqual(t["transport"], "rdma")
        self.assertEqual(s["channels"], multifd + 1)
        self.assertEqual(s["progress"]["dataBytesSent"], t["progress"]["dataBytesReceived"])
        self.assertEqual(src.status(), "postmigrate")
        self.assertEqual(dst.status(), "paused")
        self.assertEqual(src.memory_digest(), dst.memory_digest(), "memory differs")
        dst.cont()
        self.assertEqual(dst.status(), "running")
        # The metrics show this migration over RDMA (deltas: each test stands on its own).
        after = self.rdma_metrics()
        self.assertGreater(after["sent"] - before["sent"], 64 << 20)
        self.assertGreater(after["write_latency_count"] - before["write_latency_count"], 0)
        self.assertEqual(after["selected_requested"] - before["selected_requested"], 1)
        self.assertGreaterEqual(after["devices"], 1)
        print("multifd=%d: total %s ms, downtime %s ms, %d bytes over rdma, %d chunks"
              % (multifd, s["result"]["totalTimeMs"], s["result"]["downtimeMs"],
                 s["progress"]["dataBytesSent"], s["progress"]["chunksSent"]))

    def rdma_metrics(self):
        samples, _ = parse_prometheus(self.a.metrics())

        def get(name, **labels):
            return samples.get((name, frozenset(labels.items())), 0)
        return {"sent": get("rdmig_transferred_bytes_total", transport="rdma", direction="sent"),
                "write_latency_count": get("rdmig_chunk_write_latency_seconds_count", transport="rdma"),
                "selected_requested": get("rdmig_transport_selected_total", transport="rdma", reason="requested"),
                "devices": get("rdmig_rdma_devices")}

    def test_migrates_over_rdma_without_multifd(self):
        self.migrate(0)

    def test_migrates_over_rdma_with_4_multifd_channels(self):
        self.migrate(4)


if __name__ == "__main__":
    unittest.main(verbosity=2)
