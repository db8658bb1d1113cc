"""The cached launcher roots (tools/rdmiglab/launcher_root.py) are rebuilt when what they hold is
not what their recipe installs.

CI of 2026-12-07 ran every KubeVirt row that means KubeVirt 1.9's QEMU 10.0 on QEMU 11.1.3: the
backports root had been built through a symlinked launcher root, "cp -a" copied the link, and apt
installed trixie-backports' QEMU into the launcher root itself. These cases use a scratch cache
with roots that hold only what the check reads (dpkg's status file and the stamp); the builds
themselves (debootstrap, apt) run in the rows that use the roots."""
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from rdmiglab import launcher_root as lr  # noqa: E402

TRIXIE = "1:10.0.13+ds-0+deb13u1"
BACKPORTS = "1:11.1.3+ds-2~bpo13+1"

STATUS = """Package: libc6
Status: install ok installed
Version: 2.41-12

Package: qemu-system-x86
Status: install ok installed
Priority: optional
Version: {v}
Description: QEMU full system emulation binaries (x86)
 Version: 0.0 in a continuation line is not the version

Package: zlib1g
Status: install ok installed
Version: 1:1.3.dfsg+really1.3.1-1+b1
"""


def fake_root(path, qemu_version, stamped=True):
    os.makedirs(os.path.join(path, "var/lib/dpkg"), exist_ok=True)
    with open(os.path.join(path, "var/lib/dpkg/status"), "w") as f:
        f.write(STATUS.format(v=qemu_version))
    if stamped:
        with open(os.path.join(path, lr.STAMP), "w") as f:
            f.write("test root\n")


class LauncherRootCheckTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="rdmig-lr-")
        self.old = os.environ.get("RDMIG_LAUNCHER_CACHE")
        os.environ["RDMIG_LAUNCHER_CACHE"] = self.tmp.name
        self.built = []

    def tearDown(self):
        if self.old is None:
            del os.environ["RDMIG_LAUNCHER_CACHE"]
        else:
            os.environ["RDMIG_LAUNCHER_CACHE"] = self.old
        self.tmp.cleanup()

    def builder(self, version):
        def build(dest):
            self.built.append(dest)
            fake_root(dest, version)
        return build

    def test_reads_the_installed_qemu_version_from_dpkg(self):
        fake_root(lr.root_path(), TRIXIE)
        self.assertEqual(lr.qemu_package_version(lr.root_path()), TRIXIE)
        self.assertIsNone(lr.qemu_package_version(os.path.join(self.tmp.name, "none")))
        self.assertFalse(lr.is_backports_version(TRIXIE))
        self.assertTrue(lr.is_backports_version(BACKPORTS))

    def test_sound_launcher_root_is_reused_without_a_build(self):
        fake_root(lr.root_path(), TRIXIE)
        path = lr._ensure(lr.root_path(), self.builder(TRIXIE), False, lr._launcher_root_sound)
        self.assertEqual(path, lr.root_path())
        self.assertEqual(self.built, [])

    def test_launcher_root_with_backports_qemu_is_built_again(self):
        fake_root(lr.root_path(), BACKPORTS)
        marker = os.path.join(lr.root_path(), "left-over")
        open(marker, "w").close()
        lr._ensure(lr.root_path(), self.builder(TRIXIE), False, lr._launcher_root_sound)
        self.assertEqual(self.built, [lr.root_path()])
        self.assertEqual(lr.qemu_package_version(lr.root_path()), TRIXIE)
        self.assertFalse(os.path.exists(marker))  # the old root is gone, not patched

    def test_backports_root_without_backports_qemu_is_built_again(self):
        dest = lr.backports_root_path()
        fake_root(dest, TRIXIE)
        lr._ensure(dest, self.builder(BACKPORTS), False, lr._backports_root_sound)
        self.assertEqual(self.built, [dest])
        self.assertTrue(lr.is_backports_version(lr.qemu_package_version(dest)))

    def test_root_without_qemu_is_not_sound(self):
        fake_root(lr.root_path(), TRIXIE)
        os.unlink(os.path.join(lr.root_path(), "var/lib/dpkg/status"))
        with open(os.path.join(lr.root_path(), "var/lib/dpkg/status"), "w") as f:
            f.write("Package: libc6\nStatus: install ok installed\nVersion: 2.41-12\n")
        lr._ensure(lr.root_path(), self.builder(TRIXIE), False, lr._launcher_root_sound)
        self.assertEqual(self.built, [lr.root_path()])

    def test_symlinked_root_is_replaced_not_followed_on_rebuild(self):
        real = os.path.join(self.tmp.name, "elsewhere")
        fake_root(real, BACKPORTS)
        os.symlink(real, lr.root_path())
        lr._ensure(lr.root_path(), self.builder(TRIXIE), False, lr._launcher_root_sound)
        self.assertFalse(os.path.islink(lr.root_path()))
        self.assertEqual(lr.qemu_package_version(real), BACKPORTS)  # the link's target untouched


if __name__ == "__main__":
    unittest.main()
