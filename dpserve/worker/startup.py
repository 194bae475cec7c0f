"""A rank's start-up in the log, phase by phase, so that minutes of loading a large
model read as progress rather than silence.

Every rank goes through the same phases (imports, joining the gang, loading, the
warm-up); only the driver says so, once per replica, with each phase's time and a
summary when the replica is ready.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class StartupLog:
    def __init__(self, log: logging.Logger, speaks: bool) -> None:
        self.log = log
        self.speaks = speaks  # the driver: every other rank keeps the same phases quiet
        self.began = time.perf_counter()
        self.took: dict[str, float] = {}

    def say(self, message: str, *args: object) -> None:
        if self.speaks:
            self.log.info(message, *args)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase (the caller says what it is doing, before and after)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.took[name] = self.took.get(name, 0.0) + time.perf_counter() - started

    def summary(self) -> str:
        """``start-up 31.2s: imports 12.3s, gang 0.1s, load 1.2s, warm-up 0.4s``."""
        total = time.perf_counter() - self.began
        return f"start-up {total:.1f}s: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.took.items())


def folder_size(path: Path) -> str:
    """The bytes under ``path`` (links followed, as a hub cache's are), for the log."""
    total = 0
    for item in path.rglob("*"):
        try:
            if item.is_file():
                total += item.stat().st_size
        except OSError:  # a dangling link: the load will say what is wrong with it
            continue
    return human_bytes(total)


def human_bytes(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    size = float(n)
    for unit in ("KB", "MB", "GB"):
        size /= 1000
        if size < 1000:
            return f"{size:.1f} {unit}"
    return f"{size / 1000:.1f} TB"
