"""Starts and drives a QEMU (TCG) test guest built by tools/guest/build-guest.sh."""
import hashlib
import os
import re
import signal
import subprocess
import time

from .qmp import QmpClient, QmpError

COUNTER_RE = re.compile(rb"^rdmig-counter (\d+)\r?$", re.M)
# The memory verifier's lines (tools/guest/verify.c; a guest started with rdmig.verify_mib=N).
VERIFY_RE = re.compile(rb"^rdmig-verify-counter (\d+) checked=(\d+) scans=(\d+) writes=(\d+) mismatches=(\d+)\r?$", re.M)
MISMATCH_RE = re.compile(rb"^rdmig-verify-mismatch .*$", re.M)
# The guest kernel killing the verifier (out of memory): it never reports again.
VERIFY_KILLED_RE = re.compile(rb"^.*Killed process .*\(rdmig-verify\).*$", re.M)


def verifier_state(serial_log):
    """The memory verifier's state from a guest's serial log: {"counter", "checked", "scans",
    "writes", "mismatches", "mismatch_lines"} of its last complete line (counter None before any),
    and "killed": the guest kernel's line that killed it (out of memory), or None."""
    try:
        with open(serial_log, "rb") as f:
            data = f.read()
    except OSError:
        data = b""
    data = data[:data.rfind(b"\n") + 1]
    lines = VERIFY_RE.findall(data)
    bad = [m.decode(errors="replace") for m in MISMATCH_RE.findall(data)]
    killed = VERIFY_KILLED_RE.search(data)
    killed = killed.group(0).decode(errors="replace").strip() if killed else None
    if not lines:
        return {"counter": None, "checked": 0, "scans": 0, "writes": 0, "mismatches": 0, "mismatch_lines": bad,
                "killed": killed}
    c, checked, scans, writes, mism = (int(x) for x in lines[-1])
    return {"counter": c, "checked": checked, "scans": scans, "writes": writes,
            "mismatches": max(mism, max(int(l[4]) for l in lines)), "mismatch_lines": bad, "killed": killed}


def _root_qemu(r):
    libs = "%s/usr/lib/x86_64-linux-gnu:%s/lib/x86_64-linux-gnu" % (r, r)
    argv = [r + "/lib64/ld-linux-x86-64.so.2", "--library-path", libs, r + "/usr/bin/qemu-system-x86_64",
            "-L", r + "/usr/share/qemu", "-L", r + "/usr/share/seabios"]
    return argv, {"QEMU_MODULE_DIR": r + "/usr/lib/x86_64-linux-gnu/qemu"}


def trixie_qemu():
    """(argv prefix, extra environment) that run Debian 13's QEMU 10.0 on this host straight
    from the cached launcher root (``launcher_root.ensure_launcher_root()``, built once per
    machine outside the clone): its own dynamic loader and libraries, its modules and firmware.

    Why: the host's QEMU 7.2 under TCG leaves a few pages different after some migrations even
    QEMU to QEMU (seen: 4-15 pages of a 256 MiB guest with 2 multifd channels and a bandwidth
    cap, on the direct path too), which would hide a difference rdmig made; QEMU 10.0 migrated
    those shapes byte-exact (test_direct_migration.py checks that control first)."""
    from .launcher_root import ensure_launcher_root
    return _root_qemu(ensure_launcher_root())


def backports_qemu():
    """(argv prefix, extra environment) that run trixie-backports' QEMU (11.1 on 2026-12-07, at
    least 10.1) from its cached root (``launcher_root.ensure_backports_root()``): for what only
    QEMU 10.1 and later do, post-copy together with multifd."""
    from .launcher_root import ensure_backports_root
    return _root_qemu(ensure_backports_root())


def default_qemu():
    """(argv prefix, environment) of the QEMU a QemuVm runs when the caller names none.

    ctest sets RDMIG_TEST_QEMU=10 for the rows with guests that are not about a QEMU version
    (tests/CMakeLists.txt): they run Debian 13's QEMU 10, as KubeVirt 1.9 ships. The host's QEMU
    7.2 under TCG loses dirty pages when the machine is busy (direct QEMU-to-QEMU migrations, no
    rdmig in the path: 0 pages differing when run alone, 61 and 23 when run beside another guest
    test, the guest crashing on the second), and the suite runs guest tests side by side; the rows
    about 7.2 name it and tolerate that. Elsewhere (the demo, by hand): the host's QEMU."""
    if os.environ.get("RDMIG_TEST_QEMU") == "10":
        return trixie_qemu()
    return "qemu-system-x86_64", {}


