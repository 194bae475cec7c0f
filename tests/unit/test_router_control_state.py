"""Control ops as a desired state: any router applies them, none skips them, none undoes another's.

Real routers (the pool and service layer, and the app over httpx's ASGI transport)
against in-process replicas speaking the real wire protocol on real ZMQ sockets
(tests/stub_replica.py). Real workers applying states are in test_control_ops and
the serve journey.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.contract.control_state import ControlState
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.desired import DesiredState, MemoryStore
from dpserve.router.pool import PoolSettings, ReplicaPool
from dpserve.router.service import RouterService
from tests.polling import pinged, until, until_async
from tests.stub_replica import StubReplica, run_in_context

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
LORA = {"lora_nickname": "style", "lora_path": "/loras/style"}


@asynccontextmanager
async def _router(
    stubs: list[StubReplica], store: MemoryStore | None = None, settings: PoolSettings = FAST
) -> AsyncIterator[RouterService]:
    pool = ReplicaPool(settings, desired=DesiredState(store))
    await pool.set_endpoints(s.endpoint for s in stubs)
    await pool.start()
    try:
        await until(lambda: len(pool.serving()) == len(stubs))
        yield RouterService(pool)
    finally:
        await pool.close()


async def _stubs(ctx: zmq.asyncio.Context, n: int, **kw: Any) -> list[StubReplica]:
    return [StubReplica(ctx, replica=i, **kw) for i in range(n)]


async def _close(stubs: list[StubReplica]) -> None:
    for stub in stubs:
        await stub.close()


def test_a_restarted_router_applies_ops_and_never_skips_them() -> None:
    """The bug this replaces: a new router's log restarted at 1 and replicas skipped it."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2)
        async with _router(stubs) as first:
            done = await first.control("set_lora", LORA)
            assert done.status == 200, done.body
        assert all(s.held.state.loras == {"style": "/loras/style"} for s in stubs)
        # A new router with an empty store adopts what the replicas hold...
        async with _router(stubs) as second:
            assert second.pool.desired.doc == stubs[0].held
            other = {"lora_nickname": "other", "lora_path": "/loras/other"}
            done = await second.control("set_lora", other)
            assert done.status == 200, done.body
            assert done.body["control_state"]["replicas_holding"] == 2
        # ...and its op took effect everywhere, on top of the first router's.
        for stub in stubs:
            assert stub.held.state.loras == {"style": "/loras/style", "other": "/loras/other"}
            assert stub.held.state.active == {"other": 1.0}
        await _close(stubs)

    run_in_context(scenario)


def test_two_routers_follow_each_others_ops() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2)
        async with _router(stubs) as a, _router(stubs) as b:
            assert (await b.control("set_lora", LORA)).status == 200
            # a sees newer documents in the replicas' pings and adopts them, rather than
            # "repairing" the replicas back to what it last knew.
            await until(lambda: a.pool.desired.doc == b.pool.desired.doc)
            await pinged(a.pool.members())  # judged by a against what it adopted
            assert len(a.pool.serving()) == 2
            assert all(s.held == b.pool.desired.doc for s in stubs)
            assert (await a.control("release_memory_occupation", {})).status == 200
            await until(lambda: b.pool.desired.doc == a.pool.desired.doc)
            assert all(s.held.state.released for s in stubs)
        await _close(stubs)

    run_in_context(scenario)


def test_a_replica_that_cannot_reach_the_state_leaves_rotation_named() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2)
        store = MemoryStore()
        async with _router(stubs, store) as router:
            stubs[1].fail_paths.add("/loras/style")
            done = await router.control("set_lora", LORA)
            # Decision: the state stays (one replica holds it); the answer is the error.
            assert done.status == 400
            assert done.body["control_state"]["applied"] is True
            assert done.body["control_state"]["out_of_rotation_until_synced"] == ["1"]
            pool = router.pool
            assert [r.name for r in pool.serving()] == ["0"]
            states = {s["replica"]: s for s in (pool.snapshot(r) for r in pool.members())}
            assert states["1"]["state"] == "out_of_sync"
            assert "does not exist" in states["1"]["last_error"]
            # Published for the operator's status: only replicas that failed, with why.
            await until(lambda: list(store.out_of_sync) == [stubs[1].endpoint])
            assert "does not exist" in store.out_of_sync[stubs[1].endpoint]
            # Fixed on the replica's side: the sync task's retry brings it back.
            stubs[1].fail_paths.clear()
            await until(lambda: len(pool.serving()) == 2, timeout_s=10)
            assert stubs[1].held == pool.desired.doc
            await until(lambda: store.out_of_sync == {})
        await _close(stubs)

    run_in_context(scenario)


def test_an_op_no_replica_can_take_changes_nothing() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2, fail_paths={"/loras/style"})
        async with _router(stubs) as router:
            before = router.pool.desired.doc
            assert before is not None
            done = await router.control("set_lora", LORA)
            assert done.status == 400 and done.body["control_state"]["applied"] is False
            after = router.pool.desired.doc
            assert after is not None and after.state == before.state
            assert after.version == before.version + 2  # the op's version, then its undo
            await pinged(router.pool.members())  # judged again against the undo's version
            assert len(router.pool.serving()) == 2
        await _close(stubs)

    run_in_context(scenario)


