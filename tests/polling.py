"""Waiting for the world to change, in tests that watch other processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from dpserve.router.replica import Replica

T = TypeVar("T")


def eventually(
    check: Callable[[], T], timeout_s: float = 60, what: str = "", poll_s: float = 0.3
) -> T:
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
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what or check}: {last}")


def past(deadline: float) -> None:
    """Until the monotonic clock reaches ``deadline`` (one read from the code under test)."""
    eventually(lambda: time.monotonic() >= deadline, deadline - time.monotonic() + 5, poll_s=0.01)


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Until ``check()`` holds, yielding to the event loop between looks: for state that
    this process's own tasks change (no errors to wait out, short timeouts)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def until_async(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    """``until`` for a check that must itself wait (an HTTP call to an in-process app)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def pinged(replicas: Iterable[Replica], times: int = 2, timeout_s: float = 5.0) -> None:
    """Until each replica's router has recorded ``times`` more answered pings of it,
    each within ``timeout_s`` of the last.

    A router pings a replica in turn, the next ping sent only after the last was
    answered and judged: the second answer recorded from now is to a ping sent after
    this call, so it shows what the replica held then, judged after whatever the
    router did about the first.
    """
    for replica in replicas:
        for _ in range(times):
            seen = replica.last_seen
            # Awaited within its iteration: the closure sees this iteration's values.
            await until(lambda: replica.last_seen > seen, timeout_s)  # noqa: B023
