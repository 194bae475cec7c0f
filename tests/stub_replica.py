"""An in-process replica for router tests: the real wire protocol on a real ZMQ socket.

It holds a control state the way a worker does (dpserve.contract.control_state: documents
ordered by version, whole states applied, the worker's refusals) and
answers pings (with its load: cost units in flight, a calibration, a busy share and
a batch size, as a driver reports them), model_info (with features), control ops,
and generations and edits:
a fixed PNG per image (an edit echoes its first upload), after ``partial_images``
previews per image (PARTIAL replies), a step at a time (``step_s``) so tests can
cancel mid-way; cancels (its own clients', and any client's) are answered as a
driver does. Given ``video_limits`` it is a video model with a job book
(dpserve.contract.video): it checks a submit's frames and size against those limits, runs
its jobs one at a time, a step each ``step_s`` (progress), keeps their records for
get and list, serves fixed bytes as their mp4 and thumbnail, and drops a deleted
one at its next step. What it leaves out is the model: tests that need pixels or
gangs use real workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio
from PIL import Image

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract import validation as pv
from dpserve.contract import video as v
from dpserve.contract.control_state import StateDoc, answer, parse_doc, reduce, refusal
from dpserve.contract.cost import cost_units
from dpserve.contract.owners import may_see
from dpserve.plumbing.curve import Gatekeeper, WireKey
from dpserve.plumbing.transport import bind_router

T = TypeVar("T")
# What a stub video model makes: an mp4's first bytes, and a JPEG thumbnail's.
MP4 = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + b"stub video" * 8
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"stub thumbnail" * 4 + b"\xff\xd9"
_JOB = b""  # a video job's key among the work in flight (no client's identity)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


# What a driver's model_info says of a one-rank image model that takes no settings.
FEATURES: dict[str, Any] = {
    "edits": True,
    "inpainting": True,
    "max_edit_images": pv.MAX_EDIT_IMAGES,
    "partial_images": pv.MAX_PARTIAL_IMAGES,
    "output_formats": list(pv.OUTPUT_FORMATS),
    "output_compression": True,
    "max_n": 10,
    "step_caches": {},
    "step_cache_default": None,
    "max_sequence_length": None,
    "flow_shift": None,
    "vae_tiling": False,
    "vae_slicing": False,
    "video": None,
}


def model_info(replica: int = 0) -> dict[str, Any]:
    """A whole model_info (dpserve.contract.model_info.ModelInfo's wire form) of a stub at /stub."""
    return {
        "replica": replica,
        "layout": "tp1-sp1(u1r1)-pp1-cfg1-dp1",
        "parallel": {"tp": 1, "sp": 1, "ulysses": 1, "ring": 1, "cfg": 1},
        "gang_size": 1,
        "threads_per_rank": 1,
        "device": "cpu",
        "dtype": "float32",
        "size_factor": 16,
        "max_side": 2048,
        "max_steps": 100,
        "max_sequence_length": None,
        "max_sessions": 8,
        "session_idle_timeout_s": 300.0,
        "compile": None,
        "realtime": "supported",
        "features": dict(FEATURES),
        "cfg_parallel": "off",
        "without_true_cfg": "whole",
        "model_path": "/stub",
        "pipeline_class": "StubPipeline",
        "components": [],
        "released": False,
        "loras": [],
        "rank_weights": [{"rank": 0, "tp_rank": 0, "sp_rank": 0, "cfg_rank": 0, "bytes": {}}],
        "ranks": 1,
    }


@dataclass
class StubReplica:
    ctx: zmq.asyncio.Context
    replica: int = 0
    fail_paths: set[str] = field(default_factory=set)  # LoRA/weights folders it cannot load
    generate_s: float = 0.0  # how long a generation takes
    held: StateDoc = field(default_factory=StateDoc)
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    calls: list[str] = field(default_factory=list)  # control ops received, in order
    generated: int = 0
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set: answers nothing
    late_pings: int = 0  # answer this many pings late (by late_ping_s): a lagging network
    late_ping_s: float = 1.0
    checksum_s: float = 0.0  # how long get_weights_checksum takes (it hashes the model)
    key: WireKey | None = None  # a CURVE server of this key, as a driver given one
    step_s: float = 0.0  # per denoising step (steps: the request's, default 4)
    preview: bytes | None = None  # each preview's blob (default: the fixed PNG)
    # Its model_info's features; a test may give some, the rest are FEATURES'.
    features: dict[str, Any] = field(default_factory=lambda: dict(FEATURES))
    received: list[tuple[p.GenerateParams, int]] = field(default_factory=list)  # and blobs
    cancelled: list[str] = field(default_factory=list)  # request ids it dropped
    # What its pings say about its load (outstanding_units: its generations in flight).
    cost: p.CostReport = field(default_factory=lambda: p.CostReport(seconds_per_unit=1.0))
    max_batch: int = 1
    busy_fraction: float = 0.0
    # A video model's frame limits (and max_side, its video sizes); None: an image model.
    video_limits: pv.Limits | None = None
    video_max_queue: int = 8  # unfinished jobs it holds, then overloaded
    video_submits: list[tuple[v.VideoRequest, int]] = field(default_factory=list)  # and blobs
    video_cancelled: list[str] = field(default_factory=list)  # unfinished jobs deleted
    video_fail_prompts: set[str] = field(default_factory=set)  # jobs that fail at their end
    # Set: a video delete waits for it before it is done and answered (pings still are).
    delete_gate: asyncio.Event | None = None
    deletes_waiting: int = 0
    draining: bool = False  # see drain()
    # The next this-many state-changing ops find another router's op (an adapter
    # ``foreign-<version>``) landed here just before them.
    foreign_ops: int = 0
    # Its LoRA adapter cache, in its pings (None: a replica without one). A generation
    # naming adapters makes them resident here (a hit, or a miss and a load).
    adapters: p.AdapterReport | None = None
    opened: list[rt.SessionParams | None] = field(default_factory=list)  # sessions' params

    def __post_init__(self) -> None:
        # A gatekeeper is one per context: a secured stub has a context of its own.
        self._own_ctx = zmq.asyncio.Context() if self.key is not None else None
        ctx = self._own_ctx or self.ctx
        self.gate = Gatekeeper(ctx, self.key) if self.key is not None else None
        self.sock = bind_router(ctx, "tcp://127.0.0.1:0", key=self.key)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._generating: set[asyncio.Task[None]] = set()
        self._work: dict[tuple[bytes, str], asyncio.Task[None]] = {}  # generations by sender
        self._units: dict[tuple[bytes, str], float] = {}  # their cost units
        self._tenants: dict[tuple[bytes, str], str] = {}  # their tenants (the header's)
        self._task = asyncio.create_task(self._serve())
        self._png = _png()
        self._jobs: dict[str, v.VideoJob] = {}  # the job book, in submission order
        self._runs: dict[str, asyncio.Task[None]] = {}  # unfinished jobs
        self._video_turn = asyncio.Lock()  # one job runs at a time, in order
        self.sessions: dict[str, _StubSession] = {}  # realtime sessions held

    def reboot(self) -> None:
        """A restarted gang: same address, boot state, no jobs."""
        self.held, self.boot_id = StateDoc(), uuid.uuid4().hex
        for run in self._runs.values():
            run.cancel()
        self._jobs.clear()
        self._runs.clear()

    def job(self, job_id: str) -> v.VideoJob | None:
        return self._jobs.get(job_id)

    def drain(self) -> None:
        """Shutting down, as a driver's ingress does: pings say so, submits are refused,
        and its unfinished jobs fail ``unavailable`` (their router runs them again)."""
        self.draining = True
        for job_id, run in list(self._runs.items()):
            run.cancel()
            job = self._jobs[job_id]
            job.status, job.completed_at = v.FAILED, int(time.time())
            job.error = v.VideoError(code=p.UNAVAILABLE, message="the replica is shutting down")
            self._units.pop((_JOB, job_id), None)
        self._runs.clear()

    async def close(self) -> None:
        self._task.cancel()
        runs = list(self._runs.values())
        for task in [self._task, *runs]:
            task.cancel()
        for task in [self._task, *runs]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.sock.close(linger=0)
        if self.gate is not None:
            self.gate.close()
        if self._own_ctx is not None:
            self._own_ctx.term()

    async def _serve(self) -> None:
        while True:
            identity, *frames = await self.sock.recv_multipart()
            if self.stopped.is_set():
                continue  # a SIGSTOPped process: nothing is read, nothing answered
            message = p.decode(frames)
            if message.kind == p.PING and self.late_pings:
                self.late_pings -= 1
                late = asyncio.create_task(self._late(identity, message))
                self._generating.add(late)
                late.add_done_callback(self._generating.discard)
                continue
            if message.kind == p.CONTROL and self.checksum_s:
                request = message.body_as(p.ControlRequest)
                if request.op == "get_weights_checksum":
                    self.calls.append(request.op)
                    task = asyncio.create_task(self._checksum(identity, message))
                    self._generating.add(task)
                    task.add_done_callback(self._generating.discard)
                    continue
            if message.kind == p.GENERATE:
                key = (identity, message.id)
                task = asyncio.create_task(self._generate(identity, message))
                self._work[key] = task
                self._tenants[key] = message.tenant
                task.add_done_callback(functools.partial(self._done, key))
                continue
            if message.kind == p.CANCEL:
                await self._cancel(identity, message)
                continue
            if self.delete_gate is not None and _is_delete(message):
                task = asyncio.create_task(self._gated(identity, message, self.delete_gate))
                self._generating.add(task)
                task.add_done_callback(self._generating.discard)
                continue
            try:
                if message.kind == p.VIDEO:
                    reply = self._video(message)
                elif message.kind == p.SESSION:
                    reply = self._session(message)
                else:
                    reply = self._answer(message)
            except p.RequestError as exc:
                reply = p.encode_error(message.id, exc)
            await self.sock.send_multipart([identity, *reply])

    def _done(self, key: tuple[bytes, str], _: object = None) -> None:
        self._work.pop(key, None)
        self._units.pop(key, None)
        self._tenants.pop(key, None)

    async def _gated(self, identity: bytes, message: p.Message, gate: asyncio.Event) -> None:
        self.deletes_waiting += 1
        try:
            await gate.wait()
        finally:
            self.deletes_waiting -= 1
        try:
            reply = self._video(message)
        except p.RequestError as exc:
            reply = p.encode_error(message.id, exc)
        await self.sock.send_multipart([identity, *reply])

    async def _late(self, identity: bytes, message: p.Message) -> None:
        await asyncio.sleep(self.late_ping_s)
        await self.sock.send_multipart([identity, *self._answer(message)])

    async def _checksum(self, identity: bytes, message: p.Message) -> None:
        await asyncio.sleep(self.checksum_s)
        result = {"checksums": {"transformer": self.held.state.digest()}}
        reply = p.ControlResult(op="get_weights_checksum", replica=self.replica, result=result)
        await self.sock.send_multipart([identity, *p.encode(p.RESULT, message.id, reply)])

    async def _cancel(self, identity: bytes, message: p.Message) -> None:
        request: p.CancelRequest = message.body_as(p.CancelRequest)
        keys = [
            k
            for k in self._work
            if k[1] == request.request_id
            and (request.any_client or k[0] == identity)
            and (not request.any_client or may_see(request.scope, self._tenants.get(k, "")))
        ]
        for key in keys:
            self._work.pop(key).cancel()
            self.cancelled.append(request.request_id)
            error = p.RequestError(p.CANCELLED, "cancelled by its client")
            await self.sock.send_multipart([key[0], *p.encode_error(key[1], error)])
        if request.any_client:
            found = p.CANCEL_RUNNING if keys else p.CANCEL_NOT_FOUND
            answer = p.CancelResult(request_id=request.request_id, found=found)
            await self.sock.send_multipart([identity, *p.encode(p.RESULT, message.id, answer)])

    async def _generate(self, identity: bytes, message: p.Message) -> None:
        try:
            params = pv.parse_generate(message.body_as(dict), pv.Limits(), blobs=len(message.blobs))
        except p.RequestError as exc:
            await self.sock.send_multipart([identity, *p.encode_error(message.id, exc)])
            return
        self.received.append((params, len(message.blobs)))
        self._cache(params.lora)
        self._units[(identity, message.id)] = cost_units(params, self.cost)
        await asyncio.sleep(self.generate_s)
        steps = params.num_inference_steps or 4
        width, height = params.width or 16, params.height or 16
        shown = 0
        for step in range(1, steps + 1):
            await asyncio.sleep(self.step_s)
            # previews at evenly spread steps, as a worker takes them
            while shown < params.partial_images and step >= (shown + 1) * steps / (
                params.partial_images + 1
            ):
                for image in range(params.n):
                    preview = p.PartialImage(
                        image=image, index=shown, step=step, steps=steps, blob=0,
                        format=params.output_format, width=width, height=height,
                    )  # fmt: skip
                    frames = p.encode(p.PARTIAL, message.id, preview, [self.preview or self._png])
                    await self.sock.send_multipart([identity, *frames])
                shown += 1
        if self.stopped.is_set():
            return
        self.generated += 1
        edit = params.edit
        out = [message.blobs[edit.images[0]] if edit else self._png] * params.n
        seeds = params.seed or [1 + i for i in range(params.n)]
        fmt = params.output_format
        metas = [
            p.ImageMeta(index=i, blob=i, seed=s, format=fmt, width=width, height=height)
            for i, s in enumerate(seeds)
        ]
        result = p.GenerateResult(
            images=metas,
            replica=self.replica,
            inference_time_s=self.generate_s + steps * self.step_s,
            queue_time_s=0.0,
            peak_memory_mb=0.0,
            encode_time_s=0.001,
        )
        await self.sock.send_multipart([identity, *p.encode(p.RESULT, message.id, result, out)])

    def _cache(self, refs: list[p.LoraRef] | None) -> None:
        cache = self.adapters
        if cache is None:
            return
        for ref in refs or ():
            if ref.name in cache.resident:
                cache.hits += 1
                continue
            cache.misses += 1
            cache.loads += 1
            cache.resident.append(ref.name)
            if ref.path is not None:
                cache.known[ref.name] = ref.path

    def _answer(self, message: p.Message) -> list[bytes]:
        if message.kind == p.PING:
            ping = p.PingResult(
                replica=self.replica,
                boot_id=self.boot_id,
                status="draining" if self.draining else "ok",
                busy=False,
                queue_depth=max(0, len(self._units) - self.max_batch),  # beyond one batch
                served=self.generated,
                released=self.held.state.released,
                progress_age_s=0.0,
                control=self.held.to_builtins(),
                max_batch=self.max_batch,
                cost=self.cost,
                outstanding_units=sum(self._units.values()),
                busy_fraction=self.busy_fraction,
                adapters=self.adapters,
            )
            return p.encode(p.RESULT, message.id, ping)
        request: p.ControlRequest = message.body_as(p.ControlRequest)
        self.calls.append(request.op)
        result = self._control(request)
        return p.encode(
            p.RESULT,
            message.id,
            p.ControlResult(op=request.op, replica=self.replica, result=result),
        )

    def _control(self, request: p.ControlRequest) -> dict[str, Any]:
        if request.op == "model_info":
            features = {**FEATURES, **self.features}
            if self.video_limits is not None:
                limits = self.video_limits
                features["video"] = {
                    "max_frames": limits.max_frames,
                    "frame_factor": limits.frame_factor,
                    "default_frames": limits.default_frames,
                    "default_fps": limits.default_fps,
                    "image_to_video": True,
                    "text_to_video": True,
                }
            return {**model_info(self.replica), "features": features}
        if request.op == "list_loras":
            return {"loaded": sorted(self.held.state.loras)}
        if request.state is None:
            raise p.RequestError(p.INVALID_REQUEST, "this stub takes states from routers only")
        doc = parse_doc(request.state)
        if self.foreign_ops and request.op != p.SYNC_STATE:
            self.foreign_ops -= 1  # another router's op lands here first
            loras = {**self.held.state.loras, f"foreign-{self.held.version + 1}": "/loras/x"}
            state = msgspec.structs.replace(self.held.state, loras=loras)
            self.held = self.held.successor("set_lora", state)
        refused = refusal(self.held, doc, request.op)
        if refused is not None:
            raise p.RequestError(p.CONFLICT, refused)
        wanted = {*doc.state.loras.values(), *(w.path for w in doc.state.weights.values())}
        bad = sorted(wanted & self.fail_paths)
        if bad:
            raise p.RequestError(p.INVALID_REQUEST, f"lora_path {bad[0]!r} does not exist")
        self.held = doc
        out = {} if request.op == p.SYNC_STATE else answer(request.op, request.args, doc.state)
        return {**out, "state": doc.to_builtins()}

    # ------------------------------------------------------------ realtime sessions

    def _session(self, message: p.Message) -> list[bytes]:
        """A session as the worker's host keeps it: its tenant, epoch and frames; every
        frame is the stub's PNG."""
        request = rt.session_request(message.body_as(rt.SessionRequest))
        sid = request.session_id
        if request.action == rt.OPEN:
            self.sessions[sid] = _StubSession(request.tenant)
            self.opened.append(request.params)
            return self._session_frame(message.id, sid, self.sessions[sid])
        held = self.sessions.get(sid)
        scope = request.scope if request.action == rt.RESUME else None
        if held is None or not may_see(scope, held.tenant):
            raise p.RequestError(p.NOT_FOUND, f"no session {sid!r} here")
        if request.action == rt.STEP:
            held.frames += 1
            return self._session_frame(message.id, sid, held)
        if request.action == rt.RESUME:
            held.epoch += 1
        else:
            del self.sessions[sid]
        info = rt.SessionInfo(
            session_id=sid,
            replica=self.replica,
            epoch=held.epoch,
            frames=held.frames,
            state_bytes=0,
            released=request.action == rt.CLOSE,
        )
        return p.encode(p.RESULT, message.id, info)

    def _session_frame(self, message_id: str, sid: str, held: _StubSession) -> list[bytes]:
        meta = rt.FrameResult(
            session_id=sid,
            replica=self.replica,
            index=held.frames - 1,
            epoch=held.epoch,
            blob=0,
            format="png",
            width=16,
            height=16,
            inference_time_s=0.0,
            state_bytes=0,
        )
        return p.encode(p.RESULT, message_id, meta, [self._png])

    # ------------------------------------------------------------ video jobs

    def _video(self, message: p.Message) -> list[bytes]:
        request: v.VideoRequest = message.body_as(v.VideoRequest)
        blobs: list[bytes] = []
        if request.action == v.SUBMIT:
            body: Any = self._submit(request, len(message.blobs))
        elif request.action == v.LIST:
            jobs = [j for j in reversed(self._jobs.values()) if may_see(request.scope, j.tenant)]
            body = v.VideoList(jobs=jobs)
        elif request.action == v.GET:
            body = self._held(request.job_id, request.scope)
        elif request.action == v.CONTENT:
            job = self._held(request.job_id, request.scope)
            if job.status != v.COMPLETED:
                raise p.RequestError(p.CONFLICT, f"video job {job.id} is {job.status}")
            body = v.VideoContent(
                id=job.id, variant=request.variant, media_type=v.MEDIA_TYPES[request.variant]
            )
            blobs = [MP4 if request.variant == v.VIDEO_VARIANT else JPEG]
        elif request.action == v.DELETE:
            body = self._held(request.job_id, request.scope)
            del self._jobs[request.job_id]
            run = self._runs.pop(request.job_id, None)
            if run is not None:
                run.cancel()
                self._units.pop((_JOB, request.job_id), None)
                self.video_cancelled.append(request.job_id)
                body.status = v.CANCELLED
        else:
            raise p.RequestError(p.INVALID_REQUEST, f"unknown video action {request.action!r}")
        return p.encode(p.RESULT, message.id, body, blobs)

    def _held(self, job_id: str, scope: str | None = None) -> v.VideoJob:
        job = self._jobs.get(job_id)
        if job is None or not may_see(scope, job.tenant):
            raise p.RequestError(p.NOT_FOUND, f"video job {job_id} is not held by this replica")
        return job

    def _submit(self, request: v.VideoRequest, blobs: int) -> v.VideoJob:
        limits = self.video_limits
        if limits is None:
            raise p.RequestError(p.UNSUPPORTED, "this model makes images, not videos")
        params = request.params
        if params is None or params.video is None:
            raise p.RequestError(p.INVALID_REQUEST, "a video submit needs params.video")
        if self.draining:
            raise p.RequestError(p.UNAVAILABLE, f"replica {self.replica} is shutting down")
        if request.job_id in self._runs:  # a re-run sent twice
            return self._jobs[request.job_id]
        if len(self._runs) >= self.video_max_queue:
            raise p.RequestError(p.OVERLOADED, f"replica {self.replica} queue is full")
        spec = v.resolve_frames(params.video, limits)
        width, height = params.width or 64, params.height or 64
        if max(width, height) > limits.max_side:
            raise pv.invalid_fields(
                [p.FieldError("size", f"is {width}x{height}; videos here are at most "
                              f"{limits.max_side} a side")]
            )  # fmt: skip
        assert spec.num_frames is not None and spec.fps is not None and spec.seconds is not None
        job = v.VideoJob(
            id=request.job_id,
            status=v.QUEUED,
            created_at=request.created_at,
            prompt=params.prompt,
            width=width,
            height=height,
            num_frames=spec.num_frames,
            fps=spec.fps,
            seconds=spec.seconds,
            seed=params.seed[0] if params.seed else 1,
            num_inference_steps=params.num_inference_steps,
            replica=self.replica,
            attempt=request.attempt,
            estimated_time_s=request.estimated_s,
            tenant=request.tenant,
        )
        self.video_submits.append((request, blobs))
        self._jobs[job.id] = job
        self._units[(_JOB, job.id)] = cost_units(params, self.cost)
        self._runs[job.id] = asyncio.create_task(self._run(job))
        return job

    async def _run(self, job: v.VideoJob) -> None:
        steps = job.num_inference_steps or 4
        async with self._video_turn:
            job.status = v.IN_PROGRESS
            for step in range(1, steps + 1):
                await asyncio.sleep(self.step_s)
                while self.stopped.is_set():  # a SIGSTOPped gang makes no progress
                    await asyncio.sleep(0.01)
                job.progress = step * 99 // steps
            now = int(time.time())
            if job.prompt in self.video_fail_prompts:  # a pipeline error (the job's fault)
                job.status, job.completed_at = v.FAILED, now
                job.error = v.VideoError(code=p.INTERNAL, message="the stub pipeline failed")
                self._runs.pop(job.id, None)
                self._units.pop((_JOB, job.id), None)
                return
            job.status, job.progress, job.bytes = v.COMPLETED, 100, len(MP4)
            job.completed_at, job.expires_at = now, now + 3600
            job.inference_time_s = steps * self.step_s
            self._runs.pop(job.id, None)
            self._units.pop((_JOB, job.id), None)


@dataclass
class _StubSession:
    tenant: str
    epoch: int = 0
    frames: int = 1


def _is_delete(message: p.Message) -> bool:
    return message.kind == p.VIDEO and message.body_as(v.VideoRequest).action == v.DELETE


def direct_state(op: str, args: dict[str, Any], base: StateDoc) -> StateDoc:
    """The document a router would make for ``op`` over ``base``."""
    return base.successor(op, reduce(base.state, op, args, base.version + 1))


def run_in_context(scenario: Callable[[zmq.asyncio.Context], Awaitable[T]]) -> T:
    """``scenario`` run to its end with a ZMQ context for its stubs and pools, the
    context terminated after (which waits for every socket in it to be closed). A
    scenario that fails leaves sockets open: they are closed at once, so the failure
    is reported instead of hanging in ``term`` until the test's timeout."""

    async def main() -> T:
        ctx = zmq.asyncio.Context()
        try:
            result = await scenario(ctx)
        except BaseException:
            ctx.destroy(linger=0)
            raise
        ctx.term()
        return result

    return asyncio.run(main())
