"""The image API's newer surface: request ids, cancel by id, streamed previews, edits,
formats and discovery.

The real app over httpx's ASGI transport (and the official ``openai`` client on it),
its lifespan run by hand, against an in-process replica speaking the real wire
protocol on a real ZMQ socket (tests/stub_replica.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import openai
import pytest
import zmq.asyncio
from fastapi import FastAPI

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.router import schemas
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.forms import IMAGE_FIELDS, MASK_FIELD
from dpserve.router.pool import PoolSettings
from tests.stub_replica import StubReplica

T = TypeVar("T")
FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}
GEN, EDITS = "/v1/images/generations", "/v1/images/edits"
PNG = b"\x89PNG\r\n\x1a\n" + b"upload" * 10
GIF, BMP, TIFF = b"GIF89a" + bytes(40), b"BM" + bytes(60), b"II*\x00" + bytes(60)
ONLY_FORMATS = "is not a PNG, JPEG or WebP image"


def _run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


@asynccontextmanager
async def _apps(
    stub: StubReplica, count: int = 1, pool: PoolSettings = FAST, **settings: Any
) -> AsyncIterator[list[tuple[FastAPI, httpx.AsyncClient]]]:
    """``count`` routers (a Deployment's replicas) over the same stub, once it serves."""
    apps = [
        create_app(RouterSettings(workers=(stub.endpoint,), pool=pool, **settings))
        for _ in range(count)
    ]
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for app in apps:
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            http = httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30)
            clients.append(await stack.enter_async_context(http))
            deadline = time.monotonic() + 10
            while (await http.get("/ready")).status_code != 200:
                assert time.monotonic() < deadline, "the stub replica never served"
                await asyncio.sleep(0.02)
        yield list(zip(apps, clients, strict=True))


@asynccontextmanager
async def _router(**stub_args: Any) -> AsyncIterator[tuple[httpx.AsyncClient, StubReplica]]:
    ctx = zmq.asyncio.Context()
    stub = StubReplica(ctx, **stub_args)
    try:
        async with _apps(stub) as [(_, http)]:
            yield http, stub
    finally:
        await stub.close()
        ctx.term()


def _openai(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key="x",
        base_url="http://localhost/v1",
        http_client=httpx.AsyncClient(transport=http._transport, timeout=30),
        max_retries=0,
    )


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- request ids and formats


def test_request_ids_are_honoured_generated_checked_and_reach_the_replica() -> None:
    async def scenario() -> None:
        async with _router() as (http, _):
            given = await http.post(GEN, json=BODY, headers={"X-Request-Id": "client.1:a-b_c"})
            assert given.status_code == 200, given.text
            assert given.headers["x-request-id"] == "client.1:a-b_c"
            body = given.json()
            assert body["id"] == "client.1:a-b_c"
            assert body["output_format"] == "png" and body["size"] == "64x64"
            assert body["encode_time_s"] == pytest.approx(0.001)
            made = await http.post(GEN, json=BODY)
            assert made.json()["id"] == made.headers["x-request-id"]
            assert made.json()["id"] != "client.1:a-b_c"
            for bad in ("has space", "x" * 129, "a/b"):
                refused = await http.post(GEN, json=BODY, headers={"X-Request-Id": bad})
                assert refused.status_code == 400
                assert "X-Request-Id" in refused.json()["error"]["message"]
                assert "A-Z a-z 0-9 . _ : -" in refused.json()["error"]["message"]
            # errors carry the id too, body and header
            wrong = await http.post(
                GEN, json={"prompt": "x", "n": 0}, headers={"X-Request-Id": "e1"}
            )
            assert wrong.status_code == 400 and wrong.json()["id"] == "e1"
            assert wrong.headers["x-request-id"] == "e1"
            assert (await http.get("/livez")).headers["x-request-id"]

    _run(scenario)


