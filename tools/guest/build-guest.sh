#!/usr/bin/env bash
# Builds the migration test guest: Debian's kernel plus a busybox-static initramfs whose
# /init dirties memory and prints "rdmig-counter N" on the serial console once per interval.
#   tools/guest/build-guest.sh [OUT_DIR]
# OUT_DIR defaults to $RDMIG_CACHE/guest or ./.cache/guest. Produces OUT_DIR/vmlinuz and
# OUT_DIR/initramfs.cpio.gz, prints OUT_DIR on stdout. Re-runs are no-ops while OUT_DIR's
# stamp names this script's content.
# Guest kernel command line knobs:
#   rdmig.dirty_mib=N   MiB of /dev/urandom written to tmpfs per iteration (0 = idle guest)
#   rdmig.interval=S    seconds to sleep between iterations (busybox sleep; fractions work)
#   rdmig.disk=1        load virtio_pci/virtio_blk (packed below) and write /dev/vda without
#                       end: per turn K a 4 KiB block "rdmig-disk K" (NUL padded) at block
#                       (16*K mod blocks) and 60 KiB of /dev/urandom after it, each dd with
#                       conv=fsync (the bytes reach the image); every counter line is then
#                       followed by "rdmig-disk K" (the writer's last finished turn)
#   rdmig.disk_interval=S  seconds between the disk writer's turns (default 0.1)
#   rdmig.verify_mib=N  run the memory verifier (tools/guest/verify.c, packed static) over N MiB:
#                       self-describing pages rewritten at rdmig.verify_rate_mib MiB/s (default 8)
#                       and checked continuously; "rdmig-verify-counter K ... mismatches=M" once a
#                       second and "rdmig-verify-mismatch ..." per bad page on the console
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
self="$here/$(basename "${BASH_SOURCE[0]}")"
if [ -n "${1:-}" ]; then out="$1"
elif [ -n "${RDMIG_CACHE:-}" ]; then out="$RDMIG_CACHE/guest"
else out="$(pwd)/.cache/guest"; fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# Fresh when the stamp names this script's content (not its mtime: a new clone's files are
# all new, and the cache may live outside the clone, shared by every clone on the machine).
stamp="$(cat "$self" "$here/verify.c" | sha256sum | cut -c1-16)"
fresh() { [ -e "$out/vmlinuz" ] && [ -e "$out/initramfs.cpio.gz" ] && [ "$(cat "$out/.stamp" 2>/dev/null)" = "$stamp" ]; }
if fresh; then echo "$out"; exit 0; fi
# One builder at a time (ctest runs tests side by side); a second one finds it built.
exec 9>"$out/.lock"
flock 9
if fresh; then echo "$out"; exit 0; fi

busybox=""
for b in /bin/busybox /usr/bin/busybox; do
  [ -x "$b" ] || continue
  if command -v file >/dev/null && ! file -L "$b" | grep -q 'statically linked'; then continue; fi
  busybox="$b"; break
done
if [ -z "$busybox" ]; then
  echo "build-guest: installing busybox-static" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y busybox-static >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y busybox-static >&2; }
  busybox=/bin/busybox
fi
command -v cpio >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y cpio >&2

# The kernel cache lives next to the guest dir when RDMIG_CACHE is set, else under ./.cache.
kroot="$("$here/fetch-kernel.sh" ${RDMIG_CACHE:+"$RDMIG_CACHE"})"
vmlinuz="$(ls "$kroot"/boot/vmlinuz-* 2>/dev/null | head -n1)"
[ -n "$vmlinuz" ] || { echo "build-guest: no vmlinuz under $kroot/boot" >&2; exit 1; }

stage="$(mktemp -d "$out/.stage.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,sbin,dev,proc,sys,tmp,run,etc,root,lib/modules}
# virtio PCI and virtio-blk are modules in Debian's kernel (CONFIG_VIRTIO_BLK=m): packed as
# plain .ko (busybox insmod), loaded in this order (each after what it depends on) only with
# rdmig.disk=1 (tests/rdma/build-initramfs.sh packs its modules the same way).
kver="$(basename "$vmlinuz")"; kver="${kver#vmlinuz-}"
moddir="$kroot/lib/modules/$kver/kernel"
disk_modules="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk"
for m in $disk_modules; do
  ko="$(find "$moddir" -name "$m.ko" -o -name "$m.ko.xz" -o -name "$m.ko.zst" | head -n1)"
  [ -n "$ko" ] || { echo "build-guest: module $m not found under $moddir" >&2; exit 1; }
  case "$ko" in *.ko) ;; *) echo "build-guest: $ko is compressed; busybox insmod needs plain .ko" >&2; exit 1 ;; esac
  cp "$ko" "$stage/lib/modules/$m.ko"
