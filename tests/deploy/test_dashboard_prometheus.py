"""Debian's real Prometheus evaluates every dashboard query and every alert expression against
live agents and a live controller during a real migration.

The live stack of livestack.py (two agents and a controller loading the chart's configs, the API
server double) runs; a real `prometheus` scrapes both agents and the controller every second,
with the target labels the Prometheus Operator gives them through the ServiceMonitors (job = the
metrics Service, namespace, node) and the ServiceMonitors' honorLabels, and loads the PrometheusRule of operator-manifests/monitoring/
and the chart's (helm template, prometheusRule.enabled=true) as rule files. Then one RdmaMigration
of a real QEMU guest and one migration with a wrong data-plane token (Failed on its source) run.
After that, through Prometheus' HTTP API:

- every dashboard variable resolves to values (label_values over the run, as Grafana asks the
  series API), and the panels are evaluated with those values substituted (the multi-value regex
  Grafana builds), $__interval = 1s (the step), $__rate_interval = 4s (Grafana's rule: four
  scrape intervals of the data source) and $__range = the run;
- every panel query parses and returns data: at least one series with a value that is not NaN
  (range queries over the run, instant ones at its end); the panels that take the VM variable
  again with the one migrated VM selected, returning only its series;
- a few figures are checked: one migration succeeded and one failed, a failure reason, both rows
  (source, target) of the migrated VM in the table of migrations, with their phase, transport,
  start and end (rdmig_migration_info, rdmig_migration_start/end_time_seconds), and the failed
  one's; every migration the agents hold has ended;
- every annotation query parses; the start annotation marks each of the two migrations once with
  its VM, the end annotations mark the success and the failure on the source node once each;
- every alert expression parses, Prometheus evaluates every rule with health ok,
  RdmigMigrationFailed fires for node-a, RdmigRdmaFallback fires (the run's one migration was
  each agent's first, and fell back to TCP: no RDMA here), and no other alert returns a series; then the agent of node-b is stopped and RdmigAgentDown's expression returns
  node-b, its alert is pending, and the up panel shows node-b down.

KubeVirt mode (livestack.KubevirtLab): two more agents in KubeVirt mode ("kv-a", "kv-b", scraped
under the same job) and tests/kubevirt's lab (launcher pods with real libvirt and QEMU, started after
the bare-QEMU migrations, one small VMI, the KubeVirt stand-in) run one migration carried by rdmig
(an RdmaMigration naming the VMI) and one drain back with post-copy allowed (not carried). The
KubeVirt panels must show carried 1 and not carried 1 with reason post_copy, libvirt's downtime
and total time, the bytes of the memory connection, the node pair and the controller's figures;
each KubeVirt annotation marks its migration once; the KubeVirt alerts stay silent, and once kv-b's
hook socket is removed RdmigKubevirtHookNotServed's expression names kv-b. Every KubeVirt-mode
series name the scrape holds (rdmig_kubevirt_*, rdmig_controller_vmi_*, rdmig_controller_kubevirt_*)
must be read by a panel or alert and every one they read exported; promtool tests the KubeVirt and
reconcile alerts on input series with the label sets scraped here (each fires, and is silent at 1m).

A panel querying a metric that no program exports, or a syntax error anywhere, fails the test.
RDMIG_DASHBOARD=path checks another dashboard JSON (to see the test fail on a broken one).

prometheus: Debian's `prometheus` package (scripts/install-deps.sh --test).
Run: python3 tests/deploy/test_dashboard_prometheus.py -v   (ctest -L deploy; needs built binaries:
$RDMIG_AGENT and $RDMIG_CONTROLLER, else build-deploy/...)
"""
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    # The KubeVirt lab drives libvirt through Debian's python3-libvirt (/usr/bin/python3).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
    from rdmiglab.system_python import reexec_with_system_python
    reexec_with_system_python()
from livestack import BAD_TOKEN_VM, KV_NODES, KV_NS, KV_VMI, REPO, VM, KubevirtLab, LiveStack, wait_for  # noqa: E402
from deploylib import MANIFESTS, one, render  # noqa: E402

