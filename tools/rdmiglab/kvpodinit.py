"""PID 1 of a stand-in virt-launcher pod (run by kvpod.LauncherPod under unshare).

Usage: kvpodinit.py POD_DIR HOSTNAME [FLAVOR [LAUNCHER_ROOT]]
Already in private mount, UTS and PID namespaces (unshare -m -u -p -f --mount-proc):
sets the hostname, then per flavour

bookworm-root (KubeVirt's ``Root`` feature gate): bind-mounts the pod's own /etc/libvirt,
  /run/libvirt, /var/lib/libvirt, /var/log/libvirt, /var/cache/libvirt and /run/kubevirt
  from POD_DIR over the host's dirs and starts the host's libvirtd 9.0 as root;

trixie-nonroot (KubeVirt's default): mounts an overlay of the cached Debian 13 root
  (LAUNCHER_ROOT, read-only lower layer; POD_DIR/upper holds the pod's changes) at
  POD_DIR/rootfs, the pod's own /proc, /dev and /sys (bind; without /sys a domain start
  fails with "the cause is unknown"), tmpfs /run and /tmp, and the pod's dirs (MOUNTS_FOR)
  under it, chroots into it (so /proc/<pid>/root of any pod process is the pod's root) and
  starts libvirtd 11 as uid/gid 107 in session mode (XDG_* under /run as KubeVirt's
  non-root launcher sets them); its socket is /run/libvirt/libvirt-sock, with a
  virtqemud-sock symlink next to it (/var/run is a symlink to /run in the root).

Then reaps children (like a container's init) until libvirtd exits or SIGTERM arrives.
Writes POD_DIR/init.ready once libvirtd is started.
"""
import os
import signal
import socket
import subprocess
import sys

FLAVORS = ("trixie-nonroot", "bookworm-root")
MOUNTS = ("etc/libvirt", "run/libvirt", "var/lib/libvirt", "var/log/libvirt",
          "var/cache/libvirt", "run/kubevirt")
MOUNTS_FOR = {
    "bookworm-root": MOUNTS,
    # + KubeVirt's non-root private dir: XDG_CONFIG_HOME / XDG_CACHE_HOME / HOME live there
    "trixie-nonroot": MOUNTS + ("run/kubevirt-private",),
}
QEMU_UID = QEMU_GID = 107
# The environment KubeVirt's non-root virt-launcher gives its libvirt daemon (XDG_* under
# /var/run, which is /run in the root).
SESSION_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/run/kubevirt-private",
    "USER": "qemu", "LOGNAME": "qemu", "LC_ALL": "C",
    "XDG_RUNTIME_DIR": "/run",
    "XDG_CONFIG_HOME": "/run/kubevirt-private/config",
    "XDG_CACHE_HOME": "/run/kubevirt-private/cache",
}


def host_dir(pod_dir, m):
    return os.path.join(pod_dir, m.replace("/", "-"))


def mount(*args):
    subprocess.run(["mount"] + list(args), check=True)


def setup_bookworm(pod_dir):
    for m in MOUNTS:
        mount("--bind", host_dir(pod_dir, m), "/" + m)
    return ["/usr/sbin/libvirtd", "-f", "/etc/libvirt/libvirtd.conf",
            "-p", "/run/libvirt/libvirtd.pid"], None


def setup_trixie(pod_dir, lower):
    root = os.path.join(pod_dir, "rootfs")
    upper, work = os.path.join(pod_dir, "upper"), os.path.join(pod_dir, "work")
    for d in (root, upper, work):
        os.makedirs(d, exist_ok=True)
    mount("-t", "overlay", "overlay", "-o",
          "lowerdir=%s,upperdir=%s,workdir=%s" % (lower, upper, work), root)
    mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", root + "/proc")  # this pod's PIDs
    mount("--rbind", "/dev", root + "/dev")
    mount("--rbind", "/sys", root + "/sys")
    mount("-t", "tmpfs", "-o", "mode=755,nosuid,nodev", "tmpfs", root + "/run")
    mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", root + "/tmp")
    for m in MOUNTS_FOR["trixie-nonroot"]:
        # Always under $ROOT/run, never $ROOT/var/run: that is an absolute symlink to /run,
        # which outside the chroot is the host's.
        target = os.path.join(root, m)
        if os.path.islink(target):
            raise RuntimeError("refusing to mount over the symlink %s" % target)
        os.makedirs(target, exist_ok=True)
        mount("--bind", host_dir(pod_dir, m), target)
    os.chroot(root)
    os.chdir("/")
    return ["/usr/bin/setpriv", "--reuid=%d" % QEMU_UID, "--regid=%d" % QEMU_GID,
            "--clear-groups", "--", "/usr/sbin/libvirtd", "-f", "/etc/libvirt/libvirtd.conf",
            "-p", "/run/libvirt/libvirtd.pid"], SESSION_ENV


def main():
    pod_dir, hostname = sys.argv[1], sys.argv[2]
    flavor = sys.argv[3] if len(sys.argv) > 3 else "bookworm-root"
    if flavor not in FLAVORS:
        raise SystemExit("unknown launcher flavour %r" % flavor)
    socket.sethostname(hostname)
    dir_fd = os.open(pod_dir, os.O_RDONLY | os.O_DIRECTORY)  # reaches pod_dir after a chroot
    log = open(os.path.join(host_dir(pod_dir, "var/log/libvirt"), "libvirtd.stderr"), "ab")
    if flavor == "trixie-nonroot":
        argv, env = setup_trixie(pod_dir, sys.argv[4])
    else:
        argv, env = setup_bookworm(pod_dir)
    libvirtd = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    signal.signal(signal.SIGTERM, lambda *_: libvirtd.terminate())
    fd = os.open("init.ready", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
    os.write(fd, b"%d\n" % libvirtd.pid)
    os.close(fd)
    os.close(dir_fd)
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
