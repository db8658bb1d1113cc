#!/bin/sh
# Runs in both VMs of run-two-vms.sh --rails 2 (ctest rdma_two_node_rails) the two suites that need
# two nodes with two rails each, one after the other, so that the two VMs boot once for both:
#   1. agent: test_agent_rdma_two_nodes.py, migrations of real QEMU guests from node a's agent to
#      node b's (agent-tests.sh);
#   2. kubevirt: test_kubevirt_rdma_two_nodes.py, KubeVirt mode's relay between the nodes
#      (kubevirt-two-nodes.sh).
# Their rendezvous names differ (kv- for the second); each suite leaves the nodes as it found them
# (rails up, nftables tables gone). The second runs even when the first failed on this node (its
# rendezvous then sees the peer's "failed-" mark and ends early); the exit status is 0 only when
# both passed here.
#   two-node-rails-tests.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
here="$repo/tests/rdma"
. "$here/suites-lib.sh"
run agent /bin/sh "$here/agent-tests.sh" "$repo" "$build"
run kubevirt /bin/sh "$here/kubevirt-two-nodes.sh" "$repo" "$build"
finish two-node-rails-tests
