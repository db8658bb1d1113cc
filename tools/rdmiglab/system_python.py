"""Debian's python3-libvirt and python3-grpcio live in /usr/bin/python3's dist-packages, which a
pyenv or venv python3 first on PATH does not see: scripts that need them re-exec themselves."""
import os
import sys


def reexec_with_system_python(modules=("libvirt", "grpc")):
    """Re-executes the running script under /usr/bin/python3 when one of ``modules`` cannot be
    imported here (and this is not already that interpreter); returns otherwise."""
    try:
        for m in modules:
            __import__(m)
        return
    except ImportError:
        system = "/usr/bin/python3"
        if os.path.realpath(sys.executable) != os.path.realpath(system) and os.access(system, os.X_OK):
            os.execv(system, [system] + sys.argv)


def human(n):
    """Bytes in binary units: 96.5 MiB."""
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return "%.1f %s" % (n, unit)
        n /= 1024
