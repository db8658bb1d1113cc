#!/bin/sh
# Runs inside the Soft-RoCE VM: CPU time per GiB moved by rdmig-stream, TCP over loopback
# against RDMA over rxe0, same tool, same VM, same chunk size (1 MiB) and depth (16).
# Sender and receiver run in one process; its user and system time apart. With rxe the
# "NIC" is kernel code: its work lands in system time of the posting thread and in
# softirq/kthreads partly outside this process, so user time is what a hardware RNIC leaves.
# Prints: RDMIG-CPU TRANSPORT MB/s CPU-s/GiB USER-s/GiB SYSTEM-s/GiB
#   transport-cpu-vm.sh BUILD_DIR [REPEATS]
set -u
stream="$1/bench/stream/rdmig-stream"
ip="${RDMIG_VM_ADDR:-10.99.0.1}"
reps="${2:-3}"
for t in tcp rdma; do
  addr="$ip"; [ "$t" = tcp ] && addr=127.0.0.1
  r=0
  while [ $r -lt "$reps" ]; do
    r=$((r + 1))
    "$stream" --transport $t --ip "$addr" --bytes 512Mi --channels 1 --chunk 1Mi --depth 16 --no-verify --json --timeout 300 \
      | awk -v t=$t -F'[:,}]' '/"side":"client"/ { for (i = 1; i <= NF; i++) { if ($i ~ /bytesPerSecond/) b = $(i+1);
            if ($i ~ /"cpuSeconds"/) c = $(i+1); if ($i ~ /cpuUserSeconds/) u = $(i+1); if ($i ~ /cpuSystemSeconds/) s = $(i+1) }
          printf "RDMIG-CPU %s %.1f %.3f %.3f %.3f\n", t, b / 1e6, c / 0.5, u / 0.5, s / 0.5 }'
  done
done
