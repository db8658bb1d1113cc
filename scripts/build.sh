#!/usr/bin/env bash
# Configures and builds rdmig into ./build (RelWithDebInfo). Extra args go to cmake configure.
# Uses ccache when it is installed (scripts/install-deps.sh installs it; cache in
# $RDMIG_CACHE/ccache, scripts/cache-env.sh); RDMIG_CCACHE=0 builds without it.
# Compiles in unity batches (cmake/RdmigUnity.cmake: fewer CPU-seconds for a first build, e.g. 341
# against 535 for the previous release's agent, tests/compat/README.md);
# RDMIG_UNITY=0 compiles file by file (quicker rebuilds while editing one file).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache-env.sh
jobs="${RDMIG_BUILD_JOBS:-$(nproc)}"
ccache=0
if [ "${RDMIG_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then ccache=1; fi
launcher="$([ "$ccache" = 1 ] && echo ccache || true)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER_LAUNCHER="$launcher" \
  -DRDMIG_UNITY_BUILD="$([ "${RDMIG_UNITY:-1}" = 0 ] && echo OFF || echo ON)" "$@" >/dev/null
[ "$ccache" = 0 ] || ccache --zero-stats >/dev/null 2>&1 || true
start=$(date +%s)
cmake --build build -j "$jobs"
if [ "$ccache" = 1 ]; then
  echo "build: $(( $(date +%s) - start )) s; ccache: $(ccache --print-stats 2>/dev/null |
    awk -F'\t' '$1=="direct_cache_hit"||$1=="preprocessed_cache_hit"{h+=$2} $1=="cache_miss"{m=$2} END{printf "%d hits, %d misses", h, m}')"
fi
