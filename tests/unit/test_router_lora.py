"""Per-request LoRA through the router (docs/lora.md): every route takes ``lora`` and
sends it on with each name resolved to its path; bad ones are 400s naming the field;
adapter-aware least work gathers an adapter's requests where it is resident; /v1/models
and /metrics show the replicas' adapter caches.

The router in process (httpx over ASGI, uvicorn for the WebSocket) against stub
replicas speaking the real wire protocol on real ZMQ (tests/stub_replica.py), which
report an ``AdapterReport`` in their pings and keep what they received.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import zmq.asyncio
from PIL import Image
from websockets.asyncio.client import connect

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.pool import PoolSettings
from tests.polling import until
from tests.stub_replica import StubReplica, run_in_context
from tests.unit.test_router_edges import _serving

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
GEN = "/v1/images/generations"
BODY: dict[str, Any] = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2, "seed": 3}
INK = {"name": "ink", "path": "/loras/ink", "scale": 0.8}
REGISTERED = {"house": "/loras/house"}
ADMIN, USER = "admin-key", "user-key"
VIDEO_LIMITS = pv.Limits(max_frames=33, frame_factor=4, default_frames=17, default_fps=8)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


@contextlib.asynccontextmanager
async def _fleet(
    ctx: zmq.asyncio.Context, *reports: p.AdapterReport | None, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, list[StubReplica], Any]]:
    """One stub per report, a router over them (``settings``: RouterSettings' and
    PoolSettings' fields), once every stub serves."""
    stubs = [
        StubReplica(ctx, replica=i, step_s=0.02, adapters=r, video_limits=VIDEO_LIMITS)
        for i, r in enumerate(reports)
    ]
    pool_fields = {f.name for f in dataclasses.fields(PoolSettings)}
    pool = dataclasses.replace(
        FAST, loras=REGISTERED, **{k: v for k, v in settings.items() if k in pool_fields}
    )
    rest = {k: v for k, v in settings.items() if k not in pool_fields}
    app = create_app(
        RouterSettings(
            workers=tuple(s.endpoint for s in stubs), pool=pool, video_poll_s=0.05, **rest
        )
    )
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://localhost", timeout=30
            ) as http:
                running = app.state.running.pool
                await until(lambda: len(running.serving()) == len(stubs), 10)
                await until(
                    lambda: all(
                        (r.adapters is not None) == (rep is not None)
                        for r, rep in zip(
                            sorted(running.members(), key=lambda r: r.name), reports, strict=True
                        )
                    ),
                    10,
                )
                yield http, stubs, running
    finally:
        for stub in stubs:
            await stub.close()


def _cache(*resident: str, load_s: float | None = 0.05) -> p.AdapterReport:
    return p.AdapterReport(
        resident=list(resident), known={n: f"/loras/{n}" for n in resident}, load_s=load_s
    )


def _named(answer: httpx.Response) -> dict[str, str]:
    assert answer.status_code == 400, answer.text
    return {f["field"]: f["message"] for f in answer.json()["error"]["fields"]}


def _sent(stub: StubReplica) -> list[list[p.LoraRef] | None]:
    return [params.lora for params, _ in stub.received]


def test_a_generation_sends_its_adapters_with_every_name_resolved() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache("elsewhere")) as (http, [stub], _):

            async def ok(lora: Any) -> list[p.LoraRef] | None:
                answer = await http.post(GEN, json={**BODY, "lora": lora})
                assert answer.status_code == 200, answer.text
                return _sent(stub)[-1]

            assert await ok(INK) == [p.LoraRef(name="ink", path="/loras/ink", scale=0.8)]
            # A name this router sent with its path is known alone from then on.
            assert await ok("ink") == [p.LoraRef(name="ink", path="/loras/ink")]
            # Registered (--lora house=/loras/house), and a replica's own known name.
            stacked = [{"name": "house", "scale": 0.5}, {"name": "elsewhere"}]
            assert await ok(stacked) == [
                p.LoraRef(name="house", path="/loras/house", scale=0.5),
                p.LoraRef(name="elsewhere", path="/loras/elsewhere"),
            ]
            assert await ok([]) == []  # none at all, for this request
            assert await ok(None) is None  # the service's own
            # The service's set_lora nickname names its path too.
            done = await http.post(
                "/v1/set_lora", json={"lora_nickname": "svc", "lora_path": "/loras/svc"}
            )
            assert done.status_code == 200, done.text
            assert await ok({"name": "svc", "scale": 0.3}) == [
                p.LoraRef(name="svc", path="/loras/svc", scale=0.3)
            ]

    run_in_context(scenario)


