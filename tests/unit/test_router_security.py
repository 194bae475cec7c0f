"""The router's front door: API keys, JSON-only bodies, hostile JSON, body deadlines.

The real app over httpx's ASGI transport (and the real ``openai`` client on it),
its lifespan run by hand, against an in-process replica speaking the real wire
protocol on a real ZMQ socket (tests/stub_replica.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import openai
import pytest
import zmq.asyncio
from starlette.testclient import TestClient, WebSocketDenialResponse

from dpserve.cli import _router_settings, build_parser
from dpserve.contract import realtime as rt
from dpserve.plumbing.untrusted import too_deep
from dpserve.router import schemas
from dpserve.router.access import ADMIN, INFERENCE, OPEN, Levels
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.auth import Keys, Refusal, load_key_file
from dpserve.router.pool import PoolSettings
from dpserve.router.routes import flat
from dpserve.router.tenants import ANONYMOUS, KEYLESS, Principal, unnamed
from tests.in_process import serving_client
from tests.stub_replica import StubReplica
from tests.workers import free_port

T = TypeVar("T")
API, ADMIN_KEY = "sk-inference-4f1c", "sk-admin-9e2d"
FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "seed": 1}
JSON = {"content-type": "application/json"}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@asynccontextmanager
async def _router(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A running app over one stub replica, once the replica serves."""
    ctx = zmq.asyncio.Context()
    stub = StubReplica(ctx)
    app = create_app(RouterSettings(workers=(stub.endpoint,), pool=FAST, **settings))
    try:
        async with serving_client(app) as http:
            yield http
    finally:
        await stub.close()
        ctx.term()


def _run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


KEYED: dict[str, Any] = {"api_keys": (API,), "admin_keys": (ADMIN_KEY,)}


# ---------------------------------------------------------------- the policy


def test_every_route_has_an_access_class() -> None:
    app = create_app(RouterSettings())
    access = Levels.of(flat(app.routes)).of_path
    assert {access(path) for path in ("/livez", "/ready", "/health", "/metrics")} == {OPEN}
    assert {access(path) for path in ("/docs", "/openapi.json", "/redoc")} == {OPEN}
    assert access("/v1/images/generations") == INFERENCE
    assert access("/v1/realtime_video/generate") == INFERENCE
    assert access("/no/such/route") == INFERENCE  # default: a key is needed
    assert access("/health/") == INFERENCE  # not /health
    for path in ("/v1/set_lora", "/update_weights_from_disk", "/server_info", "/health/replicas"):
        assert access(path) == ADMIN
    routes = {getattr(r, "path", "") for r in flat(app.routes)}
    controls = {"/v1/list_loras", "/get_weights_checksum", "/release_memory_occupation"}
    assert controls <= routes and {access(r) for r in controls} == {ADMIN}


def test_keys_are_compared_by_digest_and_never_shown() -> None:
    keys = Keys.of([API], [ADMIN_KEY])
    assert API not in repr(keys) and all(API.encode() not in d for d, _ in keys.api)
    admin = Principal(unnamed(ADMIN_KEY), sees_all=True)
    assert keys.verdict(ADMIN, f"Bearer {ADMIN_KEY}".encode()) == admin
    assert keys.verdict(ADMIN, f"bearer  {ADMIN_KEY} ".encode()) == admin
    assert keys.verdict(INFERENCE, f"Bearer {API}".encode()) == Principal(unnamed(API), False)
    assert keys.verdict(OPEN, None) == ANONYMOUS and Keys().verdict(ADMIN, None) == KEYLESS
    refused = keys.verdict(ADMIN, f"Bearer {API}".encode())
    assert isinstance(refused, Refusal) and refused.status == 403
    for header in (
        None,
        b"",
        b"Bearer",
        b"Basic abc",
        API.encode(),
        b"Bearer " + API.encode()[:-1],
    ):
        refused = keys.verdict(INFERENCE, header)
        assert isinstance(refused, Refusal) and refused.status == 401, header
        assert "Authorization: Bearer <key>" in refused.message
    assert repr(RouterSettings(**KEYED)).count("sk-") == 0


