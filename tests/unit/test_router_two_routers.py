"""Two routers over the same replicas: an op that meets the other router's newer state
is applied on top of it (once), never refused for a client's nothing, never undoing it.

Real routers (the app over httpx's ASGI transport, and the service layer) against
in-process replicas speaking the real wire protocol (tests/stub_replica.py, which
refuses documents with the worker's own rule). The routers ping rarely here, so a
router learns of the other's op only by asking before its own (the first look) or
by meeting it on the way (another op landing between that look and its own: the
adopt-and-retry path). Real drivers: tests/e2e/test_two_routers.py; the ConfigMap
store: tests/integration/test_router_kubernetes_api.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import zmq.asyncio

from dpserve.contract.control_state import ControlState, StateDoc
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.desired import DesiredState, MemoryStore
from dpserve.router.pool import PoolSettings, ReplicaPool
from dpserve.router.service import RouterService
from tests.polling import until
from tests.stub_replica import StubReplica, run_in_context


def _settings() -> PoolSettings:
    return PoolSettings(ping_interval_s=0.05, ping_timeout_s=2, control_timeout_s=5)


async def _deafen(pool: ReplicaPool) -> None:
    """Serving, then pinging no more within the test: a router knows another's op only
    by asking for it or meeting it."""

    async def pinged() -> None:
        since = time.monotonic()
        await until(lambda: all(r.serving and r.last_seen > since for r in pool.members()))

    await pinged()  # by the health loops, not only the start
    pool.settings.ping_interval_s = 60
    await pinged()  # the pings under way land; then each loop sleeps the new interval


STYLE = {"lora_nickname": "style", "lora_path": "/loras/style"}
OTHER = {"lora_nickname": "other", "lora_path": "/loras/other"}


@asynccontextmanager
async def _http(stubs: list[StubReplica]) -> AsyncIterator[httpx.AsyncClient]:
    settings = RouterSettings(workers=tuple(s.endpoint for s in stubs), pool=_settings())
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            await _deafen(app.state.running.pool)
            yield http


@asynccontextmanager
async def _service(stubs: list[StubReplica], store: MemoryStore) -> AsyncIterator[RouterService]:
    pool = ReplicaPool(_settings(), desired=DesiredState(store))
    await pool.set_endpoints(s.endpoint for s in stubs)
    await pool.start()
    try:
        await _deafen(pool)
        yield RouterService(pool)
    finally:
        await pool.close()


def test_back_to_back_ops_through_alternating_routers_compose() -> None:
    ops: list[tuple[str, dict[str, Any]]] = [
        ("/v1/set_lora", STYLE),
        ("/v1/set_lora", OTHER),
        ("/v1/set_lora", {"lora_nickname": ["style", "other"], "strength": [1.0, 0.5]}),
        ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {}),
        ("/v1/merge_lora_weights", {"strength": 0.8}),
    ]

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = [StubReplica(ctx, replica=i) for i in range(2)]
        async with _http(stubs) as a, _http(stubs) as b:
            for i, (route, body) in enumerate(ops):
                done = await (a, b)[i % 2].post(route, json=body)
                assert done.status_code == 200, (route, done.text)
                state = done.json()["control_state"]
                # Checked against the other router's op of a moment ago (an adapter
                # it loaded is known here) and built on it: nothing in the way.
                assert state["replicas_holding"] == 2 and state["rebased_on"] is None
            want = ControlState(
                loras={"style": "/loras/style", "other": "/loras/other"},
                active={"style": 1.0, "other": 0.5},
                merged=0.8,
            )
            assert [s.held.state for s in stubs] == [want, want]
            assert stubs[0].held == stubs[1].held
            for http in (a, b):
                listed = (await http.get("/v1/list_loras")).json()
                assert listed["consistent"] is True
                assert listed["result"]["loaded"] == ["other", "style"]
        for stub in stubs:
            await stub.close()

    run_in_context(scenario)


def test_an_op_still_in_the_way_after_one_retry_is_a_409() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = [StubReplica(ctx, replica=i) for i in range(2)]
        async with _service(stubs, MemoryStore()) as router:
            # Another router's op lands on replica 0 just before ours: applied on top.
            stubs[0].foreign_ops = 1
            done = await router.control("set_lora", STYLE)
            assert done.status == 200, done.body
            assert done.body["control_state"]["rebased_on"] == 1
            for stub in stubs:
                assert stub.held.state.loras == {"foreign-1": "/loras/x", "style": "/loras/style"}
                assert stub.held.state.active == {"style": 1.0}
            # Again, and again after the retry: that is the client's to retry.
            stubs[0].foreign_ops = 2
            refused = await router.control("set_lora", OTHER)
            assert refused.status == 409, refused.body
            assert "another router changed the state at the same time" in refused.body["message"]
            assert {r["replica"]: r["ok"] for r in refused.body["replicas"]} == {
                "0": False,
                "1": True,
            }
            # Nothing is left split: every replica comes to one state, and serves.
            pool = router.pool
            await pool.health.recheck(pool.members())
            await until(lambda: stubs[0].held == stubs[1].held == pool.desired.doc, 10)
            await until(lambda: len(pool.serving()) == 2)
        for stub in stubs:
            await stub.close()

    run_in_context(scenario)


class _Racing(MemoryStore):
    """A store shared by routers, where another router's op is stored between this
    router's read and its write, ``times`` times."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def advance(self, doc: StateDoc) -> StateDoc:
        if self.times and self.doc is not None and doc.op == "set_lora":
            self.times -= 1
            theirs = {**self.doc.state.loras, f"theirs-{self.times}": "/loras/t"}
            self.doc = self.doc.successor(
                "set_lora", msgspec.structs.replace(self.doc.state, loras=theirs)
            )
        return super().advance(doc)


def test_an_op_the_store_refuses_is_built_again_on_the_stored_state() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = [StubReplica(ctx, replica=i) for i in range(2)]
        store = _Racing(times=0)
        async with _service(stubs, store) as router:
            await router.control("resume_memory_occupation", {})  # the store holds a state
            store.times = 1
            done = await router.control("set_lora", STYLE)
            assert done.status == 200, done.body
            assert done.body["control_state"]["rebased_on"] == store.doc.version - 1
            loras = {"theirs-0": "/loras/t", "style": "/loras/style"}
            assert [s.held.state.loras for s in stubs] == [loras, loras]
            assert stubs[0].held == store.doc == router.pool.desired.doc
            # Refused twice: a 409 that says so, and nothing changed on the replicas.
            held = stubs[0].held
            store.times = 2
            try:
                await router.control("set_lora", OTHER)
            except Exception as exc:
                assert getattr(exc, "status", None) == 409
                assert "changed the control state twice" in str(exc)
            else:
                raise AssertionError("an op refused twice by the store was answered")
            assert [s.held for s in stubs] == [held, held]
        for stub in stubs:
            await stub.close()

    run_in_context(scenario)
