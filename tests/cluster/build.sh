#!/usr/bin/env bash
# Build a real Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler), etcd, a node's kubelet, kube-proxy and NetworkPolicy engine
# (kube-router), and an image registry (to carry built images to that node) from Go
# modules, for tests that need a live cluster on a machine without a public
# container registry.
#
#   tests/cluster/build.sh            # builds once (cold: tens of minutes on 2 cores)
#   BIN=$(tests/cluster/build.sh | tail -n1)
#
# The versions come from the pinned modules beside this script:
#   k8s/go.mod   k8s.io/kubernetes vX.Y.Z (+ replaces of its staging modules)
#   etcd/go.mod  go.etcd.io/etcd/server/v3 vA.B.C
#   registry/go.mod  github.com/distribution/distribution/v3 (its version is not in
#                the cache path: delete bin/registry to rebuild it after a bump)
#   kube-router/go.mod  github.com/cloudnativelabs/kube-router/v2 (the same: delete
#                bin/kube-router after a bump)
# Binaries go to ${DPSERVE_CACHE:-$HOME/.cache/dpserve}/k8s/<k8s>-etcd<etcd>/bin,
# outside the repo. When all eight exist the script only prints that path. Only the
# missing ones are built: a cache made before the node's two were added keeps its
# control plane, whose cold build is the slow part. A build happens in a temporary
# directory beside the destination; each binary is renamed into place when all
# are built, so an interrupted build never leaves a partial binary in the cache.
# Progress goes to stderr; the bin directory is the last line of stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Binary name -> Go package, built in the k8s module (etcd has its own module).
# The control plane builds from local copies of upstream's mains; the node's two
# straight from k8s.io/kubernetes, which go.mod already requires.
declare -A K8S_PACKAGES=(
    [kube-apiserver]=./cmd/kube-apiserver
    [kube-controller-manager]=./cmd/kube-controller-manager
    [kube-scheduler]=./cmd/kube-scheduler
    [kubelet]=k8s.io/kubernetes/cmd/kubelet
    [kube-proxy]=k8s.io/kubernetes/cmd/kube-proxy
)
# registry (distribution's, its own module too) carries built images to the test node.
# kube-router (its own module) enforces NetworkPolicy on that node (tests/cluster/policy.py).
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler etcd kubelet kube-proxy registry
    kube-router)

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

# The binaries absent from $1/bin, one per line (none: the cache is complete).
missing() {
    local b
    for b in "${BINARIES[@]}"; do
        [[ -x "$1/bin/$b" ]] || echo "$b"
    done
}

if [[ -z "$(missing "$DEST")" ]]; then
    echo "$BIN"
    exit 0
fi

command -v go >/dev/null || { echo "build.sh: go not found on PATH" >&2; exit 1; }
mkdir -p "$CACHE_ROOT"

# One build at a time per cache; a second caller waits, then finds it done.
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
mapfile -t TODO < <(missing "$DEST")
if [[ ${#TODO[@]} -eq 0 ]]; then
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
names=() pkgs=()
for b in "${TODO[@]}"; do
    if [[ -n ${K8S_PACKAGES[$b]:-} ]]; then names+=("$b"); pkgs+=("${K8S_PACKAGES[$b]}"); fi
done
if [[ ${#pkgs[@]} -gt 0 ]]; then
    echo "build.sh: building Kubernetes $K8S_VERSION ${names[*]} (slow when cold) ..." >&2
    (cd "$HERE/k8s" && "${GOBUILD[@]}" -ldflags "$K8S_LDFLAGS" -o "$TMP/bin/" "${pkgs[@]}")
fi
if [[ " ${TODO[*]} " == *" etcd "* ]]; then
    echo "build.sh: building etcd $ETCD_VERSION ..." >&2
    (cd "$HERE/etcd" && "${GOBUILD[@]}" -ldflags "$ETCD_LDFLAGS" -o "$TMP/bin/etcd" .)
fi
if [[ " ${TODO[*]} " == *" registry "* ]]; then
    echo "build.sh: building the image registry ..." >&2
    (cd "$HERE/registry" && "${GOBUILD[@]}" -ldflags "-s -w" -o "$TMP/bin/registry" \
        github.com/distribution/distribution/v3/cmd/registry)
fi
if [[ " ${TODO[*]} " == *" kube-router "* ]]; then
    echo "build.sh: building the NetworkPolicy engine (kube-router) ..." >&2
    KR_VERSION=$(sed -nE 's/^[[:space:]]*(require[[:space:]]+)?github\.com\/cloudnativelabs\/kube-router\/v2[[:space:]]+(v[0-9][^[:space:]]*).*/\2/p' \
        "$HERE/kube-router/go.mod" | head -n1)
    (cd "$HERE/kube-router" && "${GOBUILD[@]}" \
        -ldflags "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KR_VERSION" \
        -o "$TMP/bin/kube-router" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router)
fi
for b in "${TODO[@]}"; do
    [[ -x "$TMP/bin/$b" ]] || { echo "build.sh: the build produced no $b" >&2; exit 1; }
done

mkdir -p "$BIN"
# One rename per binary (same filesystem): each appears whole or not at all.
for b in "${TODO[@]}"; do
    mv -f "$TMP/bin/$b" "$BIN/$b"
done
{
    echo "kubernetes=$K8S_VERSION"
    echo "etcd=$ETCD_VERSION"
    echo "go=$(go env GOVERSION)"
    echo "built=$BUILD_DATE ${TODO[*]}"
} >>"$DEST/VERSIONS"
echo "build.sh: built ${TODO[*]} in $((SECONDS - start))s" >&2
echo "$BIN"