def test_a_request_id_in_flight_is_a_409() -> None:
    async def scenario() -> None:
        async with _router(step_s=0.2) as (http, stub):
            headers = {"X-Request-Id": "dup-1"}
            first = asyncio.create_task(http.post(GEN, json=BODY, headers=headers))
            await _until(lambda: len(stub.received) == 1, "the first never reached the replica")
            second = await http.post(GEN, json=BODY, headers=headers)
            assert second.status_code == 409
            assert "already in flight" in second.json()["error"]["message"]
            assert (await first).status_code == 200

    _run(scenario)


def test_output_compression_reaches_the_replica_and_png_refuses_it() -> None:
    async def scenario() -> None:
        async with _router() as (http, stub):
            body = {**BODY, "output_format": "webp", "output_compression": 40}
            done = await http.post(GEN, json=body)
            assert done.status_code == 200 and done.json()["output_format"] == "webp"
            assert stub.received[-1][0].output_compression == 40
            bad = await http.post(GEN, json={**BODY, "output_compression": 40})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "output_compression"
            assert "jpeg and webp only" in bad.json()["error"]["message"]

    _run(scenario)


# ---------------------------------------------------------------- cancellation


def test_cancel_at_the_replica_frees_its_slot_and_the_caller_gets_499() -> None:
    async def scenario() -> None:
        async with _router(step_s=0.5) as (http, stub):
            rid = {"X-Request-Id": "c-replica"}
            waiting = asyncio.create_task(
                http.post(GEN, json={**BODY, "num_inference_steps": 20}, headers=rid)
            )
            await _until(lambda: bool(stub.received), "the replica never got it")
            cancelled = await http.post("/v1/images/c-replica/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json() == {
                "id": "c-replica",
                "object": "image.cancel",
                "status": "cancelled",
                "stage": "at_replica",
            }
            answer = await waiting
            assert answer.status_code == 499 and answer.json()["id"] == "c-replica"
            assert "cancelled" in answer.json()["error"]["message"]
            await _until(lambda: stub.cancelled == ["c-replica"], "the replica kept rendering")
            again = await http.post("/v1/images/c-replica/cancel")
            assert again.status_code == 409 and "already cancelled" in again.text

    _run(scenario)


def test_cancel_queued_in_the_router_leaves_the_queue() -> None:
    async def scenario() -> None:
        settings = PoolSettings(**{**FAST.__dict__, "max_inflight": 1})
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx, step_s=0.3)
        try:
            async with _apps(stub, pool=settings) as [(app, http)]:
                slow = {**BODY, "num_inference_steps": 4}
                busy = asyncio.create_task(http.post(GEN, json=slow, headers={"X-Request-Id": "b"}))
                await _until(lambda: bool(stub.received), "the first never started")
                queued = asyncio.create_task(
                    http.post(GEN, json=BODY, headers={"X-Request-Id": "q"})
                )
                admission = app.state.running.pool.admission
                await _until(lambda: admission.queue_depth == 1, "the second never queued")
                cancelled = await http.post("/v1/images/q/cancel")
                assert cancelled.json()["stage"] == "queued_in_router"
                assert (await queued).status_code == 499
                assert (await busy).status_code == 200
                assert len(stub.received) == 1  # the cancelled one never reached it
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)


def test_cancel_unknown_finished_and_through_another_router() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx, step_s=0.3)
        try:
            async with _apps(stub, count=2) as [(_, one), (_, two)]:
                unknown = await one.post("/v1/images/nobody/cancel")
                assert unknown.status_code == 404
                assert "no request 'nobody'" in unknown.json()["error"]["message"]
                bad = await one.post("/v1/images/bad%20id/cancel")
                assert bad.status_code == 400 and "not a request id" in bad.text
                done = await one.post(GEN, json=BODY, headers={"X-Request-Id": "fin"})
                assert done.status_code == 200
                late = await one.post("/v1/images/fin/cancel")
                assert late.status_code == 409 and "already completed" in late.text
                # admitted by router one, cancelled through router two
                body = {**BODY, "num_inference_steps": 20}
                waiting = asyncio.create_task(
                    one.post(GEN, json=body, headers={"X-Request-Id": "x-router"})
                )
                await _until(lambda: len(stub.received) == 2, "never reached the replica")
                other = await two.post("/v1/images/x-router/cancel")
                assert other.status_code == 200, other.text
                assert other.json()["stage"] == "running_at_replica"
                assert (await waiting).status_code == 499
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)


