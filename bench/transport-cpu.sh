#!/usr/bin/env bash
# CPU cost per GiB of rdmig's transports, measured side by side in the Soft-RoCE VM (TCP over
# loopback and RDMA over rxe0 in the same boot). Writes bench/results/transport-cpu.md.
#   bench/transport-cpu.sh   (after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
tests/rdma/run-in-vm.sh --mem 1536 --timeout 600 --add "$PWD/build/bench/stream/rdmig-stream" \
  -- bench/transport-cpu-vm.sh "$PWD/build" 3 | tee "$log" | grep --line-buffered RDMIG-CPU || true
python3 - "$log" bench/results/transport-cpu.md <<'PY'
import sys, statistics, datetime
rows = {}
for l in open(sys.argv[1], errors="replace"):
    if l.startswith("RDMIG-CPU"):
        _, t, mbs, cpu, user, system = l.split()
        rows.setdefault(t, []).append((float(mbs), float(cpu), float(user), float(system)))
if not rows:
    sys.exit("transport-cpu: no results (see the VM console above)")
out = ["# CPU per GiB moved, TCP vs RDMA (Soft-RoCE VM)", "",
       "Measured %s inside the 2-vCPU TCG VM: rdmig-stream, 1 channel, 1 MiB chunks, depth 16, 512 MiB, "
       "sender and receiver in one process (user and system time apart), medians of %d runs. rxe does the "
       "NIC's work in the kernel, on the posting thread (system time) and in kernel threads outside the "
       "process: on a hardware RNIC that work is offloaded, so for RDMA only the user time says what the "
       "agents would spend. Goal: RDMA user time <= 0.25 CPU-s/GiB for both ends."
       % (datetime.date.today().isoformat(), max(len(v) for v in rows.values())), "",
       "| transport | MB/s | CPU s per GiB (both ends) | user s per GiB | system s per GiB |", "|---|---|---|---|---|"]
for t in ("tcp", "rdma"):
    if t in rows:
        m = [statistics.median(r[i] for r in rows[t]) for i in range(4)]
        out.append("| %s | %.1f | %.2f | %.3f%s | %.3f |" % (t, m[0], m[1], m[2], " (goal <= 0.25)" if t == "rdma" else "", m[3]))
open(sys.argv[2], "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY
rm -f "$log"
