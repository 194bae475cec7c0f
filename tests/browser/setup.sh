#!/usr/bin/env bash
# Debian's Chromium for the browser tests (tests/browser), installed once when absent.
# Playwright drives it as is (its own browser download needs the internet); a font so
# the screenshots show text.
set -euo pipefail
CHROMIUM=/usr/bin/chromium
[ -x "$CHROMIUM" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "tests/browser/setup.sh: $CHROMIUM is missing; install Debian's chromium (apt-get install chromium) as root" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt run (CI images and other jobs may hold the lock) instead of failing.
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
echo "installed Debian's chromium $(dpkg-query -W -f='${Version}' chromium)"
