#!/usr/bin/env bash
# The hub-API server of the hf:// tests: olah (PyPI, MIT) at the versions pinned in
# requirements.txt, in its own venv under ${DPSERVE_CACHE:-~/.cache/dpserve}/hub (it cannot
# share .venv: its fastapi-utils pins psutil<6); git-lfs, which stores the served
# repositories' weights as the hub does; and Debian's nginx binary, unpacked beside them
# (not installed: its package would start a system nginx on port 80), which asks for a
# token in front of olah where a test wants a private repository. Idempotent: when all
# exist it only prints where they are, the last two lines of stdout:
#
#   olah=/…/bin/olah-cli
#   nginx=/…/usr/sbin/nginx
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQUIREMENTS="$HERE/requirements.txt"
PYTHON=${PYTHON:-python3}
ROOT="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/hub"
# Keyed by the pins: a bump builds a new venv beside the old one.
DEST="$ROOT/olah-$(sha256sum "$REQUIREMENTS" | cut -c1-12)"

NGINX="$ROOT/nginx"
export DEBIAN_FRONTEND=noninteractive

# apt's package lists, fetched once where a fresh machine has none (root only).
apt_lists() {
    [ "$(id -u)" -eq 0 ] || return 0
    apt-cache show "$1" >/dev/null 2>&1 && return 0
    # Wait for another apt run (CI images and other jobs may hold the lock) instead of failing.
    apt-get -o DPkg::Lock::Timeout=600 update -qq
}

if ! git lfs version >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "tests/hub/setup.sh: git-lfs is missing; install Debian's git-lfs (apt-get install git-lfs) as root" >&2
        exit 1
    fi
    apt_lists git-lfs
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends git-lfs >/dev/null
    echo "installed Debian's git-lfs $(dpkg-query -W -f='${Version}' git-lfs)" >&2
fi

mkdir -p "$ROOT"
# One builder at a time (two pytest runs may start together); each marker is written
# last, so a build that was killed half-way is started again, never used.
exec 9>"$ROOT/.lock"
flock 9
if [ ! -f "$NGINX/.complete" ]; then
    echo "unpacking Debian's nginx into $NGINX" >&2
    rm -rf "$NGINX"
    mkdir -p "$NGINX/deb"
    apt_lists nginx
    # stdout is for the paths below; apt warns that its sandbox user cannot write here
    (cd "$NGINX/deb" && apt-get -q download nginx >&2 2>/dev/null)
    dpkg-deb -x "$NGINX"/deb/nginx_*.deb "$NGINX"
    rm -rf "$NGINX/deb"
    "$NGINX/usr/sbin/nginx" -v 2>/dev/null
    touch "$NGINX/.complete"
fi
if [ ! -f "$DEST/.complete" ]; then
    echo "building olah's venv in $DEST" >&2
    rm -rf "$DEST"
    "$PYTHON" -m venv "$DEST"
    "$DEST/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REQUIREMENTS"
    touch "$DEST/.complete"
fi
echo "olah=$DEST/bin/olah-cli"
echo "nginx=$NGINX/usr/sbin/nginx"
