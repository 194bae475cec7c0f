"""Waiting for the world to change, in tests that watch other processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout_s: float = 60, what: str = "") -> T:
    """The first truthy result of ``check``, polling through transient errors."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # an API or HTTP call that is not ready yet
            last = exc
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what or check}: {last}")


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Until ``check()`` holds, yielding to the event loop between looks: for state that
    this process's own tasks change (no errors to wait out, short timeouts)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