def test_key_files(tmp_path: Path) -> None:
    good = tmp_path / "keys"
    good.write_text("# rotated monthly\n\nsk-one\n  team-a   sk-two  \nteam-a sk-three\n")
    loaded = load_key_file(good)
    assert [k.key for k in loaded] == ["sk-one", "sk-two", "sk-three"]
    assert [k.tenant for k in loaded] == [unnamed("sk-one"), "team-a", "team-a"]
    assert "sk-" not in repr(loaded) and unnamed("sk-one").startswith("key-")
    for text, why in (
        ("a b c\n", "a key alone, or a tenant name and the key"),
        ("sk-one\nt sk-one\n", "line 2: this key is listed twice"),
        ("Team_A sk-x\n", "a tenant name is"),
    ):
        (tmp_path / "odd").write_text(text)
        with pytest.raises(ValueError, match=why) as refused:
            load_key_file(tmp_path / "odd")
        assert "sk-" not in str(refused.value)
    with pytest.raises(ValueError, match="cannot read key file"):
        load_key_file(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.write_text("sk-\x7fone\n")
    with pytest.raises(ValueError, match="line 1") as caught:
        load_key_file(bad)
    assert "one" not in str(caught.value)
    argv = ["router", "--worker", "tcp://x:1", "--api-key", "k1", "--api-key-file", str(good)]
    more = ["--admin-key", "a1", "--body-timeout", "5", "--max-body", "2048"]
    args = build_parser().parse_args([*argv, *more])
    settings = _router_settings(args, args.worker)
    assert Keys.of(settings.api_keys, settings.admin_keys).tenants == tuple(
        sorted({unnamed("k1"), unnamed("sk-one"), "team-a", unnamed("a1")})
    )
    assert settings.api_keys[0] == "k1" and settings.admin_keys == ("a1",)
    assert settings.body_timeout_s == 5 and settings.max_body_bytes == 2048
    serve = build_parser().parse_args(["serve", "--admin-key-file", str(good)])
    assert _router_settings(serve, []).admin_keys == loaded
    with pytest.raises(SystemExit):  # argparse: a start-up error, exit 2
        build_parser().parse_args(["router", "--api-key-file", str(tmp_path / "missing")])


# ---------------------------------------------------------------- keys over HTTP


def test_keys_guard_inference_and_control_routes() -> None:
    async def scenario() -> None:
        async with _router(**KEYED) as http:
            gen = "/v1/images/generations"
            missing = await http.post(gen, json=BODY)
            assert missing.status_code == 401
            assert missing.headers["www-authenticate"] == "Bearer"
            error = missing.json()["error"]
            assert "Authorization: Bearer <key>" in error["message"]
            assert error["type"] == "authentication_error"
            wrong = await http.post(gen, json=BODY, headers=_bearer("sk-guess-1234"))
            assert wrong.status_code == 401 and "sk-guess-1234" not in wrong.text
            assert (await http.post(gen, json=BODY, headers=_bearer(API))).status_code == 200
            assert (await http.post(gen, json=BODY, headers=_bearer(ADMIN_KEY))).status_code == 200
            for method, path in (
                ("POST", "/v1/set_lora"),
                ("POST", "/release_memory_occupation"),
                ("GET", "/v1/list_loras"),
                ("GET", "/get_weights_checksum"),
                ("GET", "/server_info"),
                ("GET", "/health/replicas"),
            ):
                denied = await http.request(method, path, headers=_bearer(API))
                assert denied.status_code == 403, path
                assert denied.json()["error"]["type"] == "permission_error"
                assert (await http.request(method, path)).status_code == 401, path
            admin = _bearer(ADMIN_KEY)
            assert (await http.get("/v1/list_loras", headers=admin)).status_code == 200
            info = await http.get("/server_info", headers=admin)
            assert info.status_code == 200
            assert API not in info.text and ADMIN_KEY not in info.text
            assert info.json()["router"]["auth"] == {"api_keys": 1, "admin_keys": 1}
            for path in ("/livez", "/ready", "/health", "/metrics", "/openapi.json", "/docs"):
                assert (await http.get(path)).status_code == 200, path
            assert (await http.get("/no/such/route")).status_code == 401
            assert (await http.get("/no/such/route", headers=_bearer(API))).status_code == 404
            metrics = (await http.get("/metrics")).text
            assert API not in metrics and 'status="401"' in metrics

    _run(scenario)


def test_api_keys_without_admin_keys_close_control_routes_to_everyone() -> None:
    async def scenario() -> None:
        async with _router(api_keys=(API,)) as http:
            for headers in ({}, _bearer(API), _bearer("other")):
                denied = await http.post("/v1/set_lora", json={}, headers=headers)
                assert denied.status_code == 403
                assert "no admin key is configured" in denied.json()["error"]["message"]
            ok = await http.post("/v1/images/generations", json=BODY, headers=_bearer(API))
            assert ok.status_code == 200

    _run(scenario)


def test_the_openai_client_sends_its_api_key() -> None:
    async def scenario() -> None:
        async with _router(**KEYED) as http:
            transport = http._transport  # the same app
            for key, works in ((API, True), ("sk-wrong", False)):
                client = openai.AsyncOpenAI(
                    api_key=key,
                    base_url="http://localhost/v1",
                    http_client=httpx.AsyncClient(transport=transport),
                    max_retries=0,
                )
                async with client:
                    call = client.images.generate(
                        prompt="x", size="256x256", extra_body={"num_inference_steps": 1}
                    )
                    if works:
                        assert (await call).data[0].b64_json
                    else:
                        with pytest.raises(openai.AuthenticationError) as caught:
                            await call
                        assert "Authorization: Bearer" in str(caught.value)

    _run(scenario)


def test_no_keys_warns_loudly_at_start_and_keys_are_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario(**settings: Any) -> None:
        async with _router(**settings) as http:
            await http.post("/v1/images/generations", json=BODY, headers=_bearer("sk-guess"))

    with caplog.at_level(logging.INFO):
        _run(lambda: scenario())
    assert "NO API KEYS" in caplog.text and "update_weights_from_disk" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        _run(lambda: scenario(**KEYED))
    assert "NO API KEYS" not in caplog.text
    assert API not in caplog.text and ADMIN_KEY not in caplog.text and "sk-guess" not in caplog.text


def test_the_realtime_socket_is_refused_before_it_is_accepted() -> None:
    app = create_app(RouterSettings(**KEYED))  # no replicas: the key check comes first
    with TestClient(app, base_url="http://localhost") as client:
        path = "ws://localhost/v1/realtime_video/generate"  # TestClient's own: testserver
        for headers in ({}, _bearer("sk-wrong")):
            with (
                pytest.raises(WebSocketDenialResponse) as caught,
                client.websocket_connect(path, headers=headers),
            ):
                pass
            assert caught.value.status_code == 401
            assert "Authorization: Bearer <key>" in caught.value.json()["error"]["message"]
        with client.websocket_connect(path, headers=_bearer(API)) as ws:
            ws.send_bytes(msgspec.msgpack.encode({"type": "nonsense"}))
            assert msgspec.msgpack.decode(ws.receive_bytes())["type"] == "error"  # accepted
        text = client.get("/metrics").text
        assert 'dpserve_websockets_closed_total{outcome="refused"' in text


# ---------------------------------------------------------------- bodies


def test_json_routes_refuse_other_content_types() -> None:
    async def scenario() -> None:
        async with _router() as http:
            lora = json.dumps({"lora_nickname": "x", "lora_path": "/x"}).encode()
            for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
                headers = {"content-type": content_type} if content_type else {}
                for path in ("/v1/set_lora", "/v1/images/generations", "/v1/list_loras"):
                    refused = await http.post(path, content=lora, headers=headers)
                    assert refused.status_code == 415, (path, content_type)
                    assert "application/json" in refused.json()["error"]["message"]
            refused = await http.request("GET", "/get_weights_checksum", content=b"{}")
            assert refused.status_code == 415
            # An empty body where the body is optional needs no content type...
            empty = await http.post(
                "/release_memory_occupation", headers={"content-type": "text/plain"}
            )
            assert empty.status_code == 200
            assert (await http.post("/resume_memory_occupation")).status_code == 200
            # ...and JSON with parameters is JSON.
            typed = {"content-type": "Application/JSON; charset=utf-8"}
            done = await http.post(
                "/v1/images/generations", content=json.dumps(BODY), headers=typed
            )
            assert done.status_code == 200

    _run(scenario)


def test_cross_site_browser_requests_are_refused_even_without_keys() -> None:
    """A bodiless no-cors POST and a WebSocket from another site pass JSON-only bodies:
    the browser's own Sec-Fetch-Site (or, from an older one, its Origin) refuses them."""

    async def scenario() -> None:
        async with _router() as http:
            post = "/release_memory_occupation"
            for foreign in (
                {"sec-fetch-site": "cross-site"},
                {"sec-fetch-site": "same-site", "origin": "http://other.router"},
                {"origin": "http://evil.example"},
                {"origin": "null"},
            ):
                refused = await http.post(post, headers=foreign)
                assert refused.status_code == 403, foreign
                assert "cross-site" in refused.json()["error"]["message"]
            # The router's own pages, API clients, and safe methods are let through.
            for own in (
                {"sec-fetch-site": "same-origin", "origin": "http://proxy.public"},
                {"origin": "http://localhost"},
                {},
            ):
                assert (await http.post(post, headers=own)).status_code == 200, own
            assert (await http.get("/v1/models", headers={"origin": "http://x"})).status_code == 200
            assert (
                await http.get("/health", headers={"sec-fetch-site": "cross-site"})
            ).status_code == 200

    _run(scenario)
    app = create_app(RouterSettings())
    with (
        TestClient(app, base_url="http://localhost") as client,
        pytest.raises(WebSocketDenialResponse) as caught,
    ):
        headers = {"origin": "http://evil.example"}
        with client.websocket_connect("ws://localhost/v1/realtime_video/generate", headers=headers):
            pass
    assert caught.value.status_code == 403


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = [
    (b'{"prompt": "x", "seed": ' + _nested(32).encode() + b"}", "nested more than 32"),
    (b'{"prompt": ' + _nested(100_000).encode() + b"}", "nested more than 32"),
    (b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "out of range"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "out of range"),  # 2**64
    (b'{"prompt": "x", "seed": -9223372036854775809}', "out of range"),
    (b'{"prompt": "x", "guidance_scale": NaN}', "NaN is not a JSON value"),
    (b'{"prompt": "x", "guidance_scale": -Infinity}', "-Infinity is not a JSON value"),
    (b'{"prompt": "x", "guidance_scale": 1e999}', "too large"),
    (b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "a\\udfffb"}', "lone UTF-16 surrogate"),
    (b'{"\\ud800": 1, "prompt": "x"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "\xed\xa0\x80"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "\xff"}', "malformed JSON"),
]


@pytest.mark.parametrize(("raw", "message"), HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_json_is_a_400_that_says_why(raw: bytes, message: str) -> None:
    async def scenario() -> None:
        async with _router() as http:
            for path in ("/v1/images/generations", "/v1/set_lora"):
                bad = await http.post(path, content=raw, headers=JSON)
                assert bad.status_code == 400, (path, bad.text)
                assert message in bad.json()["error"]["message"]
            # A paired surrogate is one character, and fine.
            pair = b'{"prompt": "\\ud83d\\ude00", "size": "64x64", "num_inference_steps": 1}'
            assert (
                await http.post("/v1/images/generations", content=pair, headers=JSON)
            ).status_code == 200

    _run(scenario)


def test_odd_types_in_a_generation_are_400s_naming_the_field() -> None:
    async def scenario() -> None:
        async with _router() as http:
            for field, value in (
                ("response_format", {"a": 1}),
                ("response_format", [1]),
                ("output_format", {"a": 1}),
                ("size", ["64x64"]),
                ("size", 64),
                ("seed", [[1]]),
                ("seed", {"a": 1}),
                ("n", 1.5),
                ("width", "64"),
                ("prompt", {"text": "x"}),
                ("negative_prompt", ["x"]),
                ("guidance_scale", "1"),
            ):
                bad = await http.post("/v1/images/generations", json={"prompt": "x", field: value})
                assert bad.status_code == 400, (field, value, bad.text)
                assert bad.json()["error"]["param"] == field, (field, value)

    _run(scenario)


def test_a_body_that_does_not_arrive_in_time_is_a_408() -> None:
    async def slow() -> AsyncIterator[bytes]:
        yield b'{"prompt": '
        await asyncio.sleep(5)
        yield b'"x"}'

    async def scenario() -> float:
        async with _router(body_timeout_s=0.3) as http:
            started = time.perf_counter()
            late = await http.post("/v1/images/generations", content=slow(), headers=JSON)
            took = time.perf_counter() - started
            assert late.status_code == 408, late.text
            assert "did not arrive within 0.3 s" in late.json()["error"]["message"]
            return took

    assert _run(scenario) < 3.0


def test_deep_realtime_messages_are_errors_not_crashes() -> None:
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    for raw, needle in (
        (b"\x91" * 100_000 + b"\x01", "got `array`"),  # refused before any nesting is read
        (msgspec.msgpack.encode({"type": "init", "prompt": deep}), "got `array`"),
        (msgspec.msgpack.encode({"type": "step", "skipped": deep}), None),
        (b"\x82\xa4type\xa4step\xa1x" + b"\x91" * 100_000 + b"\x01", "at most 32 levels"),
    ):
        if needle is None:
            assert rt.decode_client(raw) == rt.PlainMessage(type="step")
            continue
        with pytest.raises(rt.Malformed, match=needle):
            rt.decode_client(raw)
    with pytest.raises(rt.Malformed, match="not valid msgpack"):
        rt.decode_client(b"\x81\xa4type\xa3\xed\xa0\x80")  # a lone surrogate as UTF-8
    assert too_deep([[1]], limit=1) and not too_deep([[1]], limit=2)
    assert not too_deep({"a": [{"b": 1}]}, limit=3) and too_deep({"a": [{"b": {}}]}, limit=3)


# ---------------------------------------------------------------- the schema


def test_openapi_declares_every_body_and_the_key() -> None:
    schema = create_app(RouterSettings(**KEYED)).openapi()
    paths = schema["paths"]
    generation = paths["/v1/images/generations"]["post"]
    body = generation["requestBody"]["content"]["application/json"]["schema"]
    # Which fields it declares: tests/unit/test_router_field_tables.py.
    assert body["required"] == ["prompt"] and body["additionalProperties"] is False
    for path in ("/v1/set_lora", "/update_weights_from_disk", "/release_memory_occupation"):
        assert "application/json" in paths[path]["post"]["requestBody"]["content"], path
    set_lora = paths["/v1/set_lora"]["post"]["requestBody"]["content"]["application/json"]
    assert set(set_lora["schema"]["properties"]) == set(schemas.SetLoraRequest.model_fields)
    assert generation["security"] == [{"bearer": []}]
    assert "security" not in paths["/livez"]["get"]
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert API not in json.dumps(schema)


def test_a_crash_is_a_json_500_that_says_nothing_of_it() -> None:
    app = create_app(RouterSettings())

    async def broken() -> None:
        raise RuntimeError("/secret/path/model.safetensors")

    app.add_api_route("/broken", broken)

    async def scenario() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                return await http.get("/broken")

    crashed = _run(scenario)
    assert crashed.status_code == 500 and crashed.json()["error"]["type"] == "server_error"
    assert "secret" not in crashed.text


def test_serves_banner_says_where_keys_go_and_never_shows_one() -> None:
    from dpserve.banner import ModelFacts, Ready, banner
    from dpserve.contract.model_info import decode
    from tests.stub_replica import model_info

    image = ModelFacts.of(decode({**model_info(), "realtime": "unsupported"}))

    def shown(keyed: bool) -> str:
        ready = Ready("http://127.0.0.1:8000", 2, "/m", ["tcp://127.0.0.1:5575"], keyed, 1.0)
        return banner(ready, image)

    keyed = shown(keyed=True)
    assert "Authorization: Bearer <your --api-key>" in keyed
    assert "/health/replicas -H 'Authorization: Bearer <your --admin-key>'" in keyed
    assert "Authorization" not in shown(keyed=False)


def test_open_and_inference_routes_show_no_replica_errors_or_host_paths() -> None:
    """Before: an unauthenticated /health showed a silent replica's whole snapshot
    (its last error, control state version), and /model_info gave an inference key
    the replicas' model_path. Both are an admin's (/health/replicas, /server_info)."""

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        silent = f"tcp://127.0.0.1:{free_port()}"
        settings = RouterSettings(workers=(stub.endpoint, silent), pool=FAST, **KEYED)
        app = create_app(settings)
        try:
            async with serving_client(app) as http:
                health = await http.get("/health")
                assert health.status_code == 503
                [shown] = health.json()["silent"]
                assert shown["endpoint"] == silent and set(shown) == {"replica", "endpoint"}
                admin = await http.get("/health/replicas", headers=_bearer(ADMIN_KEY))
                assert any(r["last_error"] for r in admin.json()["replicas"])
                info = await http.get("/model_info", headers=_bearer(API))
                assert info.status_code == 200 and "model_path" not in info.json()
                assert "/stub" not in info.text
                server = await http.get("/server_info", headers=_bearer(ADMIN_KEY))
                assert server.json()["model_path"] == "/stub"
        finally:
            await stub.close()
            ctx.term()

    _run(scenario)
