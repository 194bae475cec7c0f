"""OpenAI's surface, where the official client meets the service first: the served
model's name and its 404, ``/v1/models/{id}``, string error codes, the rendering
choices that are refused rather than ignored, the answer the client's
``ImagesResponse`` validates, variations, and one error shape on every route.

The real app over httpx's ASGI transport (the official ``openai`` client on it) against
in-process replicas speaking the real wire protocol (tests/stub_replica.py); the
realtime check runs under uvicorn (a real WebSocket).
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq.asyncio
from fastapi import FastAPI
from openai.types import ImagesResponse, Model
from PIL import Image
from websockets.asyncio.client import connect

from dpserve.contract import protocol as p
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.openai_api import ERROR_CODES
from dpserve.router.playground import PATHS as PLAYGROUND_PATHS
from dpserve.router.pool import PoolSettings
from dpserve.router.request_ids import HEADER
from dpserve.router.routes import flat
from tests.in_process import serving_client
from tests.polling import until
from tests.stub_replica import StubReplica
from tests.unit.test_router_edges import _serving
from tests.unit.test_router_videos import LIMITS

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
GEN, EDITS, VARIATIONS = "/v1/images/generations", "/v1/images/edits", "/v1/images/variations"
BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}


def _png(color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


@asynccontextmanager
async def _router(
    *, stub: dict[str, Any] | None = None, **settings: Any
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient, StubReplica]]:
    """One router over one stub replica, once it serves."""
    ctx = zmq.asyncio.Context()
    replica = StubReplica(ctx, **(stub or {}))
    app = create_app(RouterSettings(workers=(replica.endpoint,), pool=FAST, **settings))
    try:
        async with serving_client(app) as http:
            yield app, http, replica
    finally:
        await replica.close()
        ctx.term()


def _client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key="x",
        base_url="http://localhost/v1",
        http_client=httpx.AsyncClient(transport=http._transport, timeout=30),
        max_retries=0,
    )


def _run(scenario: Any) -> None:
    asyncio.run(scenario())


def one_shape(answer: httpx.Response) -> dict[str, Any]:
    """The one error shape: the request's id and OpenAI's error object, every field set,
    a string code from the documented list, and no Python repr in the message."""
    assert answer.status_code >= 400, answer.text
    body: dict[str, Any] = answer.json()
    assert {"id", "error"} <= set(body), body
    assert body["id"] == answer.headers["x-request-id"], body
    path = answer.request.url.path
    if not path.startswith("/v1/images/"):
        assert not body["id"].startswith("img-"), (path, body["id"])
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code", "fields"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert re.search(r"<[^>]* at 0x[0-9a-f]+>", error["message"]) is None, error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] is None or error["code"] in ERROR_CODES, error
    if error["fields"]:
        assert error["param"] == error["fields"][0]["field"], error
    else:
        assert error["param"] is None, error
    return error


# ---------------------------------------------------------------- the served model


def test_models_are_listed_and_retrieved_as_the_clients_model_type() -> None:
    async def scenario() -> None:
        async with _router() as (app, http, _), _client(http) as client:
            listed = (await http.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == ["stub"]  # the folder the replica reports
            Model.model_validate(listed[0], strict=True)
            assert listed[0]["created"] == app.state.started and listed[0]["features"]
            got = await client.models.retrieve("stub")
            assert (got.id, got.object, got.created) == ("stub", "model", app.state.started)
            assert [m.id async for m in client.models.list()] == ["stub"]
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("gpt-image-1")
            assert missing.value.code == "model_not_found" and missing.value.param == "model"
            assert "'stub'" in missing.value.message
        named = _router(served_model_name="black-forest-labs/FLUX.1-dev")
        async with named as (_, http, _), _client(http) as client:
            got = await client.models.retrieve("black-forest-labs/FLUX.1-dev")
            assert got.id == "black-forest-labs/FLUX.1-dev"
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("stub")  # the configured name wins

    _run(scenario)


def test_another_models_name_is_model_not_found_on_every_route_that_takes_one() -> None:
    async def scenario() -> None:
        named = _router(served_model_name="flux-dev")
        async with named as (_, http, stub), _client(http) as client:
            image = ("in.png", PNG, "image/png")
            calls = {
                "generate": lambda m: client.images.generate(model=m, prompt="x", size="64x64"),
                "edit": lambda m: client.images.edit(model=m, image=image, prompt="x"),
                "variation": lambda m: client.images.create_variation(model=m, image=image),
            }
            for name, call in calls.items():
                with pytest.raises(openai.NotFoundError) as refused:
                    await call("dall-e-3")
                assert refused.value.code == "model_not_found", name
                assert refused.value.param == "model", name
                assert "'flux-dev'" in refused.value.message, name
                assert (await call("flux-dev")).data, name  # the served name is fine
            assert len(stub.received) == 3  # the refused ones never reached it
            made = await client.images.generate(prompt="x", size="64x64")  # model left out
            assert made.data
            not_text = await http.post(GEN, json={**BODY, "model": 3})
            assert not_text.status_code == 400
            assert one_shape(not_text)["code"] == "invalid_value"
            # Before the model is looked at nothing else is: 404, not the bad size's 400.
            both = await http.post(GEN, json={**BODY, "model": "x", "size": "1x1"})
            assert both.status_code == 404 and one_shape(both)["code"] == "model_not_found"

    _run(scenario)


def test_a_video_job_naming_another_model_is_model_not_found() -> None:
    async def scenario() -> None:
        async with _router(stub={"video_limits": LIMITS}) as (_, http, stub):
            body = {"prompt": "a kite", "size": "64x64", "num_frames": 9}
            refused = await http.post("/v1/videos", json={**body, "model": "sora-2"})
            assert refused.status_code == 404, refused.text
            error = one_shape(refused)
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert not stub.video_submits
            made = await http.post("/v1/videos", json={**body, "model": "stub"})
            assert made.status_code == 200, made.text
            assert (await http.post("/v1/videos", json=body)).status_code == 200

    _run(scenario)


def test_a_realtime_init_naming_another_model_is_refused_and_the_socket_stays() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        settings = RouterSettings(workers=(stub.endpoint,), pool=FAST, served_model_name="rt")
        try:
            async with _serving(settings) as address:
                async with httpx.AsyncClient(base_url=f"http://{address}") as http:
                    for _ in range(500):
                        if (await http.get("/ready")).status_code == 200:
                            break
                        await asyncio.sleep(0.02)
                async with connect(f"ws://{address}/v1/realtime_video/generate") as ws:
                    init = {"type": "init", "prompt": "a harbour", "model": "other"}
                    await ws.send(msgspec.msgpack.encode(init))
                    error = msgspec.msgpack.decode(await ws.recv())
                    assert (error["type"], error["code"]) == ("error", "model_not_found")
                    assert "'rt'" in error["content"]
                    # The served name passes the check: the next complaint is the prompt.
                    await ws.send(msgspec.msgpack.encode({"type": "init", "model": "rt"}))
                    error = msgspec.msgpack.decode(await ws.recv())
                    assert error["code"] == p.INVALID_REQUEST and "prompt" in error["content"]
                    assert "model" not in error["content"]
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)


# ---------------------------------------------------------------- codes and choices


def test_error_codes_are_strings_and_the_status_stays_the_status() -> None:
    async def scenario() -> None:
        async with _router() as (_, http, _), _client(http) as client:
            cases = [
                (http.post(GEN, json={**BODY, "n": 0}), 400, "invalid_value"),
                (http.post(GEN, content=b"{}", headers={"content-type": "text/plain"}), 415,
                 "unsupported_media_type"),
                (http.post(GEN, content=b"{", headers={"content-type": "application/json"}),
                 400, "invalid_request"),
                (http.get("/v1/nothing"), 404, "not_found"),
                (http.get(GEN), 405, "method_not_allowed"),
                (http.post("/v1/images/nope/cancel"), 404, "not_found"),
            ]  # fmt: skip
            for call, status, code in cases:
                answer = await call
                assert answer.status_code == status, answer.text
                assert one_shape(answer)["code"] == code, answer.text
            with pytest.raises(openai.BadRequestError) as bad:
                await client.images.generate(prompt="x", size="3x3")  # type: ignore[arg-type]
            assert bad.value.code == "invalid_value" and bad.value.param == "size"

    _run(scenario)


def test_rendering_choices_that_cannot_be_honoured_are_refused_by_name() -> None:
    async def scenario() -> None:
        async with _router() as (_, http, stub), _client(http) as client:
            with pytest.raises(openai.BadRequestError) as transparent:
                await client.images.generate(prompt="x", size="64x64", background="transparent")
            assert transparent.value.param == "background"
            assert "opaque" in transparent.value.message
            refused = {
                "quality": "high",
                "style": "vivid",
                "moderation": "strict",
                "background": "glass",
                "user": 5,
            }
            for name, value in refused.items():
                answer = await http.post(GEN, json={**BODY, name: value})
                assert answer.status_code == 400, (name, answer.text)
                assert one_shape(answer)["param"] == name
            form = {"prompt": "x", "input_fidelity": "high"}
            upload = {"image": ("in.png", PNG, "image/png")}
            answer = await http.post(EDITS, data=form, files=upload)
            assert answer.status_code == 400 and one_shape(answer)["param"] == "input_fidelity"
            assert "strength" in answer.json()["error"]["message"]
            assert not stub.received
            honoured = {
                "background": "opaque",
                "quality": "auto",
                "moderation": "low",
                "user": "u-1",
                "safety_identifier": "s-1",
            }
            answer = await http.post(GEN, json={**BODY, **honoured})
            assert answer.status_code == 200, answer.text
            made = await client.images.generate(
                prompt="x", size="64x64", background="auto", quality="auto", moderation="auto"
            )
            assert made.data

    _run(scenario)


def test_a_non_streamed_answer_is_the_clients_images_response() -> None:
    async def scenario() -> None:
        async with _router() as (_, http, _), _client(http) as client:
            answer = await http.post(GEN, json={**BODY, "output_format": "webp"})
            body = answer.json()
            ImagesResponse.model_validate(body, strict=True)
            assert body["background"] == "opaque" and body["quality"] is None
            assert (body["output_format"], body["size"]) == ("webp", "64x64")
            assert body["usage"]["total_tokens"] == 0
            made = await client.images.generate(prompt="x", size="64x64", output_format="jpeg")
            assert (made.background, made.output_format, made.size) == ("opaque", "jpeg", "64x64")
            assert made.usage is not None and made.usage.input_tokens_details.text_tokens == 0
            edited = await client.images.edit(image=("in.png", PNG, "image/png"), prompt="x")
            assert edited.background == "opaque" and edited.usage is not None
            ImagesResponse.model_validate(edited.model_dump(), strict=True)

    _run(scenario)


# ---------------------------------------------------------------- variations


def test_a_variation_is_an_image_to_image_edit_without_a_prompt() -> None:
    async def scenario() -> None:
        async with _router() as (_, http, stub), _client(http) as client:
            made = await client.images.create_variation(
                image=io.BytesIO(PNG), n=2, size="256x256", extra_body={"seed": 3}
            )
            ((params, blobs),) = stub.received
            assert params.prompt == "" and params.edit == p.EditInput(images=[0])
            assert (blobs, params.n, params.width, params.seed) == (1, 2, 256, [3, 4])
            assert len(made.data) == 2 and made.usage is not None  # the stub echoes the upload
            image = {"image": ("in.png", PNG, "image/png")}
            strength = await http.post(VARIATIONS, data={"strength": "0.4"}, files=image)
            assert strength.status_code == 200, strength.text
            assert stub.received[-1][0].edit == p.EditInput(images=[0], strength=0.4)
            refusals = [
                ({"prompt": "a dog"}, [image], "prompt"),
                ({}, [image, {"mask": ("m.png", PNG, "image/png")}], "mask"),
                ({}, [{"image[]": ("a.png", PNG, "image/png")}] * 2, "image"),
            ]
            for data, parts, field in refusals:
                files = [item for part in parts for item in part.items()]
                answer = await http.post(VARIATIONS, data=data, files=files)
                assert answer.status_code == 400, answer.text
                error = one_shape(answer)
                assert error["param"] == field
                if field != "image":
                    assert "/v1/images/edits" in error["message"]
            assert len(stub.received) == 2
        no_edits = {"features": {"edits": False, "inpainting": False, "partial_images": 0}}
        async with _router(stub=no_edits) as (_, http, stub), _client(http) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.images.create_variation(image=io.BytesIO(PNG))
            assert refused.value.param == "image" and "no edits" in refused.value.message
            assert not stub.received

    _run(scenario)


# ---------------------------------------------------------------- one shape


# A request that fails, for every route the app has (FastAPI's docs routes only ever
# answer 405 to anything else, which a case below covers for every route).
_FAILING: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", GEN): {"json": {"prompt": 5}},
    ("POST", EDITS): {"data": {"prompt": "x"}},
    ("POST", VARIATIONS): {"files": {"image": ("a.txt", b"", "text/plain")}},
    ("POST", "/v1/images/{request_id}/cancel"): {"path": "/v1/images/no-such-id/cancel"},
    ("GET", "/v1/images/files/{name}"): {"path": "/v1/images/files/nothing.png"},
    ("POST", "/v1/videos"): {"json": {"prompt": "x"}},  # an image model
    ("GET", "/v1/videos"): {"params": {"limit": "0"}},
    ("GET", "/v1/videos/{video_id}"): {"path": "/v1/videos/video_nope"},
    ("GET", "/v1/videos/{video_id}/content"): {"path": "/v1/videos/video_nope/content"},
    ("DELETE", "/v1/videos/{video_id}"): {"path": "/v1/videos/video_nope"},
    ("GET", "/v1/models/{model_id:path}"): {"path": "/v1/models/dall-e-2"},
    ("GET", "/v1/models"): {"headers": {HEADER: "no spaces allowed"}},
    ("GET", "/model_info"): {"headers": {HEADER: "x" * 129}},
    ("GET", "/server_info"): {"headers": {HEADER: "a/b"}},
    ("POST", "/update_weights_from_disk"): {"json": {}},
    ("POST", "/release_memory_occupation"): {"content": b"[", "type": "application/json"},
    ("POST", "/resume_memory_occupation"): {"content": b"{}", "type": "text/plain"},
    ("POST", "/v1/set_lora"): {"json": {"lora_nickname": "a", "lora_path": "/nope"}},
    ("POST", "/v1/merge_lora_weights"): {"json": {}},  # nothing active
    ("POST", "/v1/unmerge_lora_weights"): {"json": {"target": "everything"}},
    ("POST", "/v1/list_loras"): {"content": b"{", "type": "application/json"},
    ("GET", "/v1/list_loras"): {"content": b"1", "type": "application/json"},
    ("POST", "/get_weights_checksum"): {"json": {"modules": 5}},
    ("GET", "/get_weights_checksum"): {"content": b"x", "type": "text/plain"},
    ("GET", "/health"): {"headers": {HEADER: "a b c"}},
    ("GET", "/livez"): {"headers": {HEADER: ""}},
    ("GET", "/ready"): {"headers": {HEADER: "two words"}},
    ("GET", "/health/replicas"): {"headers": {HEADER: "?"}},
    ("GET", "/v1/usage"): {"headers": {HEADER: "a b"}},
    ("GET", "/metrics"): {"headers": {HEADER: "#"}},
}


async def _fail(http: httpx.AsyncClient, method: str, route: str, how: dict[str, Any]) -> Any:
    headers = dict(how.get("headers", {}))
    if "type" in how:
        headers["content-type"] = how["type"]
    return await http.request(
        method,
        how.get("path", route),
        json=how.get("json"),
        data=how.get("data"),
        files=how.get("files"),
        content=how.get("content"),
        params=how.get("params"),
        headers=headers,
    )


def test_every_route_answers_its_errors_in_the_one_shape() -> None:
    async def scenario() -> None:
        async with _router(stub={"fail_paths": {"/nope"}, "step_s": 0.05}) as (app, http, _):
            routes = {
                (method, route.path)
                for route in flat(app.routes)
                if hasattr(route, "methods") and route.path not in _DOCS
                for method in route.methods - {"HEAD"}
            }
            assert routes == set(_FAILING), "a route without a failing case here"
            for (method, route), how in _FAILING.items():
                answer = await _fail(http, method, route, how)
                assert answer.status_code >= 400, (method, route, answer.text)
                one_shape(answer)
                wrong = "PUT" if method != "PUT" else "PATCH"
                one_shape(await http.request(wrong, how.get("path", route)))  # 405
            # The router's own edges: an unknown route, a body too big, a request id in use.
            one_shape(await http.get("/nowhere"))
            one_shape(await http.post(GEN, content=b"{" * (2 << 20)))
            slow = asyncio.create_task(
                http.post(GEN, json={**BODY, "num_inference_steps": 50}, headers={HEADER: "d1"})
            )
            await until(lambda: app.state.running.registry.get("d1") is not None, 5)
            assert one_shape(await http.post(GEN, json=BODY, headers={HEADER: "d1"}))["code"] == (
                p.CONFLICT
            )
            await http.post("/v1/images/d1/cancel")
            assert (await slow).status_code == 499
            one_shape(await slow)
        nobody = create_app(RouterSettings(workers=("tcp://127.0.0.1:9",), pool=FAST))
        async with nobody.router.lifespan_context(nobody):
            transport = httpx.ASGITransport(app=nobody)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                for path in ("/model_info", "/health", "/ready"):  # nothing serves: 503s
                    assert one_shape(await http.get(path))["code"] == p.UNAVAILABLE
        keyed = {"api_keys": ("k",), "admin_keys": ("a",)}
        async with _router(**keyed) as (_, http, _):
            assert one_shape(await http.post(GEN, json=BODY))["code"] == "invalid_api_key"
            inference = {"Authorization": "Bearer k"}
            denied = await http.get("/server_info", headers=inference)
            assert denied.status_code == 403 and one_shape(denied)["code"] == "permission_denied"

    _run(scenario)


# Pages and their files: static, with no error of their own to answer.
_DOCS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", *PLAYGROUND_PATHS})


def test_the_bad_request_id_answer_carries_an_id_of_the_routers() -> None:
    async def scenario() -> None:
        async with _router() as (_, http, _):
            answer = await http.post(GEN, json=BODY, headers={HEADER: "has space"})
            error = one_shape(answer)
            assert (error["code"], error["param"]) == ("invalid_value", HEADER)
            assert answer.json()["id"].startswith("img-")
            video = await http.get("/v1/videos", headers={HEADER: "has space"})
            assert one_shape(video) and video.json()["id"].startswith("req-")
            made = await http.get("/v1/videos/video_nope")
            assert made.json()["id"].startswith("req-")

    _run(scenario)
