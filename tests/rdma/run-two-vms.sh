#!/usr/bin/env bash
# Runs SCRIPT in two throw-away Soft-RoCE VMs, "node a" and "node b": two kernels, two
# network stacks, two rxe devices, joined by one virtio-net link (a QEMU stream netdev
# over a unix socket on this host). What two Kubernetes nodes with RoCE NICs are.
#
#   tests/rdma/run-two-vms.sh [--mem MiB] [--timeout S] [--with-qemu] [--add PATH]...
#                             [--out DIR] [--rails 1|2] -- SCRIPT [ARGS]...
#
# Both VMs run the same SCRIPT with the same ARGS (see run-in-vm.sh for the options);
# it tells the nodes apart by $RDMIG_NODE (a or b). Inside node a: rxea on eth0
# 10.99.1.1/24; node b: rxeb on eth0 10.99.1.2/24 ($RDMIG_RDMA_DEV, $RDMIG_RDMA_NETDEV,
# $RDMIG_VM_ADDR, $RDMIG_VM_PEER_ADDR). --rails 2: a second link (a second stream socket and
# virtio-net NIC per VM) with a second rxe device on it, rxea2 on eth1 10.99.2.1/24 and rxeb2
# on eth1 10.99.2.2/24 ($RDMIG_RDMA_DEV2, $RDMIG_RDMA_NETDEV2, $RDMIG_VM_ADDR2,
# $RDMIG_VM_PEER_ADDR2; vm-init.sh): two RDMA NICs per node, "rails". Both share one host folder at /out ($RDMIG_OUT;
# a temporary one unless --out is given): the way the two scripts meet (two-node-lib.sh).
# Each console line is prefixed "a| " or "b| ". The exit status is 0 when both scripts
# exited 0, otherwise node a's status if non-zero, else node b's. When one node fails,
# the other is stopped after a grace period (it would only wait for its peer).
# A node whose kernel's rxe fails (run-in-vm.sh writes why to the node's fault file and exits 123:
# its console showed a soft lockup,
# "watchdog: BUG: soft lockup", Debian 12's 6.1 rxe spinning in softirq after RoCE v2 was dropped
# mid-flow, seen in runs W9 and C2 of 2026-12-06, each once in about 15 runs of the rails rows, the
# VMs booting 6.1 until 2026-12-07 and again with RDMIG_VM_KERNEL_SUITE=host; or a kernel panic in
# rdma_rxe, Debian 13's 6.12: a double fault in rxe_receiver during the rail-cut cases, run W35 of
# 2026-12-07) never ends its script: both VMs are stopped at once and the pair boots again, at most
# twice, saying so (exit status 125 if that happens in three pairs). Nothing of rdmig runs in the
# kernel; a real NIC has no rxe.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
die() { echo "run-two-vms: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

opts=() outdir="" mem=1024 rails=1
while [ $# -gt 0 ]; do
  case "$1" in
    --mem) mem="${2:?--mem needs MiB}"; shift 2 ;;
    --timeout|--add) opts+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    --with-qemu) opts+=("$1"); shift ;;
    --out) outdir="${2:?--out needs a folder}"; shift 2 ;;
    --rails) rails="${2:?--rails needs 1 or 2}"; shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ $# -ge 1 ] || usage
case "$rails" in 1|2) ;; *) die "--rails takes 1 or 2" ;; esac
opts+=(--mem "$mem")

# The runner of one node: run-in-vm.sh (RDMIG_RUN_IN_VM: a stand-in for it, tests/rdma/test_console_watch.py).
runner="${RDMIG_RUN_IN_VM:-$here/run-in-vm.sh}"
# One build for both (two concurrent builds would race on the cache).
"$runner" "${opts[@]}" --build-only -- "$@"