def test_bad_adapters_are_400s_naming_lora_and_how_to_fix() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache()) as (http, [stub], _):

            async def refused(lora: Any, *says: str) -> None:
                named = _named(await http.post(GEN, json={**BODY, "lora": lora}))
                assert set(named) == {"lora"}, named
                for part in says:
                    assert part in named["lora"], (lora, named)

            await refused("nobody", "'nobody' is not known", '"path"', "--lora nobody=PATH")
            await refused(
                {"name": "house", "path": "/elsewhere"}, "/loras/house", "/elsewhere", "new name"
            )
            await refused(7, "must be {")
            await refused({"name": "a", "weight": 1}, "not weight")
            await refused({"name": "a", "scale": "x"}, "scale must be a number")
            await refused({"name": "a", "scale": 11}, "between -10 and 10")
            await refused({"name": "../x"}, "must be 1-64 letters")
            many = [{"name": f"a{i}", "path": "/p"} for i in range(pv.MAX_REQUEST_LORAS + 1)]
            await refused(many, "at most 8 adapters")
            await refused([INK, INK], "names an adapter twice")
            assert stub.received == []

    run_in_context(scenario)


def test_a_request_with_lora_while_the_service_adapters_are_merged_is_a_409() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache()) as (http, [stub], _):
            lora = {"lora_nickname": "svc", "lora_path": "/loras/svc"}
            assert (await http.post("/v1/set_lora", json=lora)).status_code == 200
            assert (await http.post("/v1/merge_lora_weights", json={})).status_code == 200
            answer = await http.post(GEN, json={**BODY, "lora": INK})
            assert answer.status_code == 409 and "unmerge_lora_weights" in answer.text
            assert (await http.post(GEN, json=BODY)).status_code == 200  # without: served
            assert _sent(stub) == [None]

    run_in_context(scenario)


