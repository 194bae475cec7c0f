#!/usr/bin/env bash
# Install what a real test node needs from Debian's packages, when missing:
# containerd (its CRI plugin runs the node's pods), runc, the CNI plugins (bridge,
# host-local, loopback, portmap), iptables and conntrack (kube-proxy programs and
# flushes them), ipset (the policy engine's address sets), busybox-static (the test
# image's whole root fs) and gcc (the pause program is compiled here, statically).
#
#   tests/cluster/node-deps.sh        # a no-op when everything is present
#
# Needs root for apt-get. Safe beside another apt user: it waits for dpkg's lock
# instead of failing on it. A containerd service the package may start (where an
# init system runs) is left alone: the test node runs its own instance, with its
# own socket, root and state, beside it (as beside Docker's).
set -euo pipefail

# Package -> a file it installs (a cheap presence check without dpkg-query).
declare -A PROVIDES=(
    [containerd]=/usr/bin/containerd
    [runc]=/usr/sbin/runc
    [containernetworking-plugins]=/usr/lib/cni/bridge
    [iptables]=/usr/sbin/iptables
    [ipset]=/usr/sbin/ipset
    [conntrack]=/usr/sbin/conntrack
    [busybox-static]=/usr/share/doc/busybox-static
    [gcc]=/usr/bin/gcc
    [libc6-dev]=/usr/include/stdio.h  
)

want=()
for pkg in "${!PROVIDES[@]}"; do
    [[ -e ${PROVIDES[$pkg]} ]] || want+=("$pkg")
done
[[ ${#want[@]} -eq 0 ]] && exit 0

if [[ $(id -u) -ne 0 ]]; then
    echo "node-deps.sh: missing ${want[*]}, and installing them needs root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt_get=(apt-get -o DPkg::Lock::Timeout=600 -y --no-install-recommends)
# The package lists may be absent on a fresh machine: refresh once, then retry.
if ! "${apt_get[@]}" install "${want[@]}" >&2; then
    "${apt_get[@]}" update >&2
    "${apt_get[@]}" install "${want[@]}" >&2
fi
