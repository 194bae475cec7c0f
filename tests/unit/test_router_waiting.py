"""wait_within: a time limit on a shared future that never loses the waiter's cancel."""

from __future__ import annotations

import asyncio

import pytest

from dpserve.router.waiting import wait_within


def test_a_cancel_in_the_turn_the_result_comes_is_not_lost() -> None:
    """asyncio.wait_for (before 3.12) returned the result here and dropped the cancel:
    a cancelled health task pinged on for ever and the pool's close waited for it."""

    async def scenario() -> None:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(wait_within(future, 10.0))
        await asyncio.sleep(0)  # the task now waits on the future
        future.set_result(1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert future.result() == 1  # the shared future is untouched

    asyncio.run(scenario())


def test_the_result_in_time_and_a_timeout_that_leaves_the_future_pending() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.01, ready.set_result, "reply")
        assert await wait_within(ready, 5.0) == "reply"
        never: asyncio.Future[str] = loop.create_future()
        with pytest.raises(TimeoutError):
            await wait_within(never, 0.01)
        assert not never.done()  # others may still await it
        with pytest.raises(TimeoutError):
            await wait_within(never, -1.0)  # a deadline already past: at once

    asyncio.run(scenario())
