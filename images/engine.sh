#!/usr/bin/env bash
# A Docker engine for building the images, on a machine without systemd: installs
# Debian's docker.io (and debootstrap, which makes the local base image) when missing,
# then starts dockerd when it does not answer. Safe to call when it is already up.
#
#   images/engine.sh          # prints the docker client to use (/usr/bin/docker)
#
# Why each choice:
# - /usr/bin/docker, Debian's client: the `docker` first on PATH may be a newer client
#   that insists on a buildx plugin; this one builds with BuildKit (DOCKER_BUILDKIT=1).
# - dockerd --iptables=false --bridge=none: its iptables rules set the FORWARD policy
#   to DROP, which breaks the test node's pod bridge on this host. Builds use
#   `--network host` and test containers `--network none`, so no bridge is needed.
# - dockerd's containerd is its own instance, started here with its own config,
#   socket, root and state (under dpserve-docker names), and named by --containerd:
#   left alone, dockerd would attach to any containerd found on the default socket
#   (/run/containerd/containerd.sock) and otherwise start a managed one. The test
#   node's containerd is another instance with its own paths; the two never meet.
# - A config file of our own (--config-file), so /etc/docker/daemon.json is not
#   touched; it caps BuildKit's cache so repeated builds do not fill the disk.
# Logs: ${DPSERVE_CACHE:-~/.cache/dpserve}/docker/{dockerd,containerd}.log.
set -euo pipefail

DOCKER=/usr/bin/docker
CACHE="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/docker"
RUN_DIR=/run/dpserve-docker
CTR_SOCK="$RUN_DIR/containerd.sock"
CTR_ROOT=/var/lib/dpserve-docker/containerd
CTR_CONF="$CACHE/containerd.toml"
DOCKERD_CONF="$CACHE/daemon.json"
PIDFILE=/var/run/docker.pid

log() { echo "engine.sh: $*" >&2; }

# wait_for SECONDS COMMAND...: true as soon as COMMAND succeeds.
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

install_missing() {
    # Package -> a file it installs (a cheap presence check).
    declare -A provides=([docker.io]=/usr/sbin/dockerd [debootstrap]=/usr/sbin/debootstrap)
    local want=() pkg
    for pkg in "${!provides[@]}"; do
        [[ -e ${provides[$pkg]} ]] || want+=("$pkg")
    done
    [[ ${#want[@]} -eq 0 ]] && return 0
    if [[ $(id -u) -ne 0 ]]; then
        log "missing ${want[*]}, and installing them needs root"
        exit 1
    fi
    log "installing ${want[*]} from Debian"
    export DEBIAN_FRONTEND=noninteractive
    # Debian's maintainer scripts start a service they install where an init system
    # runs; that dockerd would have the default flags (iptables on). policy-rc.d tells
    # them not to; it is removed again unless it was there before.
    local policy=/usr/sbin/policy-rc.d
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    local apt_get=(apt-get -o DPkg::Lock::Timeout=600 -y --no-install-recommends)
    # The package lists may be absent on a fresh machine: refresh once, then retry.
    if ! "${apt_get[@]}" install "${want[@]}" >&2; then
        "${apt_get[@]}" update >&2
        "${apt_get[@]}" install "${want[@]}" >&2
    fi
    rm -f "$policy"
    trap - EXIT
}

# The config is rewritten on each start (cheap, and a changed script takes effect).
write_configs() {
    mkdir -p "$CACHE" "$RUN_DIR" "$CTR_ROOT"
    cat >"$CTR_CONF" <<EOF
# containerd for dockerd only (images/engine.sh); the CRI plugin is the test node's job.
version = 2
root = "$CTR_ROOT"
state = "$RUN_DIR/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "$CTR_SOCK"

[plugins."io.containerd.internal.v1.opt"]
  path = "$CTR_ROOT/opt"
EOF
    cat >"$DOCKERD_CONF" <<'EOF'
{
  "features": {"buildkit": true},
  "builder": {"gc": {"enabled": true, "defaultKeepStorage": "30GB"}}
}
EOF
}

start_containerd() {
    if wait_for 0 ctr --address "$CTR_SOCK" version; then
        return 0
    fi
    log "starting containerd for dockerd (log: $CACHE/containerd.log)"
    # setsid + nohup: the daemon outlives this script and the shell that called it.
    setsid nohup /usr/bin/containerd --config "$CTR_CONF" \
        >>"$CACHE/containerd.log" 2>&1 </dev/null &
    if ! wait_for 30 ctr --address "$CTR_SOCK" version; then
        log "containerd did not answer on $CTR_SOCK; see $CACHE/containerd.log"
        exit 1
    fi
}

start_dockerd() {
    # A dockerd that is starting (pid alive, not answering yet) is waited for, not doubled.
    if [[ -s $PIDFILE ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        if wait_for 60 "$DOCKER" version; then
            return 0
        fi
        log "dockerd (pid $(cat "$PIDFILE")) runs but does not answer; see $CACHE/dockerd.log"
        exit 1
    fi
    log "starting dockerd (log: $CACHE/dockerd.log)"
    setsid nohup /usr/sbin/dockerd \
        --config-file "$DOCKERD_CONF" \
        --containerd "$CTR_SOCK" \
        --iptables=false --ip-masq=false --bridge=none \
        --pidfile "$PIDFILE" \
        >>"$CACHE/dockerd.log" 2>&1 </dev/null &
    if ! wait_for 60 "$DOCKER" version; then
        log "dockerd did not answer; see $CACHE/dockerd.log"
        exit 1
    fi
}

install_missing
if ! "$DOCKER" version >/dev/null 2>&1; then
    if [[ $(id -u) -ne 0 ]]; then
        log "dockerd is not running, and starting it needs root"
        exit 1
    fi
    write_configs
    start_containerd
    start_dockerd
fi
echo "$DOCKER"
