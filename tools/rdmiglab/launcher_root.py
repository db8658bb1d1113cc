"""Cached Debian 13 (trixie) root filesystem for non-root stand-in virt-launcher pods.

KubeVirt 1.9's launchers run an unprivileged libvirt daemon (session mode, uid/gid 107)
with QEMU 10 and libvirt 11. Debian 13 ships QEMU 10.0 and libvirt 11.3, so the
``trixie-nonroot`` launcher flavour (kvpod.LauncherPod) chroots into this root.

The root is built once per machine, outside the git clone, so that CI runs on the same
machine reuse it: ``$RDMIG_LAUNCHER_CACHE`` (default /var/cache/rdmig) /launcher-trixie-v<N>.
A build goes to a temporary dir next to it and is renamed into place when complete; a file
lock keeps two builders apart. Bump ``VERSION`` whenever the recipe changes.

A second root, ``qemu-trixie-backports-v<N>``, is the launcher root with QEMU from Debian 13's
backports (11.1 on 2026-12-07) in place of 10.0: the rows about what only QEMU 10.1 and later
do (post-copy together with multifd) run it (``ensure_backports_root()``; rdmiglab.qemu's
``backports_qemu()``). KubeVirt 1.9's launchers ship 10.0, so every other row keeps 10.0.

Usage: PYTHONPATH=tools python3 -m rdmiglab.launcher_root [--rebuild] [--backports]   (prints the path)
"""
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import time

VERSION = 1
NAME = "launcher-trixie-v%d" % VERSION
STAMP = ".rdmig-launcher-root"  # written last, inside the root, before the rename
MIRROR = os.environ.get("RDMIG_DEBIAN_MIRROR", "http://deb.debian.org/debian")
QEMU_UID = QEMU_GID = 107  # KubeVirt's qemu user
PACKAGES = [
    "qemu-system-x86", "libvirt-daemon", "libvirt-daemon-driver-qemu", "libvirt-clients",
    # BIOS/option ROMs for qemu-system-x86_64's pc machine (seabios is a Depends already;
    # spelled out so that a Recommends-only change in Debian does not break TCG starts)
    "seabios", "ipxe-qemu",
]

# Both recipes run inside a private mount namespace (unshare -m), so the mounts vanish with it:
# the root's /proc and /dev, no service started by a package (policy-rc.d), the host's resolver.
# The script after it installs, then APT_EPILOGUE cleans up.
APT_PROLOGUE = r"""
set -eu
R="$1"; shift
mount -t proc proc "$R/proc"
mount --rbind /dev "$R/dev"
printf '#!/bin/sh\nexit 101\n' > "$R/usr/sbin/policy-rc.d"
chmod 755 "$R/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$R/etc/resolv.conf" 2>/dev/null || true
export DEBIAN_FRONTEND=noninteractive LC_ALL=C PATH=/usr/sbin:/usr/bin:/sbin:/bin
"""
APT_EPILOGUE = r"""
chroot "$R" apt-get clean
rm -rf "$R"/var/lib/apt/lists/*
rm -f "$R/usr/sbin/policy-rc.d"
"""

# The launcher root (after debootstrap): KubeVirt's qemu user, then the packages.
CHROOT_SCRIPT = APT_PROLOGUE + r"""
mount --rbind /sys "$R/sys"
# KubeVirt's qemu user: created before libvirt's packages so none of their system
# users takes uid/gid 107
chroot "$R" groupadd --system --gid 107 qemu
chroot "$R" useradd --system --uid 107 --gid 107 --no-create-home --home-dir /var/run/kubevirt-private \
    --shell /usr/sbin/nologin qemu
chroot "$R" apt-get update
chroot "$R" apt-get install -y --no-install-recommends "$@"
""" + APT_EPILOGUE


BACKPORTS_VERSION = 1
BACKPORTS_NAME = "qemu-trixie-backports-v%d" % BACKPORTS_VERSION
BACKPORTS_PACKAGES = ["qemu-system-x86", "seabios", "ipxe-qemu"]
BACKPORTS_MIN_QEMU = (10, 1)

