"""The video routes' bodies and answers, declared for /docs and /openapi.json.

FastAPI validates nothing with them, as with dpserve/router/schemas.py: the routes
parse with ``video_api`` and ``video.parse_video``, which name every bad field in a
400. The create bodies come from the fields' tables (dpserve/router/fields.py), as
the image bodies do; the job's form reads its fields' types from ``VideoCreateForm``.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, Field

from dpserve.router import fields
from dpserve.router.schemas import ErrorResponse, request_model

VideoCreateRequest: Final = request_model(
    "VideoCreateRequest",
    "A video job as JSON; an image to start from is an inline data URL.",
    fields.VIDEOS,
)
VideoCreateForm: Final = request_model(
    "VideoCreateForm",
    "A video job as multipart/form-data (the openai client's form); numbers are text.",
    fields.VIDEO_FORM,
)


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
