"""The driver's ZMQ ingress: one thread owns the ROUTER socket.

It decodes and validates every message before anything reaches the gang, answers
pings on its own (so a replica busy with a long generation still answers), and
queues work for the gang loop. Replies come back from the loop over an inproc
socket, because a ZMQ socket must only be used by the thread that owns it.
Malformed frames are answered with an error when they carry a request id, else
dropped and logged; nothing a peer sends can stop this thread.

The gang loop takes a batch of compatible generations at a time (worker/batch.py)
or one other command. A generation leaves the queue without running when its
client cancels it or its deadline passes: the ingress thread answers it at once (or
within one poll interval of the deadline). A running one is found by
:meth:`Ingress.halt`, which the gang asks at each denoising step: it answers a
request that must stop while others of its batch go on, and stops the gang when
none is left.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.contract import video as v
from dpserve.plumbing.curve import Gatekeeper, WireKey, plaintext_warning
from dpserve.plumbing.transport import bind_router, bound_endpoint, inproc_pair
from dpserve.worker.batch import Batching
from dpserve.worker.commands import GangCommand, GangStatus, Generation
from dpserve.worker.edit import check_edit, fitted_size, upload_size

if TYPE_CHECKING:
    from dpserve.worker.features import Features
    from dpserve.worker.video_jobs import VideoBook

log = logging.getLogger(__name__)

# A request that stops while others of its batch run on (Ingress.halt).
_LEFT_BATCH = "dropped from its batch at a denoising step, the others went on"
# The identity of a video job's work: its answers go to the job book, not a client
# (a ZMQ ROUTER never gives a peer an empty identity).
JOB_IDENTITY = b""
_IMAGE_MODEL = "this model makes images, not videos: use /v1/images/generations"


@dataclass(frozen=True)
class Work:
    identity: bytes
    command: GangCommand
    received_at: float
    deadline: float | None = None  # on the driver's monotonic clock; generations only


@dataclass(eq=False)
class _Running:
    """A member of the running batch."""

    work: Work
    cancelled: bool = False  # its client cancelled it
    answered: bool = False  # dropped from its batch, and answered already


class WorkQueue:
    """The gang's bounded FIFO, and the batch the gang runs now (one work, or several
    compatible generations: worker/batch.py).

    A generation may leave the queue before its turn (cancelled, or past its
    deadline), and a batch before the batch ends. One lock covers the queue and the
    running batch, so a cancel finds a request in exactly one of the two places, or
    nowhere (done already).
    """

    def __init__(self, maxsize: int, batching: Batching | None = None) -> None:
        self.maxsize = maxsize
        self.batching = batching or Batching()
        self._items: deque[Work] = deque()
        self._cond = threading.Condition()  # reentrant
        self._running: list[_Running] = []

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, work: Work) -> None:
        with self._cond:
            if len(self._items) >= self.maxsize:
                raise queue.Full
            self._items.append(work)
            self._cond.notify()

    def start(self, timeout: float) -> list[Work]:
        """The next batch, which becomes the running one; empty after ``timeout``.

        The oldest work, and the compatible generations that may join it. A batch
        with nothing compatible queued behind its first request starts at once; one
        that gathered more but is not full waits up to ``batching.wait_s`` for more
        (its members count as running meanwhile: a cancel reaches them).
        """
        with self._cond:
            self._cond.wait_for(lambda: bool(self._items), timeout)
            self._running = []
            if not self._items:
                return []
            self._running.append(_Running(self._items.popleft()))
            if self.batching.grows(self._running[0].work.command):
                self._gather(time.monotonic() + self.batching.wait_s)
            return [member.work for member in self._running]

    def _gather(self, until: float) -> None:
        while True:
            batch = [member.work.command for member in self._running]
            taken, barrier = self.batching.joiners(batch, [w.command for w in self._items])
            chosen = set(taken)
            self._running += [_Running(w) for i, w in enumerate(self._items) if i in chosen]
            self._items = deque(w for i, w in enumerate(self._items) if i not in chosen)
            left = until - time.monotonic()
            alone = len(self._running) == 1  # nothing compatible queued: no reason to wait
            full = self.batching.full([member.work.command for member in self._running])
            if alone or full or barrier or left <= 0:
                return
            self._cond.wait(left)  # until new work arrives (put_nowait notifies)

    def discard(self, works: list[Work]) -> list[Work]:
        """Take ``works`` out of the running batch before it runs; the batch left."""
        with self._cond:
            self._running = [m for m in self._running if all(m.work is not w for w in works)]
            return [member.work for member in self._running]

    def finish(self) -> list[tuple[Work, bool]]:
        """The batch ended: its members, each with whether it was answered already."""
        with self._cond:
            ended = [(member.work, member.answered) for member in self._running]
            self._running = []
            return ended

    def running(self) -> list[tuple[Work, bool]]:
        """The running batch's members not answered yet, each with whether its client
        cancelled it."""
        with self._cond:
            return [(m.work, m.cancelled) for m in self._running if not m.answered]

    def answered(self, work: Work) -> None:
        """``work`` left its running batch with an answer; the others go on."""
        with self._cond:
            for member in self._running:
                if member.work is work:
                    member.answered = True

    def snapshot(self) -> list[Work]:
        """The work running (not answered yet) and queued, in that order."""
        with self._cond:
            running = [m.work for m in self._running if not m.answered]
            return running + list(self._items)

    def take(self, drop: Callable[[Work], bool]) -> list[Work]:
        """Remove the queued work ``drop`` picks, and return it in queue order."""
        with self._cond:
            kept: deque[Work] = deque()
            taken: list[Work] = []
            for work in self._items:
                (taken if drop(work) else kept).append(work)
            self._items = kept
            return taken

    def cancel(self, request_id: str, identity: bytes | None) -> tuple[list[Work], str]:
        """The generation ``request_id`` of that client (``identity`` None: of any client):
        removed if queued (and returned), marked if running; anything else is left
        alone. Also says where it was (protocol.CANCEL_*)."""

        def named(work: Work) -> bool:
            command = work.command
            return (
                (identity is None or work.identity == identity)
                and command.id == request_id
                and command.kind == p.GENERATE
            )

        with self._cond:
            running = False
            for member in self._running:
                if not member.answered and named(member.work):
                    member.cancelled = running = True
            taken = self.take(named)
        found = p.CANCEL_QUEUED if taken else p.CANCEL_RUNNING if running else p.CANCEL_NOT_FOUND
        return taken, found


class Ingress:
    def __init__(
        self,
        endpoint: str,
        replica: int,
        limits: pv.Limits,
        status: GangStatus,
        max_queue: int,
        stall_s: float,
        max_sessions: int,
        *,
        settle: bool = False,
        key: WireKey | None = None,
        features: Features | None = None,
        batching: Batching | None = None,
        videos: VideoBook | None = None,
    ) -> None:
        """``key``: the service's wire key; the socket is then a CURVE server that
        admits only clients holding it. None: a plaintext wire (warned loudly).
        ``features``: what the model serves (edits, previews), checked before work
        queues; None: not known here (uploads are still checked). ``batching``: how
        generations gather into batches (None: one at a time). ``videos``: the job
        book of a video model (None: the model makes no videos)."""
        self.videos = videos
        self.replica = replica
        self.features = features
        self.limits = limits
        self.status = status
        self.stall_s = stall_s
        self.max_sessions = max_sessions
        self.boot_id = uuid.uuid4().hex
        self.work = WorkQueue(max_queue, batching)
        self.draining = threading.Event()
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._replies_in, self._replies_out = inproc_pair(self._ctx, f"replies-{id(self)}")
        # The gatekeeper answers handshakes from before the first peer can connect.
        self.gate = Gatekeeper(self._ctx, key) if key is not None else None
        # Bind here, on the caller's thread, so a taken port fails the start-up loudly
        # (or, asked to ``settle``, moves to a free one: the endpoint is what was bound).
        try:
            self._sock = bind_router(self._ctx, endpoint, settle=settle, key=key)
        except zmq.ZMQError:
            if self.gate is not None:
                self.gate.close()
            raise
        self.endpoint = bound_endpoint(self._sock)
        if key is None:
            plaintext_warning(
                f"replica {replica}'s driver on {self.endpoint}",
                "anyone who can reach its port can run generations and control ops",
            )
        self._thread = threading.Thread(target=self._run, name="dpserve-ingress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ gang loop side

    def next_work(self, timeout: float) -> list[Work]:
        """The next batch to run (one work, or compatible generations in queue order),
        which is the running one until :meth:`finished`; empty after ``timeout``.

        Work whose deadline passed since the ingress thread last looked is answered
        here instead of run.
        """
        end = time.monotonic() + timeout
        while batch := self.work.start(max(0.0, end - time.monotonic())):
            now = time.monotonic()
            late = [(w, e) for w in batch if (e := _past_deadline(w, now, started=False))]
            for work, error in late:
                self.reply(work.identity, p.encode_error(work.command.id, error))
            if len(late) < len(batch):
                if self.videos is not None:
                    for work in batch:
                        if work.identity == JOB_IDENTITY:
                            self.videos.started(work.command.id)
                return self.work.discard([work for work, _ in late])
            self.work.finish()
        return []

    def halt(self) -> p.RequestError | None:
        """Why the running batch must stop now: every request in it was cancelled or
        passed its deadline. ``None``: go on.

        Asked by the gang loop at each denoising step. A request that must stop while
        others of its batch go on is answered here, at once, and its image is
        discarded when the batch ends. When all must stop, the last is left to the
        gang's own answer (the error returned here, raised on every rank).
        """
        now = time.monotonic()
        live = self.work.running()
        stopping = [(w, e) for w, cancelled in live if (e := _halt(w, cancelled, now))]
        if not stopping:
            return None
        last = stopping.pop()[1] if len(stopping) == len(live) else None
        for work, error in stopping:
            self.work.answered(work)
            dropped = p.RequestError(error.code, f"{error}; {_LEFT_BATCH}")
            self.reply(work.identity, p.encode_error(work.command.id, dropped))
        return last

    def finished(self, replies: Sequence[list[bytes]] = ()) -> None:
        """The running batch is done: ``replies`` holds each member's answer, in batch
        order (none for the driver's own commands), sent unless it was answered already."""
        ended = self.work.finish()
        for (work, answered), frames in zip(ended, replies, strict=False):
            if frames and not answered:
                self.reply(work.identity, frames)

    def reply(self, identity: bytes, frames: list[bytes]) -> None:
        if identity == JOB_IDENTITY:
            self._to_book(frames)
        else:
            self._replies_out.send_multipart([identity, *frames])

    def _to_book(self, frames: list[bytes]) -> None:
        if self.videos is not None:
            self.videos.answer(frames)

    def close(self) -> None:
        # Work that slipped in after the loop's last look is refused, not lost silently.
        while batch := self.next_work(timeout=0):
            refusal = p.RequestError(p.UNAVAILABLE, f"replica {self.replica} is shutting down")
            for work in batch:
                self.reply(work.identity, p.encode_error(work.command.id, refusal))
            self.work.finish()
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in (self._replies_out, self._replies_in, self._sock):
            sock.close()
        if self.gate is not None:
            self.gate.close()
        self._ctx.term()
        if self.videos is not None:
            self.videos.close()

    # ------------------------------------------------------------ ingress thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._replies_in, zmq.POLLIN)
        # Drain replies even after stop was asked, so in-flight answers go out.
        while not self._stop.is_set() or self._replies_in.poll(0):
            events = dict(poller.poll(100))
            if self._replies_in in events:
                self._sock.send_multipart(self._replies_in.recv_multipart())
            if self._sock in events:
                frames = self._sock.recv_multipart()
                try:
                    self._handle(frames)
                except Exception:  # never let one message end the ingress
                    log.exception("dropping a message that could not be handled")
            self._expire(time.monotonic())
            if self.videos is not None:
                self.videos.prune()
                for job_id in self.videos.overdue():  # past their run bound: stop at next step
                    self.work.cancel(job_id, None)

    def _expire(self, now: float) -> None:
        """Answer queued work whose deadline passed: its client stopped waiting."""
        for work in self.work.take(lambda w: w.deadline is not None and now >= w.deadline):
            late = _past_deadline(work, now, started=False)
            assert late is not None
            self._send(work.identity, p.encode_error(work.command.id, late))

    def _cancel(self, identity: bytes, message: p.Message) -> list[bytes] | None:
        """Answer the cancelled request (to its own sender); with ``any_client`` the
        cancel itself is answered too, saying where the request was."""
        request: p.CancelRequest = message.body_as(p.CancelRequest)
        mine = None if request.any_client else identity
        taken, found = self.work.cancel(request.request_id, mine)
        for work in taken:
            gone = p.RequestError(
                p.CANCELLED, f"request {work.command.id} was cancelled before it started"
            )
            self._send(work.identity, p.encode_error(work.command.id, gone))
        if not request.any_client:
            return None
        return p.encode(
            p.RESULT, message.id, p.CancelResult(request_id=request.request_id, found=found)
        )

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        if identity == JOB_IDENTITY:
            self._to_book(frames)
        else:
            self._sock.send_multipart([identity, *frames])

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            log.warning("dropping a message without identity or header (%d frames)", len(frames))
            return
        identity, rest = frames[0], frames[1:]
        try:
            message = p.decode(rest)
        except p.ProtocolError as exc:
            if exc.request_id is None:
                log.warning("dropping a malformed message: %s", exc)
                return
            self._send(identity, p.encode_error(exc.request_id, _invalid(str(exc))))
            return
        try:
            reply = self._dispatch(identity, message)
        except p.ProtocolError as exc:
            reply = p.encode_error(message.id, _invalid(str(exc)))
        except p.RequestError as exc:
            reply = p.encode_error(message.id, exc)
        if reply is not None:
            self._send(identity, reply)

    def _dispatch(self, identity: bytes, message: p.Message) -> list[bytes] | None:
        received = time.monotonic()
        if message.kind == p.PING:
            return p.encode(p.RESULT, message.id, self.ping())
        if message.kind == p.CANCEL:  # answered only when any_client asks, draining or not
            return self._cancel(identity, message)
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
        try:
            self.work.put_nowait(Work(identity, command, received, deadline))
        except queue.Full:
            raise p.RequestError(
                p.OVERLOADED, f"replica {self.replica} queue is full ({self.work.maxsize})"
            ) from None
        return None

    def _generate(self, message: p.Message) -> p.GenerateParams:
        """A generation checked whole before it queues: fields, uploads, and what the
        model serves. An edit without a size takes its first image's (fitted)."""
        body: Any = message.body_as(dict)
        blobs = message.blobs
        params = pv.parse_generate(body, self.limits, blobs=len(blobs))
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
            return params
        size = check_edit(params.edit, blobs, features.edit if features is not None else None)
        if params.width is None and params.height is None:
            width, height = fitted_size(size, self.limits.size_factor, self.limits.max_side)
            # Parsed again so the fitted size meets every bound a given one does.
            body = {k: v for k, v in body.items() if k != "size"}
            params = pv.parse_generate(
                {**body, "width": width, "height": height}, self.limits, blobs=len(blobs)
            )
        return params

    def _video(self, message: p.Message) -> list[bytes]:
        request: v.VideoRequest = message.body_as(v.VideoRequest)
        book = self.videos
        if request.action not in v.ACTIONS:
            raise _invalid(
                f"unknown video action {request.action!r}; known: {', '.join(v.ACTIONS)}"
            )
        if book is None:
            if request.action == v.LIST:
                return p.encode(p.RESULT, message.id, v.VideoList(jobs=[]))
            if request.action == v.SUBMIT:
                raise p.RequestError(p.UNSUPPORTED, _IMAGE_MODEL)
            raise p.RequestError(p.NOT_FOUND, f"video job {request.job_id} is not held here")
        blobs: list[bytes] = []
        body: Any
        match request.action:
            case v.SUBMIT:
                body = self._submit_video(request, list(message.blobs))
            case v.GET:
                body = book.get(request.job_id)
            case v.LIST:
                body = book.list()
            case v.CONTENT:
                body, data = book.content(request.job_id, request.variant)
                blobs = [data]
            case _:  # DELETE
                # Queued: it leaves the queue; running: the gang stops it at its next step
                # (its answer then finds no record, and is dropped).
                self.work.cancel(request.job_id, None)
                body = book.delete(request.job_id)
        return p.encode(p.RESULT, message.id, body, blobs)

    def _submit_video(self, request: v.VideoRequest, blobs: list[bytes]) -> v.VideoJob:
        """Check a job whole with this replica's limits, record it, queue its generation."""
        book = self.videos
        assert book is not None
        if request.params is None or request.params.video is None:
            raise _invalid("a video submit needs params with video set")
        if v.job_owner(request.job_id) is None:
            raise _invalid(f"{request.job_id[:80]!r} is not a video job id")
        if self.draining.is_set():
            raise p.RequestError(p.UNAVAILABLE, f"replica {self.replica} is shutting down")
        if book.holds(request.job_id):  # a re-run sent twice: the job is here already
            return book.get(request.job_id)
        params = pv.fill_seeds(self._video_params(request.params, blobs))
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
        )
        try:
            self.work.put_nowait(Work(JOB_IDENTITY, command, time.monotonic()))
        except queue.Full:
            book.withdraw(request.job_id)
            raise p.RequestError(
                p.OVERLOADED, f"replica {self.replica} queue is full ({self.work.maxsize})"
            ) from None
        return job

    def _video_params(self, asked: p.GenerateParams, blobs: list[bytes]) -> p.GenerateParams:
        """The router's checks again, with this model's limits: sizes, steps, frames;
        an input_reference must be an image, and the model must take one. A side the
        job leaves out gets the model's default here (what the pipeline makes when given
        none, as the cost model reads it), so its record says from the start what it
        renders."""
        spec = asked.video
        assert spec is not None
        shape = self.status.calibration.report()
        fields = {
            "prompt": asked.prompt,
            "negative_prompt": asked.negative_prompt,
            "width": asked.width or shape.default_width,
            "height": asked.height or shape.default_height,
            "num_inference_steps": asked.num_inference_steps,
            "guidance_scale": asked.guidance_scale,
            "seed": asked.seed[0] if asked.seed else None,
            "num_frames": spec.num_frames,
            "seconds": spec.seconds if spec.num_frames is None else None,
            "fps": spec.fps,
        }
        body = {k: value for k, value in fields.items() if value is not None}
        reference = asked.edit is not None
        if reference and not blobs:
            raise _invalid("input_reference names a blob the message lacks")
        params = v.parse_video(body, self.limits, blobs=1 if reference else 0)
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

    def _session(self, message: p.Message) -> GangCommand:
        request = rt.session_request(message.body_as(rt.SessionRequest))
        if request.first_frame is not None and not 0 <= request.first_frame < len(message.blobs):
            raise p.RequestError(p.INVALID_REQUEST, "first_frame names a blob the message lacks")
        if request.params is not None:
            _check_session_params(request.params, self.limits)
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
            queue_depth=self.work.qsize(),
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
        )

    def _outstanding_units(self) -> float:
        """Cost units of the generations queued and running, whoever sent them: what
        a router adds to its own view for the work other routers placed here."""
        units = self.status.calibration.units
        return sum(
            units(generation.params)
            for work in self.work.snapshot()
            for generation in work.command.batch
        )


