"""The Helm chart and the plain manifests: helm lint, helm template with the defaults and with a
values file that changes every toggle, well-formed and self-consistent objects, the chart's CRD
and dashboard copies, and agreement between operator-manifests/ and the rendered chart.

kubectl cannot validate objects here: `kubectl apply/create --dry-run=client` needs an API
server for discovery and OpenAPI, and none can run on these machines. So every object is parsed
and checked for its identity (apiVersion, kind, name, namespace) and for the references between
objects that a cluster would otherwise reject or leave broken (selectors, named ports, volumes,
ConfigMap keys, Secrets, ServiceAccounts, role bindings). The rendered agent and controller
configurations are loaded by the real programs in test_dashboard_metrics.py.

Run: python3 tests/deploy/test_chart.py -v   (ctest -L deploy)
"""
import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from rdmiglab import profile as lab_profile  # noqa: E402  (the profile the lab runs agents under)
from deploylib import (CHART, HELM_LABELS, MANIFESTS, NAMESPACE, REPO, TOGGLES, by_key, dashboard_metric_names,  # noqa: E402
                       diff, embedded_config, find, helm, key, one, plain_manifests, pod_spec, render, render_notes)

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Plugin", "NodeFeatureRule",
                  "SecurityContextConstraints"}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
WORKLOADS = ("DaemonSet", "Deployment")


