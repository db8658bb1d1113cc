#!/usr/bin/env python3
"""rdmig benchmarks: rdmig against what a user would otherwise use, side by side in one run.

  python3 bench/run.py [--quick] [--runs N] [--sections whole,defaults,dataplane,sweep,concurrent,relay,cpu,failover,postcopy]
                       [--out DIR]

Sections (all measured here, on this machine, in this run):
  whole       real QEMU guests migrated directly QEMU->QEMU over a unix socket, through two
              rdmig agents over TCP, and (unless --no-floor) through the floor relay with the
              agents' hops (rdmig-floor-relay: QEMU's unix socket -> a loopback TCP connection per
              QEMU connection -> the target QEMU's, splice through a pipe, no framing, credits or
              handshake), interleaved, for guest sizes x dirty rates x multifd channels: medians
              (and every run) of QEMU total time, QEMU downtime and the true switchover (source
              STOP -> target RESUME), the agents/direct and agents/floor ratios; agent CPU per GiB.
  defaults    the same dirtying guest through the agents at several chunk sizes and ring
              depths: what the defaults are chosen from.
  dataplane   rdmig's TCP transport (rdmig-stream) against iperf3 on loopback.
  sweep       chunk-size sweep of the TCP transport, 64Ki..64Mi.
  concurrent  two migrations at once through the same two agents, against one alone.
  relay       both agents' relay cost alone (rdmig-relay-cpu: two pumps over loopback TCP, QEMU
              stand-ins on unix sockets, their CPU taken out), tcp.splice off vs on, interleaved.
  (relay against its floor: bench/relay_floor.py, the simplest relay with the same hops, interleaved)
  cpu         agents' CPU per GiB moved over TCP, user and system apart, source and target apart:
              one dirtying guest migrated again and again through two agent pairs in turn, one
              with tcp.splice off (copies through user space) and one with it on (splice).
  postcopy    a guest that never converges in pre-copy (its memory verifier rewrites 32 MiB at
              24 MiB/s, the source may send 12 MiB/s) moved with post-copy after the first pass,
              QEMU direct (unix socket, migrate-start-postcopy) against through the agents
              (postCopy: after), interleaved on one chain of QEMU 10 guests: total time, the
              post-copy phase, page requests, the target's vCPU block time per request; the
              verifier must find no stale page on either path (each run is checked).
              --pc-preempt adds both with QEMU's postcopy-preempt (postCopyPreempt: true);
              --pc-qemu 11 runs trixie-backports' QEMU 11.1 (page-fault p50/p99 from its
              postcopy-latency-dist), --pc-multifd N adds N multifd channels to every way (11 only).
Writes DIR/results.json, DIR/results.md and DIR/bench.png. Never fails on speed.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
from rdmiglab import Agent, QemuVm, cut_data_channels, ensure_guest, migrate_direct, start_migration  # noqa: E402
from rdmiglab.qmp import event_time  # noqa: E402
from rdmiglab.qemu import backports_qemu  # noqa: E402

STREAM = os.path.join(REPO, "build", "bench", "stream", "rdmig-stream")
RELAY_CPU = os.path.join(REPO, "build", "bench", "stream", "rdmig-relay-cpu")
FLOOR_RELAY = os.path.join(REPO, "build", "bench", "stream", "rdmig-floor-relay")
BW = 10 << 30  # the same max-bandwidth on both paths (QEMU 7.2's default is 128 MiB/s)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return (a / b) if (a is not None and b not in (None, 0)) else None


def cpu_times(pid):
    """(user, system) CPU seconds of a process so far."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def cpu_seconds(pid):
    return sum(cpu_times(pid))


class GuestDied(Exception):
    """A migration failed or its guest was gone right after (a QEMU 7.2 TCG guest panic, seen
    on both paths, QEMU-to-QEMU too). Counted per path; the chain is rebooted and the run
    repeated."""


DEATHS = {"direct": 0, "agents": 0, "floor": 0}


class Chain:
    """One guest migrated again and again: each migration starts a fresh target QEMU, which
    becomes the next source. Only the first QEMU boots a kernel."""

    def __init__(self, work, name, mem, dirty):
        self.work, self.name, self.mem, self.dirty, self.n = work, name, mem, dirty, 0
        self.boot()

    def boot(self):
        # interval 0: the guest dirties continuously (a pass of `dirty` MiB, then the next).
        self.n += 1
        self.src = QemuVm(self.work, "%s-%d" % (self.name, self.n), mem_mib=self.mem, dirty_mib=self.dirty,
                          interval=0 if self.dirty else 1)
        self.src.wait_for_counter(2, timeout=180)

    def run(self, path, fn, *args, **kw):
        """Runs one migration on `path`; on a guest death counts it, reboots and retries."""
        for _ in range(3):
            if not self.src.alive():
                self.boot()
            try:
                return fn(self, *args, **kw)
            except GuestDied as e:
                DEATHS[path] = DEATHS.get(path, 0) + 1
                print("  guest died after a %s migration (%s); rebooting the chain" % (path, e), flush=True)
                self.boot()
        raise RuntimeError("guest died three times in a row")

    def next_target(self):
        self.n += 1
        return QemuVm(self.work, "%s-%d" % (self.name, self.n), mem_mib=self.mem, incoming_defer=True,
                      dirty_mib=self.dirty)

    def advance(self, dst):
        self.src.kill()
        self.src = dst

    def close(self):
        self.src.kill()


def resume_of(vm, start, timeout=30):
    ev = vm.wait_event("RESUME", timeout)
    return ev


def wait_resume(chain, dst):
    try:
        ev = dst.wait_event("RESUME", 30)
        if not dst.alive():
            raise ConnectionError("exited")
        return ev
    except ConnectionError:
        tail = [l for l in dst.serial_text().splitlines() if "panic" in l.lower()][-1:]
        dst.kill()
        chain.src.kill()
        raise GuestDied(tail[0].strip() if tail else "QEMU exited")


def settled_alive(vm, grace=2.0):
    """Whether vm's QEMU still runs once a broken QMP connection has had time to become an exit."""
    deadline = time.time() + grace
    while vm.alive() and time.time() < deadline:
        time.sleep(0.1)
    return vm.alive()


def raise_guest_death_or(e, chain, dst, check_target):
    """Called from an `except` around starting a migration: a QEMU that died (a TCG panic; the
    source may die after its last migration's checks, and the agent then refuses it, "cannot
    talk to QEMU"; either side breaks QMP mid-migration) makes it a GuestDied, anything else is
    raised again. The new target is killed either way."""
    gone = not settled_alive(chain.src) or (check_target and not settled_alive(dst))
    dst.kill()
    if not gone:
        raise e
    chain.src.kill()
    raise GuestDied("a QEMU exited: %r" % e)


