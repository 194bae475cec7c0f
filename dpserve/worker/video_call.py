"""A video generation (``params.video`` set, dpserve.contract.video) in the gang: which model
may run it, its pipeline arguments, its progress, and the output rank's reply.

A job's frames, rate and seed are fixed by the replica that accepts it before it
reaches the gang, so every rank (and a re-run elsewhere) makes the same frames.
Only the output rank decodes latents to frames and encodes them (video_encode.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from dpserve.contract import protocol as p
from dpserve.contract import video as v
from dpserve.worker.edit import decode_image
from dpserve.worker.encode import encode_image
from dpserve.worker.features import VideoSupport
from dpserve.worker.pipeline import Pipeline, pipeline_kwargs
from dpserve.worker.preview import Emit
from dpserve.worker.reply import Reply
from dpserve.worker.video_encode import encode_mp4, encode_thumbnail, to_uint8

log = logging.getLogger(__name__)


def refusal(params: p.GenerateParams, video: VideoSupport | None) -> p.RequestError | None:
    """Why this model cannot run ``params``: an image on a video model, a video on an
    image model, an input image where it makes videos from text only, or none where
    it needs one."""
    if params.video is None:
        if video is None:
            return None
        return p.RequestError(
            p.UNSUPPORTED,
            "this model makes videos, not images: submit a video job (POST /v1/videos)",
        )
    if video is None:
        return p.RequestError(p.UNSUPPORTED, "this model makes images, not videos")
    if params.edit is not None and not video.image_to_video:
        field = p.FieldError(
            "input_reference", "is not supported: this model makes videos from text"
        )
        return p.RequestError(p.UNSUPPORTED, f"input_reference {field.message}", [field])
    if params.edit is None and not video.text_to_video:
        field = p.FieldError("input_reference", "is required: this model animates an image")
        return p.RequestError(p.UNSUPPORTED, f"input_reference {field.message}", [field])
    return None


def video_kwargs(
    params: p.GenerateParams,
    accepted: Mapping[str, Any],
    output_type: str,
    blobs: Sequence[bytes] = (),
) -> dict[str, Any]:
    """``pipe(**kwargs)`` for one video: one CPU generator from the job's seed, the
    frames the replica resolved, the input image (``blobs[params.edit.images[0]]``)
    where there is one; ``output_type`` "np" (frames) or "latent"."""
    spec = params.video
    assert spec is not None
    if spec.num_frames is None or spec.fps is None:
        raise p.RequestError(
            p.INVALID_REQUEST, "a video's frames must be fixed before it reaches the gang"
        )
    if params.n != 1:
        raise p.RequestError(p.INVALID_REQUEST, f"a video job makes one video, not n={params.n}")
    kwargs = pipeline_kwargs(params, accepted, output_type)
    del kwargs["num_images_per_prompt"]  # a video pipeline's is num_videos_per_prompt
    kwargs["generator"] = kwargs["generator"][0]
    kwargs["num_frames"] = spec.num_frames
    if params.edit is not None:
        # The pipeline resizes it to the video's size (diffusers' video processor).
        kwargs["image"] = decode_image(blobs[params.edit.images[0]], "input_reference")
    return kwargs


def warmup_reference(width: int, height: int) -> bytes:
    """A grey PNG: the input image of a warm-up on a model that needs one."""
    return encode_image(Image.new("RGB", (width, height), (128, 128, 128)), "png")


class StepProgress:
    """The step-end callback of the output rank: a ``VideoProgress`` reply after every
    denoising step. It returns nothing, so the latents go on unchanged."""

    def __init__(self, request_id: str, steps: int, emit: Emit) -> None:
        self.request_id = request_id
        self.steps = steps
        self.emit = emit

    def __call__(self, pipe: Pipeline, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        steps = int(getattr(pipe, "num_timesteps", 0) or self.steps)
        body = v.VideoProgress(step=i + 1, steps=steps)
        self.emit(Reply(p.PARTIAL, self.request_id, body))
        return {}


def video_reply(
    request_id: str,
    params: p.GenerateParams,
    frames: Any,
    replica: int,
    times: tuple[float, float],
    peak_mb: float,
) -> Reply:
    """The output rank's answer: a ``VideoResult`` with the mp4 and the thumbnail;
    ``frames`` is the pipeline's (one video, float in [0, 1]); ``times`` the queue's
    and the pipeline's seconds. A failed encoding is the job's error, not the gang's."""
    assert params.video is not None and params.video.fps is not None and params.seed
    queue_s, inference_s = times
    started = time.perf_counter()
    try:
        pixels = to_uint8(np.asarray(frames)[0])
        mp4, thumbnail = encode_mp4(pixels, params.video.fps), encode_thumbnail(pixels)
    except Exception as exc:
        log.exception("video %s: encoding failed", request_id)
        return Reply.error(request_id, p.RequestError(p.INTERNAL, f"encoding failed: {exc}"))
    count, height, width, _ = pixels.shape
    result = v.VideoResult(
        replica=replica,
        width=width,
        height=height,
        num_frames=count,
        fps=params.video.fps,
        seed=params.seed[0],
        queue_time_s=queue_s,
        inference_time_s=inference_s,
        encode_time_s=time.perf_counter() - started,
        peak_memory_mb=peak_mb,
    )
    return Reply(p.RESULT, request_id, result, (mp4, thumbnail))
