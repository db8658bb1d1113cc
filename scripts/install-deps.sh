#!/usr/bin/env bash
# Installs the Debian 12 packages rdmig needs to build, run its demo and run its tests.
# Only what is missing is installed. Run as root.
#   scripts/install-deps.sh [--test]   (--test adds what only the tests need)
set -euo pipefail

build_pkgs=(cmake g++ make pkg-config libibverbs-dev librdmacm-dev libcpp-httplib-dev
  nlohmann-json3-dev prometheus-cpp-dev libyaml-cpp-dev libssl-dev libgtest-dev libgmock-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libnftables-dev libvirt-dev)
run_pkgs=(qemu-system-x86 busybox-static python3 rdma-core ibverbs-providers
  ibverbs-utils rdmacm-utils iproute2 socat cpio gzip)
# prometheus: promtool for tests/deploy/test_alerts.py (promtool check/test rules), and the
# Prometheus server that tests/deploy/test_dashboard_prometheus.py runs against live programs
# podman, debootstrap: tests/deploy/test_image_build.py builds the Dockerfile (chroot isolation,
# no OCI runtime needed; debootstrap makes the Debian 12 base images); debootstrap also builds
# the cached Debian 13 root of the non-root KubeVirt launcher pods (tools/rdmiglab/launcher_root.py;
# a copy of it with trixie-backports' QEMU serves the post-copy cases with multifd)
# faketime: tests/integration/test_agent_migration.py runs a target agent and QEMU with their
# wall clock 60 s off, as on a node whose clock disagrees (the switchover must not depend on it)
# tcpdump: tests/rdma/transport-two-nodes.sh captures the RoCE v2 packets between two nodes
# ccache: scripts/build.sh compiles through it when present; its cache in /var/cache/rdmig/ccache
# (scripts/cache-env.sh) makes a fresh clone's build take a minute instead of ten
# clang: tests/unit/thread_safety_check.py runs Debian's clang++ (14 on Debian 12) with
# -Wthread-safety over the sources that state their lock rules (common/thread_annotations.h)
test_pkgs=(perftest iperf3 seabios openssl nodejs npm unzip python3-yaml binutils prometheus
  podman debootstrap faketime tcpdump ccache clang)
# tests/kubevirt: KubeVirt's migration path with real libvirt in namespaces: the host's libvirtd
# 9.0 for RDMIG_KV_LAUNCHER=bookworm-root; the default non-root launchers bring libvirt 11.3
# and QEMU 10.0 in their trixie root, and need only python3-libvirt (and util-linux) here.
kubevirt_test_pkgs=(libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients python3-libvirt
  python3-grpcio nftables util-linux passwd)

want=("${build_pkgs[@]}" "${run_pkgs[@]}")
if [ "${1:-}" = "--test" ]; then want+=("${test_pkgs[@]}"); fi
if [ "${1:-}" = "--test" ]; then want+=("${kubevirt_test_pkgs[@]}"); fi

missing=()
for p in "${want[@]}"; do
  # Node.js may come from elsewhere (this machine kind ships NodeSource's nodejs, which
  # bundles npm and conflicts with Debian's npm package): a working command is enough.
  case "$p" in
    nodejs) command -v node >/dev/null && continue ;;
    npm) command -v npm >/dev/null && continue ;;
  esac
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all ${#want[@]} packages present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages (${missing[*]}); run as root to install them" >&2
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