def test_set_lora_refuses_targets_it_cannot_honour_over_http() -> None:
    """Adapters load whole: SGLang's "transformer" (the transformer part alone) and Wan's
    second expert are 400s that say what to send instead; nothing reaches a replica."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache()) as (http, [stub], _):
            lora = {"lora_nickname": "svc", "lora_path": "/loras/svc"}
            for target, hint in (("transformer", "target 'all'"), ("transformer_2", "modules")):
                answer = await http.post("/v1/set_lora", json={**lora, "target": target})
                assert answer.status_code == 400 and hint in answer.text, answer.text
            assert "set_lora" not in stub.calls
            assert (await http.post("/v1/set_lora", json={**lora, "target": "all"})).is_success
            assert "set_lora" in stub.calls

    run_in_context(scenario)


def test_edits_and_variations_take_lora_as_json_or_a_bare_name() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache()) as (http, [stub], _):
            files = {"image": ("in.png", _png(), "image/png")}

            async def edit(route: str, **form: str) -> httpx.Response:
                return await http.post(route, data=form, files=files)

            done = await edit("/v1/images/edits", prompt="x", lora='{"name": "ink", "path": "/i"}')
            assert done.status_code == 200, done.text
            assert _sent(stub)[-1] == [p.LoraRef(name="ink", path="/i")]
            done = await edit("/v1/images/edits", prompt="x", lora="house")
            assert done.status_code == 200, done.text
            assert _sent(stub)[-1] == [p.LoraRef(name="house", path="/loras/house")]
            done = await edit("/v1/images/variations", lora='[{"name": "ink", "scale": 0.5}]')
            assert done.status_code == 200, done.text
            assert _sent(stub)[-1] == [p.LoraRef(name="ink", path="/i", scale=0.5)]
            assert "lora" in _named(await edit("/v1/images/edits", prompt="x", lora="{bad"))
            assert "lora" in _named(await edit("/v1/images/edits", prompt="x", lora="nobody"))

    run_in_context(scenario)


def test_a_video_job_takes_lora_as_json_and_in_its_form() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache()) as (http, [stub], _):
            body = {"prompt": "a kite", "size": "64x64", "num_frames": 9, "lora": INK}
            answer = await http.post("/v1/videos", json=body)
            assert answer.status_code == 200, answer.text
            request, _ = stub.video_submits[-1]
            assert request.params is not None
            assert request.params.lora == [p.LoraRef(name="ink", path="/loras/ink", scale=0.8)]
            form = {"prompt": "a kite", "size": "64x64", "num_frames": "9", "lora": "house"}
            files = {"input_reference": ("in.png", _png(), "image/png")}
            answer = await http.post("/v1/videos", data=form, files=files)
            assert answer.status_code == 200, answer.text
            request, _ = stub.video_submits[-1]
            assert request.params is not None
            assert request.params.lora == [p.LoraRef(name="house", path="/loras/house")]
            refused = await http.post("/v1/videos", json={**body, "lora": "nobody"})
            assert "lora" in _named(refused)

    run_in_context(scenario)


def test_a_realtime_session_takes_its_adapters_at_init() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stub = StubReplica(ctx, adapters=_cache())
        settings = RouterSettings(
            workers=(stub.endpoint,), pool=dataclasses.replace(FAST, loras=REGISTERED)
        )
        try:
            async with _serving(settings) as address:
                async with httpx.AsyncClient(base_url=f"http://{address}") as http:
                    while (await http.get("/ready")).status_code != 200:
                        await asyncio.sleep(0.02)
                async with connect(f"ws://{address}/v1/realtime_video/generate") as ws:

                    async def reply() -> dict[str, Any]:
                        got: dict[str, Any] = msgspec.msgpack.decode(
                            await asyncio.wait_for(ws.recv(), 10)
                        )
                        return got

                    init = {"type": "init", "prompt": "a fox", "mode": "step", "width": 64}
                    await ws.send(msgspec.msgpack.encode({**init, "lora": "nobody"}))
                    error = await reply()
                    assert error["type"] == "error" and "nobody" in str(error), error
                    await ws.send(msgspec.msgpack.encode({**init, "lora": ["house", INK]}))
                    assert (await reply())["type"] == "init_ack"
                    assert (await reply())["type"] == "frame"
            [params] = stub.opened
            assert params is not None and params.lora == [
                p.LoraRef(name="house", path="/loras/house"),
                p.LoraRef(name="ink", path="/loras/ink", scale=0.8),
            ]
        finally:
            await stub.close()

    run_in_context(scenario)


def test_least_work_sends_an_adapters_requests_where_it_is_resident() -> None:
    ink = {**BODY, "lora": "ink"}
    wash = {**BODY, "lora": {"name": "wash", "path": "/loras/wash"}}

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache("ink"), _cache("wash")) as (http, [a, b], _):
            for _ in range(3):
                for body in (ink, wash):
                    assert (await http.post(GEN, json=body)).status_code == 200
            assert [r[0].name for r in _sent(a) if r] == ["ink"] * 3
            assert [r[0].name for r in _sent(b) if r] == ["wash"] * 3
            # Without adapters the idle replicas take turns, as before.
            for _ in range(4):
                assert (await http.post(GEN, json=BODY)).status_code == 200
            assert (len(a.received), len(b.received)) == (5, 5)
            # A holder buried in work loses to an idle replica that must load.
            long = asyncio.create_task(
                http.post(GEN, json={**ink, "size": "512x512", "num_inference_steps": 40})
            )
            await until(lambda: len(a.received) == 6, 5)
            assert (await http.post(GEN, json=ink)).status_code == 200
            assert _sent(b)[-1] == [p.LoraRef(name="ink", path="/loras/ink")]
            assert (await long).status_code == 200

    run_in_context(scenario)


def test_blind_least_work_ignores_where_adapters_are() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        fleet = _fleet(ctx, _cache("ink"), _cache(), adapter_routing="blind")
        async with fleet as (http, [a, b], _):
            for _ in range(2):
                assert (await http.post(GEN, json={**BODY, "lora": "ink"})).status_code == 200
            assert (len(a.received), len(b.received)) == (1, 1)

    run_in_context(scenario)


def test_requests_for_one_adapter_gather_before_any_ping_shows_it() -> None:
    """The first request for a new adapter goes somewhere; the next ones follow it there
    while pings lag (the trail), instead of loading it on every replica."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, _cache(), _cache()) as (http, [a, b], pool):
            for replica in pool.members():  # no ping from now on
                pool.health.stop(replica.endpoint)
            body = {**BODY, "lora": {"name": "new", "path": "/loras/new"}}
            for _ in range(4):
                assert (await http.post(GEN, json=body)).status_code == 200
            assert sorted((len(a.received), len(b.received))) == [0, 4]

    run_in_context(scenario)