def run_direct(chain, multifd, floor=None):
    """One migration QEMU to QEMU; with `floor` (a FloorRelay) through it: the source sends to
    the relay, the relay dials the target QEMU."""
    dst = chain.next_target()
    t0 = time.time()
    via = {"socket_path": floor.qemu_path, "source_uri": "unix:" + floor.source_path} if floor else {}
    try:
        r = migrate_direct(chain.src, dst, multifd_channels=multifd, max_bandwidth=BW, **via)
    except Exception as e:
        raise_guest_death_or(e, chain, dst, check_target=True)
    if r["status"] != "completed":
        dst.kill()
        chain.src.kill()
        raise GuestDied("%s migration failed: %s" % ("floor relay" if floor else "direct", r["error"]))
    resume = wait_resume(chain, dst)
    e2e = (event_time(resume) - t0) * 1000 if resume else None
    chain.advance(dst)
    return {"total_ms": r["total_time_ms"], "downtime_ms": r["downtime_ms"], "switchover_ms": r["switchover_ms"],
            "e2e_ms": e2e, "bytes": r["transferred_bytes"]}


class FloorRelay:
    """The floor's two sides (rdmig-floor-relay), one process each as the agents are: the source
    QEMU sends to `source_path`, the target side dials the target QEMU at `qemu_path`."""

    def __init__(self, work, splice=True):
        self.source_path = os.path.join(work, "floor-source.sock")
        self.qemu_path = os.path.join(work, "floor-target-qemu.sock")
        flags = ["--splice"] if splice else []
        self.target = subprocess.Popen([FLOOR_RELAY, "target", "--listen", "127.0.0.1", "--qemu", self.qemu_path]
                                       + flags, stdout=subprocess.PIPE, text=True)
        port = int(self.target.stdout.readline().split()[1])
        self.source = subprocess.Popen([FLOOR_RELAY, "source", "--listen", self.source_path, "--peer",
                                        "127.0.0.1:%d" % port] + flags)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.source_path):
            if time.monotonic() > deadline:
                raise RuntimeError("rdmig-floor-relay did not listen on %s" % self.source_path)
            time.sleep(0.01)
        self.procs = [self.source, self.target]

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()


def run_agents(chain, agents, multifd, chunk=None, depth=None, vm="bench", bw=BW, interval=0.05, on_status=None):
    """One migration through the agents; `on_status` sees each status the source polls (every
    `interval` s). The result also carries the source's failover figures (docs/failover.md)."""
    a, b = agents
    dst = chain.next_target()
    t0 = time.time()
    try:
        target, source = start_migration(a, b, chain.src.agent_qmp_path, dst.agent_qmp_path,
                                         multifd_channels=multifd, chunk_size=chunk, ring_depth=depth, vm=vm,
                                         maxBandwidthBytesPerSecond=bw)
    except Exception as e:
        raise_guest_death_or(e, chain, dst, check_target=False)
    s = a.wait(source["id"], timeout=600, interval=interval, on_status=on_status)
    if s["phase"] != "Succeeded":
        dst.kill()
        chain.src.kill()
        raise GuestDied("migration %s failed: %s" % (vm, s["result"]["reason"]))
    resume = wait_resume(chain, dst)
    e2e = (event_time(resume) - t0) * 1000 if resume else None
    chain.advance(dst)
    r = s["result"]
    return {"total_ms": r["totalTimeMs"], "downtime_ms": r["downtimeMs"], "switchover_ms": r["switchoverMs"],
            "e2e_ms": e2e, "bytes": s["progress"]["dataBytesSent"],
            "failovers": s["failover"]["failovers"], "last": s["failover"]["last"]}


# The failover section caps the migration (all three rows alike) so that the cut lands mid-stream.
FAILOVER_BW = 256 << 20


def run_agents_cut(chain, agents, multifd, at=16 << 20, bw=FAILOVER_BW):
    """run_agents, with every data channel reset once (docs/failover.md) when `at` bytes have been
    sent; the result also says how many channels were cut."""
    b = agents[1]
    cut = []

    def maybe_cut(st):
        if not cut and st["phase"] == "Migrating" and st["progress"]["dataBytesSent"] >= at:
            cut.append(cut_data_channels(b.data_port, min_bytes=1 << 20))

    r = run_agents(chain, agents, multifd, vm="bench-cut", bw=bw, interval=0.01, on_status=maybe_cut)
    r["cut"] = cut[0] if cut else 0
    return r


def section_failover(work, args, results):
    """The same migration through agents without failover, with it (what keeping the chunks costs),
    and with it and every data channel reset once (what a failover costs), interleaved."""
    mem = int(args.sizes.split(",")[0]) if args.sizes else 512
    level = os.environ.get("RDMIG_BENCH_LOG", "warn")
    fo = {"dataPlane": {"failover": "on"}}
    plain = [Agent(work, "bench-nf-a", log_level=level), Agent(work, "bench-nf-b", log_level=level)]
    on = [Agent(work, "bench-fo-a", log_level=level, config=fo), Agent(work, "bench-fo-b", log_level=level, config=fo)]
    chain = Chain(work, "fo%d" % mem, mem, 32)  # dirtying 32 MiB passes: a stream long enough to cut
    runs = {"off": [], "on": [], "cut": []}
    try:
        for _ in range(args.runs):
            runs["off"].append(chain.run("agents", run_agents, plain, 0, bw=FAILOVER_BW))
            runs["on"].append(chain.run("agents", run_agents, on, 0, bw=FAILOVER_BW))
            runs["cut"].append(chain.run("agents", run_agents_cut, on, 0))
    finally:
        chain.close()
        for a in plain + on:
            a.stop()
    row = {k: summarize(v) for k, v in runs.items()}
    row.update(mem_mib=mem, runs=args.runs, failovers=[r["failovers"] for r in runs["cut"]],
               channels_cut=[r["cut"] for r in runs["cut"]], last=runs["cut"][-1]["last"],
               on_off_ratio=ratio(row["on"]["total_ms"], row["off"]["total_ms"]),
               cut_on_ratio=ratio(row["cut"]["total_ms"], row["on"]["total_ms"]),
               cut_extra_ms=(row["cut"]["total_ms"] - row["on"]["total_ms"]) if row["cut"]["total_ms"] and row["on"]["total_ms"] else None)
    results["failover"] = row
    print("failover %d MiB dirtying: total off %.0f ms, on %.0f ms (x%.2f), on with one cut %.0f ms (x%.2f, +%.0f ms); "
          "downtime %.0f / %.0f / %.0f ms; failovers per cut run %s; last: %s" % (
              mem, row["off"]["total_ms"], row["on"]["total_ms"], row["on_off_ratio"] or 0, row["cut"]["total_ms"],
              row["cut_on_ratio"] or 0, row["cut_extra_ms"] or 0, row["off"]["downtime_ms"], row["on"]["downtime_ms"],
              row["cut"]["downtime_ms"], row["failovers"], row["last"]), flush=True)


# Post-copy (docs/api.md "post-copy"): the shape of test_agent_migration.py's post-copy cases.
PC_VERIFY = "rdmig.verify_mib=32 rdmig.verify_rate_mib=24"
PC_BW = 12 << 20
PC_MEM = 192


