"""The loaded pipeline's side of the cost model (dpserve.contract.cost): its defaults and what
its prompt's text tokens add to every denoising step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from dpserve.contract.protocol import (
    CostReport,
)
from dpserve.worker.pipeline import Pipeline, cfg_report, guides_by_scale, size_factor

if TYPE_CHECKING:
    from dpserve.worker.features import VideoSupport

_FALLBACK_STEPS = 50  # diffusers' usual default, for a pipeline that declares none


def cost_shape(
    pipe: Pipeline,
    defaults: Mapping[str, Any],
    fixed: Mapping[str, Any],
    video: VideoSupport | None = None,
) -> CostReport:
    """A request that names no size gets the pipeline's default sample size (Flux:
    ``default_sample_size x vae_scale_factor`` = 1024; Wan: its call's 832x480), as
    diffusers does. Text tokens count when a transformer attends jointly over them:
    the pipelines that take ``max_sequence_length`` pad the prompt to it
    (``--max-sequence-length`` or the pipeline's default), except a video model's
    (Wan's blocks cross-attend to the prompt: its cost grows with the video's tokens,
    which calibration covers). ``video`` gives a video model's frames."""
    side = int(getattr(pipe, "default_sample_size", 128)) * int(
        getattr(pipe, "vae_scale_factor", 8)
    )
    width = defaults.get("width") or side
    height = defaults.get("height") or side
    steps = defaults.get("num_inference_steps") or _FALLBACK_STEPS
    joint = (
        getattr(pipe, "transformer", None) is not None
        and "max_sequence_length" in defaults
        and video is None
    )
    tokens = fixed.get("max_sequence_length", defaults.get("max_sequence_length")) if joint else 0
    shape = msgspec.structs.replace(
        cfg_report(defaults, guides_by_scale(pipe)),
        default_width=int(width),
        default_height=int(height),
        default_steps=int(steps),
        text_megapixels=int(tokens or 0) * size_factor(pipe) ** 2 / 1e6,
    )
    if video is None:
        return shape
    return msgspec.structs.replace(
        shape, frame_factor=video.frame_factor, default_frames=video.default_frames
    )