def test_invalid_ops_are_refused_by_the_router_before_any_replica_sees_them() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 1)
        async with _router(stubs) as router:
            calls = list(stubs[0].calls)
            for op, args, field in (
                ("merge_lora_weights", {}, "lora_nickname"),
                ("set_lora", {"lora_nickname": "x"}, "lora_path"),
                ("update_weights_from_disk", {}, "model_path"),
                ("set_lora", {**LORA, "target": "vae"}, "target"),
            ):
                try:
                    await router.control(op, args)
                except p.RequestError as exc:
                    assert exc.status == 400 and exc.fields[0].field == field
                else:
                    raise AssertionError(f"{op} {args} was accepted")
            assert stubs[0].calls == calls
        await _close(stubs)

    run_in_context(scenario)


@pytest.mark.e2e  # 4,000 ops over real sockets: seconds
def test_catch_up_is_one_call_whatever_the_history() -> None:
    """2,000 release/resume pairs, then a restarted replica is brought back in one call,
    in about the time a fresh one takes; the stored state stays one small document."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2)
        store = MemoryStore()
        async with _router(stubs, store) as router:
            assert (await router.control("set_lora", LORA)).status == 200
            for _ in range(2_000):
                await router.control("release_memory_occupation", {})
                await router.control("resume_memory_occupation", {})
            assert store.doc is not None and store.doc.version == 4_001
            assert len(p.encode(p.RESULT, "x", store.doc.to_builtins())[0]) < 1024
            stubs[1].reboot()
            calls = len(stubs[1].calls)
            started = time.perf_counter()
            await until(lambda: stubs[1].held == router.pool.desired.doc)
            await until(lambda: len(router.pool.serving()) == 2)
            caught_up = time.perf_counter() - started
            assert stubs[1].calls[calls:].count(p.SYNC_STATE) == 1
            assert caught_up < 2.0
        await _close(stubs)

    run_in_context(scenario)


def test_a_stopped_driver_fails_its_requests_over_within_the_ping_deadline() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2, generate_s=0.3)
        settings = PoolSettings(ping_interval_s=0.2, ping_timeout_s=0.5, request_timeout_s=120)
        async with _router(stubs, settings=settings) as router:
            params = p.GenerateParams(prompt="x", seed=[1])
            stubs[0].stopped.set()  # SIGSTOP: reads nothing, answers nothing
            started = time.perf_counter()
            done = await asyncio.gather(*(router.generate(params) for _ in range(4)))
            took = time.perf_counter() - started
            assert {d.replica for d in done} == {"1"}
            assert took < 5.0  # ping deadline (2 missed pings), not the 120 s timeout
            stubs[0].stopped.clear()  # SIGCONT: back after a good ping
            await until(lambda: len(router.pool.serving()) == 2)
        await _close(stubs)

    run_in_context(scenario)


def test_one_late_ping_keeps_a_replica_in_rotation() -> None:
    """A single timeout is as likely the router's own lag; two in a row take it out."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 1)
        settings = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.3)
        async with _router(stubs, settings=settings) as router:
            replica = router.pool.members()[0]
            seen_down = False
            stubs[0].late_pings, stubs[0].late_ping_s = 1, 0.5
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                seen_down |= not replica.serving
                await asyncio.sleep(0.01)
            assert not seen_down and replica.missed_pings == 0
            assert "timed out" in str(replica.last_error)
            stubs[0].late_pings = 2
            await until(lambda: not replica.serving)
            await until(lambda: replica.serving)
        await _close(stubs)

    run_in_context(scenario)


def test_one_replica_stopped_does_not_delay_another_replicas_health() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2)
        settings = PoolSettings(ping_interval_s=0.05, ping_timeout_s=3.0)
        async with _router(stubs, settings=settings) as router:
            stubs[0].stopped.set()
            by_name = {r.name: r for r in router.pool.members()}
            stopped, live = by_name["0"], by_name["1"]
            await pinged([live], times=1)  # any answer the stopped one sent is read by now
            seen = stopped.last_seen
            # Each next answer from the live one comes in less than the stopped one's 3 s
            # ping timeout: health checks that waited on that ping would take 3 s a turn.
            await pinged([live], times=3, timeout_s=2.0)
            assert stopped.last_seen == seen
            stubs[0].stopped.clear()
        await _close(stubs)

    run_in_context(scenario)


def test_http_answers_say_what_the_state_is() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = await _stubs(ctx, 2)
        app = create_app(RouterSettings(workers=tuple(s.endpoint for s in stubs), pool=FAST))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                await until_async(lambda: _ready(http))
                done = await http.post("/v1/set_lora", json=LORA)
                assert done.status_code == 200, done.text
                info = (await http.get("/server_info")).json()["control_state"]
                assert info["version"] == done.json()["control_state"]["version"]
                assert info["state"]["loras"] == {"style": "/loras/style"}
                digest = ControlState(
                    loras={"style": "/loras/style"}, active={"style": 1.0}
                ).digest()
                assert info["digest"] == digest
                replicas = (await http.get("/health/replicas")).json()["replicas"]
                assert {r["control_state"]["digest"] for r in replicas} == {digest}
                bad = await http.post("/v1/merge_lora_weights", json={"strength": "x"})
                assert bad.status_code == 400 and "strength" in bad.text
        await _close(stubs)

    run_in_context(scenario)


async def _ready(http: httpx.AsyncClient) -> bool:
    return (await http.get("/ready")).json()["serving"] == 2
