#!/usr/bin/env bash
# Build a real Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler) and etcd from Go modules, for tests that need a live cluster on
# a machine without Docker or a container registry.
#
#   tests/cluster/build.sh            # builds once (cold: tens of minutes on 2 cores)
#   BIN=$(tests/cluster/build.sh | tail -n1)
#
# The versions come from the pinned modules beside this script:
#   k8s/go.mod   k8s.io/kubernetes vX.Y.Z (+ replaces of its staging modules)
#   etcd/go.mod  go.etcd.io/etcd/server/v3 vA.B.C
# Binaries go to ${DPSERVE_CACHE:-$HOME/.cache/dpserve}/k8s/<k8s>-etcd<etcd>/bin,
# outside the repo. When all four exist the script only prints that path. A build
# happens in a temporary directory beside the destination that is renamed into
# place when complete, so an interrupted build never leaves a partial cache.
# Progress goes to stderr; the bin directory is the last line of stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler etcd)

# Versions straight from go.mod (no `go` invocation: keeps the warm path fast).
K8S_VERSION=$(sed -nE 's/^[[:space:]]*(require[[:space:]]+)?k8s\.io\/kubernetes[[:space:]]+(v[0-9][^[:space:]]*).*/\2/p' \
    "$HERE/k8s/go.mod" | head -n1)
ETCD_VERSION=$(sed -nE 's/^[[:space:]]*(require[[:space:]]+)?go\.etcd\.io\/etcd\/server\/v3[[:space:]]+(v[0-9][^[:space:]]*).*/\2/p' \
    "$HERE/etcd/go.mod" | head -n1)
if [[ -z "$K8S_VERSION" || -z "$ETCD_VERSION" ]]; then
    echo "build.sh: cannot read versions from $HERE/k8s/go.mod or $HERE/etcd/go.mod" >&2
    exit 1
fi

CACHE_ROOT="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/k8s"
DEST="$CACHE_ROOT/${K8S_VERSION}-etcd${ETCD_VERSION#v}"
BIN="$DEST/bin"

complete() {
    local b
    for b in "${BINARIES[@]}"; do
        [[ -x "$1/bin/$b" ]] || return 1
    done
}

if complete "$DEST"; then
    echo "$BIN"
    exit 0
fi

command -v go >/dev/null || { echo "build.sh: go not found on PATH" >&2; exit 1; }
mkdir -p "$CACHE_ROOT"

# One build at a time per cache; a second caller waits, then finds it done.
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
if complete "$DEST"; then
    echo "$BIN"
    exit 0
fi

# Temp dir on the same filesystem as DEST so the final rename is atomic.
# Leftovers of a killed build (we hold the lock, so none is live).
rm -rf "$DEST".building.*
TMP=$(mktemp -d "$DEST.building.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM
mkdir -p "$TMP/bin"

export CGO_ENABLED=0          # static binaries, as upstream builds the control plane
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
# -mod=readonly: build exactly what go.mod/go.sum pin, whatever GOFLAGS says.
GOBUILD=(go build -mod=readonly -trimpath)

K8S_MINOR=$(echo "$K8S_VERSION" | cut -d. -f2)
K8S_MAJOR=$(echo "${K8S_VERSION#v}" | cut -d. -f1)
BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
K8S_LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    K8S_LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$K8S_MAJOR"
    K8S_LDFLAGS+=" -X $pkg.gitMinor=$K8S_MINOR -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
    K8S_LDFLAGS+=" -X $pkg.buildDate=$BUILD_DATE"
done
ETCD_LDFLAGS="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION"

start=$SECONDS
echo "build.sh: building Kubernetes $K8S_VERSION control plane (slow when cold) ..." >&2
(cd "$HERE/k8s" && "${GOBUILD[@]}" -ldflags "$K8S_LDFLAGS" -o "$TMP/bin/" \
    ./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler)
echo "build.sh: building etcd $ETCD_VERSION ..." >&2
(cd "$HERE/etcd" && "${GOBUILD[@]}" -ldflags "$ETCD_LDFLAGS" -o "$TMP/bin/etcd" .)

complete "$TMP" || { echo "build.sh: build produced no complete bin dir" >&2; exit 1; }
{
    echo "kubernetes=$K8S_VERSION"
    echo "etcd=$ETCD_VERSION"
    echo "go=$(go env GOVERSION)"
    echo "built=$BUILD_DATE"
} >"$TMP/VERSIONS"

# A leftover incomplete DEST (e.g. binaries deleted by hand) is replaced.
[[ -e "$DEST" ]] && rm -rf "$DEST"
mv -T "$TMP" "$DEST"
trap - EXIT
echo "build.sh: built in $((SECONDS - start))s" >&2
echo "$BIN"
