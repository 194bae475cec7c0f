"""get_weights_checksum reads the whole model on every replica: concurrent callers share
one fan-out, and past a small bound of waiters the answer is 429, not one hash each.

Real routers (the service layer, and the app over httpx's ASGI transport) against
in-process replicas on real ZMQ sockets (tests/stub_replica.py) that count the
checksum ops they receive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.policies import FanoutAnswer
from dpserve.router.pool import PoolSettings, ReplicaPool
from dpserve.router.service import RouterService
from tests.in_process import serving_client
from tests.polling import until
from tests.stub_replica import StubReplica

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
OP = "get_weights_checksum"


async def _until_serving(pool: ReplicaPool, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(pool.serving()) < n:
        assert time.monotonic() < deadline, "replicas not serving in time"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def _setup(
    n: int, checksum_s: float
) -> AsyncIterator[tuple[RouterService, list[StubReplica]]]:
    ctx = zmq.asyncio.Context()
    stubs = [StubReplica(ctx, replica=i, checksum_s=checksum_s) for i in range(n)]
    pool = ReplicaPool(FAST)  # its own context, which it terminates
    await pool.set_endpoints(s.endpoint for s in stubs)
    await pool.start()
    try:
        await _until_serving(pool, n)
        yield RouterService(pool, heavy_read_waiters=8), stubs
    finally:
        await pool.close()
        for stub in stubs:
            await stub.close()
        ctx.term()


def _hashes(stubs: list[StubReplica]) -> list[int]:
    return [s.calls.count(OP) for s in stubs]


async def _call(router: RouterService, args: dict[str, object]) -> FanoutAnswer | p.RequestError:
    try:
        return await router.control(OP, args)
    except p.RequestError as exc:
        return exc


def test_concurrent_callers_share_one_hash_per_replica() -> None:
    async def scenario() -> None:
        async with _setup(2, checksum_s=0.3) as (router, stubs):
            answers = await asyncio.gather(*(_call(router, {}) for _ in range(8)))
            assert all(isinstance(a, FanoutAnswer) and a.status == 200 for a in answers)
            assert _hashes(stubs) == [1, 1]
            assert len({str(a.body) for a in answers if isinstance(a, FanoutAnswer)}) == 1
            # Afterwards a caller gets a fresh hash, not a remembered one.
            assert isinstance(await _call(router, {}), FanoutAnswer)
            assert _hashes(stubs) == [2, 2]
            # Other arguments are another question: its own fan-out, after the first.
            both = await asyncio.gather(_call(router, {}), _call(router, {"modules": ["vae"]}))
            assert all(isinstance(a, FanoutAnswer) for a in both)
            assert _hashes(stubs) == [4, 4]

    asyncio.run(scenario())


def test_callers_past_the_bound_get_429_and_the_rest_one_hash() -> None:
    async def scenario() -> None:
        async with _setup(1, checksum_s=0.3) as (router, stubs):
            answers = await asyncio.gather(*(_call(router, {}) for _ in range(20)))
            refused = [a for a in answers if isinstance(a, p.RequestError)]
            assert len(refused) == 12 and {e.status for e in refused} == {429}
            assert "already wait" in str(refused[0])
            assert _hashes(stubs) == [1]
            assert router.heavy_reads.callers == 0

    asyncio.run(scenario())


def test_a_caller_that_leaves_does_not_cancel_the_others_hash() -> None:
    async def scenario() -> None:
        async with _setup(1, checksum_s=0.3) as (router, stubs):
            leaver = asyncio.create_task(_call(router, {}))
            stayer = asyncio.create_task(_call(router, {}))
            # Both wait on the one hash, which the replica is computing.
            await until(lambda: router.heavy_reads.callers == 2 and _hashes(stubs) == [1])
            leaver.cancel()
            answer = await stayer
            assert isinstance(answer, FanoutAnswer) and answer.status == 200
            assert _hashes(stubs) == [1] and router.heavy_reads.callers == 0

    asyncio.run(scenario())


def test_http_callers_past_the_bound_get_429_with_retry_after() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx, checksum_s=0.5)
        app = create_app(RouterSettings(workers=(stub.endpoint,), pool=FAST))
        async with serving_client(app) as http:
            answers = await asyncio.gather(*(http.get(f"/{OP}") for _ in range(12)))
        await stub.close()
        ctx.term()
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [200] * 8 + [429] * 4
        limited = next(a for a in answers if a.status_code == 429)
        assert limited.headers["Retry-After"] and "retry" in limited.json()["error"]["message"]
        assert stub.calls.count(OP) == 1

    asyncio.run(scenario())
