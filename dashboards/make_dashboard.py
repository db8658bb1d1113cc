#!/usr/bin/env python3
"""Writes dashboards/rdmig.json, the Grafana dashboard for rdmig's agents and controller.

The dashboard is generated so that every panel follows the same selectors and units; edit this
file, then run `python3 tests/deploy/sync_copies.py` (it runs this and refreshes the copies in
charts/rdmig/ and operator-manifests/monitoring/). Metric names are the agent's
(src/metrics/metrics.cpp) and the controller's (controller/controller_metrics.cpp); the ctest
deploy_dashboard_metrics scrapes both after a real migration and fails on a name nobody exports.

Labels: `namespace` (added by the Prometheus Operator) and `node` (the ServiceMonitors relabel
__meta_kubernetes_pod_node_name to it) back the namespace and node variables; the hidden
agent_job/controller_job variables are the scrape jobs that export the agent's and the
controller's metrics (so `up` can be shown per agent without knowing the release name). The
per-migration and per-VM series carry their VM's `namespace` and `name`, as KubeVirt's own
migration metrics do (the controller names a bare-QEMU migration after its RdmaMigration; the
ServiceMonitors' honorLabels keep that namespace): they are selected by the agents' scrape job and
node, never by rdmig's namespace, and back the VM namespace and VM variables. The ctest deploy_dashboard_prometheus runs Debian's Prometheus against live agents
and a live controller during a real migration and evaluates every query here through its API.

Counting events over a window: increase() cannot see the increment that created a series. The
agent creates the series of its fixed label values at 0 when it starts (reasons, results,
transports), but not those of open-ended ones (transport error kinds), and a series an agent
created before Prometheus' first scrape of it still reads as born with its value. Every
increase() here is therefore written by `events()`:
`(x unless last_over_time(x[5m] offset W)) or increase(x[W])`, which counts a series that appeared
within the window with its whole value (a counter created within the window counted every one of
its events there).
"""
import json
import os
import sys

AGENT = 'namespace=~"$namespace", node=~"$node"'
CTRL = 'namespace=~"$namespace"'
# The per-migration and per-VM series: `namespace` there is the VM's (see above).
MIGRATION = 'job=~"$agent_job", node=~"$node", namespace=~"$vm_namespace", name=~"$vm"'
# The controller's per-VMI series (RdmaMigrations that name a VMI): the VMI's namespace and name.
CTRL_VMI = 'job=~"$controller_job", namespace=~"$vm_namespace", name=~"$vm"'
DS = {"type": "prometheus", "uid": "${datasource}"}
# KubeVirt mode's per-VMI series of the source agent (its record is the complete one: the target
# hands it libvirt's figures), and the labels of one KubeVirt migration row.
# The series that name VMs for the VM variables: bare-QEMU migrations and KubeVirt VMIs.
VM_SERIES = "rdmig_migration_total_bytes|rdmig_kubevirt_migration_info"
KV_VMI = MIGRATION + ', role="source"'
KV_BY = "namespace, name, node"
KV_INFO_LABELS = "source_node, target_node, result, transport, transport_reason, reason"


class Layout:
    """Places panels left to right on Grafana's 24-column grid."""

    def __init__(self):
        self.panels, self.x, self.y, self.row_h, self.next_id = [], 0, 0, 0, 1

    def row(self, title):
        self.newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": self._id(),
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def newline(self):
        self.y += self.row_h
        self.x, self.row_h = 0, 0

    def add(self, panel, w, h):
        if self.x + w > 24:
            self.newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _id(self):
        self.next_id += 1
        return self.next_id - 1


def target(expr, legend="", ref="A", fmt=None, instant=False):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": not instant,
         "instant": instant}
    if fmt:
        t["format"] = fmt
    return t


def panel(kind, title, description, targets, unit="short", **extra):
    p = {"type": kind, "title": title, "description": description, "datasource": DS,
         "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                                  "showPoints": "never", "spanNulls": False}
        p["options"] = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    elif kind == "stat":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "none", "textMode": "value_and_name"}
    elif kind == "bargauge":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "orientation": "horizontal", "displayMode": "gradient"}
    elif kind == "piechart":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "pieType": "donut", "legend": {"displayMode": "table", "placement": "right",
                                                       "values": ["value", "percent"]}}
    elif kind == "heatmap":
        p["options"] = {"calculate": False, "yAxis": {"unit": unit}, "cellGap": 1,
                        "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64}}
    elif kind == "state-timeline":
        p["fieldConfig"]["defaults"].update(
            color={"mode": "thresholds"}, thresholds={"mode": "absolute", "steps": [
                {"color": "red", "value": None}, {"color": "green", "value": 1}]},
            mappings=[{"type": "value", "options": {"0": {"text": "down", "color": "red"},
                                                    "1": {"text": "up", "color": "green"}}}])
        p["options"] = {"mergeValues": True, "showValue": "never", "alignValue": "left", "rowHeight": 0.8,
                        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False}}
    p.update(extra)
    return p


def events(metric, sel, window):
    """Increase of the counter `metric{sel}` over `window`, counting series created within it (see above)."""
    x = "%s{%s}" % (metric, sel)
    return "((%s unless %s) or increase(%s[%s]))" % (x, existed(x, window), x, window)


