"""Video jobs across replicas and routers: placement spreads jobs and counts them as
work, a job whose replica is lost (stopped, restarted, shutting down) runs again
elsewhere under its id with its seed, and a router that did not place a job finds
it, its content and its place in the list.

Real routers (httpx over ASGI) and pools against in-process replicas speaking the
real wire protocol on real ZMQ sockets (tests/stub_replica.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import zmq.asyncio
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from dpserve.contract import video
from tests.polling import until
from tests.stub_replica import MP4, StubReplica, run_in_context
from tests.unit.test_router_videos import BODY, SLOW, create, routers, stubs, until_status

MEDIUM = {**BODY, "num_inference_steps": 25, "seed": 11}  # 0.5 s of steps


def _gauges(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("replica", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


_TOTAL_WORK = ("dpserve_outstanding_work_seconds", "")


async def _gauges_when(
    http: httpx.AsyncClient,
    check: Callable[[dict[tuple[str, str], float]], bool],
    timeout_s: float = 5.0,
) -> dict[tuple[str, str], float]:
    """The router's gauges once ``check`` holds of them (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = _gauges((await http.get("/metrics")).text)
        if check(gauges):
            return gauges
        assert time.monotonic() < deadline, f"gauges never settled: {gauges}"
        await asyncio.sleep(0.02)


def _holder(replicas: list[StubReplica], job_id: str) -> StubReplica:
    (held,) = [s for s in replicas if s.job(job_id) is not None]
    return held


def _watched(app: FastAPI) -> int:
    count: int = app.state.running.videos.watched
    return count


def test_jobs_spread_over_replicas_and_count_as_their_work() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, 2) as replicas, routers(replicas) as [(app, http)]:
            jobs = [await create(http, SLOW) for _ in range(2)]
            assert sorted(j["replica"] for j in jobs) == [0, 1]
            assert {video.job_owner(j["id"]).endpoint for j in jobs} == {  # type: ignore[union-attr]
                s.endpoint for s in replicas
            }
            gauges = _gauges((await http.get("/metrics")).text)
            assert gauges[("dpserve_video_jobs_watched", "")] == 2
            for stub in replicas:
                assert gauges[("dpserve_replica_in_flight", stub.endpoint)] == 1
                assert gauges[("dpserve_replica_outstanding_work_seconds", stub.endpoint)] > 0
            assert gauges[("dpserve_outstanding_work_seconds", "")] > 0
            # Jobs are placed past the in-flight cap (2 a replica here): they queue there.
            jobs += [await create(http, SLOW) for _ in range(3)]
            pool = app.state.running.pool
            assert sorted(r.inflight for r in pool.members()) == [2, 3]
            assert _watched(app) == 5
            for job in jobs:
                assert (await http.delete(f"/v1/videos/{job['id']}")).status_code == 200
            await until(lambda: _watched(app) == 0)
            # A delete frees the job's slot before the replica drops the job: a ping
            # answered in between counts it as another router's work until the next one.
            gauges = await _gauges_when(http, lambda g: g[_TOTAL_WORK] == 0)
            assert gauges[("dpserve_video_jobs_watched", "")] == 0

    run_in_context(scenario)


def test_a_full_replica_passes_the_job_on_and_all_full_is_429() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, 2) as replicas, routers(replicas) as [(_, http)]:
            replicas[0].video_max_queue = 0
            placed = [await create(http) for _ in range(3)]
            assert {j["replica"] for j in placed} == {1}
            replicas[1].video_max_queue = 0
            full = await http.post("/v1/videos", json=BODY)
            assert full.status_code == 429, full.text
            assert "queue is full" in full.json()["error"]["message"]

    run_in_context(scenario)


def test_a_job_whose_replica_stops_runs_again_elsewhere_with_its_id_and_seed() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, 2) as replicas, routers(replicas) as [(app, http)]:
            job = await create(http, MEDIUM)
            owner = _holder(replicas, job["id"])
            (other,) = [s for s in replicas if s is not owner]
            await until_status(http, job["id"], "in_progress")
            await owner.close()  # the gang died: its socket and its jobs are gone
            done = await until_status(http, job["id"], "completed", 10)
            assert (done["attempt"], done["replica"], done["seed"]) == (2, other.replica, 11)
            assert done["created_at"] == job["created_at"]
            ((rerun, _),) = other.video_submits
            assert rerun.job_id == job["id"] and rerun.attempt == 2
            assert rerun.created_at == job["created_at"]
            ((first, _),) = owner.video_submits
            assert rerun.params == first.params  # the seed included: the same frames
            assert (await http.get(f"/v1/videos/{job['id']}/content")).content == MP4
            await until(lambda: _watched(app) == 0)

    run_in_context(scenario)


