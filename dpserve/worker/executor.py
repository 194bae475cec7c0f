"""Runs one gang command on every rank; only the driver (output rank) produces a reply."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from dpserve.config.worker import WorkerConfig
from dpserve.contract import realtime as rt
from dpserve.contract.model_info import decode as decode_model_info
from dpserve.contract.model_info import gathered
from dpserve.contract.protocol import (
    INTERNAL,
    RESULT,
    ControlRequest,
    ControlResult,
    ErrorBody,
    GenerateParams,
    GenerateResult,
    ImageMeta,
    RequestError,
    encode,
    encode_error,
)
from dpserve.worker import call_settings, video_call
from dpserve.worker.batch import split
from dpserve.worker.batch_call import batch_kwargs
from dpserve.worker.comm import GangComm
from dpserve.worker.commands import GangStatus, Generation
from dpserve.worker.compile import Compiler
from dpserve.worker.control import ControlOps, GangDiverged, PeerFailed
from dpserve.worker.cost_shape import cost_shape
from dpserve.worker.denoiser import HaltCheck, Halted, StopGate
from dpserve.worker.denoiser_stack import DenoiserStack
from dpserve.worker.edit import edit_call
from dpserve.worker.encode import encode_image
from dpserve.worker.features import Features, features_of
from dpserve.worker.lora_cache import AdapterCache
from dpserve.worker.lora_request import RequestAdapters
from dpserve.worker.parallel import ModelParallel
from dpserve.worker.pipeline import (
    Pipeline,
    cfg_requested,
    guides_by_scale,
    pipe_output,
    size_factor,
)
from dpserve.worker.preview import Emit, Previews, can_preview, output_size
from dpserve.worker.reply import Reply
from dpserve.worker.sessions import Rendered, Session, SessionHost, SessionLimits
from dpserve.worker.splittable import text_prefix, text_split
from dpserve.worker.step_cache import StepCaches
from dpserve.worker.weights import peak_memory_mb, reset_peak_memory

log = logging.getLogger(__name__)


class _RankOutcome(msgspec.Struct, kw_only=True):
    ok: bool
    result: dict[str, Any] = msgspec.field(default_factory=dict)
    error: ErrorBody | None = None
    echo: bool = False  # failed only because another rank did (control.PeerFailed)


_OUTCOME_DECODER = msgspec.msgpack.Decoder(_RankOutcome)


def denoiser_of(pipe: Pipeline) -> torch.nn.Module:
    module = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{type(pipe).__name__} has neither a transformer nor a unet")
    return module


def denoisers_of(pipe: Pipeline) -> list[torch.nn.Module]:
    """The pipeline's denoiser, and its second one where it has one (Wan 2.2's
    low-noise expert, ``transformer_2``): the stack patches each."""
    second = getattr(pipe, "transformer_2", None)
    return [denoiser_of(pipe), *([second] if isinstance(second, torch.nn.Module) else [])]


@dataclass
class Executor:
    pipe: Pipeline
    comm: GangComm
    ops: ControlOps
    status: GangStatus
    device: torch.device
    call_defaults: dict[str, Any]
    fixed_kwargs: dict[str, Any]  # pipeline arguments set at start-up, for every request
    session_limits: SessionLimits = field(default_factory=SessionLimits)
    parallel: ModelParallel | None = None
    step_caches: StepCaches = field(default_factory=lambda: StepCaches(()))  # what it offers
    compiler: Compiler | None = None  # --compile
    max_frames: int = WorkerConfig.max_frames  # --max-frames (a video model's)
    lora_cache_mb: int = WorkerConfig.lora_cache_mb  # --lora-cache-mb
    _gate: StopGate | None = field(default=None, init=False, repr=False)  # while generating

    def __post_init__(self) -> None:
        self.stack = DenoiserStack(
            self.comm.info.cfg_rank,
            self.comm.cfg_group,
            self._progress,
            self.parallel.wrap if self.parallel is not None else None,
            self.compiler,
        )
        self.split_ok = self.stack.can_split(denoiser_of(self.pipe))
        self.by_guidance = guides_by_scale(self.pipe)  # its guidance_scale is CFG (Wan)
        self.status.control = self.ops.held().to_builtins()
        self.adapters = RequestAdapters(
            self.pipe,
            self.ops.parallel,
            self.ops.loras,
            self.ops.applier.allowed,
            AdapterCache(self.lora_cache_mb << 20),
        )
        self._report_adapters()
        self.sessions = SessionHost(
            self.pipe, self.call_defaults, self.fixed_kwargs, self.session_limits, self.run_pipe
        )
        self.features: Features = features_of(
            self.pipe,
            step_caches=self.step_caches,
            max_frames=self.max_frames,
            settings=self._call_settings(),
        )
        video = self.features.video
        shape = cost_shape(self.pipe, self.call_defaults, self.fixed_kwargs, video)
        self.status.calibration.configure(shape)

    def _call_settings(self) -> call_settings.CallSettings:
        """What a request may set on this replica's calls: text tokens up to the
        service's, splitting evenly where a sequence split cuts them too (with the
        CLIP tokens SD3 puts ahead of them)."""
        accepted = self.call_defaults
        text = self.fixed_kwargs.get("max_sequence_length", accepted.get("max_sequence_length"))
        length = int(text) if "max_sequence_length" in accepted and text is not None else None
        layout = self.parallel.layout if self.parallel is not None else None
        kind = type(denoiser_of(self.pipe)).__name__
        multiple = text_split(kind, layout.sp, layout.cfg) if layout is not None else 1
        prefix = text_prefix(kind, int(getattr(self.pipe, "tokenizer_max_length", 77)))
        return call_settings.offer(self.pipe, length, multiple, prefix if multiple > 1 else 0)

    def _progress(self) -> None:
        self.status.progress_at = time.monotonic()

    # ------------------------------------------------------------ generation

    def run_pipe(self, pipe: Pipeline, kwargs: dict[str, Any], params: GenerateParams) -> Any:
        """One pipeline call on this rank, with the request's own LoRA adapters (the
        gang agrees they are resident first: worker/lora_request.py) and the denoiser
        split when CFG asks for it (and, for a generation, its stop gate)."""
        self.ops.require_weights()
        split = self.split_ok and cfg_requested(params, self.call_defaults, self.by_guidance)
        cache = self.step_caches.resolve(params.step_cache)
        try:
            with self.adapters.applied(params.lora, self._agree_refusal):
                # The adapters are in place before the stack wraps the denoiser (tp
                # re-plans a layer's pieces when an adapter wraps it).
                denoisers = denoisers_of(pipe)
                reset_peak_memory(self.device)
                with self.stack.applied(denoisers, split, cache, self._gate):
                    return pipe_output(pipe(**kwargs))
        finally:
            if params.lora is not None:
                self._report_adapters()

    def _agree_refusal(self, mine: RequestError | None) -> RequestError | None:
        """Every rank's refusal of a request's adapters gathered: the first rank's, on
        every rank (None when no rank refused)."""
        payload = b"" if mine is None else msgspec.msgpack.encode(mine.body())
        for got in self.comm.gather_bytes(payload):
            if got:
                body = msgspec.msgpack.decode(got, type=ErrorBody)
                return RequestError(body.code, body.message, body.fields)
        return None

    def _report_adapters(self) -> None:
        """The pings' view of the adapter cache (a new object: the driver's thread reads it)."""
        self.status.adapters = self.adapters.cache.report(dict(self.ops.loras.loaded))

    def generate(
        self,
        request_id: str,
        params: GenerateParams,
        queue_s: float,
        halt: HaltCheck | None = None,
        blobs: Sequence[bytes] = (),
        emit: Callable[[list[bytes]], None] | None = None,
    ) -> list[bytes]:
        """One request on its own (a batch of one), its answers as wire frames (empty
        on a rank that is not the output rank): see :meth:`generate_batch`."""
        batch = [Generation(id=request_id, params=params)]
        interim = None if emit is None else (lambda reply: emit(reply.frames()))
        [reply] = self.generate_batch(batch, [queue_s], halt, blobs, interim)
        return reply.frames() if reply is not None else []

    def generate_batch(
        self,
        batch: Sequence[Generation],
        queue_s: Sequence[float],
        halt: HaltCheck | None = None,
        blobs: Sequence[bytes] = (),
        emit: Emit | None = None,
    ) -> list[Reply | None]:
        """Every rank runs one pipeline call for the batch's compatible requests
        (worker/batch.py); the output rank splits its images back and returns each
        request's reply, in batch order (the other ranks return None for each).

        ``halt`` is the driver's: at each denoising step it says whether the batch
        was cancelled or passed its deadline (every request of it), and the whole
        gang drops it there. ``blobs`` are an edit's uploads and ``emit`` hands the
        interim replies (previews, a video's progress) to the driver's output path:
        both only in a batch of one request. ``queue_s`` is each request's time in
        the queue; a reply's inference time is the batch's. A video is always a batch
        of its own, and its reply holds the mp4 (worker/video_call.py).
        """
        start = time.perf_counter()
        swapped = self.adapters.cache.swap_seconds
        output_rank = self.comm.info.is_output_rank
        group = self.comm.cpu_group if self.comm.size > 1 else None
        self._gate = StopGate(group, self.comm.info.replica_group[0], halt)
        params = [g.params for g in batch]
        first = params[0]
        try:
            problem = video_call.refusal(first, self.features.video)
            if problem is not None:
                raise problem
            if first.video is not None:
                pipe, kwargs = self.pipe, self._video_kwargs(batch[0], blobs, emit)
                watch: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            else:
                pipe, kwargs, watch = self._image_call(batch, blobs, emit)
            # The request's scheduler goes in before the previews hook its steps.
            with self.features.settings.applied(pipe, first), watch:
                images = self.run_pipe(pipe, kwargs, first)
        except Halted as exc:
            if output_rank:
                log.info("generation %s: %s", _ids(batch), exc)
            return [Reply.error(g.id, exc) for g in batch]
        except RequestError as exc:
            return [Reply.error(g.id, exc) for g in batch]
        except Exception as exc:
            log.exception("generation %s failed", _ids(batch))
            failed = RequestError(INTERNAL, f"generation failed: {exc}")
            return [Reply.error(g.id, failed) for g in batch]
        finally:
            self._gate = None
        inference_s = time.perf_counter() - start
        peak_mb = self._gang_peak_mb()
        if not output_rank:
            return [None for _ in batch]
        # The router's cost model learns this replica's seconds per unit (dpserve.contract.cost),
        # without the adapter loads and evictions: the router adds those where a replica
        # lacks a request's adapters (docs/lora.md), and a cache that churns must not
        # look like a slower replica.
        units = sum(self.status.calibration.units(p) for p in params)
        swap_s = self.adapters.cache.swap_seconds - swapped
        self.status.calibration.observe(units, inference_s - swap_s)
        if first.video is not None:
            times = (queue_s[0], inference_s)
            replica = self.comm.info.replica
            return [video_call.video_reply(batch[0].id, first, images, replica, times, peak_mb)]
        return [
            self._reply(g, mine, waited, inference_s, peak_mb)
            for g, mine, waited in zip(batch, split(images, params), queue_s, strict=True)
        ]

    def _image_call(
        self, batch: Sequence[Generation], blobs: Sequence[bytes], emit: Emit | None
    ) -> tuple[Pipeline, dict[str, Any], contextlib.AbstractContextManager[None]]:
        """An image batch's pipeline (an edit's sibling), arguments and previews."""
        params = [g.params for g in batch]
        first = params[0]
        output_rank = self.comm.info.is_output_rank
        # Only the output rank decodes latents to pixels; the others skip the VAE.
        output_type = "pil" if output_rank else "latent"
        kwargs = {**self.fixed_kwargs, **batch_kwargs(params, self.call_defaults, output_type)}
        pipe = self.pipe
        if first.edit is not None:
            pipe, extra = edit_call(self.pipe, first, blobs, size_factor(self.pipe))
            kwargs.update(extra)
        watch: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if first.partial_images and output_rank and emit is not None and can_preview(pipe):
            previews = Previews(batch[0].id, first, output_size(pipe, kwargs), emit)
            kwargs["callback_on_step_end"] = previews
            kwargs["callback_on_step_end_tensor_inputs"] = ["latents"]
            watch = previews.watching(pipe)
        return pipe, kwargs, watch

    def _video_kwargs(
        self, generation: Generation, blobs: Sequence[bytes], emit: Emit | None
    ) -> dict[str, Any]:
        """A video's arguments (its input image among ``blobs``): frames on the output
        rank (which alone decodes), with its progress after every step where the
        driver can send it."""
        params = generation.params
        output_rank = self.comm.info.is_output_rank
        output_type = "np" if output_rank else "latent"
        kwargs = video_call.video_kwargs(params, self.call_defaults, output_type, blobs)
        if output_rank and emit is not None:
            steps = params.num_inference_steps or self.call_defaults.get("num_inference_steps")
            progress = video_call.StepProgress(generation.id, int(steps or 0), emit)
            kwargs["callback_on_step_end"] = progress
        return {**self.fixed_kwargs, **kwargs}

    def _reply(
        self,
        generation: Generation,
        images: list[Any],
        queue_s: float,
        inference_s: float,
        peak_mb: float,
    ) -> Reply:
        """One request's reply: its own images, seeds and queue time."""
        params = generation.params
        assert params.seed is not None
        fmt, compression = params.output_format, params.output_compression
        encoding = time.perf_counter()
        files = [encode_image(img, fmt, compression) for img in images]
        encode_s = time.perf_counter() - encoding
        metas = [
            ImageMeta(
                index=i,
                blob=i,
                seed=params.seed[i],
                format=fmt,
                width=img.width,
                height=img.height,
            )
            for i, img in enumerate(images)
        ]
        result = GenerateResult(
            images=metas,
            replica=self.comm.info.replica,
            inference_time_s=inference_s,
            queue_time_s=queue_s,
            peak_memory_mb=peak_mb,
            encode_time_s=encode_s,
        )
        return Reply(RESULT, generation.id, result, tuple(files))

    def _gang_peak_mb(self) -> float:
        """The largest peak memory of any rank of the gang during the last call."""
        mine = struct.pack("<d", peak_memory_mb(self.device))
        return max(struct.unpack("<d", b)[0] for b in self.comm.gather_bytes(mine))

    # ------------------------------------------------------------ realtime sessions

    def session(
        self, request_id: str, request: rt.SessionRequest, blobs: list[bytes]
    ) -> list[bytes]:
        """Open, step, resume or close a session; a rendered frame is the reply's blob."""
        output_rank = self.comm.info.is_output_rank
        host, sid = self.sessions, request.session_id
        try:
            if request.action == rt.OPEN:
                assert request.params is not None  # checked by the driver's admission
                first = blobs[request.first_frame] if request.first_frame is not None else None
                rendered = host.open(sid, request.params, first, output_rank, request.tenant)
                return self._frame(request_id, sid, rendered)
            if request.action == rt.STEP:
                rendered = host.step(sid, request.epoch, request.prompt, output_rank)
                return self._frame(request_id, sid, rendered)
            if request.action == rt.RESUME:
                session, released = host.resume(sid, request.scope), False
            else:
                found = host.close(sid, request.epoch)
                if found is None:
                    return encode(RESULT, request_id, self._info(sid, None, released=False))
                session, released = found, True
            return encode(RESULT, request_id, self._info(sid, session, released))
        except RequestError as exc:
            return encode_error(request_id, exc)
        except Exception as exc:
            log.exception("session %s: %s failed", sid, request.action)
            host.close(sid)  # its state may be half-updated: better gone than wrong
            return encode_error(
                request_id, RequestError(INTERNAL, f"session {request.action} failed: {exc}")
            )
        finally:
            self.status.sessions = len(host.sessions)
            self.status.session_bytes = host.state_bytes

    def _frame(self, request_id: str, sid: str, rendered: Rendered) -> list[bytes]:
        if rendered.image is None:
            return []
        session = rendered.session
        fmt = session.params.output_format
        body = rt.FrameResult(
            session_id=sid,
            replica=self.comm.info.replica,
            index=session.frames - 1,
            epoch=session.epoch,
            blob=0,
            format=fmt,
            width=rendered.image.width,
            height=rendered.image.height,
            inference_time_s=rendered.seconds,
            state_bytes=session.state_bytes,
        )
        return encode(RESULT, request_id, body, [encode_image(rendered.image, fmt)])

    def _info(self, sid: str, session: Session | None, released: bool) -> rt.SessionInfo:
        return rt.SessionInfo(
            session_id=sid,
            replica=self.comm.info.replica,
            epoch=session.epoch if session else 0,
            frames=session.frames if session else 0,
            state_bytes=session.state_bytes if session else 0,
            released=released,
        )

    # ------------------------------------------------------------ control

    def _agree(self, ok: bool) -> bool:
        return all(v == b"1" for v in self.comm.gather_bytes(b"1" if ok else b"0"))

    def control(self, request_id: str, request: ControlRequest, replica: int) -> list[bytes]:
        try:
            result = self.ops.run(request, self._agree)
            outcome = _RankOutcome(ok=True, result=result)
        except PeerFailed as exc:
            outcome = _RankOutcome(ok=False, error=exc.body(), echo=True)
        except RequestError as exc:
            outcome = _RankOutcome(ok=False, error=exc.body())
        except GangDiverged:
            raise  # the ranks may differ now: only a restart is safe
        except Exception as exc:
            log.exception("control op %s failed", request.op)
            outcome = _RankOutcome(ok=False, error=ErrorBody(code=INTERNAL, message=str(exc)))
        self.adapters.reconcile()
        self._report_adapters()
        self.status.released = self.ops.released
        self.status.control = self.ops.held().to_builtins()
        gathered = self.comm.gather_bytes(msgspec.msgpack.encode(outcome))
        if not self.comm.info.is_driver:
            return []
        try:
            merged = _merge_ranks(request.op, [_OUTCOME_DECODER.decode(g) for g in gathered])
        except RequestError as exc:
            return encode_error(request_id, exc)
        body = ControlResult(op=request.op, replica=replica, result=merged)
        return encode(RESULT, request_id, body)


