# One Dockerfile, three images (docs/images.md, docs/kubernetes.md). Build with BuildKit
# (Docker 20.10+ with DOCKER_BUILDKIT=1, or buildx):
#
#   docker build --target operator -t dpserve-operator:0.1.0 .
#   docker build --target router   -t dpserve-router:0.1.0 .
#   docker build --target worker   -t dpserve-worker:0.1.0 .        # CPU torch, tiny model baked in
#
#   # CUDA worker: a CUDA base and torch from a CUDA wheel index
#   docker build --target worker -t dpserve-worker:0.1.0-cuda \
#     --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# `make images` (images/build.sh) builds all three on a machine without a container
# registry: it makes a Debian bookworm base locally (images/base.sh: debootstrap, with
# python3 and python3-venv) and passes it as PYTHON_IMAGE and BASE; it hands the
# machine's pip config and CA bundle to pip as build secrets (ids pip-conf and
# pip-cert, read by images/pip-run.sh), which no layer keeps; and where the PyTorch
# index does not answer it sets TORCH_INDEX_URL empty, meaning pip's configured index.
#
# The operator and router images install only their extras' requirements: no torch,
# no diffusers. Every image runs as the numeric user 10001, so Kubernetes can verify
# `runAsNonRoot`, and has `dpserve` as its entrypoint. Third-party packages go into
# layers that depend only on each extra's requirement list (images/requirements.py
# reads it from pyproject.toml); the dpserve wheel follows with --no-deps, so a code
# change rebuilds a small layer and never the one with torch.

# Slim Python for the wheel, the operator and the router (and the CPU worker).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Base of the worker image: the same slim Python for CPU (keep the two defaults equal; a
# test checks), an nvidia/cuda runtime image for CUDA (Debian/Ubuntu based; Python 3.10+
# and venv are installed with apt when the base lacks them).
ARG BASE=python:3.11-slim-bookworm

# ------------------------------------------------------------------ build inputs
# Each extra's requirements (the project's dependencies included), one file per extra
# in /requirements. Rerun when pyproject.toml changes; the layers that install a list
# are rebuilt only when that list's content changes.
FROM ${PYTHON_IMAGE} AS requirements
RUN --mount=type=bind,source=pyproject.toml,target=/src/pyproject.toml \
    --mount=type=bind,source=images/requirements.py,target=/src/requirements.py \
    python3 /src/requirements.py /src/pyproject.toml /requirements

# The dpserve wheel (pure Python), built once and installed by every image.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dpserve ./dpserve
RUN --mount=type=secret,id=pip-conf --mount=type=secret,id=pip-cert \
    --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/build \
    && sh /run/pip-run.sh /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

# ------------------------------------------------------------------ operator and router
# What the operator and router images share: the non-root user and the environment.
FROM ${PYTHON_IMAGE} AS slim-runtime
RUN groupadd --gid 10001 dpserve \
    && useradd --uid 10001 --gid 10001 --home-dir /home/dpserve --create-home \
       --shell /usr/sbin/nologin dpserve
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/dpserve
WORKDIR /home/dpserve

# Each venv first takes a current pip: the distribution's (23.0 on bookworm) backtracks
# for over 20 minutes on the router's requirements (boto3 beside the Kubernetes client),
# where a current one resolves them in seconds.
FROM slim-runtime AS operator-deps
RUN --mount=type=secret,id=pip-conf --mount=type=secret,id=pip-cert \
    --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=bind,from=requirements,source=/requirements/operator.txt,target=/run/requirements.txt \
    --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/venv \
    && sh /run/pip-run.sh /opt/venv/bin/pip install --upgrade pip \
    && sh /run/pip-run.sh /opt/venv/bin/pip install -r /run/requirements.txt

# The operator: kopf and the Kubernetes client. The chart runs it with a read-only root
# filesystem and an emptyDir at /tmp.
FROM operator-deps AS operator
# Which dpserve image this is: `make images` prunes only its own old builds by it.
LABEL dev.dpserve.image=operator
RUN --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=bind,from=wheel,source=/wheels,target=/run/wheels \
    sh /run/pip-run.sh /opt/venv/bin/pip install --no-deps --no-cache-dir /run/wheels/dpserve-*.whl
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["dpserve"]
CMD ["operator", "--all-namespaces"]

