#!/usr/bin/env bash
# Runs SCRIPT inside a throw-away VM (Debian's kernel under qemu-system-x86_64, TCG)
# that has a Soft-RoCE device rxe0 on veth va (10.99.0.1/24; peer vb 10.99.0.2/24).
#
#   tests/rdma/run-in-vm.sh [--mem MiB] [--smp N] [--timeout S] [--with-qemu]
#                           [--add PATH]... [--out DIR] [--verbose] [--qemu-arg ARG]...
#                           [--node a|b] [--fault-file F] [--build-only] -- SCRIPT [ARGS]...
#
#   --mem MiB     VM memory (default 1024; use 2048 with --with-qemu)
#   --smp N       VM CPUs (default 2)
#   --timeout S   whole run, boot included (default 600); on expiry QEMU is killed
#   --with-qemu   include qemu-system-x86_64 for nested guests (see build-initramfs.sh)
#   --add PATH    file or directory to include at its absolute path (repeatable)
#   --out DIR     host folder shared read-write into the VM at /out (9p); the script
#                 finds it in $RDMIG_OUT. The way to pass files out of the VM.
#   --verbose     show the kernel's boot messages
#   --qemu-arg A  extra argument for QEMU (repeatable), e.g. --qemu-arg -cpu --qemu-arg max
#   --node a|b    boot as node a or b of a two-VM run (see run-two-vms.sh, which passes the
#                 virtio-net link with --qemu-arg): rxea/rxeb on eth0 instead of rxe0 on va
#   --fault-file F  with --node: where to write why the VM kernel's rxe failed (run-two-vms.sh
#                 reads it to boot the pair again; the exit status alone could be the script's)
#   --build-only  build (or find in the cache) the initramfs and exit
#
# SCRIPT (any executable with a shebang the VM can run: /bin/sh, bash) is copied to
# its absolute path; ARGS are passed as given. The console is streamed to stdout.
# The VM's kernel: Debian 13's (RDMIG_VM_KERNEL_SUITE, default trixie; "host": this host's Debian
# 12 kernel), or RDMIG_KERNEL_ROOT (an unpacked kernel package). A VM whose kernel's rxe fails
# (console-watch.awk: a soft lockup, or a kernel panic in rdma_rxe) before the script reported
# its exit status is stopped; a lone VM (no --node) is booted again, at most three boots within
# --timeout, and a node writes why to --fault-file and exits 123 for run-two-vms.sh to boot the
# pair again.
# The exit status is the script's; 123 when a node's kernel's rxe failed (with the fault file);
# 124 on timeout; 125 when the VM's setup failed or its kernel's rxe failed in three boots;
# 126 when the VM ended without reporting (any other kernel panic, QEMU error).
# Inside the VM: PATH has the rdma tools, $RDMIG_RDMA_DEV=rxe0, $RDMIG_RDMA_NETDEV=va,
# $RDMIG_VM_ADDR=10.99.0.1, $RDMIG_VM_PEER_ADDR=10.99.0.2, $QEMU_MODULE_DIR with
# --with-qemu; / (and /tmp) is a tmpfs that may use 90% of the memory. The one rxe device serves both
# ends of a connection (loopback); for two devices in two network stacks use run-two-vms.sh.
# The base initramfs is cached under $RDMIG_CACHE (default <repo>/.cache)/rdma-vm, keyed
# by these scripts, the options and the added host paths' names, sizes and mtimes; added
# paths inside the repository go into an overlay made for each run (below).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
die() { echo "run-in-vm: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

mem=1024 smp=2 timeout_s=600 with_qemu=0 verbose=0 outdir="" adds=() qargs=() node="" build_only=0 fault_file=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mem) mem="${2:?--mem needs MiB}"; shift 2 ;;
    --smp) smp="${2:?--smp needs a count}"; shift 2 ;;
    --timeout) timeout_s="${2:?--timeout needs seconds}"; shift 2 ;;
    --with-qemu) with_qemu=1; shift ;;
    --add) adds+=("${2:?--add needs a path}"); shift 2 ;;
    --out) outdir="${2:?--out needs a folder}"; shift 2 ;;
    --verbose) verbose=1; shift ;;
    --qemu-arg) qargs+=("${2:?--qemu-arg needs an argument}"); shift 2 ;;
    --node) node="${2:?--node needs a or b}"; shift 2 ;;
    --fault-file) fault_file="${2:?--fault-file needs a path}"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
