"""PID 1 of a stand-in virt-launcher pod (run by kvpod.LauncherPod under unshare).

Usage: kvpodinit.py POD_DIR HOSTNAME
Already in private mount, UTS and PID namespaces (unshare -m -u -p -f --mount-proc):
sets the hostname, bind-mounts the pod's own /etc/libvirt, /run/libvirt, /var/lib/libvirt,
/var/log/libvirt, /var/cache/libvirt and /run/kubevirt from POD_DIR, starts libvirtd and then reaps children (like a container's init) until
libvirtd exits or SIGTERM arrives. Writes POD_DIR/init.ready once libvirtd is started.
"""
import os
import signal
import socket
import subprocess
import sys

MOUNTS = ("etc/libvirt", "run/libvirt", "var/lib/libvirt", "var/log/libvirt",
          "var/cache/libvirt", "run/kubevirt")


def main():
    pod_dir, hostname = sys.argv[1], sys.argv[2]
    socket.sethostname(hostname)
    for m in MOUNTS:
        subprocess.run(["mount", "--bind", os.path.join(pod_dir, m.replace("/", "-")), "/" + m],
                       check=True)
    log = open("/var/log/libvirt/libvirtd.stderr", "ab")
    libvirtd = subprocess.Popen(["/usr/sbin/libvirtd", "-f", "/etc/libvirt/libvirtd.conf",
                                 "-p", "/run/libvirt/libvirtd.pid"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    signal.signal(signal.SIGTERM, lambda *_: libvirtd.terminate())
    with open(os.path.join(pod_dir, "init.ready"), "w") as f:
        f.write("%d\n" % libvirtd.pid)
    while True:  # reap everything, like a container init
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == libvirtd.pid:
            return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
