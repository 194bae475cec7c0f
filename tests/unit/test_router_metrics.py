"""The router's accounting: every request it accepts is answered once, by outcome, on /metrics.

The real app over httpx's ASGI transport (its lifespan run by hand), against the
benchmarks' stub driver (a real ZMQ driver that answers at once) or against no
driver at all (requests then wait for a replica until the client leaves).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest

from dpserve.router.app import RouterSettings, create_app
from dpserve.router.metrics import (
    Accounting,
    MetricsMiddleware,
    RouterMetrics,
    outcome,
    read_accounting,
)
from tests.polling import until_async
from tests.workers import free_port

STUB = Path(__file__).resolve().parents[2] / "bench" / "stub_driver.py"
BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(port)])
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@asynccontextmanager
async def _router(
    endpoint: str, ready: bool = True, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A running app and an HTTP client on it; with ``ready``, once a replica serves."""
    app = create_app(RouterSettings(workers=(endpoint,), **settings))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            for _ in range(600 if ready else 0):  # 30 s: a loaded machine starts slowly
                if (await http.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            else:
                assert not ready, "the stub driver never served"
            yield http, app


async def _accounting(http: httpx.AsyncClient) -> Accounting:
    return read_accounting((await http.get("/metrics")).text)


async def _queued(http: httpx.AsyncClient) -> bool:
    """One request waits for a replica slot, as the router's gauge says."""
    from prometheus_client.parser import text_string_to_metric_families

    scrape = (await http.get("/metrics")).text
    families = text_string_to_metric_families(scrape)
    return [s.value for f in families if f.name == "dpserve_queue_depth" for s in f.samples] == [1]


def _series(text: str, name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == f"{name}_total" and labels.items() <= s.labels.items()
    )


def test_outcome_classes() -> None:
    assert [outcome(s, False) for s in (200, 204, 307, 400, 404, 429, 499, 500, 503)] == [
        "ok", "ok", "ok", "client_error", "client_error", "client_error", "client_error",
        "server_error", "server_error",
    ]  # fmt: skip
    assert outcome(200, True) == outcome(499, True) == "disconnected"


def test_every_accepted_request_is_answered_once_by_outcome(stub: str) -> None:
    async def scenario() -> tuple[Accounting, str]:
        async with _router(stub, max_body_bytes=1024) as (http, _):
            before = await _accounting(http)  # the readiness polls
            statuses = [
                (await http.post("/v1/images/generations", json=BODY)).status_code,
                (await http.post("/v1/images/generations", json=BODY)).status_code,
                (
                    await http.post("/v1/images/generations", content=b"{nope", headers=JSON)
                ).status_code,
                (await http.post("/v1/images/generations", content=b"x" * 4096)).status_code,
                (await http.get("/v1/images/generations")).status_code,
                (await http.get("/no/such/route")).status_code,
                (await http.get("/v1/models")).status_code,
            ]
            assert statuses == [200, 200, 400, 413, 405, 404, 200]
            after = await _accounting(http)
            text = (await http.get("/metrics")).text
        ready_polls = before.answered["ok"] + before.answered.get("server_error", 0)
        assert before.accepted == ready_polls and before.unanswered == 0
        return (
            Accounting(
                after.accepted - before.accepted,
                {k: v - before.answered.get(k, 0) for k, v in after.answered.items()},
            ),
            text,
        )

    delta, text = asyncio.run(scenario())
    assert delta.accepted == 7 and delta.unanswered == 0
    assert {k: v for k, v in delta.answered.items() if v} == {"ok": 3, "client_error": 4}
    # Entry and exit agree on the route, so the books balance route by route too.
    route = "/v1/images/generations"
    accepted = _series(text, "dpserve_requests_accepted", route=route)
    answered = _series(text, "dpserve_requests_answered", route=route)
    assert accepted == answered == _series(text, "dpserve_requests", route=route) == 5
    assert _series(text, "dpserve_requests_answered", route=route, method="GET") == 1
    assert _series(text, "dpserve_requests_answered", route="unmatched", outcome="client_error")
    # The scrape in flight while it renders is left out of the books, and only it.
    assert _series(text, "dpserve_requests_accepted", route="/metrics") == 3
    assert _series(text, "dpserve_requests_answered", route="/metrics") == 2


def test_no_replica_is_a_server_error() -> None:
    async def scenario() -> Accounting:
        async with _router(f"tcp://127.0.0.1:{free_port()}", ready=False) as (http, _):
            assert (await http.get("/model_info")).status_code == 503
            return await _accounting(http)

    books = asyncio.run(scenario())
    assert books.accepted == 1 and books.answered == {"server_error": 1}


def test_a_request_the_app_raises_on_is_a_server_error() -> None:
    metrics = RouterMetrics()

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async def call() -> None:
        scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
        await MetricsMiddleware(broken, metrics)(scope, None, None)

    with pytest.raises(RuntimeError):
        asyncio.run(call())
    books = read_accounting(generate_latest(metrics.registry).decode())
    assert books.accepted == 1 and books.answered == {"server_error": 1}


def _http_scope(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("router", 80),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip


def test_a_client_that_leaves_before_its_answer_is_counted_disconnected() -> None:
    """No replica serves, so the request waits in the queue until its client goes away."""

    async def scenario() -> tuple[Accounting, Accounting, list[Any]]:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        async with _router(endpoint, ready=False) as (http, app):
            body, gone, sent = json.dumps(BODY).encode(), asyncio.Event(), []
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            request = asyncio.create_task(
                app(_http_scope("/v1/images/generations", body), receive, send)
            )
            await until_async(lambda: _queued(http))  # waiting for a replica slot
            waiting = await _accounting(http)
            gone.set()
            await asyncio.wait_for(request, 10)
            return waiting, await _accounting(http), sent

    waiting, books, sent = asyncio.run(scenario())
    assert waiting.unanswered == 1  # accepted on entry: a lost request would stay here
    assert books.accepted == 1 and books.answered == {"disconnected": 1}
    assert sent[0]["status"] == 499  # what the app answered to nobody


def test_websockets_are_counted_apart(stub: str) -> None:
    async def session(app: FastAPI, path: str) -> None:
        inbox = [{"type": "websocket.disconnect", "code": 1000}, {"type": "websocket.connect"}]

        async def receive() -> dict[str, Any]:
            return inbox.pop()

        async def send(message: dict[str, Any]) -> None:
            pass

        scope = {**_http_scope(path, b""), "type": "websocket", "scheme": "ws", "subprotocols": []}
        await app(scope, receive, send)

    async def scenario() -> Accounting:
        async with _router(stub) as (http, app):
            await session(app, "/v1/realtime_video/generate")  # accepted, then the client left
            await session(app, "/no/such/socket")  # closed before it was accepted
            return await _accounting(http)

    books = asyncio.run(scenario())
    assert books.websockets_opened == 2 and books.websockets_open == 0
    assert books.websockets_closed == {"closed": 1, "refused": 1}
    assert books.unanswered == 0  # WebSockets stay out of the HTTP books
