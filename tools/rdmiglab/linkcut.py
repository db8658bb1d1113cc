"""Cutting the data channels between two agents on one host, as a lost link would (docs/failover.md).

ss -K destroys a socket: the end named ends with ECONNABORTED and its peer gets a reset
(ECONNRESET), as when a link or a middlebox drops the connection's state. Needs root.
"""
import subprocess


def data_connections(port, min_bytes):
    """The dialling ends (local port, bytes sent) of the established connections to `port` (a target
    agent's data port) that carried at least `min_bytes`: a migration's data channels, never its
    control link, which carries a few KiB."""
    out = subprocess.run(["ss", "-tinH", "state", "established", "( dport = :%d )" % port],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    found = []
    for i, line in enumerate(out):
        # With a state filter ss prints no State column: Recv-Q Send-Q Local:Port Peer:Port.
        fields = line.split()
        if len(fields) >= 4 and fields[3].endswith(":%d" % port):
            info = out[i + 1] if i + 1 < len(out) else ""
            acked = [int(f.split(":")[1]) for f in info.split() if f.startswith("bytes_acked:")]
            if acked and acked[0] >= min_bytes:
                found.append((int(fields[2].rsplit(":", 1)[1]), acked[0]))
    return found


def cut_data_channels(port, min_bytes=1 << 20, host="127.0.0.1"):
    """Resets every data channel to `host`:`port` (see data_connections); returns how many."""
    conns = data_connections(port, min_bytes)
    for sport, _ in conns:
        subprocess.run(["ss", "-K", "-t", "dst", host, "( sport = :%d and dport = :%d )" % (sport, port)],
                       capture_output=True, check=True)
    return len(conns)


def cut_control_connection(port, host="127.0.0.1", max_bytes=64 << 10):
    """Resets the control connection of the one migration to `host`:`port`: the established
    connection to `port` that carried the fewest bytes, under `max_bytes` (the data channels carry
    MiBs). Returns 1, or 0 when there is none (e.g. between a loss and its re-dial)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", "( dport = :%d )" % port],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    best = None
    for i, line in enumerate(out):
        fields = line.split()
        if len(fields) >= 4 and fields[3].endswith(":%d" % port):
            info = out[i + 1] if i + 1 < len(out) else ""
            acked = [int(f.split(":")[1]) for f in info.split() if f.startswith("bytes_acked:")]
            sent = acked[0] if acked else 0
            if sent < max_bytes and (best is None or sent < best[1]):
                best = (int(fields[2].rsplit(":", 1)[1]), sent)
    if best is None:
        return 0
    subprocess.run(["ss", "-K", "-t", "dst", host, "( sport = :%d and dport = :%d )" % (best[0], port)],
                   capture_output=True, check=True)
    return 1
