#!/bin/sh
# Runs inside the Soft-RoCE VM: the agent migration test over rxe0 (test_agent_rdma.py).
#   agent-tests.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
export RDMIG_AGENT="$build/agent/rdmig-agent" RDMIG_TOOLS="$repo/tools" PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 "$repo/tests/rdma/test_agent_rdma.py"
