"""Video jobs that outlive their pods (docs/outputs.md, "Jobs that outlive their
pods"): the job records in the real S3 server of tests/storage/s3.py, their leases
raced by routers, and routers in process (the real app over httpx's ASGI transport)
against stub replicas (tests/stub_replica.py): a job whose router and replica are
both gone is answered by another router, taken over, run again and told once."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
import pytest
import zmq.asyncio

from dpserve.contract import protocol as p
from dpserve.contract import video as v
from dpserve.router import webhooks as wh
from dpserve.router.job_records import JobRecord, JobRecords
from dpserve.router.leases import Leases
from dpserve.sources.outstore import VideoObjects
from dpserve.sources.uri import S3Source
from tests.polling import until
from tests.storage.s3 import S3Server
from tests.stub_replica import JPEG, MP4, run_in_context
from tests.unit.test_router_videos import SLOW, create, routers, stubs, until_status
from tests.unit.test_webhooks import _settings, _verified
from tests.webhook_receiver import Receiver, receiving

pytestmark = [pytest.mark.e2e, pytest.mark.s3]
LONG = SLOW  # 2 s of the stub's steps
JOB = "video_" + "ab" * 16 + ".dGNwOi8vMTI3LjAuMC4xOjE.0badb00f"


def _record(lease_s: float = 60.0, **job: Any) -> JobRecord:
    fields = {"id": JOB, "status": v.QUEUED, "created_at": 1, "width": 64, "height": 64}
    fields |= {"num_frames": 9, "fps": 8, "seconds": 1.0, "seed": 7, "tenant": "team-a"}
    params = p.GenerateParams(prompt="a red kite", seed=[7], video=p.VideoSpec(num_frames=9))
    return JobRecord(
        job=v.VideoJob(**(fields | job)),
        params=params,
        holder="tcp://127.0.0.1:1",
        boot="0badb00f",
        router="gone",
        lease_until=time.time() + lease_s,
    )


def _keys(s3: S3Server, bucket: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def test_of_two_routers_taking_an_orphan_one_wins_and_the_loser_learns_it(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    bucket = s3_server.new_bucket("records")
    records = JobRecords(VideoObjects(S3Source(bucket, "p/")))
    records.create(_record(lease_s=-1), [b"an input image"])  # its router is gone
    assert records.active() == [JOB]

    async def race() -> tuple[list[JobRecord | None], Leases, Leases]:
        a, b = Leases(records, 30.0, me="a"), Leases(records, 30.0, me="b")
        other = Leases(records, 30.0, fleet="k8s:other/service")  # shares the bucket only
        assert (await other.orphans(), await other.lookup(JOB)) == ([], None)
        [orphan_a], [orphan_b] = await asyncio.gather(a.orphans(), b.orphans())
        taken = await asyncio.gather(a.take(orphan_a), b.take(orphan_b))
        return list(taken), a, b

    taken, a, b = asyncio.run(race())
    won = [t for t in taken if t is not None]
    assert len(won) == 1  # the conditional write lets one through
    winner, loser = (a, b) if taken[0] is not None else (b, a)
    stored = records.read(JOB)
    assert stored is not None and stored.record.router == winner.me
    assert stored.record.lease_until > time.time() + 20
    assert records.inputs(stored.record) == [b"an input image"]

    async def afterwards() -> tuple[bool, bool, list[Any], bool]:
        lost = await loser.note(stored.record.job)  # holds nothing: writes nothing
        running = msgspec.structs.replace(stored.record.job, status=v.IN_PROGRESS)
        kept = await winner.note(running)
        orphans = await loser.orphans()  # its lease is fresh: nobody's orphan
        # Someone else writes the record (a router that took it over): the winner's
        # next write is refused, and it stops holding the lease.
        current = records.read(JOB)
        assert current is not None
        records.replace(current, msgspec.structs.replace(current.record, lease_until=0.0))
        done = msgspec.structs.replace(running, status=v.COMPLETED)
        return lost, kept, orphans, await winner.note(done)

    lost, kept, orphans, after_theft = asyncio.run(afterwards())
    assert (lost, kept, orphans, after_theft) == (False, True, [], False)
    assert not winner.holds(JOB)

    async def stopping() -> tuple[int, list[Any]]:
        # A router that stops hands its leases over: the others need not wait them out.
        [orphan] = await winner.orphans()
        record = await winner.take(orphan)
        assert record is not None and winner.holds(JOB)
        return await winner.hand_over(), await loser.orphans()

    handed, orphans = asyncio.run(stopping())
    assert handed == 1 and [o.record.job.id for o in orphans] == [JOB]


def test_settled_jobs_leave_the_active_index_and_expire_with_their_objects(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    bucket = s3_server.new_bucket("records")
    objects = VideoObjects(S3Source(bucket, "p/"))
    records = JobRecords(objects)
    now = int(time.time())
    stored = records.create(_record(), [])
    objects.put(JOB, 1, "team-a", MP4, JPEG)
    done = _record(status=v.COMPLETED, completed_at=now, expires_at=now + 5)
    stored = records.replace(stored, msgspec.structs.replace(done, announced=True)) or stored
    records.settle(stored.record)
    assert records.active() == []
    assert records.expired(now) == []  # not due yet
    assert f"p/jobs/expires/{now + 5:011d}.{JOB}" in _keys(s3_server, bucket)
    assert records.expired(now + 5) == [JOB]

    async def expire() -> int:
        return await Leases(records, 30.0).expire()

    assert asyncio.run(expire()) == 0  # the index entry went with the first look
    records.remove(JOB, None)
    assert _keys(s3_server, bucket) == []


def test_a_job_whose_router_and_replica_are_gone_is_answered_rerun_and_told_once(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    """Router A places a job and goes; the replica that ran it is replaced (a new boot,
    no jobs). Router B, sharing only the store with A, answers the job from its
    record, takes its lease over, runs it again with the same parameters, and sends
    its one ``video.completed``; a delete then removes it from the store."""
    store = S3Source(s3_server.new_bucket("jobs"), "fleet/")

    async def scenario(ctx: zmq.asyncio.Context) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with receiving(Receiver()) as receiver:
            hook = _settings(receiver.url)
            async with (
                stubs(ctx, 2) as replicas,
                routers(replicas, output_s3=store, webhook=hook) as [(_, b)],
            ):
                async with routers(replicas, output_s3=store, webhook=hook) as [(_, a)]:
                    job = await create(a, LONG)
                    job_id = job["id"]
                    await until_status(a, job_id, "in_progress")
                owner = next(s for s in replicas if s.job(job_id) is not None)
                owner.reboot()
                first = await b.get(f"/v1/videos/{job_id}")  # no replica holds it
                seen["first"] = (first.status_code, first.json())
                seen["listed"] = [j["id"] for j in (await b.get("/v1/videos")).json()["data"]]
                seen["done"] = await until_status(b, job_id, "completed", 30)
                # Settled: told, out of the active index; nothing sends it again.
                records = JobRecords(VideoObjects(store))
                await until(lambda: len(receiver.got) >= 1 and records.active() == [], 10)
                seen["submits"] = [r for s in replicas for r, _ in s.video_submits]
                seen["content"] = (await b.get(f"/v1/videos/{job_id}/content")).content
                seen["deleted"] = (await b.delete(f"/v1/videos/{job_id}")).status_code
                seen["after"] = (await b.get(f"/v1/videos/{job_id}")).status_code
                seen["keys"] = _keys(s3_server, store.bucket)
            seen["events"] = list(receiver.got)
        seen["id"] = job_id
        return seen

    seen = run_in_context(scenario)
    job_id = seen["id"]
    status, first = seen["first"]
    assert status == 200 and first["status"] in ("queued", "in_progress"), first
    assert seen["listed"] == [job_id]  # listed too, from its record
    assert seen["done"]["attempt"] == 2
    first_run, rerun = sorted(seen["submits"], key=lambda r: r.attempt)
    assert (rerun.job_id, rerun.attempt, rerun.created_at) == (job_id, 2, first_run.created_at)
    assert rerun.params == first_run.params and rerun.params.seed == first_run.params.seed
    assert seen["content"] == MP4
    [event] = seen["events"]
    body = _verified(event)
    assert body["type"] == "video.completed" and body["data"] == {"id": job_id}
    assert body["id"] == wh.event_id(job_id, "video.completed")
    assert (seen["deleted"], seen["after"]) == (200, 404)
    assert seen["keys"] == []  # record, inputs and index: all gone


def test_a_job_uploaded_by_a_replica_that_died_before_saying_so_is_completed_not_rerun(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    store = S3Source(s3_server.new_bucket("jobs"), "")
    objects = VideoObjects(store)

    async def scenario(ctx: zmq.asyncio.Context) -> dict[str, Any]:
        with receiving(Receiver()) as receiver:
            hook = _settings(receiver.url)
            async with (
                stubs(ctx, 2) as replicas,
                routers(replicas, output_s3=store, webhook=hook) as [(_, http)],
            ):
                job = await create(http, LONG)
                await until_status(http, job["id"], "in_progress")
                owner = next(s for s in replicas if s.job(job["id"]) is not None)
                # Its upload landed, then the replica died before its record said so.
                objects.put(job["id"], 1, "", b"the uploaded mp4", b"its thumbnail")
                owner.reboot()
                done = await until_status(http, job["id"], "completed", 10)
                await until(lambda: len(receiver.got) == 1, 10)
                content = (await http.get(f"/v1/videos/{job['id']}/content")).content
                submits = sum(len(s.video_submits) for s in replicas)
                record = JobRecords(objects).read(job["id"])
        assert record is not None
        return {"done": done, "content": content, "submits": submits, "record": record.record}

    seen = run_in_context(scenario)
    assert seen["done"]["attempt"] == 1 and seen["submits"] == 1  # not run again
    assert seen["content"] == b"the uploaded mp4"
    record: JobRecord = seen["record"]
    assert record.job.status == v.COMPLETED and record.announced
    assert record.job.location.endswith("/1.{mp4,jpg}")
    assert json.loads(msgspec.json.encode(record.params))["seed"] == [seen["done"]["seed"]]


def test_a_stopping_routers_job_is_taken_over_where_it_runs_not_run_twice(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    """Router A places a job and stops (a roll): it hands its lease over, router B takes
    the job over at its next sweep and, its replica still running it, watches it there:
    one run, one event, from B."""
    store = S3Source(s3_server.new_bucket("jobs"), "")

    async def scenario(ctx: zmq.asyncio.Context) -> dict[str, Any]:
        with receiving(Receiver()) as receiver:
            hook = _settings(receiver.url)
            async with (
                stubs(ctx, 2) as replicas,
                routers(replicas, output_s3=store, webhook=hook) as [(_, b)],
            ):
                async with routers(replicas, output_s3=store, webhook=hook) as [(_, a)]:
                    job = await create(a, LONG)
                    await until_status(a, job["id"], "in_progress")
                done = await until_status(b, job["id"], "completed", 10)
                records = JobRecords(VideoObjects(store))
                await until(lambda: len(receiver.got) >= 1 and records.active() == [], 10)
                submits = sum(len(s.video_submits) for s in replicas)
            events = list(receiver.got)
        return {"done": done, "submits": submits, "events": events}

    seen = run_in_context(scenario)
    assert seen["done"]["attempt"] == 1 and seen["submits"] == 1  # never run twice
    [event] = seen["events"]  # from B, which took it over: A's watch ended with A
    assert _verified(event)["type"] == "video.completed"