class PostcopyChain(Chain):
    """A chain of verifier guests (tools/guest/verify.c) on Debian 13's QEMU 10, which runs
    post-copy with the agents as the suite does; or on ``qemu`` ((argv, env): backports_qemu())."""

    def __init__(self, work, name, qemu=None):
        self.qemu_kw = {"qemu_binary": qemu[0], "env": qemu[1]} if qemu else {}  # before Chain boots
        super().__init__(work, name, PC_MEM, 0)

    def boot(self):
        self.n += 1
        self.src = QemuVm(self.work, "%s-%d" % (self.name, self.n), mem_mib=PC_MEM, dirty_mib=0,
                          extra_append=PC_VERIFY, **self.qemu_kw)
        self.src.wait_for_verifier(2, min_scans=1, timeout=180)

    def next_target(self):
        self.n += 1
        return QemuVm(self.work, "%s-%d" % (self.name, self.n), mem_mib=PC_MEM, dirty_mib=0,
                      extra_append=PC_VERIFY, incoming_defer=True, **self.qemu_kw)


def verified_on_target(chain, dst):
    """The verifier goes on on the target (3 more counts) and found no stale or torn page."""
    last = chain.src.verifier()["counter"] or 0
    try:
        v = dst.wait_for_verifier(last + 3, timeout=120)
    except Exception as e:
        dst.kill()
        chain.src.kill()
        raise GuestDied("the verifier did not go on on the target: %s" % e)
    return v["mismatches"] + chain.src.verifier()["mismatches"]


def phases_from_events(vm, since):
    """(switch after, post-copy phase) in ms from the source QEMU's own MIGRATION events (QEMU's
    timestamps, the same on both paths): "setup" to "postcopy-active", and from there to "completed"."""
    vm.poll_events(0)
    at = {}
    for e in vm.events[since:]:
        if e.get("event") == "MIGRATION":
            at.setdefault(e.get("data", {}).get("status"), event_time(e))
    setup, pc, done = at.get("setup"), at.get("postcopy-active"), at.get("completed")
    return ((pc - setup) * 1000.0 if setup and pc else None, (done - pc) * 1000.0 if pc and done else None)


def per_request_us(blocktime_ms, requests):
    return blocktime_ms * 1000.0 / requests if blocktime_ms is not None and requests else None


def run_postcopy_direct(chain, preempt=False, multifd=0):
    dst = chain.next_target()
    src, since = chain.src, len(chain.src.events)
    try:
        r = migrate_direct(chain.src, dst, max_bandwidth=PC_BW, postcopy=True, downtime_limit_ms=50, timeout=300,
                           preempt=preempt, multifd_channels=multifd)
    except Exception as e:
        raise_guest_death_or(e, chain, dst, check_target=True)
    if r["status"] != "completed":
        dst.kill()
        chain.src.kill()
        raise GuestDied("direct post-copy failed: %s" % r["error"])
    switch_after, phase = phases_from_events(src, since)
    mismatches = verified_on_target(chain, dst)
    chain.advance(dst)
    return {"total_ms": r["total_time_ms"], "downtime_ms": r["downtime_ms"], "switch_after_ms": switch_after,
            "phase_ms": phase, "requests": r["postcopy_requests"], "blocktime_ms": r["target_blocktime_ms"],
            "per_request_us": per_request_us(r["target_blocktime_ms"], r["postcopy_requests"]),
            "p50_us": r.get("target_latency_p50_us"), "p99_us": r.get("target_latency_p99_us"), "mismatches": mismatches}


def run_postcopy_agents(chain, agents, ring_depth=None, preempt=False, multifd=0):
    a, b = agents
    dst = chain.next_target()
    src, since = chain.src, len(chain.src.events)
    extra = {"postCopyPreempt": True} if preempt else {}
    try:
        target, source = start_migration(a, b, chain.src.agent_qmp_path, dst.agent_qmp_path, vm="bench-pc",
                                         postCopy="after", maxBandwidthBytesPerSecond=PC_BW, maxDowntimeMs=50,
                                         completionTimeoutSeconds=240, ring_depth=ring_depth,
                                         multifd_channels=multifd, **extra)
    except Exception as e:
        raise_guest_death_or(e, chain, dst, check_target=False)
    s = a.wait(source["id"], timeout=300)
    t = b.wait(target["id"], timeout=60)
    if s["phase"] != "Succeeded":
        dst.kill()
        chain.src.kill()
        raise GuestDied("post-copy through the agents failed: %s" % s["result"]["reason"])
    switch_after, phase = phases_from_events(src, since)
    mismatches = verified_on_target(chain, dst)
    chain.advance(dst)
    pc, tpc = s["postCopy"], t["postCopy"]
    requests = pc["pageRequests"]
    blocktime = tpc.get("blocktimeMs") if tpc.get("blocktimeMs") is not None else pc.get("blocktimeMs")
    return {"total_ms": s["result"]["totalTimeMs"], "downtime_ms": s["result"]["downtimeMs"],
            "switch_after_ms": switch_after, "phase_ms": phase, "agent_phase_ms": pc["phaseMs"],
            "requests": requests, "blocktime_ms": blocktime,
            "per_request_us": per_request_us(blocktime, requests),
            "p50_us": tpc.get("pageLatencyP50Us"), "p99_us": tpc.get("pageLatencyP99Us"), "mismatches": mismatches}


PC_KEYS = ("total_ms", "downtime_ms", "switch_after_ms", "phase_ms", "requests", "blocktime_ms", "per_request_us",
           "p50_us", "p99_us")


