# Sourced by scripts/build.sh, test.sh and demo.sh: where the heavy set-up is cached.
# Outside the clone, so that every clone and every CI run on this machine reuses it: the
# guest kernel and images, the Soft-RoCE VM's base initramfs, the Debian 13 launcher root,
# helm/kubectl, the image test's base and podman storage, and ccache's compiler cache.
# Default /var/cache/rdmig (root, as the README's commands run); elsewhere <repo>/.cache.
# Any of these set beforehand wins.
_rdmig_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${RDMIG_CACHE:-}" ]; then
  if mkdir -p /var/cache/rdmig 2>/dev/null && [ -w /var/cache/rdmig ]; then
    RDMIG_CACHE=/var/cache/rdmig
  else
    RDMIG_CACHE="$_rdmig_repo/.cache"
  fi
fi
export RDMIG_CACHE
export RDMIG_LAUNCHER_CACHE="${RDMIG_LAUNCHER_CACHE:-$RDMIG_CACHE}"
export RDMIG_TOOLS_DIR="${RDMIG_TOOLS_DIR:-$RDMIG_CACHE/tools}"
export RDMIG_IMAGE_CACHE="${RDMIG_IMAGE_CACHE:-$RDMIG_CACHE/image-test}"
# ccache: object files keyed by the preprocessed source and the flags; paths under the clone
# are made relative (CCACHE_BASEDIR) and the build directory left out of the key
# (CCACHE_NOHASHDIR: debug info may then name the clone that compiled it first), so a fresh
# clone of the same sources compiles only what differs.
export CCACHE_DIR="${CCACHE_DIR:-$RDMIG_CACHE/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$_rdmig_repo}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-3G}"
unset _rdmig_repo