# The job labels the Prometheus Operator gives the chart's targets: the ServiceMonitors' jobLabel
# (app.kubernetes.io/name) read on the metrics Services (test_chart.py checks both ends).
AGENT_JOB, CONTROLLER_JOB, NAMESPACE = "rdmig-agent", "rdmig-controller", "rdmig-system"
SCRAPE_SECONDS = 1
# Grafana: $__interval is the step (at least the data source's scrape interval); $__rate_interval
# is max($__interval + scrape interval, 4 * scrape interval).
STEP = SCRAPE_SECONDS
RATE_INTERVAL = max(STEP + SCRAPE_SECONDS, 4 * SCRAPE_SECONDS)
DASHBOARD = os.environ.get("RDMIG_DASHBOARD") or os.path.join(REPO, "dashboards", "rdmig.json")
KV_VM = KV_NS + "/" + KV_VMI


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grafana_regex(values):
    """A multi-value variable as Grafana puts it into a Prometheus regex matcher."""
    escaped = [re.sub(r"[\\^$*+?.()|[\]{}/]", lambda m: "\\\\" + m.group(0), v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


class Prometheus:
    """One `prometheus` process on a free port, its TSDB and log in `workdir`."""

    def __init__(self, workdir, config):
        binary = shutil.which("prometheus")
        if not binary:
            raise AssertionError("prometheus missing: scripts/install-deps.sh --test installs Debian's prometheus")
        self.workdir = workdir
        self.config_file = os.path.join(workdir, "prometheus.yml")
        with open(self.config_file, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        self.log_file = os.path.join(workdir, "prometheus.log")
        for _attempt in range(3):  # a port taken between free_port() and prometheus' bind: try another
            self.port = free_port()
            with open(self.log_file, "ab") as log:
                self.proc = subprocess.Popen(
                    [binary, "--config.file=" + self.config_file, "--storage.tsdb.path=" + os.path.join(workdir, "tsdb"),
                     "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=info"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_for(self._ready, 60, "prometheus to be ready", interval=0.2)
                return
            except RuntimeError:
                if "address already in use" not in self.log_text():
                    raise
        raise AssertionError("prometheus found no free port:\n" + self.log_text()[-3000:])

    def _ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError("prometheus exited with %s:\n%s" % (self.proc.returncode, self.log_text()[-3000:]))
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % self.port, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_text(self):
        with open(self.log_file, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, path, post=False, **params):
        """GET (POST: the parameters as a form) on the HTTP API; returns the decoded JSON, errors
        included."""
        url = "http://127.0.0.1:%d/api/v1/%s" % (self.port, path)
        form = urllib.parse.urlencode(params, doseq=True)
        req = urllib.request.Request(url, data=form.encode()) if post else \
            urllib.request.Request(url + ("?" + form if form else ""))
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return json.loads(text)
            except ValueError:
                return {"status": "error", "errorType": "http %d" % e.code, "error": text}

    def query(self, expr, at=None, start=None, end=None):
        """An instant query at `at`, or a range query over [start, end] at STEP. Returns
        (error or None, result list)."""
        if start is None:
            body = self.api("query", post=True, query=expr, time="%.3f" % (at or time.time()))
        else:
            body = self.api("query_range", post=True, query=expr, start="%.3f" % start, end="%.3f" % end, step=str(STEP))
        if body.get("status") != "success":
            return "%s: %s" % (body.get("errorType"), body.get("error")), []
        return None, body["data"]["result"]

    def value(self, expr):
        err, result = self.query(expr)
        if err or not result:
            return None
        return float(result[0]["value"][1])


def vm_of(labels):
    """A VM as the stack names it: namespace/name (KubeVirt's labels), or the bare name of the
    hand-made migration, whose namespace Prometheus filled in with the agent's."""
    if labels.get("name") == BAD_TOKEN_VM and labels.get("namespace") == NAMESPACE:
        return BAD_TOKEN_VM
    return "%s/%s" % (labels.get("namespace"), labels.get("name"))


def samples(series):
    """The values of one series of an instant (value) or range (values) result, as floats."""
    pairs = series["values"] if "values" in series else [series["value"]]
    return [float(v) for _t, v in pairs]


def has_data(result):
    return any(not math.isnan(v) for s in result for v in samples(s))


class DashboardPrometheusTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack, cls.prom, cls.kvlab = None, None, None
        with open(DASHBOARD) as f:
            cls.dashboard = json.load(f)
        docs = render()
        # The ServiceMonitors' honorLabels (the agent's and the controller's) become honor_labels.
        honor = {sm["metadata"]["name"].rsplit("-", 1)[1]: sm["spec"]["endpoints"][0].get("honorLabels", False)
                 for sm in render("--set", "serviceMonitor.enabled=true") if sm["kind"] == "ServiceMonitor"}
        chart_rules = one(render("--set", "prometheusRule.enabled=true", "--set", "serviceMonitor.enabled=true"), "PrometheusRule")
        with open(os.path.join(MANIFESTS, "monitoring", "prometheusrule.yaml")) as f:
            manifest_rules = one([d for d in yaml.safe_load_all(f) if d], "PrometheusRule")
        # The agents' ServiceMonitor: HTTPS with the chart's CA and name (agent.tls) becomes scheme and tls_config.
        agent_sm = [sm for sm in render("--set", "serviceMonitor.enabled=true")
                    if sm["kind"] == "ServiceMonitor" and sm["metadata"]["name"].endswith("-agent")][0]["spec"]["endpoints"][0]
        # The controller's: HTTPS with Prometheus' ServiceAccount token (bearerTokenFile) and the
        # tlsConfig it names (insecureSkipVerify for the controller's self-signed certificate).
        controller_sm = [sm for sm in render("--set", "serviceMonitor.enabled=true")
                         if sm["kind"] == "ServiceMonitor" and sm["metadata"]["name"].endswith("-controller")][0]["spec"]["endpoints"][0]
        cls.stack = LiveStack(docs)
        try:
            cls.kvlab = KubevirtLab(cls.stack)
            agent_tls = {}
            if agent_sm.get("scheme") == "https":
                assert cls.stack.tls, "the ServiceMonitor scrapes HTTPS but the rendered agents serve plain HTTP"
                agent_tls = {"scheme": "https", "tls_config": {"ca_file": cls.stack.tls["ca"],
                                                               "server_name": agent_sm["tlsConfig"]["serverName"]}}
            controller_tls = {}
            if controller_sm.get("scheme") == "https":
                assert cls.stack.metrics_token_file, "the ServiceMonitor scrapes HTTPS but the controller serves plain HTTP"
                assert "bearerTokenFile" in controller_sm, controller_sm
                controller_tls = {"scheme": "https", "authorization": {"credentials_file": cls.stack.metrics_token_file},
                                  "tls_config": {"insecure_skip_verify": controller_sm["tlsConfig"]["insecureSkipVerify"]}}
            cls.rule_files, cls.alerts = [], []
            for where, rule in (("manifest", manifest_rules), ("chart", chart_rules)):
                path = os.path.join(cls.stack.tmp, "%s.rules.yaml" % where)
                groups = [dict(g, name="%s-%s" % (g["name"], where)) for g in rule["spec"]["groups"]]
                with open(path, "w") as f:
                    yaml.safe_dump({"groups": groups}, f, sort_keys=False)
                cls.rule_files.append(path)
                cls.alerts += [(where, r["alert"], r["expr"]) for g in groups for r in g["rules"]]
            a, b = cls.stack.agents
            config = {
                "global": {"scrape_interval": "%ds" % SCRAPE_SECONDS, "scrape_timeout": "%ds" % SCRAPE_SECONDS,
                           "evaluation_interval": "%ds" % SCRAPE_SECONDS},
                "rule_files": cls.rule_files,
                "scrape_configs": [
                    dict({"job_name": AGENT_JOB, "honor_labels": honor["agent"], "static_configs": [
                        {"targets": ["127.0.0.1:%d" % agent.api_port], "labels": {"namespace": NAMESPACE,
                                                                                  "node": agent.name}}
                        for agent in (a, b)]}, **agent_tls),
                    # The KubeVirt-mode agents: the same job (the ServiceMonitor selects every agent pod).
                    dict({"job_name": AGENT_JOB + "-kubevirt", "honor_labels": honor["agent"], "static_configs": [
                        {"targets": ["127.0.0.1:%d" % agent.api_port], "labels": {"namespace": NAMESPACE,
                                                                                  "node": agent.name,
                                                                                  "job": AGENT_JOB}}
                        for agent in cls.kvlab.agents]}, **agent_tls),
                    dict({"job_name": CONTROLLER_JOB, "honor_labels": honor["controller"], "static_configs": [
                        {"targets": ["127.0.0.1:%d" % cls.stack.controller.port],
                         "labels": {"namespace": NAMESPACE, "node": "node-a"}}]}, **controller_tls)]}
            cls.prom = Prometheus(cls.stack.tmp, config)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.prom:
            cls.prom.stop()
        if cls.kvlab:
            cls.kvlab.close()
        if cls.stack:
            cls.stack.stop()

    # -- Grafana's side of a query ------------------------------------------------------------------
    def substitute(self, expr, variables, interval=STEP):
        builtin = {"__interval": "%ds" % interval, "__rate_interval": "%ds" % RATE_INTERVAL,
                   "__range": "%ds" % self.range_seconds}

        def one_var(m):
            name = m.group(1) or m.group(2)
            if name in builtin:
                return builtin[name]
            if name not in variables:
                raise AssertionError("query uses an unknown variable $%s: %s" % (name, expr))
            return grafana_regex(variables[name])
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", one_var, expr)

    def resolve_variables(self):
        """Each query variable's values over the run, in dashboard order (later ones use earlier ones)."""
        variables = {}
        for v in self.dashboard["templating"]["list"]:
            if v["type"] != "query":
                continue
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
            self.assertIsNotNone(m, "variable %s: only label_values(selector, label) is evaluated here: %s"
                                 % (v["name"], q))
            selector = self.substitute(m.group(1), variables)
            body = self.prom.api("label/%s/values" % m.group(2), **{"match[]": selector, "start": "%.3f" % self.start,
                                                                    "end": "%.3f" % self.end})
            self.assertEqual(body.get("status"), "success", "variable %s: %s" % (v["name"], body))
            self.assertTrue(body["data"], "variable %s (%s) has no values" % (v["name"], selector))
            variables[v["name"]] = sorted(body["data"])
        return variables

    def targets(self):
        def walk(panels):
            for p in panels:
                for t in p.get("targets", []):
                    yield p, t
                yield from walk(p.get("panels", []))
        return list(walk(self.dashboard["panels"]))

    def evaluate(self, expr, variables, instant):
        q = self.substitute(expr, variables)
        self.assertNotIn("$", q, "a variable was left in " + q)
        if instant:
            return self.prom.query(q, at=self.end)
        return self.prom.query(q, start=self.start, end=self.end)

    # -- the run -------------------------------------------------------------------------------------
    def wait_until_scraped(self):
        """Prometheus holds the final figures, and a few scrapes more (rate windows after the end)."""
        wait_for(lambda: self.prom.value('sum(up{job=~"%s|%s"})' % (AGENT_JOB, CONTROLLER_JOB)) == 5, 30,
                 "Prometheus to scrape the four agents and the controller")
        wait_for(lambda: self.prom.value('sum(rdmig_migrations_finished_total{role="source"})') == 2, 30,
                 "Prometheus to see both source migrations finished")
        wait_for(lambda: self.prom.value('sum(rdmig_kubevirt_migrations_total{role="source"})') == 2, 30,
                 "Prometheus to see both KubeVirt migrations ended on their source")
        wait_for(lambda: self.prom.value('count(rdmig_controller_vmi_migration_downtime_seconds)') == 1, 30,
                 "Prometheus to see the controller's figures of the VMI")
        seen = time.time()
        wait_for(lambda: (self.prom.value('min(timestamp(up{job="%s"}))' % AGENT_JOB) or 0) > seen + RATE_INTERVAL,
                 30, "%d s more of scrapes" % RATE_INTERVAL, interval=0.2)

    def check_kubevirt_panels(self, results, annotations, carried, drained):
        """KubeVirt mode's panels after one carried migration (kv-a to kv-b, by an RdmaMigration)
        and one drain back that rdmig did not carry (post-copy allowed)."""
        def by(ref, *labels):
            return {tuple(s["metric"].get(l, "") for l in labels) if len(labels) > 1 else s["metric"].get(labels[0], ""):
                    samples(s)[-1] for s in results[ref]}
        a, b = KV_NODES
        self.assertEqual((carried.source_node, carried.target_node, drained.source_node), (a, b, b))
        self.assertAlmostEqual(samples(results["Carried by rdmig (KubeVirt)/A"][0])[0], 0.5)
        self.assertEqual({k: round(v) for k, v in by("KubeVirt migrations by result/A", "result").items()},
                         {"Succeeded": 1, "Failed": 0, "NotCarried": 1})
        self.assertEqual({k: round(v) for k, v in by("Not carried, by reason/A", "reason").items()}, {"post_copy": 1})
        self.assertEqual({k: round(v) for k, v in by("Carried by transport/A", "transport").items()},
                         {"tcp": 1, "rdma": 0})
        self.assertEqual(by("Node hook served/A", "node"), {a: 1.0, b: 1.0})
        # The lab's proxies speak TLS (KubeVirt's default): nothing seen in clear, nothing refused.
        self.assertEqual({k: round(v) for k, v in by("Plaintext KubeVirt migrations (disableTLS)/A", "action").items()},
                         {"carried": 0, "refused": 0})
        active = by("Carried KubeVirt migrations running, per node/A", "node")
        self.assertEqual({n: v for n, v in active.items() if n in KV_NODES}, {a: 0.0, b: 0.0})
        # The per-VMI table: the carried migration's row on its source agent (kv-a), the drain's on kv-b.
        table = "KubeVirt migrations (per VMI)/"
        info = {s["metric"]["node"]: s["metric"] for s in results[table + "A"]}
        self.assertEqual(set(info), {a, b}, info)
        self.assertEqual({k: info[a].get(k, "") for k in ("namespace", "name", "source_node", "target_node", "result",
                                                         "transport", "reason")},
                         {"namespace": KV_NS, "name": KV_VMI, "source_node": a, "target_node": b,
                          "result": "Succeeded", "transport": "tcp", "reason": ""})
        self.assertTrue(info[a].get("transport_reason"), info[a])
        self.assertEqual({k: info[b].get(k, "") for k in ("source_node", "target_node", "result", "transport", "reason")},
                         {"source_node": b, "target_node": a, "result": "NotCarried", "transport": "",
                          "reason": "post_copy"})
        ended = by(table + "A", "node")
        self.assertLessEqual(ended[a], ended[b])
        self.assertLessEqual(self.start * 1000, ended[a])
        self.assertEqual(by(table + "B", "node"), {a: 1.0}, "one memory connection carried")
        self.assertEqual(by(table + "C", "node"), {a: carried.total_time_ms / 1000.0})
        self.assertEqual(by(table + "D", "node"), {a: carried.downtime_ms / 1000.0})
        memory_bytes = sum(c["dialed"]["tx_bytes"] for c in carried.proxy_logs["source"]["connections"]
                           if c["class"] == 49152)
        self.assertEqual(by(table + "E", "node"), {a: float(memory_bytes)})
        self.assertGreater(by(table + "F", "node")[a], 0)
        self.assertEqual(by(table + "G", "node"), {a: 1.0, b: 0.0})
        self.assertEqual(by("KubeVirt last downtime per VMI/A", "name"), {KV_VMI: carried.downtime_ms / 1000.0})
        pairs = by("KubeVirt throughput per node pair/A", "source_node", "target_node")
        self.assertEqual(list(pairs), [(a, b)])
        self.assertGreater(pairs[(a, b)], 0)
        # One downtime and one total time observed (target side, tcp): the quantiles fall in tcp's buckets.
        quantiles = {(s["metric"].get("transport")): samples(s)[0] for s in results["KubeVirt downtime and total time/A"]
                     if not math.isnan(samples(s)[0])}
        self.assertEqual(list(quantiles), ["tcp"], quantiles)
        # The controller's figures of the RdmaMigration that named the VMI.
        ctl = "RdmaMigrations of VMIs (controller)/"
        self.assertEqual(by(ctl + "A", "name"), {KV_VMI: 0.0})
        self.assertEqual(by(ctl + "B", "name"), {KV_VMI: 1.0})
        self.assertEqual(by(ctl + "C", "name"), {KV_VMI: carried.downtime_ms / 1000.0})
        self.assertEqual({k: round(v) for k, v in by("VMI migrations ended (controller)/A", "result", "carried").items()
                          if v > 0}, {("Succeeded", "true"): 1})
        # Annotations: each KubeVirt migration once, carried or not with its reason.
        kv_carried = {(dict(k)["node"], dict(k)["result"], dict(k)["transport"]): n
                      for k, n in annotations["KubeVirt migration carried"].items()}
        self.assertEqual(kv_carried, {(a, "Succeeded", "tcp"): 1})
        kv_not = {(dict(k)["node"], dict(k)["reason"]): n for k, n in annotations["KubeVirt migration not carried"].items()}
        self.assertEqual(kv_not, {(b, "post_copy"): 1})

    def test_every_dashboard_query_and_alert_evaluates_in_prometheus_after_a_real_migration(self):
        self.stack.wait_for_leader()
        wait_for(lambda: self.prom.value('sum(up{job=~"%s|%s"})' % (AGENT_JOB, CONTROLLER_JOB)) == 5, 30,
                 "Prometheus to scrape the four agents and the controller")
        self.start = time.time() - 1
        self.stack.migrate(self)
        t0 = time.monotonic()
        self.kvlab.start_cluster()
        t1 = time.monotonic()
        carried, drained = self.kvlab.migrate(self)
        print("\n  KubeVirt lab: launcher pods %.1f s, VMI booted %.1f s, two migrations %.1f s (carried: downtime %s ms, "
              "total %s ms)" % (self.kvlab.pods_seconds, t1 - t0 - self.kvlab.pods_seconds, time.monotonic() - t1,
                                carried.downtime_ms, carried.total_time_ms))
        self.wait_until_scraped()
        self.end = time.time()
        self.range_seconds = int(math.ceil(self.end - self.start))
        failures, rows = [], []

        variables = self.resolve_variables()
        print("\n  variables: " + "; ".join("%s = %s" % (k, ", ".join(v)) for k, v in variables.items()))
        self.assertEqual(variables["namespace"], [NAMESPACE])
        self.assertEqual(variables["node"], sorted(["node-a", "node-b"] + list(KV_NODES)))
        # The VMs by KubeVirt's labels: the controller's VM is namespace/name; the hand-made one
        # with a bare name gets the agent's namespace from Prometheus; the VMI its own.
        self.assertEqual(variables["vm_namespace"], sorted({VM.split("/")[0], NAMESPACE, KV_NS}))
        self.assertEqual(variables["vm"], sorted([VM.split("/")[1], BAD_TOKEN_VM, KV_VMI]))
        self.assertEqual(variables["agent_job"], [AGENT_JOB])
        self.assertEqual(variables["controller_job"], [CONTROLLER_JOB])

        # Panels: every query parses and returns data; with only the migrated VM selected too.
        results = {}
        for panel, t in self.targets():
            name = "%s/%s" % (panel["title"], t["refId"])
            err, result = self.evaluate(t["expr"], variables, t.get("instant", False))
            rows.append(("panel", name, "error" if err else "%d (%d with data)" % (
                len(result), sum(1 for s in result if has_data([s])))))
            results[name] = result
            if err:
                failures.append("panel %s: %s\n    %s" % (name, err, t["expr"]))
            elif not has_data(result):
                failures.append("panel %s returns no data\n    %s" % (name, t["expr"]))
            if "$vm" in t["expr"] and not err:
                # One VM selected: the bare-QEMU one, or the VMI for KubeVirt mode's series.
                one_vm = KV_VM if re.search(r"rdmig_(kubevirt|controller_vmi)_", t["expr"]) else VM
                err, result = self.evaluate(t["expr"], dict(variables, vm_namespace=[one_vm.split("/")[0]],
                                                            vm=[one_vm.split("/")[1]]), t.get("instant", False))
                vms = {vm_of(s["metric"]) for s in result if "name" in s["metric"]}
                if err or not has_data(result) or vms - {one_vm}:
                    failures.append("panel %s with vm=%s: %s, VMs %s" % (name, one_vm, err or "no data", vms))

        # Annotations: parse; each event marked once.
        annotations = {}
        for a in self.dashboard["annotations"]["list"]:
            if "expr" not in a:
                continue
            err, result = self.evaluate(a["expr"], variables, instant=False)
            rows.append(("annotation", a["name"], "error" if err else "%d" % len(result)))
            if err:
                failures.append("annotation %s: %s\n    %s" % (a["name"], err, a["expr"]))
            annotations[a["name"]] = {tuple(sorted(s["metric"].items())): sum(1 for v in samples(s)
                                                                             if not math.isnan(v)) for s in result}

        # Alerts: parse, evaluate, rules healthy.
        alert_series = {}
        for where, alert, expr in self.alerts:
            err, result = self.prom.query(expr, at=self.end)
            rows.append(("alert (%s)" % where, alert, "error" if err else "%d" % len(result)))
            alert_series[(where, alert)] = result
            if err:
                failures.append("alert %s (%s): %s" % (alert, where, err))
        rules = self.prom.api("rules")["data"]["groups"]
        for g in rules:
            for r in g["rules"]:
                if r["health"] != "ok":
                    failures.append("rule %s in %s: health %s: %s" % (r["name"], g["name"], r["health"],
                                                                     r.get("lastError")))
        self.assertEqual(sum(len(g["rules"]) for g in rules), len(self.alerts), "Prometheus loaded every rule")

        print("  %-12s %-62s %s" % ("kind", "query", "series"))
        for kind, name, count in rows:
            print("  %-12s %-62s %s" % (kind, name[:62], count))
        self.assertEqual(failures, [], "\n".join(failures) + "\n" + self.prom.log_text()[-2000:])

        # Figures the panels must show after this run.
        by_result = {s["metric"]["result"]: round(samples(s)[0]) for s in results["Migrations by result/A"]}
        self.assertEqual((by_result.get("succeeded"), by_result.get("failed")), (1, 1), by_result)
        reasons = {(s["metric"]["role"], s["metric"]["reason"]): samples(s)[0] for s in results["Failure reasons/A"]}
        self.assertGreaterEqual(sum(v for (role, _r), v in reasons.items() if role == "source"), 1, reasons)
        table = {(vm_of(s["metric"]), s["metric"]["role"], s["metric"]["node"]): samples(s)[0]
                 for s in results["Running and recent migrations/A"]}
        self.assertGreater(table.get((VM, "source", "node-a"), 0), 0, table)
        self.assertIn((VM, "target", "node-b"), table)
        transferred = {(vm_of(s["metric"]), s["metric"]["role"]): samples(s)[0]
                       for s in results["Running and recent migrations/B"]}
        self.assertGreater(transferred.get((VM, "source"), 0), 0, transferred)
        # Phase and transport (F: the last rdmig_migration_info of each), start and end (G, H: ms).
        phases = {(vm_of(s["metric"]), s["metric"]["role"], s["metric"]["node"]):
                  (s["metric"]["phase"], s["metric"].get("transport", "")) for s in results["Running and recent migrations/F"]}
        self.assertEqual(phases, {(VM, "source", "node-a"): ("Succeeded", "tcp"), (VM, "target", "node-b"): ("Succeeded", "tcp"),
                                  (BAD_TOKEN_VM, "source", "node-a"): ("Failed", ""),
                                  (BAD_TOKEN_VM, "target", "node-b"): ("Cancelled", "")}, phases)
        started, ended = [{(vm_of(s["metric"]), s["metric"]["role"]): samples(s)[0] / 1000
                           for s in results["Running and recent migrations/" + ref]} for ref in "GH"]
        self.assertEqual(set(started), {k[:2] for k in phases}, started)
        self.assertEqual(set(ended), set(started), ended)
        for k in started:
            self.assertLessEqual(self.start - 1, started[k], k)
            self.assertLessEqual(started[k], ended[k], k)
            self.assertLessEqual(ended[k], self.end, k)
        self.assertLess(started[(VM, "target")], started[(VM, "source")], "the controller prepares the target first")
        self.assertLessEqual(ended[(VM, "source")], started[(BAD_TOKEN_VM, "source")])
        # Running ones at the end: none (each info series is terminal; a running one has no end time).
        err, running = self.prom.query('rdmig_migration_info{phase!~"Succeeded|Failed|Cancelled"} or '
                                       '(rdmig_migration_start_time_seconds unless on (migration, role) '
                                       'rdmig_migration_end_time_seconds)', at=self.end)
        self.assertEqual((err, running), (None, []))

        # Annotations: each migration's start once with its VM; the success and the failure once.
        starts = {vm_of(dict(k)): n for k, n in annotations["Migration started"].items()}
        self.assertEqual(starts, {VM: 1, BAD_TOKEN_VM: 1}, annotations["Migration started"])
        ok = {(dict(k)["node"], dict(k)["result"]): n for k, n in annotations["Migration succeeded"].items()}
        self.assertEqual(ok, {("node-a", "succeeded"): 1})
        bad = {(dict(k)["node"], dict(k)["result"]): n for k, n in annotations["Migration failed or cancelled"].items()}
        self.assertEqual(bad, {("node-a", "failed"): 1})

        self.check_kubevirt_panels(results, annotations, carried, drained)

        # Alerts after the run: the failure fires on its source node; the first fallback of each
        # agent counts (1 of 1 migrations); agents and controller fine.
        for where in ("manifest", "chart"):
            self.assertEqual([s["metric"].get("node") for s in alert_series[(where, "RdmigMigrationFailed")]],
                             ["node-a"])
            fallback = alert_series[(where, "RdmigRdmaFallback")]
            self.assertEqual([(s["metric"], round(samples(s)[0], 3)) for s in fallback],
                             [({"namespace": NAMESPACE, "job": AGENT_JOB}, 1.0)], where)
            for alert in ("RdmigAgentDown", "RdmigControllerNoLeader", "RdmigVmPausedOnSource",
                          "RdmigControllerReconcileErrors", "RdmigKubevirtHookErrors", "RdmigKubevirtHookNotServed",
                          "RdmigKubevirtNotCarried", "RdmigKubevirtCarriedOverTcp"):
                self.assertEqual(alert_series[(where, alert)], [], alert)

        # Every KubeVirt-mode series the agents and the controller export is read by a panel or an
        # alert, and every one they read is exported (names from this live scrape).
        self.check_kubevirt_names_read_and_exported()
        # The KubeVirt alerts in promtool, on series with the label sets Prometheus scraped here.
        self.check_kubevirt_alerts_with_promtool_on_scraped_series()

        # An agent goes away: RdmigAgentDown's expression names its node, the alert is pending
        # (for: 5m), and the up panel shows it down.
        self.stack.agents[1].stop()
        wait_for(lambda: self.prom.value('up{job="%s", node="node-b"}' % AGENT_JOB) == 0, 30,
                 "Prometheus to see node-b's agent down")
        self.end = time.time()
        for where, alert, expr in self.alerts:
            if alert == "RdmigAgentDown":
                err, result = self.prom.query(expr, at=self.end)
                self.assertEqual([s["metric"]["node"] for s in result], ["node-b"], err)

        def agent_down_alert():
            alerts = self.prom.api("alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "RdmigAgentDown"]
        down = wait_for(agent_down_alert, 15, "RdmigAgentDown to be pending")
        self.assertEqual({(a["labels"]["node"], a["state"]) for a in down}, {("node-b", "pending")})
        firing = {a["labels"]["alertname"] for a in self.prom.api("alerts")["data"]["alerts"] if a["state"] == "firing"}
        self.assertIn("RdmigMigrationFailed", firing)
        self.assertIn("RdmigRdmaFallback", firing)
        up_panel = [t for p, t in self.targets() if p["title"] == "Agents and controller up" and t["refId"] == "A"][0]
        err, result = self.evaluate(up_panel["expr"], variables, instant=True)
        last = {s["metric"]["node"]: samples(s)[0] for s in result}
        self.assertEqual(last, {"node-a": 1.0, "node-b": 0.0, KV_NODES[0]: 1.0, KV_NODES[1]: 1.0}, err)

        # The node hook socket of kv-b disappears: the agent says so at the next scrape, and
        # RdmigKubevirtHookNotServed's expression names kv-b (the alert waits 5 minutes).
        os.unlink(self.kvlab.kv.hook_socket(KV_NODES[1]))
        wait_for(lambda: self.prom.value('rdmig_kubevirt_hook_serving{node="%s"}' % KV_NODES[1]) == 0, 30,
                 "Prometheus to see kv-b's node hook not served")
        for where, alert, expr in self.alerts:
            if alert == "RdmigKubevirtHookNotServed":
                err, result = self.prom.query(expr)
                self.assertEqual([s["metric"]["node"] for s in result], [KV_NODES[1]], err)
        panel = [t for p, t in self.targets() if p["title"] == "Node hook served"][0]
        self.end = time.time()
        err, result = self.evaluate(panel["expr"], variables, instant=True)
        self.assertEqual({s["metric"]["node"]: samples(s)[0] for s in result}, {KV_NODES[0]: 1.0, KV_NODES[1]: 0.0}, err)

    # -- KubeVirt mode: names and alerts from the live scrape ----------------------------------------
    KV_SERIES = r"rdmig_(kubevirt_\w+|controller_vmi_\w+|controller_kubevirt_\w+)"

    def check_kubevirt_names_read_and_exported(self):
        body = self.prom.api("label/__name__/values", **{"match[]": '{__name__=~"rdmig_(kubevirt|controller_vmi|controller_kubevirt)_.+"}',
                                                         "start": "%.3f" % self.start, "end": "%.3f" % time.time()})
        self.assertEqual(body.get("status"), "success", body)
        exported = {re.sub(r"_(bucket|sum|count)$", "", n) for n in body["data"]}
        exprs = [t["expr"] for _p, t in self.targets()] + [a["expr"] for a in self.dashboard["annotations"]["list"]
                                                           if "expr" in a] + [e for _w, _a, e in self.alerts]
        read = {re.sub(r"_(bucket|sum|count)$", "", m.group(0)) for e in exprs for m in re.finditer(self.KV_SERIES, e)}
        print("  KubeVirt-mode series exported: %s" % ", ".join(sorted(exported)))
        self.assertGreater(len(exported), 15, "too few KubeVirt series exported to be the real set")
        self.assertEqual(sorted(exported - read), [], "exported, but no panel or alert reads them")
        self.assertEqual(sorted(read - exported), [], "a panel or alert reads them, but nothing exports them")

    def check_kubevirt_alerts_with_promtool_on_scraped_series(self):
        """promtool test rules over the chart's rules: input series with the label sets scraped here
        (job, instance, namespace, node and the agents' own labels), with scripted values."""
        promtool = shutil.which("promtool")
        self.assertTrue(promtool, "promtool missing (Debian's prometheus package)")

        def scraped(selector):
            err, result = self.prom.query("last_over_time(%s[1h])" % selector, at=self.end)
            self.assertIsNone(err)
            self.assertTrue(result, "nothing scraped for " + selector)
            return [s["metric"] for s in result]

        def series(labels, values):
            name = labels["__name__"]
            text = ", ".join('%s="%s"' % (k, v) for k, v in sorted(labels.items()) if k != "__name__")
            return {"series": "%s{%s}" % (name, text), "values": values}
        a, b = KV_NODES
        on = lambda ls, **kw: [l for l in ls if all(l.get(k) == v for k, v in kw.items())]  # noqa: E731
        hook = scraped('rdmig_kubevirt_hook_calls_total{node=~"%s|%s"}' % (a, b))
        serving = scraped("rdmig_kubevirt_hook_serving")
        ended = scraped('rdmig_kubevirt_migrations_total{role="source", node="%s"}' % a)
        skipped = scraped('rdmig_kubevirt_not_carried_total{node="%s"}' % a)
        info = scraped('rdmig_kubevirt_migration_info{role="source", transport="tcp"}')
        devices = scraped('rdmig_rdma_devices{node=~"%s|%s"}' % (a, b))
        reconciles = scraped("rdmig_controller_reconciles_total")
        inputs = []
        # Hook errors on kv-a from 16m; kv-b's hook socket gone from 2m.
        inputs += [series(l, "0x15 1x15" if l["node"] == a and l["decision"] == "error" else "0x30") for l in hook]
        inputs += [series(l, "1 1 0x28" if l["node"] == b else "1x30") for l in serving]
        # kv-a in the hour: 1 carried, 3 not carried for peer_unreachable, 4 for post_copy.
        counts = {"Succeeded": 1, "NotCarried": 7, "peer_unreachable": 3, "post_copy": 4}
        inputs += [series(l, "0x30 %dx40" % counts.get(l.get("result") or l.get("reason"), 0)) for l in ended + skipped]
        # The carried migration's real info series, between two agents that now report RDMA devices.
        inputs += [series(dict(l, __name__="rdmig_kubevirt_migration_info"), "300x70") for l in info]
        inputs += [series(l, "0 0 1x68") for l in devices]  # at 1m no RDMA device yet: silent
        inputs += [series(l, "0 0 1+1x70" if l["result"] == "error" else "0x72") for l in reconciles]
        fired = {
            "RdmigKubevirtHookErrors": (20, [{"namespace": l["namespace"], "job": l["job"], "node": a}
                                             for l in on(hook, node=a, decision="error")]),
            "RdmigKubevirtHookNotServed": (8, [{"namespace": l["namespace"], "job": l["job"], "node": b}
                                               for l in on(serving, node=b)]),
            "RdmigKubevirtNotCarried": (70, [{"namespace": NAMESPACE, "job": AGENT_JOB}]),
            "RdmigKubevirtCarriedOverTcp": (10, [{"job": AGENT_JOB, "node": l["node"], "target_node": l["target_node"],
                                                  "transport_reason": l["transport_reason"]} for l in info]),
            "RdmigControllerReconcileErrors": (20, [{"namespace": l["namespace"], "job": l["job"]}
                                                    for l in on(reconciles, result="error")]),
        }
        with open(self.rule_files[1]) as f:
            rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
        tests = []
        for alert, (minute, exp) in fired.items():
            rule = [r for r in rules if r.get("alert") == alert][0]
            self.assertEqual(len(exp), 1, (alert, exp))
            tests.append({"eval_time": "%dm" % minute, "alertname": alert, "exp_alerts": [
                {"exp_labels": dict(e, **rule["labels"])} for e in exp]})
            tests.append({"eval_time": "1m", "alertname": alert, "exp_alerts": []})
        # Annotations are the static alerts-test.yaml's business: compare labels only here.
        rules_file = os.path.join(self.stack.tmp, "kv-promtool.rules.yaml")
        with open(self.rule_files[1]) as f:
            doc = yaml.safe_load(f)
        for g in doc["groups"]:
            for r in g["rules"]:
                r.pop("annotations", None)
        with open(rules_file, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        test_file = os.path.join(self.stack.tmp, "kv-promtool.test.yaml")
        with open(test_file, "w") as f:
            yaml.safe_dump({"rule_files": [rules_file], "evaluation_interval": "1m",
                            "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": tests}]}, f,
                           sort_keys=False)
        r = subprocess.run([promtool, "test", "rules", test_file], capture_output=True, text=True, timeout=120)
        with open(test_file) as f:
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr + "\n" + f.read()[:4000])
        print("  promtool on scraped KubeVirt series: %d cases passed" % len(tests))


if __name__ == "__main__":
    unittest.main()
