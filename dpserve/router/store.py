"""Where images go when a client asks for URLs instead of inline base64."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Final

_NAME: Final = re.compile(r"^[0-9a-f]{32}\.(png|jpeg|webp)$")


@dataclass(frozen=True)
class OutputStore:
    """A folder served back by the router under ``/v1/images/files/<name>``."""

    root: Path
    base_url: str  # e.g. http://router:8000, as clients reach the router

    def save(self, data: bytes, fmt: str) -> str:
        name = f"{uuid.uuid4().hex}.{fmt}"
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / name).write_bytes(data)
        return f"{self.base_url.rstrip('/')}/v1/images/files/{name}"

    def path(self, name: str) -> Path | None:
        """The file for a name this store made; anything else (``..``, odd names) is None."""
        if not _NAME.match(name):
            return None
        path = self.root / name
        return path if path.is_file() else None
