"""Stand-in virt-launcher pods: a libvirt daemon in private mount+UTS+PID namespaces.

Two flavours (``LauncherPod(flavor=...)``, see kvpodinit):
  trixie-nonroot (default, KubeVirt 1.9's own default): the cached Debian 13 root
    (launcher_root.ensure_launcher_root) with QEMU 10.0 and libvirt 11.3, libvirtd as uid/gid
    107 in session mode, reached as ``qemu+unix:///session?socket=.../virtqemud-sock``;
  bookworm-root (KubeVirt's ``Root`` feature gate): the host's libvirtd 9.0 and QEMU 7.2
    as root, reached as ``qemu+unix:///system?socket=.../libvirt-sock``.

Each pod has its own /etc/libvirt (libvirtd.conf with its own host_uuid), qemu.conf for an
unconfined TCG QEMU, /run/libvirt, /var/lib/libvirt, /var/log/libvirt, /var/cache/libvirt
and /run/kubevirt (and /run/kubevirt-private for the non-root flavour), bind-mounted from
<pod_dir> inside the pod's mount namespace, so two daemons run on one host and migrate to
each other.

From the host the pod is reached as KubeVirt's virt-handler does, through the launcher's
root: /proc/<monitor pid>/root/run/libvirt/... and .../run/kubevirt. The monitor is a
long-running ``virt-launcher-monitor --name N --uid U --namespace NS`` started inside the
pod's mount namespace (and, non-root, inside its root, as uid 107) per VMI.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

from . import kvpodinit

FLAVORS = kvpodinit.FLAVORS
DEFAULT_FLAVOR = "trixie-nonroot"
QEMU_UID = QEMU_GID = kvpodinit.QEMU_UID
# The daemon's socket inside the pod, per flavour. libvirtd 9.0 (root) has libvirt-sock only;
# the non-root libvirtd 11.3 has libvirt-sock and a virtqemud-sock symlink to it (KubeVirt's
# /var/run/libvirt/virtqemud-sock).
LIBVIRT_SOCK = {"bookworm-root": "run/libvirt/libvirt-sock",
                "trixie-nonroot": "run/libvirt/virtqemud-sock"}
URI_PATH = {"bookworm-root": "/system", "trixie-nonroot": "/session"}

LIBVIRTD_CONF = """\
# rdmig KubeVirt harness: one libvirtd per stand-in launcher pod
unix_sock_rw_perms = "0770"
auth_unix_ro = "none"
auth_unix_rw = "none"
host_uuid = "{host_uuid}"
log_outputs = "{log_level}:file:/var/log/libvirt/libvirtd.log"
"""
# Session mode: the socket dir is $XDG_RUNTIME_DIR/libvirt (= /run/libvirt) anyway; set it.
SESSION_CONF_EXTRA = """\
unix_sock_dir = "/run/libvirt"
"""
QEMU_CONF = """\
user = "root"
group = "root"
security_driver = "none"
dynamic_ownership = 0
remember_owner = 0
cgroup_controllers = [ ]
namespaces = [ ]
stdio_handler = "file"
"""
# What an unprivileged (session) QEMU driver accepts: no user/group, cgroups or namespaces.
QEMU_CONF_SESSION = """\
security_driver = "none"
dynamic_ownership = 0
remember_owner = 0
stdio_handler = "file"
"""
MONITOR = """\
#!/bin/sh
# Stand-in for KubeVirt's virt-launcher-monitor: only its command line matters
# (--name, --uid, --namespace), and that it lives in the launcher's mount namespace.
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
"""


def ensure_libvirt_qemu_user():
    """libvirt's QEMU driver wants a libvirt-qemu user even when it runs QEMU as root."""
    if subprocess.run(["getent", "passwd", "libvirt-qemu"], stdout=subprocess.DEVNULL).returncode == 0:
        return False
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                    "--home-dir", "/var/lib/libvirt", "--shell", "/usr/sbin/nologin",
                    "libvirt-qemu"], check=True)
    return True


