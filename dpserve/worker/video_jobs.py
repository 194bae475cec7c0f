"""The replica's video job book: each job's record, and the finished files on disk.

The driver owns it (dpserve/contract/video.py says why jobs live on their replica). The
socket thread reads it and submits, deletes and lists (worker/driver/video_desk.py); the
gang loop's thread reports through it (started, progress, the output rank's answer,
handed over as values by the output path: worker/driver/outbox.py). One lock covers
the records; files are written before a record says ``completed``, so a reader
never sees a completed job without its file.

Kept within bounds: a finished job's record and files go ``ttl_s`` after it
finished; past ``max_bytes`` of files the oldest finished videos go first; a video
bigger than the bound, or than one reply frame may carry, fails its job instead.
At most ``max_records`` records are kept (the oldest finished go first). A deleted
or expired id is remembered (``max_records`` of them), so the router that placed
the job can tell "gone for good" from "the owner lost it" (router/videos.py).

With an output store (``objects``: the worker's ``--output-store s3://…``) a finished
video and its thumbnail go to the bucket instead of the disk, so they outlive this
replica: uploaded off the gang loop's thread (one uploader thread), tried a bounded
number of times, and only then is the job ``completed``, its record naming where
they are (``location``); a store that stays down fails the job with the store's
error. Deleting or expiring the job removes its objects (the same thread, after).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import video as v
from dpserve.contract.owners import may_see
from dpserve.worker.reply import Reply

if TYPE_CHECKING:
    from dpserve.sources.outstore import VideoObjects

log = logging.getLogger(__name__)

# Progress up to the last denoising step; decoding and encoding take the rest.
_DENOISE_SHARE: Final = 95
_PRUNE_EVERY_S: Final = 5.0
MAX_RECORDS: Final = 4096


@dataclass
class _Entry:
    job: v.VideoJob
    finished_at: float | None = None  # unix seconds; when it reached a terminal status
    files: tuple[Path, Path] | None = None  # mp4, thumbnail: a completed job's
    max_run_s: float | None = None  # run time after which it is stopped (None: no bound)
    started_at: float | None = None  # unix seconds; when the gang took it
    overran: bool = False  # it ran past max_run_s: its stop is that bound's doing


class VideoBook:
    def __init__(
        self,
        root: Path | None,
        ttl_s: float,
        max_bytes: int,
        replica: int,
        max_records: int = MAX_RECORDS,
        clock: Callable[[], float] = time.time,
        objects: VideoObjects | None = None,
    ) -> None:
        """``root`` None: a temporary folder, removed by :meth:`close`; ``objects``:
        the output store finished videos go to (None: ``root``)."""
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="dpserve-videos-")) if root is None else root
        self.root.mkdir(parents=True, exist_ok=True)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.replica = replica
        self.max_records = max_records
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # in submission order
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> why it is not held
        self._pruned_at = 0.0
        self.objects = objects
        # The store's calls, in order, off the gang loop and the socket thread.
        self._uploader = (
            ThreadPoolExecutor(1, thread_name_prefix="video-store") if objects else None
        )

    # ------------------------------------------------------------ socket thread

    def submit(
        self,
        job_id: str,
        params: p.GenerateParams,
        created_at: int,
        attempt: int,
        estimated_s: float | None = None,
        max_run_s: float | None = None,
        tenant: str = "",
    ) -> v.VideoJob:
        """Record a job the driver queues; ``params`` resolved (size, frames, seed);
        ``estimated_s`` the router's estimate of its run time, ``max_run_s`` the run
        time after which :meth:`overdue` stops it; ``tenant`` its owner."""
        spec = params.video
        assert spec is not None and spec.num_frames and spec.fps and params.seed
        job = v.VideoJob(
            id=job_id,
            status=v.QUEUED,
            created_at=created_at or int(self.clock()),
            prompt=params.prompt,
            width=params.width or 0,
            height=params.height or 0,
            num_frames=spec.num_frames,
            fps=spec.fps,
            seconds=spec.seconds or 0.0,
            seed=params.seed[0],
            num_inference_steps=params.num_inference_steps,
            replica=self.replica,
            attempt=attempt,
            estimated_time_s=None if estimated_s is None else round(estimated_s, 3),
            tenant=tenant,
        )
        with self._lock:
            self._gone.pop(job_id, None)
            self._entries[job_id] = _Entry(job, max_run_s=max_run_s)
            self._trim_records()
            return _copy(job)

    def withdraw(self, job_id: str) -> None:
        """Forget a job the queue refused right after :meth:`submit`."""
        with self._lock:
            self._entries.pop(job_id, None)

    def holds(self, job_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(job_id)
            return entry is not None and entry.job.status not in v.TERMINAL

    def get(self, job_id: str, scope: str | None = None) -> v.VideoJob:
        """``scope``: whose jobs the caller sees (dpserve/contract/owners.py); here and
        below, another tenant's job is not found, as an unknown id is."""
        with self._lock:
            return _copy(self._entry(job_id, scope).job)

    def list(self, scope: str | None = None) -> v.VideoList:
        with self._lock:
            entries = reversed(self._entries.values())
            jobs = [_copy(e.job) for e in entries if may_see(scope, e.job.tenant)]
        return v.VideoList(jobs=jobs)

    def content(
        self, job_id: str, variant: str, scope: str | None = None
    ) -> tuple[v.VideoContent, bytes]:
        if variant not in v.MEDIA_TYPES:
            offered = ", ".join(v.MEDIA_TYPES)
            raise p.RequestError(
                p.INVALID_REQUEST,
                f"variant {variant!r} is not offered; variants: {offered}",
                [p.FieldError("variant", f"must be one of {offered}")],
            )
        with self._lock:
            entry = self._entry(job_id, scope)
            if entry.job.status != v.COMPLETED or (entry.files is None and not entry.job.location):
                raise p.RequestError(p.CONFLICT, _unfinished(entry.job))
            if entry.files is not None:
                path = entry.files[0 if variant == v.VIDEO_VARIANT else 1]
                # Read under the lock: a prune or delete cannot remove it half-read.
                data = path.read_bytes()
        if entry.files is None:
            data = self._stored(job_id, variant)
        return v.VideoContent(id=job_id, variant=variant, media_type=v.MEDIA_TYPES[variant]), data

    def owned(self, job_id: str, scope: str | None) -> None:
        """Raises not found unless the job is here and ``scope`` sees it."""
        with self._lock:
            self._entry(job_id, scope)

    def delete(self, job_id: str, scope: str | None = None) -> v.VideoJob:
        """Forget the job and remove its files; the record as it was. The driver
        has taken it from the queue or told the gang to stop it first."""
        with self._lock:
            entry = self._entry(job_id, scope)
            self._forget(job_id, "was deleted")
        if entry.job.status in (v.QUEUED, v.IN_PROGRESS):
            entry.job.status = v.CANCELLED
        return entry.job

    def prune(self) -> None:
        """Drop finished jobs past their time; cheap to call often."""
        now = self.clock()
        if now - self._pruned_at < _PRUNE_EVERY_S:
            return
        self._pruned_at = now
        with self._lock:
            for job_id, entry in list(self._entries.items()):
                if entry.finished_at is not None and now - entry.finished_at >= self.ttl_s:
                    self._forget(job_id, "expired (--video-ttl)")

    # ------------------------------------------------------------ gang loop thread

    def overdue(self) -> tuple[str, ...]:
        """Running jobs that just passed their ``max_run_s``: the caller stops their
        generations, at the next denoising step (one in its final decode finishes), and
        the stop then fails the job with a reason that names the bound."""
        now = self.clock()
        late: tuple[str, ...] = ()
        with self._lock:
            for job_id, entry in self._entries.items():
                limit, began = entry.max_run_s, entry.started_at
                if entry.job.status != v.IN_PROGRESS or entry.overran:
                    continue
                if limit is not None and began is not None and now - began >= limit:
                    entry.overran = True
                    late += (job_id,)
        return late

    def started(self, job_id: str) -> None:
        with self._lock:
            entry = self._entries.get(job_id)
            if entry is not None and entry.job.status == v.QUEUED:
                entry.job.status = v.IN_PROGRESS
                entry.started_at = self.clock()

    def answer(self, reply: Reply) -> None:
        """The gang's (or the driver's) answer to a job's generation, as values:
        progress, the finished video, or why it stopped. An answer to a deleted job
        is dropped."""
        job_id = reply.request_id
        if reply.kind == p.PARTIAL and isinstance(reply.body, v.VideoProgress):
            self._progress(job_id, reply.body)
        elif reply.kind == p.RESULT and isinstance(reply.body, v.VideoResult):
            self._completed(job_id, reply.body, reply.blobs)
        elif reply.kind == p.ERROR and isinstance(reply.body, p.RequestError):
            self._failed(job_id, reply.body)
        else:  # never from this process's own executor
            what = f"{reply.kind} {type(reply.body).__name__}"
            log.error("video job %s: an answer it cannot take: %s", job_id, what)
            self._failed(job_id, p.RequestError(p.INTERNAL, f"unreadable answer: {what}"))

    def _progress(self, job_id: str, step: v.VideoProgress) -> None:
        with self._lock:
            entry = self._entries.get(job_id)
            if entry is not None and entry.job.status in (v.QUEUED, v.IN_PROGRESS):
                entry.job.status = v.IN_PROGRESS
                entry.job.progress = _DENOISE_SHARE * step.step // max(1, step.steps)

    def _stored(self, job_id: str, variant: str) -> bytes:
        from dpserve.sources.outstore import StoreDown

        assert self.objects is not None
        try:
            data = self.objects.read(job_id, variant, None)
        except StoreDown as exc:
            raise p.RequestError(p.UNAVAILABLE, f"video job {job_id}: {exc}") from None
        if data is None:
            raise p.RequestError(
                p.NOT_FOUND, f"video job {job_id}'s objects are gone from the store"
            )
        return data

    def _completed(self, job_id: str, result: v.VideoResult, blobs: Sequence[bytes]) -> None:
        if len(blobs) < 2:
            self._failed(job_id, p.RequestError(p.INTERNAL, "the gang's answer lacks its files"))
            return
        video, thumbnail = blobs[0], blobs[1]
        too_big = _too_big(len(video), self.max_bytes)
        if too_big is not None:
            self._failed(job_id, p.RequestError(p.INVALID_REQUEST, too_big))
            return
        with self._lock:
            if job_id not in self._entries:
                return  # deleted while it ran
        if self._uploader is not None:
            self._uploader.submit(self._upload, job_id, result, video, thumbnail)
            return
        files = self._write(job_id, video, thumbnail)
        with self._lock:
            if job_id not in self._entries:  # deleted while its files were written
                _remove(files)
                return
            self._done(job_id, result, len(video), files=files)

    def _upload(self, job_id: str, result: v.VideoResult, video: bytes, thumbnail: bytes) -> None:
        """The uploader thread's: the objects first, then ``completed``."""
        from dpserve.sources.outstore import StoreDown

        assert self.objects is not None
        with self._lock:
            entry = self._entries.get(job_id)
            if entry is None:
                return  # deleted while it waited
            attempt, tenant = entry.job.attempt, entry.job.tenant
        try:
            location = self.objects.put(job_id, attempt, tenant, video, thumbnail)
        except StoreDown as exc:
            log.error("video job %s: %s", job_id, exc)
            why = f"the video was made but could not be stored: {exc}; submit it again"
            self._failed(job_id, p.RequestError(p.UNAVAILABLE, why))
            self._drop_objects(job_id, attempt)  # a half upload, if the store lets us
            return
        with self._lock:
            if job_id in self._entries:
                self._done(job_id, result, len(video), location=location)
                return
        self._drop_objects(job_id, attempt)  # deleted while it was uploaded

    def _done(
        self,
        job_id: str,
        result: v.VideoResult,
        size: int,
        files: tuple[Path, Path] | None = None,
        location: str = "",
    ) -> None:
        """Under the lock: the job is completed, its output at ``files`` or ``location``."""
        now = self.clock()
        entry = self._entries[job_id]
        entry.files, entry.finished_at = files, now
        job = entry.job
        job.location = location
        job.status, job.progress = v.COMPLETED, 100
        job.completed_at = int(now)
        job.expires_at = int(now + self.ttl_s)
        job.bytes = size
        job.width, job.height, job.num_frames = result.width, result.height, result.num_frames
        job.queue_time_s = round(result.queue_time_s, 3)
        job.inference_time_s = round(result.inference_time_s, 3)
        job.encode_time_s = round(result.encode_time_s, 3)
        self._keep_within_bytes(job_id)

    def _failed(self, job_id: str, error: p.RequestError) -> None:
        now = self.clock()
        with self._lock:
            entry = self._entries.get(job_id)
            if entry is None or entry.job.status in v.TERMINAL:
                return
            job = entry.job
            if entry.overran and error.code == p.CANCELLED and entry.max_run_s is not None:
                error = p.RequestError(p.DEADLINE_EXCEEDED, _overran(entry.max_run_s))
            job.status = v.CANCELLED if error.code == p.CANCELLED else v.FAILED
            job.error = v.VideoError(code=error.code, message=str(error))
            job.completed_at = int(now)
            entry.finished_at = now

    # ------------------------------------------------------------ under the lock

    def _entry(self, job_id: str, scope: str | None = None) -> _Entry:
        entry = self._entries.get(job_id)
        if entry is None or not may_see(scope, entry.job.tenant):
            # Another tenant's job reads as one never held (not as deleted: that too
            # would say the id exists).
            gone = self._gone.get(job_id) if entry is None else None
            why = gone or "is not held by this replica"
            raise p.RequestError(p.NOT_FOUND, f"video job {job_id} {why}")
        return entry

    def _forget(self, job_id: str, why: str) -> None:
        entry = self._entries.pop(job_id, None)
        if entry is not None and entry.files is not None:
            _remove(entry.files)
        if entry is not None and entry.job.location and self._uploader is not None:
            self._uploader.submit(self._drop_objects, job_id, entry.job.attempt)
        self._gone[job_id] = why
        while len(self._gone) > self.max_records:
            self._gone.popitem(last=False)

    def _trim_records(self) -> None:
        finished = [k for k, e in self._entries.items() if e.finished_at is not None]
        for job_id in finished[: max(0, len(self._entries) - self.max_records)]:
            self._forget(job_id, "was dropped: this replica keeps the newest records only")

    def _keep_within_bytes(self, keep: str) -> None:
        """Oldest finished videos go until the files fit ``max_bytes``."""
        stored = [(k, e) for k, e in self._entries.items() if e.files is not None]
        total = sum(e.job.bytes for _, e in stored)
        for job_id, entry in stored:
            if total <= self.max_bytes:
                break
            if job_id != keep:
                total -= entry.job.bytes
                self._forget(job_id, "was removed to keep finished videos within --video-max-bytes")

    # ------------------------------------------------------------ files

    def _write(self, job_id: str, video: bytes, thumbnail: bytes) -> tuple[Path, Path]:
        # The replica in the name too: replicas of one `serve` may share --video-dir, and
        # a re-run holds the same id.
        stem = hashlib.sha256(f"{self.replica}/{job_id}".encode()).hexdigest()[:32]
        paths = (self.root / f"{stem}.mp4", self.root / f"{stem}.jpg")
        for path, data in zip(paths, (video, thumbnail), strict=True):
            partial = path.with_name(f".{path.name}.partial")
            partial.write_bytes(data)
            os.replace(partial, path)
        return paths

    def _drop_objects(self, job_id: str, attempt: int) -> None:
        from dpserve.sources.outstore import StoreDown

        assert self.objects is not None
        try:
            self.objects.delete(job_id, attempt)
        except StoreDown as exc:  # the bucket's lifecycle rule is the backstop
            log.warning("video job %s: its objects stay in the store: %s", job_id, exc)

    def close(self) -> None:
        if self._uploader is not None:
            self._uploader.shutdown(wait=True)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def _too_big(size: int, max_bytes: int) -> str | None:
    if size > max_bytes:
        kept = f"--video-max-bytes {max_bytes}"
        return f"the video is {size} bytes, more than this replica keeps ({kept})"
    if size > p.MAX_REPLY_FRAME_BYTES:
        return (
            f"the video is {size} bytes, more than one reply may carry ({p.MAX_REPLY_FRAME_BYTES})"
        )
    return None


def _overran(limit_s: float) -> str:
    return (
        f"the job ran past this service's bound of {limit_s:g}s on a video job's run time "
        "(the router's --video-max-estimate; spec.router.videoMaxEstimateSeconds on "
        "Kubernetes) and was stopped; ask for a smaller size, fewer frames or fewer steps"
    )


def _unfinished(job: v.VideoJob) -> str:
    if job.status in (v.QUEUED, v.IN_PROGRESS):
        return f"video job {job.id} is {job.status} ({job.progress}%): its content is not ready"
    why = f": {job.error.message}" if job.error is not None else ""
    return f"video job {job.id} is {job.status}{why}; it has no content"


def _remove(paths: Sequence[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _copy(job: v.VideoJob) -> v.VideoJob:
    return msgspec.structs.replace(job)
