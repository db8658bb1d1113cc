#!/bin/sh
# Runs inside one Soft-RoCE VM (ctest rdma_single_node) the four suites that need one rxe device,
# one after another, so that the VM boots once for all four:
#   1. smoke.sh: ibv_devinfo, ib_write_bw on rxe0, ib_write_bw -R and rping through rdma_cm;
#   2. transport-tests.sh: the RDMA unit tests on the real device, rdmig-stream against ib_write_bw;
#   3. pathcheck-tests.sh: path checks between two real agents over rxe0 and against a broken one;
#   4. kubevirt-tests.sh: KubeVirt mode's relay test with every connection carried over rxe0.
# Each runs even when one before it failed; the exit status is 0 only when all four passed, and
# the last line names the ones that failed.
#   single-node-tests.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
here="$repo/tests/rdma"
. "$here/suites-lib.sh"
run smoke /bin/sh "$here/smoke.sh"
run transport /bin/sh "$here/transport-tests.sh" "$build"
run pathcheck /bin/sh "$here/pathcheck-tests.sh" "$repo" "$build"
run kubevirt /bin/sh "$here/kubevirt-tests.sh" "$repo" "$build"
finish single-node-tests