def test_v1_models_lists_adapters_an_admin_sees_where_and_a_tenant_only_the_catalog() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        keys = {"api_keys": (USER,), "admin_keys": (ADMIN,)}
        a_cache = _cache("ink")
        a_cache.pinned = ["svc"]
        async with _fleet(ctx, a_cache, _cache("ink", "wash"), **keys) as (http, _, _):
            admin = {"Authorization": f"Bearer {ADMIN}"}
            user = {"Authorization": f"Bearer {USER}"}
            shown = (await http.get("/v1/models", headers=admin)).json()["data"][0]["adapters"]
            assert shown == [
                {"name": "house", "path": "/loras/house", "resident": [], "pinned": False},
                {"name": "ink", "path": "/loras/ink", "resident": ["0", "1"], "pinned": False},
                {"name": "wash", "path": "/loras/wash", "resident": ["1"], "pinned": False},
            ]
            tenant = (await http.get("/v1/models", headers=user)).json()["data"][0]
            assert tenant["adapters"] == [{"name": "house"}]  # no paths, no others' names
            one = await http.get(f"/v1/models/{tenant['id']}", headers=user)
            assert one.json()["adapters"] == [{"name": "house"}]

    run_in_context(scenario)


def test_metrics_and_health_replicas_show_each_replicas_adapter_cache() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        counts = p.AdapterReport(
            resident=["ink", "wash"],
            used_bytes=4096,
            capacity_bytes=8192,
            hits=5,
            misses=2,
            loads=2,
            evictions=1,
            failures=1,
            load_seconds=0.25,
        )
        async with _fleet(ctx, counts, None) as (http, [a, b], _):
            text = (await http.get("/metrics")).text

            def value(metric: str, endpoint: str) -> float | None:
                pattern = rf'^{metric}\{{replica="{re.escape(endpoint)}"\}} ([0-9.e+-]+)$'
                found = re.search(pattern, text, re.M)
                return float(found.group(1)) if found else None

            expected = {
                "dpserve_lora_cache_hits_total": 5,
                "dpserve_lora_cache_misses_total": 2,
                "dpserve_lora_cache_loads_total": 2,
                "dpserve_lora_cache_evictions_total": 1,
                "dpserve_lora_cache_failures_total": 1,
                "dpserve_lora_cache_load_seconds_total": 0.25,
                "dpserve_lora_cache_resident": 2,
                "dpserve_lora_cache_used_bytes": 4096,
            }
            for metric, number in expected.items():
                assert value(metric, a.endpoint) == number, metric
                assert value(metric, b.endpoint) is None, metric  # no cache: not shown
            assert "# TYPE dpserve_lora_cache_hits_total counter" in text
            assert "# TYPE dpserve_lora_cache_resident gauge" in text
            shown = (await http.get("/health/replicas")).json()["replicas"]
            by_endpoint = {r["endpoint"]: r["adapters"] for r in shown}
            assert by_endpoint[a.endpoint] == {
                "resident": ["ink", "wash"],
                "pinned": [],
                "used_bytes": 4096,
                "capacity_bytes": 8192,
                "load_s": None,
            }
            assert by_endpoint[b.endpoint] is None

    run_in_context(scenario)