def _check_session_params(params: rt.SessionParams, limits: pv.Limits) -> None:
    """The bounds a generation request gets, applied to what a session renders."""
    body = {
        "prompt": params.prompt,
        "negative_prompt": params.negative_prompt,
        "width": params.width,
        "height": params.height,
        "num_inference_steps": params.num_inference_steps,
        "guidance_scale": params.guidance_scale,
        "true_cfg_scale": params.true_cfg_scale,
        "seed": params.seed,
        "output_format": params.output_format,
    }
    pv.parse_generate({k: v for k, v in body.items() if v is not None}, limits)
    if not 1 <= params.frame_steps <= limits.max_steps or not 0 < params.strength <= 1:
        raise p.RequestError(
            p.INVALID_REQUEST,
            f"frame_steps must be 1..{limits.max_steps} and strength in (0, 1]",
        )


def _halt(work: Work, cancelled: bool, now: float) -> p.RequestError | None:
    """Why a running request must stop now (cancelled, or past its deadline), or None."""
    if cancelled:
        return p.RequestError(p.CANCELLED, f"request {work.command.id} was cancelled")
    return _past_deadline(work, now, started=True)


def _past_deadline(work: Work, now: float, started: bool) -> p.RequestError | None:
    if work.deadline is None or now < work.deadline:
        return None
    given = work.deadline - work.received_at
    where = "while it ran" if started else "before it started"
    return p.RequestError(
        p.DEADLINE_EXCEEDED,
        f"request {work.command.id} passed its deadline ({given:g}s after this replica "
        f"received it) {where}",
    )


def _invalid(message: str) -> p.RequestError:
    return p.RequestError(p.INVALID_REQUEST, message)