def _merge_ranks(op: str, outcomes: list[_RankOutcome]) -> dict[str, Any]:
    """The replica's answer: a failing rank's own error, else rank 0's result.

    A rank that only undid its change because another failed (``echo``) does not
    hide the error that says why. A checksum must be the same on every rank
    (they hold replicated weights); a difference is an error naming the ranks.
    """
    failed = [(rank, o) for rank, o in enumerate(outcomes) if not o.ok]
    if failed:
        rank, outcome = next(((r, o) for r, o in failed if not o.echo), failed[0])
        error = outcome.error or ErrorBody(code=INTERNAL, message="unknown failure")
        prefix = f"rank {rank}: " if rank else ""
        raise RequestError(error.code, prefix + error.message, error.fields)
    if op == "get_weights_checksum":
        return {**_merge_checksums([o.result for o in outcomes]), "ranks": len(outcomes)}
    if op == "model_info":
        return msgspec.to_builtins(gathered([decode_model_info(o.result) for o in outcomes]))
    return {**outcomes[0].result, "ranks": len(outcomes)}


def _merge_checksums(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One checksum per module for the replica, from every rank's.

    Ranks holding the same tensors must agree. A module split by tensor parallel
    is held in pieces: ranks with the same tp rank must agree on their piece, and
    the replica's checksum is a digest of the pieces' checksums in tp order (so two
    replicas with the same layout and weights compare equal), listed in ``shards``.
    """
    first = results[0]
    sharded = set(first.get("sharded", ()))
    merged: dict[str, str] = {}
    shards: dict[str, list[str]] = {}
    for module, digest in first["checksums"].items():
        pieces: dict[int, tuple[int, str]] = {}  # piece -> (first rank holding it, digest)
        for rank, result in enumerate(results):
            mine = result["checksums"].get(module)
            if mine is None:
                continue  # not held by this rank (a text encoder of the output rank's)
            piece = int(result["tp_rank"]) if module in sharded else 0
            holder, held = pieces.setdefault(piece, (rank, mine))
            if mine != held:
                raise RequestError(
                    INTERNAL,
                    f"{module} weights differ between ranks {holder} and {rank} of this "
                    "replica, which should hold the same tensors",
                )
        if module in sharded:
            shards[module] = [pieces[t][1] for t in sorted(pieces)]
            merged[module] = hashlib.sha256("|".join(shards[module]).encode()).hexdigest()
        else:
            merged[module] = digest
    return {"checksums": merged, "shards": shards}


def _ids(batch: Sequence[Generation]) -> str:
    return ", ".join(g.id for g in batch)
