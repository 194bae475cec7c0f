"""OpenAI's video API over the job contract (dpserve/contract/video.py): the create body (JSON,
or a multipart form with an ``input_reference`` image file, as the openai client
sends it), the list's query and paging, and the answers' shapes.

The router decodes no image: an ``input_reference`` is checked by its size and its
first bytes (PNG, JPEG, WebP); the replica decodes it and checks its pixels before it
takes the job. A form's file is spooled, never the whole body held (dpserve/router/forms.py).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from starlette.datastructures import UploadFile
from starlette.requests import Request

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract import video
from dpserve.contract.model_info import Features
from dpserve.router import fields
from dpserve.router.bodies import JSON_TYPE, BadBody, is_json, parse_object, read_body
from dpserve.router.forms import (
    FORM_TYPE,
    FormItems,
    image_problem,
    is_form,
    read_image,
    spooled_form,
    typed_value,
)
from dpserve.router.schemas import form_types
from dpserve.router.served_model import check_model
from dpserve.router.video_schemas import VideoCreateForm

REFERENCE: Final = "input_reference"
# Fields read before the job's own parse (the served model's name, the first frame).
IGNORED: Final = fields.router_only(fields.VIDEOS)
# Form fields are text: these become numbers before the body is checked.
FORM_TYPES: Final = form_types(VideoCreateForm)
_EXTENSIONS: Final[Mapping[str, str]] = {video.VIDEO_VARIANT: "mp4", video.THUMBNAIL: "jpg"}
ORDERS: Final = ("asc", "desc")
MAX_LIMIT: Final = 100
DEFAULT_LIMIT: Final = 20


@dataclass(frozen=True)
class VideoAsk:
    """A create request as read: its fields, and its input_reference image if any."""

    body: dict[str, Any]
    reference: bytes | None = None

    @property
    def blobs(self) -> list[bytes]:
        return [self.reference] if self.reference is not None else []


@dataclass(frozen=True)
class ListQuery:
    after: str | None = None
    limit: int = DEFAULT_LIMIT
    order: str = "desc"


# ---------------------------------------------------------------- create


async def read_create(
    request: Request, max_body: int, max_upload: int, timeout_s: float
) -> VideoAsk:
    """The create body, JSON (at most ``max_body`` bytes) or a multipart form (at most
    ``max_upload``, its file spooled); 415 for anything else."""
    content_type = request.headers.get("content-type")
    if is_form(content_type):
        async with spooled_form(request, max_upload, timeout_s, max_files=1) as items:
            return await _read_form(items)
    raw = await read_body(request, max_body, timeout_s)
    if not is_json(content_type) and raw.strip():
        got = f"got {content_type!r}" if content_type else "got none"
        raise BadBody(
            415,
            f"send a video job as {JSON_TYPE}, or as {FORM_TYPE} with the {REFERENCE} image "
            f"as a file part ({got})",
        )
    body = parse_object(raw, content_type, required=True)
    reference = _json_reference(body.pop(REFERENCE, None))
    return VideoAsk(body, reference)


def parse_create(
    asked: VideoAsk,
    limits: pv.Limits,
    features: Features | None,
    served: str | None = None,
) -> p.GenerateParams:
    """The job's generation; 400 naming what to fix (an image model included), 404 for
    another model's name than ``served``."""
    check_model(asked.body.get("model"), served)
    _check_model(features, asked.reference is not None)
    return video.parse_video(asked.body, limits, ignore=IGNORED, blobs=len(asked.blobs))


def _check_model(features: Features | None, reference: bool) -> None:
    """Features unknown (no replica has said): the replica checks."""
    if features is None:
        return
    made = features.video
    if made is None:
        raise p.RequestError(p.UNSUPPORTED, "this model makes images; use /v1/images/generations")
    if reference and not made.image_to_video:
        raise p.RequestError(
            p.UNSUPPORTED,
            f"this model makes videos from text only: send the job without {REFERENCE}",
            [p.FieldError(REFERENCE, "is not supported by this model")],
        )


async def _read_form(items: FormItems) -> VideoAsk:
    body: dict[str, Any] = {}
    reference: bytes | None = None
    problems: list[p.FieldError] = []
    for name, value in items:
        if isinstance(value, UploadFile):
            if name != REFERENCE:
                problems.append(
                    p.FieldError(name, f"is not a file field (the image is {REFERENCE})")
                )
            else:
                reference = await read_image(value, REFERENCE, problems)
        elif name == REFERENCE or name.startswith(f"{REFERENCE}["):
            problems.append(p.FieldError(REFERENCE, _REFERENCE_HOW))
        elif name in body:
            problems.append(p.FieldError(name, "is given more than once"))
        else:
            body[name] = _typed(name, value, problems)
    if problems:
        raise pv.invalid_fields(problems)
    return VideoAsk(body, reference)


