#!/usr/bin/env bash
# Build the operator, router and worker images (the Dockerfile's targets) on this
# machine, with nothing pulled from a container registry (docs/images.md):
#
#   images/build.sh            # or: make images
#
# Tags: dpserve-{operator,router,worker}:<appVersion of charts/dpserve/Chart.yaml>.
# The last three lines of stdout are "<ref> <image id> <size in bytes>", one an image;
# progress goes to stderr.
#
# - The engine: images/engine.sh (installs docker.io when missing, starts dockerd).
# - The base: images/base.sh makes dpserve-base:bookworm once (debootstrap) and it
#   stands in for python:3.11-slim-bookworm through PYTHON_IMAGE and BASE.
# - pip: the machine's pip config file and CA bundle go in as build secrets (pip-conf,
#   pip-cert), so pip inside the build reaches the index as pip here does; no layer
#   keeps them.
# - torch: from the PyTorch CPU index when it answers; else TORCH_INDEX_URL is empty
#   (pip's configured index, whose torch is the larger CUDA build). TORCH_INDEX_URL in
#   the environment, even empty, is passed as it is.
# - Afterwards our dangling images (a tag's previous build; by the dev.dpserve.image
#   label, so nobody else's) are pruned, so repeated builds do not fill the disk;
#   BuildKit's cache is capped by engine.sh's config.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CPU_INDEX=https://download.pytorch.org/whl/cpu
TARGETS=(operator router worker)
started=$SECONDS

log() { echo "build.sh: $*" >&2; }

DOCKER=$(bash "$ROOT/images/engine.sh")
export DOCKER_BUILDKIT=1
BASE_IMAGE=$(bash "$ROOT/images/base.sh" "$DOCKER")

VERSION=$(sed -nE 's/^appVersion:[[:space:]]*"?([^"[:space:]]+)"?.*/\1/p' \
    "$ROOT/charts/dpserve/Chart.yaml")
if [[ -z $VERSION ]]; then
    log "no appVersion in charts/dpserve/Chart.yaml"
    exit 1
fi

if [[ -n ${TORCH_INDEX_URL+set} ]]; then
    torch_index=$TORCH_INDEX_URL
elif curl --silent --fail --max-time 10 --output /dev/null "$CPU_INDEX/torch/"; then
    torch_index=$CPU_INDEX
else
    torch_index=""
    log "the PyTorch CPU index ($CPU_INDEX) does not answer: torch comes from pip's" \
        "configured index (PyPI's torch is the CUDA build, several GB larger)"
fi

# The pip configuration pip itself would read first, and the CA bundle it names.
secrets=()
pip_conf=${PIP_CONFIG_FILE:-}
if [[ -z $pip_conf ]]; then
    for candidate in "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf" /etc/pip.conf; do
        if [[ -f $candidate ]]; then
            pip_conf=$candidate
            break
        fi
    done
fi
[[ -n $pip_conf && -f $pip_conf ]] && secrets+=(--secret "id=pip-conf,src=$pip_conf")
[[ -n ${PIP_CERT:-} && -f $PIP_CERT ]] && secrets+=(--secret "id=pip-cert,src=$PIP_CERT")

for target in "${TARGETS[@]}"; do
    args=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE" --build-arg "BASE=$BASE_IMAGE")
    [[ $target == worker ]] && args+=(--build-arg "TORCH_INDEX_URL=$torch_index")
    log "building dpserve-$target:$VERSION"
    # --network host: dockerd runs without a bridge (engine.sh says why).
    "$DOCKER" build --network host --target "$target" --tag "dpserve-$target:$VERSION" \
        "${args[@]}" "${secrets[@]}" "$ROOT" >&2
done

# Only this project's images (their label), never other dangling images on the machine.
"$DOCKER" image prune --force --filter label=dev.dpserve.image >/dev/null
log "done in $((SECONDS - started)) s"
for target in "${TARGETS[@]}"; do
    ref="dpserve-$target:$VERSION"
    echo "$ref $("$DOCKER" image inspect --format '{{.Id}} {{.Size}}' "$ref")"
done
