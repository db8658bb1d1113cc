# Sourced (POSIX sh) by the scripts that run-two-vms.sh runs in node a and node b.
# The two nodes meet through the shared folder $RDMIG_OUT/rdv (9p, no caching: a file
# one node writes is seen by the other on its next read).
#   post NAME [VALUE]       publish NAME (written to a temporary name, then renamed)
#   await NAME [SECONDS]    wait for NAME (default 300 s), print its value; fails (status 1)
#                           on time-out or when the peer published "failed"
#   counter NAME            this node's rxe port counter (hw_counters/NAME: sent_pkts, rcvd_pkts)
#   gid                     this node's RoCE v2 GID of its own IPv4 address
#   upper_netdevs           what a RoCE node's interfaces look like above the port: VLAN 100 on
#                           eth0 (eth0.100: 10.100.0.N/24, fd00:100::N/64) and a macvlan over it
#                           (mv100: 10.101.0.N/24), N = 1 on node a, 2 on node b; waits until
#                           rxe's GID table has their RoCE v2 entries (IPv6 without DAD: nodad)
: "${RDMIG_NODE:?not in a two-node VM (run-two-vms.sh)}" "${RDMIG_OUT:?no shared folder}"
RDV="$RDMIG_OUT/rdv"
mkdir -p "$RDV"
PEER_NODE=b; [ "$RDMIG_NODE" = b ] && PEER_NODE=a

post() {
  printf '%s\n' "${2:-}" >"$RDV/.$1.$RDMIG_NODE.tmp" && mv "$RDV/.$1.$RDMIG_NODE.tmp" "$RDV/$1"
}

await() {
  _deadline=$(( $(date +%s) + ${2:-300} ))
  while [ ! -e "$RDV/$1" ]; do
    if [ -e "$RDV/failed-$PEER_NODE" ]; then echo "await $1: node $PEER_NODE failed" >&2; return 1; fi
    if [ "$(date +%s)" -ge "$_deadline" ]; then echo "await $1: not posted within ${2:-300}s" >&2; return 1; fi
    sleep 0.2
  done
  cat "$RDV/$1"
}

counter() {
  cat "/sys/class/infiniband/$RDMIG_RDMA_DEV/ports/1/hw_counters/$1"
}

gid() {
  # The GID table lists the IPv4-mapped GID of eth0's address (::ffff:a.b.c.d), RoCE v2 type.
  for g in /sys/class/infiniband/"$RDMIG_RDMA_DEV"/ports/1/gids/*; do
    i="${g##*/}"
    v="$(cat "$g" 2>/dev/null)" || continue
    t="$(cat "/sys/class/infiniband/$RDMIG_RDMA_DEV/ports/1/gid_attrs/types/$i" 2>/dev/null)" || continue
    case "$v" in 0000:0000:0000:0000:0000:ffff:*) [ "$t" = "RoCE v2" ] && { echo "$v"; return 0; } ;; esac
  done
  return 1
}

upper_netdevs() {
  _n=1; [ "$RDMIG_NODE" = b ] && _n=2
  _ip=iproute2-ip   # busybox sh would run its own ip applet even by path
  $_ip link add link eth0 name eth0.100 type vlan id 100 &&
    $_ip addr add "10.100.0.$_n/24" dev eth0.100 &&
    $_ip addr add "fd00:100::$_n/64" dev eth0.100 nodad &&
    $_ip link set eth0.100 up &&
    # eth0.100 and mv100 see each other's ARP requests, and by default each answers for every
    # local address: the peer's neighbour entry for 10.101.0.N then held eth0's MAC or mv100's,
    # and the one for 10.100.0.N mv100's or eth0's, by which reply came last (seen: the macvlan
    # case behaved differently between runs, and once the VLAN case's CM requests went to mv100's
    # MAC: RDMA_CM_EVENT_UNREACHABLE). Only the interface that holds the address answers (all:
    # mv100 is made below), as hosts with macvlans are set up.
    echo 1 >/proc/sys/net/ipv4/conf/all/arp_ignore &&
    $_ip link add link eth0.100 name mv100 type macvlan mode bridge &&
    $_ip addr add "10.101.0.$_n/24" dev mv100 &&
    $_ip link set mv100 up || return 1
  # rxe adds a GID per address of every upper device of its netdev (6.1, 6.12: VLANs and macvlans alike).
  for _ in $(seq 1 100); do
    _seen="$(cat /sys/class/infiniband/"$RDMIG_RDMA_DEV"/ports/1/gid_attrs/ndevs/* 2>/dev/null | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
    case "$_seen" in *" 3 eth0.100;"*" 2 mv100;"*) return 0 ;; esac
    sleep 0.1
  done
  echo "upper_netdevs: GIDs per netdev: $_seen" >&2
  return 1
}
