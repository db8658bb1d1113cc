#!/bin/sh
# Runs inside the Soft-RoCE VM: KubeVirt mode's relay test (tests/kubevirt/test_kubevirt_relay.py)
# with the agents on transport rdma over rxe0: network namespaces, nftables redirects, the gRPC
# node hook, and every intercepted connection carried as one RDMA channel.
#   kubevirt-tests.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
export RDMIG_AGENT="$build/agent/rdmig-agent" RDMIG_KV_TRANSPORT=rdma RDMIG_IP=iproute2-ip PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 -W ignore "$repo/tests/kubevirt/test_kubevirt_relay.py" -v
