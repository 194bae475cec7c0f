"""Routing with both policies: caps, retries and leaving replicas keep working; least
work keeps a cheap request away from an expensive one, across routers too; the
autoscaling gauges and /health/replicas show the load.

Real pools, services and apps against in-process replicas speaking the real wire
protocol on real ZMQ sockets (tests/stub_replica.py). A stub's generation takes
``steps x step_s``; its pings report its cost units in flight and a calibration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from dpserve.contract import protocol as p
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.policies import POLICIES, PolicyName
from dpserve.router.pool import PoolSettings, ReplicaPool
from dpserve.router.service import RouterService
from tests.polling import pinged, until
from tests.stub_replica import StubReplica, run_in_context

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
SMALL = p.GenerateParams(prompt="s", width=64, height=64, num_inference_steps=2, seed=[1])
LARGE = p.GenerateParams(prompt="l", width=512, height=512, num_inference_steps=30, seed=[2])
STEP_S = 0.05  # the stubs' step: LARGE takes 1.5 s, SMALL 0.1 s


@asynccontextmanager
async def _stubs(ctx: zmq.asyncio.Context, n: int, **kw: Any) -> AsyncIterator[list[StubReplica]]:
    stubs = [StubReplica(ctx, replica=i, step_s=STEP_S, **kw) for i in range(n)]
    try:
        yield stubs
    finally:
        for stub in stubs:
            await stub.close()


@asynccontextmanager
async def _router(
    stubs: list[StubReplica], policy: PolicyName, **settings: Any
) -> AsyncIterator[RouterService]:
    pool = ReplicaPool(dataclasses.replace(FAST, policy=policy, **settings))
    await pool.set_endpoints(s.endpoint for s in stubs)
    await pool.start()
    try:
        await until(lambda: len(pool.serving()) == len(stubs))
        yield RouterService(pool)
    finally:
        await pool.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_the_cap_is_max_inflight_times_the_replicas_batch_size(policy: PolicyName) -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with (
            _stubs(ctx, 2, max_batch=2) as stubs,
            _router(stubs, policy, max_inflight=1) as r,
        ):
            pool = r.pool
            await until(lambda: all(x.max_batch == 2 for x in pool.members()))
            calls = [asyncio.create_task(r.generate(SMALL)) for _ in range(5)]
            await until(lambda: pool.admission.queue_depth == 1)  # 2 x 2 slots taken, one waits
            assert sorted(x.inflight for x in pool.members()) == [2, 2]
            assert {pool.snapshot(x)["max_in_flight"] for x in pool.members()} == {2}
            assert len(await asyncio.gather(*calls)) == 5
            assert pool.admission.queue_depth == 0
            assert all(len(x.ledger) == 0 for x in pool.members())

    run_in_context(scenario)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_stopped_replica_fails_over_and_a_leaving_one_drains(policy: PolicyName) -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _stubs(ctx, 2) as stubs, _router(stubs, policy) as router:
            pool = router.pool
            # Retries: a stopped driver's requests are answered by the other replica.
            stubs[0].stopped.set()
            done = await asyncio.gather(*(router.generate(SMALL) for _ in range(3)))
            assert {d.replica for d in done} == {"1"}
            stubs[0].stopped.clear()
            await until(lambda: len(pool.serving()) == 2)
            # Leaving: discovery drops replica 0 while it renders; its answer still comes.
            running = asyncio.create_task(router.generate(LARGE))
            await until(lambda: any(q == LARGE for s in stubs for q, _ in s.received))
            (busy,) = [s for s in stubs if any(q == LARGE for q, _ in s.received)]
            await pool.set_endpoints([s.endpoint for s in stubs if s is not busy])
            others = await asyncio.gather(*(router.generate(SMALL) for _ in range(3)))
            assert {d.replica for d in others} == {str(1 - busy.replica)}
            assert (await running).replica == str(busy.replica)

    run_in_context(scenario)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cheap_request_goes_where_no_expensive_one_runs_with_least_work(
    policy: PolicyName,
) -> None:
    """Round-robin sends every other cheap request behind the expensive one."""

    async def scenario(ctx: zmq.asyncio.Context) -> list[str]:
        async with _stubs(ctx, 2) as stubs, _router(stubs, policy) as router:
            large = asyncio.create_task(router.generate(LARGE))
            await until(lambda: any(s.received for s in stubs))
            (busy,) = [s for s in stubs if s.received]
            small = []
            for _ in range(4):  # one at a time: both replicas always have a free slot
                small.append((await router.generate(SMALL)).replica)
            assert (await large).replica == str(busy.replica)
            return [str(busy.replica), *small]

    busy, *small = run_in_context(scenario)
    if policy == "least_work":
        assert busy not in small
    else:
        assert small.count(busy) == 2


def test_least_work_counts_what_other_routers_placed_there() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with (
            _stubs(ctx, 2) as stubs,
            _router(stubs, "least_work") as one,
            _router(stubs, "least_work") as two,
        ):
            large = asyncio.create_task(one.generate(LARGE))
            await until(lambda: any(s.received for s in stubs))
            (busy,) = [s for s in stubs if s.received]
            seen = next(r for r in two.pool.members() if r.endpoint == busy.endpoint)
            await until(lambda: seen.others_units > 0)  # from its next ping
            assert two.pool.load.outstanding_s(seen) == pytest.approx(
                seen.others_units * busy.cost.seconds_per_unit  # type: ignore[operator]
            )
            for _ in range(3):
                assert (await two.generate(SMALL)).replica != str(busy.replica)
            mine = next(r for r in one.pool.members() if r.endpoint == busy.endpoint)
            assert mine.others_units == 0  # its own work is not counted twice
            await large

    run_in_context(scenario)


def _gauges(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("replica", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_metrics_and_health_show_each_replicas_load_and_calibration() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _stubs(ctx, 2, busy_fraction=0.25) as stubs:
            stubs[1].cost = p.CostReport(seconds_per_unit=None)  # not measured yet
            app = create_app(RouterSettings(workers=tuple(s.endpoint for s in stubs), pool=FAST))
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://localhost"
                ) as http:
                    await _until_ready(http)
                    body = {"prompt": "l", "size": "512x512", "num_inference_steps": 30}
                    post = asyncio.create_task(http.post("/v1/images/generations", json=body))
                    await until(lambda: any(s.received for s in stubs))
                    (busy,) = [s for s in stubs if s.received]
                    # A ping answered since it holds the work: its own work, which the
                    # ping counts, must not show again as other routers'.
                    await pinged([app.state.running.pool.replicas[busy.endpoint]])
                    gauges = _gauges((await http.get("/metrics")).text)
                    health = (await http.get("/health/replicas")).json()
                    assert (await post).status_code == 200
        units = LARGE.num_inference_steps * 512 * 512 / 1e6  # type: ignore[operator]
        work = gauges[("dpserve_replica_outstanding_work_seconds", busy.endpoint)]
        assert 0 < work <= units * 1.0  # seconds_per_unit 1.0 (either replica's), shrinking
        assert gauges[("dpserve_outstanding_work_seconds", "")] == pytest.approx(work, rel=0.05)
        for stub in stubs:
            assert gauges[("dpserve_replica_busy_fraction", stub.endpoint)] == 0.25
            assert gauges[("dpserve_replica_queue_depth", stub.endpoint)] == 0
        states = {r["endpoint"]: r for r in health["replicas"]}
        assert states[stubs[0].endpoint]["calibration"]["seconds_per_unit"] == 1.0
        fresh = states[stubs[1].endpoint]["calibration"]
        assert fresh["seconds_per_unit"] is None and fresh["used_seconds_per_unit"] == 1.0
        assert states[busy.endpoint]["outstanding_units"]["this_router"] == pytest.approx(
            units, 1e-4
        )

    run_in_context(scenario)


async def _until_ready(http: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 10
    while (await http.get("/ready")).status_code != 200:
        assert time.monotonic() < deadline, "no stub served"
        await asyncio.sleep(0.02)
