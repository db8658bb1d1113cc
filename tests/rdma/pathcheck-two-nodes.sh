#!/bin/sh
# Runs in both VMs of run-two-vms.sh: path checks from node a's agent to node b's over
# rxea -> rxeb (test_pathcheck_rdma_two_nodes.py; node a drives, node b serves), with the
# agents' RDMA address on eth0, then on a VLAN (IPv4, IPv6) and a macvlan above it.
#   pathcheck-two-nodes.sh REPO BUILD_DIR
set -u
repo="$1"; build="$2"
. "$repo/tests/rdma/two-node-lib.sh"
upper_netdevs || { post "failed-$RDMIG_NODE"; echo "FAILED: VLAN/macvlan setup"; exit 1; }
iproute2-ip -br addr
# Count (never drop) the RoCE v2 packets that reach this node's IP stack, IPv4 and IPv6.
nft add table inet rdmigcount && nft add chain inet rdmigcount in '{ type filter hook input priority 0; }' &&
  nft add rule inet rdmigcount in udp dport 4791 counter || { post "failed-$RDMIG_NODE"; echo "FAILED: nft"; exit 1; }
export RDMIG_AGENT="$build/agent/rdmig-agent" RDMIG_TOOLS="$repo/tools" PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 "$repo/tests/rdma/test_pathcheck_rdma_two_nodes.py"
