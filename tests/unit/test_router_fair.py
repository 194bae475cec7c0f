"""Fair shares between tenants (docs/tenants.md): a flooder's backlog does not delay
another tenant, fills only its own share of the queue, and meets its own cap.

Real pools, services and apps against an in-process replica speaking the real wire
protocol on a real ZMQ socket (tests/stub_replica.py); one slot (one replica, batch 1,
one in flight), so the order requests reach the replica is the order they were let go.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from dpserve import cli
from dpserve.contract import protocol as p
from dpserve.plumbing.ports import free_port
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.pool import PoolSettings, ReplicaPool
from dpserve.router.service import Generated, RouterService
from dpserve.router.tenants import TenantKey
from tests.in_process import serving_client
from tests.polling import until
from tests.stub_replica import StubReplica, run_in_context

ONE_SLOT = PoolSettings(
    ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5, max_inflight=1
)
STEP_S = 0.02  # two steps a request: 40 ms each


def _params(tenant: str, i: int) -> p.GenerateParams:
    return p.GenerateParams(
        prompt=f"{tenant} {i}", width=64, height=64, num_inference_steps=2, seed=[i]
    )


@asynccontextmanager
async def _service(
    ctx: zmq.asyncio.Context, **settings: Any
) -> AsyncIterator[tuple[RouterService, StubReplica]]:
    stub = StubReplica(ctx, step_s=STEP_S)
    pool = ReplicaPool(dataclasses.replace(ONE_SLOT, **settings))
    try:
        await pool.set_endpoints([stub.endpoint])
        await pool.start()
        await until(lambda: len(pool.serving()) == 1)
        yield RouterService(pool), stub
    finally:
        await pool.close()
        await stub.close()


def _send(service: RouterService, tenant: str, n: int) -> list[asyncio.Task[Generated]]:
    return [
        asyncio.create_task(service.generate(_params(tenant, i), tenant=tenant)) for i in range(n)
    ]


def _refusals(done: list[Generated | BaseException]) -> list[str]:
    out = []
    for d in done:
        if isinstance(d, BaseException):
            assert isinstance(d, p.RequestError) and d.code == p.OVERLOADED, d
            out.append(str(d))
    return out


def _order(stub: StubReplica) -> list[str]:
    """Whose requests reached the replica, in order."""
    return [q.prompt.split()[0] for q, _ in stub.received]


def test_a_light_tenant_is_served_ahead_of_a_flooders_backlog() -> None:
    """FIFO served it after all twelve of the flooder's requests; fair order after at
    most the one running and the one level with it."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _service(ctx) as (service, stub):
            admission = service.pool.admission
            blocker = await admission.acquire(set(), 5, _params("blocker", 0), "blocker")
            heavy = _send(service, "heavy", 12)
            await until(lambda: admission.queue_depth == 12)
            light = _send(service, "light", 1)
            await until(lambda: admission.queue_depth == 13)
            admission.release(blocker)
            await asyncio.gather(*light, *heavy)
            assert _order(stub).index("light") <= 1, _order(stub)
            assert admission.held("heavy") == admission.held("light") == 0

    run_in_context(scenario)


def test_weights_give_a_tenant_more_of_the_contended_replica() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _service(ctx, tenant_weights={"gold": 3}) as (service, stub):
            admission = service.pool.admission
            blocker = await admission.acquire(set(), 5, _params("blocker", 0), "blocker")
            rest = [*_send(service, "plain", 12), *_send(service, "gold", 12)]  # FIFO: plain
            await until(lambda: admission.queue_depth == 24)
            admission.release(blocker)
            await asyncio.gather(*rest)
            served = _order(stub)[:12]  # the first twelve let go from the queue
            assert served.count("gold") >= 8, served  # 9 of 12 at 3:1

    run_in_context(scenario)


