"""Write an OCI image archive from a root file system directory, without Docker.

The archive is an OCI image layout in a tar stream (``oci-layout``, ``index.json``
and the blobs: one uncompressed layer, the image config, the manifest), which
``ctr images import`` loads. The layer is reproducible: entries sorted, owned by
root, mtime 0, so the same directory always gives the same digests (and a
re-import of an unchanged image is a no-op for containerd).

The index entry carries the full image name in containerd's own annotation, so
the image is stored under exactly that name (``ctr`` would otherwise prefix the
OCI ``ref.name`` with an import date).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
IMAGE_NAME = "io.containerd.image.name"
REF_NAME = "org.opencontainers.image.ref.name"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of an image config (what a Dockerfile's CMD, ENV... set)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = (DEFAULT_PATH,)
    user: str = ""
    workdir: str = ""
    labels: dict[str, str] = field(default_factory=dict)


def normalize_ref(ref: str) -> str:
    """A reference as containerd stores it: ``busybox`` -> ``docker.io/library/busybox:latest``."""
    name, sep, digest = ref.partition("@")
    first, slash, rest = name.partition("/")
    if not (slash and ("." in first or ":" in first or first == "localhost")):
        first, rest = "docker.io", name  # no registry named: Docker Hub's
    if first == "docker.io" and "/" not in rest:
        rest = f"library/{rest}"  # Docker Hub's official images live under library/
    name = f"{first}/{rest}"
    if not sep and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return f"{name}{sep}{digest}"


def host_arch() -> str:
    """This machine's architecture as OCI names it (``amd64``, ``arm64``)."""
    return _ARCH.get(platform.machine(), platform.machine())


def _descriptor(media_type: str, data_digest: str, size: int) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": data_digest, "size": size}


def _json_blob(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def write_layer(rootfs: Path, out: IO[bytes]) -> None:
    """A tar of everything under ``rootfs`` (not ``rootfs`` itself), reproducibly."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for top, dirs, files in os.walk(rootfs):
            dirs.sort()  # os.walk descends in this order
            for name in sorted([*dirs, *files]):
                path = Path(top) / name
                # recursive=False: directories are walked here, in sorted order.
                tar.add(path, arcname=str(path.relative_to(rootfs)), recursive=False, filter=_reset)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = _reset(tarfile.TarInfo(name))
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_oci_archive(
    out: IO[bytes], rootfs: Path, ref: str, config: ImageConfig | None = None
) -> str:
    """Write the image of ``rootfs`` named ``ref`` to ``out``; returns its config digest
    (the image ID containerd and the kubelet report)."""
    config = config or ImageConfig()
    with tempfile.TemporaryFile() as layer:
        write_layer(rootfs, layer)
        size = layer.tell()
        layer.seek(0)
        h = hashlib.sha256()
        for chunk in iter(lambda: layer.read(1 << 20), b""):
            h.update(chunk)
        layer_digest = "sha256:" + h.hexdigest()
        arch = host_arch()
        image_config = _json_blob(
            {
                "architecture": arch,
                "os": "linux",
                "created": "1970-01-01T00:00:00Z",
                "config": {
                    "Entrypoint": list(config.entrypoint) or None,
                    "Cmd": list(config.cmd) or None,
                    "Env": list(config.env),
                    "User": config.user,
                    "WorkingDir": config.workdir,
                    "Labels": config.labels or None,
                },
                "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
                "history": [
                    {"created": "1970-01-01T00:00:00Z", "created_by": "tests/cluster/oci.py"}
                ],
            }
        )
        config_digest = _digest(image_config)
        manifest = _json_blob(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST,
                "config": _descriptor(CONFIG, config_digest, len(image_config)),
                "layers": [_descriptor(LAYER_TAR, layer_digest, size)],
            }
        )
        full = normalize_ref(ref)
        entry = _descriptor(MANIFEST, _digest(manifest), len(manifest))
        entry["platform"] = {"architecture": arch, "os": "linux"}
        entry["annotations"] = {IMAGE_NAME: full, REF_NAME: full.rsplit(":", 1)[-1]}
        index = _json_blob({"schemaVersion": 2, "manifests": [entry]})

        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            _add(tar, "oci-layout", _json_blob({"imageLayoutVersion": "1.0.0"}))
            _add(tar, "index.json", index)
            info = _reset(tarfile.TarInfo(f"blobs/sha256/{layer_digest.split(':')[1]}"))
            info.size, info.mode = size, 0o644
            layer.seek(0)
            tar.addfile(info, layer)
            for blob in (image_config, manifest):
                _add(tar, f"blobs/sha256/{_digest(blob).split(':')[1]}", blob)
    return config_digest
