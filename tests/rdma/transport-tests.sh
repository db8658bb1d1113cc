#!/bin/sh
# Runs inside the Soft-RoCE VM (see CMakeLists.txt here): rdmig's RDMA transport on rxe0.
#   transport-tests.sh BUILD_DIR
# 1. the RDMA unit tests against the real device;
# 2. rdmig's throughput against ib_write_bw on the same device (loopback), as a ratio.
# Streams between two devices, digests and a killed peer: transport-two-nodes.sh.
# Prints "RDMIG-RESULT key value" lines; exits non-zero when anything failed.
set -u
build="$1"
stream="$build/bench/stream/rdmig-stream"
ip="${RDMIG_VM_ADDR:-10.99.0.1}"
failed=0
fail() { echo "FAILED: $*"; failed=1; }
step() { echo; echo "=== $*"; }

step "unit tests on the real device"
RDMIG_RDMA_IP="$ip" "$build/tests/unit/rdmig-unit-tests" --gtest_filter='Rdma*' --gtest_brief=1 || fail "RDMA unit tests"
RDMIG_RDMA_IP="$ip" "$build/tests/unit/rdmig-unit-tests" --gtest_filter='Rdma*' 2>&1 | grep -q SKIPPED && fail "RDMA unit tests skipped on a real device"

step "throughput: rdmig-stream against ib_write_bw on rxe0 (1 MiB messages)"
ib_write_bw -d rxe0 -s 1048576 -n 300 -F >/tmp/ibw.server 2>&1 &
sleep 1
ibw="$(ib_write_bw -d rxe0 -s 1048576 -n 300 -F "$ip" 2>&1 | awk '$1 == 1048576 {print $4}' | tail -n1)"
wait
ours="$("$stream" --transport rdma --ip "$ip" --bytes 512Mi --channels 1 --chunk 1Mi --depth 16 --no-verify --json --timeout 120 \
        | awk -F'"bytesPerSecond":' '/"side":"client"/ {split($2, a, "}"); print a[1]}')"
echo "ib_write_bw ${ibw:-?} MB/s; rdmig-stream ${ours:-?} B/s"
if [ -n "$ibw" ] && [ -n "$ours" ]; then
  ratio="$(awk -v o="$ours" -v i="$ibw" 'BEGIN { printf "%.2f", (o / 1e6) / i }')"
  echo "RDMIG-RESULT ib_write_bw-MB/s $ibw"
  echo "RDMIG-RESULT rdmig-stream-MB/s $(awk -v o="$ours" 'BEGIN { printf "%.1f", o / 1e6 }')"
  echo "RDMIG-RESULT rdmig/ib_write_bw $ratio"
else
  fail "throughput comparison produced no figures"
fi
exit $failed
