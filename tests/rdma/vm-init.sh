#!/bin/sh
# /init of the Soft-RoCE test VM (busybox sh, PID 1). Installed by build-initramfs.sh.
# Sets the VM up (modules, file systems, veth pair va/vb, rxe0 on va), runs
# /etc/rdmig-vm/run (written by run-in-vm.sh), prints "RDMIG-VM-EXIT <code>" and
# powers off. Setup failures end with "RDMIG-VM-EXIT 125".
# With rdmig.node=a or b on the kernel command line (run-two-vms.sh) the VM is one of two
# "nodes" joined by a virtio-net link instead: no veth pair; eth0 gets 10.99.1.1/24 (a) or
# 10.99.1.2/24 (b) and the rxe device rxea or rxeb sits on eth0. With a second NIC (eth1,
# run-two-vms.sh --rails 2) a second rail: eth1 10.99.2.1/24 (a) or 10.99.2.2/24 (b) with
# rxea2 or rxeb2 on it ($RDMIG_RDMA_DEV2, $RDMIG_RDMA_NETDEV2, $RDMIG_VM_ADDR2, $RDMIG_VM_PEER_ADDR2).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TMPDIR=/tmp LANG=C.UTF-8
export LD_LIBRARY_PATH=/usr/local/lib:/usr/lib/x86_64-linux-gnu
export RDMIG_VM=1 RDMIG_RDMA_DEV=rxe0 RDMIG_RDMA_NETDEV=va
export RDMIG_VM_ADDR=10.99.0.1 RDMIG_VM_PEER_ADDR=10.99.0.2

finish() {
  code=$1
  sync
  [ -n "${RDMIG_OUT:-}" ] && umount "$RDMIG_OUT" 2>/dev/null
  printf '\nRDMIG-VM-EXIT %s\n' "$code"
  poweroff -f
  sleep 5; echo o >/proc/sysrq-trigger   # should not get here
}
fail() { echo "rdmig-vm: setup failed: $*"; finish 125; }
mount -t proc proc /proc || fail "mount /proc"
t0=$(cut -d' ' -f1 /proc/uptime)
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
# The root is the initramfs' tmpfs (files added at /tmp/... must stay visible, so no
# separate /tmp); let it grow to 90% of the memory instead of the default 50%.
mount -o remount,size=90% / || fail "remount / with size=90%"
mount -t tmpfs -o mode=0755 tmpfs /run
hostname rdmig-vm
ulimit -l unlimited 2>/dev/null  # busybox ash has -l and -c  # shellcheck disable=SC3045
ulimit -c 0 2>/dev/null

while read -r ko; do
  insmod "$ko" || fail "insmod $ko"
done </etc/rdmig-vm/modules
mount -t configfs configfs /sys/kernel/config 2>/dev/null

node=""
for arg in $(cat /proc/cmdline); do
  case "$arg" in rdmig.node=a|rdmig.node=b) node="${arg#rdmig.node=}" ;; esac
done
ip=/usr/sbin/iproute2-ip
$ip link set lo up || fail "lo up"
if [ -z "$node" ]; then
  $ip link add va type veth peer name vb || fail "veth pair"
  $ip addr add 10.99.0.1/24 dev va && $ip addr add 10.99.0.2/24 dev vb || fail "veth addresses"
  $ip link set va up && $ip link set vb up || fail "veth up"
  rdma link add rxe0 type rxe netdev va || fail "rdma link add rxe0 type rxe netdev va"
  setup="rxe0 on va 10.99.0.1/24, vb 10.99.0.2/24"
