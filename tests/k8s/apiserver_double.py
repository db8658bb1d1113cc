"""A Kubernetes API server double for testing rdmig-controller (Python stdlib only).

It is a test double, not an API server. It keeps the semantics the controller relies on:
  * one global resourceVersion counter, bumped on every write (like etcd's revision);
    list responses carry it in metadata.resourceVersion;
  * list + watch (?watch=1&resourceVersion=N) as a chunked stream of JSON lines with
    ADDED / MODIFIED / DELETED / BOOKMARK / ERROR events, from the history after N;
    resourceVersion unset or "0" starts with synthetic ADDED events for what exists;
    timeoutSeconds ends the stream (after a BOOKMARK);
  * watch expiry: expire_watches() ends open streams with an ERROR event (code 410,
    reason Expired) and compacts history so watches from older versions get 410 too;
  * the status subresource (PUT .../status changes only .status; PUT on the object keeps
    the stored .status), metadata.generation bumped on spec changes;
  * 409 Conflict on a write with a stale metadata.resourceVersion, 409 AlreadyExists on
    create of an existing name, 404 NotFound;
  * finalizers and deletionTimestamp: DELETE of an object with finalizers only sets
    deletionTimestamp; a PUT that removes the last finalizer deletes it; new finalizers
    cannot be added once deletion started;
  * labelSelector (equality terms) and fieldSelector (equality terms with the API server's
    backslash escapes; labels it does not support for a resource answer 400, as a real one
    does: pods take spec.nodeName, status.phase, ..., others metadata.name/namespace) on lists
    and watches;
  * bearer-token authentication (401 otherwise) and TLS with a CA made by the openssl CLI;
  * TokenReview (authentication.k8s.io/v1): status.authenticated and status.user (username, uid,
    groups) for the tokens it knows (the controller's, and those add_token() or
    add_service_account_token() made), authenticated false for any other; an empty spec.token is
    400, as the API server answers;
  * SubjectAccessReview (authorization.k8s.io/v1): status.allowed decided by the RBAC objects
    stored here, as Kubernetes' RBAC authorizer decides: ClusterRoleBindings (and, for resource
    attributes, RoleBindings in the namespace) whose subjects (User, Group, ServiceAccount) match
    spec.user/spec.groups, their ClusterRole's or Role's rules (verbs, apiGroups, resources,
    resourceNames, nonResourceURLs with '*' and trailing-'*' prefixes; nonResourceURLs only through
    ClusterRoleBindings), aggregated ClusterRoles (aggregationRule) and the system:masters group.
    Neither review is stored. review_fault answers both with an error instead (a failing API server);
  * RdmaMigration, RdmaPathCheck and RdmaDrainPlan writes are checked against their CRDs'
    openAPIV3Schema, CEL rules included (transition rules against the stored object on updates;
    skipped for the plurals in without_transition_rules) (422 Invalid);
  * DELETE with DeleteOptions preconditions (uid, resourceVersion): one that does not hold is a 409
    Conflict naming both values, as the apiserver's registry answers (storage Preconditions.Check's
    message in a Conflict) and nothing is deleted; before_delete (fault injection) runs a test's
    function just before a DELETE of a path is served (a write that lands first, a slow request, or
    a refusal it returns);
  * GETs answered late by delay_get (a slow API server), and publish_migration(): a VMI whose
    status.migrationState is written through the status subresource, as KubeVirt writes it;
  * kubevirt.io/v1 VirtualMachineInstance and VirtualMachineInstanceMigration like any other
    resource (list, watch, create, get, PUT, DELETE), both with the status subresource as
    KubeVirt's CRDs declare it; metadata.ownerReferences kept as written, and background
    garbage collection: when an owner is gone, its dependents are deleted (finalizers honoured).
Every request is logged (method, path, user agent, status; watches as WATCH) for the RBAC check.
It does not keep: RBAC on its own requests (any request with the controller's token is served;
tests/k8s/rbac_check.py compares the log with the chart's rules instead), admission webhooks, server-side apply/patch, field managers,
defaulting from the schema, foreground deletion/blockOwnerDeletion, pagination
(limit/continue), set-based selectors, watch caches per resource, protobuf, or API discovery.
"""
import bisect
import copy
import datetime
import http.server
import json
import os
import ssl
import subprocess
import threading
import time
import urllib.parse
import uuid

import schema_validator

