"""The Dockerfile, really built: Debian's podman builds it here and both programs run inside the image.

No Docker engine runs on these machines, and crun cannot start containers under this kernel's
cgroup setup, so the build uses podman with `--isolation chroot` (no OCI runtime: each RUN step is a
chroot into the layer) and `--network host` (apt-get in the build reaches the host's network).
The two base images do not come from a registry: `debootstrap --variant=minbase bookworm` makes a
Debian 12 root with the apt sources the real debian:12 image has (bookworm, bookworm-updates and
bookworm-security: debootstrap alone would give bookworm only, older than a real build's packages),
`podman import` turns it into an image tagged `docker.io/library/debian:12` and
`docker.io/library/debian:12-slim`, and the build runs with `--pull=never`. The build stage compiles
the project inside the image, with the checkout's git revision as the RDMIG_REVISION build argument.
Its ccache cache mount is the host's ccache directory ($CCACHE_DIR, scripts/cache-env.sh) when one
is set: the Dockerfile hashes paths as scripts/build.sh does, so with the same Debian packages on
the host and in the image the compile finds the objects the suite's own build just made. ccache hashes the locale
too: the build stage has LANG=C.UTF-8, as Debian's hosts (a host compile under another LANG
misses). Without it, the cold run of 2026-12-05 21:11 had 0 hits of 26; with it, here after a
whole run's build, 23 hits and 3 misses, the podman build 52 s. Printed: its hits and misses.

Checked inside the built image (`podman create` + `podman mount`, then chroot, no runtime needed):
both programs' `--version` names the version of CMakeLists.txt and the checkout's revision; the
agent's `--check-config` passes on the image's own /etc/rdmig/agent.yaml once a token file is there,
and fails (exit 2, key named) without one and on a bad chunk size; the controller's `--check-config`
passes on /etc/rdmig/controller.yaml as the image's user 65532; the runtime image holds no compiler.
Printed: the build time and the image size. The minbase stand-in for debian:12-slim is not the real
slim image (slim drops docs, man pages and locales that minbase keeps), so the size is an upper
bound of what `docker build` on the real bases gives.

Cache: $RDMIG_IMAGE_CACHE (scripts/test.sh: /var/cache/rdmig/image-test, outside the clone so that every
clone reuses it; else .cache/image-test/, gitignored) holds the debootstrap tarball
(made again when older than 14 days), podman's storage, and tmp/buildah-cache/rdmig-ccache, the
Dockerfile's ccache cache mount (a link to $CCACHE_DIR when set; ccache bounds it). Each run keeps only the images of its
own build (tagged rdmig-image-test and rdmig-image-test-build, so the next run reuses the package
layers) and the bases, and prunes the rest, so the cache does not grow run after run. Storage
driver: overlay where the kernel and the file system allow it, else vfs
(RDMIG_PODMAN_STORAGE_DRIVER=vfs forces it; vfs copies every layer in full, several GiB).

Needs root, podman and debootstrap (scripts/install-deps.sh --test) and Debian's mirror.
Run: python3 tests/deploy/test_image_build.py -v   (ctest -R deploy_image_build; ~5-10 min cold)
"""
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CACHE = os.environ.get("RDMIG_IMAGE_CACHE", os.path.join(REPO, ".cache", "image-test"))
# -v2: with the real image's apt sources (an older tarball without them is removed).
BASE_TAR = os.path.join(CACHE, "debian-bookworm-minbase-v2.tar")
OLD_BASE_TARS = (os.path.join(CACHE, "debian-bookworm-minbase.tar"),)
BASE_MAX_AGE_S = 14 * 24 * 3600
BASES = ("docker.io/library/debian:12", "docker.io/library/debian:12-slim")
IMAGE = "localhost/rdmig-image-test:latest"
BUILD_IMAGE = "localhost/rdmig-image-test-build:latest"
MIRROR = os.environ.get("RDMIG_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SECURITY_MIRROR = os.environ.get("RDMIG_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")
# /etc/apt/sources.list.d/debian.sources of the debian:12 image on Docker Hub.
IMAGE_SOURCES = """Types: deb
URIs: %s
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: %s
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
""" % (MIRROR, SECURITY_MIRROR)
TOKEN = "image-test-token-0123456789abcdef"


def log(msg):
    sys.stderr.write("image-test: %s\n" % msg)
    sys.stderr.flush()


def storage_driver():
    forced = os.environ.get("RDMIG_PODMAN_STORAGE_DRIVER")
    if forced:
        return forced
    # On the cache's file system (overlay needs d_type and no overlay below it); podman wants a
    # run root path under 50 characters.
    probe = tempfile.mkdtemp(prefix="overlay-probe-", dir=CACHE)
    run = tempfile.mkdtemp(prefix="rdmig-probe-", dir="/run")
    try:
        r = subprocess.run(["podman", "--root", probe, "--runroot", run, "--storage-driver", "overlay", "info"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            log("overlay storage unusable here, vfs instead: %s" % r.stderr.strip()[-300:])
        return "overlay" if r.returncode == 0 else "vfs"
    finally:
        for d in (probe, run):
            subprocess.run(["umount", "-R", d], capture_output=True)
            shutil.rmtree(d, ignore_errors=True)


class Podman:
    def __init__(self, driver):
        self.driver = driver
        # The run root (locks, mount counts) belongs on a tmpfs that a reboot clears: /run.
        runroot = "/run/rdmig-image-test-%s-%s" % (hashlib.sha256(CACHE.encode()).hexdigest()[:8], driver)
        self.base = ["podman", "--root", os.path.join(CACHE, "storage-" + driver),
                     "--runroot", runroot, "--storage-driver", driver,
                     "--cgroup-manager", "cgroupfs", "--events-backend", "file"]

    def __call__(self, *args, check=True, **kw):
        r = subprocess.run(self.base + list(args), capture_output=True, text=True, **kw)
        if check and r.returncode != 0:
            raise AssertionError("podman %s failed (%d):\n%s%s" % (" ".join(args), r.returncode,
                                                                 r.stdout[-4000:], r.stderr[-4000:]))
        return r

    def remove_build_containers(self):
        """Every container in this storage, buildah's working containers ("external") included."""
        ids = self("ps", "-a", "--external", "-q", check=False).stdout.split()
        if ids:
            self("rm", "-f", *ids, check=False)

    def exists(self, image):
        return self("image", "exists", image, check=False).returncode == 0


def make_base_tarball():
    """debootstrap --variant=minbase bookworm, packed as a tarball for podman import (~1-2 min)."""
    root = tempfile.mkdtemp(prefix="rootfs-", dir=CACHE)
    try:
        t0 = time.monotonic()
        r = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", root, MIRROR],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError("debootstrap failed (%d):\n%s%s" % (r.returncode, r.stdout[-3000:],
                                                                   r.stderr[-3000:]))
        apt = os.path.join(root, "etc", "apt")
        if os.path.exists(os.path.join(apt, "sources.list")):
            os.remove(os.path.join(apt, "sources.list"))
        os.makedirs(os.path.join(apt, "sources.list.d"), exist_ok=True)
        with open(os.path.join(apt, "sources.list.d", "debian.sources"), "w") as f:
            f.write(IMAGE_SOURCES)
        subprocess.run(["tar", "-C", root, "--numeric-owner", "-cf", BASE_TAR + ".tmp", "."], check=True)
        os.replace(BASE_TAR + ".tmp", BASE_TAR)
        for old in OLD_BASE_TARS:
            if os.path.exists(old):
                os.remove(old)
        log("debootstrap minbase bookworm: %.0f s" % (time.monotonic() - t0))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def link_ccache_mount(tmpdir):
    """Makes the Dockerfile's ccache cache mount (id rdmig-ccache) the host's $CCACHE_DIR, so the
    image's compile reuses what scripts/build.sh compiled (the Dockerfile's CCACHE_BASEDIR and
    CCACHE_NOHASHDIR match scripts/cache-env.sh's). Without one, the mount stays a directory of its
    own in the cache. Returns the host's ccache directory, or None."""
    mount = os.path.join(tmpdir, "buildah-cache", "rdmig-ccache")
    os.makedirs(os.path.dirname(mount), exist_ok=True)
    host = os.environ.get("CCACHE_DIR")
    if not host or not os.path.isdir(host) or not shutil.which("ccache"):
        if os.path.islink(mount):
            os.remove(mount)
        return None
    host = os.path.realpath(host)
    if os.path.islink(mount) and os.path.realpath(mount) == host:
        return host
    if os.path.islink(mount) or os.path.isfile(mount):
        os.remove(mount)
    elif os.path.isdir(mount):
        shutil.rmtree(mount)
    os.symlink(host, mount)
    return host


def ccache_counts(ccache_dir):
    """(hits, misses) of a ccache directory's counters, or None."""
    if not ccache_dir:
        return None
    r = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True,
                       env=dict(os.environ, CCACHE_DIR=ccache_dir))
    if r.returncode != 0:
        return None
    stats = dict(line.split("\t", 1) for line in r.stdout.splitlines() if "\t" in line)
    hits = sum(int(stats.get(k, 0)) for k in ("direct_cache_hit", "preprocessed_cache_hit"))
    return hits, int(stats.get("cache_miss", 0))


