"""The rdmig alerts (issue 12): the PrometheusRule in operator-manifests/monitoring/ (equal to the
chart's, checked in test_chart.py) passes `promtool check rules`, its firing conditions pass the
`promtool test rules` unit tests in alerts-test.yaml, every rdmig_* metric it queries is
registered in the programs' sources, and every alert has a runbook page with kubectl commands.

promtool: Debian's `prometheus` package (scripts/install-deps.sh --test).
Run: python3 tests/deploy/test_alerts.py -v   (ctest -L deploy)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploylib import HERE, MANIFESTS, REPO, one, render  # noqa: E402

RULES = os.path.join(MANIFESTS, "monitoring", "prometheusrule.yaml")
UNIT_TESTS = os.path.join(HERE, "alerts-test.yaml")
ALERTS = ["RdmigAgentDown", "RdmigControllerNoLeader", "RdmigMigrationFailed", "RdmigDowntimeOverSlo",
          "RdmigVmPausedOnSource", "RdmigRdmaFallback", "RdmigRdmaUnavailable", "RdmigRdmaRailDown",
          "RdmigRepeatedFailovers", "RdmigControllerReconcileErrors", "RdmigKubevirtHookErrors", "RdmigKubevirtHookNotServed",
          "RdmigKubevirtNotCarried", "RdmigKubevirtCarriedOverTcp"]
METRIC_SOURCES = ("src/metrics/metrics.cpp", "src/kubevirt/flow/kubevirt_metrics.cpp", "controller/controller_metrics.cpp")


def promtool():
    path = shutil.which("promtool")
    if not path:
        raise unittest.SkipTest("promtool missing: install Debian's prometheus package (scripts/install-deps.sh --test)")
    return path


class AlertsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(RULES) as f:
            cls.rule = one([d for d in yaml.safe_load_all(f) if d], "PrometheusRule")
        cls.rules = cls.rule["spec"]["groups"][0]["rules"]
        cls.tmp = tempfile.mkdtemp(prefix="rdmig-alerts-")
        with open(os.path.join(cls.tmp, "rdmig.rules.yaml"), "w") as f:
            yaml.safe_dump(cls.rule["spec"], f, sort_keys=False)
        shutil.copy(UNIT_TESTS, cls.tmp)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_promtool(self, *args):
        r = subprocess.run([promtool()] + list(args), capture_output=True, text=True, cwd=self.tmp, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout + r.stderr

    def test_the_alerts_exist_in_order_with_severity_and_runbook(self):
        self.assertEqual([r["alert"] for r in self.rules], ALERTS)
        for r in self.rules:
            self.assertIn(r["labels"]["severity"], ("warning", "critical"))
            self.assertEqual(r["annotations"]["runbook_url"],
                             "https://github.com/rdmig/rdmig/blob/main/docs/runbooks/%s.md" % r["alert"])

    def test_the_deploy_docs_count_and_name_the_alerts(self):
        # docs/deploy.md's row for this test once said "six alerts" when there were eight.
        words = {6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen",
                 14: "fourteen", 15: "fifteen"}
        with open(os.path.join(REPO, "docs", "deploy.md")) as f:
            [row] = [line for line in f if line.startswith("| `deploy_alerts` |")]
        self.assertIn("%s alerts" % words.get(len(ALERTS), len(ALERTS)), row)
        for name in ALERTS:
            self.assertIn("`%s`" % name, row)

    def test_promtool_check_rules(self):
        out = self.run_promtool("check", "rules", "rdmig.rules.yaml")
        self.assertIn("SUCCESS: %d rules found" % len(ALERTS), out)

    def test_promtool_unit_tests_of_the_firing_conditions(self):
        with open(UNIT_TESTS) as f:
            tested = {t["alertname"] for group in yaml.safe_load(f)["tests"] for t in group["alert_rule_test"]
                      if t.get("exp_alerts")}
        self.assertEqual(tested, set(ALERTS), "every alert has a test in which it fires")
        self.run_promtool("test", "rules", "alerts-test.yaml")

    def test_the_charts_rules_with_other_values_pass_promtool_too(self):
        docs = render("--set", "prometheusRule.enabled=true", "--set", "serviceMonitor.enabled=true",
                      "--set", "prometheusRule.downtimeSloSeconds=0.025",
                      "--set", "prometheusRule.rdmaFallbackRatio=0.5", release="vmmove", namespace="infra")
        rule = one(docs, "PrometheusRule")
        path = os.path.join(self.tmp, "other.rules.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(rule["spec"], f)
        self.run_promtool("check", "rules", "other.rules.yaml")
        text = " ".join(r["expr"] for r in rule["spec"]["groups"][0]["rules"])
        # The job labels do not follow the release name (the ServiceMonitors' jobLabel is the
        # Services' app.kubernetes.io/name); the DaemonSet's name does, as its object name.
        self.assertIn('job="rdmig-agent", namespace="infra"', text)
        self.assertIn('job="rdmig-controller", namespace="infra"', text)
        self.assertNotIn("vmmove-rdmig-agent-metrics", text)
        self.assertIn('daemonset="vmmove-rdmig-agent"', text)
        self.assertIn('le="0.025"', text)

    def test_every_metric_an_alert_queries_is_exported(self):
        sources = ""
        for rel in METRIC_SOURCES:
            with open(os.path.join(REPO, rel)) as f:
                sources += f.read()
        registered = set(re.findall(r'Name\("(rdmig_[A-Za-z0-9_]+)"\)', sources))
        used = set()
        for r in self.rules:
            used.update(re.findall(r"\brdmig_[A-Za-z0-9_]+", r["expr"]))
        self.assertTrue(used)
        for name in sorted(used):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            self.assertTrue(name in registered or base in registered, "an alert uses %s; no source registers it" % name)
        with open(os.path.join(REPO, "docs", "metrics.md")) as f:
            documented = f.read()
        for name in sorted(used):
            self.assertIn("`%s`" % re.sub(r"_(bucket|sum|count)$", "", name), documented)

    def test_downtime_slo_values_are_bucket_bounds_of_both_histograms(self):
        with open(os.path.join(REPO, "charts", "rdmig", "values.schema.json")) as f:
            import json
            slos = json.load(f)["properties"]["prometheusRule"]["properties"]["downtimeSloSeconds"]["enum"]
        with open(os.path.join(REPO, "src", "metrics", "metrics.cpp")) as f:
            agent = re.search(r"downtime_buckets\(\) \{(?:\s*//[^\n]*)*\s*return \{([^}]*)\}", f.read()).group(1)
        with open(os.path.join(REPO, "src", "kubevirt", "flow", "kubevirt_metrics.cpp")) as f:
            kubevirt_source = f.read()
        # The KubeVirt histogram takes the agent's bounds (metrics.h: downtime_buckets()).
        self.assertRegex(kubevirt_source, r"downtime_\.Add\([^;]*downtime_buckets\(\)\)")
        bounds = [{float(x) for x in agent.replace("\n", " ").split(",") if x.strip()}]
        for s in slos:
            for b in bounds:
                self.assertIn(float(s), b, "SLO %s is not a bucket bound (le label) of a downtime histogram" % s)

    def test_every_runbook_says_what_to_do_with_kubectl(self):
        for alert in ALERTS:
            path = os.path.join(REPO, "docs", "runbooks", alert + ".md")
            self.assertTrue(os.path.exists(path), path)
            with open(path) as f:
                text = f.read()
            self.assertTrue(text.startswith("# " + alert + "\n"), path)
            for section in ("**Meaning.**", "**Impact.**", "**Diagnose.**", "**Fix.**"):
                self.assertIn(section, text, "%s: %s" % (alert, section))
            self.assertRegex(text, r"\n\s*kubectl -n rdmig-system [a-z]|\nkubectl [a-z]", alert + ": exact kubectl commands")
        with open(os.path.join(REPO, "docs", "runbooks", "README.md")) as f:
            index = f.read()
        for alert in ALERTS:
            self.assertIn("[%s](%s.md)" % (alert, alert), index)


if __name__ == "__main__":
    unittest.main()
