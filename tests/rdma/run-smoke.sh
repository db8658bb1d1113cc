#!/usr/bin/env bash
# ctest entry point: boots the Soft-RoCE VM and runs smoke.sh inside it.
#   tests/rdma/run-smoke.sh [run-in-vm.sh options]
# Exit status: smoke.sh's (see run-in-vm.sh for 124/125/126).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$here/run-in-vm.sh" --timeout "${RDMIG_VM_TIMEOUT:-300}" "$@" -- "$here/smoke.sh"
