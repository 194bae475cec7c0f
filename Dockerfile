# syntax=docker/dockerfile:1.7
#
# One Dockerfile, three images (docs/kubernetes.md):
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
# The operator and router images install only their extras (`.[operator]`, `.[router]`):
# no torch, no diffusers. Every image runs as the numeric user 10001, so Kubernetes can
# verify `runAsNonRoot`, and has `dpserve` as its entrypoint.

# Slim Python for the wheel, the operator and the router (and the CPU worker).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Base of the worker image: the same slim Python for CPU (keep the two defaults equal; a
# test checks), an nvidia/cuda runtime image for CUDA (Debian/Ubuntu based; Python 3.10+
# and venv are installed with apt when the base lacks them).
ARG BASE=python:3.11-slim-bookworm

# ------------------------------------------------------------------ wheel
# The dpserve wheel (pure Python), built once and installed by every image.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dpserve ./dpserve
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --wheel-dir /wheels .

# ------------------------------------------------------------------ operator and router
# Virtual environments built apart from the final images, which copy only /opt/venv.
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/venv \
    && /opt/venv/bin/pip install "$(ls /wheels/dpserve-*.whl)[operator]"

FROM ${PYTHON_IMAGE} AS router-build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/venv \
    && /opt/venv/bin/pip install "$(ls /wheels/dpserve-*.whl)[router]"

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

# The operator: kopf and the Kubernetes client. The chart runs it with a read-only root
# filesystem and an emptyDir at /tmp.
FROM slim-runtime AS operator
COPY --from=operator-build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["dpserve"]
CMD ["operator", "--all-namespaces"]

# The router: FastAPI, uvicorn and the Kubernetes client (EndpointSlice discovery).
FROM slim-runtime AS router
COPY --from=router-build /opt/venv /opt/venv
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

FROM worker-runtime AS worker-build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from a PyTorch wheel index: the CPU index by default (the PyPI build is a
# large CUDA build); https://download.pytorch.org/whl/cu128 (etc.) for CUDA. The worker
# extra then finds torch satisfied and keeps it.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A pip requirement, e.g. "torch==2.9.1" to pin the version.
ARG TORCH_SPEC=torch
COPY --from=wheel /wheels /wheels
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --upgrade pip \
    && /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
    && /opt/venv/bin/pip install "$(ls /wheels/dpserve-*.whl)[worker]"

# The worker: one replica (a gang of ranks) per pod, started by the operator.
FROM worker-runtime AS worker
COPY --from=worker-build /opt/venv /opt/venv
# The tiny test model (seeded random weights, a few MiB; nothing is downloaded), for the
# CPU example and the kind end-to-end test: spec.model.path /models/tiny. Building it
# here also proves the image can import torch and diffusers.
RUN dpserve make-tiny-model /models/tiny && rm -rf /tmp/* /root/.cache
USER 10001:10001
WORKDIR /home/dpserve
EXPOSE 5575
ENTRYPOINT ["dpserve"]
CMD ["worker", "--help"]
