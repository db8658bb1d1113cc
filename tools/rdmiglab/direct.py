"""Baseline: QEMU-to-QEMU migration over a unix socket, without rdmig in between."""
import os
import time

from .qmp import event_time

GiB = 1 << 30


def _events_since(vm, start, name, pred=None):
    return [e for e in vm.events[start:]
            if e.get("event") == name and (pred is None or pred(e))]


def switchover_ms(stop_event, resume_event):
    """Milliseconds between two QMP events' timestamps (source STOP -> target RESUME)."""
    if stop_event is None or resume_event is None:
        return None
    return (event_time(resume_event) - event_time(stop_event)) * 1000.0


class PassCounter:
    """Passes over memory as the agent counts them (src/migration/passes.h, which says why): QEMU's
    dirty-sync-count, bounded by rounds counted from ram.normal + ram.duplicate, since QEMU 11.1 with
    postcopy-ram syncs ten times a second within one pass. So the direct path switches where the
    agents' `postCopy: after` does."""

    def __init__(self):
        self.rounds = self.base = self.need = 0

    def observe(self, ram):
        syncs, total, page = ram.get("dirty-sync-count", 0), ram.get("total", 0), ram.get("page-size", 4096) or 4096
        if not syncs or not total:
            return syncs
        sent = ram.get("normal", 0) + ram.get("duplicate", 0)
        if self.need == 0 and self.rounds == 0:
            self.need = total // page
        if self.need > 0 and sent >= self.base and sent - self.base >= self.need - self.need // 100:
            self.rounds += 1
            self.base = sent
            self.need = ram.get("remaining", 0) // page
        return min(syncs, 1 + self.rounds)