def git_revision():
    r = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown"


def project_version():
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        return re.search(r"project\(rdmig VERSION (\S+)", f.read()).group(1)


@unittest.skipUnless(os.geteuid() == 0, "podman's chroot isolation and chroot into the image need root")
class ImageBuildTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            cls.build_image()
        except BaseException:
            cls.tearDownClass()  # unittest skips it when setUpClass fails
            raise

    @classmethod
    def build_image(cls):
        with open(os.path.join(REPO, ".dockerignore")) as f:
            ignored = f.read().split()
        if os.path.commonpath([CACHE, REPO]) == REPO and ".cache" not in ignored:
            raise AssertionError(".dockerignore must hold .cache: the build context would carry podman's storage")
        for tool in ("podman", "debootstrap", "chroot", "tar"):
            if shutil.which(tool) is None:
                raise AssertionError("'%s' is missing (scripts/install-deps.sh --test)" % tool)
        os.makedirs(CACHE, exist_ok=True)
        # One run at a time: two builds in one podman storage would fight over the tags.
        cls.lock = open(os.path.join(CACHE, ".lock"), "w")
        fcntl.flock(cls.lock, fcntl.LOCK_EX)
        cls.podman = Podman(storage_driver())
        log("podman storage driver: %s, cache %s" % (cls.podman.driver, CACHE))
        cls.podman.remove_build_containers()  # left by a build that was killed

        fresh = not os.path.exists(BASE_TAR) or time.time() - os.path.getmtime(BASE_TAR) > BASE_MAX_AGE_S
        if fresh:
            make_base_tarball()
        if fresh or not all(cls.podman.exists(b) for b in BASES):
            cls.podman("import", BASE_TAR, BASES[0])
            cls.podman("tag", BASES[0], BASES[1])

        cls.revision = git_revision()
        cls.build_log = os.path.join(CACHE, "build.log")
        common = ["build", "--isolation", "chroot", "--network", "host", "--pull=never", "--layers",
                  "--build-arg", "RDMIG_REVISION=" + cls.revision, "-f", os.path.join(REPO, "Dockerfile")]
        t0 = time.monotonic()
        # buildah keeps the Dockerfile's cache mounts (the compile's ccache objects) under
        # $TMPDIR/buildah-cache: in the cache, so that a build after a source change recompiles only
        # what changed; the ccache one is the host's ccache when there is one.
        env = dict(os.environ, TMPDIR=os.path.join(CACHE, "tmp"))
        host_ccache = link_ccache_mount(env["TMPDIR"])
        before = ccache_counts(host_ccache)
        with open(cls.build_log, "w") as out:
            r = subprocess.run(cls.podman.base + common + ["-t", IMAGE, REPO], stdout=out,
                               stderr=subprocess.STDOUT, env=env)
        cls.build_seconds = time.monotonic() - t0
        after = ccache_counts(host_ccache)
        if before and after:
            # Other builds may share the cache meanwhile (ctest runs rows side by side): an upper bound.
            log("image compile through the host's ccache %s: %d hits, %d misses"
                % (host_ccache, after[0] - before[0], after[1] - before[1]))
        if r.returncode != 0:
            with open(cls.build_log) as f:
                tail = f.read()[-6000:]
            raise AssertionError("podman build failed (%d), log %s:\n%s" % (r.returncode, cls.build_log, tail))
        with open(cls.build_log) as f:
            text = f.read()
        cls.cached_steps = text.count("Using cache")
        # Tag the build stage's last layer so that the prune below keeps the build stage's layers for
        # the next run (a second `build --target build` would see a tree others may have changed since).
        build_stage = text.split("\n[2/2] ", 1)[0]
        ids = re.findall(r"^--> ([0-9a-f]{8,})$", build_stage, re.M)
        if not ids:
            raise AssertionError("no build-stage image id in %s" % cls.build_log)
        cls.podman("tag", ids[-1], BUILD_IMAGE)
        log("podman build: %.0f s (%d steps from the layer cache), revision %s"
            % (cls.build_seconds, cls.cached_steps, cls.revision))

        cls.container = cls.podman("create", IMAGE, "/bin/true").stdout.strip().splitlines()[-1]
        cls.root = cls.podman("mount", cls.container).stdout.strip()

    @classmethod
    def tearDownClass(cls):
        podman = getattr(cls, "podman", None)
        if podman is not None:
            if getattr(cls, "container", None):
                podman("umount", cls.container, check=False)
            podman.remove_build_containers()
            # Previous runs' images and intermediate layers: everything untagged goes.
            podman("image", "prune", "-f", check=False)
            du = subprocess.run(["du", "-sh", podman.base[2]], capture_output=True, text=True).stdout.split()
            log("podman storage after prune: %s" % (du[0] if du else "?"))
        if getattr(cls, "lock", None):
            cls.lock.close()

    def chroot(self, *argv, user=None):
        cmd = ["chroot"] + (["--userspec=%s" % user] if user else []) + [self.root] + list(argv)
        return subprocess.run(cmd, capture_output=True, text=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})

    def write_token(self, text):
        path = os.path.join(self.root, "etc", "rdmig", "token")
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)  # as a Secret volume mounts it by default
        self.addCleanup(lambda: os.path.exists(path) and os.remove(path))

    def test_both_programs_print_version_and_revision(self):
        want = "%s (revision %s)" % (project_version(), self.revision)
        for prog in ("rdmig-agent", "rdmig-controller"):
            r = self.chroot("/usr/local/bin/" + prog, "--version")
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertEqual(r.stdout.strip(), "%s %s" % (prog, want))
            log(r.stdout.strip())

    def test_agent_checks_its_own_config_in_the_image(self):
        r = self.chroot("/usr/local/bin/rdmig-agent", "--check-config", "/etc/rdmig/agent.yaml")
        self.assertEqual(r.returncode, 2, "no token file yet: %s%s" % (r.stdout, r.stderr))
        self.assertIn("api.tokenFile", r.stderr)
        self.write_token(TOKEN + "\n")
        r = self.chroot("/usr/local/bin/rdmig-agent", "--check-config", "/etc/rdmig/agent.yaml")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        log("agent --check-config /etc/rdmig/agent.yaml: %s" % (r.stdout.strip() or "exit 0"))
        bad = os.path.join(self.root, "tmp", "bad-agent.yaml")
        with open(bad, "w") as f:
            f.write("migration:\n  chunkSize: 3Mi\n")
        self.addCleanup(os.remove, bad)
        r = self.chroot("/usr/local/bin/rdmig-agent", "--check-config", "/tmp/bad-agent.yaml")
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("chunkSize", r.stderr)

    def test_controller_checks_its_own_config_as_the_image_user(self):
        self.write_token(TOKEN + "\n")
        r = self.chroot("/usr/local/bin/rdmig-controller", "--check-config", "/etc/rdmig/controller.yaml",
                        user="65532:65532")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_runtime_image_holds_no_build_tools_and_report_size(self):
        for tool in ("usr/bin/g++", "usr/bin/cmake", "usr/include/infiniband/verbs.h"):
            self.assertFalse(os.path.exists(os.path.join(self.root, tool)), "%s in the runtime image" % tool)
        size = int(self.podman("image", "inspect", IMAGE, "--format", "{{.Size}}").stdout.strip())
        base = int(self.podman("image", "inspect", BASES[1], "--format", "{{.Size}}").stdout.strip())
        log("image size %.0f MB (base %.0f MB + %.0f MB of rdmig's layers); an upper bound: the base "
            "here is a debootstrap minbase stand-in for debian:12-slim" % (size / 1e6, base / 1e6, (size - base) / 1e6))
        self.assertLess(size, 1000 * 1000 * 1000, "runtime image over 1 GB: build packages leaked into it?")


if __name__ == "__main__":
    unittest.main()
