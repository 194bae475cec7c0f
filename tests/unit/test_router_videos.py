"""The video routes (``/v1/videos``): every route's answer and its refusals, and the
official openai client on them.

The real app over httpx's ASGI transport, its lifespan run, against in-process
replicas speaking the real wire protocol on real ZMQ sockets (tests/stub_replica.py,
whose video model runs a job a step each ``step_s``).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import zmq.asyncio
from fastapi import FastAPI
from PIL import Image

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract import video
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.pool import PoolSettings
from tests.polling import until
from tests.stub_replica import JPEG, MP4, StubReplica, run_in_context

FAST = PoolSettings(ping_interval_s=0.05, ping_timeout_s=0.5, control_timeout_s=5)
LIMITS = pv.Limits(max_frames=33, frame_factor=4, default_frames=17, default_fps=8)
BODY = {"prompt": "a red kite", "size": "64x64", "num_frames": 9, "num_inference_steps": 2}
STEP_S = 0.02
SLOW = {**BODY, "num_inference_steps": 100}  # 2 s of steps: not done while a test looks


def _png(fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


# Images in formats Pillow reads but uploads may not be (PNG, JPEG, WebP only).
GIF, BMP = _png("GIF"), _png("BMP")


@asynccontextmanager
async def stubs(
    ctx: zmq.asyncio.Context, n: int = 1, **kw: Any
) -> AsyncIterator[list[StubReplica]]:
    made = [
        StubReplica(ctx, replica=i, step_s=STEP_S, **{"video_limits": LIMITS, **kw})
        for i in range(n)
    ]
    try:
        yield made
    finally:
        for stub in made:
            await stub.close()


@asynccontextmanager
async def routers(
    replicas: list[StubReplica], count: int = 1, **more: Any
) -> AsyncIterator[list[tuple[FastAPI, httpx.AsyncClient]]]:
    """``count`` routers (no shared state) over the same replicas, once all serve."""
    settings = RouterSettings(
        workers=tuple(s.endpoint for s in replicas), pool=FAST, video_poll_s=0.05, **more
    )
    async with AsyncExitStack() as stack:
        made = []
        for _ in range(count):
            app = create_app(settings)
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            http = httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30)
            await stack.enter_async_context(http)
            pool = app.state.running.pool
            await until(lambda: len(pool.serving()) == len(replicas), 10)  # noqa: B023
            made.append((app, http))
        yield made


async def create(http: httpx.AsyncClient, body: dict[str, Any] = BODY) -> dict[str, Any]:
    answer = await http.post("/v1/videos", json=body)
    assert answer.status_code == 200, answer.text
    job: dict[str, Any] = answer.json()
    return job


async def until_status(
    http: httpx.AsyncClient, job_id: str, status: str, timeout_s: float = 10
) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def look() -> None:
        while True:
            answer = await http.get(f"/v1/videos/{job_id}")
            assert answer.status_code == 200, answer.text
            seen.update(answer.json())
            if seen["status"] == status:
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(look(), timeout_s)
    return seen


def _error(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, answer.text
    message: str = answer.json()["error"]["message"]
    return message


# ---------------------------------------------------------------- happy paths


def test_a_job_runs_and_its_video_and_thumbnail_are_served() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(app, http)]:
            job = await create(http, {**BODY, "seed": 7})
            owner = video.job_owner(job["id"])
            assert owner == video.JobOwner(stub.endpoint, stub.boot_id[:8])
            assert job["object"] == "video" and job["model"] == "stub"
            assert job["status"] in ("queued", "in_progress")
            assert (job["size"], job["num_frames"], job["fps"], job["seconds"]) == (
                "64x64", 9, LIMITS.default_fps, "1"
            )  # fmt: skip
            assert (job["seed"], job["attempt"], job["replica"]) == (7, 1, 0)
            assert job["error"] is None and job["remixed_from_video_id"] is None
            ((sent, blobs),) = stub.video_submits
            assert sent.job_id == job["id"] and sent.created_at == job["created_at"]
            assert sent.params is not None and sent.params.seed == [7] and blobs == 0

            done = await until_status(http, job["id"], "completed")
            assert done["progress"] == 100 and done["inference_time_s"] == pytest.approx(0.04)
            assert done["completed_at"] >= done["created_at"]
            assert done["expires_at"] > done["completed_at"]

            mp4 = await http.get(f"/v1/videos/{job['id']}/content")
            assert mp4.status_code == 200 and mp4.content == MP4
            assert mp4.headers["content-type"] == "video/mp4"
            assert f'filename="{job["id"]}.mp4"' in mp4.headers["content-disposition"]
            thumb = await http.get(f"/v1/videos/{job['id']}/content?variant=thumbnail")
            assert thumb.content == JPEG and thumb.headers["content-type"] == "image/jpeg"
            assert f'filename="{job["id"]}.jpg"' in thumb.headers["content-disposition"]

            # The watch ended with the job, and took its slot with it.
            jobs, pool = app.state.running.videos, app.state.running.pool
            await until(lambda: jobs.watched == 0)
            assert [r.inflight for r in pool.members()] == [0]
            assert len(pool.members()[0].ledger) == 0

    run_in_context(scenario)


def test_the_router_fixes_the_seed_and_fills_the_models_default_length() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(_, http)]:
            body = {k: v for k, v in BODY.items() if k != "num_frames"}
            job = await create(http, body)
            ((sent, _),) = stub.video_submits
            assert sent.params is not None and sent.params.seed == [job["seed"]]
            assert sent.params.video == p.VideoSpec(num_frames=17, seconds=2.0, fps=8)
            assert job["num_frames"] == 17 and job["seconds"] == "2"
            timed = await create(http, {**body, "seconds": "3"})  # rounds to 4k+1 frames
            assert (timed["num_frames"], timed["seconds"]) == (25, "3")

    run_in_context(scenario)


def test_delete_cancels_a_running_job_and_frees_its_slot() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(app, http)]:
            job = await create(http, SLOW)
            await until_status(http, job["id"], "in_progress")
            gone = await http.delete(f"/v1/videos/{job['id']}")
            assert gone.status_code == 200, gone.text
            assert gone.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
            assert stub.video_cancelled == [job["id"]] and stub.job(job["id"]) is None
            message = _error(await http.get(f"/v1/videos/{job['id']}"), 404)
            assert "unknown, deleted or expired" in message
            jobs, pool = app.state.running.videos, app.state.running.pool
            await until(lambda: jobs.watched == 0 and pool.members()[0].inflight == 0)
            assert _error(await http.delete(f"/v1/videos/{job['id']}"), 404)

    run_in_context(scenario)


def test_a_deleted_job_keeps_its_slot_until_its_replica_answers_the_delete() -> None:
    """The job runs at its replica until that replica has deleted it: until then its
    slot counts there (in flight, its estimated work), as the replica's next ping would."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(app, http)]:
            job = await create(http, SLOW)
            await until_status(http, job["id"], "in_progress")
            replica = app.state.running.pool.members()[0]
            in_flight = f'dpserve_replica_in_flight{{replica="{replica.endpoint}"}}'
            assert replica.inflight == 1
            stub.delete_gate = asyncio.Event()
            deleting = asyncio.create_task(http.delete(f"/v1/videos/{job['id']}"))
            await until(lambda: stub.deletes_waiting == 1)  # the replica holds it, unanswered
            assert replica.inflight == 1 and replica.ledger.units > 0
            assert f"{in_flight} 1.0" in (await http.get("/metrics")).text
            stub.delete_gate.set()
            assert (await deleting).status_code == 200
            assert stub.video_cancelled == [job["id"]]
            jobs = app.state.running.videos
            await until(lambda: jobs.watched == 0 and replica.inflight == 0)
            assert replica.ledger.units == 0
            assert f"{in_flight} 0.0" in (await http.get("/metrics")).text

    run_in_context(scenario)


