"""Video jobs: the wire contract between router and replica, and the request rules.

A video takes from seconds to many minutes, so a client submits a job and polls it
(OpenAI's video API: ``POST /v1/videos``, ``GET /v1/videos/{id}``, ``.../content``).
The job lives on the replica that runs it, its *owner*: the owner keeps the job's
record (status, progress, times, error) and, once done, its mp4 and thumbnail on
disk for ``--video-ttl`` seconds within ``--video-max-bytes``. Nothing about a job
lives in a router, so any router finds it (docs/video.md):

- the job id carries the owner's endpoint and boot id (:func:`make_job_id`), so a
  router asks that replica first, and every serving replica after it (a re-run
  lives elsewhere under the same id);
- the job's record holds the tenant that submitted it, so each replica answers a
  caller about its own tenant's jobs only, whichever router asks (docs/tenants.md);
- the router that placed a job watches it to the end (router/videos.py) and, when
  the owner is lost (unreachable, or restarted: its boot id changed), submits it
  again elsewhere with the same id, seed and creation time.

On the wire a job is one message kind, ``protocol.VIDEO``, whose body is a
:class:`VideoRequest`; every action is answered at once by the driver's socket
thread, never behind the gang's queue. ``submit`` checks the job whole
(:func:`check_job`) and queues it (a 4xx comes back before the client's POST is
answered); the job then runs as a generation whose ``params.video`` is set, and the
output rank's answer (a :class:`VideoResult` with the mp4 and thumbnail, its progress
as :class:`VideoProgress`) goes to the replica's job book as values, never frames.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract.fields import FieldSpec, names
from dpserve.contract.ids import decode_owner, encode_owner

# VideoRequest.action
SUBMIT: Final = "submit"
GET: Final = "get"
LIST: Final = "list"
CONTENT: Final = "content"
DELETE: Final = "delete"
ACTIONS: Final = (SUBMIT, GET, LIST, CONTENT, DELETE)

# VideoJob.status (OpenAI's)
QUEUED: Final = "queued"
IN_PROGRESS: Final = "in_progress"
COMPLETED: Final = "completed"
FAILED: Final = "failed"
CANCELLED: Final = "cancelled"
TERMINAL: Final = frozenset({COMPLETED, FAILED, CANCELLED})

# Content variants (OpenAI's names) and their media types.
VIDEO_VARIANT: Final = "video"
THUMBNAIL: Final = "thumbnail"
MEDIA_TYPES: Final[Mapping[str, str]] = {VIDEO_VARIANT: "video/mp4", THUMBNAIL: "image/jpeg"}

MAX_FPS: Final = 60
MAX_SECONDS: Final = 600.0
_MAX_FRAMES_ASKED: Final = 100_000  # before the model's own bounds (resolve_frames)
_JOB_ID: Final = re.compile(r"^video_[0-9a-f]{32}\.[A-Za-z0-9_-]{1,200}\.[0-9a-f]{8}$")
_PREFIX: Final = "video_"


# ---------------------------------------------------------------- job ids


@dataclass(frozen=True)
class JobOwner:
    """Where a job id says its job was first placed."""

    endpoint: str  # the owner driver's ZMQ endpoint
    boot: str  # the first 8 hex digits of its boot id then


def make_job_id(owner_endpoint: str, boot_id: str) -> str:
    """``video_<128 random bits>.<owner endpoint, base64url>.<owner boot id, 8 hex>``."""
    return f"{_PREFIX}{secrets.token_hex(16)}.{encode_owner(owner_endpoint)}.{boot_id[:8]}"


def job_owner(job_id: str) -> JobOwner | None:
    """The owner a job id names; None for a string this service never gave out."""
    if len(job_id) > 300 or not _JOB_ID.match(job_id):
        return None
    _, encoded, boot = job_id.split(".")
    endpoint = decode_owner(encoded)
    return JobOwner(endpoint, boot) if endpoint is not None else None


# ---------------------------------------------------------------- wire bodies


class VideoRequest(msgspec.Struct, kw_only=True):
    """Body of a ``protocol.VIDEO`` message."""

    action: str  # one of ACTIONS
    job_id: str = ""  # every action but list
    # submit: the job's generation (params.video set, seeds fixed by the router),
    # and the input_reference image as blob 0 when params.edit names it.
    params: p.GenerateParams | None = None
    created_at: int = 0  # submit: unix seconds the router accepted the job; a re-run keeps it
    attempt: int = 1  # submit: 2 and up is a re-run after the owner was lost
    variant: str = VIDEO_VARIANT  # content: VIDEO_VARIANT or THUMBNAIL
    # submit: the router's estimate of the job's run time (None: no replica has
    # measured its seconds per cost unit yet), and the run time after which the
    # replica stops it (None: no bound).
    estimated_s: float | None = None
    max_run_s: float | None = None
    # submit: the tenant that owns the job, recorded with it (a re-run keeps it).
    # get, list, content, delete: whose jobs the caller sees (None: every tenant's;
    # dpserve/contract/owners.py). A job of another tenant is not found. Senders that
    # predate tenants send neither: an unowned job that everyone sees, as before.
    tenant: Annotated[str, msgspec.Meta(max_length=p.MAX_TENANT)] = ""
    scope: Annotated[str, msgspec.Meta(max_length=p.MAX_TENANT)] | None = None


class VideoError(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str


class VideoJob(msgspec.Struct, kw_only=True):
    """A job's record as its owner holds it: the answer to submit, get and delete."""

    id: str
    status: str  # QUEUED, IN_PROGRESS, COMPLETED, FAILED or CANCELLED
    progress: int = 0  # 0-100
    created_at: int
    completed_at: int | None = None  # unix seconds it reached a terminal status
    expires_at: int | None = None  # unix seconds its output goes (completed jobs)
    prompt: str = ""
    width: int
    height: int
    num_frames: int
    fps: int
    seconds: float
    seed: int
    num_inference_steps: int | None = None
    error: VideoError | None = None
    replica: int = 0  # the owner's replica index
    attempt: int = 1
    estimated_time_s: float | None = None  # the router's estimate when it placed the job
    bytes: int = 0  # the mp4's size, once completed
    queue_time_s: float = 0.0
    inference_time_s: float = 0.0  # the pipeline, without encoding
    encode_time_s: float = 0.0  # mp4 and thumbnail
    tenant: str = ""  # who owns it ("" for a job a sender that predates tenants placed)
    # Where its mp4 and thumbnail are once completed, when the owner has an output
    # store (s3://…/videos/<id>/<attempt>.{mp4,jpg}); "" for the owner's own disk, or
    # from a peer that predates the store.
    location: str = ""


