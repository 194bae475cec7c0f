"""Each tenant's usage: its counters on /metrics, the queue and inference histograms per
route, and ``GET /v1/usage`` (docs/tenants.md, Usage).

The real app over httpx's ASGI transport, its lifespan run, against in-process
replicas speaking the real wire protocol on real ZMQ sockets (tests/stub_replica.py):
two tenants (one with two keys) and an admin key.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import msgspec
import pytest
import zmq.asyncio
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from dpserve.contract import validation as pv
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.pool import PoolSettings
from dpserve.router.tenants import TenantKey
from tests.in_process import serving_client
from tests.stub_replica import StubReplica
from tests.unit.test_router_owners import _serving

T = TypeVar("T")
FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
A1, A2, B1, ADMIN_KEY = "sk-team-a-one", "sk-team-a-two", "sk-team-b-one", "sk-ops-admin"
KEYED: dict[str, Any] = {
    "api_keys": (TenantKey(A1, "team-a"), TenantKey(A2, "team-a"), TenantKey(B1, "team-b")),
    "admin_keys": (TenantKey(ADMIN_KEY, "ops"),),
}
TENANTS = {"team-a", "team-b", "ops"}
GEN, EDITS, VIDEOS = "/v1/images/generations", "/v1/images/edits", "/v1/videos"
BODY = {"prompt": "x", "size": "64x64", "num_inference_steps": 2, "seed": 1}
STEP_S = 0.01
LIMITS = pv.Limits(max_frames=33, frame_factor=4, default_frames=17, default_fps=8)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


@asynccontextmanager
async def _router(stub: dict[str, Any] | None = None, **settings: Any) -> AsyncIterator[Any]:
    """A running app over one stub replica, once the replica serves."""
    ctx = zmq.asyncio.Context()
    replica = StubReplica(ctx, step_s=STEP_S, **(stub or {}))
    app = create_app(
        RouterSettings(workers=(replica.endpoint,), pool=FAST, video_poll_s=0.05, **settings)
    )
    try:
        async with serving_client(app) as http:
            yield http
    finally:
        await replica.close()
        ctx.term()


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    ]


def _value(text: str, name: str, **labels: str) -> float:
    return sum(v for got, v in _samples(text, name) if labels.items() <= got.items())


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_counters_move_for_the_right_tenant_only_and_usage_shows_the_same() -> None:
    async def scenario() -> tuple[str, dict[str, Any]]:
        async with _router(**KEYED) as http:
            ok = [
                await http.post(GEN, json={**BODY, "n": 2}, headers=_bearer(A1)),
                await http.post(GEN, json=BODY, headers=_bearer(A2)),  # team-a's other key
                await http.post(
                    EDITS,
                    data={"prompt": "y", "num_inference_steps": "2"},
                    files={"image": ("a.png", _png(), "image/png")},
                    headers=_bearer(A1),
                ),
            ]
            assert [r.status_code for r in ok] == [200] * 3, [r.text for r in ok]
            bad = await http.post(GEN, json={"prompt": 5}, headers=_bearer(A1))
            assert bad.status_code == 400
            # A stream is counted when its job is done, as a plain answer is.
            streamed = await http.post(GEN, json={**BODY, "stream": True}, headers=_bearer(B1))
            assert streamed.status_code == 200 and "image_generation.completed" in streamed.text
            assert (await http.post(GEN, json=BODY)).status_code == 401  # no tenant's
            text = (await http.get("/metrics")).text
            usage = await http.get("/v1/usage", headers=_bearer(ADMIN_KEY))
            assert usage.status_code == 200, usage.text
            return text, usage.json()

    text, usage = _run(scenario)
    images = "dpserve_tenant_images_total"
    assert _value(text, images, tenant="team-a") == 4  # 2 + 1 + the edit's 1
    assert _value(text, images, tenant="team-b") == 1
    assert _value(text, images, tenant="ops") == 0
    requests = "dpserve_tenant_requests_total"
    assert _value(text, requests, tenant="team-a", route=GEN, outcome="ok") == 2
    assert _value(text, requests, tenant="team-a", route=EDITS, outcome="ok") == 1
    assert _value(text, requests, tenant="team-a", outcome="client_error") == 1
    assert _value(text, requests, tenant="team-b") == 1
    # The refused request acted for nobody: no tenant counts it.
    assert _value(text, requests, outcome="client_error") == 1
    units, seconds = "dpserve_tenant_cost_units_total", "dpserve_tenant_inference_seconds_total"
    assert _value(text, units, tenant="team-a") > _value(text, units, tenant="team-b") > 0
    # The stub's pipeline: 2 steps of STEP_S per request.
    assert _value(text, seconds, tenant="team-a") == pytest.approx(3 * 2 * STEP_S)
    assert _value(text, seconds, tenant="team-b") == pytest.approx(2 * STEP_S)
    assert _value(text, seconds, tenant="ops") == _value(text, units, tenant="ops") == 0
    # Per route: one observation per completed generation, in both histograms.
    for histogram in ("dpserve_request_queue_seconds", "dpserve_request_inference_seconds"):
        assert _value(text, f"{histogram}_count", route=GEN) == 3
        assert _value(text, f"{histogram}_count", route=EDITS) == 1
    inference = _value(text, "dpserve_request_inference_seconds_sum", route=GEN)
    assert inference == pytest.approx(3 * 2 * STEP_S)
    # /v1/usage is the same totals as the scrape (one owner).
    assert usage["object"] == "usage" and usage["since"] > 0
    shown = {t["tenant"]: t for t in usage["tenants"]}
    assert set(shown) == TENANTS
    a = shown["team-a"]
    assert a["requests"] == {"ok": 3, "client_error": 1}
    assert a["requests_by_route"][EDITS] == {"ok": 1}
    assert a["images"] == 4 and a["video_frames"] == 0
    assert a["cost_units"] == _value(text, units, tenant="team-a")
    assert a["inference_seconds"] == _value(text, seconds, tenant="team-a")
    assert shown["team-b"]["images"] == 1 and shown["ops"]["images"] == 0


def test_video_frames_count_for_the_tenant_once_its_job_completes() -> None:
    async def scenario() -> tuple[str, dict[str, Any]]:
        async with _router(stub={"video_limits": LIMITS}, **KEYED) as http:
            body = {"prompt": "a kite", "size": "64x64", "num_frames": 9, "num_inference_steps": 2}
            job = await http.post(VIDEOS, json=body, headers=_bearer(B1))
            assert job.status_code == 200, job.text
            deadline = time.monotonic() + 10
            while True:
                got = await http.get(f"{VIDEOS}/{job.json()['id']}", headers=_bearer(B1))
                text = (await http.get("/metrics")).text
                if _value(text, "dpserve_tenant_video_frames_total", tenant="team-b"):
                    break
                assert time.monotonic() < deadline, got.text
                await asyncio.sleep(0.05)
            assert got.json()["status"] == "completed"
            usage = await http.get("/v1/usage", headers=_bearer(ADMIN_KEY))
            return text, usage.json()

    text, usage = _run(scenario)
    assert _value(text, "dpserve_tenant_video_frames_total", tenant="team-b") == 9
    assert _value(text, "dpserve_tenant_video_frames_total", tenant="team-a") == 0
    assert _value(text, "dpserve_tenant_cost_units_total", tenant="team-b") > 0
    assert _value(text, "dpserve_request_inference_seconds_count", route=VIDEOS) == 1
    assert _value(text, "dpserve_request_queue_seconds_count", route=VIDEOS) == 1
    shown = {t["tenant"]: t for t in usage["tenants"]}
    assert shown["team-b"]["video_frames"] == 9
    assert shown["team-b"]["inference_seconds"] == pytest.approx(2 * STEP_S)


def test_usage_needs_an_admin_key_and_metrics_stay_open() -> None:
    async def scenario() -> None:
        async with _router(**KEYED) as http:
            missing = await http.get("/v1/usage")
            assert missing.status_code == 401 and missing.json()["error"]["message"]
            for key in (A1, B1):
                denied = await http.get("/v1/usage", headers=_bearer(key))
                assert denied.status_code == 403, denied.text
            assert (await http.get("/v1/usage", headers=_bearer("sk-guess"))).status_code == 401
            assert (await http.get("/v1/usage", headers=_bearer(ADMIN_KEY))).status_code == 200
            scrape = await http.get("/metrics")  # no key: Prometheus scrapes with none
            assert scrape.status_code == 200 and "dpserve_tenant_requests_total" in scrape.text
            assert all(key not in scrape.text for key in (A1, A2, B1, ADMIN_KEY))
        async with _router(api_keys=(A1,)) as http:  # no admin key: nobody reads usage
            denied = await http.get("/v1/usage", headers=_bearer(A1))
            assert denied.status_code == 403
            assert "no admin key is configured" in denied.json()["error"]["message"]

    _run(scenario)


def test_nothing_a_request_sends_makes_a_tenant_label() -> None:
    """Keys, headers, paths and bodies of the caller's choosing: the tenant label only
    ever holds the configured tenants (and "default" alone without keys)."""

    async def scenario() -> tuple[str, str, dict[str, Any]]:
        async with _router(**KEYED) as http:
            for headers in (
                _bearer("team-c"),
                _bearer("key-0123456789ab"),
                {"Authorization": "Basic team-a"},
                {"X-Tenant": "team-c", "X-Dpserve-Tenant": "evil", **_bearer(A1)},
                {"X-Tenant": "team-c"},
            ):
                await http.post(GEN, json={**BODY, "user": "team-d"}, headers=headers)
                await http.get("/v1/models/team-e", headers=headers)
                await http.get("/team-f/v1/usage", headers=headers)
            await http.get("/metrics", headers={"X-Tenant": "team-g"})
            keyed = (await http.get("/metrics")).text
        async with _router() as http:
            await http.post(GEN, json=BODY, headers={**_bearer("team-h"), "X-Tenant": "team-h"})
            keyless = (await http.get("/metrics")).text
            usage = (await http.get("/v1/usage", headers={"X-Tenant": "team-h"})).json()
        return keyed, keyless, usage

    keyed, keyless, usage = _run(scenario)

    def labels(text: str) -> set[str]:
        return {
            s.labels["tenant"]
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if "tenant" in s.labels
        }

    assert labels(keyed) == TENANTS
    assert labels(keyless) == {"default"}
    # Without keys every caller is the one tenant: the request counted, as "default".
    assert _value(keyless, "dpserve_tenant_images_total", tenant="default") == 1
    assert [t["tenant"] for t in usage["tenants"]] == ["default"]


def test_realtime_frames_count_for_the_sessions_tenant() -> None:
    """Each frame a session streams is its tenant's: the first (with the ack) and every
    one after, up to ``max_frames``; another tenant's totals do not move."""

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        try:
            settings = RouterSettings(workers=(stub.endpoint,), pool=FAST, **KEYED)
            async with _serving(settings) as url:
                init = {"type": "init", "prompt": "a kite", "mode": "stream", "max_frames": 3}
                async with connect(url, additional_headers=_bearer(A1)) as ws:
                    await ws.send(msgspec.msgpack.encode(init))
                    kinds = []
                    while not kinds or kinds[-1] != "done":
                        message = msgspec.msgpack.decode(await asyncio.wait_for(ws.recv(), 10))
                        kinds.append(message["type"])
                assert kinds.count("frame") == 3, kinds
                base = url.replace("ws://", "http://").split("/v1/")[0]
                async with httpx.AsyncClient(base_url=base, timeout=10) as http:
                    usage = (await http.get("/v1/usage", headers=_bearer(ADMIN_KEY))).json()
                    text = (await http.get("/metrics")).text
        finally:
            await stub.close()
            ctx.term()
        shown = {t["tenant"]: t["realtime_frames"] for t in usage["tenants"]}
        assert shown["team-a"] == 3 and shown["team-b"] == 0, shown
        assert _value(text, "dpserve_tenant_realtime_frames_total", tenant="team-a") == 3
        assert _value(text, "dpserve_tenant_realtime_frames_total", tenant="team-b") == 0

    _run(scenario)
