#!/bin/sh
# Runs inside the Soft-RoCE VM (bench/rdma-sweep.sh boots it): chunk-size sweep of rdmig's
# RDMA transport on rxe0, next to ib_write_bw with one write in flight (-t 1: the
# stop-and-wait pattern of QEMU's RDMA migration) and with 16 in flight, same sizes.
#   rdma-sweep-vm.sh BUILD_DIR [BYTES] [REPEATS]
# Each point is the median of REPEATS runs (default 3), interleaved with ib_write_bw.
set -u
stream="$1/bench/stream/rdmig-stream"
bytes="${2:-256Mi}"
reps="${3:-3}"
median() { sort -n | awk '{ v[NR] = $1 } END { if (NR == 0) print 0; else print v[int((NR + 1) / 2)] }'; }
ip="${RDMIG_VM_ADDR:-10.99.0.1}"
port=18515
for chunk in 64Ki 128Ki 256Ki 512Ki 1Mi 2Mi 4Mi 8Mi 16Mi 32Mi 64Mi; do
  n=$(echo "$chunk" | sed 's/Ki/*1024/; s/Mi/*1048576/' | awk '{ split($0, a, "*"); print a[1] * a[2] }')
  # Bound the ring at 64 MiB per direction: depth 16 for small chunks, at least 2.
  depth=$((67108864 / n)); [ $depth -gt 16 ] && depth=16; [ $depth -lt 2 ] && depth=2
  iters=$((134217728 / n)); [ $iters -lt 8 ] && iters=8; [ $iters -gt 2000 ] && iters=2000
  : >/tmp/ours; : >/tmp/one; : >/tmp/many
  r=0
  while [ $r -lt "$reps" ]; do
    r=$((r + 1))
    "$stream" --transport rdma --ip "$ip" --bytes "$bytes" --channels 1 --chunk "$chunk" --depth $depth \
      --no-verify --json --timeout 300 | awk -F'"bytesPerSecond":' '/"side":"client"/ {split($2, a, "}"); printf "%.1f\n", a[1] / 1e6}' >>/tmp/ours
    for t in 1 16; do
      port=$((port + 1))
      ib_write_bw -d rxe0 -s $n -n $iters -t $t -F -p $port >/dev/null 2>&1 &
      sleep 1
      timeout 120 ib_write_bw -d rxe0 -s $n -n $iters -t $t -F -p $port "$ip" 2>/dev/null \
        | awk -v s=$n '$1 == s {print $4}' | tail -n1 >>"/tmp/$([ $t = 1 ] && echo one || echo many)"
      wait
    done
  done
  echo "RDMIG-SWEEP $chunk $depth $(median </tmp/ours) $(median </tmp/one) $(median </tmp/many)"
done
# CPU per GiB: bench/transport-cpu.sh (a separate VM run).
