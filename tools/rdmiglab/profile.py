"""The agent's least-privilege profile, as the chart renders it, applied in the lab.

The chart runs the agent unprivileged (agent.privileged: false, docs/security.md "The agent's
privileges"): root, with only the capabilities of its enabled modes
(charts/rdmig/files/agent-capabilities.yaml, the file the chart's template reads), every other
dropped, seccomp RuntimeDefault, a read-only root filesystem and, unless SYS_ADMIN is among the
capabilities, allowPrivilegeEscalation: false. In a pod, root with those capabilities has them
as its bounding, permitted and effective sets, and none inheritable or ambient.

``Profile.wrap(argv)`` runs a command the same way on this host (confine.py): in a mount
namespace of its own whose root is read-only but for the given writable directories (bind mounts,
as a pod's volumes), under the runtime's default seccomp profile (seccomp-runtime-default.json:
moby/profiles' seccomp/default.json, Apache-2.0, at cd3bed8; containerd's RuntimeDefault is the
same list), then through util-linux ``setpriv`` with exactly those capabilities and
``--no-new-privs`` where the chart sets allowPrivilegeEscalation: false.
``Profile.check(pid)`` reads /proc/<pid>/status and fails unless the process holds exactly that.

``security_context()`` is the container securityContext the chart must render for the profile:
tests/deploy/test_chart.py compares it with ``helm template`` for every combination of modes, so
the lab never runs the agent under a list the chart does not ship, or the other way round.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CAPABILITIES_FILE = os.path.join(REPO, "charts", "rdmig", "files", "agent-capabilities.yaml")
SECCOMP_PROFILE = os.path.join(HERE, "seccomp-runtime-default.json")
CONFINE = os.path.join(HERE, "confine.py")

# linux/capability.h
CAP_BITS = {
    "CHOWN": 0, "DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
    "SETUID": 7, "SETPCAP": 8, "LINUX_IMMUTABLE": 9, "NET_BIND_SERVICE": 10, "NET_BROADCAST": 11, "NET_ADMIN": 12,
    "NET_RAW": 13, "IPC_LOCK": 14, "IPC_OWNER": 15, "SYS_MODULE": 16, "SYS_RAWIO": 17, "SYS_CHROOT": 18,
    "SYS_PTRACE": 19, "SYS_PACCT": 20, "SYS_ADMIN": 21, "SYS_BOOT": 22, "SYS_NICE": 23, "SYS_RESOURCE": 24,
    "SYS_TIME": 25, "SYS_TTY_CONFIG": 26, "MKNOD": 27, "LEASE": 28, "AUDIT_WRITE": 29, "AUDIT_CONTROL": 30,
    "SETFCAP": 31, "MAC_OVERRIDE": 32, "MAC_ADMIN": 33, "SYSLOG": 34, "WAKE_ALARM": 35, "BLOCK_SUSPEND": 36,
    "AUDIT_READ": 37, "PERFMON": 38, "BPF": 39, "CHECKPOINT_RESTORE": 40,
}


def chart_capabilities():
    """{mode: [capability, ...]} from the chart's file (a map of lists of names; read without
    PyYAML, which the Soft-RoCE VM lacks; test_chart.py checks it against yaml.safe_load)."""
    table, mode = {}, None
    with open(CAPABILITIES_FILE) as f:
        for raw in f:
            line = raw.split("#", 1)[0].rstrip()
            if not line:
                continue
            if not line.startswith(" ") and line.endswith(":"):
                mode = line[:-1]
                table[mode] = []
            elif line.strip().startswith("- ") and mode is not None:
                table[mode].append(line.strip()[2:].strip())
            else:
                raise ValueError("%s: cannot read %r" % (CAPABILITIES_FILE, raw))
    return table


class Profile:
    """One unprivileged agent profile: ``caps`` (names without CAP_), ``no_new_privs``,
    ``seccomp`` (the RuntimeDefault list) and ``read_only_root``."""

    def __init__(self, caps, no_new_privs=None, seccomp=True, read_only_root=True):
        self.caps = sorted(set(caps))
        for c in self.caps:
            if c not in CAP_BITS:
                raise ValueError("unknown capability %r" % c)
        # Kubernetes refuses allowPrivilegeEscalation: false beside SYS_ADMIN (which escalates anyway).
        self.no_new_privs = ("SYS_ADMIN" not in self.caps) if no_new_privs is None else no_new_privs
        self.seccomp, self.read_only_root = seccomp, read_only_root

    def __repr__(self):
        return "Profile(caps=%s, no_new_privs=%s, seccomp=%s, read_only_root=%s)" % (
            self.caps, self.no_new_privs, self.seccomp, self.read_only_root)

    def without(self, *caps):
        """The same profile less ``caps`` (a test that shows a capability is needed)."""
        return Profile([c for c in self.caps if c not in caps], self.no_new_privs, self.seccomp, self.read_only_root)

    def security_context(self):
        """The agent container's securityContext the chart renders for this profile."""
        caps = {"drop": ["ALL"]}
        if self.caps:
            caps["add"] = list(self.caps)
        sc = {"privileged": False, "runAsUser": 0, "capabilities": caps,
              "readOnlyRootFilesystem": self.read_only_root, "seccompProfile": {"type": "RuntimeDefault"}}
        if self.no_new_privs:
            sc["allowPrivilegeEscalation"] = False
        return sc

    def mask(self):
        return sum(1 << CAP_BITS[c] for c in self.caps)

    def wrap(self, argv, writable=()):
        """``argv`` run under this profile; ``writable``: the directories that stay writable
        under the read-only root (the pod's volumes)."""
        # util-linux's (a busybox setpriv has no --bounding-set)
        setpriv = ["/usr/bin/setpriv" if os.path.exists("/usr/bin/setpriv") else "setpriv", "--bounding-set=-all" + "".join(",+" + c.lower() for c in self.caps),
                   "--inh-caps=-all", "--ambient-caps=-all"]
        if self.no_new_privs:
            setpriv.append("--no-new-privs")
        confine = [sys.executable, CONFINE]
        if self.read_only_root:
            confine.append("--read-only-root")
            for w in writable:
                confine += ["--writable", os.path.abspath(w)]
        if self.seccomp:
            confine += ["--seccomp", SECCOMP_PROFILE, "--caps", ",".join(self.caps)]
        return confine + ["--"] + setpriv + ["--"] + list(argv)

    def check(self, pid):
        """Fails unless process ``pid`` holds exactly this profile (its /proc status)."""
        with open("/proc/%d/status" % pid) as f:
            status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        want = {"CapBnd": self.mask(), "CapPrm": self.mask(), "CapEff": self.mask(), "CapInh": 0, "CapAmb": 0}
        got = {k: int(status[k], 16) for k in want}
        problems = ["%s %s, want %s" % (k, names(got[k]), names(want[k])) for k in want if got[k] != want[k]]
        if status.get("NoNewPrivs", "0").strip() != ("1" if self.no_new_privs else "0"):
            problems.append("NoNewPrivs %s, want %d" % (status.get("NoNewPrivs"), self.no_new_privs))
        if self.seccomp and status.get("Seccomp", "0").strip() != "2":
            problems.append("Seccomp %s, want 2 (filter)" % status.get("Seccomp"))
        if self.read_only_root:
            root_flags = mount_options(pid, "/")
            if "ro" not in root_flags:
                problems.append("root filesystem mounted %s, want ro" % ",".join(root_flags))
        if problems:
            raise RuntimeError("pid %d is not under %r: %s" % (pid, self, "; ".join(problems)))


