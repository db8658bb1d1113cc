#!/usr/bin/env bash
# Command (2) of the README and what .ci/run calls: installs what the tests need, builds, and
# runs every test (unit, integration with real QEMU, Kubernetes, deployment, Soft-RoCE VM).
#   scripts/test.sh [ctest args, e.g. -L unit]
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scripts/install-deps.sh --test
scripts/build.sh
cd build
# Each suite prints its own failures; --output-on-failure shows them in the log.
ctest --output-on-failure --timeout 1800 "$@"
echo "test.sh: finished in $(( $(date +%s) - start )) s"