FROM slim-runtime AS router-deps
RUN --mount=type=secret,id=pip-conf --mount=type=secret,id=pip-cert \
    --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=bind,from=requirements,source=/requirements/router.txt,target=/run/requirements.txt \
    --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/venv \
    && sh /run/pip-run.sh /opt/venv/bin/pip install --upgrade pip \
    && sh /run/pip-run.sh /opt/venv/bin/pip install -r /run/requirements.txt

# The router: FastAPI, uvicorn and the Kubernetes client (EndpointSlice discovery).
FROM router-deps AS router
LABEL dev.dpserve.image=router
RUN --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=bind,from=wheel,source=/wheels,target=/run/wheels \
    sh /run/pip-run.sh /opt/venv/bin/pip install --no-deps --no-cache-dir /run/wheels/dpserve-*.whl
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["dpserve"]
CMD ["router", "--help"]

# ------------------------------------------------------------------ worker
# The worker's runtime: BASE with a Python 3.10+ that can create virtual environments.
FROM ${BASE} AS worker-runtime
ARG DEBIAN_FRONTEND=noninteractive
RUN set -eux; \
    if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; assert sys.version_info >= (3, 10), sys.version'; \
    groupadd --gid 10001 dpserve; \
    useradd --uid 10001 --gid 10001 --home-dir /home/dpserve --create-home \
        --shell /usr/sbin/nologin dpserve
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/dpserve \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1

# torch first, in a layer of its own that only these two arguments change: from a
# PyTorch wheel index, the CPU one by default (PyPI's torch is a larger CUDA build);
# https://download.pytorch.org/whl/cu128 (etc.) for CUDA; empty for pip's configured
# index. The worker's other requirements then find torch satisfied and keep it.
# torchvision comes from the same index in the same step: its compiled ops are built
# against one torch build (a PyPI torchvision beside a CPU-index torch would not load).
FROM worker-runtime AS worker-torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A pip requirement, e.g. "torch==2.9.1" to pin the version.
ARG TORCH_SPEC=torch
RUN --mount=type=secret,id=pip-conf --mount=type=secret,id=pip-cert \
    --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/venv \
    && sh /run/pip-run.sh /opt/venv/bin/pip install --upgrade pip \
    && sh /run/pip-run.sh /opt/venv/bin/pip install \
       ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" torchvision

FROM worker-torch AS worker-deps
RUN --mount=type=secret,id=pip-conf --mount=type=secret,id=pip-cert \
    --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=bind,from=requirements,source=/requirements/worker.txt,target=/run/requirements.txt \
    --mount=type=cache,target=/root/.cache/pip \
    sh /run/pip-run.sh /opt/venv/bin/pip install -r /run/requirements.txt

# The worker: one replica (a gang of ranks) per pod, started by the operator.
FROM worker-deps AS worker
LABEL dev.dpserve.image=worker
RUN --mount=type=bind,source=images/pip-run.sh,target=/run/pip-run.sh \
    --mount=type=bind,from=wheel,source=/wheels,target=/run/wheels \
    sh /run/pip-run.sh /opt/venv/bin/pip install --no-deps --no-cache-dir /run/wheels/dpserve-*.whl
# The tiny test models (seeded random weights, a few MiB; nothing is downloaded) and a
# tiny LoRA, for the CPU example and the end-to-end tests: spec.model.path /models/tiny
# (images) or /models/tiny-video (a Wan-style video model), set_lora /models/loras/tiny
# (a worker loads only from under its model mount, /models). Building them here also
# proves the image can import torch and diffusers. Written by root, readable by
# everyone, so user 10001 can load them.
RUN dpserve make-tiny-model /models/tiny \
    && dpserve make-tiny-model --variant video /models/tiny-video \
    && dpserve make-tiny-lora --model /models/tiny /models/loras/tiny \
    && chmod -R a+rX /models \
    && rm -rf /tmp/* /root/.cache /home/dpserve/.cache
USER 10001:10001
WORKDIR /home/dpserve
EXPOSE 5575
ENTRYPOINT ["dpserve"]
CMD ["worker", "--help"]