def names(mask):
    return "[" + ",".join(n for n, b in sorted(CAP_BITS.items(), key=lambda x: x[1]) if mask >> b & 1) + "]"


def mount_options(pid, target):
    """The per-mount options of ``target`` in the mount namespace of ``pid`` (last mount wins)."""
    opts = []
    with open("/proc/%d/mountinfo" % pid) as f:
        for line in f:
            fields = line.split()
            if fields[4] == target:
                opts = fields[5].split(",")
    return opts


def for_modes(kubevirt, rdma):
    """The chart's profile for an agent with KubeVirt mode and RDMA on or off."""
    table = chart_capabilities()
    caps = list(table.get("rdma", [])) if rdma else []
    if kubevirt:
        caps += table.get("kubevirt", [])
    return Profile(caps)


def for_config(cfg):
    """The chart's profile for an agent config (a dict as rdmiglab.Agent writes it): KubeVirt
    mode when kubevirt.enabled, RDMA unless transport is tcp."""
    kubevirt = bool((cfg.get("kubevirt") or {}).get("enabled"))
    return for_modes(kubevirt, cfg.get("transport", "auto") != "tcp")


def resolve(profile, cfg):
    """``profile`` as rdmiglab.Agent takes it: None = $RDMIG_AGENT_PROFILE ("chart", or unset/""
    for none), "chart" = for_config(cfg), a Profile as is."""
    if profile is None:
        profile = os.environ.get("RDMIG_AGENT_PROFILE") or None
    if profile is None or isinstance(profile, Profile):
        return profile
    if profile == "chart":
        return for_config(cfg)
    raise ValueError("agent profile %r: want 'chart' or a Profile" % (profile,))