def spread(xs):
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def section_postcopy(work, args, results):
    level = os.environ.get("RDMIG_BENCH_LOG", "warn")
    agents = [Agent(work, "bench-pc-a", log_level=level), Agent(work, "bench-pc-b", log_level=level)]
    # --pc-qemu 11: trixie-backports' QEMU (11.1), which post-copy with multifd (--pc-multifd) needs and
    # whose target reports the page-fault latency distribution (p50/p99).
    chain = PostcopyChain(work, "pc", qemu=backports_qemu() if args.pc_qemu == "11" else None)
    mf = args.pc_multifd
    # --pc-ring-depths: more rows through the agents, each with that migration ringDepth (chunks in
    # flight per channel): a requested page waits behind what is queued between the QEMUs.
    depths = {"agents": None}
    depths.update({"agents-ring%d" % d: d for d in args.pc_ring_depths})
    # --pc-preempt: QEMU's postcopy-preempt too, direct and through the agents (postCopyPreempt).
    preempt_ways = ["direct-preempt", "agents-preempt"] if args.pc_preempt else []
    ways = ["direct"] + list(depths) + preempt_ways
    runs = {w: [] for w in ways}
    try:
        for i in range(args.runs):
            for path in (ways if i % 2 == 0 else ways[::-1]):
                if path == "direct-preempt":
                    r = chain.run(path, run_postcopy_direct, True, mf)
                elif path == "agents-preempt":
                    r = chain.run(path, run_postcopy_agents, agents, None, True, mf)
                elif path == "direct":
                    r = chain.run(path, run_postcopy_direct, False, mf)
                else:
                    r = chain.run(path, run_postcopy_agents, agents, depths[path], False, mf)
                runs[path].append(r)
                print("  post-copy %s: %s" % (path, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}),
                      flush=True)
    finally:
        chain.close()
        for a in agents:
            a.stop()
    row = {path: {k: spread([r[k] for r in rs]) for k in PC_KEYS} for path, rs in runs.items()}
    row["runs"] = args.runs
    row["ways"] = ways
    row["qemu"] = "11.1 (trixie-backports)" if args.pc_qemu == "11" else "10.0 (trixie)"
    row["multifd"] = mf
    row["raw"] = runs
    row["mismatches"] = {path: sum(r["mismatches"] for r in rs) for path, rs in runs.items()}
    for k in ("total_ms", "phase_ms", "per_request_us", "p50_us", "p99_us"):
        d, a = row["direct"][k], row["agents"][k]
        row[k + "_ratio"] = ratio(a["median"], d["median"]) if a and d else None
        for w in ways[2:]:
            x = row[w][k]
            # The preempt rows against direct with preempt (the same QEMU settings), the others against direct.
            base = row["direct-preempt"][k] if w == "agents-preempt" else d
            row.setdefault("ratios_" + w, {})[k] = ratio(x["median"], base["median"]) if x and base else None
    results["postcopy"] = row
    med_of = lambda p, k: (row[p][k] or {}).get("median")
    print("post-copy: total direct %s ms, agents %s ms (x%s); post-copy phase %s / %s ms; block time per page request "
          "%s / %s us; stale pages %s" % (fmt(med_of("direct", "total_ms")), fmt(med_of("agents", "total_ms")),
                                          fmt(row["total_ms_ratio"], "%.2f"), fmt(med_of("direct", "phase_ms")),
                                          fmt(med_of("agents", "phase_ms")), fmt(med_of("direct", "per_request_us")),
                                          fmt(med_of("agents", "per_request_us")), row["mismatches"]), flush=True)


WHOLE_KEYS = ("total_ms", "downtime_ms", "switchover_ms", "e2e_ms", "bytes")


def summarize(runs):
    return {k: med([r[k] for r in runs]) for k in WHOLE_KEYS}


def spreads(runs):
    """Every figure's min and max over the runs (None where no run had it)."""
    out = {}
    for k in WHOLE_KEYS:
        xs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = {"min": min(xs), "max": max(xs)} if xs else None
    return out


def section_whole(work, agents, args, results):
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([512] if args.quick else [256, 512, 1024, 2048])
    dirties = [int(x) for x in args.dirty.split(",")]
    multifds = [int(x) for x in args.multifd.split(",")] if args.multifd else ([0, 4] if args.quick else [0, 4, 8])
    rows = []
    floor = None if args.no_floor else FloorRelay(work)
    cpu0 = [cpu_times(a.proc.pid) for a in agents]
    floor_cpu0 = [cpu_times(p.pid) for p in floor.procs] if floor else []
    agent_bytes = floor_bytes = 0
    for mem in sizes:
        for dirty in dirties:
            chain = Chain(work, "w%d-%d" % (mem, dirty), mem, dirty)
            try:
                for mf in multifds:
                    direct, via, fl = [], [], []
                    for i in range(args.runs):  # interleaved, the order rotating, so drift hits every path alike
                        ways = [("direct", lambda: direct.append(chain.run("direct", run_direct, mf))),
                                ("agents", lambda: via.append(chain.run("agents", run_agents, agents, mf)))]
                        if floor:
                            ways.append(("floor", lambda: fl.append(chain.run("floor", run_direct, mf, floor))))
                        for _, go in ways[i % len(ways):] + ways[:i % len(ways)]:
                            go()
                        agent_bytes += via[-1]["bytes"] or 0
                        if fl:
                            floor_bytes += fl[-1]["bytes"] or 0
                    d, v = summarize(direct), summarize(via)
                    # Every run's figures (in the order they ran, direct and agents interleaved) and
                    # their spread, not only the medians: one run on a noisy machine means little.
                    row = {"mem_mib": mem, "dirty_mib_s": "idle" if dirty == 0 else "continuous %d MiB passes" % dirty,
                           "multifd": mf, "direct": d, "agents": v, "runs": args.runs,
                           "direct_runs": [{k: r.get(k) for k in WHOLE_KEYS} for r in direct],
                           "agents_runs": [{k: r.get(k) for k in WHOLE_KEYS} for r in via],
                           "spread": {"direct": spreads(direct), "agents": spreads(via)},
                           "total_ratio": ratio(v["total_ms"], d["total_ms"]),
                           "downtime_ratio": ratio(v["downtime_ms"], d["downtime_ms"]),
                           "switchover_ratio": ratio(v["switchover_ms"], d["switchover_ms"]),
                           "e2e_ratio": ratio(v["e2e_ms"], d["e2e_ms"])}
                    if fl:
                        f = summarize(fl)
                        row.update({"floor": f, "floor_runs": [{k: r.get(k) for k in WHOLE_KEYS} for r in fl],
                                    "total_vs_floor": ratio(v["total_ms"], f["total_ms"]),
                                    "downtime_vs_floor": ratio(v["downtime_ms"], f["downtime_ms"]),
                                    "floor_total_ratio": ratio(f["total_ms"], d["total_ms"]),
                                    "floor_downtime_ratio": ratio(f["downtime_ms"], d["downtime_ms"])})
                        row["spread"]["floor"] = spreads(fl)
                        print("      floor total %6.0f ms (agents / floor x%.2f)  downtime %4.0f ms (agents / floor x%.2f)"
                              % (f["total_ms"] or 0, row["total_vs_floor"] or 0, f["downtime_ms"] or 0,
                                 row["downtime_vs_floor"] or 0), flush=True)
                    rows.append(row)
                    print("whole %4d MiB %-5s mf=%d  total %6.0f/%6.0f ms (x%.2f)  downtime %4.0f/%4.0f ms  "
                          "switchover %5.1f/%5.1f ms  e2e %6.0f/%6.0f ms (x%.2f)" % (
                              mem, "idle" if not dirty else "dirty", mf, v["total_ms"], d["total_ms"],
                              row["total_ratio"] or 0, v["downtime_ms"], d["downtime_ms"],
                              v["switchover_ms"] or 0, d["switchover_ms"] or 0, v["e2e_ms"] or 0,
                              d["e2e_ms"] or 0, row["e2e_ratio"] or 0), flush=True)
            finally:
                chain.close()
    cpu1 = [cpu_times(a.proc.pid) for a in agents]
    if floor:
        floor_cpu1 = [cpu_times(p.pid) for p in floor.procs]
        floor.stop()
        fgib = floor_bytes / (1 << 30)
        fcpu = sum(c1[0] - c0[0] + c1[1] - c0[1] for c0, c1 in zip(floor_cpu0, floor_cpu1))
        results["floor_cpu_seconds_per_gib"] = fcpu / fgib if fgib else None
    results["whole"] = rows
    gib = agent_bytes / (1 << 30)
    user = sum(c1[0] - c0[0] for c0, c1 in zip(cpu0, cpu1))
    system = sum(c1[1] - c0[1] for c0, c1 in zip(cpu0, cpu1))
    results["agent_cpu_seconds_per_gib_tcp"] = (user + system) / gib if gib else None
    results["agent_cpu_user_seconds_per_gib_tcp"] = user / gib if gib else None
    results["agent_cpu_system_seconds_per_gib_tcp"] = system / gib if gib else None
    results["agent_tcp_splice"] = agents[0].config.get("tcp", {}).get("splice", "auto")
    print("agent CPU: %.2f s per GiB moved over TCP (both agents together; user %.2f, system %.2f)" % (
        results["agent_cpu_seconds_per_gib_tcp"] or 0, results["agent_cpu_user_seconds_per_gib_tcp"] or 0,
        results["agent_cpu_system_seconds_per_gib_tcp"] or 0))


