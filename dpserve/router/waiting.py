"""Waiting for a future with a time limit, without losing the waiter's cancellation."""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


async def wait_within(future: asyncio.Future[T], timeout_s: float) -> T:
    """``future``'s result, or ``TimeoutError`` after ``timeout_s``; the future itself
    is never cancelled (others may await it).

    Not ``asyncio.wait_for``: before Python 3.12 it returns the result and drops the
    caller's cancellation when both happen in the same loop turn (CPython gh-86296).
    A router's health task cancelled while its ping's reply arrived went on pinging
    for ever, and the pool's shutdown waited for it.
    """
    done, _ = await asyncio.wait({future}, timeout=max(0.0, timeout_s))
    if not done:
        raise TimeoutError
    return future.result()
