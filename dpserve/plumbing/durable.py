"""Making a published file or folder survive a power loss."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries after a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