def section_relay(args, results):
    """rdmig-relay-cpu with splice off and on (source and target agents alike), interleaved."""
    runs = {"off": [], "on": []}
    for _ in range(max(3, args.runs)):
        for mode in runs:
            out = subprocess.run([RELAY_CPU, "--bytes", "2Gi", "--splice", mode], capture_output=True, text=True,
                                 timeout=600)
            if out.returncode != 0:
                raise RuntimeError("rdmig-relay-cpu failed: %s" % out.stderr)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for mode, rs in runs.items():
        row = {"splice": mode, "runs": len(rs), "MBps": med([r["bytesPerSecond"] / 1e6 for r in rs]),
               "user": med([r["agentsUserPerGiB"] for r in rs]), "system": med([r["agentsSystemPerGiB"] for r in rs]),
               "both": med([r["agentsCpuSecondsPerGiB"] for r in rs]),
               "both_min": min(r["agentsCpuSecondsPerGiB"] for r in rs),
               "both_max": max(r["agentsCpuSecondsPerGiB"] for r in rs)}
        rows.append(row)
        print("relay splice %-3s: %.0f MB/s, agents CPU-s/GiB %.3f (user %.3f, system %.3f; range %.3f..%.3f)" % (
            mode, row["MBps"], row["both"], row["user"], row["system"], row["both_min"], row["both_max"]), flush=True)
    results["relay"] = rows


def measured_run(chain, agents, multifd, vm):
    """One migration through `agents` with their CPU times read around it. A run whose guest
    died raises before returning, so its CPU is not counted against bytes it did not move."""
    c0 = [cpu_times(a.proc.pid) for a in agents]
    r = run_agents(chain, agents, multifd, vm=vm)
    c1 = [cpu_times(a.proc.pid) for a in agents]
    return r, c0, c1


def section_cpu(work, args, results):
    """Splice off and on, side by side: the same guest chain, migrations alternating between
    two agent pairs that differ only in tcp.splice. CPU is read from /proc around each
    migration (all of the agent: pumps, QMP polling, REST), bytes are the agents' dataBytesSent."""
    size = int(args.sizes.split(",")[0]) if args.sizes else 1024
    dirty = int(args.dirty.split(",")[-1])
    multifds = [int(x) for x in args.multifd.split(",")] if args.multifd else [0, 4]
    level = os.environ.get("RDMIG_BENCH_LOG", "warn")
    pairs = {mode: [Agent(work, "cpu-%s-src" % mode, log_level=level, config={"tcp": {"splice": mode}}),
                    Agent(work, "cpu-%s-dst" % mode, log_level=level, config={"tcp": {"splice": mode}})]
             for mode in ("off", "on")}
    rows = []
    try:
        for mf in multifds:
            acc = {mode: {"bytes": 0, "src_user": 0.0, "src_sys": 0.0, "dst_user": 0.0, "dst_sys": 0.0, "runs": []}
                   for mode in pairs}
            chain = Chain(work, "cpu-%d" % mf, size, dirty)
            try:
                for _ in range(args.runs):
                    for mode, agents in pairs.items():  # interleaved: drift hits both alike
                        r, c0, c1 = chain.run("agents", measured_run, agents, mf, "cpu-%s" % mode)
                        a = acc[mode]
                        a["bytes"] += r["bytes"] or 0
                        a["src_user"] += c1[0][0] - c0[0][0]
                        a["src_sys"] += c1[0][1] - c0[0][1]
                        a["dst_user"] += c1[1][0] - c0[1][0]
                        a["dst_sys"] += c1[1][1] - c0[1][1]
                        a["runs"].append(r)
            finally:
                chain.close()
            row = {"mem_mib": size, "dirty_mib": dirty, "multifd": mf, "runs": args.runs}
            for mode, a in acc.items():
                gib = a["bytes"] / (1 << 30)
                per = {k: (a[k] / gib if gib else None) for k in ("src_user", "src_sys", "dst_user", "dst_sys")}
                per["both"] = sum(per.values()) if gib else None
                per["gib"] = gib
                per["total_ms"] = med([r["total_ms"] for r in a["runs"]])
                per["downtime_ms"] = med([r["downtime_ms"] for r in a["runs"]])
                row[mode] = per
                print("cpu %d MiB dirty %d mf=%d splice %-3s: %.2f GiB moved, CPU-s/GiB both %.3f (source user %.3f "
                      "sys %.3f, target user %.3f sys %.3f), total %s ms, downtime %s ms" % (
                          size, dirty, mf, mode, gib, per["both"] or 0, per["src_user"] or 0, per["src_sys"] or 0,
                          per["dst_user"] or 0, per["dst_sys"] or 0, fmt(per["total_ms"]), fmt(per["downtime_ms"])),
                      flush=True)
            row["ratio_on_off"] = ratio(row["on"]["both"], row["off"]["both"])
            rows.append(row)
    finally:
        for agents in pairs.values():
            for a in agents:
                a.stop()
    results["cpu"] = rows


def section_defaults(work, agents, args, results):
    combos = [("256Ki", 8), ("1Mi", 4), ("1Mi", 16), ("4Mi", 4), ("4Mi", 16), ("16Mi", 4)]
    rows = []
    chain = Chain(work, "defaults", 512, 32)
    try:
        for chunk, depth in combos:
            runs = [chain.run("agents", run_agents, agents, 4, chunk=chunk, depth=depth) for _ in range(args.runs)]
            s = summarize(runs)
            rows.append({"chunk": chunk, "depth": depth, **s})
            print("defaults chunk %-5s depth %2d: total %6.0f ms downtime %4.0f ms switchover %5.1f ms e2e %6.0f ms"
                  % (chunk, depth, s["total_ms"], s["downtime_ms"], s["switchover_ms"] or 0, s["e2e_ms"] or 0), flush=True)
    finally:
        chain.close()
    results["defaults"] = rows