else
  if [ "$node" = a ]; then RDMIG_VM_ADDR=10.99.1.1 RDMIG_VM_PEER_ADDR=10.99.1.2
  else RDMIG_VM_ADDR=10.99.1.2 RDMIG_VM_PEER_ADDR=10.99.1.1; fi
  export RDMIG_NODE="$node" RDMIG_RDMA_DEV="rxe$node" RDMIG_RDMA_NETDEV=eth0 RDMIG_VM_ADDR RDMIG_VM_PEER_ADDR
  hostname "rdmig-vm-$node"
  [ -e /sys/class/net/eth0 ] || fail "node $node: no eth0 (no virtio-net device?)"
  $ip addr add "$RDMIG_VM_ADDR/24" dev eth0 && $ip link set eth0 up || fail "eth0 address/up"
  rdma link add "$RDMIG_RDMA_DEV" type rxe netdev eth0 || fail "rdma link add $RDMIG_RDMA_DEV type rxe netdev eth0"
  setup="node $node: $RDMIG_RDMA_DEV on eth0 $RDMIG_VM_ADDR/24, peer $RDMIG_VM_PEER_ADDR"
  if [ -e /sys/class/net/eth1 ]; then
    if [ "$node" = a ]; then RDMIG_VM_ADDR2=10.99.2.1 RDMIG_VM_PEER_ADDR2=10.99.2.2
    else RDMIG_VM_ADDR2=10.99.2.2 RDMIG_VM_PEER_ADDR2=10.99.2.1; fi
    export RDMIG_RDMA_DEV2="rxe${node}2" RDMIG_RDMA_NETDEV2=eth1 RDMIG_VM_ADDR2 RDMIG_VM_PEER_ADDR2
    $ip addr add "$RDMIG_VM_ADDR2/24" dev eth1 && $ip link set eth1 up || fail "eth1 address/up"
    rdma link add "$RDMIG_RDMA_DEV2" type rxe netdev eth1 || fail "rdma link add $RDMIG_RDMA_DEV2 type rxe netdev eth1"
    setup="$setup; $RDMIG_RDMA_DEV2 on eth1 $RDMIG_VM_ADDR2/24, peer $RDMIG_VM_PEER_ADDR2"
  fi
fi
# Two nodes: wait until the peer answers on each link (it may boot later), so each node's
# neighbour entry for the other exists before the first RDMA connect, as between nodes of a
# cluster that have talked before. Without it, a first rdma_cm connect right after boot has
# timed out in address resolution (no rdma_cm event in 10 s, no RoCE packet sent) in one full run.
if [ -n "$node" ]; then
  for peer in "$RDMIG_VM_PEER_ADDR" ${RDMIG_VM_PEER_ADDR2:-}; do
    t0=$(date +%s)
    until ping -c 1 -W 1 "$peer" >/dev/null 2>&1; do
      [ $(( $(date +%s) - t0 )) -lt 120 ] || { echo "rdmig-vm: node $node: $peer does not answer ping"; break; }
    done
    echo "rdmig-vm: node $node: $peer answered after $(( $(date +%s) - t0 )) s"
  done
fi
# Wait for the device to show up (sysfs and /dev/infiniband), with a deadline.
i=0
until [ -e "/sys/class/infiniband/$RDMIG_RDMA_DEV" ] && [ -e /dev/infiniband/uverbs0 ] &&
      { [ -z "${RDMIG_RDMA_DEV2:-}" ] || [ -e "/sys/class/infiniband/$RDMIG_RDMA_DEV2" ]; }; do
  i=$((i + 1)); [ $i -le 100 ] || fail "$RDMIG_RDMA_DEV or /dev/infiniband/uverbs0 did not appear"
  sleep 0.1
done

for arg in $(cat /proc/cmdline); do
  case "$arg" in
    rdmig.share=*)
      mkdir -p /out
      mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "${arg#rdmig.share=}" /out ||
        fail "mount of the shared folder (9p tag ${arg#rdmig.share=}) on /out"
      export RDMIG_OUT=/out ;;
  esac
done
if [ -e /etc/rdmig-vm/with-qemu ]; then export QEMU_MODULE_DIR=/usr/lib/x86_64-linux-gnu/qemu; fi

t1=$(cut -d' ' -f1 /proc/uptime)
echo "rdmig-vm: ready after ${t1}s of uptime (setup ${t0:-?}s..${t1}s): $setup${RDMIG_OUT:+, shared folder on /out}"
[ -e /etc/rdmig-vm/run ] || fail "no /etc/rdmig-vm/run (build the VM with run-in-vm.sh)"
cd /tmp || fail "cd /tmp"
/bin/sh /etc/rdmig-vm/run </dev/null
code=$?
echo "rdmig-vm: script exited with $code after $(cut -d' ' -f1 /proc/uptime)s of uptime"
finish $code
