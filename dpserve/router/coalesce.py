"""Admission for expensive read-only control ops: one fan-out shared, few waiters.

``get_weights_checksum`` hashes every tensor of the model on every replica, and a
replica's control ops run one after another in its gang, between generations. So
callers asking the same question at the same moment share one fan-out, the
fan-outs run one at a time, and past ``max_waiting`` callers the answer is 429:
a busy loop of callers costs one hash per round, not one per caller.

A caller joins a fan-out only if it asks the same op with the same arguments of
the same desired control state, and that fan-out did not start while a change was
being applied: so a caller whose own weight update has returned never gets a hash
of the weights from before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from dpserve.contract import protocol as p

T = TypeVar("T")


class Coalescer(Generic[T]):
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._turn = asyncio.Lock()  # one fan-out at a time
        self._runs: dict[Hashable, asyncio.Task[T]] = {}  # queued or running, by key
        self.callers = 0  # waiting or being answered

    async def run(self, key: Hashable | None, make: Callable[[], Awaitable[T]], what: str) -> T:
        """``make()``'s result, shared with every caller of the same ``key`` meanwhile
        (None: never shared); 429 when ``max_waiting`` callers already wait."""
        if self.callers >= self.max_waiting:
            raise p.RequestError(
                p.OVERLOADED,
                f"{self.callers} calls of {what} already wait (each reads the whole model on "
                "every replica); retry shortly",
            )
        self.callers += 1
        try:
            task = self._runs.get(key) if key is not None else None
            if task is None:
                task = asyncio.create_task(self._in_turn(make))
                task.add_done_callback(retrieve)
                if key is not None:
                    self._runs[key] = task
                    task.add_done_callback(lambda done: self._forget(key, done))
            # A caller that leaves does not cancel what the others wait for.
            return await asyncio.shield(task)
        finally:
            self.callers -= 1

    async def _in_turn(self, make: Callable[[], Awaitable[T]]) -> T:
        async with self._turn:
            return await make()

    def _forget(self, key: Hashable, done: asyncio.Task[T]) -> None:
        if self._runs.get(key) is done:
            del self._runs[key]


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a task's failure as seen: whoever awaited it may have left before it ended."""
    if not task.cancelled():
        task.exception()
