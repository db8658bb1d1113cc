#!/bin/sh
# Runs inside the Soft-RoCE VM (see CMakeLists.txt here): rdmig's RDMA transport on rxe0.
#   transport-tests.sh BUILD_DIR
# 1. the RDMA unit tests against the real device;
# 2. 256 MiB streams with a return stream, 1 and 4 channels, chunk sizes 64Ki/1Mi/16Mi,
#    digests compared end to end;
# 3. a peer killed mid-stream ends the other side with an error (no hang, no crash);
# 4. rdmig's throughput against ib_write_bw on the same device, as a ratio.
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

for chunk in 64Ki 1Mi 16Mi; do
  depth=16; [ "$chunk" = 16Mi ] && depth=4   # keep rings within the VM's memory
  for ch in 1 4; do
    step "stream 256Mi over $ch channel(s), chunk $chunk, depth $depth"
    out="$("$stream" --transport rdma --ip "$ip" --bytes 256Mi --reverse 4Mi --channels "$ch" --chunk "$chunk" \
           --depth "$depth" --timeout 120 2>&1)"; rc=$?
    echo "$out"
    [ $rc = 0 ] || fail "stream chunk=$chunk channels=$ch exited $rc"
    echo "$out" | grep -q "digests match" || fail "stream chunk=$chunk channels=$ch: digests do not match"
  done
done

step "peer killed mid-stream"
"$stream" --role server --transport rdma --ip "$ip" --port 7999 --channels 2 --chunk 1Mi --depth 8 \
  --reverse 0 --timeout 60 >/tmp/server.out 2>&1 &
spid=$!
sleep 1
"$stream" --role client --transport rdma --ip "$ip" --port 7999 --channels 2 --chunk 1Mi --depth 8 \
  --bytes 4Gi --timeout 60 >/tmp/client.out 2>&1 &
cpid=$!
sleep 2
kill -9 $spid
wait $spid 2>/dev/null
t0=$(date +%s)
wait $cpid; crc=$?
t1=$(date +%s)
cat /tmp/client.out
echo "client exit status $crc after the server died (waited $((t1 - t0)) s)"
[ $crc = 1 ] || fail "client should fail cleanly (exit 1), got $crc"
grep -Eq "disconnected|work completion failed|peer" /tmp/client.out || fail "client error does not say what happened"
echo "RDMIG-RESULT peer-killed-exit $crc"

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
