#!/bin/sh
# Checks nested QEMU inside the Soft-RoCE VM (run-in-vm.sh --with-qemu --mem 2048):
#   1. a kernel boots under qemu-system-x86_64 -accel tcg (it panics for want of a
#      root file system, which is fine: "Linux version" and the panic show it ran);
#   2. a 128 MiB guest that only runs its firmware migrates over a unix socket, driven
#      through QMP with socat, and the target runs afterwards.
#   tests/rdma/run-in-vm.sh --with-qemu --mem 2048 --add VMLINUZ -- tests/rdma/nested-qemu-check.sh VMLINUZ
set -eu
kernel="${1:?usage: nested-qemu-check.sh VMLINUZ}"
failed=""
fail() { echo "NESTED FAILED: $*"; failed="$failed $*;"; }
now() { cut -d' ' -f1 /proc/uptime; }
qemu-system-x86_64 --version | head -n1

echo "=== 1. boot $kernel under nested TCG"
t0=$(now)
timeout 300 qemu-system-x86_64 -accel tcg -nographic -m 128 -nic none -no-reboot \
  -kernel "$kernel" -append "console=ttyS0 panic=-1 loglevel=4" </dev/null >/tmp/nested-boot.log 2>&1 || true
t1=$(now)
tr -d '\r' </tmp/nested-boot.log | grep -a -v '^\s*$' | tail -n 12 | sed 's/^/  nested| /'
if grep -aq 'Kernel panic' /tmp/nested-boot.log || grep -aq 'Linux version' /tmp/nested-boot.log; then
  echo "RDMIG-NESTED boot-seconds $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')"
else
  fail "nested kernel did not boot"
fi

echo "=== 2. migrate a 128 MiB firmware-only guest over a unix socket"
qmp() {  # qmp SOCKET JSON...: runs commands after qmp_capabilities, prints the replies
  sock="$1"; shift
  { echo '{"execute":"qmp_capabilities"}'; for c in "$@"; do echo "$c"; done; sleep 0.3; } |
    socat -t 2 - "UNIX-CONNECT:$sock" | grep -v '"QMP"'
}
wait_sock() { i=0; until [ -S "$1" ]; do i=$((i + 1)); [ $i -le 300 ] || return 1; sleep 0.1; done; }
rm -f /tmp/src.qmp /tmp/dst.qmp /tmp/mig.sock
qemu-system-x86_64 -accel tcg -display none -m 128 -nic none -qmp unix:/tmp/dst.qmp,server=on,wait=off \
  -incoming unix:/tmp/mig.sock </dev/null >/tmp/dst.log 2>&1 &
dst=$!
qemu-system-x86_64 -accel tcg -display none -m 128 -nic none -qmp unix:/tmp/src.qmp,server=on,wait=off \
  </dev/null >/tmp/src.log 2>&1 &
src=$!
if wait_sock /tmp/src.qmp && wait_sock /tmp/dst.qmp && wait_sock /tmp/mig.sock; then
  qmp /tmp/src.qmp '{"execute":"migrate-set-parameters","arguments":{"max-bandwidth":1073741824}}' \
    '{"execute":"migrate","arguments":{"uri":"unix:/tmp/mig.sock"}}' >/dev/null
  i=0 status=""
  while [ $i -lt 120 ]; do
    r="$(qmp /tmp/src.qmp '{"execute":"query-migrate"}' | tail -n1)"
    status="$(echo "$r" | sed -n 's/.*"status": *"\([a-z-]*\)".*/\1/p')"
    case "$status" in completed|failed|cancelled) break ;; esac
    i=$((i + 1)); sleep 0.5
  done
  echo "  source query-migrate: $r"
  dstat="$(qmp /tmp/dst.qmp '{"execute":"query-status"}' | tail -n1)"
  echo "  target query-status: $dstat"
  if [ "$status" = completed ] && echo "$dstat" | grep -q '"running"'; then
    echo "RDMIG-NESTED migration-ms $(echo "$r" | sed -n 's/.*"total-time": *\([0-9]*\).*/\1/p')"
    echo "RDMIG-NESTED downtime-ms $(echo "$r" | sed -n 's/.*"downtime": *\([0-9]*\).*/\1/p')"
  else
    fail "migration status '$status', target $dstat"
  fi
else
  fail "QMP or incoming sockets did not appear"; cat /tmp/src.log /tmp/dst.log
fi
kill $src $dst 2>/dev/null || true
wait 2>/dev/null || true

if [ -n "$failed" ]; then echo "NESTED: FAILED:$failed"; exit 1; fi
echo "NESTED: all checks passed"
