#!/usr/bin/env bash
# Command (1) of the README: sets up everything on a fresh Debian 12 machine (as root), then
# live-migrates a real QEMU guest between two local rdmig-agents through their REST API.
#   scripts/demo.sh [demo options; see python3 tools/demo.py --help]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
exec python3 tools/demo.py "$@"