# ---------------------------------------------------------------- streaming


def test_a_stream_sends_previews_then_one_completed_event_per_image() -> None:
    async def scenario() -> None:
        async with _router() as (http, _):
            body = {**BODY, "n": 2, "stream": True, "partial_images": 2, "num_inference_steps": 3}
            answer = await http.post(GEN, json=body, headers={"X-Request-Id": "s1"})
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            assert answer.headers["x-request-id"] == "s1"
            events = _events(answer.text)
            kinds = [name for name, _ in events]
            assert kinds == [
                *["image_generation.partial_image"] * 4,
                *["image_generation.completed"] * 2,
            ]
            partial = events[0][1]
            assert partial["type"] == "image_generation.partial_image"
            assert {partial["partial_image_index"], events[2][1]["partial_image_index"]} == {0, 1}
            assert (partial["size"], partial["output_format"], partial["id"]) == (
                "64x64",
                "png",
                "s1",
            )
            assert partial["steps"] == 3 and base64.b64decode(partial["b64_json"])
            completed = events[-1][1]
            assert completed["usage"]["total_tokens"] == 0 and completed["seed"] == 2
            assert {e["image_index"] for _, e in events[-2:]} == {0, 1}
            plain = await http.post(GEN, json={**BODY, "stream": True})
            assert [n for n, _ in _events(plain.text)] == ["image_generation.completed"]
            url = await http.post(GEN, json={**BODY, "stream": True, "response_format": "url"})
            assert url.status_code == 400 and "cannot be streamed" in url.text

    _run(scenario)


def test_an_error_mid_stream_is_an_error_event() -> None:
    async def scenario() -> None:
        async with _router(step_s=0.3) as (http, stub):
            body = {**BODY, "stream": True, "partial_images": 1, "num_inference_steps": 10}
            headers = {"X-Request-Id": "s-err"}
            streaming = asyncio.create_task(http.post(GEN, json=body, headers=headers))
            # At the replica: the stream's 200 and headers went out before it was sent.
            await _until(lambda: len(stub.received) == 1, "the stream never reached the replica")
            assert (await http.post("/v1/images/s-err/cancel")).status_code == 200
            events = _events((await streaming).text)
            name, error = events[-1]
            assert name == "error" and error["id"] == "s-err"
            assert error["error"]["code"] == "cancelled"

    _run(scenario)


def test_the_openai_client_streams_generations_and_edits_unchanged() -> None:
    async def scenario() -> None:
        async with _router() as (http, stub), _openai(http) as client:
            stream = await client.images.generate(
                model="stub", prompt="x", size="64x64", stream=True, partial_images=2
            )
            got = [event async for event in stream]
            assert [type(e).__name__ for e in got] == [
                "ImageGenPartialImageEvent",
                "ImageGenPartialImageEvent",
                "ImageGenCompletedEvent",
            ]
            assert got[-1].size == "64x64" and got[-1].b64_json
            edits = await client.images.edit(
                model="stub",
                image=[("a.png", PNG, "image/png"), ("b.png", PNG + b"2", "image/png")],
                mask=("m.png", PNG + b"m", "image/png"),
                prompt="y",
                n=2,
                size="64x64",
                stream=True,
                partial_images=1,
            )
            got = [event async for event in edits]
            assert [e.type for e in got] == [
                "image_edit.partial_image",
                "image_edit.partial_image",
                "image_edit.completed",
                "image_edit.completed",
            ]
            assert base64.b64decode(got[-1].b64_json) == PNG  # the stub echoes the first
            params, blobs = stub.received[-1]
            assert blobs == 3 and params.edit == p.EditInput(images=[0, 1], mask=2)

    _run(scenario)


