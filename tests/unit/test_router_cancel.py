"""The router's side of deadlines against a bare ZMQ ROUTER standing in for a driver: a
request carries the time it has left, and one the router gives up on is cancelled."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.router.connection import ReplicaConnection
from tests.unit.test_router_wire import sent_ping
from tests.workers import free_port


async def _received(driver: zmq.asyncio.Socket) -> tuple[bytes, p.Message]:
    identity, *frames = await asyncio.wait_for(driver.recv_multipart(), 5)
    return identity, p.decode(frames)


async def _exchange() -> None:
    ctx = zmq.asyncio.Context()
    driver = ctx.socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    driver.bind(endpoint)
    conn = ReplicaConnection(ctx, endpoint)
    try:
        # Connected: the socket only queues on a live connection.
        pinging = await sent_ping(conn)
        identity, ping = await _received(driver)
        await driver.send_multipart([identity, *p.encode(p.RESULT, ping.id, {})])
        await asyncio.wait_for(pinging, 5)
        # Given up on at its timeout: the request had 1.5 s, and is then cancelled.
        with pytest.raises(TimeoutError):
            await conn.request(p.GENERATE, {"prompt": "x"}, 0.2, request_id="r1", deadline_s=1.5)
        _, sent = await _received(driver)
        assert (sent.id, sent.kind, sent.timeout_ms) == ("r1", p.GENERATE, 1500)
        _, cancel = await _received(driver)
        assert cancel.kind == p.CANCEL and cancel.id != "r1"
        assert cancel.body_as(p.CancelRequest).request_id == "r1"

        # Answered in time: nothing to cancel; no deadline given, none sent.
        waiting = asyncio.create_task(conn.request(p.GENERATE, {"prompt": "y"}, 5))
        identity, sent = await _received(driver)
        assert sent.timeout_ms is None
        await driver.send_multipart([identity, *p.encode(p.RESULT, sent.id, {})])
        assert (await waiting).kind == p.RESULT

        # A caller that stops waiting (its HTTP client left) cancels it too.
        waiting = asyncio.create_task(conn.request(p.GENERATE, {"prompt": "z"}, 5))
        _, sent = await _received(driver)
        waiting.cancel()
        _, cancel = await _received(driver)
        assert cancel.body_as(p.CancelRequest).request_id == sent.id

        # Control ops are never cancelled: they change state.
        with pytest.raises(TimeoutError):
            await conn.request(p.CONTROL, p.ControlRequest(op="list_loras"), 0.2)
        await _received(driver)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(driver.recv_multipart(), 0.3)
    finally:
        await conn.close()
        driver.close(linger=0)
        ctx.term()


def test_deadline_sent_and_given_up_requests_cancelled() -> None:
    asyncio.run(_exchange())
