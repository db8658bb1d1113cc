#!/bin/sh
# Runs in both VMs of run-two-vms.sh (see CMakeLists.txt here): rdmig's RDMA transport
# between two nodes, each with its own kernel, network stack and rxe device.
#   transport-two-nodes.sh BUILD_DIR
# Node a runs the rdmig-stream server on rxea (10.99.1.1), node b the client on rxeb.
# 1. the GIDs: each device has the RoCE v2 GID of its own node's address, and they differ;
# 2. streams with a return stream, 1 and 4 channels, chunk sizes 64Ki/1Mi/16Mi, digests of
#    both directions compared across the nodes; for each, the rxe hw counters of BOTH
#    devices and eth0's byte counters rise by at least what the stream moved (so the bytes
#    went over RDMA between the two devices, not over TCP or a loopback);
# 3. on the 1Mi/1-channel stream, with node b's client given the transport's traffic class
#    104 (rdmig-stream --traffic-class: RdmaOptions::traffic_class, what the agent's
#    rdma.trafficClass sets), each node captures the first 20 RoCE v2 packets (UDP 4791)
#    that reach it: all from the peer node's address, all with IP ToS 0x68 (DSCP 26);
# 4. the server's node kills it mid-stream: the client on the other node ends with an error.
# Prints "RDMIG-RESULT key value" lines; exits non-zero when anything failed.
set -u
build="$1"
. "$(dirname "$0")/two-node-lib.sh"
stream="$build/bench/stream/rdmig-stream"
server_ip=10.99.1.1
bytes=128Mi bytes_n=134217728 reverse=4Mi reverse_n=4194304
failed=0
fail() { echo "FAILED: $*"; failed=1; }
step() { echo; echo "=== $*"; }
stop() { post "failed-$RDMIG_NODE"; echo "FAILED: $*"; exit 1; }
# A packet carries at most 4096 payload bytes (the largest RoCE MTU): at least n/4096.
min_pkts() { echo $(( $1 / 4096 )); }
netbytes() { cat "/sys/class/net/$RDMIG_RDMA_NETDEV/statistics/$1"; }

step "node $RDMIG_NODE: $RDMIG_RDMA_DEV on $RDMIG_RDMA_NETDEV $RDMIG_VM_ADDR"
rdma link show
my_gid="$(gid)" || stop "$RDMIG_RDMA_DEV has no RoCE v2 IPv4 GID"
post "gid-$RDMIG_NODE" "$my_gid"
peer_gid="$(await "gid-$PEER_NODE" 120)" || stop "no GID from node $PEER_NODE"
echo "GIDs: own $my_gid, node $PEER_NODE $peer_gid"
[ "$my_gid" != "$peer_gid" ] || fail "both nodes' devices have the same GID $my_gid"
hex_ip() { echo "$1" | awk -F. '{printf "%02x%02x:%02x%02x", $1, $2, $3, $4}'; }
[ "${my_gid##*:ffff:}" = "$(hex_ip "$RDMIG_VM_ADDR")" ] || fail "own GID $my_gid is not $RDMIG_VM_ADDR's"
[ "${peer_gid##*:ffff:}" = "$(hex_ip "$RDMIG_VM_PEER_ADDR")" ] || fail "peer GID $peer_gid is not $RDMIG_VM_PEER_ADDR's"

# Fields of "server: sent N bytes digest X, received N bytes digest Y, S s, R MiB/s".
fields() { tr -d , | awk '$2 == "sent" {print $3, $6, $8, $11, $14}'; }

