# Watches a Soft-RoCE VM's console (run-in-vm.sh pipes it through this, line by line) for the two
# ways the VM kernel's rxe has ended a run that rdmig's script did not end:
#   - a soft lockup ("watchdog: BUG: soft lockup"): Debian 12's 6.1 rxe spinning in softirq after
#     RoCE v2 was dropped mid-flow; the script then waits forever;
#   - a kernel panic whose oops has rdma_rxe frames: Debian 13's 6.12 rxe, a double fault in
#     rxe_receiver's skb allocation during the KubeVirt rail-cut cases (whole run W35, 2026-12-07,
#     fixtures/rxe-double-fault.console); the VM ends without the script's exit status.
# On either it prints why on stderr, writes the reason to the file `lk` and kills QEMU (pid in
# the file `pf`; a panicked one has usually exited already), once. Any other panic, and an rxe oops
# that does not panic, are left to the script's own result. Every line is passed on to stdout.
# mawk (Debian's required awk): run it with -W interactive so that lines pass at once.
#
#   mawk -W interactive -v lk=FILE -v pf=PIDFILE -f console-watch.awk
function fault(why) {
  if (seen) return
  seen = 1
  print "run-in-vm: the VM's kernel reports " why ": stopping it" > "/dev/stderr"
  print why > lk
  close(lk)
  if (pf != "") system("kill \"$(cat \"" pf "\" 2>/dev/null)\" 2>/dev/null")
}
{ print }
/watchdog: BUG: soft lockup/ { fault("a soft lockup") }
# The start of an oops report; the frames until the next one say where it happened.
# (6.12 prints "Oops:" lines; 6.1 starts a BUG_ON's with "kernel BUG at" and "invalid opcode:".)
/(Oops:|BUG:|kernel BUG at|invalid opcode:|PANIC:|general protection fault|stack segment:)/ { oops = 1; rxe = 0 }
oops && /\[rdma_rxe\]/ { rxe = 1 }
rxe && /Kernel panic - not syncing/ { fault("a kernel panic in rdma_rxe") }