class VideoList(msgspec.Struct, kw_only=True):
    """Answer to list: every job record the replica holds, newest first."""

    jobs: list[VideoJob]


class VideoContent(msgspec.Struct, kw_only=True):
    """Answer to content; the file is blob 0."""

    id: str
    variant: str
    media_type: str


class VideoProgress(msgspec.Struct, kw_only=True):
    """A PARTIAL reply of a running video generation: denoising step ``step`` of ``steps``
    is done."""

    step: int
    steps: int


class VideoResult(msgspec.Struct, kw_only=True):
    """The output rank's answer to a video generation; blob 0 is the mp4 (H.264),
    blob 1 the thumbnail (JPEG of the first frame)."""

    replica: int
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    queue_time_s: float
    inference_time_s: float
    encode_time_s: float
    peak_memory_mb: float


# ---------------------------------------------------------------- request rules


# A video job's fields, in the order /openapi.json shows them; the router adds the ones
# it reads itself (dpserve/router/fields.py). The checks are parse_video's.
VIDEO_SPECS: Final = (
    pv.PROMPT,
    pv.NEGATIVE_PROMPT,
    FieldSpec(
        "seconds",
        str | None,
        description='length, as OpenAI sends it ("4"); rounds to frames the model makes',
    ),
    FieldSpec("size", str | None, description='"WIDTHxHEIGHT" (multiples of the size factor)'),
    pv.WIDTH,
    pv.HEIGHT,
    FieldSpec("fps", int | None, ge=1, le=MAX_FPS, description="default: the model's"),
    FieldSpec(
        "num_frames",
        int | None,
        ge=1,
        description="instead of seconds: frame_factor*k+1 (GET /v1/models features)",
    ),
    FieldSpec("seed", int | None, ge=0, le=pv.MAX_SEED, description="default: a random one"),
    pv.STEPS,
    pv.GUIDANCE,
    pv.LORA,
)
VIDEO_FIELDS: Final = names(VIDEO_SPECS)


def parse_video(
    body: Any, limits: pv.Limits, ignore: frozenset[str] = frozenset(), blobs: int = 0
) -> p.GenerateParams:
    """Validate a video job's body; raise ``RequestError`` naming every bad field.

    ``ignore`` lists fields a front end handles itself (OpenAI's ``model``);
    ``blobs`` is 1 when an ``input_reference`` image came with it (it becomes the
    generation's ``edit`` input). Frame counts are checked against ``limits`` only
    where the limits know the model (``max_frames`` > 0); the replica checks them
    again, with its own, before it accepts the job (:func:`check_job`).
    """
    if not isinstance(body, Mapping):
        raise p.RequestError(p.INVALID_REQUEST, "the request body must be an object")
    check = pv.FieldChecker(body)
    for key in sorted(str(k) for k in body if k not in VIDEO_FIELDS | ignore):
        check.bad(key, "is not a known field")
    prompt = check.text("prompt", required=True)
    negative = check.text("negative_prompt", required=False)
    width, height = pv.parse_size(check, limits)
    steps = check.integer("num_inference_steps", 1, limits.max_steps)
    guidance = check.number("guidance_scale", 0.0, limits.max_scale)
    fps = check.integer("fps", 1, MAX_FPS)
    seconds = _seconds(check, check.body.get("seconds"))
    frames = check.integer("num_frames", 1, _MAX_FRAMES_ASKED)
    seed = check.integer("seed", 0, pv.MAX_SEED)
    lora = pv.parse_lora(check, check.body.get("lora"))
    check.raise_errors()
    assert prompt is not None
    spec = p.VideoSpec(num_frames=frames, seconds=seconds, fps=fps)
    shape = _Shape(width, height, steps, guidance, seed, lora)
    return _job(prompt, negative, shape, bool(blobs), spec, limits)


