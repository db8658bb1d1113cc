#!/usr/bin/env bash
# Downloads Debian's current amd64 kernel package (the one linux-image-amd64 depends on)
# and unpacks it into a cache folder. Prints the unpacked root on stdout.
#   tools/guest/fetch-kernel.sh [--suite SUITE] [CACHE_DIR]
# CACHE_DIR defaults to $RDMIG_CACHE or ./.cache. Re-runs reuse the unpacked tree.
# Without --suite: this host's release, through apt (Debian 12's 6.1 here). With --suite (e.g.
# trixie): that release's kernel straight from the mirror ($RDMIG_DEBIAN_MIRROR, default
# deb.debian.org), no apt source needed: the suite's InRelease is checked against Debian's archive
# keys (gpgv, debian-archive-keyring; $RDMIG_DEBIAN_KEYRING names another keyring), the package
# index against the SHA-256 InRelease gives, the .deb against the SHA-256 the index gives; which
# package is current is looked up at most once a day (the answer is kept in
# CACHE_DIR/kernel/SUITE.current; when the mirror is out of reach, the kernel unpacked last time
# serves). A kernel not used for 14 days is removed.
set -euo pipefail
suite=""
if [ "${1:-}" = "--suite" ]; then suite="${2:?--suite needs a suite name}"; shift 2; fi
cache="${1:-${RDMIG_CACHE:-$(pwd)/.cache}}"
mkdir -p "$cache/kernel"
cache="$(cd "$cache" && pwd)"
exec 9>"$cache/kernel/.lock"
flock 9   # one download at a time: tests run side by side

# Each unpacked kernel (about 450 MB) is stamped when handed out (.used; one unpacked before the
# stamps existed counts from its .done); one not handed out for RDMIG_KERNEL_KEEP_DAYS days
# (default 14: a Debian kernel update replaced it) is removed.
serve() {
  local keep="${RDMIG_KERNEL_KEEP_DAYS:-14}" dir stamp
  [[ "$keep" =~ ^[0-9]+$ ]] || keep=14
  touch "$1/.used"
  for dir in "$cache"/kernel/linux-image-*/; do
    dir="${dir%/}"
    [ "$dir" = "$1" ] && continue
    stamp="$dir/.used"; [ -e "$stamp" ] || stamp="$dir/.done"
    if [ -e "$stamp" ] && [ -n "$(find "$stamp" -mtime +"$keep")" ]; then
      echo "fetch-kernel: removing $dir (not used for $keep days)" >&2
      rm -rf "$dir"
    fi
  done
  echo "$1"
}

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
  serve "$root"
  exit 0
fi