STATUS_SUBRESOURCE = {"rdmamigrations", "rdmapathchecks", "rdmadrainplans", "virtualmachineinstances", "virtualmachineinstancemigrations"}
# The RdmaPathCheck CRD: loaded for every double, so its objects are always checked against it.
PATHCHECK_CRD = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "operator-manifests", "crd-rdmapathchecks.yaml")
DRAINPLAN_CRD = os.path.join(os.path.dirname(PATHCHECK_CRD), "crd-rdmadrainplans.yaml")


def now_rfc3339():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code, reason, message):
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


def make_tls_material(workdir):
    """CA + server certificate for 127.0.0.1, made with the openssl CLI. Returns paths."""
    ca_key, ca_crt = os.path.join(workdir, "ca.key"), os.path.join(workdir, "ca.crt")
    key, csr, crt = (os.path.join(workdir, n) for n in ("server.key", "server.csr", "server.crt"))
    ext = os.path.join(workdir, "server.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args):
        subprocess.run(["openssl"] + list(args), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", ca_key, "-out", ca_crt, "-days", "2", "-subj", "/CN=rdmig-test-ca")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
        "-out", crt, "-days", "2", "-extfile", ext)
    return ca_crt, crt, key


def parse_selector(text):
    terms = {}
    for term in filter(None, (t.strip() for t in (text or "").split(","))):
        if "!=" in term:
            raise ValueError("unsupported selector term " + term)
        k, _, v = term.partition("=")
        terms[k.strip()] = v.lstrip("=").strip()
    return terms


# Field labels the API server accepts in a fieldSelector, by resource (others: 400 BadRequest).
POD_FIELDS = {"metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
              "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.podIPs",
              "status.nominatedNodeName"}
COMMON_FIELDS = {"metadata.name", "metadata.namespace"}


def parse_field_selector(text, plural):
    """Equality terms as k8s.io/apimachinery/pkg/fields parses them: terms split at unescaped
    ',', key and value at the first unescaped '=' (or '=='), and '\\' escaping '\\', ',' and '='
    in values. Raises ValueError (the API server's 400) for bad escapes and unsupported labels."""
    terms, cur, i = [], "", 0
    text = text or ""
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1] not in "\\,=":
                raise ValueError("invalid field selector: invalid escape sequence in %r" % text)
            cur += text[i:i + 2]
            i += 2
            continue
        if c == ",":
            terms.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    if cur or terms:
        terms.append(cur)
    out = {}
    allowed = POD_FIELDS if plural == "pods" else COMMON_FIELDS
    for term in terms:
        if not term.strip():
            continue
        if "!=" in term.split("\\")[0]:
            raise ValueError("unsupported selector term " + term)
        key, value, j = "", None, 0
        while j < len(term):
            if term[j] == "\\":
                j += 2
                continue
            if term[j] == "=":
                key, rest = term[:j], term[j + 1:]
                value = rest[1:] if rest.startswith("=") else rest
                break
            j += 1
        if value is None:
            raise ValueError("invalid field selector: %r has no operator" % term)
        key = key.strip()
        if key not in allowed:
            raise ValueError('field label not supported: %s' % key)
        unescaped, k = "", 0
        while k < len(value):
            if value[k] == "\\":
                if k + 1 >= len(value) or value[k + 1] not in "\\,=":
                    raise ValueError("invalid field selector: invalid escape sequence in %r" % value)
                unescaped += value[k + 1]
                k += 2
                continue
            if value[k] == "=":
                raise ValueError("invalid field selector: unescaped '=' in value %r" % value)
            unescaped += value[k]
            k += 1
        out[key] = unescaped
    return out


def field_value(obj, path):
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