script="$1"; shift
[ -f "$script" ] || die "SCRIPT $script: no such file"
script="$(realpath -s "$script")"
[[ "$mem" =~ ^[0-9]+$ && "$smp" =~ ^[0-9]+$ && "$timeout_s" =~ ^[0-9]+$ ]] ||
  die "--mem, --smp and --timeout take whole numbers"
case "$node" in ""|a|b) ;; *) die "--node takes a or b" ;; esac
for p in ${adds[@]+"${adds[@]}"}; do [ -e "$p" ] || die "--add $p: no such file or directory"; done

if ! command -v qemu-system-x86_64 >/dev/null || ! command -v cpio >/dev/null; then
  [ "$(id -u)" = 0 ] || die "qemu-system-x86_64 and cpio are needed (apt-get install qemu-system-x86 cpio)"
  echo "run-in-vm: installing qemu-system-x86 cpio" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends qemu-system-x86 cpio >&2 ||
    { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends qemu-system-x86 cpio >&2; } ||
    die "apt-get install qemu-system-x86 cpio failed"
fi

# --- base initramfs, cached outside the clone ---------------------------------------
# The base (kernel modules, rdma-core, busybox, the host's programs given with --add) is
# cached under $RDMIG_CACHE/rdma-vm, keyed by the kernel package, these scripts and the
# added host paths' names, sizes and mtimes. --add paths inside this repository (the
# build's programs, tests, tools) change with every clone and build: they go into an
# overlay archive made for each run and appended to the base, so they never rebuild it.
cache="${RDMIG_CACHE:-$repo/.cache}"
mkdir -p "$cache/rdma-vm"
cache="$(cd "$cache" && pwd)"
# The VMs' kernel: Debian 13's (6.12; RDMIG_VM_KERNEL_SUITE, "host" for this host's Debian 12 6.1),
# unless RDMIG_KERNEL_ROOT names an unpacked kernel package. Debian 12's rxe locked up its softirq
# (tasklets) after RoCE v2 was dropped mid-flow, a soft lockup in about one run in three
# (tests/rdma/README.md); 6.12's rxe runs its tasks on a workqueue.
if [ -z "${RDMIG_KERNEL_ROOT:-}" ]; then
  vm_suite="${RDMIG_VM_KERNEL_SUITE:-trixie}"
  if [ "$vm_suite" = host ]; then
    RDMIG_KERNEL_ROOT="$("$repo/tools/guest/fetch-kernel.sh" "$cache")" || die "tools/guest/fetch-kernel.sh failed"
  else
    RDMIG_KERNEL_ROOT="$("$repo/tools/guest/fetch-kernel.sh" --suite "$vm_suite" "$cache")" ||
      die "tools/guest/fetch-kernel.sh --suite $vm_suite failed"
  fi