# Over a copy of the launcher root: backports' QEMU installed over trixie's (first argument after
# the root: the mirror).
BACKPORTS_SCRIPT = APT_PROLOGUE + r"""
M="$1"; shift
echo "deb $M trixie-backports main" > "$R/etc/apt/sources.list.d/trixie-backports.list"
chroot "$R" apt-get update
chroot "$R" apt-get install -y --no-install-recommends -t trixie-backports "$@"
""" + APT_EPILOGUE


def cache_dir():
    return os.environ.get("RDMIG_LAUNCHER_CACHE", "/var/cache/rdmig")


def root_path():
    return os.path.join(cache_dir(), NAME)


def backports_root_path():
    return os.path.join(cache_dir(), BACKPORTS_NAME)


def is_complete(path=None):
    return os.path.isfile(os.path.join(path or root_path(), STAMP))


def qemu_package_version(root):
    """The version of qemu-system-x86 that dpkg in ``root`` says is installed, or None."""
    try:
        with open(os.path.join(root, "var/lib/dpkg/status"), encoding="utf-8", errors="replace") as f:
            stanzas = f.read().split("\n\n")
    except OSError:
        return None
    for st in stanzas:
        fields = dict(l.split(": ", 1) for l in st.splitlines() if ": " in l and not l.startswith(" "))
        if fields.get("Package") == "qemu-system-x86" and fields.get("Status", "").split()[-1:] == ["installed"]:
            return fields.get("Version")
    return None


def is_backports_version(version):
    return version is not None and "bpo" in version


def _launcher_root_sound(path):
    """A stamped launcher root must still have trixie's own QEMU: a backports build that
    reached it through a symlinked cache once put 11.1 there, and every row that means
    KubeVirt 1.9's QEMU 10.0 then ran 11.1 (CI of 2026-12-07)."""
    v = qemu_package_version(path)
    return v is not None and not is_backports_version(v)


def _backports_root_sound(path):
    return is_backports_version(qemu_package_version(path))


def _log(msg):
    sys.stderr.write("launcher_root: %s\n" % msg)
    sys.stderr.flush()


def _remove_stale(base):
    for d in glob.glob(base + ".tmp-*"):
        _log("removing stale partial build %s" % d)
        # A crashed build's mounts lived in its own namespace and are gone; refuse to
        # rmtree through a mount point anyway.
        with open("/proc/self/mounts") as f:
            if any(line.split()[1].startswith(d + "/") for line in f):
                raise RuntimeError("%s still has mounts; unmount them first" % d)
        shutil.rmtree(d)


def build(dest, timeout=1800):
    tmp = "%s.tmp-%d" % (dest, os.getpid())
    t0 = time.monotonic()
    _log("debootstrap --variant=minbase trixie %s %s" % (tmp, MIRROR))
    subprocess.run(["debootstrap", "--variant=minbase", "trixie", tmp, MIRROR],
                   check=True, timeout=timeout, stdout=sys.stderr)
    t1 = time.monotonic()
    _log("debootstrap took %.0f s; installing %s" % (t1 - t0, " ".join(PACKAGES)))
    subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                    "sh", "-c", CHROOT_SCRIPT, "sh", tmp] + PACKAGES,
                   check=True, timeout=timeout, stdout=sys.stderr)
    t2 = time.monotonic()
    for p in ("usr/bin/qemu-system-x86_64", "usr/sbin/libvirtd", "usr/bin/setpriv"):
        if not os.path.exists(os.path.join(tmp, p)):
            raise RuntimeError("launcher root lacks /%s" % p)
    with open(os.path.join(tmp, STAMP), "w") as f:
        f.write("%s built %s: debootstrap %.0f s, packages %.0f s\n"
                % (NAME, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), t1 - t0, t2 - t1))
    os.rename(tmp, dest)
    _log("built %s in %.0f s" % (dest, time.monotonic() - t0))


