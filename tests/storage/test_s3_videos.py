"""``--output-store s3://…`` for videos: the replica uploads a finished video and its
thumbnail before the job says completed, routers serve them from the bucket (after
the replica is gone too), and delete and expiry remove them (docs/outputs.md, "Videos").

The store is the real server of tests/storage/s3.py, reached the way users configure
it (the ``AWS_*`` variables). The book and the router run in process here; the
journey through ``dpserve serve`` with the tiny video model is the last test.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq.asyncio

from dpserve.contract import video as v
from dpserve.plumbing.ports import free_port
from dpserve.router.tenants import TenantKey
from dpserve.sources.outstore import VideoObjects
from dpserve.sources.uri import S3Source
from dpserve.worker.video_jobs import VideoBook
from tests.polling import eventually
from tests.servers import ServeProcess
from tests.storage.s3 import S3Server
from tests.stub_replica import StubReplica
from tests.unit.test_router_images import _apps
from tests.unit.test_video_book import JOB, Clock, _done, _params

pytestmark = [pytest.mark.e2e, pytest.mark.s3]
MP4, JPG = b"\x00\x00\x00\x18ftypisom-a video", b"\xff\xd8\xff-a thumbnail"


def _keys(s3: S3Server, bucket: str, prefix: str = "") -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def _wait_status(book: VideoBook, status: str) -> v.VideoJob:
    return eventually(lambda: (j := book.get(JOB)).status == status and j, 30, status, 0.02)


# ---------------------------------------------------------------- the replica's book


def test_a_job_is_completed_only_once_its_objects_are_in_the_store(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket("videos")
    clock = Clock()
    objects = VideoObjects(S3Source(bucket, "fleet/"))
    book = VideoBook(tmp_path, 60.0, 1 << 20, 0, clock=clock, objects=objects)
    try:
        book.submit(JOB, _params(), 0, 2, tenant="team-a")
        book.answer(_done(JOB, MP4, JPG))
        done = _wait_status(book, v.COMPLETED)
        keys = [f"fleet/videos/{JOB}/2.jpg", f"fleet/videos/{JOB}/2.mp4"]
        assert _keys(s3_server, bucket) == keys  # there before the record said completed
        assert done.location == f"s3://{bucket}/fleet/videos/{JOB}/2.{{mp4,jpg}}"
        assert list(tmp_path.iterdir()) == []  # not on the replica's disk
        head = s3_server.client().head_object(Bucket=bucket, Key=keys[1])
        assert head["Metadata"] == {"tenant": "team-a"}
        assert head["ContentType"] == "video/mp4"
        assert book.content(JOB, v.VIDEO_VARIANT)[1] == MP4
        assert book.content(JOB, v.THUMBNAIL)[1] == JPG
        # Expiry (--video-ttl) removes them, as it removes files.
        clock.now += 61
        book.prune()
        eventually(lambda: _keys(s3_server, bucket) == [], 10, "the objects to go", 0.05)
        # So does a delete.
        book.submit(JOB, _params(), 0, 3, tenant="team-a")
        book.answer(_done(JOB, MP4, JPG))
        _wait_status(book, v.COMPLETED)
        assert len(_keys(s3_server, bucket)) == 2
        book.delete(JOB)
        eventually(lambda: _keys(s3_server, bucket) == [], 10, "the objects to go", 0.05)
    finally:
        book.close()


def test_a_store_that_stays_down_fails_the_job_saying_so_never_completed(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port('127.0.0.1')}")
    slept: list[float] = []
    objects = VideoObjects(S3Source("videos", ""), sleep=slept.append)
    book = VideoBook(tmp_path, 60.0, 1 << 20, 0, objects=objects)
    try:
        book.submit(JOB, _params(), 0, 1)
        book.answer(_done(JOB, MP4, JPG))
        failed = _wait_status(book, v.FAILED)
    finally:
        book.close()
    assert failed.error is not None and failed.error.code == "unavailable"
    message = failed.error.message
    assert "could not be stored" in message and "s3://videos/" in message
    assert "did not answer" in message
    assert slept == [1.0, 2.0]  # tried three times, then gave up
    assert failed.location == ""


# ---------------------------------------------------------------- routers


A, B = "sk-team-a", "sk-team-b"
KEYS: dict[str, Any] = {"api_keys": (TenantKey(A, "team-a"), TenantKey(B, "team-b"))}


def test_a_router_serves_and_deletes_a_stored_video_whose_owner_is_gone(
    s3_server: S3Server, aws_env: dict[str, str]
) -> None:
    """The objects a replica uploaded, its job unknown to every replica (its owner is
    gone): content comes from the store, another tenant gets the 404 an unknown id
    gets, and delete removes the objects."""
    bucket = s3_server.new_bucket("videos")
    store = S3Source(bucket, "p/")
    VideoObjects(store).put(JOB, 1, "team-a", MP4, JPG)

    async def scenario() -> dict[str, httpx.Response]:
        ctx = zmq.asyncio.Context()
        stub = StubReplica(ctx)
        try:
            async with _apps(stub, output_s3=store, **KEYS) as [(_, http)]:
                url = f"/v1/videos/{JOB}"
                got = {
                    "video": await http.get(f"{url}/content", headers=_as(A)),
                    "thumb": await http.get(f"{url}/content?variant=thumbnail", headers=_as(A)),
                    "other": await http.get(f"{url}/content", headers=_as(B)),
                    "other_delete": await http.delete(url, headers=_as(B)),
                }
                got["sdk"] = await _sdk_download(http, JOB)
                got["delete"] = await http.delete(url, headers=_as(A))
                got["after"] = await http.get(f"{url}/content", headers=_as(A))
                return got
        finally:
            await stub.close()
            ctx.term()

    got = asyncio.run(scenario())
    assert got["video"].status_code == 200 and got["video"].content == MP4
    assert got["video"].headers["content-type"] == "video/mp4"
    assert got["thumb"].content == JPG and got["thumb"].headers["content-type"] == "image/jpeg"
    assert got["sdk"].content == MP4
    assert got["other"].status_code == 404 and got["other_delete"].status_code == 404
    assert got["other"].json()["error"] == got["after"].json()["error"]  # an unknown id's
    assert got["delete"].status_code == 200 and got["delete"].json()["deleted"] is True
    assert _keys(s3_server, bucket) == []


async def _sdk_download(http: httpx.AsyncClient, job_id: str) -> httpx.Response:
    client = openai.AsyncOpenAI(
        api_key=A,
        base_url="http://localhost/v1",
        http_client=httpx.AsyncClient(transport=http._transport, timeout=30),
        max_retries=0,
    )
    with pytest.warns(DeprecationWarning):  # OpenAI shut its own video API down
        content = await client.videos.download_content(job_id)
    return content.response


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- dpserve serve


JOB_BODY: dict[str, Any] = {"prompt": "a paper boat", "size": "64x48", "num_frames": 5}
EXTRA = {"seed": 7, "num_inference_steps": 2, "fps": 8}


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_serve_stores_a_video_that_outlives_its_replica(
    s3_server: S3Server, aws_env: dict[str, str], tiny_video_model: Path
) -> None:
    bucket = s3_server.new_bucket("videos")
    store = ("--output-store", f"s3://{bucket}/serve")
    with ServeProcess(tiny_video_model, 1, *store, timeout_s=120) as serve:
        http = serve.http
        sdk = openai.OpenAI(api_key="x", base_url=f"{serve.url}/v1", max_retries=0)
        made = http.post("/v1/videos", json={**JOB_BODY, **EXTRA})
        assert made.status_code == 200, made.text
        job_id = made.json()["id"]
        done = eventually(
            lambda: (j := http.get(f"/v1/videos/{job_id}").json())["status"] == "completed" and j,
            60,
            "the job to complete",
            0.05,
        )
        first = http.get(f"/v1/videos/{job_id}/content")
        folder = f"serve/videos/{job_id}/"
        assert _keys(s3_server, bucket, folder) == [
            f"{folder}{n}" for n in ("1.jpg", "1.mp4", "job.json")
        ]
        keys = [f"{folder}1.jpg", f"{folder}1.mp4"]
        stored = [s3_server.client().get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys]
        assert sdk.videos.download_content(job_id).content == stored[1] == first.content
        thumb = sdk.videos.download_content(job_id, variant="thumbnail").content
        assert thumb == stored[0] and thumb.startswith(b"\xff\xd8")
        assert done["status"] == "completed" and stored[1][4:8] == b"ftyp"
        # The replica that made it is killed: the video is still there.
        replica = serve.replica_supervisor(0)
        for proc in [*replica.children(recursive=True), replica]:
            os.kill(proc.pid, signal.SIGKILL)
        again = http.get(f"/v1/videos/{job_id}/content")
        assert again.status_code == 200 and again.content == stored[1]
        deleted = http.delete(f"/v1/videos/{job_id}")
        assert deleted.status_code == 200, deleted.text
        assert _keys(s3_server, bucket) == []


def test_serve_refuses_a_video_job_it_cannot_keep_in_the_store(
    s3_server: S3Server, aws_env: dict[str, str], tiny_video_model: Path
) -> None:
    """A bucket the store does not have: the job's record cannot be kept, so the job
    is refused with a 503 naming the store and its error (a job the store does not
    hold would not outlive its router), and no replica runs it."""
    store = ("--output-store", "s3://no-such-bucket/serve")
    with ServeProcess(tiny_video_model, 1, *store, timeout_s=120) as serve:
        made = serve.http.post("/v1/videos", json={**JOB_BODY, **EXTRA})
        assert made.status_code == 503, made.text
        message = made.json()["error"]["message"]
        assert "not kept" in message and "s3://no-such-bucket/serve/" in message
        assert "NoSuchBucket" in message
        assert serve.http.get("/v1/videos").json()["data"] == []  # taken back from its replica