fi
export RDMIG_KERNEL_ROOT
kpkg="$(basename "$RDMIG_KERNEL_ROOT")"
build_args=() overlay_args=()
[ "$with_qemu" = 1 ] && build_args+=(--with-qemu)
for p in ${adds[@]+"${adds[@]}"}; do
  abs="$(realpath -s "$p")"
  case "$abs/" in
    "$repo"/*) overlay_args+=(--add "$abs") ;;
    *) build_args+=(--add "$abs") ;;
  esac
done
key="$({
  echo "kernel $kpkg $RDMIG_KERNEL_ROOT"
  printf '%s\n' ${build_args[@]+"${build_args[@]}"}
  cat "$here/build-initramfs.sh" "$here/vm-init.sh"
  for a in ${build_args[@]+"${build_args[@]}"}; do
    [ "$a" = --add ] || [ "$a" = --with-qemu ] && continue
    find "$a" -printf '%p %s %T@ %l\n' | LC_ALL=C sort
  done
} | sha256sum | cut -c1-16)"
base_dir="$cache/rdma-vm/$key"
t_start=$(date +%s.%N)
# One builder per key at a time (ctest may run two VM rows side by side).
exec 9>"$cache/rdma-vm/.lock-$key"
flock 9
if [ ! -e "$base_dir/initramfs.cpio" ] || [ ! -e "$base_dir/vmlinuz" ]; then
  echo "run-in-vm: building the initramfs (cache $base_dir)" >&2
  rm -rf "$base_dir.tmp"
  RDMIG_CACHE="$cache" "$here/build-initramfs.sh" "$base_dir.tmp" ${build_args[@]+"${build_args[@]}"} >/dev/null
  rm -rf "$base_dir"; mv "$base_dir.tmp" "$base_dir"
  # keep the cache from growing without bound: the 8 newest builds stay
  ls -1dt "$cache"/rdma-vm/*/ 2>/dev/null | tail -n +9 | xargs -r rm -rf
else
  touch "$base_dir"
  echo "run-in-vm: initramfs from cache $base_dir" >&2
fi
exec 9>&-
[ "$build_only" = 1 ] && exit 0

