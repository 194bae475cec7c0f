#!/usr/bin/env bash
# Build the S3 server the storage tests run against (tests/storage/s3.py): Versity's S3
# gateway (versitygw, Apache-2.0) with its posix backend, from the Go module pinned in
# versitygw/go.mod beside this script. docs/test-storage.md says why this server.
#
#   tests/storage/build.sh            # builds once (cold: 4-7 minutes on 2 busy cores)
#   BIN=$(tests/storage/build.sh | tail -n1)
#
# The binary goes to ${DPSERVE_CACHE:-$HOME/.cache/dpserve}/s3/versitygw-<version>/bin,
# outside the repo; when it exists the script only prints that path. A build happens in
# a temporary directory beside the destination and the binary is renamed into place, so
# an interrupted build never leaves a partial binary in the cache. Progress goes to
# stderr; the bin directory is the last line of stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODULE="$HERE/versitygw"
PACKAGE=github.com/versity/versitygw/cmd/versitygw

# The version straight from go.mod (no `go` invocation: keeps the warm path fast).
VERSION=$(sed -nE 's/^[[:space:]]*(require[[:space:]]+)?github\.com\/versity\/versitygw[[:space:]]+(v[0-9][^[:space:]]*).*/\2/p' \
    "$MODULE/go.mod" | head -n1)
if [[ -z "$VERSION" ]]; then
    echo "build.sh: cannot read the versitygw version from $MODULE/go.mod" >&2
    exit 1
fi

CACHE_ROOT="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/s3"
DEST="$CACHE_ROOT/versitygw-$VERSION"
BIN="$DEST/bin"

if [[ -x "$BIN/versitygw" ]]; then
    echo "$BIN"
    exit 0
fi

command -v go >/dev/null || {
    echo "build.sh: go not found on PATH (the S3 server builds from its Go module; install Go 1.25 or newer)" >&2
    exit 1
}
mkdir -p "$CACHE_ROOT"

# One build at a time per cache; a second caller waits, then finds it done.
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
if [[ -x "$BIN/versitygw" ]]; then
    echo "$BIN"
    exit 0
fi

# Temp dir on the same filesystem as DEST so the final rename is atomic.
# Leftovers of a killed build (we hold the lock, so none is live).
rm -rf "$DEST".building.*
TMP=$(mktemp -d "$DEST.building.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM

export CGO_ENABLED=0          # a static binary, no C toolchain needed
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
LDFLAGS="-s -w -X main.Version=$VERSION -X main.Build=module -X main.BuildTime=$BUILD_DATE"

start=$SECONDS
echo "build.sh: building versitygw $VERSION (a few minutes when cold) ..." >&2
# -mod=readonly: build exactly what go.mod/go.sum pin, whatever GOFLAGS says.
(cd "$MODULE" && go build -mod=readonly -trimpath -ldflags "$LDFLAGS" -o "$TMP/versitygw" "$PACKAGE")
[[ -x "$TMP/versitygw" ]] || { echo "build.sh: the build produced no versitygw" >&2; exit 1; }

mkdir -p "$BIN"
mv -f "$TMP/versitygw" "$BIN/versitygw"   # one rename (same filesystem): whole or absent
{
    echo "versitygw=$VERSION"
    echo "go=$(go env GOVERSION)"
    echo "built=$BUILD_DATE"
} >>"$DEST/VERSIONS"
echo "build.sh: built versitygw in $((SECONDS - start))s" >&2
echo "$BIN"
