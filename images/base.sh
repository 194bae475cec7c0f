#!/usr/bin/env bash
# Make the local stand-in for python:3.11-slim-bookworm, without any container
# registry: a minimal Debian bookworm (debootstrap --variant=minbase, from the Debian
# mirror this machine's apt sources name) with python3, python3-venv and
# ca-certificates, imported as an image.
#
#   images/base.sh [DOCKER]       # prints the image name, dpserve-base:bookworm
#
# Made once: skipped while the image exists and carries this script's hash as a
# label; a changed script makes it again. Needs root (debootstrap) and a running
# dockerd (images/engine.sh).
set -euo pipefail

DOCKER=${1:-/usr/bin/docker}
IMAGE=dpserve-base:bookworm
SUITE=bookworm
HASH_LABEL=dev.dpserve.base.script-sha256
HASH=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
WORK_ROOT="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/base-work"

log() { echo "base.sh: $*" >&2; }

have=$("$DOCKER" image inspect --format "{{index .Config.Labels \"$HASH_LABEL\"}}" "$IMAGE" \
    2>/dev/null || true)
if [[ $have == "$HASH" ]]; then
    echo "$IMAGE"
    exit 0
fi

# The first mirror apt uses for the suite itself (not -security or -updates), from the
# one-line sources.list format and the deb822 *.sources format alike.
mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
    local f
    for f in "${files[@]}"; do
        [[ -f $f ]] || continue
        case $f in
        *.sources)
            # Paragraphs separated by blank lines; URIs and Suites may list several words.
            awk -v suite="$SUITE" '
                function flush() {
                    if (uri != "" && index(" " suites " ", " " suite " ")) { print uri; exit }
                    uri = ""; suites = ""
                }
                /^[[:space:]]*$/ { flush(); next }
                /^URIs:/ { uri = $2 }
                /^Suites:/ { $1 = ""; suites = $0 }
                END { flush() }' "$f"
            ;;
        *)
            # deb [options] URI SUITE COMPONENTS...
            sed -E 's/\[[^]]*\]//' "$f" |
                awk -v suite="$SUITE" '$1 == "deb" && $3 == suite { print $2; exit }'
            ;;
        esac
    done | head -n1
}

MIRROR=$(mirror)
if [[ -z $MIRROR ]]; then
    log "no apt source for $SUITE in /etc/apt/sources.list(.d); cannot debootstrap"
    exit 1
fi
if [[ $(id -u) -ne 0 ]]; then
    log "debootstrap needs root"
    exit 1
fi

mkdir -p "$WORK_ROOT"
ROOTFS=$(mktemp -d "$WORK_ROOT/rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT
log "debootstrap $SUITE from $MIRROR (about a minute)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK_ROOT/debootstrap.log" 2>&1 || {
    log "debootstrap failed; see $WORK_ROOT/debootstrap.log"
    exit 1
}
# What an image need not carry: downloaded packages and package lists (a build that
# needs apt runs apt-get update, as on the official slim images).
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
    "$ROOTFS"/var/log/* "$ROOTFS"/tmp/*

# The same environment the slim Python images set, so the Dockerfile sees one shape.
tar --numeric-owner -C "$ROOTFS" -c . | "$DOCKER" import \
    --change "LABEL $HASH_LABEL=$HASH" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$IMAGE" >/dev/null
log "made $IMAGE ($("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE") bytes)"
echo "$IMAGE"