# --- per-run part: SCRIPT and its command line, appended as a second cpio archive ----
run="$(mktemp -d "${TMPDIR:-/tmp}/rdmig-vm.XXXXXX")"
cleanup() { rm -rf "$run"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$run/extra/etc/rdmig-vm" "$run/extra$(dirname "$script")"
cp -L --preserve=mode "$script" "$run/extra$script"
quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
{
  printf 'exec'
  if [ -x "$script" ]; then printf ' %s' "$(quote "$script")"; else printf ' /bin/sh %s' "$(quote "$script")"; fi
  for a in "$@"; do printf ' %s' "$(quote "$a")"; done
  printf '\n'
} >"$run/extra/etc/rdmig-vm/run"
(cd "$run/extra" && find . -mindepth 1 -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) >"$run/extra.cpio"
overlay=()
if [ ${#overlay_args[@]} -gt 0 ]; then
  "$here/build-initramfs.sh" "$run/overlay" --only-adds "${overlay_args[@]}" >/dev/null
  overlay=("$run/overlay/initramfs.cpio")
fi
cat "$base_dir/initramfs.cpio" ${overlay[@]+"${overlay[@]}"} "$run/extra.cpio" >"$run/initramfs.cpio"
t_built=$(date +%s.%N)

# no_timer_check: on a loaded host TCG can run the IO-APIC timer check too slowly, and the kernel
# panics "IO-APIC + timer doesn't work!" (seen with two VMs booting beside a -j2 build).
append="console=ttyS0 panic=-1 rdinit=/init no_timer_check"
[ "$verbose" = 1 ] || append+=" quiet"
[ -n "$outdir" ] && append+=" rdmig.share=rdmigout"
[ -n "$node" ] && append+=" rdmig.node=$node"
qemu=(qemu-system-x86_64 -accel tcg -m "$mem" -smp "$smp" -nographic -nic none -no-reboot
      -kernel "$base_dir/vmlinuz" -initrd "$run/initramfs.cpio" -append "$append")
if [ -n "$outdir" ]; then
  mkdir -p "$outdir"
  qemu+=(-virtfs "local,path=$(cd "$outdir" && pwd),mount_tag=rdmigout,security_model=none,id=rdmigout")
fi
qemu+=(${qargs[@]+"${qargs[@]}"})

# --- boot, stream the console, collect the exit marker ---------------------------------
log="$run/console.log"
echo "run-in-vm: booting (mem ${mem} MiB, smp $smp, timeout ${timeout_s}s): $(basename "$script") $*" >&2
# A VM whose kernel's rxe fails (console-watch.awk: a soft lockup, Debian 12's 6.1 rxe under TCG,
# RDMIG_VM_KERNEL_SUITE=host; or a kernel panic in rdma_rxe, Debian 13's 6.12: tests/rdma/README.md)
# is stopped at once. A lone one is booted again, at most twice, within the same --timeout: a
# locked-up kernel had sat out the row's whole timeout (rdma_single_node, CI of 2026-12-07: 2100 s
# for a row of about 160 s). A node exits 123 and run-two-vms.sh, which stops and boots the pair,
# decides.
boots=0
while :; do
  boots=$((boots + 1))
  left=$(awk -v t="$timeout_s" -v a="$t_start" -v n="$(date +%s.%N)" 'BEGIN{l=int(t-(n-a)); print (l<1?1:l)}')
  rm -f "$run/lockup" "$run/qemu.pid"
  set +e
  # --foreground: QEMU stays in this script's process group, so that stopping the group (run-two-vms.sh
  # stops a pair whose kernel locked up) stops QEMU too. Without it timeout puts QEMU in a group of its
  # own, and a stopped pair's QEMUs ran on beside the pair booted again, until their timeout (seen:
  # W23, 2026-12-07: node b's at 100% CPU for 9 minutes, the second boot's cases 1.7 times slower).
  timeout --foreground --kill-after=10 "$left" "${qemu[@]}" -pidfile "$run/qemu.pid" </dev/null 2>&1 |
    mawk -W interactive -v lk="$run/lockup" -v pf="$run/qemu.pid" -f "$here/console-watch.awk" | tee "$log"
  rc=("${PIPESTATUS[@]}")
  set -e
  marker="$(tr -d '\r' <"$log" | grep -a -o '^RDMIG-VM-EXIT [0-9]*$' | tail -n1 || true)"
  [ -e "$run/lockup" ] || break
  # A fault after the script reported its exit status (powering off) does not undo the result.
  if [ -n "$marker" ]; then
    echo "run-in-vm: the VM kernel's rxe failed after the script ended ($(cat "$run/lockup")): its result stands" >&2
    break
  fi
  why="$(cat "$run/lockup")"
  if [ -n "$node" ]; then
    echo "run-in-vm: FAILED: the VM kernel's rxe failed ($why): node $node stopped for run-two-vms.sh to boot the pair again" >&2
    if [ -n "$fault_file" ]; then printf '%s\n' "$why" >"$fault_file"; fi
    exit 123
  fi
  if [ "$boots" -ge 3 ]; then
    echo "run-in-vm: FAILED: the VM kernel's rxe failed in $boots boots in a row (the last: $why)" >&2
    exit 125
  fi
  echo "run-in-vm: booting the VM again (boot $((boots + 1)) of at most 3; $why is the VM kernel's rxe, not the script's result)" >&2
done
t_end=$(date +%s.%N)
times="$(awk -v a="$t_start" -v b="$t_built" -v c="$t_end" 'BEGIN{printf "initramfs %.1fs, VM %.1fs, total %.1fs", b-a, c-b, c-a}')"
if [ "${rc[0]}" = 124 ] || [ "${rc[0]}" = 137 ]; then
  echo "run-in-vm: FAILED: timed out after ${timeout_s}s ($times); the console is above" >&2
  exit 124
fi
if [ -z "$marker" ]; then
  echo "run-in-vm: FAILED: the VM ended without reporting an exit status (QEMU status ${rc[0]}; kernel panic, out of memory or QEMU error?) ($times). Last console lines:" >&2
  tr -d '\r' <"$log" | tail -n 15 | sed 's/^/  | /' >&2
  exit 126
fi
code="${marker#RDMIG-VM-EXIT }"
if [ "$code" = 0 ]; then
  echo "run-in-vm: OK: $(basename "$script") exited with 0 ($times)" >&2
elif [ "$code" = 125 ]; then
  echo "run-in-vm: FAILED: the VM's setup failed before the script ran ($times); see 'setup failed' above" >&2
else
  echo "run-in-vm: FAILED: $(basename "$script") exited with $code ($times)" >&2
fi
exit "$code"
