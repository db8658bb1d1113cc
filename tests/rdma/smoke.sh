#!/bin/sh
# Soft-RoCE smoke test; runs inside the VM of run-in-vm.sh (see run-smoke.sh).
# Checks that rxe0 is a usable verbs device, measures RDMA WRITE bandwidth with
# ib_write_bw (server and client on the same rxe0: one device talks to itself), and
# checks rdma_cm connection setup to the veth address with ib_write_bw -R and rping.
# Prints "RDMIG-SMOKE <name> <value>" lines for the figures; exits non-zero on failure.
set -eu
dev="${RDMIG_RDMA_DEV:-rxe0}"
addr="${RDMIG_VM_ADDR:-10.99.0.1}"
size="${SMOKE_MSG_SIZE:-1048576}"   # bytes per RDMA WRITE
iters="${SMOKE_ITERS:-200}"
failed=""
step() { echo; echo "=== $*"; }
fail() { echo "SMOKE FAILED: $*"; failed="$failed
  $*"; }

# wait_listen tcp|cm PORT: until a TCP socket (perftest's own exchange) or an rdma_cm
# id (rdma_cm servers) listens on PORT; 30 s deadline.
listening() {
  case "$1" in
    tcp) netstat -ltn 2>/dev/null | grep -q "[:.]$2 " ;;
    cm) rdma resource show cm_id 2>/dev/null | grep -Eq "state LISTEN .*src-addr [^ ]*:$2( |\$)" ;;
  esac
}
wait_listen() {
  i=0
  until listening "$1" "$2"; do
    i=$((i + 1)); [ $i -le 300 ] || return 1
    sleep 0.1
  done
}

# perftest tcp|cm PORT NAME ARGS...: server in the background, client against $addr.
perftest() {
  kind="$1" port="$2" name="$3"; shift 3
  timeout 90 "$@" -p "$port" >"/tmp/$name.server" 2>&1 &
  spid=$!
  if ! wait_listen "$kind" "$port"; then
    fail "$name: server did not listen on port $port"; cat "/tmp/$name.server"; kill $spid 2>/dev/null; return 0
  fi
  crc=0; timeout 90 "$@" -p "$port" "$addr" >"/tmp/$name.client" 2>&1 || crc=$?
  src=0; wait $spid || src=$?
  cat "/tmp/$name.client"
  if [ $crc != 0 ] || [ $src != 0 ]; then
    echo "--- server side:"; cat "/tmp/$name.server"
    fail "$name: client exited $crc, server $src"; return 0
  fi
  # result line: #bytes #iterations BW-peak BW-average MsgRate
  bw="$(awk -v s="$size" '$1 == s && NF >= 4 {print $4}' "/tmp/$name.client" | tail -n1)"
  if [ -z "$bw" ]; then fail "$name: no result line for $size bytes"; return 0; fi
  echo "RDMIG-SMOKE $name-MB/s $bw"
}

step "devices"
ibv_devices
ibv_devices | grep -q "$dev" || fail "ibv_devices does not list $dev"
ibv_devinfo -d "$dev" || fail "ibv_devinfo -d $dev"
ibv_devinfo -d "$dev" | grep -q PORT_ACTIVE || fail "$dev port is not active"
rdma link show
rdma link show | grep -q "$dev.*ACTIVE.*netdev" || fail "rdma link: $dev not active"
echo "GIDs of $dev port 1:"
for g in /sys/class/infiniband/$dev/ports/1/gids/*; do
  v="$(cat "$g" 2>/dev/null)" || continue
  case "$v" in 0000:0000:0000:0000:0000:0000:0000:0000) ;; *) echo "  ${g##*/}: $v ($(cat /sys/class/infiniband/$dev/ports/1/gid_attrs/types/${g##*/} 2>/dev/null))";; esac
done

step "ib_write_bw -d $dev, $size-byte writes x $iters, both ends on $dev via $addr"
perftest tcp 18515 ib_write_bw ib_write_bw -d "$dev" -s "$size" -n "$iters" -F

step "ib_write_bw -R (connection through rdma_cm) to $addr"
perftest cm 18516 ib_write_bw_rdma_cm ib_write_bw -R -d "$dev" -s "$size" -n "$iters" -F

step "rping (rdma_cm) to $addr"
timeout 60 rping -s -a "$addr" -p 7471 -C 5 -S 64 >/tmp/rping.server 2>&1 &
rpid=$!
ok=0
if wait_listen cm 7471; then
  timeout 30 rping -c -a "$addr" -p 7471 -C 5 -S 64 -v >/tmp/rping.client 2>&1 && ok=1
else
  echo "rping server did not listen on port 7471" >/tmp/rping.client
fi
rsrc=0; wait $rpid || rsrc=$?
cat /tmp/rping.client
if [ $ok = 1 ] && [ $rsrc = 0 ] && [ "$(grep -c 'ping data' /tmp/rping.client)" = 5 ]; then
  echo "RDMIG-SMOKE rping-pings 5"
else
  echo "--- server side:"; cat /tmp/rping.server
  fail "rping: client ok=$ok, server exited $rsrc"
fi

echo
if [ -n "$failed" ]; then echo "SMOKE: FAILED:$failed"; exit 1; fi
echo "SMOKE: all checks passed"