[[ "$suite" =~ ^[a-z][a-z0-9-]*$ ]] || { echo "fetch-kernel: bad suite name '$suite'" >&2; exit 2; }
mirror="${RDMIG_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
current="$cache/kernel/$suite.current"   # "PACKAGE FILENAME SHA256" of the last lookup
keyring="${RDMIG_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}"
# curl with bounds: a mirror that accepts and then stays silent (or crawls under 10 KiB/s for 30 s)
# fails the try instead of holding the row until its ctest timeout; 3 retries.
fetch() { curl -fsS --retry 3 --connect-timeout 20 --speed-limit 10240 --speed-time 30 -o "$1" "$2"; }
cached_root() { [ -s "$current" ] && read -r p _ <"$current" && [ -e "$cache/kernel/$p/.done" ]; }
# The suite's package index, trusted only as far as Debian's signature reaches: InRelease verified
# with gpgv against the archive keyring (one good signature by a key there, none bad: Debian signs
# with several keys, and a keyring older than one of them still knows the others), naming this
# suite, then Packages.xz against the SHA-256 the signed text lists. Prints the index; returns 1
# (naming why on stderr) when it cannot be read or does not verify: the caller falls back to the
# kernel verified last time, if any.
signed_index() {
  local tmp rc=0
  tmp="$(mktemp -d)" || return 1
  signed_index_in "$tmp" || rc=$?
  rm -rf "$tmp"
  return "$rc"
}
signed_index_in() {
  local tmp="$1" rel want
  fetch "$tmp/InRelease" "$mirror/dists/$suite/InRelease" || return 1
  rel="$(gpgv --status-fd 3 --keyring "$keyring" --output - "$tmp/InRelease" 2>"$tmp/gpgv" 3>"$tmp/status")" || true
  if ! grep -q '^\[GNUPG:\] VALIDSIG ' "$tmp/status"; then
    echo "fetch-kernel: $mirror/dists/$suite/InRelease does not verify against $keyring:" >&2
    cat "$tmp/gpgv" >&2; return 1
  fi
  if grep -q '^\[GNUPG:\] BADSIG ' "$tmp/status"; then
    echo "fetch-kernel: $mirror/dists/$suite/InRelease carries a bad signature:" >&2
    cat "$tmp/gpgv" >&2; return 1
  fi
  if ! awk -v s="$suite" '/^$/{exit} ($1 == "Suite:" || $1 == "Codename:") && $2 == s {found=1} END{exit !found}' <<<"$rel"; then
    echo "fetch-kernel: $mirror/dists/$suite/InRelease is signed but names another suite" >&2; return 1
  fi
  want="$(awk '/^SHA256:/{p=1; next} /^[^ ]/{p=0} p && $3 == "main/binary-amd64/Packages.xz" {print $1; exit}' <<<"$rel")"
  [[ "$want" =~ ^[0-9a-f]{64}$ ]] || { echo "fetch-kernel: $suite's InRelease lists no SHA-256 for main/binary-amd64/Packages.xz" >&2; return 1; }
  fetch "$tmp/Packages.xz" "$mirror/dists/$suite/main/binary-amd64/Packages.xz" || return 1
  if [ "$(sha256sum "$tmp/Packages.xz" | cut -d' ' -f1)" != "$want" ]; then
    echo "fetch-kernel: $mirror/dists/$suite/main/binary-amd64/Packages.xz does not match the SHA-256 its signed InRelease gives" >&2; return 1
  fi
  xz -dc "$tmp/Packages.xz"
}
# Looked up again after a day, or when the last lookup is from before checksums were kept.
if [ ! -s "$current" ] || [ -n "$(find "$current" -mmin +1440)" ] || ! awk 'NF == 3 {ok = 1} END {exit !ok}' "$current"; then
  if idx="$(signed_index)" && [ -n "$idx" ]; then
    pkg="$(awk '/^Package: linux-image-amd64$/{p=1} p && /^Depends:/{sub(/^Depends: /, ""); sub(/ .*/, ""); print; exit}' <<<"$idx")"
    [[ "$pkg" =~ ^linux-image-[0-9][a-z0-9.+~-]*$ ]] || { echo "fetch-kernel: $suite's linux-image-amd64 depends on '$pkg'" >&2; exit 1; }
    read -r file sum < <(awk -v want="Package: $pkg" '$0 == want {p=1} p && /^Filename:/{f=$2} p && /^SHA256:/{s=$2} p && /^$/{exit} END{print f, s}' <<<"$idx")
    [ -n "$file" ] && [ -n "$sum" ] || { echo "fetch-kernel: $suite's index has no file or checksum for $pkg" >&2; exit 1; }
    echo "$pkg $file $sum" >"$current.tmp" && mv "$current.tmp" "$current"
  elif cached_root; then
    # The mirror is out of reach or did not verify: the kernel unpacked (and verified) last time
    # serves; looked up again next time.
    echo "fetch-kernel: no verified package index of $suite from $mirror; using the cached $(cut -d' ' -f1 "$current")" >&2
  else
    echo "fetch-kernel: no verified package index of $suite from $mirror" >&2; exit 1
  fi
fi
read -r pkg file sum <"$current"
[[ "$pkg" =~ ^linux-image-[0-9][a-z0-9.+~-]*$ ]] || { echo "fetch-kernel: bad package name '$pkg' in $current" >&2; exit 1; }
root="$cache/kernel/$pkg"
if [ ! -e "$root/.done" ]; then
  rm -rf "$root"; mkdir -p "$root"
  deb="$cache/kernel/$pkg.deb"
  if ! fetch "$deb" "$mirror/$file"; then
    rm -f "$current" "$deb"   # gone from the mirror (a newer kernel replaced it): look it up again next time
    echo "fetch-kernel: cannot download $mirror/$file" >&2; exit 1
  fi
  if [ "$(sha256sum "$deb" | cut -d' ' -f1)" != "$sum" ]; then
    rm -f "$deb"; echo "fetch-kernel: $mirror/$file does not match the SHA-256 its index gives" >&2; exit 1
  fi
  dpkg -x "$deb" "$root"
  rm -f "$deb"
  touch "$root/.done"
fi
serve "$root"
