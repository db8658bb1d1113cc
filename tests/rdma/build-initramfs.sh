#!/usr/bin/env bash
# Builds the initramfs of the Soft-RoCE test VM from Debian's packages.
#
#   tests/rdma/build-initramfs.sh OUT_DIR [--add PATH]... [--with-qemu] [--gzip] [--only-adds]
#
# OUT_DIR receives:
#   initramfs.cpio (or initramfs.cpio.gz with --gzip)  cpio newc archive, /init inside
#   vmlinuz                                            the matching Debian kernel
#   modules.txt                                        modules the init inserts, in order
# and the archive's path is printed on stdout (progress goes to stderr).
#
# Contents: busybox-static (applets in /usr/bin, /usr/sbin), bash, the Debian
# kernel's modules for Soft-RoCE (and virtio/9p for sharing a host folder, virtio-net
# for the two-VM runs, 8021q and macvlan for their VLAN/macvlan cases),
# rdma-core's libraries with the rxe provider, ibverbs-utils, rdmacm-utils (rping),
# perftest, iproute2's `rdma` and `ip` (installed as /usr/sbin/iproute2-ip:
# busybox's sh runs its own `ip` applet even when /usr/sbin/ip is called by path),
# socat, and:
#   --add FILE   copied to the same absolute path (and linked into /usr/local/bin
#                when executable), with the shared libraries ldd reports for it;
#   --add DIR    copied as is to the same absolute path (e.g. a build tree), plus the
#                libraries of every ELF file in it;
#   --with-qemu  qemu-system-x86_64, its modules (/usr/lib/x86_64-linux-gnu/qemu),
#                firmware (/usr/share/qemu, /usr/share/seabios, /usr/lib/ipxe/qemu),
#                and their libraries, for nested guests.
#   --only-adds  an overlay: only the --add paths and their libraries (no base, no /init,
#                no kernel); appended to a cached base archive (the kernel unpacks every
#                archive of a concatenation, later entries replacing earlier ones), so the
#                project's own files never invalidate the base (run-in-vm.sh).
# Environment: RDMIG_CACHE (kernel download cache, default <repo>/.cache),
# RDMIG_KERNEL_ROOT (an already unpacked kernel package root; skips fetch-kernel.sh).
# Missing Debian packages are installed with apt-get (root needed for that only).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
die() { echo "build-initramfs: $*" >&2; exit 1; }
log() { echo "build-initramfs: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

out="" adds=() with_qemu=0 compress=0 only_adds=0
while [ $# -gt 0 ]; do
  case "$1" in
    --add) [ $# -ge 2 ] || die "--add needs a path"; adds+=("$2"); shift 2 ;;
    --add=*) adds+=("${1#--add=}"); shift ;;
    --with-qemu) with_qemu=1; shift ;;
    --gzip) compress=1; shift ;;
    --only-adds) only_adds=1; shift ;;
    -h|--help) usage ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$out" ] || die "more than one OUT_DIR given ($out, $1)"; out="$1"; shift ;;
  esac
done
[ -n "$out" ] || usage

# --- host packages --------------------------------------------------------------
if [ "$only_adds" = 0 ]; then
# command-or-file -> Debian package providing it
need=(
  /usr/bin/busybox:busybox-static
  /usr/bin/bash:bash
  /usr/bin/cpio:cpio
  /usr/lib/x86_64-linux-gnu/libibverbs.so.1:libibverbs1
  /usr/lib/x86_64-linux-gnu/librdmacm.so.1:librdmacm1
  /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so:ibverbs-providers
  /etc/libibverbs.d/rxe.driver:ibverbs-providers
  /usr/bin/ibv_devinfo:ibverbs-utils
  /usr/bin/rping:rdmacm-utils
  /usr/bin/ib_write_bw:perftest
  /usr/bin/rdma:iproute2
  /usr/sbin/ip:iproute2
  /usr/bin/socat:socat
)
[ "$with_qemu" = 1 ] && need+=(/usr/bin/qemu-system-x86_64:qemu-system-x86 /usr/share/seabios/bios.bin:seabios)
missing=()
for n in "${need[@]}"; do [ -e "${n%%:*}" ] || missing+=("${n##*:}"); done
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  log "installing missing Debian packages: ${missing[*]}"
  [ "$(id -u)" = 0 ] || die "need root to apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >&2 ||
    { apt-get update >&2 && apt-get install -y --no-install-recommends "${missing[@]}" >&2; } ||
    die "apt-get install ${missing[*]} failed"
fi
command -v ldd >/dev/null || die "ldd not found (package libc-bin)"

# --- kernel -----------------------------------------------------------------------
if [ -n "${RDMIG_KERNEL_ROOT:-}" ]; then
  kroot="$RDMIG_KERNEL_ROOT"
else
  kroot="$("$repo/tools/guest/fetch-kernel.sh" "${RDMIG_CACHE:-$repo/.cache}")" ||
    die "tools/guest/fetch-kernel.sh failed"
