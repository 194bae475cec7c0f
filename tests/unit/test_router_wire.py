"""The router's side of the authenticated wire, against real ZMQ sockets: it is a CURVE
client of secured replicas, caps reply frames, and never shows the key."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time

import httpx
import pytest
import zmq
import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.plumbing.curve import WireKey
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.connection import ReplicaConnection, ReplicaLost
from dpserve.router.pool import PoolSettings
from tests.stub_replica import StubReplica
from tests.workers import free_port

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}


async def _ready(http: httpx.AsyncClient, within_s: float) -> bool:
    end = asyncio.get_running_loop().time() + within_s
    while asyncio.get_running_loop().time() < end:
        if (await http.get("/ready")).status_code == 200:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("router_has_key", [True, False])
def test_a_secured_replica_serves_only_a_router_with_the_key(
    router_has_key: bool, caplog: pytest.LogCaptureFixture
) -> None:
    key = WireKey.generate()

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx, key=key)
        pool = dataclasses.replace(FAST, wire_key=key if router_has_key else None)
        app = create_app(RouterSettings(workers=(stub.endpoint,), pool=pool))
        try:
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://localhost"
                ) as http:
                    if not router_has_key:
                        assert not await _ready(http, 1.5)
                        assert stub.generated == 0
                        said = " ".join(r.getMessage() for r in caplog.records)
                        assert "WIRE IS NOT AUTHENTICATED: the router" in said
                        assert "do not share a wire key" in said
                        return
                    assert await _ready(http, 20)
                    done = await http.post("/v1/images/generations", json=BODY)
                    assert done.status_code == 200, done.text
                    assert stub.generated == 1
                    shown = (await http.get("/server_info")).text
                    for secret in (key.secret, base64.b64encode(key.secret)):
                        assert secret.decode() not in shown
                    assert (await http.get("/server_info")).json()["router"]["pool"][
                        "wire_key"
                    ] == "curve"
        finally:
            await stub.close()
            ctx.term()

    asyncio.run(scenario())


async def sent_ping(conn: ReplicaConnection, timeout_s: float = 10) -> asyncio.Task[p.Message]:
    """A PING the connection has sent, waiting for its reply: until the connection is
    up, a send fails at once (``not connected``), so it is tried again until one goes."""
    deadline = time.monotonic() + timeout_s
    while True:
        asking = asyncio.create_task(conn.request(p.PING, None, 10))
        await asyncio.sleep(0.05)  # the task's send ran: failed, or waits for the reply
        if not asking.done():
            return asking
        assert isinstance(asking.exception(), ReplicaLost)  # not connected yet
        assert time.monotonic() < deadline, f"{conn.endpoint} never connected"


def test_an_oversized_reply_fails_the_request_not_the_router() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        driver = ctx.socket(zmq.ROUTER)
        driver.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        driver.bind(endpoint)
        conn = ReplicaConnection(ctx, endpoint)
        try:
            asking = await sent_ping(conn)
            identity, *frames = await asyncio.wait_for(driver.recv_multipart(), 5)
            sent = p.decode(frames)
            huge = b"\0" * (p.MAX_REPLY_FRAME_BYTES + 4096)
            await driver.send_multipart([identity, *p.encode(p.RESULT, sent.id, {}), huge])
            with pytest.raises(ReplicaLost, match="disconnected"):
                await asyncio.wait_for(asking, 5)  # at the drop, not at the 10 s timeout
            # It reconnects, and a reply within the cap is taken.
            asking = await sent_ping(conn)
            identity, *frames = await asyncio.wait_for(driver.recv_multipart(), 5)
            await driver.send_multipart([identity, *p.encode(p.RESULT, p.decode(frames).id, {})])
            assert (await asyncio.wait_for(asking, 5)).kind == p.RESULT
        finally:
            await conn.close()
            driver.close()
            ctx.term()

    asyncio.run(scenario())