def test_list_pages_in_either_order() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, 2) as replicas, routers(replicas) as [(_, http)]:
            made = [(await create(http))["id"] for _ in range(5)]
            listed = (await http.get("/v1/videos")).json()
            assert listed["object"] == "list" and listed["has_more"] is False
            newest_first = [j["id"] for j in listed["data"]]
            assert sorted(newest_first) == sorted(made)
            created = [j["created_at"] for j in listed["data"]]
            assert created == sorted(created, reverse=True)
            assert (listed["first_id"], listed["last_id"]) == (newest_first[0], newest_first[-1])
            for order, expected in (("desc", newest_first), ("asc", newest_first[::-1])):
                seen, after, pages = [], "", 0
                while True:
                    query = f"?limit=2&order={order}" + (f"&after={after}" if after else "")
                    page = (await http.get(f"/v1/videos{query}")).json()
                    seen += [j["id"] for j in page["data"]]
                    pages += 1
                    if not page["has_more"]:
                        break
                    after = page["last_id"]
                assert seen == expected and pages == 3

    run_in_context(scenario)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks the Sora API so
def test_the_openai_client_creates_retrieves_lists_downloads_and_deletes() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(app, _)]:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1",
                api_key="x",
                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
                max_retries=0,
            )
            reference = _png()
            async with client:
                made = await client.videos.create(
                    prompt="a kite takes off",
                    size="64x64",
                    seconds="2",
                    model="stub",
                    input_reference=("first.png", reference, "image/png"),
                    extra_body={"num_inference_steps": 2},
                )
                ((sent, blobs),) = stub.video_submits
                assert blobs == 1 and sent.params is not None
                assert sent.params.edit == p.EditInput(images=[0])
                assert made.seconds == "2" and made.size == "64x64"
                for _ in range(200):
                    got = await client.videos.retrieve(made.id)
                    if got.status == "completed":
                        break
                    await asyncio.sleep(0.02)
                assert got.status == "completed" and got.progress == 100
                page = await client.videos.list(limit=10)
                assert [v.id for v in page.data] == [made.id]
                content = await client.videos.download_content(made.id)
                assert content.content == MP4
                thumb = await client.videos.download_content(made.id, variant="thumbnail")
                assert thumb.content == JPEG
                deleted = await client.videos.delete(made.id)
                assert deleted.deleted and deleted.id == made.id
                with pytest.raises(openai.NotFoundError):
                    await client.videos.retrieve(made.id)

    run_in_context(scenario)


