"""What a generation costs, in units a replica calibrates into seconds.

A diffusion transformer's work per denoising step grows with the tokens it attends
over: the image's (one per ``size_factor``² pixels) and, for joint-attention models
(Flux, SD3), the prompt's padded text tokens. So one request costs

    units = n x CFG branches x steps x (megapixels + text_megapixels) x latent frames

where ``text_megapixels`` is what the replica reports its text tokens are worth
(``max_sequence_length x size_factor² / 1e6``; 0 when the prompt does not join the
sequence), steps are scaled by an edit's strength (diffusers runs ``steps x strength``
of them), and a request that names no size or steps gets the replica's defaults. A
video's tokens are a frame's times its latent frames (the VAE packs ``frame_factor``
frames after the first into one: ``(frames - 1) // frame_factor + 1``); an image is
one.
Each replica measures its own seconds per unit (:class:`Calibration`) and reports it
in its pings; the router multiplies. Measured on the ``small`` tiny model (CPU, one
thread): a denoising step at 64² costs about a third of one at 256², not 1/16, and
``text_megapixels`` (77 tokens x 16² = 0.0197) accounts for that; the per-request
rest (text encoding, latents) was within noise of zero at 64², so it is not
modelled, and the VAE decode (about one step's image work) is left to calibration
(docs/router.md, "Routing policies").

Stdlib, msgspec and :mod:`dpserve.contract.protocol` only: the router imports this, and no torch.
"""

from __future__ import annotations

import math
import threading

import msgspec

from dpserve.contract.protocol import (
    CostReport,
    GenerateParams,
)


def cfg_branches(params: GenerateParams, report: CostReport) -> int:
    """Two denoiser passes a step with CFG: true CFG (Flux, Qwen-Image) needs a negative
    prompt and a true_cfg_scale above 1; where guidance_scale is CFG (Wan, SD3:
    ``default_guidance_scale`` set) a scale above 1 is enough."""
    if report.default_guidance_scale is not None:
        guidance = params.guidance_scale
        if guidance is None:
            guidance = report.default_guidance_scale
        return 2 if guidance > 1.0 else 1
    scale = params.true_cfg_scale
    if scale is None:
        scale = report.default_true_cfg_scale
    return 2 if params.negative_prompt is not None and scale > 1.0 else 1


def latent_frames(params: GenerateParams, report: CostReport) -> int:
    """A video's latent frames (its default length where it names none); 1 for an image."""
    if params.video is None:
        return 1
    frames = params.video.num_frames or report.default_frames
    return (max(frames, 1) - 1) // max(report.frame_factor, 1) + 1


def cost_units(params: GenerateParams, report: CostReport) -> float:
    """The request's cost in units (see the module's docstring)."""
    width = params.width or report.default_width
    height = params.height or report.default_height
    steps = float(params.num_inference_steps or report.default_steps)
    if params.edit is not None and params.edit.strength is not None:
        # diffusers' image-to-image runs int(steps * strength) of the steps (at least one).
        steps = max(1.0, math.floor(steps * params.edit.strength))
    per_step = (width * height / 1e6 + report.text_megapixels) * latent_frames(params, report)
    return params.n * cfg_branches(params, report) * steps * per_step


class Calibration:
    """A replica's seconds per cost unit: an EWMA of measured ``seconds / units``.

    Robust to an odd sample: while it has fewer than ``seed`` samples the estimate
    is the lower median of those (so a slow first request, at a size new to the gang, counts only
    until a normal one comes: one sample is itself, two the smaller, three the
    middle); after that each sample moves the estimate in log space by ``alpha`` of
    its distance, that distance clipped to ``max_ratio`` either way (one stall moves
    it by at most ``max_ratio ** alpha``; a lasting change is followed within a few
    samples). Thread-safe: the gang loop observes, the driver's socket thread reports.
    """

    def __init__(
        self,
        shape: CostReport | None = None,
        alpha: float = 0.2,
        seed: int = 3,
        max_ratio: float = 4.0,
    ) -> None:
        self._shape = shape or CostReport()
        self._alpha, self._seed, self._clip = alpha, seed, math.log(max_ratio)
        self._lock = threading.Lock()
        self._first: list[float] = []  # log ratios of the first ``seed`` samples
        self._log: float | None = None
        self._samples = 0

    def configure(self, shape: CostReport) -> None:
        """The model's defaults and text megapixels (its calibration is kept)."""
        with self._lock:
            self._shape = shape

    def forget(self) -> None:
        """Drop every sample: what was measured says nothing of a request's cost (the
        warm-up: first-call costs, and with --compile the compilation)."""
        with self._lock:
            self._first, self._log, self._samples = [], None, 0

    def units(self, params: GenerateParams) -> float:
        return cost_units(params, self._shape)

    def observe(self, units: float, seconds: float) -> None:
        """One generation (or batch) of ``units`` took ``seconds`` of inference."""
        if not (units > 0 and seconds > 0 and math.isfinite(units) and math.isfinite(seconds)):
            return
        sample = math.log(seconds / units)
        with self._lock:
            self._samples += 1
            if len(self._first) < self._seed:
                self._first.append(sample)
                ordered = sorted(self._first)
                self._log = ordered[(len(ordered) - 1) // 2]
                return
            assert self._log is not None
            step = max(-self._clip, min(self._clip, sample - self._log))
            self._log += self._alpha * step

    @property
    def seconds_per_unit(self) -> float | None:
        with self._lock:
            return None if self._log is None else math.exp(self._log)

    def report(self) -> CostReport:
        with self._lock:
            spu = None if self._log is None else math.exp(self._log)
            shape, samples = self._shape, self._samples
        return msgspec.structs.replace(shape, seconds_per_unit=spu, samples=samples)
