#!/usr/bin/env bash
# Chunk-size sweep of rdmig's RDMA transport in the Soft-RoCE VM (Debian's kernel under
# qemu-system-x86_64 with rdma_rxe): 64 KiB .. 64 MiB, one channel, next to ib_write_bw with
# 1 and 16 writes in flight. Writes bench/results/rdma-sweep.md and prints it.
#   bench/rdma-sweep.sh [BYTES per run, default 256Mi] [REPEATS, default 3]   (after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/rdma-sweep.md
log=$(mktemp)
tests/rdma/run-in-vm.sh --mem 2048 --timeout 1500 --add "$PWD/build/bench/stream/rdmig-stream" \
  -- bench/rdma-sweep-vm.sh "$PWD/build" "${1:-256Mi}" "${2:-3}" | tee "$log" | grep --line-buffered RDMIG-SWEEP || true
python3 - "$log" "$out" <<'PY'
import sys, datetime
rows = [l.split()[1:] for l in open(sys.argv[1], errors="replace") if l.startswith("RDMIG-SWEEP")]
if not rows:
    sys.exit("rdma-sweep: no results (see the VM console above)")
best = max(float(r[2]) for r in rows)
mib = {r[0]: float(r[2]) for r in rows}
lines = ["# RDMA chunk-size sweep (Soft-RoCE VM)", "",
         "Measured %s: rdmig-stream, 1 channel, one rxe0 device talking to itself inside a 2-vCPU TCG VM; "
         "medians of 3 runs per point, interleaved with ib_write_bw."
         % datetime.date.today().isoformat(),
         "ib_write_bw -t 1 has one write in flight (QEMU's RDMA migration pattern); -t 16 has 16.", "",
         "| chunk | ring depth | rdmig MB/s | rdmig / best | ib_write_bw -t 1 MB/s | ib_write_bw -t 16 MB/s |",
         "|---|---|---|---|---|---|"]
for chunk, depth, ours, one, many in rows:
    lines.append("| %s | %s | %s | %.2f | %s | %s |" % (chunk, depth, ours, float(ours) / best if best else 0, one, many))
lines += ["", "1 MiB / best chunk size: **%.2f** (goal 0.9; QEMU's RDMA migration on a ConnectX-7: 0.07)."
          % (mib.get("1Mi", 0) / best if best else 0)]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
rm -f "$log"