def test_an_input_reference_may_come_inline_as_a_data_url() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(_, http)]:
            url = "data:image/png;base64," + base64.b64encode(_png()).decode()
            await create(http, {**BODY, "input_reference": {"image_url": url}})
            assert stub.video_submits[0][1] == 1

    run_in_context(scenario)


# ---------------------------------------------------------------- refusals


def test_bad_ids_and_unfinished_or_unknown_content_are_named() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(_, http)]:
            message = _error(await http.get("/v1/videos/video_123"), 404)
            assert "not a video id this service gave out" in message
            assert _error(await http.get("/v1/videos/x/content"), 404)
            assert _error(await http.delete("/v1/videos/x"), 404)
            unknown = video.make_job_id(stub.endpoint, stub.boot_id)
            message = _error(await http.get(f"/v1/videos/{unknown}"), 404)
            assert "unknown, deleted or expired" in message
            elsewhere = video.make_job_id("tcp://10.9.9.9:5555", "ab" * 16)
            message = _error(await http.get(f"/v1/videos/{elsewhere}"), 404)
            assert "lost with the replica that ran it" in message and "submit it again" in message

            job = await create(http, SLOW)
            message = _error(await http.get(f"/v1/videos/{job['id']}/content"), 409)
            assert job["id"] in message and "%" in message and "content is not ready" in message
            wrong = await http.get(f"/v1/videos/{job['id']}/content?variant=spritesheet")
            assert "video, thumbnail" in _error(wrong, 400)
            assert wrong.json()["error"]["param"] == "variant"

    run_in_context(scenario)


def test_bad_jobs_are_refused_by_the_router_or_by_the_replica() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(_, http)]:

            async def refused(body: dict[str, Any], field: str) -> str:
                answer = await http.post("/v1/videos", json=body)
                message = _error(answer, 400)
                assert answer.json()["error"]["param"] == field, message
                return message

            # The router's checks, with the limits the replicas' features give.
            assert "4*k+1" in await refused({**BODY, "num_frames": 10}, "num_frames")
            assert "1 to 33" in await refused({**BODY, "num_frames": 37}, "num_frames")
            await refused({**BODY, "seconds": "soon"}, "seconds")
            await refused({**BODY, "size": "60x64"}, "size")
            await refused({**BODY, "colour": "red"}, "colour")
            await refused({k: v for k, v in BODY.items() if k != "prompt"}, "prompt")
            assert stub.video_submits == []
            # The replica's own checks (its limits changed since the router read them).
            stub.video_limits = dataclasses.replace(LIMITS, max_frames=17)
            assert "1 to 17" in await refused({**BODY, "num_frames": 33}, "num_frames")
            stub.video_limits = dataclasses.replace(LIMITS, max_side=32)
            assert "at most 32" in await refused(BODY, "size")
            assert stub.video_submits == []

            # input_reference must be an image, uploaded or inline.
            form = {k: str(v) for k, v in BODY.items()}
            for name, data in (("notes.txt", b"plain words"), ("anim.gif", GIF), ("a.bmp", BMP)):
                upload = {"input_reference": (name, data, "image/octet-stream")}
                answer = await http.post("/v1/videos", data=form, files=upload)
                assert "is not a PNG, JPEG or WebP image" in _error(answer, 400)
                assert answer.json()["error"]["param"] == "input_reference"
            linked = {**BODY, "input_reference": {"image_url": "https://example.com/a.png"}}
            assert "not fetched" in await refused(linked, "input_reference")
            image = {"input_reference": ("first.png", _png(), "image/png")}
            answer = await http.post("/v1/videos", data={**form, "num_frames": "nine"}, files=image)
            assert "must be an integer" in _error(answer, 400)
            answer = await http.post("/v1/videos", content=b"prompt=x")
            assert "multipart/form-data" in _error(answer, 415)

    run_in_context(scenario)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks the Sora API so
