#!/usr/bin/env bash
# Downloads Debian's current amd64 kernel package (the one linux-image-amd64 depends on)
# and unpacks it into a cache folder. Prints the unpacked root on stdout.
#   tools/guest/fetch-kernel.sh [--suite SUITE] [CACHE_DIR]
# CACHE_DIR defaults to $RDMIG_CACHE or ./.cache. Re-runs reuse the unpacked tree.
# Without --suite: this host's release, through apt (Debian 12's 6.1 here). With --suite (e.g.
# trixie): that release's kernel straight from the mirror ($RDMIG_DEBIAN_MIRROR, default
# deb.debian.org), no apt source needed; which package is current is looked up at most once a
# day (the answer is kept in CACHE_DIR/kernel/SUITE.current).
set -euo pipefail
suite=""
if [ "${1:-}" = "--suite" ]; then suite="${2:?--suite needs a suite name}"; shift 2; fi
cache="${1:-${RDMIG_CACHE:-$(pwd)/.cache}}"
mkdir -p "$cache/kernel"
cache="$(cd "$cache" && pwd)"
exec 9>"$cache/kernel/.lock"
flock 9   # one download at a time: tests run side by side

if [ -z "$suite" ]; then
  if ! command -v apt-get >/dev/null; then echo "fetch-kernel: apt-get not found (Debian 12 expected)" >&2; exit 1; fi
  pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')"
  if [ -z "$pkg" ]; then
    apt-get update >/dev/null
    pkg="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')"
  fi
  [ -n "$pkg" ] || { echo "fetch-kernel: cannot resolve linux-image-amd64's kernel package" >&2; exit 1; }
  root="$cache/kernel/$pkg"
  if [ ! -e "$root/.done" ]; then
    rm -rf "$root"; mkdir -p "$root"
    ( cd "$cache/kernel" && apt-get download "$pkg" >&2 )
    dpkg -x "$cache/kernel/${pkg}"_*.deb "$root"
    rm -f "$cache/kernel/${pkg}"_*.deb
    touch "$root/.done"
  fi
  echo "$root"
  exit 0
fi

[[ "$suite" =~ ^[a-z][a-z0-9-]*$ ]] || { echo "fetch-kernel: bad suite name '$suite'" >&2; exit 2; }
mirror="${RDMIG_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
current="$cache/kernel/$suite.current"   # "PACKAGE FILENAME" of the last lookup
if [ ! -s "$current" ] || [ -n "$(find "$current" -mmin +1440)" ]; then
  idx="$(curl -fsS --retry 3 "$mirror/dists/$suite/main/binary-amd64/Packages.xz" | xz -dc)" ||
    { echo "fetch-kernel: cannot read $suite's package index from $mirror" >&2; exit 1; }
  pkg="$(awk '/^Package: linux-image-amd64$/{p=1} p && /^Depends:/{sub(/^Depends: /, ""); sub(/ .*/, ""); print; exit}' <<<"$idx")"
  [ -n "$pkg" ] || { echo "fetch-kernel: $suite has no linux-image-amd64" >&2; exit 1; }
  file="$(awk -v want="Package: $pkg" '$0 == want {p=1} p && /^Filename:/{print $2; exit}' <<<"$idx")"
  [ -n "$file" ] || { echo "fetch-kernel: $suite's index has no file for $pkg" >&2; exit 1; }
  echo "$pkg $file" >"$current.tmp" && mv "$current.tmp" "$current"
fi
read -r pkg file <"$current"
root="$cache/kernel/$pkg"
if [ ! -e "$root/.done" ]; then
  rm -rf "$root"; mkdir -p "$root"
  curl -fsS --retry 3 -o "$cache/kernel/$pkg.deb" "$mirror/$file" ||
    { echo "fetch-kernel: cannot download $mirror/$file" >&2; exit 1; }
  dpkg -x "$cache/kernel/$pkg.deb" "$root"
  rm -f "$cache/kernel/$pkg.deb"
  touch "$root/.done"
fi
echo "$root"