fi
vmlinuz="$(ls "$kroot"/boot/vmlinuz-* 2>/dev/null | head -n1)"
[ -n "$vmlinuz" ] || die "no boot/vmlinuz-* under $kroot"
kver="${vmlinuz##*/vmlinuz-}"
moddir="$kroot/lib/modules/$kver/kernel"
[ -d "$moddir" ] || moddir="$kroot/usr/lib/modules/$kver/kernel"   # Debian 13's package: usr-merged
[ -d "$moddir" ] || die "no $moddir"

# The modules wanted; each is inserted after the ones it depends on (its modinfo "depends=",
# followed here), and one built into the kernel is skipped (Debian 13's 6.12 has virtio and ctr
# built in, and fscache inside netfs). crc32_generic is not a declared dependency of rdma_rxe, but
# without it adding an rxe link fails.
modules=(crc32_generic configfs ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe
         iw_cm ib_cm rdma_cm rdma_ucm veth
         virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
         failover net_failover virtio_net
         netfs 9pnet 9pnet_virtio 9p
         nfnetlink crc32c_generic libcrc32c nf_defrag_ipv4 nf_defrag_ipv6 nf_conntrack nf_nat
         nf_tables nft_chain_nat nft_redir
         llc stp garp mrp 8021q macvlan
         gf128mul ghash-generic ctr gcm tls)
# tls: kernel TLS, the data plane's TLS records handed to the kernel; it asks the crypto API for
# gcm(aes), whose template and hash are modules too (AES itself is built in), and this VM has no
# modprobe to load them on demand: without them kTLS's setsockopt fails and OpenSSL stays in user space.

fi

# --- staging tree -----------------------------------------------------------------
mkdir -p "$out"
out="$(cd "$out" && pwd)"
stage="$out/root"
rm -rf "$stage"
mkdir -p "$stage"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,usr/local/bin,etc/rdmig-vm,proc,sys,dev,tmp,run,root,out,mnt,var/tmp}
# Debian 12 is usr-merged; keep the same layout so host paths stay valid.
ln -s usr/bin "$stage/bin"; ln -s usr/sbin "$stage/sbin"
ln -s usr/lib "$stage/lib"; ln -s usr/lib64 "$stage/lib64"
chmod 1777 "$stage/tmp" "$stage/var/tmp"

