"""KubeVirt-shaped live migration on one machine, without Kubernetes and without rdmig.

Two "nodes", each with
  - a virt-handler pod network namespace (kvnet.HandlerNetwork) where the migration proxy
    stand-in (kvproxy, process name "virt-handler") runs, one process per role and migration;
  - a virt-launcher pod (kvpod.LauncherPod): libvirtd in private mount/UTS/PID namespaces and,
    per VMI, a virt-launcher-monitor stand-in whose /proc/<pid>/root reaches the pod's files.
    Flavour (``flavor``, default $RDMIG_KV_LAUNCHER or "trixie-nonroot"): KubeVirt 1.9's
    non-root launcher (Debian 13 root, libvirtd 11.3 as uid 107 in session mode, QEMU 10.0)
    or "bookworm-root" (the host's root libvirtd 9.0 and QEMU 7.2, KubeVirt's Root gate).
A migration follows KubeVirt's data path: target proxy listens on [::]:0 per class and
publishes targetNodeAddress/targetDirectMigrationNodePorts; the source proxy creates
<uid>-source.sock and <uid>-49152-source.sock in the source launcher, calls the
PreMigrationSource node hook (optional), then libvirt migrates peer to peer through them
(LIVE|PEER2PEER|PERSIST_DEST [|PARALLEL] [|PAUSED], dconnuri and migrate URI on unix sockets).
The VMI goes back and forth: each migration moves it to the node it is not on.
"""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from .kvnet import HandlerNetwork
from .kvpki import make_test_pki
from .kvpod import DEFAULT_FLAVOR, FLAVORS, QEMU_GID, QEMU_UID, LauncherPod, wait_for, _stop
from .qmp import QmpClient
from .qemu import verifier_state

TOOLS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARE_DIR = "/var/run/kubevirt"  # virtShareDir inside the launcher
COUNTER_RE = re.compile(rb"^rdmig-counter (\d+)\r?$", re.M)
DISK_RE = re.compile(rb"^rdmig-disk (\d+)\r?$", re.M)  # the guest's disk writer (rdmig.disk=1)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def libvirt_module():
    import libvirt  # python3-libvirt
    return libvirt


def proc_cpu_seconds(pid):
    """utime+stime of a process from /proc/<pid>/stat, or None once it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(8 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def disk_xml(path, cache):
    """A raw virtio disk as KubeVirt's converter writes one for a file-backed volume (alias
    ua-<volume>, cache "none" where O_DIRECT works, else "writethrough")."""
    return """<disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='{cache}' error_policy='stop' discard='unmap'/>
      <source file='{path}'/>
      <target dev='vda' bus='virtio'/>
      <alias name='ua-disk0'/>
    </disk>""".format(path=path, cache=cache)


def direct_io_works(path):
    """KubeVirt's directIOChecker: can the file be opened with O_DIRECT?"""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def domain_xml(name, dom_uuid, mem_mib, kernel, initrd, cmdline, serial_path, qmp_path, disks=""):
    """A TCG domain booting the test guest directly. ``qmp_path``: a second QMP monitor for
    the harness (libvirt keeps its own), used to read the source's memory mid-migration.
    ``disks``: <disk> elements (disk_xml)."""
    return """<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{name}</name>
  <uuid>{uuid}</uuid>
  <memory unit='MiB'>{mem}</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{kernel}</kernel><initrd>{initrd}</initrd><cmdline>{cmdline}</cmdline></os>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <controller type='usb' model='none'/>
    {disks}
    <serial type='file'><source path='{serial}'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>
    <qemu:arg value='-qmp'/><qemu:arg value='unix:{qmp},server=on,wait=off'/>
  </qemu:commandline>
</domain>""".format(name=name, uuid=dom_uuid, mem=int(mem_mib), kernel=kernel, initrd=initrd,
                    cmdline=cmdline, serial=serial_path, qmp=qmp_path, disks=disks)


class Vmi:
    """The VMI as the harness tracks it; ``node`` is where it runs now."""

    def __init__(self, name, namespace, uid, mem_mib, node):
        self.name, self.namespace, self.uid = name, namespace, uid
        self.mem_mib = mem_mib
        self.node = node
        self.domain = "%s_%s" % (namespace, name)  # util.DomainFromNamespaceName
        self.serial_in_pod = "/var/log/libvirt/qemu/%s.serial.log" % self.domain
        self.qmp_in_pod = "/run/kubevirt/%s.qmp" % self.domain  # the harness's own monitor
        self.disk_mib = 0  # a local disk (vda) of that size, block-migrated; 0: none
        self.disk_in_pod = "/var/lib/libvirt/images/%s-disk0.img" % self.domain


