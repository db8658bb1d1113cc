#!/bin/sh
# Runs inside the Soft-RoCE VM (bench/rdma-sweep.sh boots it): chunk-size sweep of rdmig's
# RDMA transport on rxe0, next to ib_write_bw with one write in flight (-t 1: the
# stop-and-wait pattern of QEMU's RDMA migration) and with 16 in flight, same sizes.
#   rdma-sweep-vm.sh BUILD_DIR [BYTES]
set -u
stream="$1/bench/stream/rdmig-stream"
bytes="${2:-512Mi}"
ip="${RDMIG_VM_ADDR:-10.99.0.1}"
port=18515
for chunk in 64Ki 128Ki 256Ki 512Ki 1Mi 2Mi 4Mi 8Mi 16Mi 32Mi 64Mi; do
  n=$(echo "$chunk" | sed 's/Ki/*1024/; s/Mi/*1048576/' | awk '{ split($0, a, "*"); print a[1] * a[2] }')
  # Bound the ring at 64 MiB per direction: depth 16 for small chunks, at least 2.
  depth=$((67108864 / n)); [ $depth -gt 16 ] && depth=16; [ $depth -lt 2 ] && depth=2
  ours="$("$stream" --transport rdma --ip "$ip" --bytes "$bytes" --channels 1 --chunk "$chunk" --depth $depth \
          --no-verify --json --timeout 300 | awk -F'"bytesPerSecond":' '/"side":"client"/ {split($2, a, "}"); print a[1]}')"
  iters=$((268435456 / n)); [ $iters -lt 8 ] && iters=8; [ $iters -gt 2000 ] && iters=2000
  port=$((port + 1))
  ib_write_bw -d rxe0 -s $n -n $iters -t 1 -F -p $port >/dev/null 2>&1 &
  sleep 1
  one="$(timeout 120 ib_write_bw -d rxe0 -s $n -n $iters -t 1 -F -p $port "$ip" 2>/dev/null | awk -v s=$n '$1 == s {print $4}' | tail -n1)"
  wait
  port=$((port + 1))
  ib_write_bw -d rxe0 -s $n -n $iters -t 16 -F -p $port >/dev/null 2>&1 &
  sleep 1
  many="$(timeout 120 ib_write_bw -d rxe0 -s $n -n $iters -t 16 -F -p $port "$ip" 2>/dev/null | awk -v s=$n '$1 == s {print $4}' | tail -n1)"
  wait
  echo "RDMIG-SWEEP $chunk $depth $(awk -v o="${ours:-0}" 'BEGIN { printf "%.1f", o / 1e6 }') ${one:-0} ${many:-0}"
done
