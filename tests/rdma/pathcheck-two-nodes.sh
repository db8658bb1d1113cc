#!/bin/sh
# Runs in both VMs of run-two-vms.sh: a path check from node a's agent to node b's over
# rxea -> rxeb (test_pathcheck_rdma_two_nodes.py; node a drives, node b serves).
#   pathcheck-two-nodes.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
export RDMIG_AGENT="$build/agent/rdmig-agent" RDMIG_TOOLS="$repo/tools" PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 "$repo/tests/rdma/test_pathcheck_rdma_two_nodes.py"
