#!/usr/bin/env bash
# Build the S3 server the storage tests run against (tests/storage/s3.py): s3server/main.go,
# Versity's S3 gateway (versitygw, Apache-2.0) with its posix backend, on the Go module
# pinned in s3server/go.mod beside this script. docs/test-storage.md says why this server.
#
#   tests/storage/build.sh            # builds once (cold: 2-4 minutes on 2 busy cores)
#   BIN=$(tests/storage/build.sh | tail -n1)
#
# The binary goes to ${DPSERVE_CACHE:-$HOME/.cache/dpserve}/s3/versitygw-<version>-<hash>/bin,
# outside the repo, where <hash> covers main.go, go.mod and go.sum (an edit rebuilds);
# when it exists the script only prints that path. A build happens in a temporary
# directory beside the destination and the binary is renamed into place, so an
# interrupted build never leaves a partial binary in the cache. Progress goes to
# stderr; the bin directory is the last line of stdout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODULE="$HERE/s3server"

# The version straight from go.mod (no `go` invocation: keeps the warm path fast).
VERSION=$(sed -nE 's/^[[:space:]]*(require[[:space:]]+)?github\.com\/versity\/versitygw[[:space:]]+(v[0-9][^[:space:]]*).*/\2/p' \
    "$MODULE/go.mod" | head -n1)
if [[ -z "$VERSION" ]]; then
    echo "build.sh: cannot read the versitygw version from $MODULE/go.mod" >&2
    exit 1
fi
SOURCES=$(cd "$MODULE" && cat main.go go.mod go.sum | sha256sum | cut -c1-12)

CACHE_ROOT="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/s3"
DEST="$CACHE_ROOT/versitygw-$VERSION-$SOURCES"
BIN="$DEST/bin"

if [[ -x "$BIN/s3server" ]]; then
    echo "$BIN"
    exit 0
fi

command -v go >/dev/null || {
    echo "build.sh: go not found on PATH (the S3 server builds from Go modules; install Go 1.25 or newer)" >&2
    exit 1
}
mkdir -p "$CACHE_ROOT"

# One build at a time per cache; a second caller waits, then finds it done.
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
if [[ -x "$BIN/s3server" ]]; then
    echo "$BIN"
    exit 0
fi

# Temp dir on the same filesystem as DEST so the final rename is atomic.
# Leftovers of a killed build (we hold the lock, so none is live).
rm -rf "$CACHE_ROOT"/*.building.*
TMP=$(mktemp -d "$DEST.building.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM

export CGO_ENABLED=0          # a static binary, no C toolchain needed
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)

start=$SECONDS
echo "build.sh: building the S3 server on versitygw $VERSION (minutes when cold) ..." >&2
# -mod=readonly: build exactly what go.mod/go.sum pin, whatever GOFLAGS says.
(cd "$MODULE" && go build -mod=readonly -trimpath -ldflags "-s -w" -o "$TMP/s3server" .)
[[ -x "$TMP/s3server" ]] || { echo "build.sh: the build produced no s3server" >&2; exit 1; }

mkdir -p "$BIN"
mv -f "$TMP/s3server" "$BIN/s3server"   # one rename (same filesystem): whole or absent
{
    echo "versitygw=$VERSION"
    echo "sources=$SOURCES"
    echo "go=$(go env GOVERSION)"
    echo "built=$BUILD_DATE"
} >>"$DEST/VERSIONS"
echo "build.sh: built the S3 server in $((SECONDS - start))s" >&2
echo "$BIN"
