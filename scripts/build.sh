#!/usr/bin/env bash
# Configures and builds rdmig into ./build (RelWithDebInfo). Extra args go to cmake configure.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${RDMIG_BUILD_JOBS:-$(nproc)}"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build build -j "$jobs"