for chunk in 64Ki 1Mi 16Mi; do
  depth=16; [ "$chunk" = 16Mi ] && depth=4   # keep rings within the VM's memory
  for ch in 1 4; do
    case_="$chunk-$ch"
    step "stream $bytes (+$reverse back) over $ch channel(s), chunk $chunk, depth $depth: node b -> node a"
    s0=$(counter sent_pkts); r0=$(counter rcvd_pkts); tx0=$(netbytes tx_bytes); rx0=$(netbytes rx_bytes)
    capture=0 tclass=""; [ "$case_" = 1Mi-1 ] && capture=1
    # Node b's client marks its connections with the transport's traffic class 104 = DSCP 26
    # (AF31), ECN 0; the devices' default (configfs default_roce_tos) stays 0.
    [ $capture = 1 ] && [ "$RDMIG_NODE" = b ] && tclass="--traffic-class 104"
    if [ $capture = 1 ]; then
      # The first packets that reach this node's RoCE v2 port: they must come from the peer
      # node's address (-Q in: only what arrives). -Z root: tcpdump would drop to a user the VM
      # does not have; -t: no timestamps, so each header line starts with "IP (tos".
      tcpdump -Z root -Q in -t -i "$RDMIG_RDMA_NETDEV" -n -v -c 20 "udp dst port 4791" >/tmp/capture.out 2>/tmp/capture.err &
      tpid=$!
      for _ in $(seq 1 100); do grep -q "listening on" /tmp/capture.err && break; sleep 0.1; done
      grep -q "listening on" /tmp/capture.err || { cat /tmp/capture.err; fail "tcpdump did not start"; }
    fi
    common="--transport rdma --ip $server_ip --bytes $bytes --reverse $reverse --channels $ch --chunk $chunk --depth $depth --timeout 180"
    if [ "$RDMIG_NODE" = a ]; then
      # shellcheck disable=SC2086
      out="/tmp/server-$case_.out"   # one file per case: the loop below must not read the last one's
      "$stream" --role server --port 0 $common >"$out" 2>&1 &
      spid=$!
      port=""
      for _ in $(seq 1 300); do
        port="$(awk '$1 == "listening" {print $2}' "$out" 2>/dev/null)"
        [ -n "$port" ] && break
        kill -0 $spid 2>/dev/null || break
        sleep 0.1
      done
      [ -n "$port" ] || { cat "$out"; stop "server did not listen ($case_)"; }
      post "port-$case_" "$port"
      wait $spid; rc=$?
      cat "$out"
      [ $rc = 0 ] || fail "server $case_ exited $rc"
      mine="$(fields <"$out")"
      theirs="$(await "result-b-$case_" 200)" || stop "no client result ($case_)"
      # server sent == client received, server received == client sent (count and digest)
      set -- $mine - - - - -; s_sent="$1 $2" s_recv="$3 $4"
      set -- $theirs - - - - -; c_sent="$1 $2" c_recv="$3 $4" rate="$5"
      if [ -n "$mine" ] && [ "$s_recv" = "$c_sent" ] && [ "$s_sent" = "$c_recv" ] && [ "${c_sent% *}" = "$bytes_n" ]; then
        echo "digests match across the nodes: b->a $c_sent, a->b $s_sent"
      else
        fail "$case_: digests differ: server sent/received '$s_sent'/'$s_recv', client '$c_sent'/'$c_recv'"
      fi
      echo "RDMIG-RESULT two-node-$case_-MiB/s $rate"
      in_n=$bytes_n out_n=$reverse_n
    else
      port="$(await "port-$case_" 120)" || stop "no server port ($case_)"
      # shellcheck disable=SC2086
      "$stream" --role client --port "$port" $common $tclass >/tmp/client.out 2>&1; rc=$?
      cat /tmp/client.out
      [ $rc = 0 ] || fail "client $case_ exited $rc"
      post "result-b-$case_" "$(fields </tmp/client.out)"
      in_n=$reverse_n out_n=$bytes_n
    fi
    if [ $capture = 1 ]; then
      wait $tpid
      # tcpdump -v: "IP (tos 0x0, ttl 64, ..., proto UDP (17), length N)" then "    SRC.PORT > DST.4791: UDP, ..."
      n_peer="$(grep -c "^ *$RDMIG_VM_PEER_ADDR\.[0-9]* > $RDMIG_VM_ADDR\.4791: UDP" /tmp/capture.out)"
      tos="$(awk '/^IP \(tos / {sub(",", "", $3); print $3}' /tmp/capture.out | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
      echo "captured on $RDMIG_RDMA_NETDEV: $n_peer of 20 RoCE v2 packets from $RDMIG_VM_PEER_ADDR to $RDMIG_VM_ADDR:4791; IP ToS (count value): $tos"
      [ "$n_peer" = 20 ] || { head -n 8 /tmp/capture.out; fail "$case_: the RoCE v2 packets here are not all from node $PEER_NODE"; }
      # b's packets carry the class its client set; node a's accepted connection takes it from
      # b's CM request, so a's packets carry it too. Without --traffic-class both are 0x0.
      # (The agent's rdma.trafficClass end to end: test_agent_rdma_two_nodes.py.)
      [ "$tos" = " 20 0x68;" ] || fail "$case_: IP ToS on the wire is '$tos', expected 0x68 (DSCP 26) on all 20"
      echo "RDMIG-RESULT two-node-roce-v2-tos-$RDMIG_NODE $(echo "$tos" | awk '{print $2}' | tr -d ';')"
    fi
    ds=$(( $(counter sent_pkts) - s0 )); dr=$(( $(counter rcvd_pkts) - r0 ))
    dtx=$(( $(netbytes tx_bytes) - tx0 )); drx=$(( $(netbytes rx_bytes) - rx0 ))
    echo "$RDMIG_RDMA_DEV: sent_pkts +$ds, rcvd_pkts +$dr; $RDMIG_RDMA_NETDEV: tx_bytes +$dtx, rx_bytes +$drx"
    [ "$ds" -ge "$(min_pkts $out_n)" ] || fail "$case_: $RDMIG_RDMA_DEV sent $ds packets, fewer than $out_n bytes need"
    [ "$dr" -ge "$(min_pkts $in_n)" ] || fail "$case_: $RDMIG_RDMA_DEV received $dr packets, fewer than $in_n bytes need"
    [ "$dtx" -ge "$out_n" ] || fail "$case_: $RDMIG_RDMA_NETDEV sent $dtx bytes, fewer than the stream's $out_n"
    [ "$drx" -ge "$in_n" ] || fail "$case_: $RDMIG_RDMA_NETDEV received $drx bytes, fewer than the stream's $in_n"
  done