class Store:
    """Objects, history and resourceVersions. All methods take the condition's lock."""

    def __init__(self, crd_schema=None):
        self.cond = threading.Condition()
        self.rv = 100
        self.objects = {}    # (plural, ns, name) -> object
        self.history = []    # (rv, plural, ns, type, object)
        self.compacted = 0   # watches from a resourceVersion below this get 410
        self.epoch = 0       # bumped by expire_watches(): open watches end with 410
        self.crd_schema = crd_schema  # RdmaMigration's (None: not checked)
        self.pathcheck_schema = schema_validator.load_crd_schema(PATHCHECK_CRD)
        self.drainplan_schema = schema_validator.load_crd_schema(DRAINPLAN_CRD)
        self.on_finalizers_removed = None  # hook(obj) called before the object goes away
        # hook(plural, ns, name, new) called on a status write before it is stored; it may change
        # `new` (a user's delete or edit landing in the same instant, for fault tests)
        self.on_status_write = None
        self.conflict_once = set()  # (plural, ns, name): the next PUT on it answers 409 (fault injection)
        # Plurals whose updates skip the CRD's transition rules (those naming oldSelf), as an API
        # server that does not run CEL validation rules would (Kubernetes before 1.25 or with
        # CustomResourceValidationExpressions off): what a controller-side check must catch.
        self.without_transition_rules = set()
        self.counters = {"list": {}, "watch": {}, "gone": 0}

    # -- internals -----------------------------------------------------------------------
    def _bump(self, plural, ns, etype, obj):
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, plural, ns, etype, copy.deepcopy(obj)))
        self.cond.notify_all()

    def _validate(self, plural, obj, old=None):
        schema, kind = {"rdmamigrations": (self.crd_schema, "RdmaMigration"),
                        "rdmapathchecks": (self.pathcheck_schema, "RdmaPathCheck"),
                        "rdmadrainplans": (self.drainplan_schema, "RdmaDrainPlan")}.get(plural, (None, None))
        if schema is None:
            return None
        errors = schema_validator.validate(obj, schema, old=None if plural in self.without_transition_rules else old)
        if errors:
            return 422, status_body(422, "Invalid", "%s is invalid: %s" % (kind, "; ".join(errors)))
        return None

    # -- operations (each returns (http_status, body)) -----------------------------------
    def create(self, plural, ns, obj):
        obj = copy.deepcopy(obj)
        md = obj.setdefault("metadata", {})
        if not md.get("name") and md.get("generateName"):
            md["name"] = md["generateName"] + uuid.uuid4().hex[:5]
        if not md.get("name"):
            return 422, status_body(422, "Invalid", "metadata.name: Required value")
        if ns is not None:
            md["namespace"] = ns
        bad = self._validate(plural, obj)
        if bad:
            return bad
        with self.cond:
            key = (plural, md.get("namespace"), md["name"])
            if key in self.objects:
                return 409, status_body(409, "AlreadyExists", '%s "%s" already exists' % (plural, md["name"]))
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = now_rfc3339()
            md["generation"] = 1
            md.pop("deletionTimestamp", None)
            if plural in STATUS_SUBRESOURCE:
                obj.pop("status", None)
            self.objects[key] = obj
            self._bump(plural, key[1], "ADDED", obj)
            return 201, copy.deepcopy(obj)

    def create_with_status(self, plural, ns, obj):
        """Creates `obj` with its status in one step (one ADDED event that holds it): a fixture
        as its controller would have left it, so that no controller sees it without its status
        (and starts on it) in between a create and a status write."""
        with self.cond:
            code, body = self.create(plural, ns, obj)
            if code != 201:
                return code, body
            key = (plural, body["metadata"]["namespace"], body["metadata"]["name"])
            self.objects[key]["status"] = copy.deepcopy(obj.get("status", {}))
            self.history[-1][4]["status"] = copy.deepcopy(obj.get("status", {}))
            return 201, copy.deepcopy(self.objects[key])

    def get(self, plural, ns, name):
        with self.cond:
            obj = self.objects.get((plural, ns, name))
            if obj is None:
                return 404, status_body(404, "NotFound", '%s "%s" not found' % (plural, name))
            return 200, copy.deepcopy(obj)

    def _check_rv(self, stored, body, plural, name):
        want = body.get("metadata", {}).get("resourceVersion")
        if want and want != stored["metadata"]["resourceVersion"]:
            return 409, status_body(409, "Conflict", 'Operation cannot be fulfilled on %s "%s": the object has '
                                    "been modified; please apply your changes to the latest version and try again"
                                    % (plural, name))
        return None

    def replace(self, plural, ns, name, body, subresource=None):
        with self.cond:
            key = (plural, ns, name)
            stored = self.objects.get(key)
            if stored is None:
                return 404, status_body(404, "NotFound", '%s "%s" not found' % (plural, name))
            conflict = self._check_rv(stored, body, plural, name)
            if not conflict and key in self.conflict_once:
                self.conflict_once.discard(key)
                body = dict(body, metadata=dict(body.get("metadata", {}), resourceVersion="0"))
                conflict = self._check_rv(stored, body, plural, name)
            if conflict:
                return conflict
            new = copy.deepcopy(stored)
            if subresource == "status":
                new["status"] = copy.deepcopy(body.get("status", {}))
                if self.on_status_write:
                    self.on_status_write(plural, ns, name, new)
            else:
                for k, v in body.items():
                    if k not in ("metadata", "status") or plural not in STATUS_SUBRESOURCE and k == "status":
                        new[k] = copy.deepcopy(v)
                md_in = body.get("metadata", {})
                for k in ("labels", "annotations"):
                    if k in md_in:
                        new["metadata"][k] = copy.deepcopy(md_in[k])
                old_fin = stored["metadata"].get("finalizers", [])
                new_fin = list(md_in.get("finalizers", []))
                if stored["metadata"].get("deletionTimestamp") and [f for f in new_fin if f not in old_fin]:
                    return 422, status_body(422, "Forbidden", "no new finalizers can be added if the object is "
                                            "being deleted")
                new["metadata"]["finalizers"] = new_fin
                if not new_fin:
                    new["metadata"].pop("finalizers", None)
                if plural in STATUS_SUBRESOURCE and new.get("spec") != stored.get("spec"):
                    new["metadata"]["generation"] = stored["metadata"].get("generation", 1) + 1
            bad = self._validate(plural, new, old=stored)
            if bad:
                return bad
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                if self.on_finalizers_removed:
                    self.on_finalizers_removed(copy.deepcopy(new))
                del self.objects[key]
                self._bump(plural, ns, "DELETED", new)
                self._collect_garbage(new["metadata"]["uid"])
                return 200, copy.deepcopy(new)
            self.objects[key] = new
            self._bump(plural, ns, "MODIFIED", new)
            return 200, copy.deepcopy(new)

    def delete(self, plural, ns, name, preconditions=None):
        with self.cond:
            key = (plural, ns, name)
            stored = self.objects.get(key)
            if stored is None:
                return 404, status_body(404, "NotFound", '%s "%s" not found' % (plural, name))
            for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                want = (preconditions or {}).get(field)
                have = stored["metadata"].get(field)
                if want is not None and want != have:
                    return 409, status_body(409, "Conflict", 'Operation cannot be fulfilled on %s "%s": Precondition '
                                            'failed: %s in precondition: %s, %s in object meta: %s'
                                            % (plural, name, label, want, label, have))
            if stored["metadata"].get("finalizers"):
                if not stored["metadata"].get("deletionTimestamp"):
                    stored["metadata"]["deletionTimestamp"] = now_rfc3339()
                    stored["metadata"]["deletionGracePeriodSeconds"] = 0
                    self._bump(plural, ns, "MODIFIED", stored)
                return 200, copy.deepcopy(stored)
            del self.objects[key]
            self._bump(plural, ns, "DELETED", stored)
            self._collect_garbage(stored["metadata"]["uid"])
            return 200, copy.deepcopy(stored)

    def _collect_garbage(self, owner_uid):
        """Background cascading deletion: dependents of a vanished owner are deleted."""
        for (plural, ns, name), obj in list(self.objects.items()):
            if any(r.get("uid") == owner_uid for r in obj["metadata"].get("ownerReferences", [])):
                self.delete(plural, ns, name)

    def matches(self, obj, plural, ns, labels, fields):
        md = obj.get("metadata", {})
        if ns is not None and md.get("namespace") != ns:
            return False
        for k, v in labels.items():
            if (md.get("labels") or {}).get(k) != v:
                return False
        for k, v in fields.items():
            if str(field_value(obj, k) or "") != v:
                return False
        return True

    def list(self, plural, ns, labels, fields):
        with self.cond:
            self.counters["list"][plural] = self.counters["list"].get(plural, 0) + 1
            items = [copy.deepcopy(o) for (p, _, _), o in sorted(self.objects.items())
                     if p == plural and self.matches(o, plural, ns, labels, fields)]
            return 200, {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                         "items": items}

    def expire_watches(self):
        """Ends every open watch with 410 and compacts history to now (after one unrelated
        write, as happens in a busy cluster), so resuming from any version seen so far fails."""
        with self.cond:
            self.rv += 1
            self.compacted = self.rv
            self.history = [h for h in self.history if h[0] >= self.compacted]
            self.epoch += 1
            self.cond.notify_all()

    def objects_of(self, plural):
        with self.cond:
            return [copy.deepcopy(o) for (p, _, _), o in self.objects.items() if p == plural]