def check_objects(test, docs, external_secrets=(), external_service_accounts=()):
    """Identity and cross-references of a set of objects, as a cluster would need them."""
    seen = set()
    for d in docs:
        where = "%s %s" % (d.get("kind"), d.get("metadata", {}).get("name"))
        test.assertTrue(d.get("apiVersion"), where + ": apiVersion")
        test.assertTrue(d.get("kind"), where + ": kind")
        md = d.get("metadata") or {}
        name = md.get("name")
        test.assertTrue(name and len(name) <= 253 and DNS_SUBDOMAIN.match(name), where + ": metadata.name")
        if d["kind"] in CLUSTER_SCOPED:
            test.assertNotIn("namespace", md, where + " is cluster-scoped")
        else:
            test.assertTrue(md.get("namespace"), where + ": namespaced object without metadata.namespace")
        for k, v in (md.get("labels") or {}).items():
            test.assertRegex(k, LABEL_KEY, where + ": label key")
            test.assertTrue(isinstance(v, str) and len(v) <= 63 and LABEL_VALUE.match(v), "%s: label %s=%r" % (where, k, v))
        test.assertNotIn(key(d), seen, where + ": defined twice")
        seen.add(key(d))

    objs = by_key(docs)

    def exists(kind, ns, name):
        return (kind, ns, name) in objs

    for w in [d for d in docs if d["kind"] in WORKLOADS]:
        ns, where = w["metadata"]["namespace"], "%s %s" % (w["kind"], w["metadata"]["name"])
        tmpl_labels = w["spec"]["template"]["metadata"]["labels"]
        for k, v in w["spec"]["selector"]["matchLabels"].items():
            test.assertEqual(tmpl_labels.get(k), v, where + ": selector label %s not on the pod template" % k)
        spec = pod_spec(w)
        sa = spec.get("serviceAccountName")
        test.assertTrue(exists("ServiceAccount", ns, sa) or sa in external_service_accounts,
                        where + ": ServiceAccount %s missing" % sa)
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            test.assertRegex(c["image"], r"^[^\s:@]+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[a-f0-9]{64})$",
                             where + ": image")
            ports = {}
            for p in c.get("ports", []):
                test.assertTrue(1 <= p["containerPort"] <= 65535, where + ": port")
                test.assertTrue(len(p["name"]) <= 15 and DNS_LABEL.match(p["name"]), where + ": port name")
                test.assertNotIn(p["name"], ports, where + ": port name twice")
                ports[p["name"]] = p["containerPort"]
            for probe in ("readinessProbe", "livenessProbe"):
                port = c[probe]["httpGet"]["port"]
                test.assertIn(port, ports, "%s: %s port %s is not a container port" % (where, probe, port))
            for m in c.get("volumeMounts", []):
                test.assertIn(m["name"], volumes, where + ": volumeMount without a volume")
        for v in volumes.values():
            sources = v.get("projected", {}).get("sources", [])
            for s in sources + [v]:
                if "configMap" in s:
                    cm = objs.get(("ConfigMap", ns, s["configMap"]["name"]))
                    test.assertIsNotNone(cm, where + ": ConfigMap %s missing" % s["configMap"]["name"])
                    for item in s["configMap"].get("items", []):
                        test.assertIn(item["key"], cm["data"], where + ": ConfigMap key missing")
                if "secret" in s:
                    sname = s["secret"].get("name") or s["secret"].get("secretName")
                    if sname not in external_secrets:
                        sec = objs.get(("Secret", ns, sname))
                        test.assertIsNotNone(sec, where + ": Secret %s missing" % sname)
                        keys = set((sec.get("data") or {}).keys()) | set((sec.get("stringData") or {}).keys())
                        for item in s["secret"].get("items", []):
                            test.assertIn(item["key"], keys, where + ": Secret key missing")

    for s in find(docs, "Service"):
        ns, where = s["metadata"]["namespace"], "Service " + s["metadata"]["name"]
        pods = [w for w in docs if w["kind"] in WORKLOADS and w["metadata"]["namespace"] == ns
                and all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                        for k, v in s["spec"]["selector"].items())]
        test.assertEqual(len(pods), 1, where + ": selects %d workloads" % len(pods))
        names = {p["name"] for c in pod_spec(pods[0])["containers"] for p in c.get("ports", [])}
        for p in s["spec"]["ports"]:
            test.assertIn(p["targetPort"], names, where + ": targetPort")

    for sm in find(docs, "ServiceMonitor"):
        where = "ServiceMonitor " + sm["metadata"]["name"]
        svcs = [s for s in find(docs, "Service") if s["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
                and all(s["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())]
        test.assertEqual(len(svcs), 1, where + ": selects %d Services" % len(svcs))
        for ep in sm["spec"]["endpoints"]:
            test.assertIn(ep["port"], [p["name"] for p in svcs[0]["spec"]["ports"]], where + ": port")

    for b in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
        where = "%s %s" % (b["kind"], b["metadata"]["name"])
        ref = b["roleRef"]
        ns = "" if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"]
        test.assertTrue(exists(ref["kind"], ns, ref["name"]), where + ": roleRef %s missing" % ref["name"])
        for s in b["subjects"]:
            test.assertTrue(exists("ServiceAccount", s["namespace"], s["name"]) or s["name"] in external_service_accounts,
                            where + ": subject missing")


def strip_helm(obj):
    """The rendered object without what only Helm adds (its labels, checksum annotations)."""
    obj = copy.deepcopy(obj)
    for md in (obj.get("metadata", {}), obj.get("spec", {}).get("template", {}).get("metadata", {})):
        for k in HELM_LABELS:
            md.get("labels", {}).pop(k, None)
        ann = md.get("annotations")
        if ann is not None:
            for k in [k for k in ann if k.startswith("checksum/")]:
                del ann[k]
            if not ann:
                del md["annotations"]
    return obj


class ChartTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.defaults = render()
        cls.toggled = render("-f", TOGGLES)
        cls.plain = plain_manifests()

    def test_helm_lint_passes_with_defaults_and_with_every_toggle(self):
        for extra in ([], ["-f", TOGGLES]):
            r = helm("lint", "--strict", CHART, "-n", NAMESPACE, *extra)
            self.assertIn("0 chart(s) failed", r.stdout)

    def test_default_render_holds_every_object_and_each_is_well_formed(self):
        kinds = sorted(key(d) for d in self.defaults)
        expected = [("ClusterRole", "", "rdmig-controller"), ("ClusterRoleBinding", "", "rdmig-controller"),
                    # KubeVirt read only: why a migration was not carried (Plugins, the gate)
                    ("ClusterRole", "", "rdmig-controller-kubevirt-config"),
                    ("ClusterRoleBinding", "", "rdmig-controller-kubevirt-config"),
                    ("ClusterRole", "", "rdmig-view"), ("ClusterRole", "", "rdmig-edit"),
                    # /metrics over HTTPS: token and access reviews; who may read it
                    ("ClusterRole", "", "rdmig-controller-metrics-auth"),
                    ("ClusterRoleBinding", "", "rdmig-controller-metrics-auth"),
                    ("ClusterRole", "", "rdmig-metrics-reader"),
                    ("CustomResourceDefinition", "", "rdmamigrations.rdmig.io"),
                    ("CustomResourceDefinition", "", "rdmapathchecks.rdmig.io"),
                    ("CustomResourceDefinition", "", "rdmadrainplans.rdmig.io"),
                    ("PodDisruptionBudget", NAMESPACE, "rdmig-controller"),
                    # helm test hook: its Pod and the rights to read the agents, controller and Lease
                    ("Pod", NAMESPACE, "rdmig-test"), ("ServiceAccount", NAMESPACE, "rdmig-test"),
                    ("Role", NAMESPACE, "rdmig-test"), ("RoleBinding", NAMESPACE, "rdmig-test"),
                    ("ConfigMap", NAMESPACE, "rdmig-agent-config"), ("ConfigMap", NAMESPACE, "rdmig-controller-config"),
                    ("ConfigMap", NAMESPACE, "rdmig-grafana-dashboard"), ("DaemonSet", NAMESPACE, "rdmig-agent"),
                    ("Deployment", NAMESPACE, "rdmig-controller"), ("Role", NAMESPACE, "rdmig-controller"),
                    ("RoleBinding", NAMESPACE, "rdmig-controller"), ("Secret", NAMESPACE, "rdmig-token"),
                    ("Secret", NAMESPACE, "rdmig-agent-tls"),
                    ("Service", NAMESPACE, "rdmig-agent-metrics"), ("Service", NAMESPACE, "rdmig-controller-metrics"),
                    ("ServiceAccount", NAMESPACE, "rdmig-agent"), ("ServiceAccount", NAMESPACE, "rdmig-controller")]
        self.assertEqual(kinds, sorted(expected))
        check_objects(self, self.defaults)
        token = base64.b64decode(one(self.defaults, "Secret", "rdmig-token")["data"]["token"]).decode()
        self.assertRegex(token, r"^[A-Za-z0-9]{48}$")

    def test_toggled_render_is_well_formed(self):
        check_objects(self, self.toggled, external_secrets=("my-rdmig-token", "my-agent-tls"),
                      external_service_accounts=("vm-agents", "vm-controller"))

    def test_plain_manifests_are_well_formed(self):
        check_objects(self, self.plain)

    CRD_FILES = ("crd-rdmamigrations.yaml", "crd-rdmapathchecks.yaml", "crd-rdmadrainplans.yaml")

    def crd_docs(self):
        docs = []
        for name in self.CRD_FILES:
            with open(os.path.join(MANIFESTS, name)) as f:
                docs.append(yaml.safe_load(f))
        return docs

    def test_chart_crd_equals_operator_manifests_crd_byte_for_byte(self):
        self.assertFalse(os.path.exists(os.path.join(CHART, "crds")),
                         "the CRD is a template (files/ + templates/): crds/ would be installed once, never upgraded")
        rendered = {d["metadata"]["name"]: d for d in find(self.defaults, "CustomResourceDefinition")}
        for name, doc in zip(self.CRD_FILES, self.crd_docs()):
            with open(os.path.join(MANIFESTS, name), "rb") as a, open(os.path.join(CHART, "files", name), "rb") as b:
                self.assertEqual(a.read(), b.read(), "charts/rdmig/files/ differs from operator-manifests/: "
                                 "run python3 tests/deploy/sync_copies.py")
            crd = copy.deepcopy(rendered[doc["metadata"]["name"]])
            self.assertEqual(crd["metadata"].pop("annotations"), {"helm.sh/resource-policy": "keep"})
            self.assertEqual(crd, doc)

    def test_generated_copies_match_their_sources(self):
        r = subprocess.run([sys.executable, os.path.join(REPO, "tests", "deploy", "sync_copies.py"), "--check"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_plain_manifests_and_default_chart_agree_object_for_object(self):
        chart = {key(d): strip_helm(d) for d in render("--set", "serviceMonitor.enabled=true",
                                                       "--set", "prometheusRule.enabled=true", "--skip-tests")}
        for crd_name in ("rdmamigrations.rdmig.io", "rdmapathchecks.rdmig.io", "rdmadrainplans.rdmig.io"):
            # helm.sh/resource-policy: keep (crds.keep), Helm's own
            del chart[("CustomResourceDefinition", "", crd_name)]["metadata"]["annotations"]
        plain = {key(d): d for d in self.plain}
        only_plain = sorted(set(plain) - set(chart))
        only_chart = sorted(set(chart) - set(plain))
        # The chart creates no Namespace (helm install --create-namespace; docs/deploy.md labels it).
        self.assertEqual(only_plain, [("Namespace", "", NAMESPACE)])
        self.assertEqual(only_chart, [])
        for k in sorted(set(plain) & set(chart)):
            p, c = dict(plain[k]), chart[k]
            p.pop("__file__")
            if k[0] == "ConfigMap":
                self.assertEqual(embedded_config(p), embedded_config(c), "%s: embedded files differ" % (k,))
                p, c = dict(p, data=None), dict(c, data=None)
            if k[0] == "Secret":
                self.assertEqual(set(p.pop("stringData")), set(c.pop("data")), "%s: keys differ" % (k,))
            problems = diff(p, c)
            self.assertEqual(problems, [], "%s (%s) differs from the chart:\n  %s"
                             % (k, plain[k]["__file__"], "\n  ".join(problems)))

    def test_images_ports_labels_and_rbac_rules_agree_by_name(self):
        """The same comparison, spelled out for the four things operators look for."""
        chart, plain = self.defaults, self.plain
        for kind in WORKLOADS:
            c, p = one(chart, kind), one(plain, kind)
            self.assertEqual([x["image"] for x in pod_spec(c)["containers"]],
                             [x["image"] for x in pod_spec(p)["containers"]])
            self.assertEqual([x.get("ports") for x in pod_spec(c)["containers"]],
                             [x.get("ports") for x in pod_spec(p)["containers"]])
            self.assertEqual(strip_helm(c)["spec"]["template"]["metadata"]["labels"],
                             p["spec"]["template"]["metadata"]["labels"])
            self.assertEqual(c["spec"]["selector"], p["spec"]["selector"])
        for s in find(plain, "Service"):
            self.assertEqual(one(chart, "Service", s["metadata"]["name"])["spec"]["ports"], s["spec"]["ports"])
        for kind in ("ClusterRole", "Role"):
            for r in find(plain, kind):
                self.assertEqual(one(chart, kind, r["metadata"]["name"])["rules"], r["rules"])
        with open(os.path.join(CHART, "Chart.yaml")) as f:
            image = "registry.invalid/rdmig:" + yaml.safe_load(f)["appVersion"]
        self.assertEqual({c["image"] for w in find(plain, "DaemonSet") + find(plain, "Deployment")
                          for c in pod_spec(w)["containers"]}, {image})

    def test_every_toggle_takes_effect(self):
        t = self.toggled
        with open(TOGGLES) as f:
            toggles = yaml.safe_load(f)
        with open(os.path.join(CHART, "values.yaml")) as f:
            defaults = yaml.safe_load(f)

        def booleans(node, path=""):
            if isinstance(node, dict):
                for k, v in node.items():
                    if k.endswith(("securityContext", "SecurityContext")):
                        continue  # Kubernetes' own fields, passed through: not the chart's toggles
                    yield from booleans(v, path + "." + k)
            elif isinstance(node, bool):
                yield path

        def get(node, path):
            for part in path.strip(".").split("."):
                node = node[part]
            return node
        for path in booleans(defaults):
            self.assertEqual(get(toggles, path), not get(defaults, path), "values-all-toggles.yaml must flip " + path)

        self.assertEqual(find(t, "Secret"), [], "existingSecret: the chart creates no Secret")
        self.assertEqual(find(t, "ConfigMap", "rdmig-grafana-dashboard"), [])
        # The controller's metrics are local only (metrics.secure false): the agents' alone.
        self.assertEqual([m["metadata"]["name"] for m in find(t, "ServiceMonitor")], ["rdmig-agent"])
        for sm in find(t, "ServiceMonitor"):
            self.assertEqual(sm["metadata"]["labels"]["release"], "kube-prometheus-stack")
            self.assertEqual(sm["spec"]["endpoints"][0]["interval"], "30s")

        ds = one(t, "DaemonSet")
        spec, c = pod_spec(ds), pod_spec(ds)["containers"][0]
        self.assertEqual(c["image"], "registry.test/rdmig/agent@sha256:" + "2" * 64, "a digest wins over the tag")
        self.assertEqual(c["imagePullPolicy"], "Always")
        self.assertEqual(spec["imagePullSecrets"], [{"name": "registry-test"}])
        self.assertEqual(c["resources"], {"requests": {"cpu": "500m", "memory": "1Gi", "example.com/rdma_vf": "2"},
                                          "limits": {"memory": "8Gi", "example.com/rdma_vf": "2"}})
        self.assertEqual(spec["nodeSelector"], {"rdmig.test/vm-node": "true"}, "null drops the default label")
        self.assertEqual(spec["tolerations"][0]["key"], "rdmig.test/dedicated")
        self.assertIn("nodeAffinity", spec["affinity"])
        self.assertEqual(spec["priorityClassName"], "system-node-critical")
        self.assertEqual(ds["spec"]["template"]["metadata"]["annotations"]["rdmig.test/agent"], "yes")
        self.assertEqual(ds["spec"]["template"]["metadata"]["labels"]["rdmig.test/agent-label"], "yes")
        self.assertEqual(ds["spec"]["updateStrategy"], {"type": "OnDelete"}, "no rollingUpdate beside OnDelete")
        self.assertEqual(spec["serviceAccountName"], "vm-agents")
        self.assertEqual(spec["securityContext"], {"fsGroup": 1234})
        self.assertEqual(c["securityContext"], {"privileged": True, "runAsUser": 0, "seLinuxOptions": {"type": "spc_t"}},
                         "agent.privileged, agent.securityContext merged over it")
        self.assertIn({"name": "dev-infiniband", "hostPath": {"path": "/dev/infiniband", "type": "DirectoryOrCreate"}},
                      spec["volumes"], "privileged: the node's RDMA devices")
        self.assertEqual(c["args"], ["--config", "/etc/rdmig/agent.yaml", "--test-agent-arg"])
        self.assertEqual(c["env"][-1], {"name": "RDMIG_TEST", "value": "agent"})
        self.assertIn({"name": "agent-extra", "mountPath": "/var/lib/agent-extra"}, c["volumeMounts"])
        self.assertIn({"name": "agent-extra", "emptyDir": {}}, spec["volumes"])
        self.assertEqual([p["containerPort"] for p in c["ports"]], [17470, 17471, 17472, 7473])
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        self.assertTrue({"/var/lib/vms", "/srv/qmp", "/run/other", "/var/run/rdmig-test"} <= mounts)
        self.assertNotIn("/run/vms", mounts)
        secret = [s["secret"] for s in spec["volumes"][0]["projected"]["sources"] if "secret" in s][0]
        self.assertEqual(secret, {"name": "my-rdmig-token", "items": [{"key": "api-token", "path": "token"}]})
        tls_source = [s["secret"] for s in spec["volumes"][0]["projected"]["sources"] if "secret" in s][1]
        self.assertEqual(tls_source, {"name": "my-agent-tls", "items": [
            {"key": "tls.crt", "path": "tls/tls.crt"}, {"key": "tls.key", "path": "tls/tls.key", "mode": 0o400}]})
        agent_cfg = embedded_config(one(t, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]
        self.assertEqual(agent_cfg["migration"]["verifyChunks"], True)
        self.assertEqual(agent_cfg["dataPlane"]["allowLoopbackPeers"], True)
        self.assertEqual(agent_cfg["dataPlane"]["tls"], "on")
        self.assertEqual(agent_cfg["api"], {"address": "0.0.0.0", "port": 17470, "probePort": 7473,
                                            "maxBodyBytes": 131072, "tokenFile": "/etc/rdmig/token",
                                            "tls": {"certFile": "/etc/rdmig/tls/tls.crt",
                                                    "keyFile": "/etc/rdmig/tls/tls.key"}})
        controller_cfg = embedded_config(one(t, "ConfigMap", "rdmig-controller-config"))["controller.yaml"]
        self.assertEqual(controller_cfg["agents"]["tls"], {"caFile": "/etc/rdmig/tls/ca.crt",
                                                           "serverName": "agents.rdmig.test"})
        agent_sm = one(t, "ServiceMonitor", "rdmig-agent")["spec"]["endpoints"][0]
        self.assertEqual((agent_sm["scheme"], agent_sm["tlsConfig"]),
                         ("https", {"serverName": "agents.rdmig.test", "ca": {"secret": {"name": "my-agent-tls",
                                                                                          "key": "ca.crt"}}}))
        self.assertEqual(agent_cfg["rdma"], {"device": "mlx5_0", "netdev": "ens1f0", "address": "192.0.2.10",
                                             "resourceEnv": "PCIDEVICE_TEST", "trafficClass": 104,
                                             "alternateAddresses": ["198.51.100.10"]},
                         "an explicit resourceEnv wins over agent.rdma.resourceName; alternates pass through")
        self.assertEqual((agent_cfg["transport"], agent_cfg["stateDir"], agent_cfg["logLevel"]),
                         ("tcp", "/var/run/rdmig-test", "debug"))
        self.assertEqual(one(t, "Service", "rdmig-agent-metrics")["spec"]["ports"][0]["port"], 17470)

        dep = one(t, "Deployment")
        spec, c = pod_spec(dep), pod_spec(dep)["containers"][0]
        self.assertEqual(c["image"], "registry.test/rdmig/controller@sha256:" + "1" * 64, "image.digest is the fallback")
        self.assertEqual(dep["spec"]["replicas"], 1)
        tmd = dep["spec"]["template"]["metadata"]
        self.assertEqual((tmd["labels"]["rdmig.test/controller-label"], tmd["annotations"]["rdmig.test/controller"]),
                         ("yes", "yes"))
        self.assertEqual(dep["spec"]["strategy"], {"type": "Recreate"})
        self.assertEqual(spec["serviceAccountName"], "vm-controller")
        self.assertEqual(spec["securityContext"]["runAsUser"], 1001)
        self.assertEqual(spec["topologySpreadConstraints"], [{
            "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "rdmig-controller",
                                              "app.kubernetes.io/instance": "rdmig"}}}])
        self.assertEqual(c["args"], ["--config", "/etc/rdmig/controller.yaml", "--test-controller-arg"])
        self.assertEqual(c["env"][-1], {"name": "RDMIG_TEST", "value": "controller"})
        self.assertIn({"name": "controller-extra", "mountPath": "/var/lib/controller-extra"}, c["volumeMounts"])
        self.assertIn({"name": "controller-extra", "emptyDir": {}}, spec["volumes"])
        # serviceAccount.create=false: the named accounts are used, none is made; the bindings name them
        self.assertEqual(find(t, "ServiceAccount"), [])
        self.assertEqual({s["name"] for b in find(t, "RoleBinding") for s in b["subjects"]}, {"vm-agents", "vm-controller"})
        # crds.install, rbac.aggregateTo*, podDisruptionBudget.enabled, tests.enabled off
        for kind in ("CustomResourceDefinition", "PodDisruptionBudget", "Pod"):
            self.assertEqual(find(t, kind), [], kind)
        # Only the agent's own (KubeVirt mode: this node's launcher pods), bound to the named account.
        self.assertEqual([r["metadata"]["name"] for r in find(t, "ClusterRole")],
                         ["rdmig-agent-launchers", "rdmig-agent-vmis"])
        self.assertEqual([s["name"] for b in find(t, "ClusterRoleBinding") for s in b["subjects"]],
                         ["vm-agents", "vm-agents"])
        rule = one(t, "PrometheusRule")
        self.assertEqual(rule["metadata"]["labels"]["release"], "kube-prometheus-stack")
        exprs = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
        self.assertIn('le="0.1"', exprs["RdmigDowntimeOverSlo"]["expr"])
        self.assertTrue(exprs["RdmigRdmaFallback"]["expr"].rstrip().endswith("> 0.25"))
        self.assertEqual(exprs["RdmigAgentDown"]["annotations"]["runbook_url"], "https://runbooks.test/rdmig/RdmigAgentDown.md")
        self.assertEqual(spec["priorityClassName"], "system-cluster-critical")
        self.assertEqual(spec["affinity"], toggles["controller"]["affinity"])
        self.assertEqual(c["ports"], [{"name": "probes", "containerPort": 18081, "protocol": "TCP"}],
                         "local-only metrics: no metrics port, the probes' own")
        self.assertEqual(find(t, "Service", "rdmig-controller-metrics"), [])
        ctl_cfg = embedded_config(one(t, "ConfigMap", "rdmig-controller-config"))["controller.yaml"]
        self.assertEqual(ctl_cfg["metrics"], {"secure": False, "port": 18080, "authCacheEntries": 256})
        self.assertEqual(one(t, "NetworkPolicy")["spec"]["egress"][0]["ports"], [{"protocol": "TCP", "port": 6443}])
        self.assertEqual(one(t, "SecurityContextConstraints")["users"], ["system:serviceaccount:%s:vm-agents" % NAMESPACE])
        self.assertEqual(ctl_cfg["agents"]["port"], 17470, "the controller dials the agents' API port")
        self.assertEqual((ctl_cfg["watchNamespace"], ctl_cfg["leaderElection"]["enabled"]), ("vms", False))
        # The agent's one (KubeVirt mode: list this node's virt-launcher pods) is not the controller's.
        self.assertEqual([r["metadata"]["name"] for r in find(t, "ClusterRole")],
                         ["rdmig-agent-launchers", "rdmig-agent-vmis"],
                         "watchNamespace: no cluster-wide rights for the controller")
        watch_role = one(t, "Role", "rdmig-controller-rdmamigrations")
        self.assertEqual(watch_role["metadata"]["namespace"], "vms")
        own_role = one(t, "Role", "rdmig-controller")
        self.assertEqual(own_role["rules"], [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
                         "no Lease rights without leader election")
        self.assertNotIn("kubevirt.io", json.dumps(watch_role["rules"]), "controller kubevirt.enabled=false: no KubeVirt rights")
        self.assertEqual((ctl_cfg["qemu"], ctl_cfg["kubevirt"]),
                         ({"allowedNamespaces": ["vms"]}, {"enabled": False, "maxReportedVmis": 16, "figuresWaitSeconds": 10}))

        # KubeVirt mode: the Plugin, the hook socket's hostPath, the capabilities, agent.config.kubevirt verbatim.
        plugin = one(t, "Plugin")
        self.assertEqual(plugin["apiVersion"], "plugin.kubevirt.io/v1alpha1")
        self.assertEqual(plugin["spec"]["nodeHooks"], [{"socket": "/var/run/rdmig-test/hooks/agent.sock",
                                                        "permittedHooks": ["PreMigrationSource"],
                                                        "failureStrategy": "Ignore", "timeout": "3s"}])
        ds_spec = pod_spec(ds)
        agent_c = ds_spec["containers"][0]
        self.assertTrue(agent_c["securityContext"]["privileged"], "agent.privileged: no capability list beside it")
        self.assertNotIn("capabilities", agent_c["securityContext"])
        self.assertTrue(ds_spec["hostPID"])
        hooks = {v["name"]: v for v in ds_spec["volumes"]}["kubevirt-hooks"]
        self.assertEqual(hooks["hostPath"]["path"], "/var/run/rdmig-test/hooks")
        self.assertIn({"name": "kubevirt-hooks", "mountPath": "/var/run/rdmig-test/hooks"}, agent_c["volumeMounts"])
        # kubevirt.enabled turns the agent's mode on with the socket the Plugin names; the rest of
        # agent.config.kubevirt passes through.
        self.assertEqual(agent_cfg["kubevirt"], {"enabled": True, "hookSocket": "/var/run/rdmig-test/hooks/agent.sock",
                                                 "sessionIdleSeconds": 3, "discovery": "kubernetes",
                                                 "handlerNamespace": "kubevirt",
                                                 "agentSelector": "app.kubernetes.io/name=rdmig-agent,"
                                                                  "app.kubernetes.io/instance=rdmig"})
        # Peers come from the API: the agent may list pods of its namespace and of KubeVirt's (which
        # processes are virt-handler: those in this node's virt-handler pods), nothing else.
        self.assertTrue(ds_spec["automountServiceAccountToken"])
        role = [d for d in t if d["kind"] == "Role" and d["metadata"]["name"].endswith("-agent-peers")]
        self.assertEqual([r["rules"] for r in role], [[{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]])
        handlers = [d for d in t if d["kind"] == "Role" and d["metadata"]["name"].endswith("-agent-handlers")]
        self.assertEqual([(r["metadata"]["namespace"], r["rules"]) for r in handlers],
                         [("kubevirt", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])])
        self.assertEqual(len([d for d in t if d["kind"] == "RoleBinding"
                              and d["metadata"]["name"].endswith("-agent-handlers")]), 1)
        # This node's virt-launcher pods, in any namespace: which processes are a VMI's launcher.
        launchers = [d for d in t if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-agent-launchers")]
        self.assertEqual([r["rules"] for r in launchers],
                         [[{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]])
        self.assertEqual(len([d for d in t if d["kind"] == "ClusterRoleBinding"
                              and d["metadata"]["name"].endswith("-agent-launchers")]), 1)
        # The VMI a migration names, by name only: what the hook may arm and a target may dial.
        vmis = [d for d in t if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-agent-vmis")]
        self.assertEqual([r["rules"] for r in vmis],
                         [[{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachineinstances"], "verbs": ["get"]}]])
        self.assertEqual(len([d for d in t if d["kind"] == "ClusterRoleBinding"
                              and d["metadata"]["name"].endswith("-agent-vmis")]), 1)

    def test_token_value_rdma_count_and_dashboard_namespace(self):
        docs = render("--set", "token.value=0123456789abcdef0123", "--set", "agent.rdma.resourceName=rdma/hca",
                      "--set", "agent.rdma.resourceCount=2", "--set", "dashboard.namespace=monitoring")
        self.assertEqual(base64.b64decode(one(docs, "Secret", "rdmig-token")["data"]["token"]).decode(),
                         "0123456789abcdef0123")
        res = pod_spec(one(docs, "DaemonSet"))["containers"][0]["resources"]
        self.assertEqual((res["requests"]["rdma/hca"], res["limits"]["rdma/hca"]), ("2", "2"))
        self.assertEqual(embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"]["rdma"]["resourceEnv"],
                         "rdma/hca")
        self.assertEqual(one(docs, "ConfigMap", "rdmig-grafana-dashboard")["metadata"]["namespace"], "monitoring")

    def test_kubevirt_defaults_controller_rights_and_no_agent_privileges(self):
        rules = one(self.defaults, "ClusterRole", "rdmig-controller")["rules"]
        self.assertIn({"apiGroups": ["kubevirt.io"], "resources": ["virtualmachineinstances"], "verbs": ["get", "list"]}, rules)
        self.assertIn({"apiGroups": ["kubevirt.io"], "resources": ["virtualmachineinstancemigrations"],
                       "verbs": ["create", "get", "list", "watch", "delete"]}, rules)
        self.assertEqual(find(self.defaults, "Plugin"), [])
        c = pod_spec(one(self.defaults, "DaemonSet"))["containers"][0]
        self.assertEqual(c["securityContext"], {"privileged": False, "runAsUser": 0, "allowPrivilegeEscalation": False,
                                                "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"},
                                                "capabilities": {"drop": ["ALL"]}},
                         "bare QEMU over TCP (no RDMA device plugin by default): no capability at all")
        self.assertNotIn("kubevirt-hooks", json.dumps(c))
        cfg = embedded_config(one(self.defaults, "ConfigMap", "rdmig-controller-config"))["controller.yaml"]
        self.assertEqual(cfg["qemu"], {"allowedNamespaces": []}, "the bare-QEMU kind is an opt-in")
        r = helm("template", "rdmig", CHART, "--set", "kubevirt.plugin.enabled=true", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("kubevirt.plugin.enabled needs kubevirt.enabled", r.stderr)

    def test_plain_plugin_manifest_equals_the_charts_plugin(self):
        with open(os.path.join(MANIFESTS, "kubevirt", "plugin.yaml")) as f:
            plain = yaml.safe_load(f)
        chart = one(render("--set", "kubevirt.enabled=true", "--set", "kubevirt.plugin.enabled=true"), "Plugin")
        chart = strip_helm(chart)
        chart["metadata"]["name"] = "rdmig"  # the release-prefixed name
        self.assertEqual(diff(plain, chart), [])

    def test_bad_values_fail_with_a_message(self):
        r = helm("template", "rdmig", CHART, "--set", "token.value=short", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("at least 16 characters", r.stderr)
        r = helm("template", "rdmig", CHART, "--set", "controller.config.leaderElection.enabled=false", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("leaderElection", r.stderr)

    def test_other_release_names_prefix_every_object(self):
        docs = render(release="vmmove", namespace="infra")
        self.assertTrue(all(d["metadata"]["name"].startswith("vmmove-rdmig-") for d in docs
                            if d["kind"] != "CustomResourceDefinition"), [key(d) for d in docs])
        check_objects(self, docs)

    def test_dashboard_configmap_carries_the_dashboard_for_the_grafana_sidecar(self):
        with open(os.path.join(REPO, "dashboards", "rdmig.json")) as f:
            dashboard = json.load(f)
        for docs in (self.defaults, self.plain):
            cm = one(docs, "ConfigMap", "rdmig-grafana-dashboard")
            self.assertEqual(cm["metadata"]["labels"]["grafana_dashboard"], "1")
            self.assertEqual(embedded_config(cm)["rdmig.json"], dashboard)

    def test_dashboard_has_the_issue_panels_and_variables(self):
        with open(os.path.join(REPO, "dashboards", "rdmig.json")) as f:
            d = json.load(f)
        self.assertEqual([v["name"] for v in d["templating"]["list"]],
                         ["datasource", "namespace", "node", "agent_job", "controller_job", "vm_namespace", "vm"])
        titles = {p["title"] for p in d["panels"]}
        for t in ("Active migrations", "Throughput per migration", "Last downtime per VM", "Downtime distribution",
                  "Total migration duration", "Transferred bytes", "Chunk size", "Chunk write latency",
                  "Chunks in flight", "Credit stalls", "Transport errors by kind", "Migrations by result",
                  "RDMA versus TCP", "Running and recent migrations", "Failure reasons", "Agents and controller up",
                  "RDMA rails up",
                  # KubeVirt mode (issue 41)
                  "Carried by rdmig (KubeVirt)", "KubeVirt migrations by result", "Not carried, by reason",
                  "Carried and not carried over time", "Carried KubeVirt migrations running, per node",
                  "KubeVirt migrations (per VMI)", "KubeVirt downtime and total time", "KubeVirt downtime distribution",
                  "KubeVirt total time distribution", "KubeVirt throughput per node pair",
                  "RdmaMigrations of VMIs (controller)", "Node hook served",
                  # Drain plans (issue 45)
                  "Drain time: forecast and actual", "Drain plan VMs by state"):
            self.assertIn(t, titles)
        annotations = {a["name"]: a for a in d["annotations"]["list"] if "expr" in a}
        self.assertEqual(sorted(annotations), ["KubeVirt migration carried", "KubeVirt migration not carried",
                                               "Migration failed or cancelled", "Migration started",
                                               "Migration succeeded"])
        for a in annotations.values():
            self.assertEqual(a["datasource"]["uid"], "${datasource}", a["name"])
            # The agents the variables select: by rdmig's namespace, or for a VM's series (whose
            # namespace is the VM's) by the agents' scrape job.
            self.assertTrue('namespace=~"$namespace", node=~"$node"' in a["expr"]
                            or 'job=~"$agent_job", node=~"$node", namespace=~"$vm_namespace"' in a["expr"], a)
        ids = [p["id"] for p in d["panels"]]
        self.assertEqual(len(ids), len(set(ids)))
        for p in d["panels"]:
            if p["type"] == "row":
                continue
            self.assertEqual(p["datasource"]["uid"], "${datasource}", p["title"])
            for t in p["targets"]:
                if "rdmig_controller_" not in t["expr"] and "$controller_job" not in t["expr"]:
                    self.assertIn('node=~"$node"', t["expr"], p["title"])
                # rdmig's namespace, or for a VM's series the agents' (or the controller's) scrape
                # job (which the *_job variables take from rdmig's namespace) and the VM's namespace;
                # a drain plan's series (its own namespace and name) by the controller's job.
                self.assertTrue('namespace=~"$namespace"' in t["expr"]
                                or 'job=~"$agent_job", node=~"$node", namespace=~"$vm_namespace"' in t["expr"]
                                or 'job=~"$controller_job", namespace=~"$vm_namespace"' in t["expr"]
                                or ("rdmig_controller_drainplan_" in t["expr"]
                                    and '{job=~"$controller_job"}' in t["expr"]),
                                (p["title"], t["expr"]))

    def test_service_monitors_let_the_vm_namespace_label_win(self):
        """honorLabels: the per-VM series keep their VM's `namespace` (as KubeVirt's own migration
        metrics are read), not the exported_namespace Prometheus renames it to otherwise. Safe only
        while no program exports another label a target gets, and while the alerts and the
        dashboard select rdmig's namespace only on series that carry none of their own."""
        chart = find(render("--set", "serviceMonitor.enabled=true"), "ServiceMonitor")
        plain = find(self.plain, "ServiceMonitor")
        self.assertEqual(len(chart), 2)
        self.assertEqual(len(plain), 2)
        for sm in chart + plain:
            for ep in sm["spec"]["endpoints"]:
                self.assertIs(ep.get("honorLabels"), True, sm["metadata"]["name"])

        sources = ""
        for rel in ("src/metrics/metrics.cpp", "src/kubevirt/flow/kubevirt_metrics.cpp", "controller/controller_metrics.cpp"):
            with open(os.path.join(REPO, rel)) as f:
                sources += f.read()
        labels = set(re.findall(r'\{"([a-z_]+)", ', sources)) | set(re.findall(r'\w+\["([a-z_]+)"\] = ', sources))
        self.assertTrue({"role", "namespace", "name", "phase"} <= labels, sorted(labels))
        self.assertNotIn("vm", labels, "per-VM series use KubeVirt's namespace and name labels")
        target_labels = {"job", "instance", "pod", "service", "endpoint", "container", "node"}
        self.assertEqual(labels & target_labels, set(), "a program label would override a target label")

        # The series that carry their VM's namespace (KubeVirt's and the bare-QEMU per-migration
        # and per-VM ones): nothing selects rdmig's namespace on them, only the VM's.
        vm_namespaced = re.compile(
            r"\brdmig_(kubevirt_migration_\w+|controller_vmi_migration_\w+|migration_(total_bytes|transferred_bytes|"
            r"remaining_bytes|throughput_bytes_per_second|dirty_rate_bytes_per_second|info|start_time_seconds|"
            r"end_time_seconds)|last_(downtime|switchover)_seconds)\{[^}]*\bnamespace=~?\"(?!\$vm_namespace\")")
        with open(os.path.join(REPO, "dashboards", "rdmig.json")) as f:
            _, exprs = dashboard_metric_names(json.load(f))
        rule = one(render("--set", "prometheusRule.enabled=true", "--set", "serviceMonitor.enabled=true"), "PrometheusRule")
        exprs = list(exprs) + [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
        self.assertGreater(len(exprs), 20)
        for expr in exprs:
            self.assertIsNone(vm_namespaced.search(expr), expr)

    def test_dashboard_metric_names_are_registered_in_the_sources(self):
        """Static half of the metric check (the live half scrapes real processes)."""
        with open(os.path.join(REPO, "dashboards", "rdmig.json")) as f:
            names, _ = dashboard_metric_names(json.load(f))
        sources = ""
        for rel in ("src/metrics/metrics.cpp", "src/kubevirt/flow/kubevirt_metrics.cpp", "controller/controller_metrics.cpp"):
            with open(os.path.join(REPO, rel)) as f:
                sources += f.read()
        registered = set(re.findall(r'Name\("(rdmig_[A-Za-z0-9_]+)"\)', sources))
        for n in sorted(names):
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            self.assertTrue(n in registered or base in registered, "dashboard uses %s; no source registers it" % n)

    def test_notes_tell_how_to_start_and_watch_a_migration(self):
        for extra in ([], ["-f", TOGGLES]):
            notes = render_notes(*extra)
            for needle in ("kind: RdmaMigration", "kubectl apply -f -", "kubectl get rdmig -A -w",
                           "kubectl describe rdmig", '"cancel":true', "source: {vmi: {name: web-1}}",
                           "CarriedByRdmig", "involvedObject.kind=VirtualMachineInstance",
                           "helm test rdmig -n rdmig-system --logs"):  # --logs: why a check failed
                self.assertIn(needle, notes)
            self.assertNotIn("<no value>", notes)
            self.assertIn('feature gate "Plugins"', notes)
            self.assertEqual("kubectl patch kubevirt" in notes, bool(extra), "the gate's commands once the Plugin is made")
            self.assertEqual("A bare QEMU (namespaces vms only)" in notes, bool(extra))
            # Which image each program runs (the toggles file pins the agent by digest).
            self.assertRegex(notes, r"Images: agent \S+\n\s+controller \S+")


class ImageRequiredTest(unittest.TestCase):
    def test_an_install_without_image_repository_fails_naming_what_to_set(self):
        # No default image: a privileged hostPID agent must not come from a public name anyone
        # could claim (the old default was rdmig/rdmig on Docker Hub).
        for args in ([], ["--set", "agent.image.repository=reg.example/agent-only"]):
            r = helm("template", "rdmig", CHART, "-n", NAMESPACE, "--set", "image.repository=", *args, check=False)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn("image.repository is required", r.stderr)
            self.assertIn("--set image.repository=<registry>/rdmig", r.stderr)
        docs = render("--set", "image.repository=reg.example/infra/rdmig", "--set", "image.digest=sha256:" + "a" * 64)
        images = {c["image"] for w in find(docs, "DaemonSet") + find(docs, "Deployment")
                  for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", [])}
        self.assertEqual(images, {"reg.example/infra/rdmig@sha256:" + "a" * 64})


class KubevirtPluginApiNotesTest(unittest.TestCase):
    def test_notes_say_whether_the_cluster_serves_kubevirts_plugin_api(self):
        # What `helm install` can check of KubeVirt's side: its discovery (Capabilities, which
        # --api-versions stands in for here) lists the Plugin API or not. Without it the Plugin
        # object itself cannot be created, and with only the agents' mode on nothing registers
        # the hook: the NOTES say which, naming the controller's reason.
        served = ("--api-versions", "plugin.kubevirt.io/v1alpha1/Plugin")
        on = ("--set", "kubevirt.enabled=true")
        notes = render_notes(*on, *served)
        self.assertIn("this cluster serves KubeVirt's Plugin API (plugin.kubevirt.io/v1alpha1)", notes)
        self.assertNotIn("WARNING, checked as Helm installed", notes)
        notes = render_notes(*on)
        self.assertIn("WARNING, checked as Helm installed: this cluster serves no plugin.kubevirt.io/v1alpha1", notes)
        self.assertIn("PluginApiMissing", notes)
        for notes in (render_notes(), render_notes(*served)):  # KubeVirt mode off: nothing to check
            self.assertNotIn("checked as Helm installed", notes)


def json_patch_add(obj, path, value):
    """RFC 6902 "add" as an API server applies it (a missing parent fails; "-" appends)."""
    obj = copy.deepcopy(obj)
    *parents, last = path.lstrip("/").split("/")
    where = obj
    for p in parents:
        where = where[p]  # KeyError: the patch fails
    if isinstance(where, list):
        where.append(value) if last == "-" else where.insert(int(last), value)
    else:
        where[last] = value
    return obj


def merge_patch(obj, patch):
    """RFC 7386 JSON merge patch: objects merge, anything else (a list too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(obj) if isinstance(obj, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class KubevirtModeNotesTest(unittest.TestCase):
    """What the NOTES tell about the KubeVirt path (issue 19): the three things carrying needs, and
    a command for KubeVirt's Plugins gate that works whether its featureGates list exists or not."""

    def test_defaults_name_the_three_things_kubevirt_mode_needs(self):
        notes = render_notes()
        for needle in ("kubevirt.enabled=true", "kubevirt.plugin.enabled=true", 'feature gate "Plugins"',
                       "helm upgrade rdmig <chart> -n rdmig-system --reuse-values --set kubevirt.enabled=true "
                       "--set kubevirt.plugin.enabled=true"):
            self.assertIn(needle, notes)

    def test_gate_commands_use_kubevirt_namespace_and_fit_a_list_or_none(self):
        gates = ["spec", "configuration", "developerConfiguration", "featureGates"]
        with_list = {"spec": {"configuration": {"developerConfiguration": {"featureGates": ["LiveMigration"]}}}}
        without = {"spec": {"configuration": {}}, "metadata": {"name": "kubevirt"}}

        def gates_of(obj):
            for k in gates:
                obj = obj[k]
            return obj

        for extra in (["--set", "kubevirt.enabled=true"], ["--set", "kubevirt.enabled=true", "--set", "kubevirt.plugin.enabled=true"]):
            notes = render_notes(*extra, "--set", "kubevirt.namespace=virt")
            self.assertNotIn("-n kubevirt", notes, "kubevirt.namespace, not a fixed namespace")
            self.assertIn("kubectl get kubevirt -n virt -o jsonpath=", notes)
            patches = re.findall(r"kubectl patch kubevirt kubevirt -n virt --type (json|merge) -p '([^']*)'", notes)
            self.assertEqual([t for t, _ in patches], ["json", "merge"], notes)
            (_, json_text), (_, merge_text) = patches
            [op] = json.loads(json_text)
            self.assertEqual(op["op"], "add")
            # A list: the JSON patch appends and keeps the other gates; the merge patch would drop them.
            self.assertEqual(gates_of(json_patch_add(with_list, op["path"], op["value"])), ["LiveMigration", "Plugins"])
            self.assertEqual(gates_of(merge_patch(with_list, json.loads(merge_text))), ["Plugins"])
            # No list: the JSON patch fails (as the old NOTES' only command did), the merge patch makes it.
            with self.assertRaises(KeyError):
                json_patch_add(without, op["path"], op["value"])
            self.assertEqual(gates_of(merge_patch(without, json.loads(merge_text))), ["Plugins"])
        self.assertIn("kubectl get kubevirt -n kubevirt -o jsonpath=",
                      render_notes("--set", "kubevirt.enabled=true"), "the default kubevirt.namespace")

    def test_notes_say_post_copy_is_never_carried(self):
        for extra in ([], ["-f", TOGGLES]):
            notes = " ".join(render_notes(*extra).split())
            self.assertIn("Never carried, by design: post-copy migrations (a MigrationPolicy or the KubeVirt config "
                          "with allowPostCopy, or mode PostCopy)", notes)


class AgentPrivilegesTest(unittest.TestCase):
    """The agent's securityContext per mode (docs/security.md "The agent's privileges"): unprivileged
    by default with the capabilities of the enabled modes only (files/agent-capabilities.yaml),
    privileged only as an explicit value; and the lab's profile (tools/rdmiglab/profile.py, under
    which tests/integration, tests/kubevirt and tests/rdma run their agents) equal to it."""

    RESOURCE = "agent.rdma.resourceName=nvidia.com/sriov_rdma"
    # (KubeVirt mode, RDMA) -> values
    MODES = {(False, False): [], (False, True): [RESOURCE], (True, False): ["kubevirt.enabled=true"],
             (True, True): ["kubevirt.enabled=true", RESOURCE]}

    def agent(self, *sets):
        spec = pod_spec(one(render(*[a for x in sets for a in ("--set", x)]), "DaemonSet"))
        return spec, spec["containers"][0]

    def test_the_lab_runs_the_agent_under_exactly_the_charts_security_context(self):
        with open(lab_profile.CAPABILITIES_FILE) as f:
            self.assertEqual(lab_profile.chart_capabilities(), yaml.safe_load(f), "the lab reads the chart's file as YAML does")
        seen = set()
        for (kubevirt, rdma), sets in self.MODES.items():
            spec, c = self.agent(*sets)
            lab = lab_profile.for_modes(kubevirt, rdma)
            self.assertEqual(c["securityContext"], lab.security_context(), "kubevirt=%s rdma=%s" % (kubevirt, rdma))
            seen.add(tuple(lab.caps))
            # The lab's agents pick their mode from their config as the chart does from values.
            cfg = {"transport": "rdma" if rdma else "tcp", "kubevirt": {"enabled": kubevirt}}
            self.assertEqual(lab_profile.for_config(cfg).caps, lab.caps)
        self.assertEqual(sorted(seen), [(), ("DAC_OVERRIDE", "IPC_LOCK", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"),
                                        ("DAC_OVERRIDE", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"), ("IPC_LOCK",)])
        # Kubernetes refuses allowPrivilegeEscalation: false beside SYS_ADMIN: KubeVirt mode leaves it out.
        self.assertNotIn("allowPrivilegeEscalation", self.agent("kubevirt.enabled=true")[1]["securityContext"])

    def test_rdma_is_on_with_a_device_plugin_or_multus_and_off_over_tcp(self):
        def caps(*sets):
            return self.agent(*sets)[1]["securityContext"]["capabilities"].get("add", [])
        self.assertEqual(caps(self.RESOURCE), ["IPC_LOCK"])
        self.assertEqual(caps("agent.rdma.network=sriov-rdma"), ["IPC_LOCK"], "Multus: the injector adds the resource")
        self.assertEqual(caps("agent.config.rdma.resourceEnv=PCIDEVICE_X"), ["IPC_LOCK"])
        self.assertEqual(caps(self.RESOURCE, "agent.config.transport=tcp"), [], "tcp: no RDMA, no IPC_LOCK")
        self.assertEqual(caps(), [], "auto without a device plugin: an unprivileged agent opens no RDMA device")
        self.assertIn("open no RDMA device and migrate over TCP", render_notes(), "the NOTES say so")
        self.assertNotIn("open no RDMA device", render_notes("--set", self.RESOURCE))
        for sets in ([], [self.RESOURCE], ["kubevirt.enabled=true"]):
            spec, c = self.agent(*sets)
            self.assertNotIn("dev-infiniband", json.dumps(spec), "unprivileged: devices come from the device plugin")
        for bad in (["agent.config.transport=rdma"], ["agent.config.rdma.netdev=ens1f0"], ["agent.config.rdma.device=mlx5_0"]):
            r = helm("template", "rdmig", CHART, *[a for x in bad for a in ("--set", x)], check=False)
            self.assertNotEqual(r.returncode, 0, bad)
            self.assertIn("set agent.rdma.resourceName (or agent.rdma.network), or agent.privileged: true", r.stderr)
        # The same with a device plugin, or privileged, renders.
        self.agent("agent.config.transport=rdma", self.RESOURCE)
        self.agent("agent.config.rdma.netdev=ens1f0", "agent.privileged=true")

    def test_privileged_is_an_explicit_value(self):
        spec, c = self.agent("agent.privileged=true", "kubevirt.enabled=true")
        self.assertEqual(c["securityContext"], {"privileged": True, "runAsUser": 0})
        self.assertIn({"name": "dev-infiniband", "mountPath": "/dev/infiniband"}, c["volumeMounts"])
        r = helm("template", "rdmig", CHART, "--set", "agent.securityContext.privileged=true", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("agent.securityContext.privileged: set agent.privileged: true instead", r.stderr)
        # agent.securityContext is merged over the chart's: a capabilities.add given there replaces the list.
        spec, c = self.agent("agent.securityContext.capabilities.add={DAC_OVERRIDE}")
        self.assertEqual(c["securityContext"]["capabilities"], {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]})
        self.assertTrue(c["securityContext"]["readOnlyRootFilesystem"])


class AgentTlsModesTest(unittest.TestCase):
    """agent.tls.mode: generate (default), certManager, secret and off, each rendered: where the
    certificate comes from, what each pod mounts, both programs' configs, the ServiceMonitor."""

    def tls_sources(self, docs, kind):
        """The projected config volume's sources that are not the token's Secret."""
        sources = pod_spec(one(docs, kind))["volumes"][0]["projected"]["sources"]
        return [s["secret"] for s in sources if "secret" in s and s["secret"]["name"] != "rdmig-token"]

    def configs(self, docs):
        return (embedded_config(one(docs, "ConfigMap", "rdmig-agent-config"))["agent.yaml"],
                embedded_config(one(docs, "ConfigMap", "rdmig-controller-config"))["controller.yaml"])

    def assert_wired(self, docs, secret, server_name):
        """Agents mount tls.crt/tls.key, the controller only ca.crt, from `secret`; configs and the
        agents' ServiceMonitor point at them; both pod templates carry the same checksum/tls."""
        self.assertEqual(self.tls_sources(docs, "DaemonSet"), [{"name": secret, "items": [
            {"key": "tls.crt", "path": "tls/tls.crt"}, {"key": "tls.key", "path": "tls/tls.key", "mode": 0o400}]}])
        self.assertEqual(self.tls_sources(docs, "Deployment"),
                         [{"name": secret, "items": [{"key": "ca.crt", "path": "tls/ca.crt"}]}])
        agent, controller = self.configs(docs)
        self.assertEqual(agent["api"]["tls"], {"certFile": "/etc/rdmig/tls/tls.crt", "keyFile": "/etc/rdmig/tls/tls.key"})
        self.assertEqual(controller["agents"]["tls"], {"caFile": "/etc/rdmig/tls/ca.crt", "serverName": server_name})
        sm = {m["metadata"]["name"]: m["spec"]["endpoints"][0] for m in find(docs, "ServiceMonitor")}
        self.assertEqual((sm["rdmig-agent"]["scheme"], sm["rdmig-agent"]["tlsConfig"]),
                         ("https", {"serverName": server_name, "ca": {"secret": {"name": secret, "key": "ca.crt"}}}))
        self.assertEqual((sm["rdmig-controller"]["scheme"], sm["rdmig-controller"]["tlsConfig"]),
                         ("https", {"insecureSkipVerify": True}), "the controller's own: its self-signed certificate")
        sums = {w["spec"]["template"]["metadata"]["annotations"]["checksum/tls"]
                for w in (one(docs, "DaemonSet"), one(docs, "Deployment"))}
        self.assertEqual(len(sums), 1, "a new certificate restarts agents and controller together")
        # The probes stay plain HTTP on their own port (the kubelet has no CA).
        c = pod_spec(one(docs, "DaemonSet"))["containers"][0]
        self.assertEqual(c["readinessProbe"]["httpGet"].get("scheme", "HTTP"), "HTTP")
        self.assertEqual(c["readinessProbe"]["httpGet"]["port"], "probes")

    def test_generate_makes_a_ca_and_a_certificate_for_the_server_name(self):
        docs = render("--set", "serviceMonitor.enabled=true", "--set", "agent.tls.serverName=agents.example.test")
        self.assert_wired(docs, "rdmig-agent-tls", "agents.example.test")
        sec = one(docs, "Secret", "rdmig-agent-tls")
        self.assertEqual((sec["type"], sorted(sec["data"])), ("kubernetes.io/tls", ["ca.crt", "tls.crt", "tls.key"]))
        self.assertEqual(find(docs, "Certificate") + find(docs, "Issuer"), [])
        tmp = tempfile.mkdtemp(prefix="rdmig-tls-")
        try:
            for k, v in sec["data"].items():
                with open(os.path.join(tmp, k), "wb") as f:
                    f.write(base64.b64decode(v))

            def openssl(*args):
                r = subprocess.run(("openssl",) + args, capture_output=True, text=True, cwd=tmp)
                self.assertEqual(r.returncode, 0, r.stderr)
                return r.stdout
            self.assertIn("tls.crt: OK", openssl("verify", "-CAfile", "ca.crt", "tls.crt"))
            ext = openssl("x509", "-in", "tls.crt", "-noout", "-ext", "subjectAltName,extendedKeyUsage")
            self.assertEqual(re.findall(r"(DNS|IP Address):([^,\s]+)", ext), [("DNS", "agents.example.test")])
            self.assertIn("TLS Web Server Authentication", ext)
            # The key is the certificate's: the same public key.
            self.assertEqual(openssl("x509", "-in", "tls.crt", "-noout", "-pubkey"),
                             openssl("pkey", "-in", "tls.key", "-pubout"))
            self.assertIn("CA:TRUE", openssl("x509", "-in", "ca.crt", "-noout", "-ext", "basicConstraints"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # Without a cluster to look the Secret up in, every render makes a new one (NOTES say so).
        self.assertNotEqual(*[one(render(), "Secret", "rdmig-agent-tls")["data"]["tls.crt"] for _ in range(2)])

    def test_cert_manager_makes_its_own_ca_chain_or_uses_the_given_issuer(self):
        docs = render("--set", "serviceMonitor.enabled=true", "--set", "agent.tls.mode=certManager")
        self.assert_wired(docs, "rdmig-agent-tls", "rdmig-agent")
        self.assertEqual(find(docs, "Secret", "rdmig-agent-tls"), [], "cert-manager writes it")
        issuers = {i["metadata"]["name"]: i["spec"] for i in find(docs, "Issuer")}
        self.assertEqual(issuers, {"rdmig-selfsigned": {"selfSigned": {}},
                                   "rdmig-agent-ca": {"ca": {"secretName": "rdmig-agent-ca"}}})
        certs = {c["metadata"]["name"]: c["spec"] for c in find(docs, "Certificate")}
        self.assertEqual(set(certs), {"rdmig-agent-ca", "rdmig-agent-tls"})
        self.assertTrue(certs["rdmig-agent-ca"]["isCA"])
        self.assertEqual(certs["rdmig-agent-ca"]["issuerRef"]["name"], "rdmig-selfsigned")
        leaf = certs["rdmig-agent-tls"]
        self.assertEqual((leaf["secretName"], leaf["dnsNames"], leaf["issuerRef"]),
                         ("rdmig-agent-tls", ["rdmig-agent"], {"name": "rdmig-agent-ca", "kind": "Issuer",
                                                               "group": "cert-manager.io"}))
        self.assertIn("server auth", leaf["usages"])
        for c in find(docs, "Certificate") + find(docs, "Issuer"):
            self.assertEqual((c["apiVersion"], c["metadata"]["namespace"]), ("cert-manager.io/v1", NAMESPACE))
        own = render("--set", "agent.tls.mode=certManager", "--set", "agent.tls.certManager.issuerRef.name=corp-ca",
                     "--set", "agent.tls.certManager.issuerRef.kind=ClusterIssuer")
        self.assertEqual(find(own, "Issuer"), [])
        self.assertEqual([c["spec"]["issuerRef"] for c in find(own, "Certificate")], [{"name": "corp-ca", "kind": "ClusterIssuer"}])

    def test_secret_uses_the_named_secret_and_needs_one(self):
        docs = render("--set", "serviceMonitor.enabled=true", "--set", "agent.tls.mode=secret",
                      "--set", "agent.tls.existingSecret=agents-https")
        self.assert_wired(docs, "agents-https", "rdmig-agent")
        self.assertEqual([d["metadata"]["name"] for d in find(docs, "Secret")], ["rdmig-token"])
        r = helm("template", "rdmig", CHART, "-n", NAMESPACE, "--set", "agent.tls.mode=secret", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("agent.tls.existingSecret", r.stderr)

    def test_off_is_plain_http_everywhere_and_the_notes_warn(self):
        docs = render("--set", "serviceMonitor.enabled=true", "--set", "agent.tls.mode=off")
        self.assertEqual([d["metadata"]["name"] for d in find(docs, "Secret")], ["rdmig-token"])
        self.assertEqual(self.tls_sources(docs, "DaemonSet") + self.tls_sources(docs, "Deployment"), [])
        agent, controller = self.configs(docs)
        self.assertNotIn("tls", agent["api"])
        self.assertNotIn("tls", controller["agents"])
        agent_sm = one(docs, "ServiceMonitor", "rdmig-agent")["spec"]["endpoints"][0]
        self.assertNotIn("tlsConfig", agent_sm)
        self.assertNotIn("scheme", agent_sm)
        self.assertEqual(one(docs, "ServiceMonitor", "rdmig-controller")["spec"]["endpoints"][0]["scheme"], "https",
                         "the controller's /metrics is HTTPS whatever agent.tls says")
        for w in (one(docs, "DaemonSet"), one(docs, "Deployment")):
            self.assertNotIn("checksum/tls", w["spec"]["template"]["metadata"]["annotations"])
        self.assertIn("WARNING: agent.tls.mode=off", render_notes("--set", "agent.tls.mode=off"))

    def test_notes_say_where_the_certificate_comes_from(self):
        notes = render_notes()
        self.assertIn("speak HTTPS only", notes)
        self.assertIn("every render", notes)
        self.assertIn("--cacert ca.crt", notes)
        self.assertNotIn("WARNING", notes)
        self.assertIn("get certificate rdmig-agent-tls", render_notes("--set", "agent.tls.mode=certManager"))

    def test_an_unknown_mode_or_server_name_is_refused(self):
        for bad in ("agent.tls.mode=none", "agent.tls.serverName=Not_A_Name", "agent.tls.serverName=10.0.0.1:443"):
            r = helm("template", "rdmig", CHART, "-n", NAMESPACE, "--set", bad, check=False)
            self.assertNotEqual(r.returncode, 0, bad)
            self.assertIn("agent.tls", r.stderr, bad)



SCHEMAS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")


def schema_errors(obj, name):
    """Errors of `obj` against tests/deploy/schemas/<name>.yaml (tests/k8s/schema_validator.py)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "k8s"))
    import schema_validator
    with open(os.path.join(SCHEMAS, name + ".yaml")) as f:
        return schema_validator.validate(obj, yaml.safe_load(f)["schema"])


def scc_from_daemonset(ds):
    """What an SCC must grant for the agent DaemonSet's pod, worked out here independently of the
    chart's template: the test fails when the rendered SCC and the rendered DaemonSet differ."""
    spec = pod_spec(ds)
    psc = spec.get("securityContext") or {}
    containers = spec.get("initContainers", []) + spec["containers"]
    scs = [c.get("securityContext") or {} for c in containers]
    drops = [set((sc.get("capabilities") or {}).get("drop") or []) for sc in scs]
    uids = {str(sc.get("runAsUser", psc.get("runAsUser", ""))) for sc in scs}
    volumes = sorted({k for v in spec["volumes"] for k in v if k != "name"})
    return {
        "allowPrivilegedContainer": any(sc.get("privileged", False) for sc in scs),
        "allowedCapabilities": sorted({c for sc in scs for c in (sc.get("capabilities") or {}).get("add") or []}),
        "requiredDropCapabilities": sorted(set.intersection(*drops)),
        "allowPrivilegeEscalation": any(sc.get("privileged") or sc.get("allowPrivilegeEscalation") is not False
                                        for sc in scs),
        "readOnlyRootFilesystem": all(sc.get("readOnlyRootFilesystem") for sc in scs),
        "allowHostNetwork": spec.get("hostNetwork", False), "allowHostPID": spec.get("hostPID", False),
        "allowHostIPC": spec.get("hostIPC", False),
        "allowHostDirVolumePlugin": "hostPath" in volumes, "volumes": volumes,
        "runAsUser": {"type": "MustRunAs", "uid": int(uids.pop())} if len(uids) == 1 and "" not in uids else None,
    }


class ControllerMetricsAndPoliciesTest(unittest.TestCase):
    """Issue 42: the controller's /metrics over HTTPS with token and access reviews by default (its
    RBAC, the reader role, the ServiceMonitor), the local-only option, the optional NetworkPolicy
    and the optional OpenShift SCC, each rendered and checked against its API's schema."""

    def controller(self, docs):
        c = pod_spec(one(docs, "Deployment"))["containers"][0]
        cfg = embedded_config(one(docs, "ConfigMap", "rdmig-controller-config"))["controller.yaml"]
        return c, cfg

    def test_metrics_are_https_with_reviews_by_default(self):
        docs = render("--set", "serviceMonitor.enabled=true")
        c, cfg = self.controller(docs)
        self.assertEqual(cfg["metrics"], {"secure": True, "port": 8443, "authCacheEntries": 256})
        self.assertEqual(cfg["probes"], {"address": "0.0.0.0", "port": 8081})
        self.assertEqual([(p["name"], p["containerPort"]) for p in c["ports"]], [("metrics", 8443), ("probes", 8081)])
        for probe in ("readinessProbe", "livenessProbe"):
            self.assertEqual(c[probe]["httpGet"]["port"], "probes", "the kubelet has no token: its own port")
        self.assertEqual(one(docs, "Service", "rdmig-controller-metrics")["spec"]["ports"][0]["port"], 8443)
        ep = one(docs, "ServiceMonitor", "rdmig-controller")["spec"]["endpoints"][0]
        self.assertEqual((ep["scheme"], ep["bearerTokenFile"], ep["tlsConfig"]),
                         ("https", "/var/run/secrets/kubernetes.io/serviceaccount/token", {"insecureSkipVerify": True}))
        # The controller may create token and access reviews, nothing more, cluster-wide.
        self.assertEqual(one(docs, "ClusterRole", "rdmig-controller-metrics-auth")["rules"],
                         [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                          {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
                           "verbs": ["create"]}])
        self.assertEqual(one(docs, "ClusterRoleBinding", "rdmig-controller-metrics-auth")["subjects"],
                         [{"kind": "ServiceAccount", "name": "rdmig-controller", "namespace": NAMESPACE}])
        self.assertEqual(one(docs, "ClusterRole", "rdmig-metrics-reader")["rules"],
                         [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])
        self.assertEqual(find(docs, "ClusterRoleBinding", "rdmig-metrics-reader"), [], "nobody is bound by default")
        # The same rights under watchNamespace (the reviews are cluster-scoped, never a Role's).
        scoped = render("--set", "controller.config.watchNamespace=vms")
        self.assertEqual(one(scoped, "ClusterRole", "rdmig-controller-metrics-auth")["rules"],
                         one(docs, "ClusterRole", "rdmig-controller-metrics-auth")["rules"])

    def test_reader_subjects_and_scrape_authorization(self):
        docs = render("--set", "serviceMonitor.enabled=true", "--set-json",
                      'controller.metrics.reader.subjects=[{"kind":"ServiceAccount","name":"prometheus-k8s",'
                      '"namespace":"monitoring"},{"kind":"ServiceAccount","name":"local-prom"},'
                      '{"kind":"Group","name":"scrapers"}]',
                      "--set-json", 'controller.metrics.scrapeAuthorization={"credentials":{"name":"prom-token","key":"token"}}')
        b = one(docs, "ClusterRoleBinding", "rdmig-metrics-reader")
        self.assertEqual(b["roleRef"]["name"], "rdmig-metrics-reader")
        self.assertEqual(b["subjects"], [
            {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"},
            {"kind": "ServiceAccount", "name": "local-prom", "namespace": NAMESPACE},
            {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "scrapers"}])
        ep = one(docs, "ServiceMonitor", "rdmig-controller")["spec"]["endpoints"][0]
        self.assertEqual(ep["authorization"], {"credentials": {"name": "prom-token", "key": "token"}})
        self.assertNotIn("bearerTokenFile", ep)

    def test_a_metrics_certificate_secret_is_mounted_and_verified_by_prometheus(self):
        docs = render("--set", "serviceMonitor.enabled=true", "--set", "controller.metrics.tls.existingSecret=ctl-tls")
        c, cfg = self.controller(docs)
        self.assertEqual(cfg["metrics"]["tls"], {"certFile": "/etc/rdmig/metrics-tls/tls.crt",
                                                 "keyFile": "/etc/rdmig/metrics-tls/tls.key"})
        sources = pod_spec(one(docs, "Deployment"))["volumes"][0]["projected"]["sources"]
        self.assertIn({"secret": {"name": "ctl-tls", "items": [{"key": "tls.crt", "path": "metrics-tls/tls.crt"},
                                                             {"key": "tls.key", "path": "metrics-tls/tls.key",
                                                              "mode": 0o400}]}}, sources)
        ep = one(docs, "ServiceMonitor", "rdmig-controller")["spec"]["endpoints"][0]
        self.assertEqual(ep["tlsConfig"], {"serverName": "rdmig-controller-metrics.%s.svc" % NAMESPACE,
                                           "ca": {"secret": {"name": "ctl-tls", "key": "ca.crt"}}})
        r = helm("template", "rdmig", CHART, "-n", NAMESPACE, "--set", "image.repository=registry.invalid/rdmig",
                 "--set", "controller.metrics.tls.existingSecret=ctl-tls",
                 "--set", "controller.config.metrics.secure=false", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("controller.metrics.tls.existingSecret is for controller.config.metrics.secure=true", r.stderr)

    def test_local_only_metrics_have_no_port_service_monitor_or_review_rights(self):
        docs = render("--set", "serviceMonitor.enabled=true", "--set", "controller.config.metrics.secure=false")
        c, cfg = self.controller(docs)
        self.assertEqual(cfg["metrics"], {"secure": False, "port": 8443, "authCacheEntries": 256},
                         "no address: the controller binds 127.0.0.1")
        self.assertEqual([p["name"] for p in c["ports"]], ["probes"])
        self.assertEqual(find(docs, "Service", "rdmig-controller-metrics"), [])
        self.assertEqual([m["metadata"]["name"] for m in find(docs, "ServiceMonitor")], ["rdmig-agent"])
        names = [d["metadata"]["name"] for d in find(docs, "ClusterRole") + find(docs, "ClusterRoleBinding")]
        self.assertNotIn("rdmig-controller-metrics-auth", names)
        self.assertNotIn("rdmig-metrics-reader", names)
        check_objects(self, docs)
        # Rules would fire RdmigControllerNoLeader for a controller nobody can scrape.
        r = helm("template", "rdmig", CHART, "-n", NAMESPACE, "--set", "image.repository=registry.invalid/rdmig",
                 "--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
                 "--set", "controller.config.metrics.secure=false", check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("controller.config.metrics.secure=false serves the controller's /metrics on 127.0.0.1 only",
                      r.stderr)
        one(render("--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
                   "--set", "prometheusRule.withoutServiceMonitor=true", "--set", "controller.config.metrics.secure=false"),
            "PrometheusRule")

    def test_network_policy_is_off_by_default_and_valid_when_on(self):
        self.assertEqual(find(render(), "NetworkPolicy"), [])
        docs = render("--set", "controller.networkPolicy.enabled=true")
        np = one(docs, "NetworkPolicy", "rdmig-controller")
        self.assertEqual(schema_errors(np, "networkpolicy-v1"), [])
        spec = np["spec"]
        self.assertEqual(spec["podSelector"]["matchLabels"], one(docs, "Deployment")["spec"]["selector"]["matchLabels"])
        self.assertEqual(spec["policyTypes"], ["Ingress", "Egress"])
        c, cfg = self.controller(docs)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual([r["ports"] for r in spec["ingress"]],
                         [[{"protocol": "TCP", "port": ports["probes"]}], [{"protocol": "TCP", "port": ports["metrics"]}]])
        self.assertTrue(all("from" not in r for r in spec["ingress"]), "any source by default")
        dns, api, agents = spec["egress"]
        self.assertEqual(dns["ports"], [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}])
        self.assertEqual(dns["to"][0]["podSelector"], {"matchLabels": {"k8s-app": "kube-dns"}})
        self.assertEqual(api, {"ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]},
                         "no cluster to look the endpoints up in: those ports to any address")
        self.assertEqual(agents, {"ports": [{"protocol": "TCP", "port": cfg["agents"]["port"]}]})
        # Addresses narrow it; local-only metrics drop the metrics rule.
        docs = render("--set", "controller.networkPolicy.enabled=true",
                      "--set-json", 'controller.networkPolicy.apiServer.cidrs=["10.0.0.10/32"]',
                      "--set-json", 'controller.networkPolicy.agentCidrs=["192.168.0.0/24"]',
                      "--set-json", 'controller.networkPolicy.metricsFrom=[{"namespaceSelector":{"matchLabels":'
                                    '{"kubernetes.io/metadata.name":"monitoring"}}}]',
                      "--set", "controller.config.metrics.secure=false")
        np = one(docs, "NetworkPolicy")
        self.assertEqual(schema_errors(np, "networkpolicy-v1"), [])
        self.assertEqual(len(np["spec"]["ingress"]), 1, "only the probes: metrics are on 127.0.0.1")
        self.assertEqual(np["spec"]["egress"][1]["to"], [{"ipBlock": {"cidr": "10.0.0.10/32"}}])
        self.assertEqual(np["spec"]["egress"][2]["to"], [{"ipBlock": {"cidr": "192.168.0.0/24"}}])
        on = one(render("--set", "controller.networkPolicy.enabled=true", "--set-json",
                        'controller.networkPolicy.metricsFrom=[{"namespaceSelector":{"matchLabels":'
                        '{"kubernetes.io/metadata.name":"monitoring"}}}]'), "NetworkPolicy")
        self.assertEqual(on["spec"]["ingress"][1]["from"],
                         [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}])
        # The schema check itself catches a malformed policy.
        broken = copy.deepcopy(on)
        broken["spec"]["egress"][0]["ports"][0]["protocol"] = "tcp"
        broken["spec"]["ingress"][0]["form"] = []
        self.assertEqual(len(schema_errors(broken, "networkpolicy-v1")), 2)

    def test_openshift_scc_is_off_by_default_and_grants_exactly_the_daemonsets_profile(self):
        self.assertEqual(find(render(), "SecurityContextConstraints"), [])
        cases = [
            [],
            ["--set", "kubevirt.enabled=true"],
            ["--set", "kubevirt.enabled=false"],
            # A non-privileged profile: the SCC follows whatever the DaemonSet asks for.
            ["--set-json", 'agent.securityContext={"privileged":false,"allowPrivilegeEscalation":false,'
                           '"readOnlyRootFilesystem":true,"capabilities":{"add":["IPC_LOCK","NET_ADMIN"],"drop":["ALL"]},'
                           '"seccompProfile":{"type":"RuntimeDefault"}}'],
        ]
        seen = []
        for extra in cases:
            docs = render("--set", "openshift.securityContextConstraints.enabled=true", *extra)
            scc, ds = one(docs, "SecurityContextConstraints", "rdmig-agent"), one(docs, "DaemonSet")
            self.assertEqual(schema_errors(scc, "securitycontextconstraints-v1"), [], extra)
            want = scc_from_daemonset(ds)
            got = {k: scc.get(k) for k in want}
            if want["runAsUser"] is None:
                got["runAsUser"] = None
            self.assertEqual(got, want, extra)
            self.assertEqual(scc["users"], ["system:serviceaccount:%s:rdmig-agent" % NAMESPACE])
            self.assertEqual((scc["defaultAddCapabilities"], scc["groups"]), ([], []))
            self.assertNotIn("namespace", scc["metadata"])
            seen.append(scc)
        strict = seen[3]
        self.assertEqual((strict["allowPrivilegedContainer"], strict["allowPrivilegeEscalation"],
                          strict["readOnlyRootFilesystem"], strict["requiredDropCapabilities"],
                          strict["allowedCapabilities"], strict["seccompProfiles"]),
                         (False, False, True, ["ALL"], ["IPC_LOCK", "NET_ADMIN"], ["runtime/default"]))
        self.assertNotEqual(seen[1]["allowedCapabilities"], seen[2]["allowedCapabilities"],
                            "KubeVirt mode's capabilities come and go with kubevirt.enabled")
        broken = copy.deepcopy(seen[0])
        broken["runAsUser"]["type"] = "MustRunAsRoot"
        del broken["volumes"]
        self.assertEqual(len(schema_errors(broken, "securitycontextconstraints-v1")), 2)


if __name__ == "__main__":
    unittest.main()
