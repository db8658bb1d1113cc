#!/usr/bin/python3
"""rdmig KubeVirt demo: a VMI live-migrated by KubeVirt's own path, with rdmig carrying it.

Starts the KubeVirt-shaped harness (tools/rdmiglab/kubevirt.py: two real libvirtd "launcher
pods", two "virt-handler" network namespaces, the migration-proxy stand-in with mTLS), one
rdmig agent per node in KubeVirt mode, boots the VMI on node-a and migrates it to node-b the
way KubeVirt does: the source proxy calls the agent's PreMigrationSource node hook, the agent
redirects the memory connections in the source handler's network namespace and carries them
to the target node's agent, which dials the target proxy from the target's namespace.
libvirt's control connection stays on KubeVirt's TCP. Needs root and the test packages
(scripts/demo.sh --kubevirt installs and builds everything first).
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rdmiglab.kvagents import KubevirtAgents  # noqa: E402
from rdmiglab.system_python import human, reexec_with_system_python  # noqa: E402



def redirect_rules(netns):
    """rdmig's nftables table in a handler's network namespace (empty if none)."""
    return subprocess.run(["ip", "netns", "exec", netns, "nft", "list", "table", "inet", "rdmig"],
                          capture_output=True, text=True).stdout


class Progress:
    """Prints the source agent's record of the migration while it runs (display only)."""

    def __init__(self, kv, node):
        self.kv, self.node, self.stop = kv, node, threading.Event()
        self.thread = None

    def start(self, migration_uid):
        def run():
            last = None
            while not self.stop.wait(0.25):
                try:
                    items = self.kv.records(self.node, migration_uid)
                except Exception:
                    continue
                if items:
                    i = items[0]
                    line = "  %-10s carried=%s  connections %d  sent %s  chunks %d" % (
                        i["phase"], i["carried"], i["connections"], human(i["bytesSent"]), i["chunksSent"])
                    if line != last:
                        print(line, flush=True)
                        last = line
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        if self.thread:
            self.thread.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mem", type=int, default=256, help="guest RAM in MiB (default 256)")
    ap.add_argument("--dirty", type=int, default=16, help="MiB the guest dirties per second (default 16)")
    ap.add_argument("--parallel", type=int, default=8, help="parallel migration connections (default 8)")
    ap.add_argument("--no-tls", action="store_true", help="disableTLS (KubeVirt's proxies talk plain TCP)")
    ap.add_argument("--keep", action="store_true", help="keep pods, agents and the VMI until Ctrl-C")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("demo_kubevirt: needs root (network namespaces, libvirtd, nftables)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on SIGTERM too
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    from rdmiglab.kubevirt import KubevirtCluster
    tls = not args.no_tls
    work = tempfile.mkdtemp(prefix="rdmig-kvdemo-")
    try:
        with KubevirtCluster() as cluster, KubevirtAgents(work, cluster.nodes, transport="auto") as kv:
            row = ("non-root launchers as KubeVirt 1.9 ships them (libvirt 11.3 as uid 107, QEMU 10.0)"
                   if cluster.nonroot else "root launchers (libvirt 9.0, QEMU 7.2)")
            print("rdmig KubeVirt demo: two %s, two virt-handler netns, guest %d MiB dirtying %d MiB/s"
                  % (row, args.mem, args.dirty), flush=True)
            for n in cluster.nodes:
                print("  %s: handler netns %s, pod IP %s; agent %s, node hook %s"
                      % (n, cluster.netns(n), cluster.pod_ip(n), kv[n].url, kv.hook_socket(n)))
            cluster.define_and_start_vmi("demovm", "default", mem_mib=args.mem, dirty_mib=args.dirty,
                                         boot_counter=2)
            source = cluster.vmi.node
            print("VMI default/demovm running on %s (counter %s)" % (source, cluster.serial_counter(source)))
            print("migrating %s -> %s: KubeVirt's path, %s, %d parallel connection(s), rdmig carrying it"
                  % (source, cluster.other(source), "TLS" if tls else "TLS disabled", args.parallel), flush=True)
            armed, progress = {}, Progress(kv, source)

            def before_dial(ctx):  # the source proxy called the hook and is ready: look at the netns
                rules = redirect_rules(ctx.handler_netns["source"])
                armed["netns"] = ctx.handler_netns["source"]
                armed["ok"] = ("%s . " % ctx.target_address) in rules
                armed["rules"] = [l.strip() for l in rules.splitlines() if "redirect" in l or "tproxy" in l]
                progress.start(ctx.migration_uid)

            try:
                r = cluster.migrate(parallel=args.parallel, tls=tls, hook_socket=kv.hook_socket(source),
                                    hook_timeout=5, expect_success=False, before_dial=before_dial)
            finally:
                progress.close()
            src = kv.record(r.source_node, r.migration_uid) if r.hook and r.hook.get("ok") else None
            dst = kv.record(r.target_node, r.migration_uid) if src and src["carried"] else None
            ok = r.success and bool(src and src["carried"] and src["phase"] == "Succeeded")
            print()
            print("result")
            print("  status            libvirt %s; source agent %s, target agent %s%s" % (
                "completed" if r.success else "FAILED (%s)" % r.error, src and src["phase"], dst and dst["phase"],
                "" if not src or src["carried"] else " (not carried: %s)" % src["reason"]))
            print("  total time        %s ms (libvirt's, on the target), %.0f ms wall clock of migrateToURI3"
                  % (r.total_time_ms, r.wall_ms or 0))
            print("  downtime          %s ms (libvirt's figure)" % r.downtime_ms)
            print("  avg throughput    %s/s (libvirt's data bytes / total time)" % human(r.throughput_bps))
            if src:
                print("  bytes             %s by libvirt, %s sent through the agents in %d chunks"
                      % (human(r.data_bytes), human(src["bytesSent"]), src["chunksSent"]))
                print("  connections       %d carried (1 main + %d multifd), %s; libvirt's control connection"
                      " stayed on KubeVirt's TCP" % (src["connections"], max(src["connections"] - 1, 0),
                                                     "mTLS ciphertext from the proxies" if tls else "plain"))
                print("  transport         %s (%s)" % (src["transport"], src["transportReason"]))
            print("  node hook         %s in %.2f s; %s" % (
                "ok" if r.hook and r.hook.get("ok") else "FAILED", (r.hook or {}).get("duration_s") or 0,
                ("it armed the redirect to the agent in the source handler's netns %s (nft table inet rdmig)"
                 % armed["netns"]) if armed.get("ok") else "no redirect seen in the source handler's netns"))
            if r.success:
                print("  guest             running on %s, counter %s -> %s (continues on the target)"
                      % (r.target_node, r.counter_before, r.counter_after))
            if args.keep:
                for n in cluster.nodes:
                    print("  metrics           %s/metrics (%s)" % (kv[n].url, n))
                print("pods, agents and the VMI keep running; Ctrl-C to stop", flush=True)
                threading.Event().wait()
            return 0 if ok else 1
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    reexec_with_system_python()
    sys.exit(main())