# ---------------------------------------------------------------- edits


def test_the_openai_client_edits_one_image_with_sglang_fields() -> None:
    async def scenario() -> None:
        async with _router() as (http, stub), _openai(http) as client:
            answer = await client.images.edit(
                image=("a.png", io.BytesIO(PNG), "image/png"),
                prompt="y",
                size="32x32",
                output_format="jpeg",
                output_compression=70,
                extra_body={"strength": "0.5", "seed": "7", "num_inference_steps": "2"},
            )
            assert base64.b64decode(answer.data[0].b64_json or "") == PNG
            params, blobs = stub.received[-1]
            assert blobs == 1 and params.edit == p.EditInput(images=[0], strength=0.5)
            assert (params.seed, params.num_inference_steps) == ([7], 2)
            assert (params.output_format, params.output_compression) == ("jpeg", 70)

    _run(scenario)


def _form(**fields: str) -> dict[str, str]:
    return {"prompt": "y", **fields}


def test_edit_refusals_say_what_to_fix() -> None:
    async def scenario() -> None:
        async with _router() as (http, stub):
            image = {"image": ("a.png", PNG, "image/png")}
            cases: list[tuple[dict[str, Any], dict[str, Any], int, str]] = [
                (_form(n="two"), image, 400, "n must be an integer"),
                (_form(strength="2"), image, 400, "strength must be in (0, 1]"),
                (_form(guidance_scale="x"), image, 400, "guidance_scale must be a number"),
                (_form(stream="maybe"), image, 400, "stream must be true or false"),
                (_form(colour="red"), image, 400, "colour is not a known field"),
                (_form(), {"mask": ("m.png", PNG, "image/png")}, 400, "image is required"),
                (_form(), {"image": ("a.png", b"", "image/png")}, 400, "is empty"),
                # Formats Pillow reads but uploads may not be: the accepted ones are named.
                (_form(), {"image": ("a.gif", GIF, "image/gif")}, 400, ONLY_FORMATS),
                (_form(), {"image": ("a.bmp", BMP, "image/bmp")}, 400, ONLY_FORMATS),
                (_form(), {"image": ("a.png", PNG), "mask": ("m.tif", TIFF)}, 400, ONLY_FORMATS),
                (_form(), {"photo": ("a.png", PNG, "image/png")}, 400, "photo is not a known"),
                (
                    _form(),
                    {"image": ("big.png", b"x" * (pv.MAX_EDIT_IMAGE_BYTES + 1), "image/png")},
                    400,
                    "'big.png' is",
                ),
            ]
            for data, files, status, message in cases:
                answer = await http.post(EDITS, data=data, files=files)
                assert answer.status_code == status, (data, answer.text)
                assert message in answer.json()["error"]["message"], answer.text
            many = [
                ("image[]", (f"{i}.png", PNG, "image/png")) for i in range(pv.MAX_EDIT_IMAGES + 1)
            ]
            answer = await http.post(EDITS, data=_form(), files=many)
            assert answer.status_code == 400 and "at most 16 images" in answer.text
            as_json = await http.post(EDITS, json={"prompt": "y"})
            assert as_json.status_code == 415 and "multipart/form-data" in as_json.text
            assert not stub.received  # every refusal came before the replica

    _run(scenario)