def test_a_holder_takes_its_adapters_request_past_its_cap_when_that_finishes_first() -> None:
    """At its in-flight cap, the holder of an adapter whose load costs more than a
    request still takes that adapter's request (up to four times the cap); a request
    without adapters goes to the replica with room, as before."""
    ink = {**BODY, "lora": "ink"}

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        slow = 30.0  # seconds per adapter load, both replicas
        fleet = _fleet(ctx, _cache("ink", load_s=slow), _cache(load_s=slow), max_inflight=1)
        async with fleet as (http, [a, b], _):
            for _ in range(2):  # calibrates both: step costs measured
                assert (await http.post(GEN, json=BODY)).status_code == 200
            running = asyncio.create_task(http.post(GEN, json={**ink, "num_inference_steps": 20}))
            await until(lambda: len(a.received) == 2, 5)
            assert (await http.post(GEN, json=ink)).status_code == 200
            assert _sent(a)[-1] == [p.LoraRef(name="ink", path="/loras/ink")]
            assert b.received[-1][0].lora is None  # b only had the calibration request
            plain = asyncio.create_task(http.post(GEN, json=BODY))
            await until(lambda: len(b.received) == 2, 5)
            assert (await plain).status_code == 200 and (await running).status_code == 200

    run_in_context(scenario)


def test_blind_least_work_keeps_the_cap() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        fleet = _fleet(
            ctx,
            _cache("ink", load_s=30.0),
            _cache(load_s=30.0),
            max_inflight=1,
            adapter_routing="blind",
        )
        async with fleet as (http, [a, b], _):
            ink = {**BODY, "lora": "ink"}
            running = asyncio.create_task(http.post(GEN, json={**ink, "num_inference_steps": 20}))
            await until(lambda: len(a.received) + len(b.received) == 1, 5)
            assert (await http.post(GEN, json=ink)).status_code == 200
            assert (len(a.received), len(b.received)) == (1, 1)
            assert (await running).status_code == 200

    run_in_context(scenario)


def test_a_load_into_a_full_cache_costs_twice_when_placing() -> None:
    """Replica 0 loads faster but its cache is full (a load there evicts an adapter in
    demand); replica 1 has room: the request goes to 1. With room on both, to 0."""
    new = {**BODY, "lora": {"name": "new", "path": "/loras/new"}}

    def cache(load_s: float, used: int) -> p.AdapterReport:
        return p.AdapterReport(
            resident=["x", "y"], capacity_bytes=100, used_bytes=used, load_s=load_s
        )

    async def scenario(ctx: zmq.asyncio.Context, used: int, to: int) -> None:
        async with _fleet(ctx, cache(0.3, used), cache(0.45, 40)) as (http, stubs, _):
            assert (await http.post(GEN, json=new)).status_code == 200
            assert [len(s.received) for s in stubs] == [int(to == 0), int(to == 1)]

    run_in_context(lambda ctx: scenario(ctx, used=90, to=1))
    run_in_context(lambda ctx: scenario(ctx, used=40, to=0))


