# Sourced (POSIX sh) by the scripts that run-two-vms.sh runs in node a and node b.
# The two nodes meet through the shared folder $RDMIG_OUT/rdv (9p, no caching: a file
# one node writes is seen by the other on its next read).
#   post NAME [VALUE]       publish NAME (written to a temporary name, then renamed)
#   await NAME [SECONDS]    wait for NAME (default 300 s), print its value; fails (status 1)
#                           on time-out or when the peer published "failed"
#   counter NAME            this node's rxe port counter (hw_counters/NAME: sent_pkts, rcvd_pkts)
#   gid                     this node's RoCE v2 GID of its own IPv4 address
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
