"""The video routes' bodies and answers, declared for /docs and /openapi.json.

FastAPI validates nothing with them, as with dpserve/router/schemas.py: the routes
parse with ``video_api`` and ``video.parse_video``, which name every bad field in a
400; the job's form reads its fields' types from ``VideoCreateForm``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dpserve.contract import validation as pv
from dpserve.contract import video
from dpserve.router.schemas import ErrorResponse


class _VideoFields(BaseModel):
    """OpenAI's video fields, and this service's extras."""

    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400, named

    prompt: str = Field(max_length=pv.MAX_PROMPT_CHARS)
    negative_prompt: str | None = Field(None, max_length=pv.MAX_PROMPT_CHARS)
    seconds: str | None = Field(
        None, description='length, as OpenAI sends it ("4"); rounds to frames the model makes'
    )
    size: str | None = Field(None, description='"WIDTHxHEIGHT" (multiples of the size factor)')
    width: int | None = Field(None, description="instead of size, with height")
    height: int | None = None
    fps: int | None = Field(None, ge=1, le=video.MAX_FPS, description="default: the model's")
    num_frames: int | None = Field(
        None, ge=1, description="instead of seconds: frame_factor*k+1 (GET /v1/models features)"
    )
    seed: int | None = Field(None, ge=0, le=pv.MAX_SEED, description="default: a random one")
    num_inference_steps: int | None = Field(None, ge=1, le=pv.Limits.max_steps)
    guidance_scale: float | None = Field(None, ge=0, le=pv.Limits.max_scale)
    model: str | None = Field(
        None, description="the served model's name (GET /v1/models); another is a 404"
    )


class VideoCreateRequest(_VideoFields):
    """A video job as JSON; an image to start from is an inline data URL."""

    input_reference: dict[str, str] | None = Field(
        None, description='{"image_url": "data:image/png;base64,..."}: the first frame'
    )


class VideoCreateForm(_VideoFields):
    """A video job as multipart/form-data (the openai client's form); numbers are text."""

    input_reference: bytes | None = Field(None, description="an image file: the first frame")


class VideoError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    """OpenAI's Video, with this service's extras (fps to attempt)."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int = Field(ge=0, le=100)
    created_at: int
    completed_at: int | None
    expires_at: int | None = Field(description="when a completed video's files go")
    prompt: str
    size: str
    seconds: str
    error: VideoError | None
    remixed_from_video_id: None = None
    fps: int
    num_frames: int
    seed: int
    num_inference_steps: int | None
    attempt: int = Field(description="2 and up: run again after its replica was lost")
    replica: int
    estimated_time_s: float | None = Field(
        description="the run time the router estimated when it placed the job (null: no "
        "replica had measured its speed yet)"
    )
    queue_time_s: float | None = Field(None, description="completed jobs: queued at the replica")
    inference_time_s: float | None = Field(None, description="completed jobs: the pipeline")
    encode_time_s: float | None = Field(None, description="completed jobs: mp4 and thumbnail")


class VideoListResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: Literal[True] = True


def create_body() -> dict[str, Any]:
    """``openapi_extra`` for POST /v1/videos: JSON, or the form with an image file."""
    content = {
        "application/json": {"schema": VideoCreateRequest.model_json_schema()},
        "multipart/form-data": {"schema": VideoCreateForm.model_json_schema()},
    }
    for media in content.values():
        assert "$defs" not in media["schema"], "keep request models flat"
    return {"requestBody": {"required": True, "content": content}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    what = {
        400: "a bad field or parameter, named",
        404: "no such video (or not an id this service gave out)",
        409: "not completed yet",
        429: "every replica's queue is full",
        503: "no replica serves",
    }
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}
