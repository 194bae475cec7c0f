"""Where images go when a client asks for URLs instead of inline base64.

The folder is bounded: each save removes the files older than ``max_age_s`` and,
past ``max_files``, the oldest ones, so a router that hands out URLs for days does
not fill its disk. A URL is good for ``max_age_s`` (OpenAI's are for an hour); a
file past that is not served even before it is removed. The folder is the only
state: routers that share it (one volume) prune each other's old files alike.

A file's name holds the tenant it was made for (``<uuid>.<tenant>.<format>``), so
its owner is known to every router that shares the folder, after any restart; a
name without one (saved before tenants) is nobody's. docs/tenants.md says who may
open which.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

_NAME: Final = re.compile(
    r"^[0-9a-f]{32}(\.[a-z0-9](?:[a-z0-9._-]{0,61}[a-z0-9])?)?\.(png|jpeg|webp)$"
)


def owner(name: str) -> str | None:
    """The tenant a stored file's name records ("": none); None for a name this store
    never makes."""
    found = _NAME.match(name)
    if found is None:
        return None
    return (found.group(1) or ".")[1:]


def expired(
    files: Iterable[tuple[str, float]], now: float, max_files: int, max_age_s: float
) -> list[str]:
    """Which of ``(name, mtime)`` go: the too old, then the oldest past ``max_files``."""
    by_age = sorted(files, key=lambda f: (f[1], f[0]))
    young = [name for name, mtime in by_age if now - mtime <= max_age_s]
    old = [name for name, mtime in by_age if now - mtime > max_age_s]
    return old + young[: max(0, len(young) - max_files)]


@dataclass(frozen=True)
class OutputStore:
    """A folder served back by the router under ``/v1/images/files/<name>``."""

    root: Path
    base_url: str  # e.g. http://router:8000, as clients reach the router
    max_files: int  # the router's --output-max-files and --output-max-age
    max_age_s: float

    def save(self, data: bytes, fmt: str, tenant: str = "") -> str:
        """Store an image of ``tenant``'s; its URL."""
        name = f"{uuid.uuid4().hex}.{tenant}.{fmt}" if tenant else f"{uuid.uuid4().hex}.{fmt}"
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / name).write_bytes(data)
        self.prune()
        return f"{self.base_url.rstrip('/')}/v1/images/files/{name}"

    def prune(self) -> list[str]:
        """Remove what is past the bounds; returns the names removed."""
        gone = expired(self._files(), time.time(), self.max_files, self.max_age_s)
        for name in gone:
            with contextlib.suppress(FileNotFoundError):  # another router took it first
                (self.root / name).unlink()
        return gone

    def path(self, name: str) -> Path | None:
        """The file for a name this store made, while it is young enough; anything
        else (``..``, odd names, expired) is None."""
        if not _NAME.match(name):
            return None
        path = self.root / name
        try:
            fresh = time.time() - path.stat().st_mtime <= self.max_age_s
        except FileNotFoundError:
            return None
        return path if fresh and path.is_file() else None

    def _files(self) -> list[tuple[str, float]]:
        found = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if _NAME.match(entry.name):  # only what this store made
                    with contextlib.suppress(FileNotFoundError):
                        found.append((entry.name, entry.stat().st_mtime))
        return found