declare -A copied=()
# copy_file SRC [DEST]: SRC (symlinks followed) to DEST (default: same path) in the tree.
copy_file() {
  local src="$1" dest="${2:-$1}"
  [ -n "${copied[$dest]:-}" ] && return 0
  [ -e "$src" ] || die "missing $src"
  mkdir -p "$stage$(dirname "$dest")"
  cp -L --preserve=mode "$src" "$stage$dest"
  copied[$dest]=1
}
is_elf() { [ -f "$1" ] && [ "$(head -c4 "$1" 2>/dev/null | od -An -c | tr -d ' ')" = '177ELF' ]; }
# copy_libs FILE: the shared libraries FILE needs (as ldd resolves them on this host).
copy_libs() {
  local lib
  is_elf "$1" || return 0
  while read -r lib; do
    [ -n "$lib" ] && copy_file "$lib"
  done < <(ldd "$1" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
  if ldd "$1" 2>/dev/null | grep -q 'not found'; then
    log "warning: $1 has unresolved libraries: $(ldd "$1" | awk '/not found/{print $1}' | tr '\n' ' ')"
  fi
}
copy_bin() { copy_file "$1" "${2:-$1}"; copy_libs "$1"; }

if [ "$only_adds" = 0 ]; then
# busybox applets first, so real tools copied afterwards replace the links.
cp /usr/bin/busybox "$stage/usr/bin/busybox"
for applet in $(/usr/bin/busybox --list-full); do
  [ -e "$stage/$applet" ] || [ -L "$stage/$applet" ] || ln -s /usr/bin/busybox "$stage/$applet"
done

for b in /usr/bin/bash /usr/bin/ibv_devices /usr/bin/ibv_devinfo /usr/bin/rping \
         /usr/bin/ib_write_bw /usr/bin/ib_read_bw /usr/bin/ib_send_bw /usr/bin/ib_write_lat \
         /usr/bin/rdma /usr/bin/socat; do
  [ -e "$b" ] || die "missing $b"
  rm -f "$stage$b"; copy_bin "$b"
done
copy_bin /usr/sbin/ip /usr/sbin/iproute2-ip
rm -f "$stage/usr/sbin/ip"; copy_bin /usr/sbin/ip   # for bash scripts; busybox sh runs its applet
# rdma-core: verbs, rdma_cm, the rxe provider and its driver file.
# glibc dlopens libgcc_s for pthread_exit and cancellation (rping aborts without it).
copy_bin /usr/lib/x86_64-linux-gnu/libgcc_s.so.1
copy_bin /usr/lib/x86_64-linux-gnu/libibverbs.so.1
copy_bin /usr/lib/x86_64-linux-gnu/librdmacm.so.1
copy_bin /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so
copy_file /etc/libibverbs.d/rxe.driver
[ -d /usr/share/perftest ] && { mkdir -p "$stage/usr/share"; cp -a /usr/share/perftest "$stage/usr/share/"; }

# Kernel modules at their usual paths, as plain .ko (busybox's insmod reads no compressed module;
# Debian 12's package ships plain ones, Debian 13's .ko.xz), in dependency order.
modbase="$(dirname "$moddir")"
declare -A mod_seen=()
mod_find() { find "$moddir" \( -name "$1.ko" -o -name "$1.ko.xz" -o -name "$1.ko.zst" \) | head -n1; }
mod_cat() { case "$1" in *.xz) xz -dc "$1" ;; *.zst) zstd -dc "$1" ;; *) cat "$1" ;; esac; }
mod_builtin() { grep -q -e "/$1.ko\$" -e "/${1//_/-}.ko\$" -e "/${1//-/_}.ko\$" "$modbase/modules.builtin" 2>/dev/null; }
add_module() {
  local m="$1" ko dep rel
  [ -n "${mod_seen[${m//-/_}]:-}" ] && return 0   # modinfo writes ghash_generic, the file ghash-generic
  mod_seen[${m//-/_}]=1
  mod_builtin "$m" && return 0
  ko="$(mod_find "$m")"; [ -n "$ko" ] || ko="$(mod_find "${m//_/-}")"; [ -n "$ko" ] || ko="$(mod_find "${m//-/_}")"
  [ -n "$ko" ] || die "module $m is neither built into $kver nor under $moddir"
  for dep in $(mod_cat "$ko" | tr '\0' '\n' | sed -n 's/^depends=//p' | head -n1 | tr ',' ' '); do
    add_module "$dep"
  done
  rel="/lib/modules/$kver/kernel/${ko#"$moddir"/}"
  rel="${rel%.xz}"; rel="${rel%.zst}"
  mkdir -p "$stage/usr$(dirname "$rel")"
  mod_cat "$ko" >"$stage/usr$rel"
  copied["/usr$rel"]=1
  echo "/usr$rel" >>"$out/modules.txt"
}
: >"$out/modules.txt"
for m in "${modules[@]}"; do add_module "$m"; done
cp "$out/modules.txt" "$stage/etc/rdmig-vm/modules"

# Minimal /etc.
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$stage/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$stage/etc/group"
printf '127.0.0.1 localhost\n::1 localhost\n10.99.0.1 rdmig-vm va\n10.99.0.2 vb\n' >"$stage/etc/hosts"
printf 'passwd: files\ngroup: files\nhosts: files\n' >"$stage/etc/nsswitch.conf"
echo rdmig-vm >"$stage/etc/hostname"

# Nested QEMU.
if [ "$with_qemu" = 1 ]; then
  copy_bin /usr/bin/qemu-system-x86_64
  [ -x /usr/bin/qemu-img ] && copy_bin /usr/bin/qemu-img
  for so in /usr/lib/x86_64-linux-gnu/qemu/*.so; do copy_bin "$so"; done
  for d in /usr/share/qemu /usr/share/seabios /usr/lib/ipxe/qemu; do
    [ -d "$d" ] || continue
    mkdir -p "$stage$(dirname "$d")"; cp -a "$d" "$stage$(dirname "$d")/"
  done
  echo 1 >"$stage/etc/rdmig-vm/with-qemu"
fi

fi

# --add paths, at their absolute host paths.
for p in ${adds[@]+"${adds[@]}"}; do
  [ -e "$p" ] || die "--add $p: no such file or directory"
  abs="$(realpath -s "$p")"
  if [ -d "$p" ]; then
    mkdir -p "$stage$abs"
    cp -a "$abs/." "$stage$abs/"
    n=0
    while IFS= read -r -d '' f; do
      if is_elf "$f"; then copy_libs "$f"; n=$((n + 1)); fi
    done < <(find "$abs" -type f \( -perm -u+x -o -name '*.so' -o -name '*.so.*' \) -print0)
    log "added directory $abs ($(du -sh "$abs" | cut -f1), $n ELF files)"
  else
    rm -f "$stage$abs"; copy_bin "$abs"
    [ -x "$abs" ] && ln -sf "$abs" "$stage/usr/local/bin/$(basename "$abs")"
  fi
done

if [ "$only_adds" = 0 ]; then
  install -m 0755 "$here/vm-init.sh" "$stage/init"
  echo "$kver" >"$stage/etc/rdmig-vm/kernel"
fi

# --- archive ----------------------------------------------------------------------
[ "$only_adds" = 1 ] || cp "$vmlinuz" "$out/vmlinuz"
rm -f "$out/initramfs.cpio" "$out/initramfs.cpio.gz"
if [ "$compress" = 1 ]; then
  archive="$out/initramfs.cpio.gz"
  (cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet | gzip -1) >"$archive.tmp"
else
  archive="$out/initramfs.cpio"
  (cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) >"$archive.tmp"
fi
mv "$archive.tmp" "$archive"
rm -rf "$stage"
log "$archive: $(du -h "$archive" | cut -f1)$([ "$only_adds" = 1 ] && echo " (overlay)" || echo " (kernel $kver)")"
echo "$archive"