def _ensure(dest, builder, rebuild, sound):
    if not rebuild and is_complete(dest) and sound(dest):  # fast path: no lock for a finished root
        return dest
    os.makedirs(cache_dir(), exist_ok=True)
    with open(dest + ".lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)  # another builder: wait for it, then reuse its root
        if not rebuild and is_complete(dest) and not sound(dest):
            # A root that is already wrong is replaced even if a row runs from it now: that row
            # runs the wrong QEMU either way, and every later one gets the right one.
            _log("%s has qemu-system-x86 %s, not what its recipe installs: building it again"
                 % (dest, qemu_package_version(dest)))
            rebuild = True
        if rebuild and os.path.lexists(dest):
            if os.path.islink(dest):
                os.unlink(dest)
            else:
                old = "%s.tmp-old-%d" % (dest, os.getpid())
                os.rename(dest, old)
                shutil.rmtree(old)
        if is_complete(dest):
            return dest
        _remove_stale(dest)
        if os.path.islink(dest):  # a link (dangling or to an incomplete root): the build puts a directory here
            os.unlink(dest)
        elif os.path.exists(dest):  # incomplete root without a stamp (should not happen)
            shutil.rmtree(dest)
        builder(dest)
    return dest


def ensure_launcher_root(rebuild=False):
    """Returns the path of the cached trixie launcher root; builds it if missing."""
    return _ensure(root_path(), build, rebuild, _launcher_root_sound)


def build_backports(dest, timeout=1800):
    """The launcher root copied, then QEMU from trixie-backports installed over its 10.0 (about
    10 s and 40 MB of packages once the launcher root exists)."""
    # realpath: with a symlinked launcher root, "cp -a" copies the link, and apt would install
    # backports' QEMU into the launcher root itself
    base = os.path.realpath(ensure_launcher_root())
    tmp = "%s.tmp-%d" % (dest, os.getpid())
    t0 = time.monotonic()
    subprocess.run(["cp", "-a", base + "/.", tmp], check=True, timeout=timeout)
    if os.path.islink(tmp) or not os.path.isdir(tmp):
        raise RuntimeError("%s: the copy of %s is not a directory of its own" % (tmp, base))
    os.unlink(os.path.join(tmp, STAMP))
    _log("installing %s from trixie-backports into a copy of %s" % (" ".join(BACKPORTS_PACKAGES), base))
    subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                    "sh", "-c", BACKPORTS_SCRIPT, "sh", tmp, MIRROR] + BACKPORTS_PACKAGES,
                   check=True, timeout=timeout, stdout=sys.stderr)
    from .qemu import _root_qemu, qemu_version  # its argv for a root (qemu imports this module lazily)
    version = qemu_version(*_root_qemu(tmp))
    if version < BACKPORTS_MIN_QEMU:
        raise RuntimeError("trixie-backports gave QEMU %d.%d, older than %d.%d" % (version + BACKPORTS_MIN_QEMU))
    if not _launcher_root_sound(base):
        raise RuntimeError("building %s changed the launcher root %s (qemu-system-x86 %s)"
                           % (tmp, base, qemu_package_version(base)))
    with open(os.path.join(tmp, STAMP), "w") as f:
        f.write("%s built %s from %s: QEMU %d.%d, %.0f s\n"
                % (BACKPORTS_NAME, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), NAME,
                   version[0], version[1], time.monotonic() - t0))
    os.rename(tmp, dest)
    _log("built %s (QEMU %d.%d) in %.0f s" % (dest, version[0], version[1], time.monotonic() - t0))


def ensure_backports_root(rebuild=False):
    """Returns the path of the cached root with trixie-backports' QEMU; builds it if missing."""
    return _ensure(backports_root_path(), build_backports, rebuild, _backports_root_sound)


def main(argv):
    t0 = time.monotonic()
    ensure = ensure_backports_root if "--backports" in argv else ensure_launcher_root
    path = ensure(rebuild="--rebuild" in argv)
    _log("ready in %.3f s" % (time.monotonic() - t0))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