def wait_for(pred, timeout, what, alive=None, interval=0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if alive is not None and not alive():
            raise RuntimeError("%s: process exited while waiting" % what)
        if time.monotonic() > deadline:
            raise TimeoutError("%s: not within %.0fs" % (what, timeout))
        time.sleep(interval)


class LauncherPod:
    def __init__(self, name, pod_dir, log_level=3, flavor=None, launcher_qemu=None):
        """launcher_qemu (non-root flavour): None for the trixie root's QEMU 10.0, "backports" for its
        copy with trixie-backports' QEMU 11.1 (launcher_root.ensure_backports_root), where post-copy
        with multifd needs QEMU 10.1+."""
        self.name = name
        self.launcher_qemu = launcher_qemu
        self.dir = os.path.abspath(pod_dir)
        self.flavor = flavor or DEFAULT_FLAVOR
        if self.flavor not in FLAVORS:
            raise ValueError("unknown launcher flavour %r (one of %s)" % (self.flavor, ", ".join(FLAVORS)))
        self.nonroot = self.flavor == "trixie-nonroot"
        self.mounts = kvpodinit.MOUNTS_FOR[self.flavor]
        self.host_uuid = str(uuid.uuid4())
        self.log_level = log_level
        self.init = None
        self._pid1 = None
        self.launcher_root = None  # the cached trixie root (non-root flavour)
        self.monitors = {}  # vmi uid -> Popen

    # -- paths --------------------------------------------------------------------------
    def path(self, in_pod):
        """Host path of a path inside the pod's bind-mounted dirs (e.g. /var/log/libvirt/x)."""
        if in_pod.startswith("/var/run/"):
            in_pod = in_pod[len("/var"):]  # a symlink to /run (in the trixie root)
        for m in self.mounts:
            if in_pod == "/" + m or in_pod.startswith("/" + m + "/"):
                return os.path.join(self.dir, m.replace("/", "-")) + in_pod[len(m) + 1:]
        raise ValueError("%s is not in a pod-private dir" % in_pod)

    def root(self, pid=None):
        """/proc/<pid>/root of a process in the pod (default: its PID 1)."""
        return "/proc/%d/root" % (pid or self._pid1)

    @property
    def libvirt_sock(self):
        """The daemon's socket inside the pod, relative to its root."""
        return LIBVIRT_SOCK[self.flavor]

    @property
    def uri_path(self):
        """``/session`` (non-root daemon) or ``/system`` (root daemon)."""
        return URI_PATH[self.flavor]

    def libvirt_uri(self, pid=None):
        return "qemu+unix://%s?socket=%s/%s" % (self.uri_path, self.root(pid), self.libvirt_sock)

    def stage_guest(self, kernel, initrd):
        """Returns the kernel and initrd paths for the domain XML. Non-root: copies them into
        the pod's /var/lib/libvirt/images (readable by uid 107, the same path in every pod,
        as the domain XML migrates as is); root: the host paths."""
        if not self.nonroot:
            return kernel, initrd
        out = []
        for src in (kernel, initrd):
            in_pod = "/var/lib/libvirt/images/" + os.path.basename(src)
            dst = self.path(in_pod)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o644)
            out.append(in_pod)
        return tuple(out)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, timeout=30.0):
        if self.nonroot:
            from .launcher_root import ensure_backports_root, ensure_launcher_root
            self.launcher_root = ensure_backports_root() if self.launcher_qemu == "backports" else ensure_launcher_root()
        else:
            ensure_libvirt_qemu_user()
        for m in self.mounts:
            if not self.nonroot:
                os.makedirs("/" + m, exist_ok=True)  # mount points (empty dirs on the host)
            os.makedirs(os.path.join(self.dir, m.replace("/", "-")), exist_ok=True)
        os.makedirs(self.path("/run/kubevirt/migrationproxy"), exist_ok=True)
        os.makedirs(self.path("/var/log/libvirt/qemu"), exist_ok=True)
        conf = LIBVIRTD_CONF.format(host_uuid=self.host_uuid, log_level=self.log_level)
        if self.nonroot:
            conf += SESSION_CONF_EXTRA
        # Debugging aid: e.g. RDMIG_LIBVIRT_LOG_FILTERS="1:qemu.qemu_migration 1:qemu.qemu_monitor"
        # with libvirt_log_level=1 logs what the named modules do.
        if os.environ.get("RDMIG_LIBVIRT_LOG_FILTERS"):
            conf += 'log_filters = "%s"\n' % os.environ["RDMIG_LIBVIRT_LOG_FILTERS"].replace('"', "")
        with open(self.path("/etc/libvirt/libvirtd.conf"), "w") as f:
            f.write(conf)
        with open(self.path("/etc/libvirt/qemu.conf"), "w") as f:
            f.write(QEMU_CONF_SESSION if self.nonroot else QEMU_CONF)
        if self.nonroot:
            self._prepare_nonroot()
        else:
            self.monitor_path = os.path.join(self.dir, "virt-launcher-monitor")
            with open(self.monitor_path, "w") as f:
                f.write(MONITOR)
            os.chmod(self.monitor_path, 0o755)
        ready = os.path.join(self.dir, "init.ready")
        if os.path.exists(ready):
            os.unlink(ready)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        argv = [sys.executable, "-m", "rdmiglab.kvpodinit", self.dir, self.name, self.flavor]
        if self.nonroot:
            argv.append(self.launcher_root)
        with open(os.path.join(self.dir, "init.log"), "ab") as log:
            self.init = subprocess.Popen(
                ["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
                 "--propagation", "private", "--"] + argv,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)
        # self.init is unshare; its child (PID 1 of the pod) has the pod's mount namespace.
        wait_for(lambda: os.path.exists(ready), timeout, "%s: pod init" % self.name,
                 alive=lambda: self.init.poll() is None)
        self._pid1 = self._child_of(self.init.pid)
        sock = "/proc/%d/root/%s" % (self._pid1, self.libvirt_sock)
        wait_for(lambda: os.path.exists(sock), timeout, "%s: libvirtd socket %s" % (self.name, sock),
                 alive=lambda: self.init.poll() is None)
        return self

    def _prepare_nonroot(self):
        """Pod dirs for the uid-107 daemon: what it and QEMU write is owned by 107
        (KubeVirt's non-root launcher image does the same); the session daemon's qemu.conf
        is read from $XDG_CONFIG_HOME/libvirt; the virtqemud-sock symlink; the monitor."""
        for d in ("/run/kubevirt-private/config/libvirt", "/run/kubevirt-private/cache",
                  "/var/lib/libvirt/images"):
            os.makedirs(self.path(d), exist_ok=True)
        shutil.copyfile(self.path("/etc/libvirt/qemu.conf"),
                        self.path("/run/kubevirt-private/config/libvirt/qemu.conf"))
        link = self.path("/run/libvirt/virtqemud-sock")
        if not os.path.lexists(link):
            os.symlink("libvirt-sock", link)
        for m in self.mounts:
            if m == "etc/libvirt":
                continue  # configuration: root-owned, readable
            top = os.path.join(self.dir, m.replace("/", "-"))
            for dirpath, dirnames, filenames in os.walk(top):
                for n in [dirpath] + [os.path.join(dirpath, x) for x in dirnames + filenames]:
                    os.lchown(n, QEMU_UID, QEMU_GID)
        # The monitor lives in the pod's root (the overlay's upper layer, written before
        # the overlay is mounted), as /usr/bin/virt-launcher-monitor does in KubeVirt's image.
        self.monitor_path = "/usr/bin/virt-launcher-monitor"
        host = os.path.join(self.dir, "upper", self.monitor_path.lstrip("/"))
        os.makedirs(os.path.dirname(host), exist_ok=True)
        with open(host, "w") as f:
            f.write(MONITOR)
        os.chmod(host, 0o755)

    @staticmethod
    def _child_of(pid):
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            kids = f.read().split()
        if not kids:
            raise RuntimeError("process %d has no child" % pid)
        return int(kids[0])

    @property
    def pid1(self):
        """Host pid of the pod's PID 1 (kvpodinit): in the pod's mount namespace."""
        return self._pid1

    def start_monitor(self, vmi_name, vmi_uid, namespace):
        """Starts virt-launcher-monitor for a VMI inside the pod's mount+UTS namespaces;
        returns its host pid (exec'd by nsenter, so the Popen pid is the monitor)."""
        argv = ["nsenter", "-t", str(self._pid1), "-m", "-u"]
        if self.nonroot:  # inside the pod's root, as KubeVirt's non-root user
            argv += ["-r", "-w", "--", "/usr/bin/setpriv", "--reuid=%d" % QEMU_UID,
                     "--regid=%d" % QEMU_GID, "--clear-groups"]
        p = subprocess.Popen(argv + ["--", self.monitor_path, "--name", vmi_name, "--uid", vmi_uid,
                                     "--namespace", namespace],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        self.monitors[vmi_uid] = p
        own_mnt = os.readlink("/proc/%d/ns/mnt" % self._pid1)
        wait_for(lambda: _readlink("/proc/%d/ns/mnt" % p.pid) == own_mnt, 10,
                 "%s: monitor in the pod's mount namespace" % self.name,
                 alive=lambda: p.poll() is None)
        return p.pid

    def monitor_pid(self, vmi_uid):
        p = self.monitors.get(vmi_uid)
        return p.pid if p and p.poll() is None else None

    def stop_monitor(self, vmi_uid):
        p = self.monitors.pop(vmi_uid, None)
        if p is not None:
            _stop(p)

    def close(self):
        for uid in list(self.monitors):
            self.stop_monitor(uid)
        if self.init is not None:
            try:  # PID 1 of the pod: when it dies the kernel kills libvirtd and QEMU
                os.kill(self._pid1, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
            _stop(self.init)
            self.init = None


def _readlink(p):
    try:
        return os.readlink(p)
    except OSError:
        return None


def _stop(p, timeout=5.0):
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout)


def remove_tree(path):
    shutil.rmtree(path, ignore_errors=True)
