"""The replica's video job book: a job's record through its life, its files on disk,
and the bounds (TTL, bytes, records) that keep a long-running replica's disk in check."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpserve.contract import protocol as p
from dpserve.contract import video as v
from dpserve.worker.reply import Reply
from dpserve.worker.video_jobs import VideoBook

JOB = v.make_job_id("tcp://10.0.0.1:5555", "0123456789abcdef")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _params(seed: int = 7) -> p.GenerateParams:
    spec = p.VideoSpec(num_frames=9, seconds=0.5, fps=16)
    return p.GenerateParams(prompt="a cat", width=64, height=48, seed=[seed], video=spec)


def _done(job_id: str, video: bytes = b"mp4-bytes", thumb: bytes = b"jpg") -> Reply:
    result = v.VideoResult(
        replica=0, width=64, height=48, num_frames=9, fps=16, seed=7, queue_time_s=0.5,
        inference_time_s=2.0, encode_time_s=0.1, peak_memory_mb=1.0,
    )  # fmt: skip
    return Reply(p.RESULT, job_id, result, (video, thumb))


def _book(tmp_path: Path, clock: Clock, **kw: int) -> VideoBook:
    return VideoBook(tmp_path, ttl_s=60.0, max_bytes=kw.pop("max_bytes", 1000), replica=3,
                     clock=clock, **kw)  # fmt: skip


def test_a_job_goes_from_queued_to_completed_with_its_files(tmp_path: Path) -> None:
    clock = Clock()
    book = _book(tmp_path, clock)
    job = book.submit(JOB, _params(), created_at=123, attempt=2)
    assert (job.status, job.created_at, job.attempt, job.replica) == (v.QUEUED, 123, 2, 3)
    assert (job.num_frames, job.fps, job.seed, job.width) == (9, 16, 7, 64)
    with pytest.raises(p.RequestError) as early:
        book.content(JOB, v.VIDEO_VARIANT)
    assert early.value.status == 409 and "queued (0%)" in str(early.value)
    book.started(JOB)
    book.answer(Reply(p.PARTIAL, JOB, v.VideoProgress(step=2, steps=4)))
    running = book.get(JOB)
    assert (running.status, running.progress) == (v.IN_PROGRESS, 47)
    clock.now += 5
    book.answer(_done(JOB))
    done = book.get(JOB)
    assert (done.status, done.progress, done.bytes) == (v.COMPLETED, 100, 9)
    assert done.completed_at == int(clock.now) and done.expires_at == int(clock.now + 60)
    assert (done.inference_time_s, done.encode_time_s) == (2.0, 0.1)
    meta, data = book.content(JOB, v.VIDEO_VARIANT)
    assert (meta.media_type, data) == ("video/mp4", b"mp4-bytes")
    assert book.content(JOB, v.THUMBNAIL)[1] == b"jpg"
    assert sorted(f.suffix for f in tmp_path.iterdir()) == [".jpg", ".mp4"]


def test_unknown_variant_deleted_and_expired_jobs_say_why(tmp_path: Path) -> None:
    clock = Clock()
    book = _book(tmp_path, clock)
    book.submit(JOB, _params(), 0, 1)
    book.answer(_done(JOB))
    with pytest.raises(p.RequestError) as bad:
        book.content(JOB, "spritesheet")
    assert bad.value.status == 400 and "video, thumbnail" in str(bad.value)
    assert book.delete(JOB).status == v.COMPLETED
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(p.RequestError) as gone:
        book.get(JOB)
    assert gone.value.code == p.NOT_FOUND and "was deleted" in str(gone.value)
    other = JOB.replace(JOB[6:10], "ffff")
    book.submit(other, _params(), 0, 1)
    book.answer(_done(other))
    clock.now += 61
    book.prune()
    with pytest.raises(p.RequestError) as expired:
        book.get(other)
    assert "expired (--video-ttl)" in str(expired.value)
    assert list(tmp_path.iterdir()) == []


def test_a_deleted_running_job_is_cancelled_and_its_late_answer_dropped(tmp_path: Path) -> None:
    book = _book(tmp_path, Clock())
    book.submit(JOB, _params(), 0, 1)
    book.started(JOB)
    assert book.delete(JOB).status == v.CANCELLED
    book.answer(_done(JOB))  # the gang finished before it saw the cancel
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(p.RequestError):
        book.get(JOB)


def test_errors_become_failed_or_cancelled(tmp_path: Path) -> None:
    book = _book(tmp_path, Clock())
    ids = [JOB.replace(JOB[6:10], f"{i:04x}") for i in range(2)]
    for job_id in ids:
        book.submit(job_id, _params(), 0, 1)
    book.answer(Reply.error(ids[0], p.RequestError(p.CANCELLED, "stop")))
    book.answer(Reply.error(ids[1], p.RequestError(p.INTERNAL, "boom")))
    cancelled, failed = (book.get(i) for i in ids)
    assert cancelled.status == v.CANCELLED and cancelled.error is not None
    assert failed.status == v.FAILED and failed.error == v.VideoError(
        code="internal", message="boom"
    )
    assert [j.id for j in book.list().jobs] == ids[::-1]  # newest first


def test_bytes_bound_drops_the_oldest_video_and_refuses_one_too_big(tmp_path: Path) -> None:
    clock = Clock()
    book = _book(tmp_path, clock, max_bytes=25)
    ids = [JOB.replace(JOB[6:10], f"{i:04x}") for i in range(3)]
    for job_id in ids:
        book.submit(job_id, _params(), 0, 1)
    book.answer(_done(ids[0], b"x" * 10))
    book.answer(_done(ids[1], b"y" * 10))
    book.answer(_done(ids[2], b"z" * 10))  # 30 > 25: the oldest goes
    with pytest.raises(p.RequestError) as evicted:
        book.get(ids[0])
    assert "--video-max-bytes" in str(evicted.value)
    assert book.get(ids[2]).status == v.COMPLETED
    huge = JOB.replace(JOB[6:10], "9999")
    book.submit(huge, _params(), 0, 1)
    book.answer(_done(huge, b"h" * 26))
    failed = book.get(huge)
    assert failed.status == v.FAILED and failed.error is not None
    assert "more than this replica keeps" in failed.error.message


def test_records_are_bounded_oldest_finished_first(tmp_path: Path) -> None:
    book = _book(tmp_path, Clock(), max_records=2)
    ids = [JOB.replace(JOB[6:10], f"{i:04x}") for i in range(3)]
    book.submit(ids[0], _params(), 0, 1)
    book.answer(Reply.error(ids[0], p.RequestError(p.INTERNAL, "x")))
    book.submit(ids[1], _params(), 0, 1)
    book.submit(ids[2], _params(), 0, 1)
    assert [j.id for j in book.list().jobs] == [ids[2], ids[1]]


def test_a_temporary_folder_is_removed_at_close() -> None:
    book = VideoBook(None, ttl_s=1.0, max_bytes=10, replica=0)
    assert book.root.is_dir()
    book.close()
    assert not book.root.exists()


def test_a_job_keeps_its_estimate_and_is_stopped_once_it_runs_past_its_bound(
    tmp_path: Path,
) -> None:
    clock = Clock()
    book = _book(tmp_path, clock)
    queued = book.submit(JOB, _params(), 0, 1, estimated_s=12.34567, max_run_s=30.0)
    assert queued.estimated_time_s == 12.346
    clock.now += 100  # queued time does not count: the bound is on its run
    assert book.overdue() == ()
    book.started(JOB)
    clock.now += 29
    assert book.overdue() == ()
    clock.now += 2
    assert book.overdue() == (JOB,)  # the caller stops it at the next denoising step
    assert book.overdue() == ()  # once
    assert book.get(JOB).status == v.IN_PROGRESS  # until the gang stops
    stop = p.RequestError(p.CANCELLED, f"request {JOB} was cancelled")
    book.answer(Reply.error(JOB, stop))
    failed = book.get(JOB)
    assert failed.status == v.FAILED and failed.error is not None
    assert failed.error.code == p.DEADLINE_EXCEEDED
    assert "bound of 30s" in failed.error.message
    assert "--video-max-estimate" in failed.error.message


def test_a_job_past_its_bound_in_its_last_decode_completes(tmp_path: Path) -> None:
    """No denoising step is left to stop at: the video is made, and kept."""
    clock = Clock()
    book = _book(tmp_path, clock)
    book.submit(JOB, _params(), 0, 1, max_run_s=5.0)
    book.started(JOB)
    clock.now += 6
    assert book.overdue() == (JOB,)
    book.answer(_done(JOB))
    assert book.get(JOB).status == v.COMPLETED


def test_a_job_without_a_bound_or_an_estimate_runs_on(tmp_path: Path) -> None:
    clock = Clock()
    book = _book(tmp_path, clock)
    assert book.submit(JOB, _params(), 0, 1).estimated_time_s is None
    book.started(JOB)
    clock.now += 10**6
    assert book.overdue() == ()
    book.answer(Reply.error(JOB, p.RequestError(p.CANCELLED, "cancelled")))
    assert book.get(JOB).status == v.CANCELLED  # a plain cancel stays one
