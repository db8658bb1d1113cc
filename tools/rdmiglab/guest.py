"""Builds (or reuses) the test guest: Debian kernel + busybox initramfs."""
import os
import subprocess

TOOLS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_DIR = os.path.dirname(TOOLS_DIR)
BUILD_SCRIPT = os.path.join(TOOLS_DIR, "guest", "build-guest.sh")


def ensure_guest(out_dir=None, timeout=600):
    """Runs tools/guest/build-guest.sh [out_dir]; returns (vmlinuz, initramfs) paths.

    out_dir defaults to the script's default, $RDMIG_CACHE/guest or else
    <repo>/.cache/guest (the script runs with the repository root as its cwd)."""
    argv = [BUILD_SCRIPT] + ([out_dir] if out_dir else [])
    res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         timeout=timeout, check=False, cwd=REPO_DIR)
    if res.returncode != 0:
        raise RuntimeError("build-guest.sh failed (rc %d): %s"
                           % (res.returncode, res.stderr.decode(errors="replace")))
    out = res.stdout.decode().strip().splitlines()[-1]
    vmlinuz = os.path.join(out, "vmlinuz")
    initrd = os.path.join(out, "initramfs.cpio.gz")
    for p in (vmlinuz, initrd):
        if not os.path.isfile(p):
            raise RuntimeError("build-guest.sh did not produce %s" % p)
    return vmlinuz, initrd
