"""What the loaded model serves beyond plain generation, as ``model_info`` reports it
and the driver checks requests against."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Final

from dpserve.contract import model_info as contract
from dpserve.contract.validation import (
    MAX_PARTIAL_IMAGES,
    OUTPUT_FORMATS,
    Limits,
)
from dpserve.worker.call_settings import CallSettings
from dpserve.worker.edit import EditSupport, edit_support
from dpserve.worker.pipeline import Pipeline, call_defaults
from dpserve.worker.preview import can_preview
from dpserve.worker.step_cache import StepCaches

# Wan's frame rate; a diffusers pipeline carries none.
DEFAULT_FPS: Final = 16
_FALLBACK_FRAMES: Final = 81  # Wan's default length, for a pipeline that declares none


@dataclass(frozen=True)
class VideoSupport:
    """A video model's frames (dpserve.contract.video): counts are ``frame_factor * k + 1``."""

    max_frames: int
    frame_factor: int
    default_frames: int
    default_fps: int = DEFAULT_FPS
    image_to_video: bool = False  # takes an input_reference image
    text_to_video: bool = True  # False: it needs one (Wan's image-to-video pipeline)

    def info(self) -> contract.VideoFeatures:
        return contract.VideoFeatures(
            max_frames=self.max_frames,
            frame_factor=self.frame_factor,
            default_frames=self.default_frames,
            default_fps=self.default_fps,
            image_to_video=self.image_to_video,
            text_to_video=self.text_to_video,
        )


def video_support(pipe: Pipeline, max_frames: int) -> VideoSupport | None:
    """None for an image model. ``max_frames`` (``--max-frames``) is capped where the
    transformer's rotary table ends (one position per latent frame) and rounded down
    to a count the VAE makes, as is the pipeline's default length."""
    defaults = call_defaults(pipe)
    factor = getattr(pipe, "vae_scale_factor_temporal", None)
    if "num_frames" not in defaults or factor is None:
        return None
    factor = int(factor)
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    positions = getattr(config, "rope_max_seq_len", None)
    top = max_frames if positions is None else min(max_frames, (int(positions) - 1) * factor + 1)
    top = max(1, top - (top - 1) % factor)
    default = min(int(defaults["num_frames"] or _FALLBACK_FRAMES), top)
    default -= (default - 1) % factor
    image = inspect.signature(pipe.__call__).parameters.get("image")
    return VideoSupport(
        max_frames=top,
        frame_factor=factor,
        default_frames=default,
        image_to_video=image is not None,
        text_to_video=image is None or image.default is not inspect.Parameter.empty,
    )


@dataclass(frozen=True)
class Features:
    edit: EditSupport
    partial_images: int  # previews per image it can send; 0: it cannot preview
    max_n: int = Limits.max_n
    step_caches: StepCaches = field(default_factory=lambda: StepCaches(()))
    video: VideoSupport | None = None  # None: an image model
    settings: CallSettings = field(default_factory=CallSettings)  # text length, shift, VAE

    def info(self) -> contract.Features:
        """The ``features`` of model_info (the router checks requests by it and shows it)."""
        return contract.Features(
            edits=self.edit.edits,
            inpainting=self.edit.inpainting,
            max_edit_images=self.edit.max_images,
            partial_images=self.partial_images,
            output_formats=list(OUTPUT_FORMATS),
            output_compression=True,
            max_n=self.max_n,
            step_caches=self.step_caches.offered_knobs(),
            step_cache_default=self.step_caches.default_knobs(),
            step_caches_unavailable=self.step_caches.refusal,
            max_sequence_length=self.settings.text_offer(),
            flow_shift=self.settings.shift_offer(),
            vae_tiling=self.settings.vae_tiling,
            vae_slicing=self.settings.vae_slicing,
            video=self.video.info() if self.video is not None else None,
        )


def features_of(
    pipe: Pipeline,
    max_n: int = Limits.max_n,
    step_caches: StepCaches | None = None,
    max_frames: int = 0,
    settings: CallSettings | None = None,
) -> Features:
    """``max_frames`` is the replica's ``--max-frames`` (a video model's cap)."""
    video = video_support(pipe, max_frames)
    return Features(
        edit=edit_support(pipe),
        partial_images=MAX_PARTIAL_IMAGES if can_preview(pipe) else 0,
        max_n=max_n,
        step_caches=step_caches or StepCaches(()),
        video=video,
        settings=settings or CallSettings(),
    )
