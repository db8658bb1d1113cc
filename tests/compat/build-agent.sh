#!/usr/bin/env bash
# Builds rdmig-agent as it was at one commit (default: the previous release point, the one line of
# tests/compat/previous-release) into the cache outside the clone, keyed by the commit:
#   $RDMIG_CACHE/compat/<full sha>/rdmig-agent   and   .../stamp
# (RDMIG_CACHE: scripts/cache-env.sh, /var/cache/rdmig as root). Only the agent target, from
# `git archive <sha>` of this clone, at -O1 without debug info
# (RDMIG_COMPAT_CXXFLAGS: a third less compile than RelWithDebInfo, 115 s against 173 s here; the old
# agent's protocol and behaviour do not depend on the optimisation level), with ccache, at nice 19;
# only the binary and the stamp are kept. Idempotent: a built commit is reused by every clone.
# Prints the binary's path on stdout (everything else goes to stderr).
#   tests/compat/build-agent.sh            # the previous release point
#   tests/compat/build-agent.sh <commit>   # any commit of this clone
# A clone without the commit (a shallow one) fails naming the commit and how to fetch it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
source "$repo/scripts/cache-env.sh"
want="${1:-$(grep -v '^#' "$here/previous-release" | head -n1)}"

sha="$(git -C "$repo" rev-parse --verify --quiet "$want^{commit}" || true)"
if [ -z "$sha" ]; then
  shallow="$(git -C "$repo" rev-parse --is-shallow-repository 2>/dev/null || echo unknown)"
  echo "compat: commit $want (the agent of the previous release point, tests/compat/previous-release) is not" \
       "in this clone (shallow: $shallow). Fetch it: git fetch --unshallow origin, or" \
       "git fetch origin $want; then run this again." >&2
  exit 2
fi
out="$RDMIG_CACHE/compat/$sha"
fresh() { [ -x "$out/rdmig-agent" ] && grep -q "^commit $sha\$" "$out/stamp" 2>/dev/null; }
if fresh; then echo "$out/rdmig-agent"; exit 0; fi

# One builder per commit at a time (ctest runs rows side by side); a second one finds it built.
mkdir -p "$RDMIG_CACHE/compat"
exec 9>"$RDMIG_CACHE/compat/.lock-$sha"
flock 9
if fresh; then echo "$out/rdmig-agent"; exit 0; fi

tmp="$(mktemp -d "$RDMIG_CACHE/compat/.build-${sha:0:12}.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
git -C "$repo" archive "$sha" | tar -x -C "$tmp/src"
# Compiled in unity batches as scripts/build.sh compiles today's tree (cold, without ccache: 341
# CPU-seconds against 535 file by file, tests/compat/README.md): this tree's cmake/RdmigUnity.cmake is added to the unpacked one when it has none (the
# sources are the old commit's, untouched); RDMIG_UNITY_SKIP lists its targets whose sources
# clash in one batch (4dbda54: two local join() in rdmig_transport_rdma). RDMIG_UNITY=0: file by file.
unity=()
if [ "${RDMIG_UNITY:-1}" != 0 ]; then
  if ! grep -q RDMIG_UNITY_BUILD "$tmp/src/CMakeLists.txt"; then
    mkdir -p "$tmp/src/cmake"
    cp "$repo/cmake/RdmigUnity.cmake" "$tmp/src/cmake/"
    printf '\nif(RDMIG_UNITY_BUILD)\n  include(cmake/RdmigUnity.cmake)\n  rdmig_unity_build()\nendif()\n' \
      >>"$tmp/src/CMakeLists.txt"
  fi
  unity=(-DRDMIG_UNITY_BUILD=ON "-DRDMIG_UNITY_SKIP=${RDMIG_COMPAT_UNITY_SKIP-rdmig_transport_rdma}")
fi
launcher=""
if [ "${RDMIG_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
  launcher=ccache
  # Paths relative to the unpacked tree, so that objects of the same sources compiled in any
  # clone (or an earlier compat build) hit; scripts/cache-env.sh sets the rest.
  export CCACHE_BASEDIR="$tmp/src"
fi
# ccache's counters before and after (a difference: other builds share the cache, so its stats
# are not zeroed here; a build beside this one adds to the figure).
ccstats() { [ -z "$launcher" ] || ccache --print-stats 2>/dev/null | awk -F'\t' \
  '$1=="direct_cache_hit"||$1=="preprocessed_cache_hit"{h+=$2} $1=="cache_miss"{m=$2} END{print h+0, m+0}'; }
read -r h0 m0 <<<"$(ccstats || true)"
echo "compat: building rdmig-agent at ${sha:0:12} in $tmp (only the agent target, nice 19)" >&2
start=$(date +%s)
# The build directory inside the tree, as scripts/build.sh has it (<clone>/build): the relative paths
# ccache keys on are then those of any clone's build of the same sources. The revision is named, as
# the unpacked tree has no .git (rdmig-agent --version says which commit it is).
nice -n 19 cmake -S "$tmp/src" -B "$tmp/src/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="${RDMIG_COMPAT_CXXFLAGS--O1 -DNDEBUG}" -DRDMIG_BUILD_TESTS=OFF \
  -DRDMIG_REVISION="${sha:0:12}" -DCMAKE_CXX_COMPILER_LAUNCHER="$launcher" "${unity[@]}" >/dev/null
nice -n 19 cmake --build "$tmp/src/build" --target rdmig-agent -j "${RDMIG_BUILD_JOBS:-$(nproc)}" >&2
secs=$(( $(date +%s) - start ))
cache=""
if [ -n "$launcher" ]; then
  read -r h1 m1 <<<"$(ccstats || true)"
  cache="$(( ${h1:-0} - ${h0:-0} )) hits, $(( ${m1:-0} - ${m0:-0} )) misses"
fi
mkdir -p "$out.new.$$"
install -m 0755 "$tmp/src/build/agent/rdmig-agent" "$out.new.$$/rdmig-agent"
{
  echo "commit $sha"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $secs s${cache:+ (ccache: $cache)}${unity:+ (unity batches)}, flags ${RDMIG_COMPAT_CXXFLAGS--O1 -DNDEBUG}"
  echo "subject $(git -C "$repo" log -1 --format=%s "$sha" | cut -c1-120)"
} >"$out.new.$$/stamp"
rm -rf "$out"
mv "$out.new.$$" "$out"
echo "compat: built in $secs s${cache:+; ccache: $cache}; $out" >&2
echo "$out/rdmig-agent"
