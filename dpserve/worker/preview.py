"""Previews of a running generation, decoded from the current prediction.

After a chosen denoising step the output rank estimates the clean latents the
step is heading for and decodes them like the final image (each family's latent
layout: ``preview_latents.py``). For a flow-matching
scheduler a step moves the latents along the predicted velocity,
``x_next = x_prev + (sigma_next - sigma_prev) * v``, so the two latents around
the step give ``v`` back exactly and ``x0 = x_next - sigma_next * v``. The two
latents are caught at the scheduler's ``step`` (patched on the instance for one
call, like the denoiser): the pipeline's step-end callback sees the latents only
after an inpainting pipeline has pasted the kept pixels back. The scheduler sees
the combined (CFG) prediction on every rank, so a CFG-split gang previews the
same as one process; only the output rank decodes, and nothing here is a
collective, so the other ranks do nothing.

A preview never changes the generation: the callback returns nothing and the
decode draws no random numbers, so the final image is the same bytes with or
without previews.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dpserve.contract.protocol import (
    PARTIAL,
    GenerateParams,
    PartialImage,
)
from dpserve.worker.encode import encode_image
from dpserve.worker.pipeline import Pipeline
from dpserve.worker.preview_latents import decoder
from dpserve.worker.preview_latents import layout as latent_layout
from dpserve.worker.reply import Reply

Emit = Callable[[Reply], None]  # hands one interim answer to the driver's output path


def preview_steps(steps: int, count: int) -> list[int]:
    """The 0-based steps after which previews are taken: evenly spread, distinct, and
    never the last (the final image is that one). Short runs give fewer."""
    if steps < 2:
        return []
    # round((i + 1) * steps / (count + 1)), halves up, in integers: no float ties.
    spread = ((2 * (i + 1) * steps + count + 1) // (2 * (count + 1)) for i in range(count))
    return sorted({min(steps - 2, max(0, s - 1)) for s in spread})


def can_preview(pipe: Pipeline) -> bool:
    """A latent layout ``preview_latents`` knows, from a flow-matching Euler scheduler
    (whose step gives the velocity back exactly, module docstring) and a pipeline
    that calls back after each step."""
    scheduler = getattr(pipe, "scheduler", None)
    return (
        latent_layout(pipe) is not None
        and type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
        and hasattr(scheduler, "sigmas")
        and hasattr(scheduler, "step_index")
        and "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
    )


def output_size(pipe: Pipeline, kwargs: dict[str, Any]) -> tuple[int, int]:
    """The width and height the call renders (the pipeline's default when not given)."""
    default = int(getattr(pipe, "default_sample_size", 128)) * int(pipe.vae_scale_factor)
    return int(kwargs.get("width") or default), int(kwargs.get("height") or default)


class Previews:
    """One request's previews: a scheduler hook that keeps the last step's latents,
    and the step-end callback that decodes and emits them at the chosen steps."""

    def __init__(
        self, request_id: str, params: GenerateParams, size: tuple[int, int], emit: Emit
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.width, self.height = size
        self.emit = emit
        self.decode_s = 0.0  # time spent decoding and encoding previews
        self._around: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._scheduler: Any = None

    @contextlib.contextmanager
    def watching(self, pipe: Pipeline) -> Iterator[None]:
        scheduler = self._scheduler = pipe.scheduler
        original = scheduler.step

        def step(model_output: Any, timestep: Any, sample: torch.Tensor, *a: Any, **kw: Any) -> Any:
            out = original(model_output, timestep, sample, *a, **kw)
            after = out[0] if isinstance(out, tuple) else out.prev_sample
            self._around = (sample, after, int(scheduler.step_index))
            return out

        object.__setattr__(scheduler, "step", step)
        try:
            yield
        finally:
            scheduler.__dict__.pop("step", None)

    def __call__(self, pipe: Pipeline, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        total = int(getattr(pipe, "num_timesteps", 0) or self.params.num_inference_steps or 0)
        chosen = preview_steps(total, self.params.partial_images)
        if i in chosen and self._around is not None:
            start = time.perf_counter()
            self._send(pipe, chosen.index(i), i + 1, total)
            self.decode_s += time.perf_counter() - start
        return {}  # the latents go on unchanged

    def _send(self, pipe: Pipeline, index: int, step: int, steps: int) -> None:
        assert self._around is not None
        before, after, at = self._around
        sigmas = self._scheduler.sigmas
        s_prev, s_next = float(sigmas[at - 1]), float(sigmas[at])
        velocity = (after.float() - before.float()) / (s_next - s_prev)
        clean = after.float() - s_next * velocity
        decoded = decoder(pipe, self.width, self.height)(clean)
        fmt, compression = self.params.output_format, self.params.output_compression
        for image_index, image in enumerate(pipe.image_processor.postprocess(decoded, "pil")):
            body = PartialImage(
                image=image_index,
                index=index,
                step=step,
                steps=steps,
                blob=0,
                format=fmt,
                width=image.width,
                height=image.height,
            )
            blob = encode_image(image, fmt, compression)
            self.emit(Reply(PARTIAL, self.request_id, body, (blob,)))