def latency_quantile_us(dist, q):
    """The q-quantile of QEMU's postcopy-latency-dist (bucket N: [2^N, 2^(N+1)) us) as its bucket's
    upper edge, as the agent reports pageLatencyP50Us/P99Us; None without a fault (or before 10.1)."""
    total = sum(dist or [])
    if not total:
        return None
    rank, seen = -(-q * total // 1), 0
    for i, n in enumerate(dist):
        seen += n
        if seen >= rank:
            return float(2 ** (i + 1))
    return float(2 ** len(dist))


def _set_caps(vm, multifd, postcopy=False, blocktime=False, preempt=False):
    caps = [{"capability": "events", "state": True},
            {"capability": "multifd", "state": bool(multifd)}]
    if postcopy:
        caps.append({"capability": "postcopy-ram", "state": True})
        caps.append({"capability": "postcopy-preempt", "state": bool(preempt)})
    if blocktime:  # the target's figure of how long its vCPUs waited on pages
        caps.append({"capability": "postcopy-blocktime", "state": True})
    vm.qmp_raw("migrate-set-capabilities", {"capabilities": caps})


def migrate_direct(src, dst, multifd_channels=0, max_bandwidth=10 * GiB,
                   downtime_limit_ms=None, socket_path=None, timeout=300.0,
                   target_timeout=60.0, poll_interval=0.05, postcopy=False, source_uri=None, preempt=False):
    """Migrates ``src`` (a running QemuVm) into ``dst`` (a QemuVm started with
    incoming_defer=True) over a unix socket.

    multifd_channels > 0 enables the multifd capability on both sides with that many
    channels. max_bandwidth is bytes/s (QEMU 7.2 defaults to 128 MiB/s). Waits for the
    source to reach completed/failed/cancelled (raises TimeoutError after ``timeout`` s,
    having issued migrate_cancel), then for the target to leave "inmigrate" and, when
    it runs (no -S), for its RESUME event.

    Returns a dict:
      status                       source's final status (completed, failed, cancelled)
      error                        error-desc on failure, else None
      total_time_ms, downtime_ms, setup_time_ms   as reported by the source
      transferred_bytes            ram.transferred on the source
      ram                          the source's whole query-migrate "ram" dict
      switchover_ms                source STOP event -> target RESUME event (QMP
                                   timestamps); None if the target stays paused (-S)
      stop_to_target_completed_ms  source STOP -> target MIGRATION{completed} event
      target_status                target's query-status after the migration
      wall_time_ms                 host time from issuing "migrate" to source completion
      multifd_channels, max_bandwidth, downtime_limit_ms
      source_info                  the source's final query-migrate reply
    ``postcopy``: postcopy-ram on both QEMUs (postcopy-blocktime on the target) and
    migrate-start-postcopy once the first pass is done (PassCounter reaches 2),
    as an agent's `postCopy: after` does; the result then also has postcopy_requests (the source's
    ram.postcopy-requests) and target_blocktime_ms (the target's postcopy-blocktime). When the switch
    came and how long post-copy ran: the source's MIGRATION events (QEMU's own timestamps).
    ``preempt``: with postcopy, postcopy-preempt on both QEMUs too (one more connection at the switch).
    ``source_uri``: where the source QEMU sends (a relay in between, bench/run.py's floor); the
    target still listens on ``socket_path``.
    """
    channels = int(multifd_channels or 0)
    if socket_path is None:
        socket_path = os.path.join(dst.workdir, "%s.migrate.sock" % dst.name)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    uri = "unix:" + socket_path

    src_ev0 = len(src.events)
    dst_ev0 = len(dst.events)

    # Target side: capabilities must match the source's (multifd in particular).
    _set_caps(dst, channels > 0, postcopy, blocktime=postcopy, preempt=preempt)
    if channels > 0:
        dst.qmp_raw("migrate-set-parameters", {"multifd-channels": channels})
    dst.qmp_raw("migrate-incoming", {"uri": uri})
    deadline = time.monotonic() + 10.0
    while not os.path.exists(socket_path):
        if time.monotonic() > deadline:
            raise TimeoutError("target did not listen on %s" % socket_path)
        time.sleep(0.01)

    # Source side.
    _set_caps(src, channels > 0, postcopy, preempt=preempt)
    params = {"max-bandwidth": int(max_bandwidth)}
    if downtime_limit_ms is not None:
        params["downtime-limit"] = int(downtime_limit_ms)
    if channels > 0:
        params["multifd-channels"] = channels
    src.qmp_raw("migrate-set-parameters", params)

    t0 = time.monotonic()
    src.qmp_raw("migrate", {"uri": source_uri or uri})
    deadline = t0 + timeout
    switched = False
    passes = PassCounter()
    while True:
        info = src.qmp_raw("query-migrate")
        status = info.get("status")
        if status in ("completed", "failed", "cancelled"):
            break
        if postcopy and not switched and status == "active" and passes.observe(info.get("ram") or {}) >= 2:
            src.qmp_raw("migrate-start-postcopy")
            switched = True
        if time.monotonic() > deadline:
            try:
                src.qmp_raw("migrate_cancel")
            except Exception:
                pass
            raise TimeoutError("migration still %s after %.0fs: %r" % (status, timeout, info))
        time.sleep(poll_interval)
    wall_ms = (time.monotonic() - t0) * 1000.0
    # QEMU 7.2 sets "completed" just before it computes total-time and downtime (a large idle
    # guest showed total-time 0): ask again until they are filled in, as the agent does.
    fill_deadline = time.monotonic() + 2.0
    while (status == "completed" and not (info.get("total-time") or 0) > 0
           and time.monotonic() < fill_deadline):
        time.sleep(0.01)
        info = src.qmp_raw("query-migrate")

    result = {
        "status": status,
        "error": info.get("error-desc"),
        "total_time_ms": info.get("total-time"),
        "downtime_ms": info.get("downtime"),
        "setup_time_ms": info.get("setup-time"),
        "transferred_bytes": info.get("ram", {}).get("transferred"),
        "ram": info.get("ram", {}),
        "switchover_ms": None,
        "stop_to_target_completed_ms": None,
        "target_status": None,
        "wall_time_ms": wall_ms,
        "multifd_channels": channels,
        "max_bandwidth": int(max_bandwidth),
        "downtime_limit_ms": downtime_limit_ms,
        "source_info": info,
    }
    if postcopy:
        result["postcopy_requests"] = (info.get("ram") or {}).get("postcopy-requests")
        result["target_blocktime_ms"] = None
    if status != "completed":
        return result

    # Target: wait until it has loaded the final state.
    tdeadline = time.monotonic() + target_timeout
    while True:
        tst = dst.status()
        if tst != "inmigrate":
            break
        if time.monotonic() > tdeadline:
            raise TimeoutError("target still inmigrate %.0fs after source completed"
                               % target_timeout)
        time.sleep(poll_interval)
    result["target_status"] = tst
    if postcopy:
        tinfo = dst.qmp_raw("query-migrate")
        result["target_blocktime_ms"] = tinfo.get("postcopy-blocktime")
        dist = tinfo.get("postcopy-latency-dist")  # QEMU 10.1+
        result["target_latency_p50_us"] = latency_quantile_us(dist, 0.5)
        result["target_latency_p99_us"] = latency_quantile_us(dist, 0.99)

    src.poll_events(0)
    stops = _events_since(src, src_ev0, "STOP")
    stop = stops[-1] if stops else None
    try:
        done = dst.wait_event(
            "MIGRATION", max(0.5, tdeadline - time.monotonic()),
            pred=lambda e: e.get("data", {}).get("status") == "completed"
            and e in dst.events[dst_ev0:])
    except TimeoutError:
        done = None
    result["stop_to_target_completed_ms"] = switchover_ms(stop, done)
    if tst == "running":
        resume = dst.wait_event("RESUME", max(0.5, tdeadline - time.monotonic()),
                                pred=lambda e: e in dst.events[dst_ev0:])
        result["switchover_ms"] = switchover_ms(stop, resume)
    return result
