"""Realtime session state, held by every rank of the owner's gang.

A session is the last frame's latents plus its own noise generator. The first
frame is an ordinary generation from the session's seed (or an image-to-image
pass over a starting image); each later frame re-noises the previous latents to
``strength`` and denoises them ``frame_steps`` steps under the current prompt,
so frames evolve smoothly. Every rank renders the same frame (CFG-parallel
ranks share the denoiser's work) and keeps its own copy of the state; only the
output rank decodes pixels.

Every rank sees the same command stream, so every rank's table takes the same
decisions (capacity, epochs). Idle expiry is the driver's call, relayed to the
gang as a ``close`` command, for the same reason.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from PIL import Image

from dpserve.contract.owners import may_see
from dpserve.contract.protocol import (
    CONFLICT,
    NOT_FOUND,
    OVERLOADED,
    UNSUPPORTED,
    GenerateParams,
    RequestError,
)
from dpserve.contract.realtime import SessionParams
from dpserve.worker.edit import decode_image, fitted_size, image_to_image
from dpserve.worker.pipeline import Pipeline, pipeline_kwargs, size_factor

log = logging.getLogger(__name__)

# Runs the pipeline (weights check, CFG split) and returns its images.
RunPipe = Callable[[Pipeline, dict[str, Any], GenerateParams], list[Image.Image]]
_NEEDED_ARGS = ("latents", "sigmas", "callback_on_step_end")


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 8
    max_state_bytes: int = 256 << 20
    idle_timeout_s: float = 60.0


@dataclass
class Session:
    params: SessionParams
    prompt: str
    latents: torch.Tensor
    noise: torch.Generator  # re-noising draws from here, so frames are reproducible
    last_used: float
    frames: int = 1
    epoch: int = 0
    tenant: str = ""  # who owns it (dpserve/contract/owners.py)

    @property
    def state_bytes(self) -> int:
        return self.latents.numel() * self.latents.element_size()


@dataclass
class Rendered:
    session: Session
    image: Image.Image | None  # on the output rank only
    seconds: float


class _Capture:
    """A step-end callback keeping the latest latents: after the last step, the frame's."""

    def __init__(self) -> None:
        self.latents: torch.Tensor | None = None

    def __call__(self, pipe: Any, step: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.latents = kwargs["latents"]
        return {}


@dataclass
class SessionHost:
    pipe: Pipeline
    defaults: dict[str, Any]
    fixed_kwargs: dict[str, Any]
    limits: SessionLimits
    run: RunPipe
    sessions: dict[str, Session] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._flat: Any = None  # a scheduler that takes the frame sigmas as given

    # ------------------------------------------------------------ bookkeeping

    @property
    def state_bytes(self) -> int:
        return sum(s.state_bytes for s in self.sessions.values())

    def expired(self, now: float) -> list[str]:
        idle = self.limits.idle_timeout_s
        return [sid for sid, s in self.sessions.items() if now - s.last_used > idle]

    def get(self, session_id: str, epoch: int | None = None, scope: str | None = None) -> Session:
        """``scope``: whose sessions the caller sees; another tenant's is not found,
        word for word as an unknown one."""
        session = self.sessions.get(session_id)
        if session is None or not may_see(scope, session.tenant):
            raise RequestError(
                NOT_FOUND,
                f"no session {session_id!r} here: it was closed, expired after "
                f"{self.limits.idle_timeout_s:g}s idle, or this replica restarted",
            )
        if epoch is not None and epoch != session.epoch:
            raise RequestError(
                CONFLICT,
                f"session {session_id!r} was resumed by another connection; "
                "this one no longer drives it",
            )
        return session

    def resume(self, session_id: str, scope: str | None = None) -> Session:
        session = self.get(session_id, scope=scope)
        session.epoch += 1
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: str, epoch: int | None = None) -> Session | None:
        """Drop a session, unless ``epoch`` says a newer attachment drives it."""
        session = self.sessions.get(session_id)
        if session is None or (epoch is not None and epoch != session.epoch):
            return None
        return self.sessions.pop(session_id)

    # ------------------------------------------------------------ rendering

    def unsupported(self) -> str | None:
        """Why this pipeline cannot hold sessions, or None."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        if not isinstance(self.pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            kind = type(self.pipe.scheduler).__name__
            return f"realtime sessions need a flow-matching scheduler; this pipeline uses {kind}"
        params = inspect.signature(self.pipe.__call__).parameters
        missing = [a for a in _NEEDED_ARGS if a not in params]
        if missing:
            return f"{type(self.pipe).__name__} does not take {', '.join(missing)}"
        return None

    def open(
        self,
        session_id: str,
        params: SessionParams,
        first_frame: bytes | None,
        output_rank: bool,
        tenant: str = "",
    ) -> Rendered:
        reason = self.unsupported()
        if reason is not None:
            raise RequestError(UNSUPPORTED, reason)
        if session_id in self.sessions:
            raise RequestError(CONFLICT, f"session {session_id!r} is already open here")
        if len(self.sessions) >= self.limits.max_sessions:
            raise RequestError(
                OVERLOADED,
                f"this replica holds its maximum of {self.limits.max_sessions} sessions",
            )
        start = time.perf_counter()
        image = decode_image(first_frame, "first_frame") if first_frame is not None else None
        if image is not None and (params.width is None or params.height is None):
            # The frames keep the starting image's size (the model's multiple below it).
            width, height = fitted_size(image.size, size_factor(self.pipe))
            params = msgspec.structs.replace(params, width=width, height=height)
        request = _as_request(params, params.prompt, params.num_inference_steps)
        capture = _Capture()
        kwargs = self._kwargs(request, output_rank, capture)
        pipe = self.pipe
        if image is not None:
            pipe = image_to_image(self.pipe)
            kwargs.update(image=image, strength=params.strength)
        images = self.run(pipe, kwargs, request)
        assert capture.latents is not None, "the pipeline ran no denoising step"
        noise = torch.Generator("cpu").manual_seed((params.seed + 1) % 2**63)
        now = time.monotonic()
        session = Session(params, params.prompt, capture.latents, noise, now, tenant=tenant)
        if session.state_bytes > self.limits.max_state_bytes:
            raise RequestError(
                OVERLOADED,
                f"this session's state takes {session.state_bytes} bytes, over the replica's "
                f"limit of {self.limits.max_state_bytes} (use a smaller size)",
            )
        self.sessions[session_id] = session
        return Rendered(session, images[0] if output_rank else None, time.perf_counter() - start)

    def step(
        self, session_id: str, epoch: int | None, prompt: str | None, output_rank: bool
    ) -> Rendered:
        session = self.get(session_id, epoch)
        start = time.perf_counter()
        params = session.params
        k, s = params.frame_steps, params.strength
        # A frame that fails (weights released, say) leaves the session as it was, so
        # the frames after it are the ones an uninterrupted session renders.
        noise_state = session.noise.get_state()
        # Flow matching: x_s = (1 - s) x_0 + s noise, then denoise from s down to 0.
        noise = torch.randn(session.latents.shape, generator=session.noise)
        noised = (1 - s) * session.latents + s * noise.to(session.latents)
        request = _as_request(params, prompt if prompt is not None else session.prompt, k)
        capture = _Capture()
        kwargs = self._kwargs(request, output_rank, capture)
        kwargs.update(latents=noised, sigmas=[s * (k - i) / k for i in range(k)])
        try:
            with self._flat_schedule():
                images = self.run(self.pipe, kwargs, request)
        except BaseException:
            session.noise.set_state(noise_state)
            raise
        assert capture.latents is not None, "the pipeline ran no denoising step"
        session.latents, session.prompt = capture.latents, request.prompt
        session.frames += 1
        session.last_used = time.monotonic()
        return Rendered(session, images[0] if output_rank else None, time.perf_counter() - start)

    def _kwargs(
        self, request: GenerateParams, output_rank: bool, capture: _Capture
    ) -> dict[str, Any]:
        output_type = "pil" if output_rank else "latent"
        return {
            **self.fixed_kwargs,
            **pipeline_kwargs(request, self.defaults, output_type),
            "callback_on_step_end": capture,
            "callback_on_step_end_tensor_inputs": ["latents"],
        }

    @contextlib.contextmanager
    def _flat_schedule(self) -> Iterator[None]:
        """Swap in a scheduler that uses the frame's sigmas unshifted, for one call."""
        if self._flat is None:
            from diffusers import FlowMatchEulerDiscreteScheduler

            self._flat = FlowMatchEulerDiscreteScheduler.from_config(
                self.pipe.scheduler.config,
                use_dynamic_shifting=False,
                shift=1.0,
                shift_terminal=None,
                use_karras_sigmas=False,
                use_exponential_sigmas=False,
                use_beta_sigmas=False,
                invert_sigmas=False,
            )
        original = self.pipe.scheduler
        self.pipe.scheduler = self._flat
        try:
            yield
        finally:
            self.pipe.scheduler = original


def _as_request(params: SessionParams, prompt: str, steps: int | None) -> GenerateParams:
    return GenerateParams(
        prompt=prompt,
        negative_prompt=params.negative_prompt,
        width=params.width,
        height=params.height,
        num_inference_steps=steps,
        guidance_scale=params.guidance_scale,
        true_cfg_scale=params.true_cfg_scale,
        seed=[params.seed],
        output_format=params.output_format,
        lora=params.lora,  # the session's own adapters, on every frame
    )