def test_hot_adapters_gather_on_a_clean_replica_and_new_cold_ones_load_on_the_other() -> None:
    """Homes by demand (docs/lora.md, "Homes by demand"): once more adapters are in
    demand than the caches hold, the hottest share one replica's cache (the first
    endpoint, "clean") and the tail churns on the other, so cold loads never evict a
    hot adapter. A rendezvous hash alone would split both kinds between the two."""

    def cache() -> p.AdapterReport:  # room for four adapters of the size it holds
        return p.AdapterReport(resident=["seed"], capacity_bytes=400, used_bytes=100, load_s=0.05)

    def lora(name: str) -> dict[str, Any]:
        return {**BODY, "lora": {"name": name, "path": f"/loras/{name}"}}

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, cache(), cache()) as (http, stubs, pool):
            for replica in pool.members():  # the trail alone says where adapters went
                pool.health.stop(replica.endpoint)
            clean, churn = sorted(stubs, key=lambda s: s.endpoint)
            hot = [f"hot-{i}" for i in range(4)]
            for name in [f"tail-{i}" for i in range(12)] + hot * 6:
                assert (await http.post(GEN, json=lora(name))).status_code == 200
            new = [f"new-{i}" for i in range(8)]
            for name in new:
                assert (await http.post(GEN, json=lora(name))).status_code == 200

            def names(stub: StubReplica) -> set[str]:
                return {r[0].name for r in _sent(stub) if r}

            assert set(hot) <= names(clean) and not set(hot) & names(churn)
            assert set(new) <= names(churn) and not set(new) & names(clean)

    run_in_context(scenario)


def test_adapter_home_slack_sets_how_far_a_request_detours_to_its_home() -> None:
    """``--adapter-home-slack`` (PoolSettings.adapter_home_slack): the home of a
    request's adapters (the first replica, while the sets in demand fit the caches)
    runs a long request (10 or 20 requests' work); the other replica is idle and loads
    in half a step. At 16 requests of slack the request waits at home; at 0, it goes to
    the idle one. (A slow host shortens the wait left at home: neither case is
    sensitive to it.)"""
    ink = {**BODY, "lora": {"name": "ink", "path": "/loras/ink"}}

    def cache() -> p.AdapterReport:  # room for four adapters of the size it holds
        return p.AdapterReport(resident=["seed"], capacity_bytes=400, used_bytes=100, load_s=0.01)

    async def scenario(ctx: zmq.asyncio.Context, slack: float, steps: int, detours: bool) -> None:
        async with _fleet(ctx, cache(), cache(), adapter_home_slack=slack) as (http, stubs, _):
            for _ in range(2):  # calibrates both: step costs measured
                assert (await http.post(GEN, json=BODY)).status_code == 200
            home, other = sorted(stubs, key=lambda s: s.endpoint)
            assert (await http.post(GEN, json=ink)).status_code == 200
            assert _sent(home)[-1] == [p.LoraRef(name="ink", path="/loras/ink")]
            long = asyncio.create_task(http.post(GEN, json={**ink, "num_inference_steps": steps}))
            await until(lambda: len(home.received) == 3, 5)
            assert (await http.post(GEN, json=ink)).status_code == 200
            expected = (4, 1) if detours else (3, 2)
            assert (len(home.received), len(other.received)) == expected
            assert (await long).status_code == 200

    run_in_context(lambda ctx: scenario(ctx, slack=16.0, steps=20, detours=True))
    run_in_context(lambda ctx: scenario(ctx, slack=0.0, steps=40, detours=False))


def test_a_load_into_a_full_cache_adds_the_load_once_to_the_replicas_queue() -> None:
    """Placement weighs a load into a full cache twice (the evicted adapter's reload is
    a later request's), but the replica's work ahead grows by what it will run: the
    request and one load. Counted twice there, a churning cache looked deeper than it
    was and least work sent its share of the traffic to the other replica."""
    full = p.AdapterReport(resident=["x", "y"], capacity_bytes=100, used_bytes=90, load_s=30.0)
    new = {**BODY, "lora": {"name": "new", "path": "/loras/new"}, "num_inference_steps": 20}

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with _fleet(ctx, full) as (http, [stub], pool):
            assert (await http.post(GEN, json=BODY)).status_code == 200  # calibrates it
            [replica] = pool.members()
            params = p.GenerateParams(prompt="x", lora=[p.LoraRef(name="new", path="/loras/new")])
            placing = pool.load.miss_cost_s(replica, params)
            running = asyncio.create_task(http.post(GEN, json=new))
            await until(lambda: len(stub.received) == 2, 5)
            ahead = pool.load.outstanding_s(replica)
            assert placing == 60.0 and 29.0 < ahead < 31.0, ahead
            assert (await running).status_code == 200

    run_in_context(scenario)