class MigrationResult:
    """What one migration produced. Attributes:
    success (bool), error (libvirt's error text or a hook/proxy failure, else None),
    migration_uid, vmi_uid, source_node, target_node, parallel, tls, dial_order (kvproxy's
    --dial-order on both proxies), wall_ms (migrateToURI3 call), job (target's completed job stats dict from libvirt:
    time_elapsed, downtime, data_total/processed, memory_bps, ... ; None on failure),
    source_job (the source's, when libvirt kept it), downtime_ms, total_time_ms,
    data_bytes, throughput_bps (data_processed / time_elapsed, bytes/s),
    proxy_logs {"source": doc, "target": doc} (kvproxy's JSON log),
    hook (the source proxy's hook report or None), handler_pids {"source","target"},
    handler_cpu_s {"source","target"} (/proc/<pid>/stat utime+stime at the end),
    handler_netns {"source","target"}, launcher_pids {"source","target"},
    target_address, ports (targetDirectMigrationNodePorts), vmi_json (as sent to the hook),
    memory (dict, with target_paused: source_sha256, target_sha256, equal, bytes),
    block (VIR_MIGRATE_NON_SHARED_INC with the VMI's disk and the 49153 class), disk (dict,
    block with target_paused: SHA-256 of the source's and of the target's disk image once
    libvirt's call returned, both guests paused: source_sha256, target_sha256, equal, bytes,
    sizes), disk_counter_before (block: the guest disk writer's last turn on the source),
    counter_before (source's last serial counter) and counter_after (target's, after resume),
    target_cleanup (after a failed migration: the state of the domain libvirt left on the
    target, which the harness then destroyed as KubeVirt deletes the target pod; None when
    libvirt left none), source_failed_at (time.monotonic() when the harness saw the source
    QEMU's migration failed or cancelled, else None), target_pod_deleted_at (when the harness
    destroyed the target domain because libvirt's call outlived the source's failure by
    TARGET_POD_DELETE_AFTER_S, else None).
    """

    def __init__(self, **kw):
        self.success = False
        self.error = None
        self.job = self.source_job = None
        self.downtime_ms = self.total_time_ms = self.data_bytes = self.throughput_bps = None
        self.proxy_logs = {}
        self.hook = None
        self.memory = None
        self.block = False
        self.disk = self.disk_counter_before = None
        self.counter_before = self.counter_after = None
        self.target_cleanup = None
        self.source_failed_at = self.target_pod_deleted_at = None
        self.source_memory_error = None
        self.postcopy = None
        self.__dict__.update(kw)

    def summary(self):
        keys = ("success", "error", "parallel", "tls", "dial_order", "wall_ms", "downtime_ms", "total_time_ms",
                "data_bytes", "throughput_bps", "handler_cpu_s", "counter_before", "counter_after")
        out = {k: getattr(self, k, None) for k in keys}
        out["memory_equal"] = self.memory and self.memory.get("equal")
        out["block"] = self.block
        out["disk_equal"] = self.disk and self.disk.get("equal")
        out["hook"] = self.hook and {k: self.hook.get(k) for k in ("ok", "error", "duration_s")}
        return out


class MigrationFailed(AssertionError):
    def __init__(self, result):
        super().__init__("migration %s failed: %s%s" % (
            result.migration_uid, result.error,
            "; " + result.source_memory_error if result.source_memory_error else ""))
        self.result = result


