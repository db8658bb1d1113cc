#!/bin/sh
# Runs inside the Soft-RoCE VM: path checks between two real agents over rxe0 (each agent its
# own rdma_cm port on the one device), and against an agent whose RDMA is broken
# (tests/integration/test_agent_pathcheck.py, class PathCheckRdmaTest).
#   pathcheck-tests.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
export RDMIG_AGENT="$build/agent/rdmig-agent" RDMIG_PATHCHECK_TRANSPORT=rdma PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 -W ignore "$repo/tests/integration/test_agent_pathcheck.py" -v PathCheckRdmaTest