_REFERENCE_HOW: Final = (
    "must be an image file part, or in a JSON body "
    '{"image_url": "data:image/png;base64,..."}; URLs and file ids are not fetched'
)


def _json_reference(raw: Any) -> bytes | None:
    """``{"image_url": "data:...;base64,..."}`` (OpenAI's reference object, inline)."""
    if raw is None:
        return None
    url = raw.get("image_url") if isinstance(raw, dict) else None
    head, _, data = url.partition(",") if isinstance(url, str) else ("", "", "")
    if not (head.startswith("data:") and head.endswith(";base64")):
        raise pv.invalid_fields([p.FieldError(REFERENCE, _REFERENCE_HOW)])
    try:
        image = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise pv.invalid_fields(
            [p.FieldError(REFERENCE, "holds data that is not base64")]
        ) from None
    problem = image_problem(image[:12], len(image), "the image_url data")
    if problem is not None:
        raise pv.invalid_fields([p.FieldError(REFERENCE, problem)])
    return image


def _typed(name: str, text: str, out: list[p.FieldError]) -> Any:
    """A form string as its field's type; the rest stays text (seconds is text too)."""
    return typed_value(name, text, out, FORM_TYPES)


# ---------------------------------------------------------------- list


def parse_list(query: Mapping[str, str]) -> ListQuery:
    """``after``, ``limit`` (1-100) and ``order`` (asc, desc); other keys are ignored."""
    problems: list[p.FieldError] = []
    after = query.get("after") or None
    if after is not None and video.job_owner(after) is None:
        problems.append(p.FieldError("after", f"{after[:80]!r} is not a video id"))
    limit = DEFAULT_LIMIT
    raw = query.get("limit")
    if raw is not None:
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIMIT:
            problems.append(
                p.FieldError("limit", f"must be an integer from 1 to {MAX_LIMIT}, got {raw[:20]!r}")
            )
    order = query.get("order", "desc")
    if order not in ORDERS:
        problems.append(p.FieldError("order", f"must be asc or desc, got {order[:20]!r}"))
    if problems:
        raise pv.invalid_fields(problems)
    return ListQuery(after, limit, order)


def page(jobs: Sequence[video.VideoJob], query: ListQuery) -> tuple[list[video.VideoJob], bool]:
    """One page in (created_at, id) order after ``query.after``; whether more follow."""
    ordered = sorted(jobs, key=lambda j: (j.created_at, j.id), reverse=query.order == "desc")
    start = 0
    if query.after is not None:
        at = next((i for i, j in enumerate(ordered) if j.id == query.after), None)
        if at is None:
            raise pv.invalid_fields(
                [
                    p.FieldError(
                        "after",
                        f"no replica holds {query.after} now (deleted or expired): "
                        "list again from the start",
                    )
                ]
            )
        start = at + 1
    rest = ordered[start:]
    return rest[: query.limit], len(rest) > query.limit


# ---------------------------------------------------------------- answers


def job_json(job: video.VideoJob, model: str) -> dict[str, Any]:
    """OpenAI's ``Video`` object, and what this service adds to it."""
    shown: dict[str, Any] = {
        "id": job.id,
        "object": "video",
        "model": model,
        "status": job.status,
        "progress": job.progress,
        "created_at": job.created_at,
        "completed_at": job.completed_at,
        "expires_at": job.expires_at,
        "prompt": job.prompt,
        "size": f"{job.width}x{job.height}",
        "seconds": video.seconds_text(job.seconds),
        "error": {"code": job.error.code, "message": job.error.message} if job.error else None,
        "remixed_from_video_id": None,
        "fps": job.fps,
        "num_frames": job.num_frames,
        "seed": job.seed,
        "num_inference_steps": job.num_inference_steps,
        "attempt": job.attempt,
        "replica": job.replica,
        "estimated_time_s": job.estimated_time_s,
    }
    if job.status == video.COMPLETED:  # the replica's times (a job's overhead is the rest)
        shown["queue_time_s"] = job.queue_time_s
        shown["inference_time_s"] = job.inference_time_s
        shown["encode_time_s"] = job.encode_time_s
    return shown


def list_json(jobs: Sequence[video.VideoJob], has_more: bool, model: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [job_json(j, model) for j in jobs],
        "first_id": jobs[0].id if jobs else None,
        "last_id": jobs[-1].id if jobs else None,
        "has_more": has_more,
    }


def deleted_json(job_id: str) -> dict[str, Any]:
    return {"id": job_id, "object": "video.deleted", "deleted": True}


def filename(job_id: str, variant: str) -> str:
    return f"{job_id}.{_EXTENSIONS[variant]}"
