#!/bin/sh
# Runs in both VMs of run-two-vms.sh (ctest rdma_two_node_transport_pathcheck) the two suites that
# need two nodes with one link and one rxe device each, one after the other, so that the two VMs
# boot once for both:
#   1. transport-two-nodes.sh: rdmig's RDMA transport between the nodes (GIDs, streams with
#      digests and hw counters, the traffic class on the wire, a killed server);
#   2. pathcheck-two-nodes.sh: path checks from node a's agent to node b's on eth0, a VLAN (IPv4,
#      IPv6), a macvlan, RoCE v2 dropped mid-check, Multus mode.
# The second runs even when the first failed on this node (its rendezvous then sees the peer's
# "failed-" mark and ends early); the exit status is 0 only when both passed here.
#   two-node-tests.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
here="$repo/tests/rdma"
. "$here/suites-lib.sh"
run transport /bin/sh "$here/transport-two-nodes.sh" "$build"
run pathcheck /bin/sh "$here/pathcheck-two-nodes.sh" "$repo" "$build"
finish two-node-tests
