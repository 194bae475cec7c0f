"""Admission: each decoded request becomes queued work or an immediate answer.

Runs on the socket thread (worker/driver/socket_thread.py). A request is checked
whole before anything reaches the gang: its fields against this replica's limits,
what the model serves (edits, previews, step caches, call settings), uploads from
their headers, the sessions this replica holds, and whether it is draining. Pings,
cancels and video job actions are answered here at once, so a replica busy with a
long generation still answers them.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.contract import video as v
from dpserve.worker.commands import GangCommand, GangStatus, Generation
from dpserve.worker.driver.outbox import Client
from dpserve.worker.driver.work_queue import Work
from dpserve.worker.edit import check_edit, check_generation, fitted_size

if TYPE_CHECKING:
    from dpserve.worker.driver.read_ahead import ReadAhead
    from dpserve.worker.driver.scheduler import Scheduler
    from dpserve.worker.driver.video_desk import VideoDesk
    from dpserve.worker.features import Features


class Admission:
    def __init__(
        self,
        replica: int,
        limits: pv.Limits,
        status: GangStatus,
        scheduler: Scheduler,
        draining: threading.Event,
        *,
        stall_s: float,
        max_sessions: int,
        boot_id: str,
        features: Features | None = None,
        videos: VideoDesk | None = None,
        read_ahead: ReadAhead | None = None,
    ) -> None:
        """``features``: what the model serves, checked before work queues; None: not
        known here (uploads are still checked). ``videos``: a video model's job actions."""
        self.replica = replica
        self.limits = limits
        self.status = status
        self.scheduler = scheduler
        self.draining = draining
        self.stall_s = stall_s
        self.max_sessions = max_sessions
        self.boot_id = boot_id
        self.features = features
        self.videos = videos
        self.read_ahead = read_ahead

    def handle(self, identity: bytes, message: p.Message) -> list[bytes] | None:
        """The immediate answer to ``message`` from peer ``identity``; None when it
        queued (the gang answers it) or needs no answer. Raises the refusal."""
        received = time.monotonic()
        if message.kind == p.PING:
            return p.encode(p.RESULT, message.id, self.ping())
        if message.kind == p.CANCEL:  # answered only when any_client asks, draining or not
            return self._cancel(Client(identity), message)
        if message.kind == p.VIDEO:  # answered at once; a submit queues the job's generation
            return self._video(message)
        if message.kind == p.GENERATE:
            params = pv.fill_seeds(self._generate(message))
            blobs = list(message.blobs) if params.edit is not None else []
            batch = [Generation(id=message.id, params=params)]
            command = GangCommand(kind=p.GENERATE, id=message.id, batch=batch, blobs=blobs)
        elif message.kind == p.SESSION:
            command = self._session(message)
        elif message.kind == p.CONTROL:
            control = pv.parse_control(message.body_as(p.ControlRequest))
            command = GangCommand(kind=p.CONTROL, id=message.id, control=control)
        else:
            kinds = ", ".join(sorted(p.REQUEST_KINDS))
            raise p.RequestError(
                p.UNSUPPORTED, f"unknown message kind {message.kind!r}; known: {kinds}"
            )
        if self.draining.is_set():
            if message.kind == p.SESSION:
                # Not "try again": the sessions' state ends with this process.
                ending = f"replica {self.replica} is shutting down; its sessions end with it"
                raise p.RequestError(p.NOT_FOUND, ending)
            raise p.RequestError(p.UNAVAILABLE, f"replica {self.replica} is shutting down")
        deadline = None  # sessions and control ops run to the end: they change state
        if message.kind == p.GENERATE and message.timeout_ms is not None:
            deadline = received + message.timeout_ms / 1000
        work = Work(Client(identity), command, received, deadline, message.tenant)
        self.scheduler.enqueue(work)
        self._read_ahead(command)
        return None

    def _read_ahead(self, command: GangCommand) -> None:
        """Adapters the gang lacks start into the page cache while it works (read_ahead.py)."""
        if self.read_ahead is None:
            return
        if command.batch:
            refs = command.batch[0].params.lora
        elif command.session is not None and command.session.params is not None:
            refs = command.session.params.lora
        else:
            return
        self.read_ahead.want(refs, self.status.adapters)

    def _cancel(self, sender: Client, message: p.Message) -> list[bytes] | None:
        """Answer the cancelled request (to its own sender); with ``any_client`` the
        cancel itself is answered too, saying where the request was."""
        request: p.CancelRequest = message.body_as(p.CancelRequest)
        if request.any_client:
            found = self.scheduler.cancel(request.request_id, None, request.scope)
        else:
            found = self.scheduler.cancel(request.request_id, sender)
        if not request.any_client:
            return None
        return p.encode(
            p.RESULT, message.id, p.CancelResult(request_id=request.request_id, found=found)
        )

    def _video(self, message: p.Message) -> list[bytes]:
        request: v.VideoRequest = message.body_as(v.VideoRequest)
        if request.action not in v.ACTIONS:
            raise p.RequestError(
                p.INVALID_REQUEST,
                f"unknown video action {request.action!r}; known: {', '.join(v.ACTIONS)}",
            )
        if self.videos is None:
            if request.action == v.LIST:
                return p.encode(p.RESULT, message.id, v.VideoList(jobs=[]))
            if request.action == v.SUBMIT:
                raise p.RequestError(p.UNSUPPORTED, _IMAGE_MODEL)
            raise p.RequestError(p.NOT_FOUND, f"video job {request.job_id} is not held here")
        body, blobs = self.videos.act(request, list(message.blobs))
        if request.action == v.SUBMIT and request.params is not None and self.read_ahead:
            self.read_ahead.want(request.params.lora, self.status.adapters)  # it queued
        return p.encode(p.RESULT, message.id, body, blobs)

    def _generate(self, message: p.Message) -> p.GenerateParams:
        """A generation checked whole before it queues, decoded and checked once:
        fields, uploads, and what the model serves. An edit without a size takes its
        first image's (fitted)."""
        blobs = message.blobs
        params = pv.parse_generate(message.body_as(dict), self.limits, blobs=len(blobs))
        features = self.features
        if features is not None and params.partial_images > features.partial_images:
            limit = features.partial_images
            raise p.RequestError(
                p.UNSUPPORTED,
                f"this model's pipeline sends at most {limit} partial images"
                + ("" if limit else " (it cannot preview)"),
                [p.FieldError("partial_images", f"must be at most {limit}")],
            )
        if features is not None:
            features.step_caches.check(params.step_cache)
            features.settings.check(params)
        if params.edit is None:
            check_generation(features.edit if features is not None else None)
            return params
        size = check_edit(params.edit, blobs, features.edit if features is not None else None)
        if params.width is None and params.height is None:
            width, height = fitted_size(size, self.limits.size_factor, self.limits.max_side)
            pv.check_size(width, height, self.limits)  # every bound a given size meets
            params = msgspec.structs.replace(params, width=width, height=height)
        return params

    def _session(self, message: p.Message) -> GangCommand:
        request = rt.session_request(message.body_as(rt.SessionRequest))
        if request.first_frame is not None and not 0 <= request.first_frame < len(message.blobs):
            raise p.RequestError(p.INVALID_REQUEST, "first_frame names a blob the message lacks")
        if request.params is not None:
            rt.check_session(request.params, self.limits)
        if request.action == rt.OPEN and self.status.sessions >= self.max_sessions:
            # Refused here, without waiting behind the gang's queue; the gang's own
            # table still decides when this view is stale.
            raise p.RequestError(
                p.OVERLOADED, f"this replica holds its maximum of {self.max_sessions} sessions"
            )
        blobs = list(message.blobs) if request.first_frame is not None else []
        return GangCommand(kind=p.SESSION, id=message.id, session=request, blobs=blobs)

    def ping(self) -> p.PingResult:
        age = time.monotonic() - self.status.progress_at
        status = "ok"
        if self.draining.is_set():
            status = "draining"
        elif self.status.busy and age > self.stall_s:
            status = "stalled"
        return p.PingResult(
            replica=self.replica,
            boot_id=self.boot_id,
            status=status,
            busy=self.status.busy,
            queue_depth=self.scheduler.work.qsize(),
            served=self.status.served,
            released=self.status.released,
            progress_age_s=round(age, 3),
            control=self.status.control,
            sessions=self.status.sessions,
            max_sessions=self.max_sessions,
            session_bytes=self.status.session_bytes,
            max_batch=self.status.max_batch,
            cost=self.status.calibration.report(),
            outstanding_units=self._outstanding_units(),
            busy_fraction=round(self.status.busy_fraction, 4),
            adapters=self.status.adapters,
        )

    def _outstanding_units(self) -> float:
        """Cost units of the generations queued and running, whoever sent them: what
        a router adds to its own view for the work other routers placed here."""
        units = self.status.calibration.units
        return sum(
            units(generation.params)
            for work in self.scheduler.work.snapshot()
            for generation in work.command.batch
        )


_IMAGE_MODEL = "this model makes images, not videos: use /v1/images/generations"
