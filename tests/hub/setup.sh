#!/usr/bin/env bash
# The hub-API server of the hf:// tests: olah (PyPI, MIT) at the versions pinned in
# requirements.txt, in its own venv under ${DPSERVE_CACHE:-~/.cache/dpserve}/hub (it cannot
# share .venv: its fastapi-utils pins psutil<6), and git-lfs, which stores the served
# repositories' weights as the hub does. Idempotent: when both exist it only prints the
# path of olah's command, the last line of stdout.
#
#   OLAH=$(bash tests/hub/setup.sh | tail -n1)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQUIREMENTS="$HERE/requirements.txt"
PYTHON=${PYTHON:-python3}
ROOT="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/hub"
# Keyed by the pins: a bump builds a new venv beside the old one.
DEST="$ROOT/olah-$(sha256sum "$REQUIREMENTS" | cut -c1-12)"

if ! git lfs version >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "tests/hub/setup.sh: git-lfs is missing; install Debian's git-lfs (apt-get install git-lfs) as root" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    # Wait for another apt run (CI images and other jobs may hold the lock) instead of failing.
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends git-lfs >/dev/null
    echo "installed Debian's git-lfs $(dpkg-query -W -f='${Version}' git-lfs)" >&2
fi

mkdir -p "$ROOT"
# One builder at a time (two pytest runs may start together); the marker is written last,
# so a build that was killed half-way is started again, never used.
exec 9>"$ROOT/.lock"
flock 9
if [ ! -f "$DEST/.complete" ]; then
    echo "building olah's venv in $DEST" >&2
    rm -rf "$DEST"
    "$PYTHON" -m venv "$DEST"
    "$DEST/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REQUIREMENTS"
    touch "$DEST/.complete"
fi
echo "$DEST/bin/olah-cli"