run="$(mktemp -d "${TMPDIR:-/tmp}/rdmig-2vm.XXXXXX")"
pids=()
# Stops both nodes' sessions (run-in-vm.sh and its QEMU, which run-in-vm keeps in its process group)
# and waits until nothing of them is left: SIGKILL after 15 s. A pair booted again never runs
# beside the stopped one.
stop_nodes() {
  for p in ${pids[@]+"${pids[@]}"}; do kill -TERM -- "-$p" 2>/dev/null || true; done
  local alive
  for _ in $(seq 1 150); do
    alive=0
    for p in ${pids[@]+"${pids[@]}"}; do kill -0 -- "-$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.1
  done
  echo "run-two-vms: a node did not stop within 15 s of SIGTERM: SIGKILL" >&2
  for p in ${pids[@]+"${pids[@]}"}; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
cleanup() {
  stop_nodes
  wait 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ -z "$outdir" ]; then outdir="$run/out"; fi
mkdir -p "$outdir"
outdir="$(cd "$outdir" && pwd)"
rm -rf "$outdir/rdv"   # rendezvous files of an earlier run would mislead the scripts
links=()   # link k (1-based) is the unix socket of node a's k-th NIC's stream netdev
for k in $(seq 1 "$rails"); do links+=("$run/link$k.sock"); done

boot() { # NODE SERVER(on|off)
  local node="$1" server="$2" k=0 nics=()
  shift 2
  for l in "${links[@]}"; do
    k=$((k + 1))
    nics+=(--qemu-arg -netdev --qemu-arg "stream,id=link$k,server=$server,addr.type=unix,addr.path=$l"
           --qemu-arg -device
           --qemu-arg "virtio-net-pci,netdev=link$k,mac=52:54:00:99:0$k:0$([ "$node" = a ] && echo 1 || echo 2)")
  done
  # In a session of its own (setsid), so that stopping it reaches QEMU too: kill -- -PID.
  # The status file appears whole (written aside, then renamed): a look between its creation and
  # its write would read nothing.
  NODE="$node" RC_FILE="$run/$node.rc" setsid bash -c '
    "$@" 2>&1 | while IFS= read -r line || [ -n "$line" ]; do printf "%s| %s\n" "$NODE" "$line"; done
    rc="${PIPESTATUS[0]}"
    echo "$rc" >"$RC_FILE.tmp" && mv "$RC_FILE.tmp" "$RC_FILE"' _ \
    "$runner" "${opts[@]}" --node "$node" --fault-file "$run/$node.fault" --out "$outdir" "${nics[@]}" -- "$@" &
  pids+=($!)
}
# Node `$1`'s kernel's rxe failed (its fault file): says so, with the other node's exit status
# when that one had ended (a failure of its own is booted again with the pair), and marks the pair.
name_fault() {
  local other=a
  [ "$1" = a ] && other=b
  lockup=$1
  printf "run-two-vms: node %s's kernel's rxe failed (%s)" "$1" "$(cat "$run/$1.fault")" >&2
  if [ -e "$run/$other.rc" ]; then printf ', node %s had exited %s' "$other" "$(cat "$run/$other.rc")" >&2; fi
  echo >&2
}
# One boot of the pair: 0 when both nodes' scripts ended, 1 when a kernel's rxe failed (both stopped).
run_pair() {
  rm -f "$run"/a.rc "$run"/b.rc "$run"/a.fault "$run"/b.fault "${links[@]}"
  rm -rf "$outdir/rdv"
  # Node a serves the links; node b connects, so b starts once a's sockets exist.
  boot a on "$@"
  for l in "${links[@]}"; do
    for _ in $(seq 1 600); do
      [ -S "$l" ] && break
      [ -e "$run/a.rc" ] && break
      sleep 0.1
    done
    [ -S "$l" ] || { echo "run-two-vms: node a did not open the link socket $l" >&2; wait; exit 126; }
  done
  boot b off "$@"

  # Wait for both; when one fails, give the other a grace period, then stop it.
  local grace=30 failed_at="" lockup=""
  while [ ! -e "$run/a.rc" ] || [ ! -e "$run/b.rc" ]; do
    for n in a b; do
      if [ -e "$run/$n.rc" ] && [ -e "$run/$n.fault" ] && [ -z "$lockup" ]; then
        name_fault "$n"
        echo "run-two-vms: stopping both nodes" >&2
        stop_nodes
        break
      fi
      if [ -e "$run/$n.rc" ] && [ "$(cat "$run/$n.rc")" != 0 ] && [ -z "$failed_at" ]; then
        failed_at=$(date +%s)
        echo "run-two-vms: node $n failed; the other node gets ${grace}s" >&2
      fi
    done
    [ -n "$lockup" ] && break
    if [ -n "$failed_at" ] && [ $(( $(date +%s) - failed_at )) -gt "$grace" ]; then
      echo "run-two-vms: stopping the remaining node" >&2
      stop_nodes
      break
    fi
    sleep 0.5
  done
  wait 2>/dev/null || true
  pids=()
  # Both may have ended between two looks: node a's script done (or failed waiting for b) and b's
  # kernel failed.
  for n in a b; do
    if [ -z "$lockup" ] && [ -e "$run/$n.fault" ]; then name_fault "$n"; fi
  done
  [ -z "$lockup" ]
}
# Up to two boots again: W26 (2026-12-07) saw node b lock up in two pairs in a row.
boots=1
until run_pair "$@"; do
  if [ "$boots" -ge 3 ]; then
    echo "run-two-vms: a VM kernel's rxe failed in $boots pairs in a row: failed" >&2
    exit 125
  fi
  boots=$((boots + 1))
  echo "run-two-vms: booting both VMs again (pair $boots of at most 3; a VM kernel's rxe failing is not the script's result)" >&2
done
rc_a="$(cat "$run/a.rc" 2>/dev/null || echo 126)"
rc_b="$(cat "$run/b.rc" 2>/dev/null || echo 126)"
echo "run-two-vms: node a exited $rc_a, node b exited $rc_b" >&2
if [ "$rc_a" != 0 ]; then exit "$rc_a"; fi
exit "$rc_b"
