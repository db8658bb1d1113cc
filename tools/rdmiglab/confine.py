#!/usr/bin/env python3
"""Runs a command confined as a container runtime confines a pod's container, for the lab's
unprivileged agent (rdmiglab/profile.py builds the command line):

  confine.py [--read-only-root [--writable DIR]...] [--seccomp PROFILE.json --caps A,B] -- CMD...

--read-only-root  a mount namespace of its own (mounts from the host still propagate in, as
                  HostToContainer volumes) whose / is remounted read-only; each --writable DIR is
                  bind-mounted onto itself first, so it stays writable (a pod's volumes)
--seccomp         a seccomp filter from a Docker/containerd profile (JSON: defaultAction, syscalls
                  with names, action, args, includes/excludes by caps, arches and minKernel), for a
                  process whose capabilities will be --caps (names without CAP_), as runc builds it;
                  no_new_privs is left to the command (setpriv), as runc leaves it to the pod's
                  allowPrivilegeEscalation
Then execs CMD (setpriv, which drops the capabilities and execs the agent). Uses libseccomp
through ctypes (libseccomp.so.2; no Python binding needed) and libc's unshare and mount.
"""
import ctypes
import json
import os
import platform
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_SLAVE = 1, 32, 4096, 16384, 1 << 19
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_FLTATR_CTL_NNP = 3
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5,
       "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def die(msg):
    print("confine.py: " + msg, file=sys.stderr)
    sys.exit(125)


def libc_call(fn, *args):
    if fn(*args) != 0:
        e = ctypes.get_errno()
        die("%s%r: %s" % (fn.__name__, args, os.strerror(e)))


def read_only_root(writable):
    libc = ctypes.CDLL(None, use_errno=True)
    libc_call(libc.unshare, CLONE_NEWNS)
    libc_call(libc.mount, None, b"/", None, MS_REC | MS_SLAVE, None)
    for d in writable:
        libc_call(libc.mount, d.encode(), d.encode(), None, MS_BIND | MS_REC, None)
    libc_call(libc.mount, None, b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)


def action(name, errno_ret):
    if name == "SCMP_ACT_ALLOW":
        return SCMP_ACT_ALLOW
    if name == "SCMP_ACT_ERRNO":
        return 0x00050000 | (errno_ret & 0xFFFF)
    if name == "SCMP_ACT_KILL":
        return 0
    die("seccomp action %s not supported" % name)


def kernel_at_least(version):
    have = [int(x) for x in platform.release().split("-")[0].split(".")[:2]]
    return have >= [int(x) for x in version.split(".")[:2]]


def applies(rule, caps):
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    if any(c not in caps for c in inc.get("caps") or []):
        return False
    if inc.get("arches") and ARCH not in inc["arches"]:
        return False
    if inc.get("minKernel") and not kernel_at_least(inc["minKernel"]):
        return False
    if any(c in caps for c in exc.get("caps") or []):
        return False
    if ARCH in (exc.get("arches") or []):
        return False
    return True


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def load_seccomp(path, caps):
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        lib = ctypes.CDLL("/usr/lib/%s-linux-gnu/libseccomp.so.2" % platform.machine())
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    with open(path) as f:
        prof = json.load(f)
    default = action(prof["defaultAction"], prof.get("defaultErrnoRet", 1))
    ctx = lib.seccomp_init(default)
    if not ctx:
        die("seccomp_init failed")
    if lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0) != 0:
        die("seccomp_attr_set(CTL_NNP, 0) failed")
    caps = {"CAP_" + c for c in caps}
    for rule in prof["syscalls"]:
        if not applies(rule, caps):
            continue
        act = action(rule["action"], rule.get("errnoRet", 1))
        args = rule.get("args") or []
        arr = (ArgCmp * max(1, len(args)))(*[ArgCmp(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0))
                                             for a in args])
        for name in rule["names"]:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a syscall of this architecture or unknown to this libseccomp: runc skips it too
            rc = lib.seccomp_rule_add_array(ctx, act, nr, len(args), arr)
            if rc != 0 and rc != -17:  # -EEXIST: the same rule again
                die("seccomp_rule_add(%s): %s" % (name, os.strerror(-rc)))
    rc = lib.seccomp_load(ctx)
    if rc != 0:
        die("seccomp_load: %s" % os.strerror(-rc))


def main(argv):
    if "--" not in argv:
        die("usage: confine.py [--read-only-root [--writable DIR]...] [--seccomp PROFILE --caps A,B] -- CMD...")
    i = argv.index("--")
    opts, cmd = argv[:i], argv[i + 1:]
    writable, seccomp, caps, ro = [], None, [], False
    it = iter(opts)
    for o in it:
        if o == "--writable":
            writable.append(next(it))
        elif o == "--read-only-root":
            ro = True
        elif o == "--seccomp":
            seccomp = next(it)
        elif o == "--caps":
            caps = [c for c in next(it).split(",") if c]
        else:
            die("unknown option %s" % o)
    if ro:
        read_only_root(writable)
    if seccomp:
        load_seccomp(seccomp, caps)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        die("exec %s: %s" % (cmd[0], e))


if __name__ == "__main__":
    main(sys.argv[1:])
