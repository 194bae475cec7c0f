"""The dpserve images for tests: built by ``images/build.sh`` and described.

    reason = images_unavailable()      # None where they can be built here
    built = build_images()             # {"operator": BuiltImage(...), "router": ..., "worker": ...}

The real node receives them through a local registry (tests/cluster/registry.py).

A build with nothing changed is cached by BuildKit and takes about a second, so every
caller may call ``build_images()``; the first one on a fresh machine takes minutes
(Docker's install, the Debian base, torch). Give its test a timeout to match.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "images" / "build.sh"
# Debian's client: the `docker` first on PATH may want a buildx plugin (images/engine.sh).
DOCKER = "/usr/bin/docker"
TARGETS = ("operator", "router", "worker")
# The worker image (about 6 GB with PyPI's CUDA torch), its layers while exported, and
# BuildKit's working copies: below this much free space a first build would fail late.
MIN_FREE_BYTES = 20 * 2**30


@dataclass(frozen=True)
class BuiltImage:
    ref: str  # e.g. "dpserve-worker:0.1.0"
    image_id: str  # the image's config digest, "sha256:..."
    size_bytes: int


def images_unavailable() -> str | None:
    """Why the images cannot be built on this machine, or None when they can."""
    if sys.platform != "linux":
        return "the images build with Debian's docker.io and debootstrap (Linux only)"
    if os.geteuid() != 0:
        return "building the images needs root (dockerd, debootstrap, apt-get)"
    if not Path(DOCKER).exists() and shutil.which("apt-get") is None:
        return f"no {DOCKER} and no apt-get to install Debian's docker.io"
    free = shutil.disk_usage("/var/lib").free
    if free < MIN_FREE_BYTES and not _all_present():
        return f"{free / 2**30:.0f} GiB free under /var/lib; a first build needs about 20"
    return None


def build_images() -> dict[str, BuiltImage]:
    """Run ``images/build.sh`` (its progress on this process's stderr) and return the
    three images it tagged, keyed by target."""
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], check=False, stdout=subprocess.PIPE, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"images/build.sh failed (exit {done.returncode}); see its stderr")
    built: dict[str, BuiltImage] = {}
    # Its last lines: "<ref> <image id> <size in bytes>", one an image.
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) != 3 or not parts[1].startswith("sha256:"):
            continue
        ref, image_id, size = parts
        target = ref.split(":", 1)[0].removeprefix("dpserve-")
        if target in TARGETS:
            built[target] = BuiltImage(ref, image_id, int(size))
    missing = set(TARGETS) - set(built)
    if missing:
        raise RuntimeError(f"images/build.sh did not report {sorted(missing)}: {done.stdout!r}")
    return built


def _all_present() -> bool:
    """Whether images of all three targets exist already (a rebuild needs little disk)."""
    if not Path(DOCKER).exists():
        return False
    listed = subprocess.run(
        [DOCKER, "image", "ls", "--format", "{{.Repository}}"],
        check=False,
        capture_output=True,
        text=True,
    )
    names = set(listed.stdout.split()) if listed.returncode == 0 else set()
    return {f"dpserve-{t}" for t in TARGETS} <= names
