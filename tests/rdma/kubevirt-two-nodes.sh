#!/bin/sh
# Runs in both VMs of run-two-vms.sh: KubeVirt mode's relay between the two nodes
# (test_kubevirt_rdma_two_nodes.py; node a = source, node b = target).
#   kubevirt-two-nodes.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
export RDMIG_AGENT="$build/agent/rdmig-agent" RDMIG_TOOLS="$repo/tools" RDMIG_IP=iproute2-ip PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 -W ignore "$repo/tests/rdma/test_kubevirt_rdma_two_nodes.py" "$repo"