done
echo "$disk_modules" > "$stage/etc/rdmig-disk-modules"
cc -static -O2 -o "$stage/bin/rdmig-verify" "$here/verify.c" \
  || { echo "build-guest: cannot build the memory verifier (a C compiler with static libc: gcc, libc6-dev)" >&2; exit 1; }
cp "$busybox" "$stage/bin/busybox"
chmod 755 "$stage/bin/busybox"
for a in sh mount mkdir cat dd sleep echo rm sync poweroff reboot ls ps free insmod; do
  ln -s busybox "$stage/bin/$a"
done
cat > "$stage/init" <<'EOF'
#!/bin/sh
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /run/dirty
mount -t tmpfs -o size=90% tmpfs /run/dirty
dirty=0
interval=1
for w in $(cat /proc/cmdline); do
  case "$w" in
    rdmig.dirty_mib=*) dirty="${w#rdmig.dirty_mib=}" ;;
    rdmig.interval=*) interval="${w#rdmig.interval=}" ;;
    rdmig.disk=*) disk="${w#rdmig.disk=}" ;;
    rdmig.disk_interval=*) disk_interval="${w#rdmig.disk_interval=}" ;;
    rdmig.verify_mib=*) verify_mib="${w#rdmig.verify_mib=}" ;;
    rdmig.verify_rate_mib=*) verify_rate="${w#rdmig.verify_rate_mib=}" ;;
  esac
done
con=/dev/ttyS0
[ -c "$con" ] || con=/dev/console
echo "rdmig-guest dirty_mib=$dirty interval=$interval disk=${disk:-0}" > "$con"
if [ "${disk:-0}" != 0 ]; then
  for m in $(cat /etc/rdmig-disk-modules); do
    insmod "/lib/modules/$m.ko" || echo "rdmig-disk-error insmod $m" > "$con"
  done
  t=0
  while [ ! -b /dev/vda ] && [ "$t" -lt 100 ]; do sleep 0.1; t=$((t + 1)); done
  if [ -b /dev/vda ]; then
    blocks=$(( $(cat /sys/block/vda/size) / 8 ))
    echo "rdmig-disk-ready blocks=$blocks" > "$con"
    (
      k=0
      while :; do
        k=$((k + 1))
        b=$(( (k * 16) % blocks ))
        echo "rdmig-disk $k" | dd of=/dev/vda bs=4096 seek="$b" count=1 conv=notrunc,sync,fsync 2>/dev/null
        dd if=/dev/urandom of=/dev/vda bs=4096 seek=$((b + 1)) count=15 conv=notrunc,fsync 2>/dev/null
        echo "$k" > /run/disk-turn
        sleep "${disk_interval:-0.1}"
      done
    ) &
  else
    echo "rdmig-disk-error no /dev/vda" > "$con"
  fi
fi
if [ "${verify_mib:-0}" != 0 ]; then
  /bin/rdmig-verify "$verify_mib" "${verify_rate:-8}" "$con" &
fi
n=0
while :; do
  if [ "$dirty" != 0 ]; then
    dd if=/dev/urandom of=/run/dirty/buf bs=1M count="$dirty" conv=notrunc 2>/dev/null
  fi
  n=$((n + 1))
  echo "rdmig-counter $n" > "$con"
  [ -f /run/disk-turn ] && echo "rdmig-disk $(cat /run/disk-turn)" > "$con"
  sleep "$interval"
done
EOF
chmod 755 "$stage/init"

( cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner=0:0 --quiet ) \
  | gzip -n -6 > "$out/.initramfs.cpio.gz.tmp"
cp "$vmlinuz" "$out/.vmlinuz.tmp"
mv -f "$out/.vmlinuz.tmp" "$out/vmlinuz"
mv -f "$out/.initramfs.cpio.gz.tmp" "$out/initramfs.cpio.gz"
echo "$stamp" > "$out/.stamp"
echo "$out"