def check_job(params: p.GenerateParams, limits: pv.Limits) -> p.GenerateParams:
    """A job's params as a router sent them (typed), checked with ``limits`` by the
    bounds :func:`parse_video` gives a body, every bad field named in one error: the
    fields a video job takes (an input_reference as ``edit``), its frames resolved."""
    spec = params.video
    assert spec is not None
    check = pv.FieldChecker()
    prompt = check.bounded_text("prompt", params.prompt, required=True)
    negative = check.bounded_text("negative_prompt", params.negative_prompt, required=False)
    width, height = pv.check_sides(check, params.width, params.height, limits)
    steps = check.count("num_inference_steps", params.num_inference_steps, 1, limits.max_steps)
    guidance = check.amount("guidance_scale", params.guidance_scale, 0.0, limits.max_scale)
    fps = check.count("fps", spec.fps, 1, MAX_FPS)
    seconds = _seconds(check, spec.seconds if spec.num_frames is None else None)
    frames = check.count("num_frames", spec.num_frames, 1, _MAX_FRAMES_ASKED)
    seed = check.count("seed", params.seed[0] if params.seed else None, 0, pv.MAX_SEED)
    pv.check_loras(check, params.lora)
    check.raise_errors()
    assert prompt is not None
    spec = p.VideoSpec(num_frames=frames, seconds=seconds, fps=fps)
    reference = params.edit is not None
    shape = _Shape(width, height, steps, guidance, seed, params.lora)
    return _job(prompt, negative, shape, reference, spec, limits)


@dataclass(frozen=True)
class _Shape:
    """A checked job's fields besides its prompts, its frames and its input."""

    width: int | None
    height: int | None
    steps: int | None
    guidance: float | None
    seed: int | None
    lora: list[p.LoraRef] | None


def _job(
    prompt: str,
    negative: str | None,
    shape: _Shape,
    reference: bool,
    spec: p.VideoSpec,
    limits: pv.Limits,
) -> p.GenerateParams:
    """A checked job's params (an input_reference as ``edit``), its frames fixed where
    the limits know the model."""
    if limits.max_frames:
        spec = resolve_frames(spec, limits)
    return p.GenerateParams(
        prompt=prompt,
        negative_prompt=negative,
        width=shape.width,
        height=shape.height,
        num_inference_steps=shape.steps,
        guidance_scale=shape.guidance,
        seed=None if shape.seed is None else [shape.seed],
        edit=p.EditInput(images=[0]) if reference else None,
        video=spec,
        lora=shape.lora,
    )


def _seconds(check: pv.FieldChecker, raw: Any) -> float | None:
    """OpenAI sends ``seconds`` as a string ("4"); a number is taken too."""
    if raw is None:
        return None
    try:
        value = float(raw) if isinstance(raw, str | int | float) and raw is not True else None
    except ValueError:
        value = None
    if value is None or raw is False or not 0.0 < value <= MAX_SECONDS:
        check.bad("seconds", f"must be a number of seconds in (0, {MAX_SECONDS:g}], got {raw!r}")
        return None
    return value


def resolve_frames(spec: p.VideoSpec, limits: pv.Limits) -> p.VideoSpec:
    """The frames, rate and length a job gets on a model with these limits.

    ``num_frames`` wins over ``seconds``; ``seconds`` rounds to the nearest frame
    count the model makes (``frame_factor * k + 1``); neither gives the model's
    default. A count the model cannot make is a 400 naming what it can.
    """
    fps = spec.fps or limits.default_fps
    factor = limits.frame_factor
    top = limits.max_frames - (limits.max_frames - 1) % factor
    what = (
        f"this model makes {factor}*k+1 frames, 1 to {top} (at {fps} fps up to "
        f"{(top - 1) / fps:g} s)"
    )
    if spec.num_frames is not None:
        frames = spec.num_frames
        if frames % factor != 1 % factor or not 1 <= frames <= top:
            raise pv.invalid_fields([p.FieldError("num_frames", f"is {frames}, but {what}")])
    elif spec.seconds is not None:
        frames = round(spec.seconds * fps / factor) * factor + 1
        if frames > top:
            raise pv.invalid_fields([p.FieldError("seconds", f"is {spec.seconds:g}, but {what}")])
    else:
        frames = min(limits.default_frames, top)
    return p.VideoSpec(num_frames=frames, seconds=round((frames - 1) / fps, 3), fps=fps)


def seconds_text(seconds: float) -> str:
    """OpenAI's ``seconds`` is a string: "4", or "5.06" where it is not whole."""
    return f"{seconds:.2f}".rstrip("0").rstrip(".")
