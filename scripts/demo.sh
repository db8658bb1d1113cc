#!/usr/bin/env bash
# Command (1) of the README: sets up everything on a fresh Debian 12 machine (as root), then
# live-migrates a real QEMU guest between two local rdmig-agents through their REST API.
#   scripts/demo.sh [demo options; see python3 tools/demo.py --help]
#   scripts/demo.sh --kubevirt [options; see /usr/bin/python3 tools/demo_kubevirt.py --help]
#     the same through KubeVirt's migration path (real libvirt, virt-handler netns, mTLS
#     proxies) with two agents in KubeVirt mode carrying it; needs the test packages.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cache-env.sh   # the guest, the launcher root and ccache live in /var/cache/rdmig
if [ "${1:-}" = "--kubevirt" ]; then
  shift
  scripts/install-deps.sh --test   # libvirt, python3-libvirt, python3-grpcio, nftables
  scripts/build.sh
  # python3-libvirt and python3-grpcio are Debian's: only /usr/bin/python3 sees them.
  exec /usr/bin/python3 tools/demo_kubevirt.py "$@"
fi
scripts/install-deps.sh
scripts/build.sh
exec python3 tools/demo.py "$@"
