"""What can be checked of the Dockerfile without a Docker engine (none runs on these machines).

Checked: both stages are Debian 12; every Debian package it installs exists for Debian 12
(`apt-cache policy` has a candidate; needs an `apt-get update` first, done here when root and the
lists are empty); the build stage installs every build package of scripts/install-deps.sh (less
the test-only gtest/gmock); the runtime stage's packages and their dependencies provide every
shared library that the built rdmig-agent and rdmig-controller link (readelf NEEDED -> dpkg -S),
plus rdma-core's user-space providers (ibverbs-providers); the CMake configure step with the
Dockerfile's own flags succeeds on this tree (a configure, not a full build); the build steps
(cmake configure, cmake build, docker build) are the ones docs/deploy.md gives (and README.md,
when it shows a docker build); the final image runs as a non-root user, and the binaries land
where the manifests' `command` expects them; .dockerignore keeps what the build needs.
The build stage copies only the build inputs (so a docs or chart change reuses its layers): the
configure step runs on a tree holding only what its COPY lines copy; the git revision comes in as
the build argument RDMIG_REVISION (.git is not in the context), declared before the configure
step that passes it to CMake, and the docs' docker build passes it.
Not checked here: that the build runs, the image starts and its size: tests/deploy/test_image_build.py
builds it with podman. Nor the base images' current package versions (the packages are resolved
against this machine's Debian 12 lists).

Run: python3 tests/deploy/test_dockerfile.py -v   (ctest -L deploy)
"""
import fnmatch
import os
import re
import shlex
import subprocess
import sys
import shutil
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
for var, rel in (("RDMIG_AGENT", "build-deploy/agent/rdmig-agent"),
                 ("RDMIG_CONTROLLER", "build-deploy/controller/rdmig-controller")):
    os.environ.setdefault(var, os.path.join(REPO, rel))
from deploylib import plain_manifests, pod_spec  # noqa: E402


def parse_dockerfile(path):
    """Stages as [{'from': image, 'name': alias, 'instructions': [(INSTR, text)]}]."""
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    stages = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            parts = rest.split()
            stages.append({"from": parts[0], "name": parts[2] if len(parts) > 2 else None, "instructions": []})
        else:
            stages[-1]["instructions"].append((instr, " ".join(rest.split())))
    return stages


def apt_packages(stage):
    pkgs = []
    for instr, text in stage["instructions"]:
        if instr != "RUN":
            continue
        for cmd in text.split("&&"):
            words = shlex.split(cmd)
            if "apt-get" in words and "install" in words:
                pkgs += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return pkgs


def run_commands(stage):
    """The shell commands of the RUN steps, without RUN's own flags (--mount=...)."""
    out = []
    for instr, text in stage["instructions"]:
        if instr == "RUN":
            while text.startswith("--"):
                text = text.split(None, 1)[1]
            out += [c.strip() for c in text.split("&&")]
    return out


def install_deps_array(name):
    with open(os.path.join(REPO, "scripts", "install-deps.sh")) as f:
        text = f.read()
    m = re.search(r"^%s=\(([^)]*)\)" % name, text, re.M)
    return m.group(1).split()


class DockerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stages = parse_dockerfile(os.path.join(REPO, "Dockerfile"))
        cls.build, cls.runtime = cls.stages[0], cls.stages[-1]

    def test_two_stages_on_debian_12(self):
        self.assertEqual(len(self.stages), 2)
        self.assertEqual(self.build["name"], "build")
        for s in self.stages:
            self.assertRegex(s["from"], r"^debian:(12|bookworm)(-slim)?$")
        self.assertRegex(self.runtime["from"], r"-slim$", "the runtime image is the slim one")

    def test_every_apt_package_exists_in_debian_12(self):
        with open("/etc/os-release") as f:
            osr = f.read()
        if "VERSION_CODENAME=bookworm" not in osr:
            self.skipTest("this machine is not Debian 12: its apt lists say nothing about bookworm")
        pkgs = apt_packages(self.build) + apt_packages(self.runtime)
        self.assertGreater(len(pkgs), 10)

        def candidates():
            out = subprocess.run(["apt-cache", "policy"] + pkgs, capture_output=True, text=True).stdout
            found, current = {}, None
            for line in out.splitlines():
                if line and not line.startswith(" ") and line.endswith(":"):
                    current = line[:-1]
                elif current and line.strip().startswith("Candidate:"):
                    found[current] = line.split(":", 1)[1].strip()
            return found
        found = candidates()
        if not any(v and v != "(none)" for v in found.values()) and os.geteuid() == 0:
            subprocess.run(["apt-get", "update", "-qq"], check=True)
            found = candidates()
        missing = [p for p in pkgs if found.get(p) in (None, "(none)")]
        self.assertEqual(missing, [], "no Debian 12 candidate for: %s (apt-cache policy)" % missing)

    def test_build_stage_installs_every_build_dependency_of_install_deps(self):
        wanted = set(install_deps_array("build_pkgs")) - {"libgtest-dev", "libgmock-dev"}
        self.assertEqual(sorted(wanted - set(apt_packages(self.build))), [])

    def needed_packages(self, binary):
        out = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
        ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        paths = dict(re.findall(r"^\s*(\S+) => (\S+)", ldd, re.M))
        pkgs = {}
        for lib in needed:
            path = os.path.realpath(paths[lib])
            owners = None
            for candidate in (path, path.replace("/usr/lib/", "/lib/", 1)):
                r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
                if r.returncode == 0:
                    owners = r.stdout.split(":")[0]
                    break
            self.assertIsNotNone(owners, "%s: no package owns %s" % (binary, path))
            pkgs[lib] = owners
        return pkgs

    def test_runtime_stage_provides_every_library_the_programs_link(self):
        runtime = apt_packages(self.runtime)
        self.assertIn("ibverbs-providers", runtime, "rdma-core's user-space providers (mlx5, rxe, ...)")
        closure = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
                                  "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances",
                                  "--no-pre-depends"] + runtime, capture_output=True, text=True).stdout
        available = set(runtime) | {l.strip().split(":")[-1].strip().strip("<>") for l in closure.splitlines()}
        for var in ("RDMIG_AGENT", "RDMIG_CONTROLLER"):
            binary = os.environ[var]
            if not os.access(binary, os.X_OK):
                self.fail("%s not built (%s)" % (var, binary))
            for lib, pkg in self.needed_packages(binary).items():
                pkg = pkg.split(":")[0]
                self.assertIn(pkg, available, "%s links %s from %s, which the runtime stage does not install"
                              % (os.path.basename(binary), lib, pkg))

    def build_copies(self):
        """(source, destination) of the build stage's COPY lines from the context."""
        out = []
        for instr, text in self.build["instructions"]:
            if instr == "COPY":
                words = text.split()
                self.assertFalse(words[0].startswith("--from"), text)
                out += [(src, words[-1]) for src in words[:-1]]
        return out

    def test_build_stage_copies_only_build_inputs_and_passes_the_revision(self):
        copies = self.build_copies()
        self.assertNotIn(".", [src for src, _ in copies], "COPY . . rebuilds on every docs or chart change")
        for src, _ in copies:
            self.assertTrue(os.path.exists(os.path.join(REPO, src)), src)
        instr = [(i, t) for i, t in self.build["instructions"]]
        arg = [n for n, (i, t) in enumerate(instr) if i == "ARG" and t.startswith("RDMIG_REVISION")]
        configure = [n for n, (i, t) in enumerate(instr) if i == "RUN" and t.startswith("cmake -S")]
        self.assertEqual(len(arg), 1, "ARG RDMIG_REVISION in the build stage")
        self.assertLess(arg[0], configure[0])
        self.assertIn('-DRDMIG_REVISION="${RDMIG_REVISION}"', instr[configure[0]][1])
        last_copy = max(n for n, (i, _) in enumerate(instr) if i == "COPY")
        self.assertGreater(arg[0], last_copy, "declared after the copies: the package layer does not depend on it")
        with open(os.path.join(REPO, ".dockerignore")) as f:
            self.assertIn(".git", f.read().split(), "the revision argument is needed because .git is not sent")
        with open(os.path.join(REPO, "docs", "deploy.md")) as f:
            deploy = f.read()
        self.assertIn("docker build --build-arg RDMIG_REVISION=$(git rev-parse --short=12 HEAD)", deploy)

    def test_cmake_configure_step_works_with_the_dockerfile_flags(self):
        configure = [c for c in run_commands(self.build) if c.startswith("cmake -S")]
        self.assertEqual(len(configure), 1)
        words = shlex.split(configure[0].replace("${RDMIG_REVISION}", "0123456789ab"))
        tmp = tempfile.mkdtemp(prefix="rdmig-docker-configure-")
        try:
            # The source tree as the build stage has it: only what its COPY lines copy.
            src = os.path.join(tmp, "src")
            for path, dest in self.build_copies():
                target = os.path.join(src, dest)  # a directory: every destination here ends in /
                if os.path.isdir(os.path.join(REPO, path)):
                    shutil.copytree(os.path.join(REPO, path), target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    os.makedirs(target, exist_ok=True)
                    shutil.copy(os.path.join(REPO, path), target)
            words[words.index("-S") + 1] = src
            words[words.index("-B") + 1] = os.path.join(tmp, "build")
            r = subprocess.run(words, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            with open(os.path.join(tmp, "build", "CMakeCache.txt")) as f:
                cache = f.read()
            self.assertIn("RDMIG_BUILD_TESTS:BOOL=OFF", cache)
            with open(os.path.join(tmp, "build", "generated", "common", "version.h")) as f:
                self.assertIn('"0123456789ab"', f.read(), "the build argument names the revision")
            targets = subprocess.run(["cmake", "--build", os.path.join(tmp, "build"), "--target", "help"],
                                     capture_output=True, text=True).stdout
            for t in ("rdmig-agent", "rdmig-controller"):
                self.assertIn(t, targets)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_build_steps_are_the_ones_the_docs_give(self):
        cmake_steps = [c for c in run_commands(self.build) if c.startswith("cmake ")]
        self.assertEqual(len(cmake_steps), 2, cmake_steps)
        self.assertIn("--target rdmig-agent rdmig-controller", cmake_steps[1])
        # The compile goes through ccache, whose objects live in a build cache mount, not in a layer.
        self.assertIn("ccache", apt_packages(self.build))
        self.assertIn("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", cmake_steps[0])
        build_run = [t for i, t in self.build["instructions"] if i == "RUN" and "cmake --build" in t]
        self.assertEqual(len(build_run), 1, build_run)
        self.assertTrue(build_run[0].startswith("--mount=type=cache,target=/root/.cache/ccache"), build_run[0])
        with open(os.path.join(REPO, "docs", "deploy.md")) as f:
            deploy = " ".join(f.read().split())
        for step in cmake_steps:
            self.assertTrue(step in deploy, "docs/deploy.md does not give the Dockerfile's step: " + step)
        docker_build = re.findall(r"docker build [^`\n]*", deploy)
        self.assertTrue(docker_build, "docs/deploy.md gives no docker build command")
        readme = os.path.join(REPO, "README.md")
        if os.path.exists(readme):
            with open(readme) as f:
                text = f.read()
            for cmd in re.findall(r"docker build [^`\n]*", text):
                self.assertTrue(" ".join(cmd.split()) in deploy,
                                "README.md's `%s` differs from docs/deploy.md's" % cmd.strip())

    def test_runtime_runs_non_root_and_holds_the_binaries_the_manifests_start(self):
        users = [t for i, t in self.runtime["instructions"] if i == "USER"]
        self.assertEqual(users, ["65532:65532"])
        commands = set()
        for w in plain_manifests():
            if w["kind"] in ("DaemonSet", "Deployment"):
                commands.update(c["command"][0] for c in pod_spec(w)["containers"])
        self.assertEqual(commands, {"/usr/local/bin/rdmig-agent", "/usr/local/bin/rdmig-controller"})
        installs = " ".join(run_commands(self.build))
        for c in commands:
            self.assertIn("/out" + c, installs)
        self.assertIn(("COPY", "--from=build /out/ /"), self.runtime["instructions"])
        dep = [w for w in plain_manifests() if w["kind"] == "Deployment"][0]
        self.assertEqual(pod_spec(dep)["securityContext"]["runAsUser"], 65532, "the controller runs as the image's user")

    def test_dockerignore_keeps_what_the_build_needs(self):
        with open(os.path.join(REPO, ".dockerignore")) as f:
            patterns = [l.strip() for l in f if l.strip() and not l.startswith("#")]
        for needed in ("CMakeLists.txt", "src", "agent", "controller", "bench/stream", "tests/CMakeLists.txt",
                       "agent/agent.yaml", "controller/controller.yaml"):
            for p in patterns:
                self.assertFalse(fnmatch.fnmatch(needed, p) or needed.startswith(p.rstrip("/") + "/"),
                                 ".dockerignore pattern %s drops %s" % (p, needed))


if __name__ == "__main__":
    unittest.main()
