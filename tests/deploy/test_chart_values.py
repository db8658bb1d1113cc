"""The chart's operator-facing values (issue 12): values.schema.json refusing mistakes at install
time, the conventional values, scheduling, tokens under GitOps, the CRD upgrade path, the
`helm test` hook, Chart.yaml metadata, NOTES without repository paths, the generated chart README
and the aggregated ClusterRoles.

The schema must accept exactly what the programs accept (src/config/agent_config.cpp,
controller/config.cpp): the chunk-size enum is checked here against the agent's own rules
(common/units.cpp parse_bytes + validate_chunk_size).

Run: python3 tests/deploy/test_chart_values.py -v   (ctest -L deploy)
"""
import base64
import json
import os
import re
import subprocess
import sys
import unittest

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploylib import (CHART, NAMESPACE, REPO, TOGGLES, PodListApi, embedded_config, find, helm, one, pod_spec,  # noqa: E402
                       render, render_notes)

SCHEMA = os.path.join(CHART, "values.schema.json")
# ctest passes the built programs; run by hand, the default build directory's.
for var, rel in (("RDMIG_AGENT", "build/agent/rdmig-agent"), ("RDMIG_CONTROLLER", "build/controller/rdmig-controller")):
    os.environ.setdefault(var, os.path.join(REPO, rel))


def template(*args):
    return helm("template", "rdmig", CHART, "-n", NAMESPACE, *args, check=False)


def agent_accepts_chunk_size(text):
    """The agent's rule for migration.chunkSize: parse_bytes (digits, then "", Ki, Mi, Gi, Ti, k,
    M or G) and validate_chunk_size (a power of two in [64Ki, 1Gi])."""
    m = re.fullmatch(r"([0-9]+)(|Ki|Mi|Gi|Ti|k|M|G)", text)
    if not m:
        return False
    mult = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 1000, "M": 10 ** 6, "G": 10 ** 9}
    v = int(m.group(1)) * mult[m.group(2)]
    return v & (v - 1) == 0 and (64 << 10) <= v <= (1 << 30)


class SchemaTest(unittest.TestCase):
    def assert_refused(self, *sets, needle=None):
        args = [a for s in sets for a in ("--set", s)]
        r = template(*args)
        self.assertNotEqual(r.returncode, 0, "helm template %s must fail" % " ".join(sets))
        self.assertIn("values don't meet the specifications of the schema", r.stderr, r.stderr)
        if needle:
            self.assertIn(needle, r.stderr)
        return r.stderr

    def test_defaults_and_every_toggle_pass_the_schema(self):
        for extra in ([], ["-f", TOGGLES]):
            r = template(*extra)
            self.assertEqual(r.returncode, 0, r.stderr)

    def test_typo_in_a_config_key_fails_at_install_time(self):
        err = self.assert_refused("agent.config.migration.chunksize=2Mi", needle="chunksize")
        self.assertIn("Additional property chunksize is not allowed", err)
        self.assert_refused("controller.config.leaderelection.enabled=false", needle="leaderelection")
        self.assert_refused("agent.config.kubevirt.sessionIdle=3", needle="sessionIdle")
        self.assert_refused("agent.nodeselector.a=b", needle="nodeselector")
        self.assert_refused("prometheusrule.enabled=true", needle="prometheusrule")

    def test_wrong_types_fail(self):
        self.assert_refused("agent.config.api.port=abc", needle="agent.config.api.port")
        self.assert_refused("controller.replicas=two", needle="controller.replicas")
        self.assert_refused("kubevirt.enabled=yes", needle="kubevirt.enabled")
        self.assert_refused("agent.config.migration.ringDepth=1", needle="ringDepth")  # below the agent's 2
        self.assert_refused("agent.config.stateDir=relative/dir", needle="stateDir")
        self.assert_refused("agent.config.stateDir=/" + "x" * 40, needle="stateDir")  # unix socket paths
        self.assert_refused("image.digest=latest", needle="image.digest")
        # rdma.trafficClass is a ToS byte with the ECN bits 0, as the agent checks it.
        self.assert_refused("agent.config.rdma.trafficClass=105", needle="trafficClass")
        self.assert_refused("agent.config.rdma.trafficClass=256", needle="trafficClass")
        self.assert_refused("agent.config.rdma.serviceLevel=3", needle="serviceLevel")

    def test_bad_enums_fail(self):
        self.assert_refused("agent.config.migration.chunkSize=3Mi", needle="chunkSize")
        self.assert_refused("agent.config.migration.chunkSize=2Gi", needle="chunkSize")
        self.assert_refused("agent.config.migration.chunkSize=32Ki", needle="chunkSize")
        self.assert_refused("agent.config.transport=infiniband", needle="transport")
        self.assert_refused("agent.config.logLevel=verbose", needle="logLevel")
        self.assert_refused("controller.config.logLevel=trace", needle="logLevel")
        self.assert_refused("agent.config.kubevirt.discovery=dns", needle="discovery")
        self.assert_refused("prometheusRule.downtimeSloSeconds=0.3", needle="downtimeSloSeconds")

    def test_keys_the_chart_sets_are_not_values(self):
        """api.tokenFile, api.tls, agents.port/tokenFile/tls, metrics.tls, namespace and kubevirt.enabled/hookSocket
        in the configs come from the chart; a value there would be overwritten or break the RBAC."""
        for s in ("agent.config.api.tokenFile=/x", "controller.config.agents.port=1",
                  "controller.config.agents.tokenFile=/x", "controller.config.namespace=other",
                  "agent.config.kubevirt.enabled=true", "agent.config.kubevirt.hookSocket=/x.sock",
                  "agent.config.api.tls.certFile=/x", "controller.config.agents.tls.caFile=/x",
                  "controller.config.metrics.tls.certFile=/x"):
            self.assert_refused(s)

    def test_chunk_size_enum_is_exactly_what_the_agent_accepts(self):
        with open(SCHEMA) as f:
            schema = json.load(f)
        cs = schema["properties"]["agent"]["properties"]["config"]["properties"]["migration"]["properties"]["chunkSize"]
        strings = next(o["enum"] for o in cs["oneOf"] if o["type"] == "string")
        ints = next(o["enum"] for o in cs["oneOf"] if o["type"] == "integer")
        # Every spelling without leading zeros the agent accepts, up to its largest (1048576Ki).
        candidates = ["%d%s" % (n, u) for u in ("", "Ki", "Mi", "Gi", "Ti", "k", "M", "G")
                      for n in [1 << p for p in range(0, 31)] + [10 ** p for p in range(0, 10)]]
        accepted = sorted({c for c in candidates if agent_accepts_chunk_size(c)})
        self.assertEqual(sorted(strings), accepted)
        self.assertEqual(sorted(ints), [1 << p for p in range(16, 31)])
        for v in ("1Mi", "1024Ki", "1048576", "64Ki", "1Gi"):
            r = template("--set-string", "agent.config.migration.chunkSize=" + v)
            self.assertEqual(r.returncode, 0, r.stderr)
        r = template("--set", "agent.config.migration.chunkSize=2097152")  # a number, as YAML would give it
        self.assertEqual(r.returncode, 0, r.stderr)
        cfg = embedded_config(one(render("--set", "agent.config.migration.chunkSize=2097152"), "ConfigMap",
                                  "rdmig-agent-config"))["agent.yaml"]
        self.assertEqual(cfg["migration"]["chunkSize"], 2097152, "rendered as a plain integer, not 2.097152e+06")

    def test_enums_match_the_parsers(self):
        with open(os.path.join(REPO, "src", "config", "agent_config.cpp")) as f:
            agent_src = f.read()
        with open(os.path.join(REPO, "src", "common", "log.cpp")) as f:
            log_src = f.read()
        with open(os.path.join(REPO, "src", "common", "transport_kind.cpp")) as f:
            transport_src = f.read()  # parse_transport (issue 39 moved it out of the config)
        with open(SCHEMA) as f:
            schema = json.load(f)
        agent_cfg = schema["properties"]["agent"]["properties"]["config"]["properties"]
        self.assertEqual(sorted(agent_cfg["transport"]["enum"]),
                         sorted(re.findall(r'if \(text == "(\w+)"\) return TransportKind', transport_src)))
        self.assertEqual(sorted(schema["definitions"]["logLevel"]["enum"]),
                         sorted(re.findall(r'name == "(\w+)"', log_src)))
        self.assertEqual(set(agent_cfg), set(re.search(r'check_keys\(root, "", \{([^}]*)\}', agent_src).group(1)
                                             .replace('"', "").replace(" ", "").replace("\n", "").split(",")))


class ValuesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.defaults = render()

    def test_agent_schedules_only_on_labelled_rdma_nodes_and_requests_nothing_by_default(self):
        spec = pod_spec(one(self.defaults, "DaemonSet"))
        self.assertEqual(spec["nodeSelector"], {"feature.node.kubernetes.io/rdma.available": "true"})
        self.assertNotIn("tolerations", spec, "no blanket toleration of every taint")
        res = spec["containers"][0]["resources"]
        self.assertEqual(res, {"requests": {"cpu": "200m", "memory": "2304Mi"}},
                         "no RDMA resource unless configured; memory: bufferBudget 2Gi + 256Mi")
        cfg = embedded_config(one(self.defaults, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
        self.assertEqual(cfg["rdma"]["resourceEnv"], "")

    def test_rails_reach_the_agent_config_and_are_checked(self):
        """rdma.devices (rails) pass through to agent.yaml as given; the SR-IOV resource name is not
        added as rdma.resourceEnv beside them (the agent refuses the single keys next to the list);
        a typo in a rail's key fails at install time."""
        r = template("--set", "agent.config.rdma.devices[0].netdev=ens1f0v0",
                     "--set", "agent.config.rdma.devices[1].netdev=ens2f0v0",
                     "--set", "agent.config.rdma.devices[1].trafficClass=104",
                     "--set", "agent.rdma.resourceName=nvidia.com/sriov_rdma")
        self.assertEqual(r.returncode, 0, r.stderr)
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        cfg = embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
        self.assertEqual(cfg["rdma"]["devices"], [{"netdev": "ens1f0v0"}, {"netdev": "ens2f0v0", "trafficClass": 104}])
        self.assertEqual(cfg["rdma"].get("resourceEnv", ""), "")
        r = template("--set", "agent.config.rdma.devices[0].netdv=ens1f0v0")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("netdv", r.stderr)

    def test_two_releases_in_one_namespace_do_not_collide(self):
        a = render("--set", "kubevirt.enabled=true", release="rdmig-a")
        b = render("--set", "kubevirt.enabled=true", "--set", "crds.install=false", release="rdmig-b")
        names = lambda docs: {(d["kind"], d["metadata"]["name"]) for d in docs}
        self.assertEqual(names(a) & names(b), set(), "object names derive from the release")
        for docs, release in ((a, "rdmig-a"), (b, "rdmig-b")):
            ctl = embedded_config(one(docs, "ConfigMap", release + "-controller-config"))["controller.yaml"]
            self.assertEqual(ctl["agents"]["labelSelector"],
                             "app.kubernetes.io/name=rdmig-agent,app.kubernetes.io/instance=" + release)
            self.assertEqual(ctl["leaderElection"]["leaseName"], release + "-controller")
            agent = embedded_config(one(docs, "ConfigMap", release + "-agent-config"))["agent.yaml"]
            self.assertEqual(agent["kubevirt"]["agentSelector"],
                             "app.kubernetes.io/name=rdmig-agent,app.kubernetes.io/instance=" + release)
            # Every selector of pods names the release: the agents of one are never the other's.
            ds = one(docs, "DaemonSet")
            self.assertEqual(ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"], release)
            lease_rule = [r for r in one(docs, "Role", release + "-controller")["rules"] if "leases" in r["resources"]]
            self.assertIn([release + "-controller"], [r.get("resourceNames") for r in lease_rule])
        # An explicit selector or lease is the operator's.
        docs = render("--set", "controller.config.agents.labelSelector=tier=agents",
                      "--set", "controller.config.leaderElection.leaseName=my-lease")
        ctl = embedded_config(one(docs, "ConfigMap", "rdmig-controller-config"))["controller.yaml"]
        self.assertEqual((ctl["agents"]["labelSelector"], ctl["leaderElection"]["leaseName"]), ("tier=agents", "my-lease"))

    def render_beside(self, found, *args):
        """helm template of release rdmig as `helm install` would render it where `lookup` finds
        `found` (dict of lists daemonsets, deployments, configmaps, crds): the chart's
        rdmig.lookupNamespace is replaced by those objects in a copy. (CompletedProcess, NOTES)."""
        import shutil
        import tempfile
        tmp = tempfile.mkdtemp(prefix="rdmig-beside-")
        try:
            chart = os.path.join(tmp, "rdmig")
            shutil.copytree(CHART, chart)
            helpers = os.path.join(chart, "templates", "_helpers.tpl")
            with open(helpers) as f:
                text = f.read()
            text, n = re.subn(r'\{\{- define "rdmig.lookupNamespace" -\}\}.*?\{\{- end -\}\}',
                              '{{- define "rdmig.lookupNamespace" -}}{{ .Files.Get "found.json" }}{{- end -}}', text, flags=re.S)
            self.assertEqual(n, 1)
            with open(helpers, "w") as f:
                f.write(text)
            with open(os.path.join(chart, "found.json"), "w") as f:
                json.dump(found, f)
            shutil.copy(os.path.join(chart, "templates", "NOTES.txt"), os.path.join(chart, "notes.txt"))
            with open(os.path.join(chart, "templates", "zz-notes.yaml"), "w") as f:
                f.write('apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
                        'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | quote }}\n')
            r = helm("template", "rdmig", chart, "-n", NAMESPACE, *args, check=False)
            notes = ""
            if r.returncode == 0:
                notes = [d for d in yaml.safe_load_all(r.stdout) if d and d["metadata"]["name"] == "notes"][0]["data"]["notes"]
            return r, notes
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_a_second_release_in_the_namespace_is_refused_or_warned_where_it_collides(self):
        # What `lookup` finds at install: release rdmig-a's own objects, as the chart renders them.
        other = render("--set", "kubevirt.enabled=true", release="rdmig-a")
        crds = find(other, "CustomResourceDefinition")
        for crd in crds:
            crd["metadata"]["annotations"].update({"meta.helm.sh/release-name": "rdmig-a",
                                                   "meta.helm.sh/release-namespace": NAMESPACE})
        found = {"daemonsets": find(other, "DaemonSet"), "deployments": find(other, "Deployment"),
                 "configmaps": find(other, "ConfigMap"), "crds": crds}
        # Nothing found (`helm template`, or the first release): no word of it.
        r, notes = self.render_beside({})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("release rdmig-a", notes)
        # The CRDs are the first release's: crds.install=false, or Helm would refuse them.
        r, _ = self.render_beside(found)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("the CRD rdmamigrations.rdmig.io (cluster-wide) belongs to release rdmig-a in namespace "
                      + NAMESPACE + ": install this release with crds.install=false", r.stderr)
        # Both controllers watching every namespace would act on the same RdmaMigrations.
        r, _ = self.render_beside(found, "--set", "crds.install=false")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("release rdmig-a's controller (Deployment rdmig-a-controller) watches every namespace", r.stderr)
        self.assertIn("controller.config.watchNamespace", r.stderr)
        self.assertNotIn("CRD", r.stderr)
        # Own namespaces on both sides: accepted. Same agent ports and stateDir: a warning only (the
        # releases may run on different nodes).
        ctl = one(found["configmaps"], "ConfigMap", "rdmig-a-controller-config")
        cfg = yaml.safe_load(ctl["data"]["controller.yaml"])
        cfg["watchNamespace"] = "team-a"
        ctl["data"]["controller.yaml"] = yaml.safe_dump(cfg)
        r, notes = self.render_beside(found, "--set", "crds.install=false", "--set", "controller.config.watchNamespace=team-a")
        self.assertNotEqual(r.returncode, 0, "the same namespace is refused too")
        self.assertIn("watches namespace team-a and this one would watch namespace team-a", r.stderr)
        ours = ("--set", "crds.install=false", "--set", "controller.config.watchNamespace=team-b", "--set", "kubevirt.enabled=true")
        r, notes = self.render_beside(found, *ours)
        self.assertEqual(r.returncode, 0, r.stderr)
        warning = " ".join(notes.split())
        self.assertIn("WARNING: release rdmig-a's agents (DaemonSet rdmig-a-agent) use the same host port 7470, host port 7471, "
                      "host port 7472, host port 7473, stateDir /var/run/rdmig, kubevirt.hookSocket "
                      "/var/run/kubevirt/plugins/rdmig.sock", warning)
        self.assertIn("agent.nodeSelector", warning)
        # Other ports, stateDir and hook socket: no warning.
        r, notes = self.render_beside(found, *ours, "--set", "agent.config.api.port=7480", "--set", "agent.config.api.probePort=7483",
                                      "--set", "agent.config.dataPlane.port=7481", "--set", "agent.config.dataPlane.rdmaPort=7482",
                                      "--set", "agent.config.stateDir=/var/run/rdmig-b",
                                      "--set", "kubevirt.hookSocket=/var/run/kubevirt/plugins/rdmig-b.sock")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("WARNING: release rdmig-a", notes)
        # Our own release's objects (an upgrade) are not another release.
        mine = render()
        for crd in find(mine, "CustomResourceDefinition"):
            crd["metadata"]["annotations"].update({"meta.helm.sh/release-name": "rdmig", "meta.helm.sh/release-namespace": NAMESPACE})
        r, notes = self.render_beside({"daemonsets": find(mine, "DaemonSet"), "deployments": find(mine, "Deployment"),
                                       "configmaps": find(mine, "ConfigMap"), "crds": find(mine, "CustomResourceDefinition")})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("WARNING: release", notes)

    def test_optional_node_feature_rule_labels_what_the_node_selector_selects(self):
        self.assertEqual(find(self.defaults, "NodeFeatureRule"), [])
        docs = render("--set", "nodeFeatureRule.enabled=true")
        rule = one(docs, "NodeFeatureRule")
        self.assertEqual(rule["apiVersion"], "nfd.k8s-sigs.io/v1alpha1")
        [r] = rule["spec"]["rules"]
        selector = pod_spec(one(docs, "DaemonSet"))["nodeSelector"]
        self.assertEqual(r["labels"], selector, "the rule sets exactly the label the agents select")
        self.assertEqual(r["matchFeatures"], [{"feature": "kernel.loadedmodule", "matchExpressions": {
            "ib_uverbs": {"op": "Exists"}, "rdma_ucm": {"op": "Exists"}}}])

    def test_agent_is_not_evicted_first_and_requests_the_memory_it_can_pin(self):
        spec = pod_spec(one(self.defaults, "DaemonSet"))
        self.assertEqual(spec["priorityClassName"], "system-node-critical")
        # The request follows the budget (locked ring buffers are charged to the pod) ...
        for budget, overhead, want in (("4Gi", "256Mi", "4352Mi"), ("512Mi", "128Mi", "640Mi"),
                                       ("1000000000", "256Mi", "1210Mi"), ("3221225472", "1Gi", "4096Mi")):
            ds = one(render("--set", "agent.config.migration.bufferBudget=" + budget,
                            "--set", "agent.memoryOverhead=" + overhead), "DaemonSet")
            self.assertEqual(pod_spec(ds)["containers"][0]["resources"]["requests"]["memory"], want, budget)
        # ... an explicit request is the operator's, and a limit that cannot hold it is refused.
        ds = one(render("--set", "agent.resources.requests.memory=1Gi"), "DaemonSet")
        self.assertEqual(pod_spec(ds)["containers"][0]["resources"]["requests"]["memory"], "1Gi")
        ds = one(render("--set", "agent.resources.limits.memory=3Gi"), "DaemonSet")
        self.assertEqual(pod_spec(ds)["containers"][0]["resources"]["limits"]["memory"], "3Gi")
        r = helm("template", "rdmig", CHART, "--set", "agent.resources.limits.memory=2Gi", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("agent.resources.limits.memory 2Gi cannot hold agent.config.migration.bufferBudget (2Gi", r.stderr)
        self.assertIn("at least 2304Mi", r.stderr)
        r = helm("template", "rdmig", CHART, "--set", "agent.config.migration.bufferBudget=2GB", check=False)
        self.assertNotEqual(r.returncode, 0)
        # A budget given as a YAML number (bytes) counts the same.
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write("agent:\n  config:\n    migration:\n      bufferBudget: 4294967296\n")
            f.flush()
            ds = one(render("-f", f.name), "DaemonSet")
        self.assertEqual(pod_spec(ds)["containers"][0]["resources"]["requests"]["memory"], "4352Mi")
        # Without a priority class, when an operator says so.
        ds = one(render("--set", "agent.priorityClassName="), "DaemonSet")
        self.assertNotIn("priorityClassName", pod_spec(ds))

    def test_init_container_checks_the_mounted_config_with_the_program_itself(self):
        cases = (("DaemonSet", "rdmig-agent-config", "agent.yaml", ("api", "tokenFile")),
                 ("Deployment", "rdmig-controller-config", "controller.yaml", ("agents", "tokenFile")))
        for docs in (self.defaults, render("--set", "image.tag=9.9.9", "--set", "kubevirt.enabled=true")):
            for kind, cm, key, token_key in cases:
                spec = pod_spec(one(docs, kind))
                main = spec["containers"][0]
                [init] = spec["initContainers"]
                self.assertEqual(init["name"], "check-config")
                self.assertEqual((init["image"], init["command"]), (main["image"], main["command"]), kind)
                config_path = main["args"][main["args"].index("--config") + 1]
                self.assertEqual(init["args"], ["--check-config", config_path])
                self.assertEqual(init["terminationMessagePolicy"], "FallbackToLogsOnError",
                                 "the program's message shows in the pod's status")
                # The config and the token file it names resolve in the init container as in the main one.
                token_path = embedded_config(one(docs, "ConfigMap", cm))[key][token_key[0]][token_key[1]]
                for path in (config_path, token_path):
                    mains = [m for m in main["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
                    inits = [m for m in init["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
                    self.assertTrue(mains, path)
                    self.assertEqual(inits, mains, "%s: %s mounted differently" % (kind, path))
                sc = init["securityContext"]
                self.assertFalse(sc.get("privileged", False))
                self.assertNotIn("add", sc.get("capabilities", {}))
                self.assertEqual(sc["capabilities"]["drop"], ["ALL"])
                self.assertFalse(sc["allowPrivilegeEscalation"])
                self.assertNotIn("nvidia.com/sriov_rdma", json.dumps(init.get("resources", {})))

    def test_init_container_check_passes_on_the_rendered_config(self):
        """The agent's and the controller's own --check-config on the chart's rendered files, with
        the certificate, key and CA the chart generated (agent.tls.mode generate)."""
        import tempfile
        token = base64.b64decode(one(self.defaults, "Secret", "rdmig-token")["data"]["token"]).decode()
        tls = {k: base64.b64decode(v) for k, v in one(self.defaults, "Secret", "rdmig-agent-tls")["data"].items()}
        for var, cm, key, section in (("RDMIG_AGENT", "rdmig-agent-config", "agent.yaml", "api"),
                                      ("RDMIG_CONTROLLER", "rdmig-controller-config", "controller.yaml", "agents")):
            binary = os.environ.get(var, "")
            if not os.access(binary, os.X_OK):
                self.fail("%s not built (%r): ctest sets it" % (var, binary))
            cfg = embedded_config(one(self.defaults, "ConfigMap", cm))[key]
            with tempfile.TemporaryDirectory() as tmp:
                cfg[section]["tokenFile"] = os.path.join(tmp, "token")
                with open(cfg[section]["tokenFile"], "w") as f:
                    f.write(token)
                for name, data in tls.items():
                    with open(os.path.join(tmp, name), "wb") as f:
                        f.write(data)
                for k in ("certFile", "keyFile", "caFile"):
                    if k in cfg[section]["tls"]:
                        self.assertTrue(cfg[section]["tls"][k].startswith("/etc/rdmig/tls/"), cfg[section]["tls"])
                        cfg[section]["tls"][k] = os.path.join(tmp, os.path.basename(cfg[section]["tls"][k]))
                path = os.path.join(tmp, key)
                with open(path, "w") as f:
                    yaml.safe_dump(cfg, f)
                r = subprocess.run([binary, "--check-config", path], capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                cfg["logLevel"] = "verbose"
                with open(path, "w") as f:
                    yaml.safe_dump(cfg, f)
                r = subprocess.run([binary, "--check-config", path], capture_output=True, text=True)
                self.assertEqual(r.returncode, 2, "a bad config must fail the init container")
                self.assertIn("logLevel", r.stderr)
                # A certificate file that is not there fails the check, naming the key.
                del cfg["logLevel"]
                tls_key = "certFile" if section == "api" else "caFile"
                cfg[section]["tls"][tls_key] = os.path.join(tmp, "missing.crt")
                with open(path, "w") as f:
                    yaml.safe_dump(cfg, f)
                r = subprocess.run([binary, "--check-config", path], capture_output=True, text=True)
                self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
                self.assertIn("%s.tls.%s" % (section, tls_key), r.stderr)

    def test_agent_grace_period_follows_shutdown_grace_and_no_pre_stop(self):
        for sets, grace in (((), 300), (("--set", "agent.config.shutdownGraceSeconds=120"), 120)):
            docs = render(*sets)
            cfg = embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
            self.assertEqual(cfg["shutdownGraceSeconds"], grace)
            spec = pod_spec(one(docs, "DaemonSet"))
            self.assertEqual(spec["terminationGracePeriodSeconds"], grace + 10,
                             "the kubelet's SIGKILL must not cut the agent's drain short")
            # SIGTERM itself cancels cleanly; why there is no preStop: docs/deploy.md.
            self.assertNotIn("lifecycle", spec["containers"][0])
        with open(os.path.join(REPO, "docs", "deploy.md")) as f:
            self.assertIn("### Stopping an agent", f.read())

    def test_name_overrides(self):
        docs = render("--set", "nameOverride=vmmove")
        self.assertIn(("DaemonSet", "rdmig-vmmove-agent"), [(d["kind"], d["metadata"]["name"]) for d in docs])
        docs = render("--set", "fullnameOverride=mig")
        names = {d["metadata"]["name"] for d in docs if d["kind"] != "CustomResourceDefinition"}
        self.assertTrue(all(n.startswith("mig-") for n in names), names)
        self.assertEqual(pod_spec(one(docs, "DaemonSet"))["serviceAccountName"], "mig-agent")
        # The selector labels stay: the controller finds the agents by app.kubernetes.io/name.
        self.assertEqual(one(docs, "DaemonSet")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"], "rdmig-agent")

    def test_service_account_annotations(self):
        docs = render("--set", "agent.serviceAccount.annotations.a=b", "--set", "controller.serviceAccount.name=ctl")
        self.assertEqual(one(docs, "ServiceAccount", "rdmig-agent")["metadata"]["annotations"], {"a": "b"})
        self.assertEqual(pod_spec(one(docs, "Deployment"))["serviceAccountName"], "ctl")
        one(docs, "ServiceAccount", "ctl")

    def test_controller_pod_disruption_budget(self):
        pdb = one(self.defaults, "PodDisruptionBudget")
        self.assertEqual(pdb["spec"], {"maxUnavailable": 1, "selector": one(self.defaults, "Deployment")["spec"]["selector"]})
        self.assertEqual(find(render("--set", "controller.replicas=1"), "PodDisruptionBudget"), [],
                         "one replica: no budget that could only block drains")

    def test_token_checksum_is_on_both_pod_templates_and_follows_the_token(self):
        def checksums(docs):
            return [w["spec"]["template"]["metadata"]["annotations"]["checksum/token"]
                    for w in (one(docs, "DaemonSet"), one(docs, "Deployment"))]
        a = render("--set", "token.value=0123456789abcdef0123")
        b = render("--set", "token.value=0123456789abcdef0124")
        self.assertEqual(len(set(checksums(a))), 1, "agents and controller restart together")
        self.assertNotEqual(checksums(a), checksums(b))
        # The generated token is made once per render: the Secret and the annotation agree.
        d = self.defaults
        import hashlib
        token = base64.b64decode(one(d, "Secret", "rdmig-token")["data"]["token"])
        self.assertEqual(checksums(d)[0], hashlib.sha256(token).hexdigest())

    def test_existing_secret_renders_identically_twice(self):
        # GitOps: the token and the agents' certificate from Secrets made outside the chart.
        args = ["--set", "token.existingSecret=gitops-token", "--set", "token.existingSecretKey=t",
                "--set", "agent.tls.mode=secret", "--set", "agent.tls.existingSecret=gitops-tls"]
        first, second = template(*args), template(*args)
        self.assertEqual(first.returncode, 0, first.stderr)
        self.assertEqual(first.stdout, second.stdout, "a GitOps tool must see no change between renders")
        docs = render(*args)
        self.assertEqual(find(docs, "Secret"), [])
        self.assertNotEqual(one(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/token"],
                            one(render("--set", "token.existingSecret=other"), "DaemonSet")
                            ["spec"]["template"]["metadata"]["annotations"]["checksum/token"])
        # Without existingSecret or a value, helm template has no cluster to look up: a new token.
        self.assertNotEqual(template().stdout, template().stdout)

    def test_crds_install_and_keep(self):
        crds = find(self.defaults, "CustomResourceDefinition")
        self.assertEqual(sorted(c["metadata"]["name"] for c in crds), ["rdmadrainplans.rdmig.io", "rdmamigrations.rdmig.io", "rdmapathchecks.rdmig.io"])
        for crd in crds:
            self.assertEqual(crd["metadata"]["annotations"], {"helm.sh/resource-policy": "keep"})
        for crd in find(render("--set", "crds.keep=false"), "CustomResourceDefinition"):
            self.assertNotIn("annotations", crd["metadata"])
        self.assertEqual(find(render("--set", "crds.install=false"), "CustomResourceDefinition"), [])

    def test_helm_test_hook_checks_agents_controller_and_leader(self):
        pod = one(self.defaults, "Pod")
        self.assertEqual(pod["metadata"]["annotations"]["helm.sh/hook"], "test")
        spec = pod["spec"]
        self.assertEqual(spec["restartPolicy"], "Never")
        cmds = {c["name"]: c["command"] for c in spec["containers"]}
        self.assertEqual(cmds["agents-ready"], ["kubectl", "rollout", "status", "daemonset/rdmig-agent",
                                                "--timeout=120s", "--namespace=rdmig-system"])
        # Zero agents scheduled (no node matches agent.nodeSelector) fails the test, saying why
        # (test_helm_test_with_zero_agents_says_why).
        self.assertEqual(cmds["agents-scheduled"][:3], ["kubectl", "get", "pod"])
        self.assertIn("--selector=app.kubernetes.io/name=rdmig-agent,app.kubernetes.io/instance=rdmig",
                      cmds["agents-scheduled"])
        self.assertIn({"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                      one(self.defaults, "Role", "rdmig-test")["rules"])
        self.assertEqual(cmds["controller-available"][:4], ["kubectl", "rollout", "status", "deployment/rdmig-controller"])
        self.assertEqual(cmds["controller-leads"][:4], ["kubectl", "wait", "--for=jsonpath={.spec.holderIdentity}",
                                                        "lease/rdmig-controller"])
        for c in spec["containers"]:
            self.assertEqual(c["image"], "registry.k8s.io/kubectl:v1.32.3")
            self.assertFalse(c["securityContext"]["allowPrivilegeEscalation"])
        for kind in ("ServiceAccount", "Role", "RoleBinding"):
            obj = one(self.defaults, kind, "rdmig-test")
            self.assertEqual(obj["metadata"]["annotations"]["helm.sh/hook"], "test")
        self.assertEqual(spec["serviceAccountName"], "rdmig-test")
        rules = one(self.defaults, "Role", "rdmig-test")["rules"]
        self.assertTrue(all(set(r["verbs"]) <= {"get", "list", "watch"} for r in rules), "read only")
        # Without leader election there is no Lease to check.
        docs = render("--set", "controller.config.leaderElection.enabled=false", "--set", "controller.replicas=1")
        self.assertEqual(sorted(c["name"] for c in one(docs, "Pod")["spec"]["containers"]),
                         ["agents-ready", "agents-scheduled", "controller-available"])
        # kubectl accepts the flags (it parses them before it needs a cluster)
        kubectl = os.path.join(os.path.dirname(helm("version").args[0]), "kubectl")
        for args in cmds.values():
            r = subprocess.run([kubectl] + args[1:] + ["--help"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)

    def test_helm_test_pod_runs_its_own_image_not_rdmigs_tag_or_digest(self):
        # A digest-pinned install (what values.yaml recommends) once gave the test pod
        # registry.k8s.io/kubectl@<rdmig's digest>, an image that does not exist.
        digest, own = "sha256:" + "ab" * 32, "sha256:" + "cd" * 32
        docs = render("--set", "image.digest=" + digest, "--set", "image.tag=9.9.9")
        self.assertEqual({c["image"] for c in one(docs, "Pod")["spec"]["containers"]}, {"registry.k8s.io/kubectl:v1.32.3"})
        self.assertEqual({c["image"] for c in pod_spec(one(docs, "DaemonSet"))["containers"]},
                         {"registry.invalid/rdmig@" + digest})
        docs = render("--set", "image.digest=" + digest, "--set", "tests.image.digest=" + own)
        self.assertEqual({c["image"] for c in one(docs, "Pod")["spec"]["containers"]}, {"registry.k8s.io/kubectl@" + own})
        r = template("--set", "tests.image.repository=")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("tests.image.repository", r.stderr)

    def test_helm_test_with_zero_agents_says_why(self):
        # The agents-scheduled container's own command, run by the real kubectl against an API
        # that holds zero agent pods (no node matches agent.nodeSelector), then one.
        def scheduled(docs):
            return {c["name"]: c["command"] for c in one(docs, "Pod")["spec"]["containers"]}["agents-scheduled"][1:]

        def zero_agents(docs):
            with PodListApi([]) as api:
                r = api.kubectl(scheduled(docs))
            self.assertNotEqual(r.returncode, 0, "zero agent pods fail the test")
            return r.stdout + r.stderr

        out = zero_agents(self.defaults)
        self.assertIn("no rdmig agent pod", out.splitlines()[0], "the cause comes first:\n" + out)
        for needle in ("agent.nodeSelector: feature.node.kubernetes.io/rdma.available=true",
                       "kubectl get nodes -l feature.node.kubernetes.io/rdma.available=true",
                       "node-feature-discovery", "nodeFeatureRule.enabled=true",
                       "kubectl label node <node> feature.node.kubernetes.io/rdma.available=true",
                       "agent.tolerations"):
            self.assertIn(needle, out)
        # With the chart's NodeFeatureRule on, the question is whether NFD runs at all.
        out = zero_agents(render("--set", "nodeFeatureRule.enabled=true"))
        self.assertIn("NodeFeatureRule rdmig-rdma-available", out)
        self.assertIn("is node-feature-discovery running", out)
        self.assertNotIn("nodeFeatureRule.enabled=true", out)
        # An operator's own label: no word of NFD.
        out = zero_agents(render("--set", "agent.nodeSelector.feature\\.node\\.kubernetes\\.io/rdma\\.available=null",
                                 "--set", "agent.nodeSelector.vms=rdma"))
        self.assertIn("agent.nodeSelector: vms=rdma", out)
        self.assertIn("kubectl label node <node> vms=rdma", out)
        self.assertNotIn("node-feature-discovery", out)
        # One agent pod: the check passes and says how many.
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rdmig-agent-x1", "namespace": NAMESPACE}}
        with PodListApi([pod]) as api:
            r = api.kubectl(scheduled(self.defaults))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("1 rdmig agent pod(s)", r.stdout)

    def test_aggregated_cluster_roles(self):
        view, edit = one(self.defaults, "ClusterRole", "rdmig-view"), one(self.defaults, "ClusterRole", "rdmig-edit")
        self.assertEqual(view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"], "true")
        self.assertEqual(edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"], "true")
        self.assertEqual(view["rules"], [{"apiGroups": ["rdmig.io"],
                                          "resources": ["rdmamigrations", "rdmamigrations/status", "rdmapathchecks",
                                                        "rdmapathchecks/status", "rdmadrainplans",
                                                        "rdmadrainplans/status"],
                                          "verbs": ["get", "list", "watch"]}])
        self.assertNotIn("rdmamigrations/status", json.dumps(edit["rules"]), "people do not write status")
        self.assertNotIn("rdmapathchecks/status", json.dumps(edit["rules"]), "people do not write status")
        self.assertNotIn("rdmadrainplans/status", json.dumps(edit["rules"]), "people do not write status")
        self.assertEqual(edit["rules"][0]["resources"], ["rdmamigrations", "rdmapathchecks", "rdmadrainplans"])
        self.assertIn("create", edit["rules"][0]["verbs"])

    def test_prometheus_rule_auto_follows_the_cluster_and_comes_only_with_scraping(self):
        both = ("--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
                "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
        self.assertEqual(find(self.defaults, "PrometheusRule"), [])
        self.assertEqual(find(self.defaults, "ServiceMonitor"), [])
        docs = render(*both)
        one(docs, "PrometheusRule")
        self.assertEqual(len(find(docs, "ServiceMonitor")), 2)
        self.assertEqual(find(render("--set", "prometheusRule.enabled=false", *both), "PrometheusRule"), [])
        # Rules without scraping: RdmigControllerNoLeader's absent() would fire for a controller
        # nobody scrapes. auto leaves them out; true refuses, naming the fix.
        self.assertEqual(find(render("--api-versions", "monitoring.coreos.com/v1/PrometheusRule"), "PrometheusRule"), [])
        self.assertEqual(find(render("--set", "serviceMonitor.enabled=false", *both), "PrometheusRule"), [])
        r = template("--set", "prometheusRule.enabled=true")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("prometheusRule.enabled=true but the chart's ServiceMonitors are off", r.stderr)
        self.assertIn("serviceMonitor.enabled=true", r.stderr)
        # Scraped another way: said explicitly.
        one(render("--set", "prometheusRule.enabled=true", "--set", "prometheusRule.withoutServiceMonitor=true"),
            "PrometheusRule")
        # The job label does not follow the release: ServiceMonitors take it from the Services'
        # app.kubernetes.io/name, which is what the alerts select.
        docs = render("--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
                      release="other")
        services = {s["metadata"]["name"]: s for s in find(docs, "Service")}
        for sm in find(docs, "ServiceMonitor"):
            self.assertEqual(sm["spec"]["jobLabel"], "app.kubernetes.io/name")
            svc = [s for s in services.values()
                   if all(s["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
                   and s["metadata"]["name"].endswith("-metrics")]
            self.assertEqual(len(svc), 1, sm["metadata"]["name"])
            self.assertIn(svc[0]["metadata"]["labels"]["app.kubernetes.io/name"], ("rdmig-agent", "rdmig-controller"))
        rules = one(docs, "PrometheusRule")["spec"]["groups"][0]["rules"]
        text = " ".join(r["expr"] for r in rules)
        self.assertIn('job="rdmig-agent", namespace="rdmig-system"', text)
        self.assertIn('job="rdmig-controller", namespace="rdmig-system"', text)
        for r in rules:
            self.assertEqual(r["labels"]["kubernetes_operator_part_of"], "rdmig", r["alert"])
            self.assertIn(r["labels"]["kubernetes_operator_component"], ("rdmig-agent", "rdmig-controller"))
            self.assertIn(r["labels"]["operator_health_impact"], ("none", "warning", "critical"))

    def test_realistic_overrides_together_keep_every_default_promise(self):
        """The overrides an operator of a KubeVirt cluster with SR-IOV RDMA NICs sets, all at once
        (each is also tested alone above): an image pinned by digest, an SR-IOV device plugin
        resource, a cert-manager ClusterIssuer, monitoring off on a cluster that has the
        Prometheus operator, KubeVirt mode with its Plugin. Every promise of the defaults holds
        in that combination too."""
        digest = "sha256:" + "ab" * 32
        sets = ["image.repository=registry.example.com/infra/rdmig", "image.digest=" + digest,
                "agent.rdma.resourceName=nvidia.com/sriov_rdma",
                "agent.tls.mode=certManager", "agent.tls.certManager.issuerRef.name=my-ca",
                "agent.tls.certManager.issuerRef.kind=ClusterIssuer",
                "agent.tls.certManager.issuerRef.group=cert-manager.io",
                "serviceMonitor.enabled=false", "prometheusRule.enabled=false",
                "kubevirt.enabled=true", "kubevirt.plugin.enabled=true"]
        apis = ["--api-versions", "plugin.kubevirt.io/v1alpha1", "--api-versions", "cert-manager.io/v1",
                "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
                "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]
        docs = render(*[a for x in sets for a in ("--set", x)], *apis)
        ds, deploy = one(docs, "DaemonSet"), one(docs, "Deployment")
        # Image: rdmig's own by digest everywhere; the helm test pod keeps kubectl's.
        for w in (ds, deploy):
            for c in pod_spec(w).get("initContainers", []) + pod_spec(w)["containers"]:
                self.assertEqual(c["image"], "registry.example.com/infra/rdmig@" + digest, c["name"])
        for c in one(docs, "Pod")["spec"]["containers"]:
            self.assertTrue(c["image"].startswith("registry.k8s.io/kubectl"), c["image"])
            self.assertNotIn(digest, c["image"])
        # Placement and QoS: priority class, memory for the budget, the RDMA resource, NFD's label.
        spec = pod_spec(ds)
        self.assertEqual(spec["priorityClassName"], "system-node-critical")
        self.assertEqual(spec["nodeSelector"], {"feature.node.kubernetes.io/rdma.available": "true"})
        res = spec["containers"][0]["resources"]
        self.assertEqual(res["requests"]["memory"], "2304Mi")
        self.assertEqual(str(res["requests"]["nvidia.com/sriov_rdma"]), "1")
        self.assertEqual(str(res["limits"]["nvidia.com/sriov_rdma"]), "1")
        cfg = embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
        self.assertEqual(cfg["rdma"]["resourceEnv"], "nvidia.com/sriov_rdma", "the agent reads PCIDEVICE_NVIDIA_COM_SRIOV_RDMA")
        # TLS from the operator's issuer; no Secret the chart generates for the agents.
        cert = one(docs, "Certificate")
        self.assertEqual(cert["spec"]["issuerRef"], {"name": "my-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})
        self.assertEqual([s for s in find(docs, "Secret") if s["metadata"]["name"].endswith("-agent-tls")], [])
        # Monitoring off: neither scraping nor rules, although the cluster serves both kinds.
        self.assertEqual(find(docs, "ServiceMonitor"), [])
        self.assertEqual(find(docs, "PrometheusRule"), [])
        # KubeVirt on: the agent in KubeVirt mode, the hook socket's host directory, the Plugin.
        self.assertTrue(cfg["kubevirt"]["enabled"])
        self.assertIn("/var/run/kubevirt/plugins", [v.get("hostPath", {}).get("path") for v in spec["volumes"]])
        one(docs, "Plugin")
        # The conditions of both CRDs are list-maps keyed by type.
        for crd in find(docs, "CustomResourceDefinition"):
            for version in crd["spec"]["versions"]:
                cond = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
                self.assertEqual(cond.get("x-kubernetes-list-type"), "map", crd["metadata"]["name"])
                self.assertEqual(cond.get("x-kubernetes-list-map-keys"), ["type"], crd["metadata"]["name"])
        # NOTES name the images and, with the Plugin API served, no missing piece but KubeVirt's gate.
        notes = notes_of(*sets)
        self.assertIn("registry.example.com/infra/rdmig@" + digest, notes)
        self.assertIn("Plugins", notes)

    def test_leader_election_timing_is_checked_at_install(self):
        r = template("--set", "controller.config.leaderElection.renewDeadlineSeconds=20")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("renewDeadlineSeconds must be less than leaseDurationSeconds", r.stderr)


class ChartDocsTest(unittest.TestCase):
    def test_chart_metadata(self):
        with open(os.path.join(CHART, "Chart.yaml")) as f:
            chart = yaml.safe_load(f)
        for k in ("home", "sources", "icon", "maintainers"):
            self.assertTrue(chart.get(k), k)
        self.assertTrue(chart["icon"].startswith("https://"))
        icon = chart["icon"].rsplit("/main/", 1)[1]
        self.assertTrue(os.path.exists(os.path.join(REPO, icon)), "the icon is a file of the repository: " + icon)

    def test_notes_never_point_at_repository_paths(self):
        with open(os.path.join(CHART, "templates", "NOTES.txt")) as f:
            notes = f.read()
        for bad in re.findall(r"(?:docs|operator-manifests|charts|tests|agent|controller|dashboards)/[\w./-]+|\w+\.md\b", notes):
            self.fail("NOTES.txt names %s, which a chart user does not have" % bad)

    def test_chart_readme_is_generated_from_values(self):
        gen = os.path.join(REPO, "scripts", "chart-readme.py")
        r = subprocess.run([sys.executable, gen, "--check"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(os.path.join(CHART, "README.md")) as f:
            readme = f.read()
        with open(os.path.join(CHART, "values.yaml")) as f:
            values = yaml.safe_load(f)

        def leaves(node, path=""):
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    yield from leaves(v, path + "." + k if path else k)
            else:
                yield path
        rows = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
        for path in leaves(values):
            self.assertTrue(any(path == r or path.startswith(r + ".") for r in rows),
                            "the README lists every value: %s is missing" % path)
        self.assertIn("`agent.config.kubevirt.sessionIdleSeconds`", readme, "and the KubeVirt keys from the schema")
        for bad in re.findall(r"\]\((?!https?://|#)[^)]+\)", readme):
            self.fail("README links to %s, a path a chart user does not have" % bad)


def notes_of(*sets):
    """NOTES.txt as Helm renders it for these --set values."""
    return render_notes(*[a for x in sets for a in ("--set", x)])


def strategic_merge(base, patch):
    """kubectl's strategic merge for what operator-manifests/multus/agent-daemonset-patch.yaml uses:
    maps merge key by key, lists of named objects (containers, env, volumes, volumeMounts) by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x for x in base + patch):
        out = [dict(x) for x in base]
        for p in patch:
            i = next((i for i, x in enumerate(out) if x["name"] == p["name"]), None)
            if i is None:
                out.append(p)
            else:
                out[i] = strategic_merge(out[i], p)
        return out
    return patch


class RdmaModesTest(unittest.TestCase):
    """How the agent gets its RDMA device (docs/deploy.md "RDMA device"), one render per mode: the
    SR-IOV device plugin (a VF on the host network, found through PCIDEVICE_<RESOURCE>), the
    shared-device plugin (rdma/... resources, no variable: the interface names the device) and
    Multus (the VF attached as a secondary network, the agent on the pod network)."""

    def agent(self, *sets):
        r = template(*[a for s in sets for a in ("--set", s)])
        self.assertEqual(r.returncode, 0, r.stderr)
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        ds = one(docs, "DaemonSet")
        cfg = embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
        return ds, pod_spec(ds), pod_spec(ds)["containers"][0], cfg

    def assert_host_network_mode(self, ds, spec, main):
        self.assertIs(spec["hostNetwork"], True)
        self.assertEqual(spec["dnsPolicy"], "ClusterFirstWithHostNet")
        self.assertNotIn("k8s.v1.cni.cncf.io/networks", ds["spec"]["template"]["metadata"]["annotations"])
        self.assertNotIn("podinfo", [v["name"] for v in spec["volumes"]])
        self.assertNotIn("POD_IP", [e["name"] for e in main["env"]])

    def test_sriov_device_plugin_mode(self):
        ds, spec, main, cfg = self.agent("agent.rdma.resourceName=nvidia.com/sriov_rdma")
        self.assert_host_network_mode(ds, spec, main)
        self.assertEqual((main["resources"]["requests"]["nvidia.com/sriov_rdma"],
                          main["resources"]["limits"]["nvidia.com/sriov_rdma"]), ("1", "1"))
        self.assertEqual(cfg["rdma"]["resourceEnv"], "nvidia.com/sriov_rdma", "the agent reads PCIDEVICE_NVIDIA_COM_SRIOV_RDMA")
        self.assertNotIn("network", cfg["rdma"])

    def test_shared_device_plugin_mode(self):
        ds, spec, main, cfg = self.agent("agent.rdma.resourceName=rdma/hca_shared_devices_a",
                                         "agent.config.rdma.netdev=ens1f0")
        self.assert_host_network_mode(ds, spec, main)
        self.assertEqual(main["resources"]["limits"]["rdma/hca_shared_devices_a"], "1")
        self.assertEqual((cfg["rdma"]["resourceEnv"], cfg["rdma"]["netdev"]), ("rdma/hca_shared_devices_a", "ens1f0"),
                         "the plugin sets no variable: the interface chooses the device")

    def test_multus_mode_asks_for_the_network_and_mounts_its_status(self):
        ds, spec, main, cfg = self.agent("agent.rdma.network=sriov-rdma", "agent.rdma.resourceName=nvidia.com/sriov_rdma")
        self.assertEqual(ds["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"], "sriov-rdma")
        self.assertIs(spec["hostNetwork"], False, "Multus attaches nothing to a host-network pod")
        self.assertIs(spec["hostPID"], True, "QMP sockets, KubeVirt's processes and their namespaces")
        self.assertEqual(spec["dnsPolicy"], "ClusterFirst")
        env = {e["name"]: e for e in main["env"]}
        self.assertEqual(env["POD_IP"]["valueFrom"], {"fieldRef": {"fieldPath": "status.podIP"}},
                         "peers dial the pod's address, not the node's")
        self.assertEqual(env["POD_NAMESPACE"]["valueFrom"], {"fieldRef": {"fieldPath": "metadata.namespace"}},
                         "a bare network name is looked up in the pod's namespace")
        # The file the agent reads is the downward API file of the annotation.
        self.assertEqual(cfg["rdma"]["network"], "sriov-rdma")
        status_file = cfg["rdma"]["networkStatusFile"]
        [mount] = [m for m in main["volumeMounts"] if status_file.startswith(m["mountPath"] + "/")]
        self.assertTrue(mount.get("readOnly"))
        [vol] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        self.assertEqual(vol["downwardAPI"]["items"], [{
            "path": os.path.relpath(status_file, mount["mountPath"]),
            "fieldRef": {"fieldPath": "metadata.annotations['k8s.v1.cni.cncf.io/network-status']"}}])
        # The VF's resource is still requested, but the agent takes its device from the network's entry.
        self.assertEqual(main["resources"]["limits"]["nvidia.com/sriov_rdma"], "1")
        self.assertEqual(cfg["rdma"].get("resourceEnv", ""), "")
        self.assertIn("ask Multus for sriov-rdma", notes_of("agent.rdma.network=sriov-rdma"))
        self.assertNotIn("Multus", notes_of())

    def test_multus_mode_with_rails_asks_for_every_rails_network(self):
        ds, spec, main, cfg = self.agent("agent.config.rdma.devices[0].network=rail0",
                                         "agent.config.rdma.devices[1].network=rdmig-system/rail1",
                                         "agent.config.rdma.devices[1].trafficClass=104")
        self.assertEqual(ds["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"],
                         "rail0, rdmig-system/rail1")
        self.assertIs(spec["hostNetwork"], False)
        self.assertEqual(cfg["rdma"]["devices"], [{"network": "rail0"},
                                                  {"network": "rdmig-system/rail1", "trafficClass": 104}])
        self.assertEqual(cfg["rdma"]["networkStatusFile"], "/etc/podinfo/network-status")

    def test_multus_mode_rendered_config_passes_the_agents_own_check(self):
        import tempfile
        binary = os.environ.get("RDMIG_AGENT", "")
        if not os.access(binary, os.X_OK):
            self.fail("RDMIG_AGENT not built (%r): ctest sets it" % binary)
        for sets in (("agent.rdma.network=sriov-rdma",), ("agent.config.rdma.devices[0].network=rail0",
                                                           "agent.config.rdma.devices[1].network=rail1")):
            _, _, _, cfg = self.agent("agent.tls.mode=off", *sets)
            with tempfile.TemporaryDirectory() as tmp:
                cfg["api"]["tokenFile"] = os.path.join(tmp, "token")
                with open(cfg["api"]["tokenFile"], "w") as f:
                    f.write("0123456789abcdef0123")
                path = os.path.join(tmp, "agent.yaml")
                with open(path, "w") as f:
                    yaml.safe_dump(cfg, f)
                r = subprocess.run([binary, "--check-config", path], capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_multus_mode_refuses_keys_that_its_network_gives(self):
        for extra, needle in (("agent.config.rdma.netdev=ens1f0", "agent.config.rdma.netdev cannot be set beside agent.rdma.network"),
                              ("agent.config.rdma.device=mlx5_0", "agent.config.rdma.device cannot be set beside"),
                              ("agent.config.rdma.devices[0].network=rail0", "give each rail its own network")):
            r = template("--set", "agent.rdma.network=sriov-rdma", "--set", extra)
            self.assertNotEqual(r.returncode, 0, extra)
            self.assertIn(needle, r.stderr)
        # Names Multus would not take, and the keys the chart sets from agent.rdma.network.
        for s in ("agent.rdma.network=Sriov", "agent.rdma.network=sriov@net1", "agent.rdma.network=a/b/c",
                  "agent.config.rdma.devices[0].network=rail_0", "agent.config.rdma.network=sriov-rdma",
                  "agent.config.rdma.networkStatusFile=/x", "agent.config.rdma.networkWaitSeconds=60"):
            r = template("--set", s)
            self.assertNotEqual(r.returncode, 0, s)
            self.assertIn("values don't meet the specifications of the schema", r.stderr, s)

    def test_plain_manifests_multus_patch_makes_the_charts_multus_pod(self):
        """operator-manifests/multus/agent-daemonset-patch.yaml applied (strategic merge) to the plain
        DaemonSet gives the pod-network settings, volume, mount, env and resource of the chart's
        Multus render; its NetworkAttachmentDefinition example names the same network and resource."""
        manifests = os.path.join(REPO, "operator-manifests")
        with open(os.path.join(manifests, "agent-daemonset.yaml")) as f:
            plain = yaml.safe_load(f)
        with open(os.path.join(manifests, "multus", "agent-daemonset-patch.yaml")) as f:
            patched = strategic_merge(plain, yaml.safe_load(f))
        with open(os.path.join(manifests, "multus", "sriov-rdma-network.yaml")) as f:
            nad = yaml.safe_load(f)
        network, resource = nad["metadata"]["name"], nad["metadata"]["annotations"]["k8s.v1.cni.cncf.io/resourceName"]
        self.assertEqual(nad["kind"], "NetworkAttachmentDefinition")
        nad_config = json.loads(nad["spec"]["config"])
        self.assertEqual([p["type"] for p in nad_config["plugins"]], ["sriov", "rdma"])
        self.assertIn("ipam", nad_config["plugins"][0], "the agent needs the VF's address in network-status")
        ds, spec, main, cfg = self.agent("agent.rdma.network=" + network, "agent.rdma.resourceName=" + resource)
        pspec, pmain = pod_spec(patched), pod_spec(patched)["containers"][0]
        self.assertEqual(patched["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"],
                         ds["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"])
        for k in ("hostNetwork", "hostPID", "dnsPolicy"):
            self.assertEqual(pspec[k], spec[k], k)
        by_name = lambda items: {x["name"]: x for x in items}  # noqa: E731
        self.assertEqual(by_name(pspec["volumes"])["podinfo"], by_name(spec["volumes"])["podinfo"])
        self.assertEqual(by_name(pmain["volumeMounts"])["podinfo"], by_name(main["volumeMounts"])["podinfo"])
        self.assertEqual(by_name(pmain["env"])["POD_IP"], by_name(main["env"])["POD_IP"])
        for k in ("requests", "limits"):
            self.assertEqual(pmain["resources"][k][resource], main["resources"][k][resource])
        self.assertEqual(len(pmain["env"]), len(main["env"]), "no env entry lost or doubled")
        self.assertEqual(pmain["securityContext"], main["securityContext"], "RDMA over the VF: IPC_LOCK added")


if __name__ == "__main__":
    unittest.main()