def stream(args_list):
    out = subprocess.run([STREAM, "--json"] + args_list, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError("rdmig-stream failed: %s" % out.stderr)
    for line in out.stdout.splitlines():
        j = json.loads(line)
        if j["side"] == "client":
            return j["bytesPerSecond"]
    raise RuntimeError("no client line")


def iperf3(parallel, seconds=5):
    port = 5201 + parallel
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if subprocess.run(["sh", "-c", "ss -ltn | grep -q ':%d '" % port]).returncode == 0:
                break
            time.sleep(0.05)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-P", str(parallel), "-J"],
                             capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8
    finally:
        server.wait(timeout=30)


def section_dataplane(args, results):
    rows = []
    for ch in (1, 4):
        ours, theirs = [], []
        for _ in range(args.runs):
            ours.append(stream(["--transport", "tcp", "--ip", "127.0.0.1", "--bytes", "8Gi", "--channels", str(ch),
                                "--chunk", "1Mi", "--depth", "16", "--no-verify"]))
            theirs.append(iperf3(ch))
        o, t = med(ours), med(theirs)
        rows.append({"channels": ch, "rdmig_Bps": o, "iperf3_Bps": t, "ratio": ratio(o, t)})
        print("dataplane %d stream(s): rdmig %.0f MiB/s, iperf3 %.0f MiB/s, ratio %.2f" % (ch, o / 2**20, t / 2**20, o / t), flush=True)
    results["dataplane"] = rows


def section_sweep(args, results):
    rows = []
    for chunk in ["64Ki", "128Ki", "256Ki", "512Ki", "1Mi", "2Mi", "4Mi", "8Mi", "16Mi", "32Mi", "64Mi"]:
        n = int(chunk[:-2]) * (1024 if chunk.endswith("Ki") else 1 << 20)
        depth = max(2, min(16, (64 << 20) // n))
        runs = [stream(["--transport", "tcp", "--ip", "127.0.0.1", "--bytes", "4Gi", "--channels", "1", "--chunk", chunk,
                        "--depth", str(depth), "--no-verify"]) for _ in range(max(1, args.runs // 2))]
        rows.append({"chunk": chunk, "depth": depth, "Bps": med(runs)})
        print("sweep tcp chunk %-5s depth %2d: %.0f MiB/s" % (chunk, depth, med(runs) / 2**20), flush=True)
    best = max(r["Bps"] for r in rows)
    for r in rows:
        r["of_best"] = r["Bps"] / best
    results["sweep_tcp"] = rows
    results["sweep_tcp_1mi_of_best"] = next(r["of_best"] for r in rows if r["chunk"] == "1Mi")


def section_concurrent(work, agents, args, results):
    alone, together = [], []
    # Idle guests: two *dirtying* TCG guests migrated at once on this 2-core machine make
    # QEMU 7.2's guests panic after the migration even QEMU-to-QEMU without rdmig
    # (reproduced on the direct path), which would measure a QEMU/TCG fault, not rdmig.
    c1 = Chain(work, "conc-a", 512, 0)
    c2 = Chain(work, "conc-b", 512, 0)
    try:
        for _ in range(args.runs):
            alone.append(c1.run("agents", run_agents, agents, 0, vm="conc-a"))
            out = {}
            t1 = threading.Thread(target=lambda: out.__setitem__("a", c1.run("agents", run_agents, agents, 0, vm="conc-a")))
            t2 = threading.Thread(target=lambda: out.__setitem__("b", c2.run("agents", run_agents, agents, 0, vm="conc-b")))
            t1.start(); t2.start(); t1.join(); t2.join()
            together += [out["a"], out["b"]]
    finally:
        c1.close(); c2.close()
    a, t = summarize(alone), summarize(together)
    results["concurrent"] = {"alone": a, "two_at_once": t, "total_ratio": ratio(t["total_ms"], a["total_ms"]),
                             "downtime_ratio": ratio(t["downtime_ms"], a["downtime_ms"])}
    print("concurrent: alone total %.0f ms downtime %.0f ms; two at once total %.0f ms downtime %.0f ms"
          % (a["total_ms"], a["downtime_ms"], t["total_ms"], t["downtime_ms"]), flush=True)


def machine():
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "kernel": os.uname().release, "qemu": qemu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def fmt(v, spec="%.0f"):
    return "-" if v is None else spec % v


def write_markdown(results, path):
    L = ["# rdmig benchmark results", "",
         "Machine: %(cpus)d vCPUs (%(cpu)s), %(mem_gib)s GiB, kernel %(kernel)s, %(qemu)s, guests under TCG. %(date)s." % results["machine"],
         "Command: `%s`" % results["command"], ""]
    if "postcopy" in results:
        pc = results["postcopy"]

        def cell(way, k, spec="%.0f"):
            v = pc[way][k]
            return "%s (%s-%s)" % (fmt(v["median"], spec), fmt(v["min"], spec), fmt(v["max"], spec)) if v else "-"
        L += ["## Post-copy: QEMU direct against through two agents, %d interleaved runs each" % pc["runs"], "",
              "QEMU %s, %d multifd channels. " % (pc.get("qemu", "10.0 (trixie)"), pc.get("multifd", 0)) +
              "A %d MiB guest whose verifier rewrites 32 MiB at 24 MiB/s while the source may send 12 MiB/s "
              "(pre-copy never converges), switched to post-copy after the first pass; medians (min-max). "
              "Switch after and post-copy phase from the source QEMU's MIGRATION events (setup, postcopy-active, "
              "completed: QEMU's timestamps on both paths). "
              "Block time: the target QEMU's postcopy-blocktime (vCPUs waiting on pages), per page request: "
              "QEMU 10.0 has no per-request latency (postcopy-latency came in 10.1), so this is the mean wait "
              "per request; QEMU 10.1+ also gives the distribution of fault waits (postcopy-latency-dist): p50 and p99 "
              "are the upper edges of its power-of-two buckets (- on 10.0). The guests run the QEMU above "
              "($RDMIG_TEST_QEMU=10, or --pc-qemu 11), whatever the machine line says of the host's QEMU." % PC_MEM, "",
              "| | total (ms) | downtime (ms) | switch after (ms) | post-copy phase (ms) | page requests | block time (ms) | per request (us) | fault p50 (us) | fault p99 (us) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for way in pc.get("ways", ("direct", "agents")):
            L.append("| %s | %s |" % (way, " | ".join(cell(way, k) for k in PC_KEYS)))
        L += ["", "Ratios agents / direct (medians): total %s, post-copy phase %s, block time per request %s. "
              "Stale or torn pages found by the verifier: %s." % (
                  fmt(pc["total_ms_ratio"], "%.2f"), fmt(pc["phase_ms_ratio"], "%.2f"), fmt(pc["per_request_us_ratio"], "%.2f"),
                  pc["mismatches"]), ""]
        for way in pc.get("ways", ())[2:]:
            q = pc["ratios_" + way]
            L += ["%s / %s (medians): total %s, post-copy phase %s, block time per request %s." % (
                way, "direct-preempt" if way == "agents-preempt" else "direct", fmt(q["total_ms"], "%.2f"),
                fmt(q["phase_ms"], "%.2f"), fmt(q["per_request_us"], "%.2f")), ""]
    if "failover" in results:
        f = results["failover"]
        L += ["## Failover (docs/failover.md): %d MiB guest dirtying 32 MiB passes, multifd 0, capped at 256 MiB/s, medians of %d interleaved runs" % (f["mem_mib"], f["runs"]), "",
              "| agents | total (ms) | downtime (ms) | ratio |", "|---|---|---|---|",
              "| failover off | %s | %s | 1 |" % (fmt(f["off"]["total_ms"]), fmt(f["off"]["downtime_ms"])),
              "| failover on | %s | %s | %s (on / off) |" % (fmt(f["on"]["total_ms"]), fmt(f["on"]["downtime_ms"]), fmt(f["on_off_ratio"], "%.2f")),
              "| failover on, every data channel reset once at 16 MiB sent | %s | %s | %s (cut / on), +%s ms |" % (
                  fmt(f["cut"]["total_ms"]), fmt(f["cut"]["downtime_ms"]), fmt(f["cut_on_ratio"], "%.2f"), fmt(f["cut_extra_ms"])),
              "", "Failovers per cut run: %s. Last: %s" % (f["failovers"], f["last"]), ""]
    if "whole" in results:
        L += ["## Whole migrations: direct QEMU-to-QEMU (unix socket) vs through two rdmig agents (TCP)", "",
              "Medians (min-max) of %d interleaved runs each; every run's figures are in results.json "
              "(`direct_runs`, `agents_runs`). total = QEMU's total-time; downtime = QEMU's figure; switchover = "
              "source STOP to target RESUME; e2e = from the first command to the target's RESUME." % results["whole"][0]["runs"], "",
              "| guest | dirtying | multifd | total direct / agents (ms) | ratio | downtime direct / agents (ms) | ratio | switchover direct / agents (ms) | e2e ratio |",
              "|---|---|---|---|---|---|---|---|---|"]

        def ranged(r, way, k, spec="%.0f"):
            sp = (r.get("spread") or {}).get(way, {}).get(k)
            v = fmt(r[way][k], spec)
            return "%s (%s-%s)" % (v, fmt(sp["min"], spec), fmt(sp["max"], spec)) if sp else v
        for r in results["whole"]:
            L.append("| %d MiB | %s | %d | %s / %s | %s | %s / %s | %s | %s / %s | %s |" % (
                r["mem_mib"], r["dirty_mib_s"], r["multifd"], ranged(r, "direct", "total_ms"), ranged(r, "agents", "total_ms"),
                fmt(r["total_ratio"], "%.2f"), ranged(r, "direct", "downtime_ms"), ranged(r, "agents", "downtime_ms"),
                fmt(r["downtime_ratio"], "%.2f"), ranged(r, "direct", "switchover_ms", "%.1f"),
                ranged(r, "agents", "switchover_ms", "%.1f"), fmt(r["e2e_ratio"], "%.2f")))
        if any("floor" in r for r in results["whole"]):
            L += ["", "Through the floor relay (rdmig-floor-relay: the agents' hops, splice, nothing else), the same "
                  "runs interleaved: medians (min-max), and the agents against it (goal: total <= 1.10, downtime "
                  "<= 1.10 of the floor relay's).", "",
                  "| guest | dirtying | multifd | total floor (ms) | agents / floor | floor / direct | downtime floor (ms) "
                  "| agents / floor | floor / direct |", "|---|---|---|---|---|---|---|---|---|"]
            for r in results["whole"]:
                if "floor" not in r:
                    continue
                L.append("| %d MiB | %s | %d | %s | **%s** | %s | %s | **%s** | %s |" % (
                    r["mem_mib"], r["dirty_mib_s"], r["multifd"], ranged(r, "floor", "total_ms"),
                    fmt(r["total_vs_floor"], "%.2f"), fmt(r["floor_total_ratio"], "%.2f"),
                    ranged(r, "floor", "downtime_ms"), fmt(r["downtime_vs_floor"], "%.2f"),
                    fmt(r["floor_downtime_ratio"], "%.2f")))
            L += ["", "Floor relay CPU: %s CPU-seconds per GiB (both sides)." % fmt(
                results.get("floor_cpu_seconds_per_gib"), "%.2f")]
        tr = [r["total_ratio"] for r in results["whole"] if r["total_ratio"]]
        dr = [r["downtime_ratio"] for r in results["whole"] if r["downtime_ratio"]]
        L += ["", "Median ratio over all rows: total %.2f (goal <= 1.10), downtime %.2f (goal <= 1.2)." % (
            statistics.median(tr), statistics.median(dr)) if tr and dr else "",
              "Agent CPU: %s CPU-seconds per GiB moved over TCP (both agents; user %s, system %s; tcp.splice %s; "
              "goal <= 0.6)." % (fmt(results.get("agent_cpu_seconds_per_gib_tcp"), "%.2f"),
                                 fmt(results.get("agent_cpu_user_seconds_per_gib_tcp"), "%.2f"),
                                 fmt(results.get("agent_cpu_system_seconds_per_gib_tcp"), "%.2f"),
                                 results.get("agent_tcp_splice", "auto")), ""]
    if "defaults" in results:
        L += ["## Chunk size and ring depth through the agents (512 MiB dirtying guest, 4 multifd)", "",
              "| chunk | depth | total (ms) | downtime (ms) | switchover (ms) | e2e (ms) |", "|---|---|---|---|---|---|"]
        for r in results["defaults"]:
            L.append("| %s | %d | %s | %s | %s | %s |" % (r["chunk"], r["depth"], fmt(r["total_ms"]), fmt(r["downtime_ms"]),
                                                       fmt(r["switchover_ms"], "%.1f"), fmt(r["e2e_ms"])))
        L.append("")
    if "guest_deaths_after_migration" in results:
        d = results["guest_deaths_after_migration"]
        L += ["Runs repeated because the migration failed or the guest died right after it (kernel panics of "
              "QEMU 7.2 TCG guests under this load, on both paths; the chain is rebooted): direct %d, through "
              "agents %d, through the floor relay %d." % (d["direct"], d["agents"], d.get("floor", 0)), ""]
    if "dataplane" in results:
        L += ["## Data plane alone: rdmig-stream (TCP transport) vs iperf3 on loopback", "",
              "| streams | rdmig MiB/s | iperf3 MiB/s | ratio (goal >= 0.8) |", "|---|---|---|---|"]
        for r in results["dataplane"]:
            L.append("| %d | %.0f | %.0f | %.2f |" % (r["channels"], r["rdmig_Bps"] / 2**20, r["iperf3_Bps"] / 2**20, r["ratio"]))
        L.append("")
    if "sweep_tcp" in results:
        L += ["## Chunk-size sweep, TCP transport (1 channel, ring <= 64 MiB)", "", "| chunk | depth | MiB/s | of best |", "|---|---|---|---|"]
        for r in results["sweep_tcp"]:
            L.append("| %s | %d | %.0f | %.2f |" % (r["chunk"], r["depth"], r["Bps"] / 2**20, r["of_best"]))
        L += ["", "1 MiB / best: **%.2f** (goal >= 0.9)." % results["sweep_tcp_1mi_of_best"], ""]
    if "concurrent" in results:
        c = results["concurrent"]
        L += ["## Two migrations at once (512 MiB idle guests, same two agents)", "",
              "| | total (ms) | downtime (ms) |", "|---|---|---|",
              "| one alone | %s | %s |" % (fmt(c["alone"]["total_ms"]), fmt(c["alone"]["downtime_ms"])),
              "| two at once (each) | %s | %s |" % (fmt(c["two_at_once"]["total_ms"]), fmt(c["two_at_once"]["downtime_ms"])), ""]
    if "relay" in results:
        L += ["## Relay cost alone: both agents' CPU per GiB, tcp.splice off vs on (rdmig-relay-cpu)", "",
              "Two ChannelPumps joined by loopback TCP, as the source and target agents run them; QEMU stand-ins "
              "write and read the unix sockets and their CPU (QEMU's own copies) is taken out per thread. 2 GiB a run, "
              "runs interleaved, medians. Goal: both agents <= 0.6 CPU-s/GiB.", "",
              "| tcp.splice | runs | MB/s | user CPU-s/GiB | system CPU-s/GiB | both agents (goal <= 0.6) | range |",
              "|---|---|---|---|---|---|---|"]
        for r in results["relay"]:
            L.append("| %s | %d | %.0f | %.3f | %.3f | **%.3f** | %.3f..%.3f |" % (
                r["splice"], r["runs"], r["MBps"], r["user"], r["system"], r["both"], r["both_min"], r["both_max"]))
        L.append("")
    if "cpu" in results:
        r0 = results["cpu"][0]
        L += ["## Agent CPU per GiB moved over TCP: tcp.splice off vs on", "",
              "%d MiB guest dirtying continuously (%d MiB passes), migrated %d times per row through each agent pair "
              "in turn (same run, same guest chain); CPU of the whole agent processes from /proc around each "
              "migration, per GiB of the agents' dataBytesSent. Goal: both agents together <= 0.6 CPU-s/GiB." % (
                  r0["mem_mib"], r0["dirty_mib"], r0["runs"]), "",
              "| multifd | splice | GiB moved | source user | source system | target user | target system | "
              "both agents (goal <= 0.6) | total (ms) | downtime (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["cpu"]:
            for mode in ("off", "on"):
                p = r[mode]
                L.append("| %d | %s | %.2f | %s | %s | %s | %s | **%s** | %s | %s |" % (
                    r["multifd"], mode, p["gib"], fmt(p["src_user"], "%.3f"), fmt(p["src_sys"], "%.3f"),
                    fmt(p["dst_user"], "%.3f"), fmt(p["dst_sys"], "%.3f"), fmt(p["both"], "%.3f"),
                    fmt(p["total_ms"]), fmt(p["downtime_ms"])))
        L += ["", "on / off: " + ", ".join("%s (multifd %d)" % (fmt(r["ratio_on_off"], "%.2f"), r["multifd"])
                                          for r in results["cpu"]), ""]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def plot(results, path):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot.py")
    py = "/usr/bin/python3"  # Debian's python3-matplotlib
    r = subprocess.run([py, script, os.path.join(os.path.dirname(path), "results.json"), path], capture_output=True, text=True)
    if r.returncode != 0:
        print("plot skipped: %s" % (r.stderr.strip().splitlines() or ["?"])[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 MiB guests, multifd 0/4 only")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", help="guest sizes in MiB for 'whole', e.g. 256,512")
    ap.add_argument("--dirty", default="0,32", help="MiB per dirtying pass (0 = idle), e.g. 0,32")
    ap.add_argument("--multifd", help="multifd channel counts for 'whole', e.g. 0,4,8")
    ap.add_argument("--no-floor", action="store_true", help="'whole' without the floor relay's row")
    ap.add_argument("--sections", default="whole,defaults,dataplane,sweep,concurrent")
    ap.add_argument("--pc-ring-depths", default="",
                    help="postcopy: also through the agents with these migration ringDepth values, e.g. 4,2")
    ap.add_argument("--pc-qemu", choices=("10", "11"), default="10",
                    help="postcopy: the guests' QEMU: 10 (trixie's 10.0, as the suite) or 11 (trixie-backports' 11.1)")
    ap.add_argument("--pc-multifd", type=int, default=0,
                    help="postcopy: multifd channels on every way (QEMU 10.1+: needs --pc-qemu 11)")
    ap.add_argument("--pc-preempt", action="store_true",
                    help="postcopy: also with QEMU's postcopy-preempt, direct and through the agents (postCopyPreempt)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "latest"))
    args = ap.parse_args()
    try:
        args.pc_ring_depths = [int(x) for x in args.pc_ring_depths.split(",") if x]
    except ValueError:
        ap.error("--pc-ring-depths: integers, e.g. 4,2")
    if any(d < 2 or d > 1024 for d in args.pc_ring_depths):
        ap.error("--pc-ring-depths: each 2..1024 (migration ringDepth)")
    if args.pc_multifd and args.pc_qemu != "11":
        ap.error("--pc-multifd: post-copy with multifd needs QEMU 10.1+ (--pc-qemu 11)")
    if not 0 <= args.pc_multifd <= 64:
        ap.error("--pc-multifd: 0..64")
    sections = args.sections.split(",")
    ensure_guest()
    os.makedirs(args.out, exist_ok=True)
    results = {"machine": machine(), "command": "python3 bench/run.py " + " ".join(sys.argv[1:])}
    work = tempfile.mkdtemp(prefix="rdmig-bench-")
    agents = []
    try:
        if {"whole", "defaults", "concurrent"} & set(sections):
            level = os.environ.get("RDMIG_BENCH_LOG", "warn")
            agents = [Agent(work, "bench-a", log_level=level), Agent(work, "bench-b", log_level=level)]
        if "whole" in sections:
            section_whole(work, agents, args, results)
        if "defaults" in sections:
            section_defaults(work, agents, args, results)
        if "dataplane" in sections:
            section_dataplane(args, results)
        if "sweep" in sections:
            section_sweep(args, results)
        if "concurrent" in sections:
            section_concurrent(work, agents, args, results)
        if "relay" in sections:
            section_relay(args, results)
        if "cpu" in sections:
            section_cpu(work, args, results)
        if "failover" in sections:
            section_failover(work, args, results)
        if "postcopy" in sections:
            section_postcopy(work, args, results)
    except Exception:
        for a in agents:
            print("---- %s log (tail) ----\n%s" % (a.name, a.log_text()[-6000:]))
        raise
    finally:
        for a in agents:
            a.stop()
        shutil.rmtree(work, ignore_errors=True)
        results["guest_deaths_after_migration"] = DEATHS
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        write_markdown(results, os.path.join(args.out, "results.md"))
        plot(results, os.path.join(args.out, "bench.png"))
    print("wrote %s/results.md" % args.out)


if __name__ == "__main__":
    main()
