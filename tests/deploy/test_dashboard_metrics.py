"""Every metric the Grafana dashboard queries is exported by a live rdmig-agent or
rdmig-controller, and the chart's rendered agent.yaml and controller.yaml load in the real
programs.

Two real agents (one per "node", loading the agent.yaml that `helm template` puts into the agent
ConfigMap, with only the listen addresses, ports, token file and state dir changed for this
machine) and a real controller (loading the chart's controller.yaml, against the API server
double of tests/k8s) carry one RdmaMigration of a real QEMU guest end to end; then a migration
with a wrong data-plane token makes the agents count a transport error. After that both agents'
and the controller's /metrics are scraped, and each rdmig_* name in any dashboard query must
have at least one sample there (histograms as _bucket/_sum/_count). A panel that names a metric
nobody exports fails the test. KubeVirt mode's names (rdmig_kubevirt_*, rdmig_controller_vmi_*,
rdmig_controller_kubevirt_*) need agents in KubeVirt mode and real KubeVirt migrations: the ctest
deploy_dashboard_prometheus checks them, both ways, after its lab's two KubeVirt migrations.

Run: python3 tests/deploy/test_dashboard_metrics.py -v   (ctest -L deploy; needs built binaries:
$RDMIG_AGENT and $RDMIG_CONTROLLER, else build-deploy/...)
"""
import json
import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from livestack import REPO, LiveStack  # noqa: E402
from deploylib import dashboard_metric_names  # noqa: E402
from rdmiglab import parse_prometheus  # noqa: E402


class DashboardMetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = LiveStack()
        cls.agents, cls.controller = cls.stack.agents, cls.stack.controller

    @classmethod
    def tearDownClass(cls):
        cls.stack.stop()

    def test_every_dashboard_metric_is_exported_by_a_live_agent_or_controller(self):
        self.stack.wait_for_leader()
        self.stack.migrate(self)

        exported = {}
        for who, text in [(a.name, a.metrics()) for a in self.agents] + \
                         [("controller", self.controller.metrics_text())]:
            samples, _ = parse_prometheus(text)
            for name, _labels in samples:
                exported.setdefault(name, set()).add(who)
        with open(os.path.join(REPO, "dashboards", "rdmig.json")) as f:
            names, exprs = dashboard_metric_names(json.load(f))
        self.assertGreater(len(names), 20, "the dashboard queries too few metrics to be the real one")
        missing = []
        kubevirt_mode = re.compile(r"^rdmig_(kubevirt|controller_vmi|controller_kubevirt)_")
        for name in sorted(n for n in names if not kubevirt_mode.match(n)):
            series = [n for n in (name, name + "_bucket", name + "_count") if n in exported]
            if not series:
                missing.append(name)
            else:
                print("  %-48s exported by %s" % (name, ", ".join(sorted(exported[series[0]]))))
        self.assertEqual(missing, [], "dashboard queries metrics that no live agent or controller exports: %s"
                         % ", ".join(missing))
        base = lambda n: re.sub(r"_(bucket|sum|count)$", "", n)  # noqa: E731
        unused = sorted({base(n) for n in exported if n.startswith("rdmig_")} - {base(m) for m in names})
        print("  exported but on no panel: %s" % (", ".join(unused) or "none"))


if __name__ == "__main__":
    unittest.main()
