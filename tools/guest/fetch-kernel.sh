#!/usr/bin/env bash
# Downloads Debian's current amd64 kernel package (the one linux-image-amd64 depends on)
# and unpacks it into a cache folder. Prints the unpacked root on stdout.
#   tools/guest/fetch-kernel.sh [CACHE_DIR]
# CACHE_DIR defaults to $RDMIG_CACHE or ./.cache. Re-runs reuse the unpacked tree.
set -euo pipefail
cache="${1:-${RDMIG_CACHE:-$(pwd)/.cache}}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
if ! command -v apt-get >/dev/null; then echo "fetch-kernel: apt-get not found (Debian 12 expected)" >&2; exit 1; fi
pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')"
if [ -z "$pkg" ]; then
  apt-get update >/dev/null
  pkg="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')"
fi
[ -n "$pkg" ] || { echo "fetch-kernel: cannot resolve linux-image-amd64's kernel package" >&2; exit 1; }
root="$cache/kernel/$pkg"
mkdir -p "$cache/kernel"
exec 9>"$cache/kernel/.lock"
flock 9   # one download at a time: tests run side by side
if [ ! -e "$root/.done" ]; then
  rm -rf "$root"; mkdir -p "$root"
  ( cd "$cache/kernel" && apt-get download "$pkg" >&2 )
  dpkg -x "$cache/kernel/${pkg}"_*.deb "$root"
  rm -f "$cache/kernel/${pkg}"_*.deb
  touch "$root/.done"
fi
echo "$root"