done

step "the server's node kills it mid-stream; the client on node b must fail cleanly"
kill_args="--transport rdma --ip $server_ip --channels 2 --chunk 1Mi --depth 8 --timeout 90"
if [ "$RDMIG_NODE" = a ]; then
  # shellcheck disable=SC2086
  "$stream" --role server --port 0 --reverse 0 $kill_args >/tmp/server-kill.out 2>&1 &
  spid=$!
  port=""
  for _ in $(seq 1 300); do
    port="$(awk '$1 == "listening" {print $2}' /tmp/server-kill.out 2>/dev/null)"
    [ -n "$port" ] && break
    kill -0 $spid 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$port" ] || { cat /tmp/server-kill.out; stop "kill test: server did not listen"; }
  post port-kill "$port"
  await client-streaming 120 >/dev/null || stop "kill test: the client did not start"
  r0=$(counter rcvd_pkts)
  sleep 2
  [ $(( $(counter rcvd_pkts) - r0 )) -gt 0 ] || fail "kill test: no packets arrived before the kill"
  kill -9 $spid
  wait $spid 2>/dev/null
  post server-killed
  crc="$(await client-exit 120)" || stop "kill test: no client result"
  echo "client on node b exited $crc"
else
  port="$(await port-kill 120)" || stop "kill test: no port"
  # shellcheck disable=SC2086
  "$stream" --role client --port "$port" --bytes 4Gi $kill_args >/tmp/client.out 2>&1 &
  cpid=$!
  post client-streaming
  await server-killed 120 >/dev/null || stop "kill test: server was not killed"
  t0=$(date +%s)
  wait $cpid; crc=$?
  t1=$(date +%s)
  post client-exit "$crc"
  cat /tmp/client.out
  echo "client exit status $crc after the server's node killed it (waited $((t1 - t0)) s)"
  [ "$crc" = 1 ] || fail "client should fail cleanly (exit 1), got $crc"
  grep -Eq "disconnected|work completion failed|acknowledged nothing|peer" /tmp/client.out || fail "client error does not say what happened"
  echo "RDMIG-RESULT two-node-peer-killed-exit $crc"
fi

[ $failed = 0 ] || post "failed-$RDMIG_NODE"
exit $failed