def test_a_job_whose_replica_restarts_runs_again_and_a_lost_one_says_so() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(app, http)]:
            job = await create(http, MEDIUM)
            await until_status(http, job["id"], "in_progress")
            stub.reboot()  # same address, a new boot id, an empty job book
            done = await until_status(http, job["id"], "completed", 10)
            assert done["attempt"] == 2 and done["seed"] == 11
            # A finished job is not watched any more: a restart now loses it for good.
            await until(lambda: _watched(app) == 0)
            stub.reboot()
            lost = await http.get(f"/v1/videos/{job['id']}")
            assert lost.status_code == 404
            assert "lost with the replica that ran it" in lost.json()["error"]["message"]

    run_in_context(scenario)


def test_a_job_its_replica_gives_up_while_shutting_down_runs_again_elsewhere() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, 2) as replicas, routers(replicas) as [(_, http)]:
            job = await create(http, MEDIUM)
            owner = _holder(replicas, job["id"])
            await until_status(http, job["id"], "in_progress")
            owner.drain()
            done = await until_status(http, job["id"], "completed", 10)
            assert done["attempt"] == 2 and done["replica"] != owner.replica
            # The owner's failed copy is deleted, so no router finds it there.
            await until(lambda: owner.job(job["id"]) is None)

    run_in_context(scenario)


def test_another_router_finds_the_job_its_content_and_lists_it() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, 2) as replicas, routers(replicas, 2) as [(a, ha), (b, hb)]:
            job = await create(ha, MEDIUM)
            seen = (await hb.get(f"/v1/videos/{job['id']}")).json()
            assert seen["id"] == job["id"] and seen["seed"] == 11
            done = await until_status(hb, job["id"], "completed", 10)
            assert done["attempt"] == 1
            content = await hb.get(f"/v1/videos/{job['id']}/content")
            assert content.status_code == 200 and content.content == MP4
            listed = (await hb.get("/v1/videos")).json()
            assert [j["id"] for j in listed["data"]] == [job["id"]]
            assert _watched(b) == 0  # only the placing router watches
            await until(lambda: _watched(a) == 0)
            gone = await hb.delete(f"/v1/videos/{job['id']}")
            assert gone.status_code == 200
            assert (await ha.get(f"/v1/videos/{job['id']}")).status_code == 404

    run_in_context(scenario)


def test_a_client_that_leaves_mid_submit_leaves_a_watched_job() -> None:
    """The submission outlives its caller: a job a replica took is never orphaned."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(app, http)]:
            post = asyncio.create_task(http.post("/v1/videos", json=SLOW))
            await until(lambda: bool(stub.video_submits))
            post.cancel()
            await asyncio.gather(post, return_exceptions=True)
            await until(lambda: _watched(app) == 1)
            ((sent, _),) = stub.video_submits
            assert app.state.running.pool.members()[0].inflight == 1
            assert (await http.delete(f"/v1/videos/{sent.job_id}")).status_code == 200
            await until(lambda: _watched(app) == 0)

    run_in_context(scenario)


def test_a_job_no_replica_can_take_again_waits_queued_until_one_can() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx, 2) as replicas, routers(replicas) as [(app, http)]:
            job = await create(http, MEDIUM)
            owner = _holder(replicas, job["id"])
            (other,) = [s for s in replicas if s is not owner]
            other.video_max_queue = 0  # full: the re-run is refused, and tried each poll
            await until_status(http, job["id"], "in_progress")
            await owner.close()
            waiting = await until_status(http, job["id"], "queued")  # never a 404 meanwhile
            assert waiting["attempt"] == 1 and waiting["progress"] == 0
            listed = (await http.get("/v1/videos")).json()["data"]
            assert [(j["id"], j["status"]) for j in listed] == [(job["id"], "queued")]
            assert _watched(app) == 1
            other.video_max_queue = 8
            done = await until_status(http, job["id"], "completed", 10)
            assert done["attempt"] == 2 and done["replica"] == other.replica

    run_in_context(scenario)


def test_a_job_lost_on_its_third_attempt_is_given_up() -> None:
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        async with stubs(ctx) as [stub], routers([stub]) as [(app, http)]:
            job = await create(http, SLOW)
            for attempt in (1, 2, 3):
                await until(lambda: (stub.job(job["id"]) or _NONE).attempt == attempt, 10)  # noqa: B023
                stub.reboot()
            await until(lambda: _watched(app) == 0, 10)
            assert [s.attempt for s, _ in stub.video_submits] == [1, 2, 3]
            lost = await http.get(f"/v1/videos/{job['id']}")
            assert lost.status_code == 404
            assert "lost with the replica that ran it" in lost.json()["error"]["message"]

    run_in_context(scenario)


_NONE = video.VideoJob(
    id="", status="", created_at=0, width=0, height=0, num_frames=0, fps=0, seconds=0, seed=0,
    attempt=0,
)  # fmt: skip