def qemu_version(argv_prefix, env=None):
    """(major, minor) of the QEMU that ``argv_prefix`` runs."""
    out = subprocess.run(list(argv_prefix) + ["--version"], capture_output=True, text=True,
                         env=dict(os.environ, **(env or {})), check=True).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def differing_pages(src, dst, page=4096):
    """Guest-physical page numbers whose content differs between two stopped QemuVms."""
    a_path = os.path.join(src.workdir, src.name + ".cmp.mem")
    b_path = os.path.join(dst.workdir, dst.name + ".cmp.mem")
    src.memory_digest(path=a_path, keep=True)
    dst.memory_digest(path=b_path, keep=True)
    pages = []
    try:
        with open(a_path, "rb") as a, open(b_path, "rb") as b:
            n = 0
            while True:
                x, y = a.read(page * 256), b.read(page * 256)
                if not x and not y:
                    break
                if x != y:
                    for i in range(0, max(len(x), len(y)), page):
                        if x[i:i + page] != y[i:i + page]:
                            pages.append(n + i // page)
                n += 256
    finally:
        for p in (a_path, b_path):
            if os.path.exists(p):
                os.unlink(p)
    return pages


def guest_fate(vm, last_counter, timeout=60.0):
    """After cont() on a target whose memory QEMU itself left different (QEMU 7.2's TCG): "ran on
    (counter N)", or what stopped it (the guest may crash on the corrupted pages). For the record:
    a row that cannot require the guest to survive QEMU's own fault still says what happened."""
    try:
        return "ran on (counter %d)" % vm.wait_for_counter(last_counter + 1, timeout=timeout)
    except Exception as e:  # QEMU exited (the guest's panic, -no-reboot) or the counter stalled
        return "did not run on: %s" % str(e).splitlines()[0][:200]


class QemuGone(BrokenPipeError):
    """A QEMU whose monitor no longer answers, with its exit code and stderr tail in the message.
    An OSError (as the broken pipe itself was), so a caller that expects a QEMU to be gone can
    still catch it as one."""


class QemuVm:
    """One qemu-system-x86_64 process.

    Files live in ``workdir``: ``<name>.qmp`` (QMP socket), ``<name>.serial.log``,
    ``<name>.stderr.log``. ``kernel``/``initrd`` default to ``guest.ensure_guest()``.
    """

    def __init__(self, workdir, name="vm", mem_mib=512, dirty_mib=64, interval=1,
                 kernel=None, initrd=None, incoming_defer=False, paused=False,
                 extra_args=(), extra_append="", qemu_binary=None,
                 start=True, start_timeout=30.0, firmware_only=False, blob=None, env=None):
        """``firmware_only``: no kernel, the guest runs only its firmware (fast under nested
        TCG); ``blob``: a file loaded into guest RAM at 16 MiB so memory has content; ``env``:
        extra environment for the QEMU process (e.g. a faked clock). ``qemu_binary``: a program
        name, or an argv prefix (list) such as ``trixie_qemu()[0]`` (then pass its environment
        in ``env``). Without one: Debian 13's QEMU 10 when $RDMIG_TEST_QEMU is 10 (the suite's
        rows that are not about a QEMU version: see default_qemu()), else the host's."""
        if qemu_binary is None:
            qemu_binary, default_env = default_qemu()
            env = dict(default_env, **(env or {}))
        self.env = dict(os.environ, **(env or {}))
        if firmware_only:
            kernel = initrd = None
        elif kernel is None or initrd is None:
            from .guest import ensure_guest
            kernel, initrd = ensure_guest()
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.name = name
        self.mem_mib = int(mem_mib)
        self.mem_bytes = self.mem_mib * 1024 * 1024
        self.dirty_mib = dirty_mib
        self.interval = interval
        self.kernel = kernel
        self.initrd = initrd
        self.incoming_defer = incoming_defer
        self.paused = paused
        self.qmp_path = os.path.join(self.workdir, name + ".qmp")
        # A second monitor for rdmig-agent: QEMU serves one client per QMP socket, and the
        # tests keep their own connection on qmp_path.
        self.agent_qmp_path = os.path.join(self.workdir, name + ".agent.qmp")
        self.serial_log = os.path.join(self.workdir, name + ".serial.log")
        self.stderr_log = os.path.join(self.workdir, name + ".stderr.log")
        append = "console=ttyS0 quiet panic=-1 rdmig.dirty_mib=%s rdmig.interval=%s" % (
            dirty_mib, interval)
        if extra_append:
            append += " " + extra_append
        prefix = [qemu_binary] if isinstance(qemu_binary, str) else list(qemu_binary)
        self.argv = prefix + [
            "-accel", "tcg", "-nodefaults", "-display", "none",
            "-m", str(self.mem_mib), "-smp", "1",
        ]
        if not firmware_only:
            self.argv.append("-no-reboot")  # SeaBIOS alone reboots to retry booting
        if not firmware_only:
            self.argv += ["-kernel", kernel, "-initrd", initrd, "-append", append]
        if blob:
            self.argv += ["-device", "loader,file=%s,addr=0x1000000,force-raw=on" % blob]
        self.argv += [
            "-chardev", "file,id=ser0,path=%s" % self.serial_log,
            "-serial", "chardev:ser0",
            "-qmp", "unix:%s,server=on,wait=off" % self.qmp_path,
            "-qmp", "unix:%s,server=on,wait=off" % self.agent_qmp_path,
            "-nic", "none",
        ]
        if incoming_defer:
            self.argv += ["-incoming", "defer"]
        if paused:
            self.argv += ["-S"]
        self.argv += list(extra_args)
        self.proc = None
        self._qmp = None
        if start:
            self.start(start_timeout)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout=30.0):
        for p in (self.qmp_path, self.agent_qmp_path, self.serial_log):
            if os.path.exists(p):
                os.unlink(p)
        with open(self.stderr_log, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                         stdout=err, stderr=subprocess.STDOUT,
                                         cwd=self.workdir, start_new_session=True, env=self.env)
        try:
            self._qmp = QmpClient(self.qmp_path, timeout=timeout, alive=self.alive)
        except Exception as e:
            self.kill()
            raise RuntimeError("%s: QEMU did not come up: %s; stderr: %s"
                               % (self.name, e, self.stderr_text())) from e
        return self

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    @property
    def qmp_client(self):
        return self._qmp

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stderr_text(self):
        try:
            with open(self.stderr_log, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout=10.0):
        """Asks QEMU to quit, waits up to ``timeout`` s, then SIGKILLs. Returns exit code."""
        if self.proc is None:
            return None
        if self.alive() and self._qmp is not None:
            try:
                self._qmp.command("quit", timeout=min(timeout, 5.0))
            except (QmpError, OSError, TimeoutError, ConnectionError, ValueError):
                pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_qmp()
        return self.proc.returncode

    def kill(self):
        """SIGKILLs QEMU and reaps it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._close_qmp()

    def _close_qmp(self):
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- QMP ---------------------------------------------------------------------------
    def qmp(self, cmd, timeout=60.0, **args):
        """Runs a QMP command; keyword names use '_' for '-' (max_bandwidth -> max-bandwidth)."""
        if self._qmp is None:
            raise RuntimeError("%s: no QMP connection" % self.name)
        args = {k.replace("_", "-"): v for k, v in args.items()}
        return self._qmp.command(cmd, args, timeout=timeout)

    def qmp_raw(self, cmd, args=None, timeout=60.0):
        """Runs a QMP command with an argument dict passed through unchanged."""
        return self._qmp.command(cmd, args, timeout=timeout)

    @property
    def events(self):
        """Buffered QMP events (dicts with event, data, timestamp) in arrival order."""
        return self._qmp.events if self._qmp else []

    def poll_events(self, timeout=0.0):
        self._qmp.poll_events(timeout)
        return self._qmp.events

    def wait_event(self, name, timeout, pred=None):
        return self._qmp.wait_event(name, timeout, pred)

    def status(self):
        """query-status's "status" string (running, paused, inmigrate, postmigrate, ...). A QEMU
        that is gone says how: its exit code and the tail of its stderr (a broken pipe alone
        cannot tell a crash from a quit)."""
        try:
            return self.qmp("query-status")["status"]
        except (OSError, ConnectionError) as e:
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            raise QemuGone("QEMU %s: query-status failed (%s); %s" % (self.name, e, self.how_gone())) from e

    def runs(self):
        """Whether this QEMU runs its VM (query-status "running"). One that is gone, or exits while
        asked (a target whose incoming migration failed may exit between alive() and the question:
        run W10 of 2026-12-06), does not; a live one that cannot answer raises QemuGone."""
        if not self.alive():
            return False
        try:
            return self.status() == "running"
        except QemuGone:
            if self.alive():
                raise
            return False

    def how_gone(self):
        """Why this QEMU is not there: alive or not, its exit code, its stderr tail and the guest's
        last serial lines (a guest panic exits QEMU: panic=-1 with -no-reboot)."""
        serial = self.serial_text().strip().splitlines()[-12:]
        return "alive: %s, exit code %s, stderr: %s; guest serial tail: %s" % (
            self.alive(), self.proc.returncode if self.proc else None, self.stderr_text()[-1500:].strip() or "(empty)",
            " | ".join(serial) or "(empty)")

    def wait_for_status(self, wanted, timeout=30.0):
        wanted = (wanted,) if isinstance(wanted, str) else tuple(wanted)
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st in wanted:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError("%s: status %s, wanted %s within %.0fs"
                                   % (self.name, st, wanted, timeout))
            time.sleep(0.05)

    def cont(self):
        return self.qmp("cont")

    # -- serial counter ----------------------------------------------------------------
    def serial_text(self):
        try:
            with open(self.serial_log, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def last_counter(self):
        """Highest complete "rdmig-counter N" line on the serial log, or None."""
        try:
            with open(self.serial_log, "rb") as f:
                data = f.read()
        except OSError:
            return None
        # Only complete lines: the last one may still be being written.
        data = data[:data.rfind(b"\n") + 1]
        values = [int(m) for m in COUNTER_RE.findall(data)]
        return max(values) if values else None

    def wait_for_counter(self, min_value, timeout=60.0):
        """Waits until the serial log shows a counter >= min_value; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.last_counter()
            if v is not None and v >= min_value:
                return v
            if not self.alive():
                raise RuntimeError("%s: QEMU exited (rc %s) waiting for counter %d; stderr: %s"
                                   % (self.name, self.proc.returncode, min_value,
                                      self.stderr_text()))
            if time.monotonic() > deadline:
                raise TimeoutError("%s: counter %s, wanted >= %d within %.0fs"
                                   % (self.name, v, min_value, timeout))
            time.sleep(0.1)

    # -- memory verifier (rdmig.verify_mib) -----------------------------------------------
    def verifier(self):
        """The verifier's state from the serial log (verifier_state)."""
        return verifier_state(self.serial_log)

    def wait_for_verifier(self, min_counter, min_scans=0, timeout=60.0):
        """Waits until the verifier's counter reaches ``min_counter`` with at least ``min_scans``
        full scans; returns its state."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.verifier()
            if v["counter"] is not None and v["counter"] >= min_counter and v["scans"] >= min_scans:
                return v
            if not self.alive():
                raise RuntimeError("%s: QEMU exited (rc %s) waiting for verifier %d; stderr: %s"
                                   % (self.name, self.proc.returncode, min_counter, self.stderr_text()))
            if v["killed"]:  # it never reports again: the guest's memory is too small for what it holds
                raise RuntimeError("%s: the guest's kernel killed the verifier: %s" % (self.name, v["killed"]))
            if time.monotonic() > deadline:
                raise TimeoutError("%s: verifier %s, wanted counter >= %d, scans >= %d within %.0fs"
                                   % (self.name, v, min_counter, min_scans, timeout))
            time.sleep(0.2)

    # -- memory ------------------------------------------------------------------------
    def memory_digest(self, path=None, keep=False, timeout=300.0):
        """pmemsave of guest-physical [0, mem_bytes) to ``path``; returns its sha256 hex.

        Only meaningful while the guest is stopped (paused, postmigrate, ...)."""
        if path is None:
            path = os.path.join(self.workdir, self.name + ".mem")
        path = os.path.abspath(path)
        if os.path.exists(path):
            os.unlink(path)
        self.qmp_raw("pmemsave", {"val": 0, "size": self.mem_bytes, "filename": path},
                     timeout=timeout)
        # pmemsave is synchronous, so the file is complete when the reply arrives; the
        # size check guards against a short write.
        deadline = time.monotonic() + 10.0
        while os.path.getsize(path) < self.mem_bytes:
            if time.monotonic() > deadline:
                raise RuntimeError("%s: pmemsave wrote %d of %d bytes"
                                   % (self.name, os.path.getsize(path), self.mem_bytes))
            time.sleep(0.05)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while True:
                chunk = f.read(8 << 20)
                if not chunk:
                    break
                h.update(chunk)
        if not keep:
            os.unlink(path)
        return h.hexdigest()
