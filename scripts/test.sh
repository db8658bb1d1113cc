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
rc=0
ctest --output-on-failure --timeout 1800 "$@" || rc=$?
if [ "$rc" -ne 0 ]; then
  # The why of each failure, last in the log (a CI log is often read from its tail).
  python3 ../scripts/failure-digest.py Testing/Temporary/LastTest.log || true
fi
echo "test.sh: finished in $(( $(date +%s) - start )) s"
exit "$rc"
