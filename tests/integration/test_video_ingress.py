"""The driver's ingress with video jobs (a real ROUTER socket; this test plays the gang
loop): every action is answered at once, a submit is checked with the replica's own
limits and queues the job's generation, the gang's answers reach the job book, and a
delete stops a running job at its next step."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract import video as v
from dpserve.contract.protocol import AdapterReport
from dpserve.worker.commands import GangStatus
from dpserve.worker.driver import Driver
from dpserve.worker.driver.outbox import Jobs
from dpserve.worker.driver.read_ahead import ReadAhead
from dpserve.worker.edit import EditSupport
from dpserve.worker.features import Features, VideoSupport
from dpserve.worker.paths import AllowedPaths
from dpserve.worker.reply import Reply
from dpserve.worker.video_jobs import VideoBook
from tests.polling import eventually
from tests.workers import free_port

LIMITS = pv.Limits(size_factor=16, min_side=16, max_frames=17, frame_factor=4, default_frames=9)


@pytest.fixture()
def front(tmp_path: Path) -> Iterator[Driver]:
    book = VideoBook(tmp_path, ttl_s=60.0, max_bytes=1 << 20, replica=1)
    ingress = Driver(f"tcp://127.0.0.1:{free_port()}", 1, LIMITS, GangStatus(), 2, 120.0, 2,
                      videos=book)  # fmt: skip
    ingress.start()
    try:
        yield ingress
    finally:
        ingress.close()


def _submit(
    client: ReplicaClient,
    job_id: str,
    blobs: list[bytes] | None = None,
    max_run_s: float | None = None,
    **fields: Any,
) -> p.Message:
    body = {"prompt": "a cat", "width": 64, "height": 48, "seed": 5, **fields}
    body = {k: value for k, value in body.items() if value is not None}
    params = v.parse_video(body, pv.Limits(), blobs=1 if blobs else 0)
    request = v.VideoRequest(
        action=v.SUBMIT, job_id=job_id, params=params, created_at=99, max_run_s=max_run_s
    )
    return client.call(p.VIDEO, request, blobs=blobs or [])


def _ask(client: ReplicaClient, action: str, job_id: str = "", **kw: Any) -> p.Message:
    return client.call(p.VIDEO, v.VideoRequest(action=action, job_id=job_id, **kw))


def _refused(call: Callable[[], object]) -> p.RequestError:
    with pytest.raises(p.RequestError) as refused:
        call()
    return refused.value


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    return buf.getvalue()


def test_submit_get_run_content_and_delete(front: Driver) -> None:
    job_id = v.make_job_id(front.endpoint, "0123456789abcdef")
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        job: v.VideoJob = _submit(client, job_id, seconds="1").body_as(v.VideoJob)
        assert (job.status, job.num_frames, job.fps, job.seed, job.created_at) == (
            v.QUEUED, 17, 16, 5, 99,
        )  # fmt: skip
        assert front.scheduler.work.qsize() == 1 and front.admission.ping().queue_depth == 1
        [work] = front.scheduler.next_batch(timeout=0)
        assert isinstance(work.to, Jobs) and work.command.batch[0].params.video is not None
        assert _ask(client, v.GET, job_id).body_as(v.VideoJob).status == v.IN_PROGRESS
        front.outbox.answer(work.to, Reply(p.PARTIAL, job_id, v.VideoProgress(step=1, steps=2)))
        assert _ask(client, v.GET, job_id).body_as(v.VideoJob).progress == 47
        assert _refused(lambda: _ask(client, v.CONTENT, job_id)).status == 409
        result = v.VideoResult(replica=1, width=64, height=48, num_frames=17, fps=16, seed=5,
                               queue_time_s=0, inference_time_s=1, encode_time_s=0,
                               peak_memory_mb=0)  # fmt: skip
        front.scheduler.finished([Reply(p.RESULT, job_id, result, (b"MP4", b"JPG"))])
        content = _ask(client, v.CONTENT, job_id, variant=v.THUMBNAIL)
        assert content.body_as(v.VideoContent).media_type == "image/jpeg"
        assert content.blobs == (b"JPG",)
        listed = _ask(client, v.LIST).body_as(v.VideoList)
        assert [(j.id, j.status) for j in listed.jobs] == [(job_id, v.COMPLETED)]
        assert _ask(client, v.DELETE, job_id).body_as(v.VideoJob).status == v.COMPLETED
        assert _refused(lambda: _ask(client, v.GET, job_id)).code == p.NOT_FOUND


def test_a_delete_stops_the_running_job_at_its_next_step(front: Driver) -> None:
    job_id = v.make_job_id(front.endpoint, "0123456789abcdef")
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        _submit(client, job_id)
        front.scheduler.next_batch(timeout=0)
        assert front.scheduler.halt() is None
        assert _ask(client, v.DELETE, job_id).body_as(v.VideoJob).status == v.CANCELLED
        stop = front.scheduler.halt()  # the gang's next denoising step
        assert stop is not None and stop.code == p.CANCELLED
        front.scheduler.finished([Reply.error(job_id, stop)])  # answered to the book: dropped


def test_a_job_without_a_size_gets_the_models_default_size_from_the_start(
    front: Driver,
) -> None:
    """The size the pipeline makes when given none (the cost model's default), in the
    record from the submit on, and in what the gang is asked to make."""
    front.status.calibration.configure(p.CostReport(default_width=96, default_height=64))
    job_id = v.make_job_id(front.endpoint, "0123456789abcdef")
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        job = _submit(client, job_id, width=None, height=None).body_as(v.VideoJob)
        assert (job.width, job.height) == (96, 64)
        [work] = front.scheduler.next_batch(timeout=0)
        params = work.command.batch[0].params
        assert (params.width, params.height) == (96, 64)
        other = v.make_job_id(front.endpoint, "0123456789abcdef")
        half = _submit(client, other, height=None).body_as(v.VideoJob)  # one side alone
        assert (half.width, half.height) == (64, 64)


def test_a_job_that_runs_past_its_bound_is_stopped_and_says_why(front: Driver) -> None:
    job_id = v.make_job_id(front.endpoint, "0123456789abcdef")
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        _submit(client, job_id, max_run_s=0.3)
        front.scheduler.next_batch(timeout=0)
        assert front.scheduler.halt() is None
        stop = None
        deadline = time.monotonic() + 10
        while stop is None and time.monotonic() < deadline:  # the gang's denoising steps
            time.sleep(0.05)
            stop = front.scheduler.halt()
        assert stop is not None and stop.code == p.CANCELLED
        front.scheduler.finished([Reply.error(job_id, stop)])
        job = _ask(client, v.GET, job_id).body_as(v.VideoJob)
        assert job.status == v.FAILED and job.error is not None
        assert job.error.code == p.DEADLINE_EXCEEDED and "bound of 0.3s" in job.error.message


def test_bad_jobs_are_refused_before_they_queue(front: Driver) -> None:
    job_id = v.make_job_id(front.endpoint, "0123456789abcdef")
    with ReplicaClient(front.endpoint, timeout_s=5) as client:
        too_long = _refused(lambda: _submit(client, job_id, num_frames=21))
        assert too_long.status == 400 and "1 to 17" in str(too_long)
        odd = _refused(lambda: _submit(client, job_id, width=60))
        assert odd.status == 400 and "multiple of 16" in str(odd)
        not_image = _refused(lambda: _submit(client, job_id, blobs=[b"not an image"]))
        assert not_image.status == 400 and "input_reference" in str(not_image)
        no_i2v = _refused(lambda: _submit(client, job_id, blobs=[_png()]))
        assert no_i2v.status == 400 and "from text only" in str(no_i2v)
        bad_id = _refused(lambda: _submit(client, "video_nope"))
        assert bad_id.status == 400
        unknown = _refused(lambda: _ask(client, "remix", job_id))
        assert unknown.status == 400 and "submit, get" in str(unknown)
        assert front.scheduler.work.qsize() == 0
        for i in range(2):  # the queue holds 2
            other = v.make_job_id(front.endpoint, "0123456789abcdef")
            assert _submit(client, other).kind == p.RESULT, i
        full = _refused(lambda: _submit(client, job_id))
        assert full.code == p.OVERLOADED
        assert _refused(lambda: _ask(client, v.GET, job_id)).code == p.NOT_FOUND  # withdrawn


def test_an_image_model_refuses_jobs_and_lists_none() -> None:
    ingress = Driver(f"tcp://127.0.0.1:{free_port()}", 0, pv.Limits(), GangStatus(), 2, 120.0, 2)
    ingress.start()
    try:
        job_id = v.make_job_id(ingress.endpoint, "0123456789abcdef")
        with ReplicaClient(ingress.endpoint, timeout_s=5) as client:
            refused = _refused(lambda: _submit(client, job_id))
            assert refused.status == 400 and "/v1/images/generations" in str(refused)
            assert _ask(client, v.LIST).body_as(v.VideoList).jobs == []
            assert _refused(lambda: _ask(client, v.GET, job_id)).code == p.NOT_FOUND
    finally:
        ingress.close()


def test_an_image_to_video_model_needs_its_image(tmp_path: Path) -> None:
    i2v = VideoSupport(max_frames=17, frame_factor=4, default_frames=9, image_to_video=True,
                       text_to_video=False)  # fmt: skip
    features = Features(edit=EditSupport(False, False, 0), partial_images=0, video=i2v)
    book = VideoBook(tmp_path, ttl_s=60.0, max_bytes=1 << 20, replica=0)
    ingress = Driver(f"tcp://127.0.0.1:{free_port()}", 0, LIMITS, GangStatus(), 2, 120.0, 2,
                      features=features, videos=book)  # fmt: skip
    ingress.start()
    try:
        job_id = v.make_job_id(ingress.endpoint, "0123456789abcdef")
        with ReplicaClient(ingress.endpoint, timeout_s=5) as client:
            refused = _refused(lambda: _submit(client, job_id))
            assert refused.status == 400 and "from an image" in str(refused)
            job = _submit(client, job_id, blobs=[_png()]).body_as(v.VideoJob)
            assert job.status == v.QUEUED
            [work] = ingress.scheduler.next_batch(timeout=0)
            assert work.command.blobs == [_png()]  # the image goes to the gang with the job
    finally:
        ingress.close()


def test_a_job_naming_an_adapter_the_gang_lacks_has_its_files_read_ahead(tmp_path: Path) -> None:
    """A queued video job's adapter starts into the page cache as a generation's does
    (docs/lora.md, Read-ahead): the gang's load at its turn reads memory, not disk."""
    adapter = tmp_path / "model" / "ink"
    adapter.mkdir(parents=True)
    (adapter / "pytorch_lora_weights.safetensors").write_bytes(b"x" * 4096)
    status = GangStatus(adapters=AdapterReport(resident=["held"]))
    reader = ReadAhead(AllowedPaths.of(tmp_path / "model"))
    book = VideoBook(tmp_path / "jobs", ttl_s=60.0, max_bytes=1 << 20, replica=0)
    ingress = Driver(f"tcp://127.0.0.1:{free_port()}", 0, LIMITS, status, 2, 120.0, 2,
                      videos=book, read_ahead=reader)  # fmt: skip
    ingress.start()
    try:
        with ReplicaClient(ingress.endpoint, timeout_s=5) as client:
            held = {"name": "held", "path": str(adapter)}
            _submit(client, v.make_job_id(ingress.endpoint, "0" * 16), lora=held)
            _submit(client, v.make_job_id(ingress.endpoint, "1" * 16),
                    lora={"name": "ink", "path": str(adapter)})  # fmt: skip
            eventually(lambda: reader.folders == 1, timeout_s=10, poll_s=0.01)
    finally:
        ingress.close()
    assert reader.read_bytes == 4096  # the held adapter's job read nothing
