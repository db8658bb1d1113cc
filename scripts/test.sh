#!/usr/bin/env bash
# Command (2) of the README and what .ci/run calls: installs what the tests need, builds, and
# runs every test (unit, integration with real QEMU, Kubernetes, deployment, Soft-RoCE VM).
#   scripts/test.sh [ctest args, e.g. -L unit]
#   scripts/test.sh --quick [ctest args]   the unit tests, one real-QEMU migration through two agents
#                                          and one KubeVirt carry: a few minutes (tests/CMakeLists.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
select=(-LE quick-only)   # the full run: every test but the quick set's repeats
if [ "${1:-}" = "--quick" ]; then
  shift
  select=(-L '^(unit|k8s-unit|quick)$')   # labels: tests/CMakeLists.txt
fi
source scripts/cache-env.sh   # caches outside the clone (/var/cache/rdmig), shared by every run
scripts/install-deps.sh --test
scripts/build.sh
cd build
# Each suite prints its own failures; --output-on-failure shows them in the log.
rc=0
# One test per core: tests that keep the CPU busy hold a lock and never overlap (tests/CMakeLists.txt).
ctest --output-on-failure --timeout 1800 -j "${RDMIG_TEST_JOBS:-$(nproc)}" "${select[@]}" "$@" || rc=$?
if [ "$rc" -ne 0 ]; then
  # The why of each failure, last in the log (a CI log is often read from its tail).
  python3 ../scripts/failure-digest.py Testing/Temporary/LastTest.log || true
fi
echo "test.sh: finished in $(( $(date +%s) - start )) s"
exit "$rc"