def existed(x, ago):
    """The series of `x` that had a sample in the 5 minutes before `ago` ago. A range selector skips
    the staleness markers that a failed scrape leaves, so a missed scrape does not make an old
    series look new (`x offset ago` would)."""
    return "last_over_time(%s[5m] offset %s)" % (x, ago)


def quantiles(metric, sel, by, window, qs=(0.5, 0.99)):
    return [target('histogram_quantile(%s, sum by (le, %s) (rate(%s_bucket{%s}[%s])))' % (q, by, metric, sel, window),
                   "p%d {{%s}}" % (round(q * 100), by)) for q in qs]


def table_column(ref, name, unit):
    return {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": unit}]}, \
        ("Value #%s" % ref, name)


def annotation(name, color, expr, title, text, tags):
    """A Prometheus annotation: an event at each step where `expr` has a series (Grafana merges
    consecutive steps into a region). `$__interval` is the step, so `x - x offset $__interval`
    sees each change of a counter, and `x unless existed(x, "$__interval")` each new series,
    exactly once at any zoom."""
    return {"name": name, "datasource": DS, "enable": True, "hide": False, "iconColor": color,
            "expr": expr, "step": "15s", "titleFormat": title, "textFormat": text, "tagKeys": tags,
            "useValueForTime": False}


def kubevirt(L):
    """KubeVirt mode: which VMI migrations (drains, virtctl migrate, RdmaMigrations naming a VMI)
    rdmig carried, which it left to KubeVirt's own path and why, and how fast (docs/metrics.md)."""
    src = AGENT + ', role="source"'
    L.row("KubeVirt: VMI migrations")
    L.add(panel("stat", "Carried by rdmig (KubeVirt)", "Share of the KubeVirt migrations that started on the "
                "selected agents in the time range that rdmig carried (ended Succeeded or Failed); the rest went "
                "over KubeVirt's own path (NotCarried, reasons beside). Alert RdmigKubevirtNotCarried.",
                [target("sum (%s) / sum (%s)" % (events("rdmig_kubevirt_migrations_total", src + ', result=~"Succeeded|Failed"',
                                                        "$__range"),
                                                 events("rdmig_kubevirt_migrations_total", src, "$__range")),
                        "carried", instant=True)], unit="percentunit",
                fieldConfig={"defaults": {"unit": "percentunit", "min": 0, "max": 1, "thresholds": {
                    "mode": "absolute", "steps": [{"color": "red", "value": None}, {"color": "orange", "value": 0.5},
                                                  {"color": "green", "value": 0.9}]}}, "overrides": []}), 4, 6)
    L.add(panel("stat", "KubeVirt migrations by result", "KubeVirt migrations that ended in the time range, "
                "counted on their source agent: Succeeded and Failed were carried by rdmig, NotCarried went over "
                "KubeVirt's own path.",
                [target("sum by (result) (%s)" % events("rdmig_kubevirt_migrations_total", src, "$__range"),
                        "{{result}}", instant=True)]), 6, 6)
    L.add(panel("bargauge", "Not carried, by reason", "Why the node hook left migrations to KubeVirt's own path in "
                "the time range (reason codes: docs/metrics.md; what to do: docs/troubleshooting.md). post_copy, "
                "same_node and decentralized are by design, draining and peer_draining expected while an agent "
                "drains (an upgrade); the others are faults.",
                [target("sum by (reason) (%s) > 0" % events("rdmig_kubevirt_not_carried_total", AGENT, "$__range"),
                        "{{reason}}", instant=True)]), 6, 6)
    L.add(panel("stat", "Carried by transport", "Carried KubeVirt migrations in the time range by transport "
                "(source side). TCP on nodes whose agents see RDMA devices: alert RdmigKubevirtCarriedOverTcp.",
                [target("sum by (transport) (%s)" % events("rdmig_kubevirt_carried_total", src, "$__range"),
                        "{{transport}}", instant=True)]), 4, 6)
    L.add(panel("stat", "Node hook served", "1 where the agent's node hook socket (kubevirt.hookSocket) is its "
                "own listener; 0: KubeVirt's Plugin cannot reach it and nothing is carried on that node (alert "
                "RdmigKubevirtHookNotServed).",
                [target("min by (node) (rdmig_kubevirt_hook_serving{%s})" % AGENT, "{{node}}")],
                fieldConfig={"defaults": {"unit": "short", "thresholds": {"mode": "absolute", "steps": [
                    {"color": "red", "value": None}, {"color": "green", "value": 1}]}}, "overrides": []}), 4, 6)
    L.add(panel("stat", "Plaintext KubeVirt migrations (disableTLS)", "Migrations in the time range whose own "
                "TLS KubeVirt had turned off (migrations.disableTLS: the source agent saw QEMU's stream in clear), "
                "by what the agent did (kubevirt.plaintextMigrations): carried (between the agents encrypted only "
                "with dataPlane.tls on and over TCP) or refused. docs/security.md.",
                [target("sum by (action) (%s)" % events("rdmig_kubevirt_plaintext_migrations_total", AGENT, "$__range"),
                        "{{action}}", instant=True)]), 4, 7)
    L.add(panel("timeseries", "Carried and not carried over time", "In each interval, on the source agents: "
                "KubeVirt migrations by result, the node hook's decisions (carried, skipped, error) and the "
                "not-carried reasons.",
                [target("sum by (result) (%s)" % events("rdmig_kubevirt_migrations_total", src, "$__rate_interval"),
                        "ended {{result}}"),
                 target("sum by (decision) (%s)" % events("rdmig_kubevirt_hook_calls_total", AGENT, "$__rate_interval"),
                        "hook {{decision}}"),
                 target("sum by (reason) (%s)" % events("rdmig_kubevirt_not_carried_total", AGENT, "$__rate_interval"),
                        "not carried: {{reason}}")]), 12, 7)
    L.add(panel("timeseries", "Carried KubeVirt migrations running, per node", "KubeVirt migrations each agent "
                "carries now (source and target).",
                [target("sum by (node) (rdmig_kubevirt_migrations_active{%s})" % AGENT, "{{node}}")]), 8, 7)
    columns = [table_column("A", "Ended", "dateTimeAsIso"), table_column("B", "Connections", "short"),
               table_column("C", "libvirt total time", "s"), table_column("D", "libvirt downtime", "s"),
               table_column("E", "Bytes", "bytes"), table_column("F", "Throughput", "Bps"),
               table_column("G", "Carried", "short")]
    last = "max by (%s) (last_over_time(%%s{%s}[$__range]))" % (KV_BY, KV_VMI)
    L.add(panel("table", "KubeVirt migrations (per VMI)", "The last migration of each VMI in the time range, as its "
                "source agent saw it: source and target node, result (Succeeded, Failed: carried by rdmig; "
                "NotCarried with its reason code), transport and why, KubeVirt connections carried, libvirt's "
                "total time and downtime, bytes sent and average throughput. An agent keeps "
                "migration.historySize records.",
                [target("topk by (%s) (1, last_over_time(rdmig_kubevirt_migration_info{%s}[$__range])) * 1000"
                        % (KV_BY, KV_VMI), fmt="table", instant=True)]
                + [target(last % m, fmt="table", instant=True) for m in (
                    "rdmig_kubevirt_migration_connections", "rdmig_kubevirt_migration_total_time_seconds",
                    "rdmig_kubevirt_migration_downtime_seconds")]
                + [target("max by (%s) (last_over_time(rdmig_kubevirt_migration_bytes{%s, direction=\"sent\"}"
                          "[$__range]))" % (KV_BY, KV_VMI), fmt="table", instant=True)]
                + [target(last % m, fmt="table", instant=True) for m in (
                    "rdmig_kubevirt_migration_throughput_bytes_per_second", "rdmig_kubevirt_migration_carried")],
                fieldConfig={"defaults": {"unit": "short", "custom": {"align": "auto"}},
                             "overrides": [c[0] for c in columns]},
                transformations=[{"id": "merge", "options": {}},
                                 {"id": "organize", "options": {
                                     "excludeByName": {"Time": True, "job": True, "instance": True, "role": True},
                                     "indexByName": {"namespace": 0, "name": 1, "source_node": 2, "target_node": 3,
                                                     "result": 4, "reason": 5, "transport": 6, "transport_reason": 7},
                                     "renameByName": dict([("namespace", "Namespace"), ("name", "VMI"),
                                                           ("node", "Agent"), ("source_node", "Source node"),
                                                           ("target_node", "Target node"), ("result", "Result"),
                                                           ("reason", "Not carried because"),
                                                           ("transport", "Transport"),
                                                           ("transport_reason", "Transport because")]
                                                          + [c[1] for c in columns])}}],
                options={"showHeader": True, "sortBy": [{"displayName": "Ended", "desc": True}]}), 24, 8)
    L.add(panel("stat", "KubeVirt downtime and total time", "libvirt's figures of the carried migrations that "
                "ended in the time range (read on the target agent), quantiles by transport.",
                [target("histogram_quantile(%s, sum by (le, transport) (%s))"
                        % (q, events("rdmig_kubevirt_%s_seconds_bucket" % what, AGENT, "$__range")),
                        "%s p%d {{transport}}" % (what.replace("_", " "), round(q * 100)), instant=True)
                 for what, q in (("downtime", 0.5), ("downtime", 0.95), ("total_time", 0.5), ("total_time", 0.95))],
                unit="s"), 8, 8)
    L.add(panel("heatmap", "KubeVirt downtime distribution", "Carried migrations per libvirt downtime bucket in "
                "each interval.",
                [target("sum by (le) (%s)" % events("rdmig_kubevirt_downtime_seconds_bucket", AGENT, "$__rate_interval"),
                        "{{le}}", fmt="heatmap")], unit="s"), 8, 8)
    L.add(panel("heatmap", "KubeVirt total time distribution", "Carried migrations per libvirt total-time bucket "
                "in each interval.",
                [target("sum by (le) (%s)" % events("rdmig_kubevirt_total_time_seconds_bucket", AGENT,
                                                    "$__rate_interval"), "{{le}}", fmt="heatmap")], unit="s"), 8, 8)
    L.add(panel("bargauge", "KubeVirt throughput per node pair", "Average throughput of the last carried "
                "migration of the selected VMIs, the best per source and target node.",
                [target("max by (source_node, target_node) (rdmig_kubevirt_migration_throughput_bytes_per_second{%s} "
                        "* on (instance, namespace, name, role) group_left (source_node, target_node) "
                        "group by (instance, namespace, name, role, source_node, target_node) "
                        "(rdmig_kubevirt_migration_info{%s, result=~\"Succeeded|Failed\"}))" % (KV_VMI, KV_VMI),
                        "{{source_node}} -> {{target_node}}", instant=True)], unit="Bps"), 12, 7)
    L.add(panel("bargauge", "KubeVirt last downtime per VMI", "libvirt's downtime of each VMI's last carried "
                "migration.",
                [target("max by (namespace, name) (rdmig_kubevirt_migration_downtime_seconds{%s})" % KV_VMI,
                        "{{namespace}}/{{name}}", instant=True)], unit="s"), 12, 7)
    # RdmaMigrations that name a VMI: what the controller mirrored into their status.
    ctrl_columns = [table_column("A", "Running", "short"), table_column("B", "Carried", "short"),
                    table_column("C", "Downtime", "s"), table_column("D", "Duration", "s"),
                    table_column("E", "Transferred", "bytes")]
    L.add(panel("table", "RdmaMigrations of VMIs (controller)", "The last migration of each VMI that an "
                "RdmaMigration named, as the controller mirrored it: running, carried by rdmig (1) or by "
                "KubeVirt (0), libvirt's downtime, duration and the bytes rdmig carried.",
                [target("max by (namespace, name) (last_over_time(%s{%s}[$__range]))" % (m, CTRL_VMI),
                        fmt="table", instant=True) for m in (
                    "rdmig_controller_vmi_migration_active", "rdmig_controller_vmi_migration_carried",
                    "rdmig_controller_vmi_migration_downtime_seconds", "rdmig_controller_vmi_migration_duration_seconds",
                    "rdmig_controller_vmi_migration_transferred_bytes")],
                fieldConfig={"defaults": {"unit": "short", "custom": {"align": "auto"}},
                             "overrides": [c[0] for c in ctrl_columns]},
                transformations=[{"id": "merge", "options": {}},
                                 {"id": "organize", "options": {
                                     "excludeByName": {"Time": True},
                                     "renameByName": dict([("namespace", "Namespace"), ("name", "VMI")]
                                                          + [c[1] for c in ctrl_columns])}}]), 16, 7)
    L.add(panel("stat", "VMI migrations ended (controller)", "KubeVirt migrations of RdmaMigrations that ended in "
                "the time range, by result and whether rdmig carried them (true, false, unknown).",
                [target("sum by (result, carried) (%s)" % events("rdmig_controller_kubevirt_migrations_total", CTRL,
                                                                 "$__range"),
                        "{{result}} carried={{carried}}", instant=True)]), 8, 7)


def build():
    L = Layout()
    L.row("Overview")
    L.add(panel("stat", "Active migrations", "Migrations in progress on the selected agents, by role "
                "(a migration counts once on its source and once on its target).",
                [target("sum by (role) (rdmig_migrations_active{%s})" % AGENT, "{{role}}")]), 5, 5)
    L.add(panel("stat", "Migrations by result", "Migrations finished in the time range, counted on the source "
                "agent, by result (succeeded, failed, cancelled).",
                [target("sum by (result) (%s)" % events("rdmig_migrations_finished_total", AGENT + ', role="source"',
                                                        "$__range"), "{{result}}", instant=True)]), 7, 5)
    L.add(panel("piechart", "RDMA versus TCP", "Transport chosen for the migrations started in the time range.",
                [target("sum by (transport) (%s)" % events("rdmig_transport_selected_total", AGENT, "$__range"),
                        "{{transport}}", instant=True)]), 6, 5)
    L.add(panel("stat", "RDMA devices per node", "Usable RDMA devices each agent sees (0: TCP only on that node).",
                [target("rdmig_rdma_devices{%s}" % AGENT, "{{node}}")]), 6, 5)
    L.add(panel("timeseries", "Migrations started and finished", "Per source agent, in each interval.",
                [target("sum by (result) (%s)" % events("rdmig_migrations_finished_total", AGENT + ', role="source"',
                                                        "$__rate_interval"), "finished {{result}}"),
                 target("sum (%s)" % events("rdmig_migrations_started_total", AGENT + ', role="source"',
                                            "$__rate_interval"), "started")]), 12, 7)
    L.add(panel("timeseries", "RdmaMigration objects by phase (controller)", "As the controller replicas see "
                "them; both replicas keep the same cache, so the maximum is shown.",
                [target("max by (phase) (rdmig_controller_migrations{%s})" % CTRL, "{{phase}}")]), 8, 7)
    L.add(panel("stat", "Controller leader", "Replicas that hold the leader Lease (1 expected).",
                [target("sum (rdmig_controller_leader{%s})" % CTRL, "leaders")]), 4, 7)
    L.add(panel("state-timeline", "Agents and controller up", "Prometheus' `up` of each agent (per node) and "
                "each controller replica: down means no scrape, and migrations from or to that node fail.",
                [target('max by (node) (up{job=~"$agent_job", %s})' % AGENT, "agent {{node}}"),
                 target('max by (instance) (up{job=~"$controller_job", %s})' % CTRL, "controller {{instance}}")]),
          24, 5)
    L.add(panel("state-timeline", "RDMA rails up", "Each configured RDMA rail (rdma.devices[rail]) of each agent: "
                "up when the agent uses it, down with the reason it left the rail out at start (no-device, "
                "no-address, gid-not-found, listener-failed; transport-tcp on an agent configured for TCP). "
                "A rail down beside an up rail of the same node: its migrations use fewer rails and are slower "
                "(alert RdmigRdmaRailDown); no rail up: RDMA is not used there (alert RdmigRdmaUnavailable).",
                [target("max by (node, rail, device, reason) (rdmig_rdma_rail_up{%s})" % AGENT,
                        "{{node}} rail {{rail}}: {{reason}} {{device}}")]), 24, 6)

    L.row("Migrations")
    columns = [table_column("A", "Guest RAM", "bytes"), table_column("B", "Transferred", "bytes"),
               table_column("C", "Remaining", "bytes"), table_column("D", "Throughput now", "Bps"),
               table_column("E", "Dirty rate", "Bps")]
    per_migration = ("rdmig_migration_total_bytes", "rdmig_migration_transferred_bytes",
                     "rdmig_migration_remaining_bytes", "rdmig_migration_throughput_bytes_per_second",
                     "rdmig_migration_dirty_rate_bytes_per_second")
    by_migration = "namespace, name, migration, role, node"
    # Phase and transport: the labels of each migration's latest rdmig_migration_info series (the
    # series is replaced at each phase change; topk keeps the one sampled last in the range). Its
    # value, a timestamp, is hidden. Start and end: unix seconds, in ms for Grafana's date unit; a
    # running migration has no end.
    info = ("max by (%s, phase, transport) (topk by (%s) (1, last_over_time(timestamp(rdmig_migration_info{%s})"
            "[$__range:$__interval])))" % (by_migration, by_migration, MIGRATION))
    columns += [table_column("G", "Started", "dateTimeAsIso"), table_column("H", "Ended", "dateTimeAsIso")]
    times = [target("max by (%s) (last_over_time(%s{%s}[$__range])) * 1000" % (by_migration, m, MIGRATION),
                    fmt="table", instant=True)
             for m in ("rdmig_migration_start_time_seconds", "rdmig_migration_end_time_seconds")]
    L.add(panel("table", "Running and recent migrations", "Every migration the selected agents held in the time "
                "range (an agent keeps its last migration.historySize), one row per agent and role: its phase "
                "(Pending, Connecting, Migrating, Completing while it runs; Succeeded, Failed or Cancelled), "
                "transport, start and end (empty while it runs), and the last value of its figures.",
                [target("max by (%s) (last_over_time(%s{%s}[$__range]))" % (by_migration, m, MIGRATION),
                        fmt="table", instant=True) for m in per_migration]
                + [target(info, fmt="table", instant=True)] + times,
                fieldConfig={"defaults": {"unit": "short", "custom": {"align": "auto"}},
                             "overrides": [c[0] for c in columns]},
                transformations=[{"id": "merge", "options": {}},
                                 {"id": "organize", "options": {
                                     "excludeByName": {"Time": True, "Value #F": True},
                                     "indexByName": {"namespace": 0, "name": 1, "migration": 2, "role": 3, "node": 4,
                                                     "phase": 5, "transport": 6, "Value #G": 7, "Value #H": 8},
                                     "renameByName": dict([("namespace", "Namespace"), ("name", "VM"),
                                                           ("migration", "Migration"), ("role", "Role"),
                                                           ("node", "Node"), ("phase", "Phase"),
                                                           ("transport", "Transport")] + [c[1] for c in columns])}}],
                options={"showHeader": True, "sortBy": [{"displayName": "Started", "desc": True}]}), 24, 8)
    L.add(panel("bargauge", "Failure reasons", "Failed migrations in the time range by role and reason "
                "(timeout, peer_lost, qemu, protocol, io, target_failed, vm_paused_on_source, other); reasons "
                "without a failure are left out. A failed migration counts once on each agent that saw it fail.",
                [target("sum by (role, reason) (%s) > 0" % events("rdmig_migration_failures_total", AGENT, "$__range"),
                        "{{role}}: {{reason}}", instant=True)]), 10, 7)
    L.add(panel("timeseries", "Failures by reason", "Failed migrations in each interval, by role and reason.",
                [target("sum by (role, reason) (%s)" % events("rdmig_migration_failures_total", AGENT,
                                                              "$__rate_interval"), "{{role}}: {{reason}}")]), 10, 7)
    L.add(panel("stat", "VMs left paused on the source", "Source migrations in the time range that ended with the "
                "VM paused on the source because the target's verdict was lost: an operator must find where the "
                "VM runs (alert RdmigVmPausedOnSource).",
                [target("sum (%s)" % events("rdmig_source_vms_left_paused_total", AGENT, "$__range"), "paused",
                        instant=True)],
                fieldConfig={"defaults": {"unit": "short", "thresholds": {"mode": "absolute", "steps": [
                    {"color": "green", "value": None}, {"color": "red", "value": 1}]}}, "overrides": []}), 4, 7)

    L.row("Throughput and progress")
    L.add(panel("timeseries", "Throughput per migration", "QEMU's current throughput of each running migration "
                "(source side).",
                [target('rdmig_migration_throughput_bytes_per_second{%s, role="source"}' % MIGRATION,
                        "{{namespace}}/{{name}} {{migration}}")], unit="Bps"), 12, 8)
    L.add(panel("timeseries", "Data-plane throughput by transport", "Migration stream bytes carried by the agents, "
                "per node, transport and direction (path checks: the Path checks row).",
                [target("sum by (node, transport, direction) (rate(rdmig_transferred_bytes_total{%s, traffic=\"migration\"}"
                        "[$__rate_interval]))" % AGENT, "{{node}} {{transport}} {{direction}}")], unit="Bps"), 12, 8)
    L.add(panel("timeseries", "Migration progress", "Bytes transferred and remaining, and guest RAM size, "
                "per migration (source side).",
                [target('rdmig_migration_transferred_bytes{%s, role="source"}' % MIGRATION, "transferred {{namespace}}/{{name}}"),
                 target('rdmig_migration_remaining_bytes{%s, role="source"}' % MIGRATION, "remaining {{namespace}}/{{name}}"),
                 target('rdmig_migration_total_bytes{%s, role="source"}' % MIGRATION, "total {{namespace}}/{{name}}")],
                unit="bytes"), 12, 8)
    L.add(panel("timeseries", "Guest dirty rate", "Memory the guest dirties per second, as QEMU sees it; a dirty "
                "rate near the throughput keeps a migration from converging.",
                [target('rdmig_migration_dirty_rate_bytes_per_second{%s, role="source"}' % MIGRATION,
                        "{{namespace}}/{{name}}")],
                unit="Bps"), 6, 8)
    L.add(panel("stat", "Transferred bytes", "Migration bytes sent by the data plane in the time range, by transport.",
                [target("sum by (transport) (%s)" % events("rdmig_transferred_bytes_total",
                                                           AGENT + ', direction="sent", traffic="migration"',
                                                           "$__range"), "{{transport}}", instant=True)],
                unit="bytes"), 6, 8)

    L.row("Downtime and duration")
    L.add(panel("bargauge", "Last downtime per VM", "Guest downtime of each VM's last migration, as QEMU reports it.",
                [target("max by (namespace, name) (rdmig_last_downtime_seconds{%s})" % MIGRATION, "{{namespace}}/{{name}}",
                        instant=True)],
                unit="s"), 6, 8)
    L.add(panel("bargauge", "Last switchover per VM", "Source STOP to target RESUME of each VM's last migration "
                "(only when the target runs afterwards).",
                [target("max by (namespace, name) (rdmig_last_switchover_seconds{%s})" % MIGRATION, "{{namespace}}/{{name}}",
                        instant=True)],
                unit="s"), 6, 8)
    L.add(panel("heatmap", "Downtime distribution", "Migrations per downtime bucket in each interval.",
                [target("sum by (le) (%s)" % events("rdmig_downtime_seconds_bucket", AGENT, "$__rate_interval"),
                        "{{le}}", fmt="heatmap")], unit="s"), 6, 8)
    L.add(panel("stat", "Downtime and switchover over the range", "Quantiles over every migration in the time "
                "range, by transport.",
                [target("histogram_quantile(%s, sum by (le, transport) (%s))"
                        % (q, events("rdmig_%s_seconds_bucket" % what, AGENT, "$__range")),
                        "%s p%d {{transport}}" % (what, round(q * 100)), instant=True)
                 for what, q in (("downtime", 0.5), ("downtime", 0.95), ("switchover", 0.95))], unit="s"), 6, 8)
    L.add(panel("timeseries", "Total migration duration", "Start to result on the source, mean and p95 over "
                "the migrations that finished in each interval, by result.",
                [target("sum by (result) (%s) / sum by (result) (%s)"
                        % (events("rdmig_migration_duration_seconds_sum", AGENT + ', role="source"', "$__rate_interval"),
                           events("rdmig_migration_duration_seconds_count", AGENT + ', role="source"',
                                  "$__rate_interval")), "mean {{result}}"),
                 target("histogram_quantile(0.95, sum by (le, result) (%s))"
                        % events("rdmig_migration_duration_seconds_bucket", AGENT + ', role="source"', "$__rate_interval"),
                        "p95 {{result}}")], unit="s"), 24, 7)

    L.row("Data plane")
    L.add(panel("timeseries", "Chunk size", "Payload of each chunk sent: mean and median. Chunks go out early "
                "when QEMU has nothing more ready, so they can be smaller than the configured size.",
                [target("sum by (transport) (rate(rdmig_chunk_size_bytes_sum{%s}[$__rate_interval])) / "
                        "sum by (transport) (rate(rdmig_chunk_size_bytes_count{%s}[$__rate_interval]))" % (AGENT, AGENT),
                        "mean {{transport}}")] + quantiles("rdmig_chunk_size_bytes", AGENT, "transport",
                                                         "$__rate_interval", (0.5,)), unit="bytes"), 8, 8)
    L.add(panel("timeseries", "Chunk write latency", "Post to completion of each chunk write, p50 and p99.",
                quantiles("rdmig_chunk_write_latency_seconds", AGENT, "transport", "$__rate_interval"),
                unit="s"), 8, 8)
    L.add(panel("timeseries", "Chunks in flight", "Chunks written but not yet acknowledged, per node and transport.",
                [target("sum by (node, transport) (rdmig_chunks_in_flight{%s})" % AGENT, "{{node}} {{transport}}")]),
          8, 8)
    L.add(panel("timeseries", "Chunks per second", "Chunks carried, per node, transport, direction and traffic "
                "(migration, pathcheck).",
                [target("sum by (node, transport, direction, traffic) (rate(rdmig_chunks_total{%s}[$__rate_interval]))"
                        % AGENT, "{{node}} {{transport}} {{direction}} {{traffic}}")], unit="cps"), 8, 8)
    L.add(panel("timeseries", "Credit stalls", "Times per second a sender waited for a free slot in the "
                "receiver's ring (raise ringDepth when this is high).",
                [target("sum by (node, transport) (rate(rdmig_credit_stalls_total{%s}[$__rate_interval]))" % AGENT,
                        "{{node}} {{transport}}")], unit="ops"), 8, 8)
    L.add(panel("timeseries", "Transport errors by kind", "Data-plane errors in each interval.",
                [target("sum by (transport, kind) (%s)" % events("rdmig_transport_errors_total", AGENT,
                                                                 "$__rate_interval"), "{{transport}} {{kind}}")]), 8, 8)
    L.add(panel("bargauge", "Transport selection by reason", "Why each transport was chosen, in the time range.",
                [target("sum by (transport, reason) (%s)" % events("rdmig_transport_selected_total", AGENT, "$__range"),
                        "{{transport}} ({{reason}})", instant=True)]), 24, 6)

    L.row("Path checks")
    L.add(panel("bargauge", "Path checks by node pair", "RdmaPathCheck pairs that ended in the time range, by "
                "source node, target node and result (Passed, FellBack: carried over TCP where auto could have "
                "used RDMA, Failed), as the controller wrote them. The pair's reason, rails and round trip are in "
                "the objects: kubectl get rdmapathchecks.",
                [target("sum by (source_node, target_node, result) (%s)"
                        % events("rdmig_controller_pathcheck_pairs_total", CTRL, "$__range"),
                        "{{source_node}} -> {{target_node}} {{result}}", instant=True)]), 12, 7)
    L.add(panel("bargauge", "Path check throughput by node pair", "Throughput of the last pair from each source "
                "node to each target node that carried its bytes (bytes over the stream's time).",
                [target("max by (source_node, target_node) (rdmig_controller_pathcheck_pair_throughput_bytes_per_second"
                        "{%s})" % CTRL, "{{source_node}} -> {{target_node}}", instant=True)], unit="Bps"), 12, 7)
    L.add(panel("bargauge", "Path checks by node and result", "RdmaPathCheck pairs this node's agent took part in, "
                "in the time range, by role (source, target) and result. The per-pair figures (transport, reason, "
                "throughput, round trip) are in the objects: kubectl get rdmapathchecks.",
                [target("sum by (node, role, result) (%s)" % events("rdmig_pathchecks_finished_total", AGENT, "$__range"),
                        "{{node}} {{role}} {{result}}", instant=True)]), 12, 7)
    L.add(panel("timeseries", "Path check throughput", "Bytes of path checks carried by the agents, per node, "
                "transport and direction (not counted in the migration panels).",
                [target("sum by (node, transport, direction) (rate(rdmig_transferred_bytes_total{%s, "
                        "traffic=\"pathcheck\"}[$__rate_interval]))" % AGENT, "{{node}} {{transport}} {{direction}}")],
                unit="Bps"), 12, 7)

    kubevirt(L)

    # RdmaDrainPlans (docs/drain.md): the series carry the plan's namespace and name (honorLabels),
    # so they are selected by the controller's job alone.
    plan = 'job=~"$controller_job"'
    L.row("Drain plans")
    L.add(panel("timeseries", "Drain time: forecast and actual", "Each RdmaDrainPlan's forecast drain time (its "
                "order and concurrency) and, once it executes, the drain's time so far and in all. Per VM figures "
                "(forecast, measured, ratio): kubectl get rddp <plan> -o jsonpath='{.status.vms}'.",
                [target("max by (namespace, name) (rdmig_controller_drainplan_predicted_drain_seconds{%s})" % plan,
                        "{{namespace}}/{{name}} forecast"),
                 target("max by (namespace, name) (rdmig_controller_drainplan_actual_drain_seconds{%s})" % plan,
                        "{{namespace}}/{{name}} actual")], unit="s"), 12, 8)
    L.add(panel("bargauge", "Drain plan VMs by state", "Each RdmaDrainPlan's VMs: pending (to start), running, "
                "succeeded, failed, skipped (forecast not to converge within its limits, or no memory in its spec; "
                "spec.notConverging; or not started because the plan was cancelled), cancelled (running when the "
                "plan was cancelled with spec.runningOnCancel Cancel). A forecast-only plan counts its planned VMs "
                "as pending.",
                [target("max by (namespace, name, state) (rdmig_controller_drainplan_vms{%s})" % plan,
                        "{{namespace}}/{{name}} {{state}}", instant=True)]), 12, 8)

    L.row("Controller")
    L.add(panel("timeseries", "Reconciles by result", "Reconciles of RdmaMigration objects per second.",
                [target("sum by (result) (rate(rdmig_controller_reconciles_total{%s}[$__rate_interval]))" % CTRL,
                        "{{result}}")], unit="ops"), 12, 7)
    L.add(panel("timeseries", "Agent requests by HTTP code", "Controller calls on the agents' REST API per "
                "second (error: no response).",
                [target("sum by (code) (rate(rdmig_controller_agent_requests_total{%s}[$__rate_interval]))" % CTRL,
                        "{{code}}")], unit="reqps"), 12, 7)

    def query_var(name, label, query, all_value=".*", hide=0):
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "definition": query, "refresh": 2, "includeAll": True, "multi": True, "allValue": all_value,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1, "hide": hide}

    source = 'rdmig_migration_total_bytes{%s, role="source"}' % MIGRATION
    finished = 'rdmig_migrations_finished_total{%s, role="source", result=~"%%s"}' % AGENT
    ended = "sum by (node, result) (%s - %s offset $__interval) > 0"
    kv_info = 'rdmig_kubevirt_migration_info{%s, result=~"%%s"}' % KV_VMI
    return {
        "title": "rdmig: RDMA live migration",
        "uid": "rdmig-overview",
        "description": "rdmig agents and controller: migrations, throughput, downtime, data plane.",
        "tags": ["rdmig", "migration", "rdma", "kubevirt"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "annotations": {"list": [
            {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
             "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
            # A migration starts when its source agent creates its per-migration series.
            annotation("Migration started", "blue",
                       "group by (node, namespace, name, migration) (%s unless %s)"
                       % (source, existed(source, "$__interval")),
                       "Migration of {{namespace}}/{{name}} started", "migration {{migration}} from node {{node}}",
                       "namespace,name,node"),
            annotation("Migration succeeded", "green", ended % (finished % "succeeded", finished % "succeeded"),
                       "Migration succeeded", "source node {{node}}", "node,result"),
            annotation("Migration failed or cancelled", "red",
                       ended % (finished % "failed|cancelled", finished % "failed|cancelled"),
                       "Migration {{result}}", "source node {{node}}", "node,result"),
            # A KubeVirt migration ends when its source agent writes the VMI's info series: a new
            # series, or the same labels with a later end time (the value).
            annotation("KubeVirt migration carried", "purple",
                       "group by (%s, %s) ((%s unless %s) or (%s > last_over_time(%s[5m] offset $__interval)))"
                       % (KV_BY, KV_INFO_LABELS, kv_info % "Succeeded|Failed", existed(kv_info % "Succeeded|Failed", "$__interval"),
                          kv_info % "Succeeded|Failed", kv_info % "Succeeded|Failed"),
                       "KubeVirt migration of {{namespace}}/{{name}} {{result}} (rdmig, {{transport}})",
                       "{{source_node}} -> {{target_node}}, transport {{transport}} ({{transport_reason}})",
                       "namespace,name,result,transport"),
            annotation("KubeVirt migration not carried", "orange",
                       "group by (%s, %s) ((%s unless %s) or (%s > last_over_time(%s[5m] offset $__interval)))"
                       % (KV_BY, KV_INFO_LABELS, kv_info % "NotCarried", existed(kv_info % "NotCarried", "$__interval"),
                          kv_info % "NotCarried", kv_info % "NotCarried"),
                       "KubeVirt migration of {{namespace}}/{{name}} not carried: {{reason}}",
                       "{{source_node}} -> {{target_node}} over KubeVirt's own path ({{reason}})",
                       "namespace,name,reason"),
        ]},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": ""},
            query_var("namespace", "Namespace", "label_values(rdmig_rdma_devices, namespace)"),
            query_var("node", "Node", 'label_values(rdmig_rdma_devices{namespace=~"$namespace"}, node)'),
            # The scrape jobs of the agents and of the controller (for `up`); All = every one found.
            query_var("agent_job", "Agent scrape job", 'label_values(rdmig_rdma_devices{namespace=~"$namespace"}, job)',
                      all_value=None, hide=2),
            query_var("controller_job", "Controller scrape job",
                      'label_values(rdmig_controller_leader{namespace=~"$namespace"}, job)', all_value=None, hide=2),
            # The VMs' own namespaces and names (KubeVirt's labels), from the selected agents' series.
            query_var("vm_namespace", "VM namespace",
                      'label_values({__name__=~"%s", job=~"$agent_job", node=~"$node"}, namespace)' % VM_SERIES),
            query_var("vm", "VM",
                      'label_values({__name__=~"%s", job=~"$agent_job", node=~"$node", '
                      'namespace=~"$vm_namespace"}, name)' % VM_SERIES),
        ]},
        "panels": L.panels,
    }


def render():
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "rdmig.json")
    with open(out, "w") as f:
        f.write(render())
    print("wrote", out)