def test_edits_are_refused_when_the_model_has_none_and_uploads_are_bounded() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        stub.features = {**stub.features, "edits": False, "inpainting": False}
        try:
            async with _apps(stub, max_upload_bytes=4096) as [(_, http)]:
                image = {"image": ("a.png", PNG, "image/png")}
                refused = await http.post(EDITS, data=_form(), files=image)
                assert refused.status_code == 400 and "serves no edits" in refused.text
                big = {"image": ("a.png", b"x" * 5000, "image/png")}
                assert (await http.post(EDITS, data=_form(), files=big)).status_code == 413
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)


def test_an_upload_is_spooled_not_held_whole() -> None:
    """A 48 MiB edit form, streamed in 64 KiB chunks: its files go to spooled temporary
    files as they arrive, and one refused by its first bytes is never read back. The
    router held the whole body (and a copy while joining it) before: 96 MiB here."""
    boundary = "dpserve-test-boundary"
    chunk = bytes(64 << 10)
    part_chunks = (pv.MAX_EDIT_IMAGE_BYTES - 1024) // len(chunk)
    parts = 6

    async def body() -> AsyncIterator[bytes]:
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx'.encode()
        for i in range(parts):
            head = (
                f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="image[]"; '
                f'filename="{i}.gif"\r\nContent-Type: image/gif\r\n\r\n'
            )
            yield head.encode() + GIF
            for _ in range(part_chunks):
                yield chunk  # the same object each time: the client allocates nothing
        yield f"\r\n--{boundary}--\r\n".encode()

    async def scenario() -> tuple[httpx.Response, int]:
        async with _router() as (http, stub):
            headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
            tracemalloc.start()
            try:
                answer = await http.post(EDITS, content=body(), headers=headers)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert not stub.received
            return answer, peak

    answer, peak = _run(scenario)
    assert answer.status_code == 400, answer.text
    assert len(answer.json()["error"]["fields"]) == parts  # each file named
    sent = parts * part_chunks * len(chunk)
    assert sent > 40 << 20
    assert peak < 8 << 20, f"{peak >> 20} MiB held for a {sent >> 20} MiB upload"


def test_the_edit_form_schema_declares_its_uploads_and_the_answers() -> None:
    # Which fields each route's schema declares: tests/unit/test_router_field_tables.py.
    schema = create_app(RouterSettings()).openapi()
    form = schema["paths"][EDITS]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert {*IMAGE_FIELDS, MASK_FIELD} <= set(form["schema"]["properties"])
    assert form["schema"]["properties"]["image[]"]["anyOf"][0]["items"]["format"] == "binary"
    paths = schema["paths"]
    assert "/v1/images/{request_id}/cancel" in paths
    cancel = paths["/v1/images/{request_id}/cancel"]["post"]["responses"]["200"]
    assert "CancelResponse" in json.dumps(cancel)
    assert "ImagesResponse" in json.dumps(paths[GEN]["post"]["responses"]["200"])
    assert set(schemas.ImagesResponse.model_fields) >= {"id", "output_format", "encode_time_s"}


# ---------------------------------------------------------------- discovery


def test_discovery_routes_show_the_features() -> None:
    async def scenario() -> None:
        async with _router() as (http, stub):
            model = (await http.get("/v1/models")).json()["data"][0]
            assert model["features"] == stub.features
            router = model["router_features"]
            assert router["streaming"] and router["cancellation"]
            assert router["max_upload_bytes"] == 64 << 20
            info = (await http.get("/model_info")).json()
            assert info["features"]["edits"] is True and info["router_features"] == router
            server = (await http.get("/server_info")).json()
            assert server["features"]["max_n"] == 10 and server["router_features"] == router
            assert server["router"]["max_upload_bytes"] == 64 << 20

    _run(scenario)


def test_the_upload_limit_is_a_flag() -> None:
    from dpserve.cli import _router_settings, build_parser

    args = build_parser().parse_args(["router", "--worker", "tcp://x:1", "--max-upload-bytes", "9"])
    assert _router_settings(args, args.worker).max_upload_bytes == 9
    assert RouterSettings().max_upload_bytes == 64 << 20