def service_account_user(namespace, name):
    return "system:serviceaccount:%s:%s" % (namespace, name)


def _subject_matches(subject, binding_ns, user, groups):
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return name == user
    if kind == "Group":
        return name in groups
    if kind == "ServiceAccount":
        return service_account_user(subject.get("namespace") or binding_ns, name) == user
    return False


def _url_matches(spec, path):
    """A nonResourceURLs entry: exact, '*', or a prefix ending in '*' (rbac/v1 helpers)."""
    return spec == "*" or spec == path or (spec.endswith("*") and path.startswith(spec[:-1]))


def _rule_allows(rule, attrs):
    if not ({"*", attrs["verb"]} & set(rule.get("verbs") or [])):
        return False
    if attrs.get("nonResource"):
        return any(_url_matches(u, attrs["path"]) for u in rule.get("nonResourceURLs") or [])
    if rule.get("nonResourceURLs") and not rule.get("resources"):
        return False
    resource = attrs["resource"] + ("/" + attrs["subresource"] if attrs.get("subresource") else "")
    return (bool({"*", attrs["group"]} & set(rule.get("apiGroups") or []))
            and bool({"*", resource} & set(rule.get("resources") or []))
            and (not rule.get("resourceNames") or attrs.get("name") in rule["resourceNames"]))


