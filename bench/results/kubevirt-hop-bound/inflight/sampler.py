# Runs inside one netns: every 5 ms, the TCP sockets with queued bytes (tx_queue = unacked/unsent
# send bytes, rx_queue = received, not yet read), as JSON lines {t, s: [[lport, rport, tx, rx]]}.
import json, sys, time
out = open(sys.argv[1], "w")
stop_at = time.monotonic() + float(sys.argv[2])
while time.monotonic() < stop_at:
    t = time.monotonic()
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            next(f)
            for line in f:
                p = line.split()
                tx, rx = (int(x, 16) for x in p[4].split(":"))
                if tx or rx:
                    rows.append([int(p[1].rsplit(":", 1)[1], 16), int(p[2].rsplit(":", 1)[1], 16), tx, rx])
    if rows:
        out.write(json.dumps({"t": round(t, 4), "s": rows}) + "\n")
    time.sleep(0.005)
out.close()
