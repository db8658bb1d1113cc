#!/usr/bin/env python3
"""rdmig demo: a real QEMU guest live-migrated between two local rdmig-agents.

Builds a small guest (Debian's kernel + a busybox initramfs that dirties memory and prints a
counter), starts a source QEMU and a target QEMU waiting with -incoming defer, starts two
rdmig-agents on 127.0.0.1, migrates through their REST API with live progress, and prints
the result. Transport: RDMA when the agents find a device, else TCP (--transport).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rdmiglab import Agent, QemuVm, ensure_guest, parse_prometheus, start_migration  # noqa: E402
from rdmiglab.agent import TERMINAL  # noqa: E402
from rdmiglab.system_python import human  # noqa: E402



def bar(percent, width=30):
    filled = int(round(width * min(max(percent, 0), 100) / 100))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mem", type=int, default=512, help="guest RAM in MiB (default 512)")
    ap.add_argument("--dirty", type=int, default=64, help="MiB the guest dirties per second (default 64)")
    ap.add_argument("--multifd", type=int, default=0, help="multifd channels (default 0)")
    ap.add_argument("--chunk-size", default="1Mi", help="chunk size (default 1Mi, the agent default)")
    ap.add_argument("--transport", default="auto", choices=("auto", "rdma", "tcp"))
    ap.add_argument("--bandwidth", type=int, default=0, help="max bandwidth in MiB/s (0 = unlimited)")
    ap.add_argument("--keep", action="store_true", help="keep agents and the target VM running until Ctrl-C")
    args = ap.parse_args()

    print("rdmig demo: preparing the guest (Debian kernel + busybox initramfs)...", flush=True)
    ensure_guest()
    work = tempfile.mkdtemp(prefix="rdmig-demo-")
    vms, agents = [], []
    try:
        # Two agents on one host: a lab, where the source may dial the target on 127.0.0.1
        # (dataPlane.allowLoopbackPeers; never set on a node, docs/security.md).
        cfg = {"transport": args.transport, "dataPlane": {"allowLoopbackPeers": True}}
        agents.append(Agent(work, "agent-source", config=cfg))
        agents.append(Agent(work, "agent-target", config=cfg))
        src_agent, dst_agent = agents
        print("agents: source api %s (data plane :%d), target api %s (data plane :%d)"
              % (src_agent.url, src_agent.data_port, dst_agent.url, dst_agent.data_port))
        src = QemuVm(work, "source", mem_mib=args.mem, dirty_mib=args.dirty)
        vms.append(src)
        dst = QemuVm(work, "target", mem_mib=args.mem, incoming_defer=True)
        vms.append(dst)
        print("guest booting on the source QEMU (pid %d); target QEMU (pid %d) waits with -incoming defer"
              % (src.pid, dst.pid), flush=True)
        src.wait_for_counter(2, timeout=120)
        print("guest is running: counter at %d, dirtying %d MiB/s" % (src.last_counter(), args.dirty))

        options = {}
        if args.bandwidth:
            options["maxBandwidthBytesPerSecond"] = args.bandwidth << 20
        target, source = start_migration(src_agent, dst_agent, src.agent_qmp_path, dst.agent_qmp_path,
                                         multifd_channels=args.multifd, chunk_size=args.chunk_size,
                                         vm="demo-vm", **options)
        print("POST /v1/migrations: target %s answered endpoint %s; source started migration %s"
              % (dst_agent.url, target["endpoint"], source["id"]))
        t0 = time.monotonic()
        tty = sys.stdout.isatty()
        last_line = ""

        def show(st):
            nonlocal last_line
            p = st["progress"]
            line = "%-10s %s %5.1f%%  %s/s  sent %s  passes %d  chunks %d" % (
                st["phase"], bar(p["percent"]), p["percent"], human(p["throughputBytesPerSecond"]),
                human(p["transferredBytes"]), p["passes"], p["chunksSent"])
            if tty:
                sys.stdout.write("\r" + line.ljust(len(last_line)))
                sys.stdout.flush()
            elif line != last_line:
                print(line, flush=True)
            last_line = line

        s = src_agent.wait(source["id"], timeout=1800, on_status=show, interval=0.2)
        if tty:
            print()
        t = dst_agent.wait(target["id"], phases=TERMINAL, timeout=120)
        wall = time.monotonic() - t0
        r, p = s["result"], s["progress"]
        avg = (p["dataBytesSent"] / (r["totalTimeMs"] / 1000.0)) if r["totalTimeMs"] else 0
        print()
        print("result")
        print("  status            %s (source) / %s (target)" % (s["phase"], t["phase"]))
        if r["reason"]:
            print("  reason            %s" % r["reason"])
        print("  transport         %s, %d channel(s), chunk size %s" % (s["transport"], s["channels"], args.chunk_size))
        print("  total time        %s ms (QEMU), %.0f ms wall clock through the REST API" % (r["totalTimeMs"], wall * 1000))
        print("  downtime          %s ms (QEMU's figure)" % r["downtimeMs"])
        print("  switchover        %s ms (source STOP event to target RESUME event)" % r["switchoverMs"])
        print("  avg throughput    %s/s" % human(avg))
        print("  bytes             %s by QEMU, %s through the data plane" % (human(p["transferredBytes"]), human(p["dataBytesSent"])))
        print("  chunks            %d sent" % p["chunksSent"])
        if s["phase"] == "Succeeded":
            last = src.last_counter()
            after = dst.wait_for_counter(last + 1, timeout=60)
            print("  guest             target status '%s', counter %d -> %d (continues on the target)"
                  % (dst.status(), last, after))
        print("  metrics           %s/metrics and %s/metrics (Prometheus text format)" % (src_agent.url, dst_agent.url))
        samples, _ = parse_prometheus(src_agent.metrics())
        for (name, labels), value in sorted(samples.items()):
            if name in ("rdmig_migrations_finished_total", "rdmig_last_downtime_seconds",
                        "rdmig_last_switchover_seconds", "rdmig_transferred_bytes_total") and value:
                print("    %s{%s} %g" % (name, ",".join('%s="%s"' % kv for kv in sorted(labels)), value))
        if args.keep:
            print("agents and the target VM keep running; Ctrl-C to stop")
            while True:
                time.sleep(3600)
        return 0 if s["phase"] == "Succeeded" else 1
    except KeyboardInterrupt:
        return 130
    finally:
        for vm in vms:
            vm.kill()
        for a in agents:
            a.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
