"""A video model's job actions, answered at once on the socket thread: submit (checked
whole with this replica's limits, recorded, its generation queued for the job book),
get, list, content and delete (docs/video.md)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract import video as v
from dpserve.worker.commands import GangCommand, GangStatus, Generation
from dpserve.worker.driver.outbox import Jobs
from dpserve.worker.driver.work_queue import Work
from dpserve.worker.edit import upload_size

if TYPE_CHECKING:
    from dpserve.worker.driver.scheduler import Scheduler
    from dpserve.worker.features import Features
    from dpserve.worker.video_jobs import VideoBook


class VideoDesk:
    def __init__(
        self,
        book: VideoBook,
        replica: int,
        limits: pv.Limits,
        status: GangStatus,
        scheduler: Scheduler,
        draining: threading.Event,
        features: Features | None = None,
    ) -> None:
        self.book = book
        self.replica = replica
        self.limits = limits
        self.status = status
        self.scheduler = scheduler
        self.draining = draining
        self.features = features

    def act(self, request: v.VideoRequest, blobs: list[bytes]) -> tuple[Any, list[bytes]]:
        """The answer's body and blobs for a known action."""
        book = self.book
        match request.action:
            case v.SUBMIT:
                return self._submit(request, blobs), []
            case v.GET:
                return book.get(request.job_id, request.scope), []
            case v.LIST:
                return book.list(request.scope), []
            case v.CONTENT:
                body, data = book.content(request.job_id, request.variant, request.scope)
                return body, [data]
            case _:  # DELETE
                book.owned(request.job_id, request.scope)  # another tenant's: not found
                # Queued: it leaves the queue; running: the gang stops it at its next step
                # (its answer then finds no record, and is dropped).
                self.scheduler.work.cancel(request.job_id, None)
                return book.delete(request.job_id, request.scope), []

    def _submit(self, request: v.VideoRequest, blobs: list[bytes]) -> v.VideoJob:
        """Check a job whole with this replica's limits, record it, queue its generation."""
        book = self.book
        if request.params is None or request.params.video is None:
            raise _invalid("a video submit needs params with video set")
        if v.job_owner(request.job_id) is None:
            raise _invalid(f"{request.job_id[:80]!r} is not a video job id")
        if self.draining.is_set():
            raise p.RequestError(p.UNAVAILABLE, f"replica {self.replica} is shutting down")
        if book.holds(request.job_id):  # a re-run sent twice: the job is here already
            return book.get(request.job_id)
        params = pv.fill_seeds(self._params(request.params, blobs))
        command = GangCommand(
            kind=p.GENERATE,
            id=request.job_id,
            batch=[Generation(id=request.job_id, params=params)],
            blobs=blobs[:1] if params.edit is not None else [],
        )
        # Recorded first, so the gang that starts it at once finds the record.
        job = book.submit(
            request.job_id,
            params,
            request.created_at,
            request.attempt,
            request.estimated_s,
            request.max_run_s,
            request.tenant,
        )
        try:
            self.scheduler.enqueue(Work(Jobs(book), command, time.monotonic()))
        except p.RequestError:
            book.withdraw(request.job_id)
            raise
        return job

    def _params(self, asked: p.GenerateParams, blobs: list[bytes]) -> p.GenerateParams:
        """The router's checks again, with this model's limits: sizes, steps, frames;
        an input_reference must be an image, and the model must take one. A side the
        job leaves out gets the model's default here (what the pipeline makes when given
        none, as the cost model reads it), so its record says from the start what it
        renders."""
        shape = self.status.calibration.report()
        if asked.edit is not None and not blobs:
            raise _invalid("input_reference names a blob the message lacks")
        sized = msgspec.structs.replace(
            asked,
            width=asked.width or shape.default_width,
            height=asked.height or shape.default_height,
        )
        params = v.check_job(sized, self.limits)
        reference = params.edit is not None
        video = self.features.video if self.features is not None else None
        if reference:
            upload_size(blobs[0], "input_reference")
            if video is None or not video.image_to_video:
                raise p.RequestError(
                    p.UNSUPPORTED,
                    "this model makes videos from text only: send the job without input_reference",
                    [p.FieldError("input_reference", "is not supported by this model")],
                )
        elif video is not None and not video.text_to_video:
            raise p.RequestError(
                p.UNSUPPORTED,
                "this model makes videos from an image: send the job with an input_reference",
                [p.FieldError("input_reference", "is required by this model")],
            )
        return params


def _invalid(message: str) -> p.RequestError:
    return p.RequestError(p.INVALID_REQUEST, message)
