"""RBAC check: the API calls a controller or an agent made (from the API server double's request
log, by User-Agent) against the Role/ClusterRole rules the Helm chart renders for its
ServiceAccount (tests/k8s for the controller, tests/kubevirt/test_kubevirt_relay.py for the agent). Every call must
be allowed, and every granted (apiGroup, resource, verb) must have been used: least privilege,
checked both ways."""
import os
import sys
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "deploy"))


def parse_call(method, path):
    """(apiGroup, resource[/subresource], verb, namespace, name) of one request, as RBAC sees it."""
    url = urllib.parse.urlsplit(path)
    parts = [p for p in url.path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    ns = ""
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        ns, rest = rest[1], rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else ""
    if len(rest) > 2:
        resource += "/" + rest[2]
    verb = {"GET": "get" if name else "list", "WATCH": "watch", "POST": "create", "PUT": "update",
            "DELETE": "delete", "PATCH": "patch"}[method]
    return group, resource, verb, ns, name


def calls_from_log(requests, user_agent_prefix):
    return sorted({parse_call(m, p) for m, p, ua, _ in requests if ua.startswith(user_agent_prefix)})


def chart_rules(*helm_args, sa_suffix="-controller"):
    """[(namespace or "" for cluster-wide, rule)] bound to the ServiceAccount whose name ends in
    `sa_suffix` (the controller's by default)."""
    from deploylib import find, render
    docs = render(*helm_args)
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
             for d in find(docs, "Role") + find(docs, "ClusterRole")}
    out = []
    for b in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
        if not any(s["name"].endswith(sa_suffix) for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        ns = "" if b["kind"] == "ClusterRoleBinding" else b["metadata"]["namespace"]
        role = roles[(ref["kind"], "" if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"], ref["name"])]
        out += [(ns, r) for r in role["rules"]]
    return out


def without(rules, resource, verb):
    """`rules` less `verb` on `resource`: a grant that another test file exercises."""
    out = []
    for ns, r in rules:
        if resource in r["resources"] and verb in r["verbs"]:
            r = dict(r, verbs=[v for v in r["verbs"] if v != verb])
        out.append((ns, r))
    return out


def allows(scope_ns, rule, call):
    group, resource, verb, ns, name = call
    return ((scope_ns == "" or scope_ns == ns) and group in rule["apiGroups"] and resource in rule["resources"]
            and verb in rule["verbs"] and (not rule.get("resourceNames") or name in rule["resourceNames"]))


def compare(calls, rules, unused_of=None):
    """Calls not granted, and grants never used; `unused_of`: look for unused grants only on
    these resources (a test that exercises one kind of object)."""
    problems = []
    for c in calls:
        if not any(allows(ns, r, c) for ns, r in rules):
            problems.append("not granted: %s %s/%s in namespace %r (name %r)" % (c[2], c[0] or "core", c[1], c[3], c[4]))
    for ns, r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                if unused_of is not None and res not in unused_of:
                    continue
                for v in r["verbs"]:
                    if not any(c[0] == g and c[1] == res and c[2] == v and (ns == "" or c[3] == ns) for c in calls):
                        problems.append("granted but never used: %s %s/%s (%s)" % (v, g or "core", res, ns or "cluster"))
    return problems