class KubevirtCluster:
    """Context manager. ``workdir``: where pods, logs and certificates go (a temp dir by
    default, removed on close unless ``keep``). ``nodes``: the two node names. ``flavor``:
    the launcher pods' flavour (kvpod.FLAVORS; default $RDMIG_KV_LAUNCHER, else
    "trixie-nonroot"). ``launcher_qemu``: "backports" for the non-root launchers with
    trixie-backports' QEMU 11.1 instead of 10.0 (kvpod.LauncherPod)."""

    # kvproxy --dial-order for both proxies when migrate() is not given one: "concurrent"
    # (KubeVirt's goroutine per connection), "shuffle" (test: never the accept order) or
    # "accept" (order kept). Default: $RDMIG_KV_DIAL_ORDER, else "concurrent" on the non-root
    # QEMU 10 row and "accept" on the bookworm-root QEMU 7.2 row: QEMU 7.2 fails when a multifd
    # channel reaches it before the main one (1 in 17 tries with 8 connections under
    # "concurrent", 4 in 5 under "shuffle"), with or without rdmig. No KubeVirt 1.9 ships QEMU
    # 7.2; that row stands for the Root gate's /system daemon, not for its QEMU.
    dial_order = os.environ.get("RDMIG_KV_DIAL_ORDER")

    def __init__(self, workdir=None, nodes=("node-a", "node-b"), keep=False, libvirt_log_level=3,
                 kernel=None, initrd=None, flavor=None, launcher_qemu=None):
        self.keep = keep or bool(os.environ.get("RDMIG_KEEP_TMP"))
        if os.environ.get("RDMIG_LIBVIRT_LOG_FILTERS"):
            libvirt_log_level = 1  # the filters decide what is logged
        self._own_workdir = workdir is None
        self.workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="rdmig-kv-"))
        self.nodes = list(nodes)
        self.kernel, self.initrd = kernel, initrd
        self.net = HandlerNetwork(self.nodes)
        self.flavor = flavor or os.environ.get("RDMIG_KV_LAUNCHER") or DEFAULT_FLAVOR
        if self.flavor not in FLAVORS:
            raise ValueError("unknown launcher flavour %r (RDMIG_KV_LAUNCHER: one of %s)"
                             % (self.flavor, ", ".join(FLAVORS)))
        self.nonroot = self.flavor == "trixie-nonroot"
        if launcher_qemu and not self.nonroot:
            raise ValueError("launcher_qemu: only the trixie-nonroot launchers have another QEMU")
        self.pods = {n: LauncherPod(n, os.path.join(self.workdir, n), libvirt_log_level, self.flavor, launcher_qemu)
                     for n in self.nodes}
        self.guest_paths = None  # (kernel, initrd) as the domain XML names them
        self.pki_dir = os.path.join(self.workdir, "pki")
        self.vmi = None
        self.migrations = 0
        self._procs = []

    # -- lifecycle ----------------------------------------------------------------------
    # Fields merged into status.migrationState.migrationConfiguration (e.g. allowPostCopy).
    migration_config_overrides = {}

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc):
        self.close()

    def start(self):
        if self.kernel is None or self.initrd is None:
            from .guest import ensure_guest
            self.kernel, self.initrd = ensure_guest()
        self.net.setup()
        make_test_pki(self.pki_dir)
        for pod in self.pods.values():
            os.makedirs(pod.dir, exist_ok=True)
            pod.start()
        staged = {pod.stage_guest(self.kernel, self.initrd) for pod in self.pods.values()}
        if len(staged) != 1:  # the domain XML migrates as is: same paths in every pod
            raise RuntimeError("guest paths differ between pods: %s" % staged)
        self.guest_paths = staged.pop()
        return self

    def close(self):
        for p in self._procs:
            _stop(p)
        self._procs = []
        for pod in self.pods.values():
            pod.close()
        self.net.close()
        if self.keep:
            print("kept %s" % self.workdir, file=sys.stderr)
        elif self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- accessors for tests and for rdmig's agents --------------------------------------
    def other(self, node):
        return [n for n in self.nodes if n != node][0]

    def netns(self, node):
        """Name of the node's virt-handler network namespace (/run/netns/<name>)."""
        return self.net.netns[node]

    def pod_ip(self, node, family="ipv4"):
        return self.net.ip4[node] if family == "ipv4" else self.net.ip6[node]

    def launcher_pid(self, node, vmi=None):
        """Host pid of the virt-launcher-monitor stand-in of the VMI on that node."""
        return self.pods[node].monitor_pid((vmi or self.vmi).uid)

    def launcher_root(self, node, vmi=None):
        return "/proc/%d/root" % self.launcher_pid(node, vmi)

    def libvirt_uri(self, node):
        """libvirt as KubeVirt's handler reaches it: through the launcher's /proc root."""
        return self.pods[node].libvirt_uri(self.launcher_pid(node))

    def connect(self, node):
        return libvirt_module().open(self.libvirt_uri(node))

    def domain(self, node):
        return self.connect(node).lookupByName(self.vmi.domain)

    def _serial_max(self, node, pattern):
        """The highest number `pattern` finds on complete lines of the node's serial log."""
        try:
            with open(self.pods[node].path(self.vmi.serial_in_pod), "rb") as f:
                data = f.read()
        except OSError:
            return None
        data = data[:data.rfind(b"\n") + 1]
        values = [int(m) for m in pattern.findall(data)]
        return max(values) if values else None

    def serial_counter(self, node):
        return self._serial_max(node, COUNTER_RE)

    def verifier(self, node):
        """The guest's memory verifier on `node` (define_and_start_vmi(verify_mib=...)) from the
        node's serial log: {"counter", "checked", "scans", "writes", "mismatches",
        "mismatch_lines"} of its last complete line; counter None before any. The counts live in
        guest memory, so on the target they go on from the source's (a migrated guest's log
        starts anew in the target pod)."""
        return verifier_state(self.pods[node].path(self.vmi.serial_in_pod))

    def wait_for_verifier(self, node, min_counter, min_scans=0, timeout=60.0):
        """Waits until the verifier on `node` reaches ``min_counter`` with ``min_scans`` full scans."""
        try:
            return wait_for(lambda: (lambda v: v["counter"] is not None and v["counter"] >= min_counter
                                     and v["scans"] >= min_scans and v)(self.verifier(node)),
                            timeout, "%s: guest verifier counter >= %d, scans >= %d" % (node, min_counter, min_scans))
        except TimeoutError as e:
            raise TimeoutError("%s; verifier %s; %s" % (e, self.verifier(node), self.guest_diagnosis(node))) from None

    def wait_for_counter(self, node, minimum, timeout=60.0):
        try:
            return wait_for(lambda: (self.serial_counter(node) or -1) >= minimum and self.serial_counter(node),
                            timeout, "%s: guest counter >= %d" % (node, minimum))
        except TimeoutError as e:
            raise TimeoutError("%s; %s" % (e, self.guest_diagnosis(node))) from None

    def guest_diagnosis(self, node):
        """What a stalled guest counter needs to be read: QEMU's own run and migration state
        over the harness's QMP monitor, and the end of the guest's serial console (an oops
        shows there)."""
        parts = []
        try:
            qmp = QmpClient(self.launcher_root(node) + self.vmi.qmp_in_pod, timeout=5)
            try:
                status = qmp.command("query-status", timeout=5)
                mig = qmp.command("query-migrate", timeout=5)
                parts.append("QEMU status %s, migration %s%s" % (
                    status.get("status"), mig.get("status"),
                    (" (%s)" % mig["error-desc"]) if mig.get("error-desc") else ""))
            finally:
                qmp.close()
        except Exception as e:  # noqa: BLE001 - a diagnosis names what it could not read
            parts.append("QEMU monitor: %s" % e)
        try:
            with open(self.pods[node].path(self.vmi.serial_in_pod), "rb") as f:
                tail = f.read()[-600:]
            parts.append("serial tail: %r" % tail.decode("utf-8", "replace"))
        except OSError as e:
            parts.append("serial: %s" % e)
        # libvirt's log of the domain's QEMU: why a QEMU that is gone ended ("terminating on
        # signal 15 from pid N", an abort, a guest panic's shutdown). /system logs under
        # /var/log/libvirt/qemu, a session daemon under $XDG_CACHE_HOME/libvirt/qemu/log.
        for in_pod in ("/var/log/libvirt/qemu/%s.log" % self.vmi.domain,
                       "/run/kubevirt-private/cache/libvirt/qemu/log/%s.log" % self.vmi.domain):
            try:
                with open(self.pods[node].path(in_pod), "rb") as f:
                    tail = f.read()[-800:]
            except (OSError, ValueError):  # ValueError: not this flavour's pod dirs
                continue
            parts.append("QEMU log %s tail: %r" % (in_pod, tail.decode("utf-8", "replace")))
        return "; ".join(parts)

    def domain_running(self, node):
        """Whether the VMI's domain is active on the node (False when libvirt does not know it)."""
        try:
            return self.domain(node).isActive() == 1
        except Exception:  # noqa: BLE001 - libvirtError: no such domain
            return False

    # -- VMI ----------------------------------------------------------------------------
    def define_and_start_vmi(self, name="testvm", namespace="default", mem_mib=256, dirty_mib=16,
                             interval=1, uid=None, boot_counter=1, boot_timeout=90.0,
                             disk_mib=0, disk_interval=0.1, verify_mib=0, verify_rate_mib=8):
        """Defines and starts the VMI's domain on the first node (persistent, like
        virt-launcher) and starts virt-launcher-monitor for it in both launcher pods.
        Waits until the guest printed ``boot_counter``. Returns the Vmi.

        disk_mib: a local raw virtio disk (vda) of that size in the first node's
        /var/lib/libvirt/images (KubeVirt's hostDisk/emptyDisk: a file in the launcher pod,
        owned by 107 on the non-root row), filled with random bytes; the guest (rdmig.disk=1)
        then writes it without end (tools/guest/build-guest.sh), every ``disk_interval`` s.
        Such a VMI migrates with KubeVirt's block migration (migrate(block=...)).

        verify_mib: the guest's memory verifier (tools/guest/verify.c) over that many MiB,
        rewritten at ``verify_rate_mib`` MiB/s and checked continuously (verifier())."""
        if self.vmi is not None:
            raise RuntimeError("this harness runs one VMI")
        node = self.nodes[0]
        vmi = Vmi(name, namespace, uid or str(uuid.uuid4()), mem_mib, node)
        for pod in self.pods.values():
            pod.start_monitor(name, vmi.uid, namespace)
        self.vmi = vmi
        cmdline = "console=ttyS0 quiet panic=-1 rdmig.dirty_mib=%s rdmig.interval=%s" % (
            dirty_mib, interval)
        disks = ""
        if disk_mib:
            vmi.disk_mib = int(disk_mib)
            host = self._create_disk_image(node, fill=True)
            disks = disk_xml(vmi.disk_in_pod, "none" if direct_io_works(host) else "writethrough")
            cmdline += " rdmig.disk=1 rdmig.disk_interval=%s" % disk_interval
        if verify_mib:
            cmdline += " rdmig.verify_mib=%d rdmig.verify_rate_mib=%s" % (verify_mib, verify_rate_mib)
        xml = domain_xml(vmi.domain, vmi.uid, mem_mib, self.guest_paths[0], self.guest_paths[1], cmdline,
                         vmi.serial_in_pod, vmi.qmp_in_pod, disks)
        conn = self.connect(node)
        try:
            dom = conn.defineXML(xml)
            dom.create()
        finally:
            conn.close()
        self.wait_for_counter(node, boot_counter, boot_timeout)
        return vmi

    def _create_disk_image(self, node, fill):
        """The VMI's disk image in the node's pod: ``fill`` (the VMI's own disk) with random
        bytes, else empty and sparse of the same size, what KubeVirt's migration target pod
        has before libvirt copies into it (virt-launcher's preStartHook creates emptyDisk and
        hostDisk images of the volume's capacity; a migrated PVC is a new blank volume).
        Owned by 107 on the non-root row. Returns the host path."""
        v = self.vmi
        host = self.pods[node].path(v.disk_in_pod)
        os.makedirs(os.path.dirname(host), exist_ok=True)
        with open(host, "wb") as f:
            if fill:
                for _ in range(v.disk_mib):
                    f.write(os.urandom(1 << 20))
            else:
                f.truncate(v.disk_mib << 20)
        if self.pods[node].nonroot:
            os.chown(host, QEMU_UID, QEMU_GID)
        os.chmod(host, 0o660)
        return host

    def disk_counter(self, node):
        """The guest disk writer's last finished turn as printed on the node's serial log."""
        return self._serial_max(node, DISK_RE)

    def vmi_document(self, source, target, migration_uid, address, ports, tls, pod_names):
        """The VMI as KubeVirt would marshal it for the node hook (status.migrationState)."""
        v = self.vmi
        return {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": v.name, "namespace": v.namespace, "uid": v.uid},
            "spec": {"domain": {"memory": {"guest": "%dMi" % v.mem_mib}}},
            "status": {
                "nodeName": source, "phase": "Running", "migrationTransport": "Unix",
                "migrationState": {
                    "sourceNode": source, "targetNode": target, "targetNodeAddress": address,
                    "targetDirectMigrationNodePorts": ports, "migrationUid": migration_uid,
                    "sourcePod": pod_names[0], "targetPod": pod_names[1], "mode": "PreCopy",
                    "migrationConfiguration": {
                        "allowAutoConverge": False, "allowPostCopy": False,
                        "allowWorkloadDisruption": False, "bandwidthPerMigration": "0Mi",
                        "completionTimeoutPerGiB": 150, "progressTimeout": 150,
                        "unsafeMigrationOverride": False, "disableTLS": not tls,
                        "parallelMigrationThreads": None, "network": None,
                        **self.migration_config_overrides}}},
        }

    # -- migration ----------------------------------------------------------------------
    def _spawn_handler(self, node, argv, log_path):
        env = dict(os.environ, PYTHONPATH=TOOLS_DIR, PYTHONDONTWRITEBYTECODE="1")
        with open(log_path, "ab") as log:
            p = subprocess.Popen(["nsenter", "--net=" + self.net.netns_path(node), "--",
                                  sys.executable, "-m", "rdmiglab.kvproxy"] + argv,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                 start_new_session=True)
        self._procs.append(p)
        return p

    def migrate(self, parallel=8, tls=True, hook_socket=None, hook_timeout=30.0,
                hook_failure="Ignore", expect_success=True, target_paused=False, timeout=120.0,
                family="ipv4", after_ports=None, before_dial=None, check_memory=None,
                check_counter=True, migration_uid=None, dial_order=None, block=None, postcopy=False,
                postcopy_bandwidth_mib=None, postcopy_after_mib=32):
        """Migrates the VMI to the other node the way KubeVirt does. See MigrationResult.

        block (default: the VMI has a disk): KubeVirt's block migration
        (live-migration-source.go generateMigrationFlags/generateMigrationParams):
        VIR_MIGRATE_NON_SHARED_INC, VIR_MIGRATE_PARAM_MIGRATE_DISKS ["vda"],
        VIR_MIGRATE_PARAM_DISKS_URI unix://<share>/migrationproxy/<uid>-49153-source.sock
        (and MIGRATE_DISKS_DETECT_ZEROES ["vda"] where the source's libvirt has it, >= 10.9);
        the target proxy also listens for the 49153 class (GetMigrationPortsList), the source
        proxy serves every published class, and the target pod gets an empty image of the
        disk's size first. With target_paused, r.disk compares both images.

        hook_socket/hook_timeout/hook_failure: the source proxy calls PreMigrationSource there
        after its unix listeners are up; with "Fail" a failed hook stops the migration.
        target_paused: VIR_MIGRATE_PAUSED, then the RAM of both sides is compared and the
        target resumed (check_memory defaults to target_paused): the source proxy holds
        libvirt's control bytes once memory flows, so the source QEMU is still there (paused,
        migration completed) for a pmemsave over the harness's QMP monitor; the target is
        read with qemu-monitor-command through libvirt. libvirt's times and downtime then
        include that hold: measure with target_paused=False. after_ports(ctx) runs once
        the target published its ports; before_dial(ctx) right before libvirt is called
        (ctx: the MigrationResult filled so far). dial_order: kvproxy's --dial-order for both
        proxies (default the class attribute, $RDMIG_KV_DIAL_ORDER, else "concurrent").
        postcopy: KubeVirt's post-copy (allowPostCopy): VIR_MIGRATE_POSTCOPY, and the switch
        the launcher's migration monitor makes (live-migration-source.go: MigrateStartPostCopy
        once its completion deadline passes) made once libvirt's job shows ``postcopy_after_mib``
        MiB of memory sent (memory_processed), early in the first pass, so that every run
        switches with most of the memory still to move; r.postcopy says when (ms after the
        call), at which iteration, what remained, what libvirt showed of the source domain after
        it, and libvirt's own error if the switch failed.
        postcopy_bandwidth_mib: libvirt's bandwidth.postcopy (QEMU's max-postcopy-bandwidth, MiB/s)
        for the background copy after the switch (a test that needs the phase to last).
        Raises MigrationFailed when the migration fails and expect_success is set."""
        lv = libvirt_module()
        v = self.vmi
        source, target = v.node, self.other(v.node)
        if not self.domain_running(source):
            # The VMI stopped after an earlier migration (a guest that died after its resume,
            # a QEMU that exited): say so with what QEMU and its console left, rather than
            # libvirt's bare "domain is not running" from the migrate call.
            raise RuntimeError("the VMI's domain is not running on %s before this migration "
                               "(it stopped after an earlier one): %s"
                               % (source, self.guest_diagnosis(source)))
        mig_uid = migration_uid or str(uuid.uuid4())  # KubeVirt's VMIM uid when a stand-in drives it
        self.migrations += 1
        mdir = os.path.join(self.workdir, "migration-%d" % self.migrations)
        os.makedirs(mdir)
        r = MigrationResult(
            migration_uid=mig_uid, vmi_uid=v.uid, source_node=source, target_node=target,
            parallel=parallel, tls=tls, workdir=mdir,
            handler_netns={"source": self.netns(source), "target": self.netns(target)},
            launcher_pids={"source": self.launcher_pid(source), "target": self.launcher_pid(target)},
            handler_pids={}, handler_cpu_s={})
        check_memory = target_paused if check_memory is None else check_memory
        r.postcopy = {"switched": False, "bandwidth_mib": postcopy_bandwidth_mib,
                      "after_mib": postcopy_after_mib} if postcopy else None
        r.block = bool(v.disk_mib) if block is None else bool(block)
        if r.block and not v.disk_mib:
            raise ValueError("block migration needs a VMI with a disk (define_and_start_vmi(disk_mib=...))")
        if check_memory and not target_paused:
            raise ValueError("check_memory needs target_paused (a running target changes its RAM)")
        tls_args = ["--tls-dir", self.pki_dir] if tls else ["--disable-tls"]
        r.dial_order = dial_order or self.dial_order or ("concurrent" if self.nonroot else "accept")
        tls_args = tls_args + ["--dial-order", r.dial_order]  # both proxies
        procs = {}
        if r.block:  # the new target pod's volume: empty, of the same size
            self._create_disk_image(target, fill=False)
        try:
            # 1. Target handler: listeners, then ports published.
            ports_file = os.path.join(mdir, "target-ports.json")
            troot = self.launcher_root(target)
            procs["target"] = self._spawn_handler(target, [
                "target", "--uid", v.uid, "--base-dir", troot + "/run/kubevirt",
                "--libvirt-sock", troot + "/" + self.pods[target].libvirt_sock,
                "--ports-file", ports_file, "--log", os.path.join(mdir, "target-proxy.json"),
            ] + tls_args + (["--block"] if r.block else []), os.path.join(mdir, "target-proxy.stderr"))
            r.handler_pids["target"] = procs["target"].pid
            wait_for(lambda: os.path.exists(ports_file), 20, "target proxy ports",
                     alive=lambda: procs["target"].poll() is None)
            with open(ports_file) as f:
                r.ports = json.load(f)["ports"]
            r.target_address = self.pod_ip(target, family)
            if after_ports:
                after_ports(r)
            # 2. Source handler: unix listeners in the source launcher, the hook, ready.
            doc = self.vmi_document(source, target, mig_uid, r.target_address, r.ports, tls,
                                    ("virt-launcher-%s-%s" % (v.name, source),
                                     "virt-launcher-%s-%s" % (v.name, target)))
            r.vmi_json = json.dumps(doc)
            vmi_file = os.path.join(mdir, "vmi.json")
            with open(vmi_file, "w") as f:
                f.write(r.vmi_json)
            ready = os.path.join(mdir, "source-ready.json")
            argv = ["source", "--uid", v.uid, "--base-dir", self.launcher_root(source) + "/run/kubevirt",
                    "--target-address", r.target_address, "--ports", json.dumps(r.ports),
                    "--ready-file", ready, "--log", os.path.join(mdir, "source-proxy.json"),
                    "--vmi-json", vmi_file, "--node-name", source] + tls_args
            if self.pods[source].nonroot:  # virt-handler chowns them for a non-root launcher
                argv += ["--socket-owner", "%d:%d" % (QEMU_UID, QEMU_GID)]
            if check_memory:
                argv += ["--hold-control"]
            if hook_socket:
                argv += ["--hook-socket", hook_socket, "--hook-timeout", str(hook_timeout),
                         "--hook-failure", hook_failure]
            procs["source"] = self._spawn_handler(source, argv, os.path.join(mdir, "source-proxy.stderr"))
            r.handler_pids["source"] = procs["source"].pid
            wait_for(lambda: os.path.exists(ready), hook_timeout + 20, "source proxy ready",
                     alive=lambda: procs["source"].poll() is None)
            with open(ready) as f:
                rd = json.load(f)
            r.hook = rd["hook"]
            if not rd["proceed"]:
                r.error = "node hook PreMigrationSource failed: %s" % r.hook.get("error")
            else:
                self._libvirt_migrate(lv, r, parallel, target_paused, timeout, before_dial,
                                      check_memory, procs["source"])
        finally:
            self._stop_handlers(r, procs)
        if r.success and target_paused:
            self.domain(target).resume()
        if r.success and check_counter:
            r.counter_after = self.wait_for_counter(target, (r.counter_before or 0) + 1, 60)
        if not r.success and expect_success:
            raise MigrationFailed(r)
        return r

    def _switch_to_postcopy(self, lv, node, domain, th, r, t0):
        """KubeVirt's launcher's switch (MigrateStartPostCopy) once libvirt's job shows the first
        pass over memory done; on a connection of its own, as the launcher's monitor runs beside
        the migrate call."""
        conn = None
        try:
            conn = self.connect(node)
            dom = conn.lookupByName(domain)
            while th.is_alive():
                try:
                    stats = dom.jobStats()
                except lv.libvirtError:
                    stats = {}
                it = stats.get("memory_iteration", 0)
                done_mib = stats.get("memory_processed", 0) >> 20
                if stats.get("type") == lv.VIR_DOMAIN_JOB_UNBOUNDED and done_mib >= r.postcopy["after_mib"]:
                    dom.migrateStartPostCopy(0)
                    r.postcopy.update(switched=True, at_ms=round((time.monotonic() - t0) * 1000, 1), iteration=it,
                                      remaining_bytes=stats.get("memory_remaining"))
                    # What libvirt shows of the source domain after the switch: (state, reason)
                    # pairs, each with the ms after the switch it was first seen.
                    seen, t_sw = [], time.monotonic()
                    while th.is_alive() and time.monotonic() - t_sw < 3:
                        try:
                            st = tuple(dom.state())
                        except lv.libvirtError as e:
                            st = ("error", str(e))
                        if not seen or seen[-1][1] != st:
                            seen.append((round((time.monotonic() - t_sw) * 1000), st))
                        time.sleep(0.02)
                    r.postcopy["source_states"] = seen
                    return
                time.sleep(0.05)
        except lv.libvirtError as e:
            r.postcopy["error"] = str(e)
        finally:
            if conn is not None:
                conn.close()

    def _pmemsave(self, node, qmp_command, keep_as):
        """pmemsave of the guest's RAM into the node's /run/kubevirt, moved to ``keep_as``;
        returns its SHA-256."""
        in_pod = "/run/kubevirt/%s.mem" % self.vmi.domain
        host = self.pods[node].path(in_pod)
        if os.path.exists(host):
            os.unlink(host)
        qmp_command("pmemsave", {"val": 0, "size": self.vmi.mem_mib << 20, "filename": in_pod})
        os.replace(host, keep_as)
        if os.path.getsize(keep_as) != self.vmi.mem_mib << 20:
            raise RuntimeError("%s: pmemsave wrote %d bytes" % (node, os.path.getsize(keep_as)))
        return file_sha256(keep_as)

    def _source_memory_while_held(self, r, th, source_proc, deadline):
        """With the control connection held, waits for the source QEMU to finish its part
        (run state "postmigrate"), digests its RAM over the harness's own QMP
        monitor, then releases the hold. Returns the digest or None."""
        qmp = None
        try:
            qmp = QmpClient(self.launcher_root(r.source_node) + self.vmi.qmp_in_pod, timeout=10)
            while th.is_alive() and time.monotonic() < deadline:
                # Not query-migrate: a QEMU that came in by migration reports "completed"
                # from the start. "postmigrate" is reached only once it sent everything.
                if qmp.command("query-status").get("status") == "postmigrate":
                    return self._pmemsave(r.source_node, lambda c, a: qmp.command(c, a, timeout=120),
                                          os.path.join(r.workdir, "source.mem"))
                time.sleep(0.02)
            return None
        except (OSError, ValueError) as e:
            # The source QEMU's monitor went away under the harness (its QEMU ended or was
            # stopped by libvirt): no digest, and the reason is kept for the test's message
            # (once a bare BrokenPipeError from sendall, which named nothing).
            r.source_memory_error = "source QEMU monitor: %s: %s" % (type(e).__name__, e)
            return None
        finally:
            if qmp is not None:
                qmp.close()
            os.kill(source_proc.pid, signal.SIGUSR1)  # release the hold in every case

    def _libvirt_migrate(self, lv, r, parallel, target_paused, timeout, before_dial,
                         check_memory, source_proc):
        v = self.vmi
        source, target = r.source_node, r.target_node
        sconn = self.connect(source)
        try:
            dom = sconn.lookupByName(v.domain)
            xml = dom.XMLDesc(lv.VIR_DOMAIN_XML_MIGRATABLE)
            params = {
                lv.VIR_MIGRATE_PARAM_URI: "unix://%s/migrationproxy/%s-49152-source.sock" % (SHARE_DIR, v.uid),
                lv.VIR_MIGRATE_PARAM_DEST_XML: xml,
                lv.VIR_MIGRATE_PARAM_PERSIST_XML: xml,
                lv.VIR_MIGRATE_PARAM_DEST_NAME: v.domain,
            }
            flags = lv.VIR_MIGRATE_LIVE | lv.VIR_MIGRATE_PEER2PEER | lv.VIR_MIGRATE_PERSIST_DEST
            if r.block:
                flags |= lv.VIR_MIGRATE_NON_SHARED_INC
                params[lv.VIR_MIGRATE_PARAM_MIGRATE_DISKS] = ["vda"]
                params[lv.VIR_MIGRATE_PARAM_DISKS_URI] = "unix://%s/migrationproxy/%s-49153-source.sock" % (
                    SHARE_DIR, v.uid)
                if sconn.getLibVersion() >= 10009000:  # VIR_MIGRATE_PARAM_MIGRATE_DISKS_DETECT_ZEROES
                    params["migrate_disks_detect_zeroes"] = ["vda"]
            if parallel:
                flags |= lv.VIR_MIGRATE_PARALLEL
                params[lv.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS] = int(parallel)
            if target_paused:
                flags |= lv.VIR_MIGRATE_PAUSED
            if r.postcopy is not None:
                flags |= lv.VIR_MIGRATE_POSTCOPY
                if r.postcopy["bandwidth_mib"]:
                    params[lv.VIR_MIGRATE_PARAM_BANDWIDTH_POSTCOPY] = int(r.postcopy["bandwidth_mib"])
            # The source daemon reaches the TARGET daemon through the proxy: its mode decides.
            dconnuri = "qemu+unix://%s?socket=%s/migrationproxy/%s-source.sock" % (
                self.pods[target].uri_path, SHARE_DIR, v.uid)
            if before_dial:
                before_dial(r)
            outcome = {}

            def run():
                try:
                    dom.migrateToURI3(dconnuri, params, flags)
                    outcome["ok"] = True
                except lv.libvirtError as e:
                    outcome["error"] = str(e)

            t0 = time.monotonic()
            th = threading.Thread(target=run, daemon=True)
            th.start()
            if r.postcopy is not None:
                threading.Thread(target=self._switch_to_postcopy, args=(lv, source, v.domain, th, r, t0),
                                 daemon=True).start()
            source_digest = None
            if check_memory:
                source_digest = self._source_memory_while_held(r, th, source_proc, t0 + timeout)
            else:
                self._watch_source_failure(r, th, t0 + timeout)
            th.join(max(0.0, t0 + timeout - time.monotonic()))
            if th.is_alive():
                try:
                    dom.abortJob()
                except lv.libvirtError:
                    pass
                th.join(30)
                outcome.setdefault("error", "migration did not finish within %.0fs (aborted)" % timeout)
            r.wall_ms = round((time.monotonic() - t0) * 1000, 1)
            r.error = outcome.get("error")
            r.success = bool(outcome.get("ok"))
            try:
                r.source_job = dom.jobStats(lv.VIR_DOMAIN_JOB_STATS_COMPLETED
                                            | lv.VIR_DOMAIN_JOB_STATS_KEEP_COMPLETED)
            except lv.libvirtError:
                pass
        finally:
            sconn.close()
        r.counter_before = self.serial_counter(source)
        if r.block:
            r.disk_counter_before = self.disk_counter(source)
        if not r.success:
            left = self._delete_target_pod_domain(lv, target)
            r.target_cleanup = r.target_cleanup or left
            return
        v.node = target
        tconn = self.connect(target)
        try:
            tdom = tconn.lookupByName(v.domain)
            r.job = tdom.jobStats(lv.VIR_DOMAIN_JOB_STATS_COMPLETED
                                  | lv.VIR_DOMAIN_JOB_STATS_KEEP_COMPLETED)
            r.target_state = tdom.state()[0]
            if check_memory:
                import libvirt_qemu

                def via_libvirt(cmd, args):  # what `virsh qemu-monitor-command` does
                    reply = json.loads(libvirt_qemu.qemuMonitorCommand(
                        tdom, json.dumps({"execute": cmd, "arguments": args}), 0))
                    if "error" in reply:
                        raise RuntimeError("%s: %s" % (cmd, reply["error"]))
                    return reply.get("return")
                r.memory = {"source_sha256": source_digest,
                            "target_sha256": self._pmemsave(target, via_libvirt,
                                                            os.path.join(r.workdir, "target.mem")),
                            "bytes": v.mem_mib << 20}
                r.memory["equal"] = r.memory["source_sha256"] == r.memory["target_sha256"]
                if r.memory["equal"] or not self.keep:  # unequal dumps stay for cmp -l
                    for role in ("source", "target"):
                        os.unlink(os.path.join(r.workdir, role + ".mem"))
            if r.block and target_paused:
                # Both guests are paused: the source QEMU stopped (vm_stop flushed its writes)
                # and is gone, libvirt completed the mirror to the target before Finish.
                paths = {role: self.pods[node].path(v.disk_in_pod)
                         for role, node in (("source", source), ("target", target))}
                r.disk = {"source_sha256": file_sha256(paths["source"]),
                          "target_sha256": file_sha256(paths["target"]),
                          "bytes": v.disk_mib << 20,
                          "sizes": {role: os.path.getsize(p) for role, p in paths.items()}}
                r.disk["equal"] = r.disk["source_sha256"] == r.disk["target_sha256"]
        finally:
            tconn.close()
        r.downtime_ms = r.job.get("downtime")
        r.total_time_ms = r.job.get("time_elapsed")
        r.data_bytes = r.job.get("data_processed", r.job.get("data_total"))
        if r.total_time_ms and r.data_bytes is not None:
            r.throughput_bps = round(r.data_bytes / (r.total_time_ms / 1000.0))

    # After the source QEMU's outgoing migration failed, how long libvirt's call may take to
    # return before the harness deletes the target pod as KubeVirt does for a failed migration.
    TARGET_POD_DELETE_AFTER_S = 5.0

    def _watch_source_failure(self, r, th, deadline):
        """While libvirt's call runs, watches the source QEMU's own migration state over the
        harness's QMP monitor. r.source_failed_at (time.monotonic()) is when it was first
        seen failed or cancelled. If libvirt's call is still running TARGET_POD_DELETE_AFTER_S
        later, the target domain is destroyed (r.target_pod_deleted_at): a target QEMU 7.2
        blocked in a multifd sync on a connection that KubeVirt's proxy keeps open (its
        handleConnection closes only the accepted leg) never answers libvirt's Finish, so
        the call would hang until KubeVirt deletes the target pod."""
        r.source_failed_at = r.target_pod_deleted_at = None
        qmp = None
        try:
            while th.is_alive() and time.monotonic() < deadline:
                th.join(0.25)
                if not th.is_alive():
                    break
                if r.source_failed_at is None:
                    try:
                        if qmp is None:
                            # alive: once libvirt's call returned, stop retrying (after a
                            # success the source QEMU is gone and its socket refuses for good)
                            qmp = QmpClient(self.launcher_root(r.source_node) + self.vmi.qmp_in_pod,
                                            timeout=5, alive=th.is_alive)
                        status = qmp.command("query-migrate", timeout=5).get("status")
                    except Exception:  # noqa: BLE001 - the monitor is an observer; retry next turn
                        if qmp is not None:
                            qmp.close()
                        qmp = None
                        continue
                    if status in ("failed", "cancelled"):
                        r.source_failed_at = time.monotonic()
                elif time.monotonic() - r.source_failed_at >= self.TARGET_POD_DELETE_AFTER_S:
                    r.target_pod_deleted_at = time.monotonic()
                    r.target_cleanup = self._delete_target_pod_domain(libvirt_module(), r.target_node)
                    break
            if r.source_failed_at is None and not th.is_alive():
                # libvirt returned first: the failure is at most this old.
                try:
                    if qmp is None:
                        # One connect attempt: a failed source QEMU still runs and accepts at
                        # once; a gone one (a success) must not cost the 5 s of retries
                        # meant for a starting QEMU.
                        once = iter([True])
                        qmp = QmpClient(self.launcher_root(r.source_node) + self.vmi.qmp_in_pod,
                                        timeout=5, alive=lambda: next(once, False))
                    if qmp.command("query-migrate", timeout=5).get("status") in ("failed", "cancelled"):
                        r.source_failed_at = time.monotonic()
                except Exception:  # noqa: BLE001 - observer only
                    pass
        finally:
            if qmp is not None:
                qmp.close()

    def _delete_target_pod_domain(self, lv, target):
        """A failed migration's target pod is deleted by KubeVirt (virt-controller), which
        takes any domain libvirt left there with it. The stand-in launcher pods live on, so
        the harness destroys such a domain instead. Returns its state name, or None."""
        conn = self.connect(target)
        try:
            try:
                dom = conn.lookupByName(self.vmi.domain)
            except lv.libvirtError:
                return None
            try:  # libvirt may remove the failed incoming domain between the lookup and here
                if dom.isActive() != 1:
                    return None
                state = {lv.VIR_DOMAIN_RUNNING: "running", lv.VIR_DOMAIN_PAUSED: "paused"}.get(
                    dom.state()[0], str(dom.state()[0]))
            except lv.libvirtError:
                return None
            try:
                dom.destroy()
            except lv.libvirtError:
                pass
            return state
        finally:
            conn.close()

    def _stop_handlers(self, r, procs, drain_timeout=10.0):
        """Lets forwarded connections end by themselves (bounded), then SIGTERMs the
        handlers and reads their logs."""
        def open_count(role):
            try:
                with open(os.path.join(r.workdir, "%s-proxy.json" % role)) as f:
                    return json.load(f).get("open", 0)
            except (OSError, ValueError):
                return 0
        if r.success:
            try:
                wait_for(lambda: all(open_count(x) == 0 for x in procs), drain_timeout,
                         "proxied connections to close")
            except TimeoutError:
                pass
        for role, p in procs.items():
            r.handler_cpu_s[role] = proc_cpu_seconds(p.pid)
            _stop(p, timeout=15)
            self._procs.remove(p)
            try:
                with open(os.path.join(r.workdir, "%s-proxy.json" % role)) as f:
                    r.proxy_logs[role] = json.load(f)
            except (OSError, ValueError):
                r.proxy_logs[role] = None


def benchmark(cluster, runs=3, **migrate_kwargs):
    """Runs ``runs`` migrations (back and forth) and returns one dict per run: wall_ms,
    total_time_ms, downtime_ms, data_bytes, throughput_bps (libvirt's figures) and
    handler_cpu_s {"source","target"} (CPU seconds of the proxy processes)."""
    out = []
    for _ in range(runs):
        r = cluster.migrate(**migrate_kwargs)
        out.append({"wall_ms": r.wall_ms, "total_time_ms": r.total_time_ms,
                    "downtime_ms": r.downtime_ms, "data_bytes": r.data_bytes,
                    "throughput_bps": r.throughput_bps, "handler_cpu_s": r.handler_cpu_s,
                    "parallel": r.parallel, "tls": r.tls})
    return out