def test_a_flooder_fills_its_own_share_of_the_queue_and_gets_its_own_429s() -> None:
    """Before, the light tenant's requests were the ones refused: the queue was full."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _service(ctx, max_queue=4) as (service, stub):
            admission = service.pool.admission
            blocker = await admission.acquire(set(), 5, _params("blocker", 0), "blocker")
            heavy = _send(service, "heavy", 8)  # four wait, four are refused
            await until(lambda: admission.queue_depth == 4)
            light = _send(service, "light", 2)  # each takes a heavy waiter's place
            await until(lambda: admission.held("light") == 2)
            assert admission.queue_depth == 4
            admission.release(blocker)
            assert len(await asyncio.gather(*light)) == 2
            refused = _refusals(await asyncio.gather(*heavy, return_exceptions=True))
            assert len(refused) == 6
            assert sum("gave way to another tenant's" in r for r in refused) == 2
            assert sum("--max-waiting 4" in r for r in refused) == 6
            assert _order(stub).count("light") == 2

    run_in_context(scenario)


def test_a_tenant_past_its_cap_gets_429_and_another_goes_on() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _service(ctx, max_per_tenant=3) as (service, _):
            admission = service.pool.admission
            heavy = _send(service, "heavy", 5)
            await until(lambda: admission.held("heavy") == 3)
            light = _send(service, "light", 2)
            done = await asyncio.gather(*heavy, return_exceptions=True)
            refused = _refusals(done)
            assert len(refused) == 2
            assert "tenant 'heavy' has 3 requests in flight or waiting" in refused[0]
            assert "--max-requests-per-tenant 3" in refused[0]
            assert len(await asyncio.gather(*light)) == 2
            assert admission.held("heavy") == admission.held("light") == 0

    run_in_context(scenario)


def test_a_waiter_that_leaves_takes_its_count_and_a_slot_handed_to_it_goes_back() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _service(ctx, max_per_tenant=2) as (service, _):
            admission, (replica,) = service.pool.admission, service.pool.members()
            running = await admission.acquire(set(), 5, _params("a", 0), "a")
            waiting = asyncio.create_task(admission.acquire(set(), 5, _params("b", 1), "b"))
            await until(lambda: admission.queue_depth == 1)
            admission.release(running)  # hands the slot to b's waiter...
            waiting.cancel()  # ...which is cancelled in the same turn
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert (replica.inflight, admission.held("a"), admission.held("b")) == (0, 0, 0)
            # A waiter that times out leaves its count too.
            running = await admission.acquire(set(), 5, _params("a", 2), "a")
            with pytest.raises(p.RequestError, match="within 0s"):
                await admission.acquire(set(), 0.05, _params("a", 3), "a")
            assert admission.held("a") == 1
            admission.release(running)
            assert admission.held("a") == 0 and admission.queue_depth == 0

    run_in_context(scenario)


HEAVY_KEY, LIGHT_KEY = "heavy-key-0123456789abcdef", "light-key-0123456789abcdef"
BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 4, "seed": 1}


def test_the_cap_is_per_tenant_of_the_requests_key() -> None:
    """Through the app: the tenant is the key's (a key file's name), not the caller's
    address: one tenant's keys share its cap, another's has its own."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stub = StubReplica(ctx, step_s=0.1)
        keys = (
            TenantKey(HEAVY_KEY, "heavy"),
            TenantKey(HEAVY_KEY + "-2", "heavy"),
            TenantKey(LIGHT_KEY, "light"),
        )
        pool = dataclasses.replace(ONE_SLOT, max_per_tenant=1)
        app = create_app(RouterSettings(workers=(stub.endpoint,), pool=pool, api_keys=keys))
        try:
            async with serving_client(app) as http:
                admission = app.state.running.pool.admission

                def post(key: str) -> Any:
                    headers = {"Authorization": f"Bearer {key}"}
                    return asyncio.create_task(
                        http.post("/v1/images/generations", json=BODY, headers=headers)
                    )

                first = post(HEAVY_KEY)
                await until(lambda: admission.held("heavy") == 1)
                over = await post(HEAVY_KEY + "-2")
                light = post(LIGHT_KEY)
                assert over.status_code == 429, over.text
                assert over.headers["Retry-After"] == "1"
                message = over.json()["error"]["message"]
                assert "--max-requests-per-tenant 1" in message and "'heavy'" in message
                assert (await first).status_code == (await light).status_code == 200
        finally:
            await stub.close()

    run_in_context(scenario)


def test_weights_for_tenants_no_key_names_stop_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"team-a {HEAVY_KEY}\nteam-b {LIGHT_KEY}\n")
    command = ["router", "--worker", "tcp://127.0.0.1:1", "--port", str(free_port())]
    command += ["--api-key-file", str(keys), "--tenant-weight", "team-c=2"]
    with pytest.raises(SystemExit) as stopped:
        cli.main(command)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--tenant-weight names team-c, which no key names; the tenants are team-a, team-b" in err
    with pytest.raises(ValueError, match="no API keys are configured"):
        create_app(RouterSettings(pool=PoolSettings(tenant_weights={"team-a": 2})))