def rbac_allows(store, user, groups, attrs):
    """(allowed, reason) as Kubernetes' RBAC authorizer (plus the system:masters group) decides."""
    if "system:masters" in groups:
        return True, "allowed by the system:masters group"
    with store.cond:
        objects = copy.deepcopy(store.objects)

    def cluster_role_rules(name):
        role = objects.get(("clusterroles", None, name))
        if role is None:
            return []
        rules = list(role.get("rules") or [])
        for sel in (role.get("aggregationRule") or {}).get("clusterRoleSelectors") or []:
            want = sel.get("matchLabels") or {}
            for (p, _, n), other in sorted(objects.items()):
                labels = other["metadata"].get("labels") or {}
                if p == "clusterroles" and n != name and all(labels.get(k) == v for k, v in want.items()):
                    rules += other.get("rules") or []
        return rules

    bindings = [(b, None) for (p, _, _), b in sorted(objects.items()) if p == "clusterrolebindings"]
    if not attrs.get("nonResource") and attrs.get("namespace"):
        bindings += [(b, attrs["namespace"]) for (p, ns, _), b in sorted(objects.items())
                     if p == "rolebindings" and ns == attrs["namespace"]]
    for b, ns in bindings:
        if not any(_subject_matches(s, ns, user, groups) for s in b.get("subjects") or []):
            continue
        ref = b.get("roleRef") or {}
        if ref.get("kind") == "ClusterRole":
            rules = cluster_role_rules(ref.get("name"))
        else:
            role = objects.get(("roles", ns, ref.get("name")))
            rules = (role or {}).get("rules") or []
        if any(_rule_allows(r, attrs) for r in rules):
            return True, 'RBAC: allowed by %s "%s" of %s "%s"' % (
                "ClusterRoleBinding" if ns is None else "RoleBinding", b["metadata"]["name"], ref.get("kind"),
                ref.get("name"))
    return False, ""


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rdmig-apiserver-double"

    def log_message(self, fmt, *args):
        pass

    @property
    def api(self):
        return self.server.api

    def _send(self, code, body, logged=False):
        data = (json.dumps(body) + "\n").encode()
        if not logged:  # before the answer: a client that has it (and acts on it) finds it logged
            self.api.log(self.command, self.path, self.headers.get("User-Agent", ""), code)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            self.close_connection = True  # the client gave up (a late answer, delay_get): as a real server

    def _write(self, operation, *args):
        """One store write, logged under the store's lock: a test that sees the write's effect (an
        object gone, a status set) also finds the request in the log, however late this thread
        gets to write the answer."""
        with self.api.store.cond:
            code, body = operation(*args)
            self.api.log(self.command, self.path, self.headers.get("User-Agent", ""), code)
        self._send(code, body, logged=True)

    def _route(self):
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        parts = [p for p in url.path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            rest = parts[3:]
        else:
            return None
        ns = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            ns, rest = rest[1], rest[2:]
        if not rest:
            return None
        plural = rest[0]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        return plural, ns, name, sub, query

    def _auth(self):
        if self.headers.get("Authorization") != "Bearer " + self.api.token:
            self._send(401, status_body(401, "Unauthorized", "Unauthorized"))
            return False
        return True

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            return None

    def do_GET(self):
        if not self._auth():
            return
        r = self._route()
        if r is None:
            return self._send(404, status_body(404, "NotFound", "no route " + self.path))
        plural, ns, name, sub, q = r
        store = self.api.store
        delay = self.api.delay_get(self.path, self.headers.get("User-Agent", "")) if self.api.delay_get else 0
        if delay:
            time.sleep(delay)  # a slow API server (fault injection): the answer comes, late
        if name:
            return self._send(*store.get(plural, ns, name))
        try:
            labels, fields = parse_selector(q.get("labelSelector")), parse_field_selector(q.get("fieldSelector"), plural)
        except ValueError as e:
            return self._send(400, status_body(400, "BadRequest", str(e)))
        refused = self.api.refuse_lists.get(plural)
        if refused:
            return self._send(refused[0], status_body(*refused))
        if q.get("watch") in ("1", "true"):
            return self._watch(plural, ns, labels, fields, q)
        return self._send(*store.list(plural, ns, labels, fields))

    def _chunk(self, obj):
        data = (json.dumps(obj) + "\n").encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, plural, ns, labels, fields, q):
        store = self.api.store
        rv_text = q.get("resourceVersion", "")
        timeout = float(q.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        self.api.log("WATCH", self.path, self.headers.get("User-Agent", ""), 200)
        with store.cond:
            store.counters["watch"][plural] = store.counters["watch"].get(plural, 0) + 1
            epoch = store.epoch
            start_rv = int(rv_text) if rv_text not in ("", "0") else store.rv
            initial = []
            if rv_text in ("", "0"):
                initial = [copy.deepcopy(o) for (p, _, _), o in sorted(store.objects.items())
                           if p == plural and store.matches(o, plural, ns, labels, fields)]
            too_old = rv_text not in ("", "0") and start_rv < store.compacted
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if too_old:
                with store.cond:
                    store.counters["gone"] += 1
                self._chunk({"type": "ERROR", "object": status_body(
                    410, "Expired", "too old resource version: %s (%s)" % (start_rv, store.compacted))})
                return self._end_chunks()
            for o in initial:
                self._chunk({"type": "ADDED", "object": o})
            cursor = start_rv
            while not self.api.stopping:
                with store.cond:
                    pending = []
                    while True:
                        if store.epoch != epoch:
                            store.counters["gone"] += 1
                            pending = None
                            break
                        i = bisect.bisect_right([h[0] for h in store.history], cursor)
                        pending = [h for h in store.history[i:] if h[1] == plural]
                        if store.history[i:]:
                            cursor = store.history[-1][0]
                        if pending or time.monotonic() >= deadline or self.api.stopping:
                            break
                        store.cond.wait(0.25)
                if pending is None:
                    self._chunk({"type": "ERROR", "object": status_body(410, "Expired", "watch expired (compacted)")})
                    break
                for (_, _, _, etype, obj) in pending:
                    if store.matches(obj, plural, ns, labels, fields):
                        self._chunk({"type": etype, "object": obj})
                if time.monotonic() >= deadline:
                    self._chunk({"type": "BOOKMARK", "object": {"kind": "", "apiVersion": "",
                                                                "metadata": {"resourceVersion": str(cursor)}}})
                    break
            self._end_chunks()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            pass
        self.close_connection = True

    def _end_chunks(self):
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def do_POST(self):
        if not self._auth():
            return
        r = self._route()
        body = self._body()
        if r is None or body is None:
            return self._send(400, status_body(400, "BadRequest", "bad request"))
        plural, ns, name, sub, q = r
        path = urllib.parse.urlsplit(self.path).path
        if path == "/apis/authentication.k8s.io/v1/tokenreviews":
            return self._send(*self.api.token_review(body))
        if path == "/apis/authorization.k8s.io/v1/subjectaccessreviews":
            return self._send(*self.api.access_review(body))
        self._write(self.api.store.create, plural, ns, body)

    def do_PUT(self):
        if not self._auth():
            return
        r = self._route()
        body = self._body()
        if r is None or body is None or not r[2]:
            return self._send(400, status_body(400, "BadRequest", "bad request"))
        plural, ns, name, sub, q = r
        if sub not in (None, "status") or (sub == "status" and plural not in STATUS_SUBRESOURCE):
            return self._send(404, status_body(404, "NotFound", "no subresource " + str(sub)))
        self._write(self.api.store.replace, plural, ns, name, body, sub)

    def do_DELETE(self):
        if not self._auth():
            return
        r = self._route()
        if r is None or not r[2]:
            return self._send(405, status_body(405, "MethodNotAllowed", "collection delete not supported"))
        plural, ns, name, sub, q = r
        options = self._body()
        if options is None:
            return self._send(400, status_body(400, "BadRequest", "the DeleteOptions body is not JSON"))
        if not isinstance(options, dict) or not isinstance(options.get("preconditions") or {}, dict):
            return self._send(400, status_body(400, "BadRequest", "DeleteOptions: preconditions must be an object"))
        if self.api.before_delete:
            refused = self.api.before_delete(self.path)
            if refused:  # (code, reason, message): the API server answers that and deletes nothing
                return self._send(refused[0], status_body(*refused))
        self._write(self.api.store.delete, plural, ns, name, options.get("preconditions"))


class ApiServerDouble:
    """Runs the double on 127.0.0.1:<free port> in a background thread (TLS by default)."""

    def __init__(self, workdir, tls=True, crd_path=None):
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.token = "test-" + uuid.uuid4().hex
        # Tokens the TokenReview knows: token -> (username, uid, groups). The controller's own is
        # its ServiceAccount's, as in a cluster.
        self.tokens = {}
        self.add_service_account_token("rdmig-system", "rdmig-controller", token=self.token)
        self.review_fault = None  # (code, reason, message): TokenReviews and SubjectAccessReviews answer that
        schema = schema_validator.load_crd_schema(crd_path) if crd_path else None
        self.store = Store(schema)
        self.stopping = False
        self.requests = []  # (method, path, user_agent, status)
        self.refuse_lists = {}  # plural -> (code, reason, message): lists of it answer that (fault injection)
        self.delay_get = None  # (path, user_agent) -> seconds a GET waits before it is answered (fault injection)
        # path -> None, called before a DELETE is served (fault injection); a (code, reason,
        # message) it returns is answered instead and nothing is deleted (an outage, RBAC).
        self.before_delete = None
        self._log_lock = threading.Lock()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.api = self
        self.tls = tls
        self.ca_file = None
        if tls:
            self.ca_file, crt, key = make_tls_material(workdir)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(crt, key)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return "%s://127.0.0.1:%d" % ("https" if self.tls else "http", self.port)

    def log(self, method, path, user_agent, status):
        with self._log_lock:
            self.requests.append((method, path, user_agent, status))

    def write_kubeconfig(self, path, namespace="rdmig-system"):
        cluster = {"server": self.url}
        if self.ca_file:
            cluster["certificate-authority"] = self.ca_file
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
               "clusters": [{"name": "double", "cluster": cluster}],
               "users": [{"name": "controller", "user": {"token": self.token}}],
               "contexts": [{"name": "test", "context": {"cluster": "double", "user": "controller",
                                                         "namespace": namespace}}]}
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)  # JSON is YAML
        return path

    # -- authentication.k8s.io and authorization.k8s.io -----------------------------------------
    def add_token(self, username, groups=(), token=None):
        """A bearer token the TokenReview authenticates as `username` with `groups`."""
        token = token or "tok-" + uuid.uuid4().hex
        self.tokens[token] = (username, str(uuid.uuid4()), list(groups))
        return token

    def add_service_account_token(self, namespace, name, token=None):
        """A ServiceAccount's token, with the groups the API server gives one."""
        return self.add_token(service_account_user(namespace, name),
                              ["system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"],
                              token=token)

    def _review_checks(self, body, kind, group):
        if self.review_fault:
            return self.review_fault[0], status_body(*self.review_fault)
        if body.get("apiVersion") != group + "/v1" or body.get("kind") != kind:
            return 400, status_body(400, "BadRequest", "expected apiVersion %s/v1, kind %s" % (group, kind))
        if not isinstance(body.get("spec"), dict):
            return 422, status_body(422, "Invalid", "%s: spec: Required value" % kind)
        return None

    def token_review(self, body):
        """(201, the TokenReview with its status), as the API server's tokenreviews REST storage answers."""
        bad = self._review_checks(body, "TokenReview", "authentication.k8s.io")
        if bad:
            return bad
        token = body["spec"].get("token")
        if not isinstance(token, str) or not token:
            return 400, status_body(400, "BadRequest", "token is required for TokenReview in authentication")
        out = copy.deepcopy(body)
        out.setdefault("metadata", {})["creationTimestamp"] = None
        known = self.tokens.get(token)
        if known is None:
            out["status"] = {"authenticated": False, "user": {}, "error": "invalid bearer token"}
        else:
            username, uid, groups = known
            out["status"] = {"authenticated": True, "user": {"username": username, "uid": uid, "groups": groups},
                             "audiences": ["https://kubernetes.default.svc"]}
        return 201, out

    def access_review(self, body):
        """(201, the SubjectAccessReview with its status), decided by the stored RBAC objects."""
        bad = self._review_checks(body, "SubjectAccessReview", "authorization.k8s.io")
        if bad:
            return bad
        spec = body["spec"]
        res, nonres = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if bool(res) == bool(nonres):
            return 422, status_body(422, "Invalid", "SubjectAccessReview: spec: Invalid value: exactly one of "
                                    "nonResourceAttributes or resourceAttributes must be specified")
        user, groups = spec.get("user") or "", list(spec.get("groups") or [])
        if not user and not groups:
            return 422, status_body(422, "Invalid", "SubjectAccessReview: spec.user: Invalid value: at least one "
                                    "of user or group must be specified")
        if nonres:
            attrs = {"nonResource": True, "path": nonres.get("path", ""), "verb": nonres.get("verb", "")}
        else:
            attrs = {"verb": res.get("verb", ""), "group": res.get("group", ""), "resource": res.get("resource", ""),
                     "subresource": res.get("subresource", ""), "name": res.get("name", ""),
                     "namespace": res.get("namespace", "")}
        allowed, reason = rbac_allows(self.store, user, groups, attrs)
        out = copy.deepcopy(body)
        out.setdefault("metadata", {})["creationTimestamp"] = None
        out["status"] = {"allowed": allowed}
        if reason:
            out["status"]["reason"] = reason
        return 201, out

    def grant(self, name, rules, subjects):
        """A ClusterRole `name` with `rules` bound to `subjects` by a ClusterRoleBinding of the same name."""
        for plural, obj in (("clusterroles", {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                                              "metadata": {"name": name}, "rules": rules}),
                            ("clusterrolebindings", {"apiVersion": "rbac.authorization.k8s.io/v1",
                                                     "kind": "ClusterRoleBinding", "metadata": {"name": name},
                                                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                 "kind": "ClusterRole", "name": name},
                                                     "subjects": subjects})):
            code, body = self.store.create(plural, None, obj)
            assert code == 201, body

    def stop(self):
        self.stopping = True
        with self.store.cond:
            self.store.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- conveniences for tests (same code paths as the HTTP API) -------------------------
    def add_agent_pod(self, namespace, name, node, port, ready=True, ip="127.0.0.1",
                      labels=None, terminating=False):
        """terminating: then deleted, as a rollout deletes the old agent pod; a finalizer keeps
        the object (deletionTimestamp set, still Running) the way the kubelet's grace period
        keeps a real one while the agent drains."""
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": namespace,
                            "labels": labels or {"app.kubernetes.io/name": "rdmig-agent"}},
               "spec": {"nodeName": node, "hostNetwork": True,
                        "containers": [{"name": "agent", "ports": [{"name": "api", "containerPort": port}]}]},
               "status": {"phase": "Running", "podIP": ip,
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        if terminating:
            pod["metadata"]["finalizers"] = ["rdmig.test/grace-period"]
        code, body = self.store.create("pods", namespace, pod)
        assert code == 201, body
        if terminating:
            code, body = self.store.delete("pods", namespace, name)
            assert code == 200 and body["metadata"].get("deletionTimestamp"), body
        return body

    def publish_migration(self, namespace, name, migration_state, node="node-a"):
        """A VMI (created when absent, its UID the server's) whose status.migrationState KubeVirt
        has just written through the status subresource, as virt-controller and virt-handler do.
        Returns the stored object."""
        code, vmi = self.store.get("virtualmachineinstances", namespace, name)
        if code == 404:
            code, vmi = self.store.create("virtualmachineinstances", namespace, {
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": name, "namespace": namespace}, "spec": {"domain": {}}})
            assert code == 201, vmi
        vmi["status"] = {"phase": "Running", "nodeName": node, "migrationState": migration_state}
        code, body = self.store.replace("virtualmachineinstances", namespace, name, vmi, "status")
        assert code == 200, body
        return body

    def events(self, name=None):
        return [e for e in self.store.objects_of("events")
                if name is None or e.get("involvedObject", {}).get("name") == name]