def test_a_job_carries_its_estimate_and_one_estimated_past_the_bound_is_a_400() -> None:
    """Estimated seconds: cost units (pixels x latent frames x steps x CFG branches)
    times the replica's measured seconds per unit; a job past --video-max-estimate is
    refused naming both, through plain HTTP and the openai client alike."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        calibrated = p.CostReport(seconds_per_unit=100.0)
        async with (
            stubs(ctx, cost=calibrated) as [stub],
            routers([stub], video_max_estimate_s=60.0) as [(app, http)],
        ):
            job = await create(http)  # 64x64, 9 frames (3 latent), 2 steps, one branch
            assert job["estimated_time_s"] == pytest.approx(100 * 2 * 64 * 64 / 1e6 * 3)
            ((sent, _),) = stub.video_submits
            assert sent.max_run_s == 60.0  # the replica stops it past the bound, too
            answer = await http.post("/v1/videos", json=SLOW)
            message = _error(answer, 400)
            assert "estimated to run 123s (64x64, 9 frames, 100 steps)" in message
            assert "bound of 60s" in message and "--video-max-estimate" in message
            assert len(stub.video_submits) == 1  # refused before any replica saw it
            assert (await until_status(http, job["id"], "completed"))["estimated_time_s"] == (
                job["estimated_time_s"]
            )
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1",
                api_key="x",
                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
                max_retries=0,
            )
            async with client:
                with pytest.raises(openai.BadRequestError, match="bound of 60s"):
                    await client.videos.create(prompt="x", size="64x64", extra_body=SLOW)

    run_in_context(scenario)


def test_before_any_replica_measured_a_job_has_no_estimate_and_only_the_run_bound() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        fresh = p.CostReport(seconds_per_unit=None)
        async with (
            stubs(ctx, cost=fresh) as [stub],
            routers([stub], video_max_estimate_s=60.0) as [(_, http)],
        ):
            job = await create(http, {**SLOW, "size": "1280x720", "num_frames": 33})
            assert job["estimated_time_s"] is None and job["size"] == "1280x720"
            ((sent, _),) = stub.video_submits
            assert sent.estimated_s is None and sent.max_run_s == 60.0
            await http.delete(f"/v1/videos/{job['id']}")

    run_in_context(scenario)


def test_an_image_model_refuses_video_jobs() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, video_limits=None) as [stub], routers([stub]) as [(_, http)]:
            answer = await http.post("/v1/videos", json=BODY)
            assert "/v1/images/generations" in _error(answer, 400)
            listed = await http.get("/v1/videos")
            assert listed.status_code == 200 and listed.json()["data"] == []

    run_in_context(scenario)


def test_bad_list_parameters_are_named() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(_, http)]:
            unknown = video.make_job_id(stub.endpoint, stub.boot_id)
            for query, param in (
                ("limit=0", "limit"),
                ("limit=101", "limit"),
                ("limit=many", "limit"),
                ("order=sideways", "order"),
                ("after=video_1", "after"),
                (f"after={unknown}", "after"),
            ):
                answer = await http.get(f"/v1/videos?{query}")
                _error(answer, 400)
                assert answer.json()["error"]["param"] == param, query
            assert (await http.get("/v1/videos?limit=100&order=asc&x=1")).status_code == 200

    run_in_context(scenario)


def test_the_video_routes_need_an_inference_key() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        keys = {"api_keys": ("sk-user",), "admin_keys": ("sk-admin",)}
        async with stubs(ctx) as [stub], routers([stub], **keys) as [(_, http)]:
            assert (await http.get("/v1/videos")).status_code == 401
            assert (await http.post("/v1/videos", json=BODY)).status_code == 401
            user = {"Authorization": "Bearer sk-user"}
            made = await http.post("/v1/videos", json=BODY, headers=user)
            assert made.status_code == 200, made.text
            job_id = made.json()["id"]
            for path in (f"/v1/videos/{job_id}", f"/v1/videos/{job_id}/content"):
                assert (await http.get(path)).status_code == 401
                assert (await http.get(path, headers=user)).status_code in (200, 409)
            assert (await http.delete(f"/v1/videos/{job_id}")).status_code == 401
            assert (await http.delete(f"/v1/videos/{job_id}", headers=user)).status_code == 200

    run_in_context(scenario)


def test_the_create_body_is_declared_as_json_and_as_a_form() -> None:
    """/openapi.json declares both create bodies (which fields: test_router_field_tables.py)."""
    schema = create_app(RouterSettings()).openapi()
    body = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "multipart/form-data"}
    assert {"/v1/videos/{video_id}", "/v1/videos/{video_id}/content"} <= set(schema["paths"])
