#!/bin/sh
# Runs in both VMs of run-two-vms.sh: the two-node agent migration test
# (test_agent_rdma_two_nodes.py; node a = source, node b = target).
#   agent-tests.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
export RDMIG_AGENT="$build/agent/rdmig-agent" RDMIG_TOOLS="$repo/tools" PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 "$repo/tests/rdma/test_agent_rdma_two_nodes.py"
