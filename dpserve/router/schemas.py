"""The request bodies (and answers) each route has, declared for /docs and /openapi.json.

FastAPI validates nothing with these models (no 422s): the routes keep their own
parsing (``parse_image_request``, the edit form's, the control state's checks), which
names every bad field in a 400. The image and video request models are built from the
fields' tables (:func:`request_model`, dpserve/router/fields.py), the same rows the
parsers take their known fields from, so a model declares what its parser accepts:
unknown fields are a 400 for generation, edits and videos, and ignored by control ops,
as declared. The forms read their fields' types from them (``form_types``: which text
fields are numbers or switches).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from dpserve.contract.control_state import DENOISERS
from dpserve.router import fields

Names = str | list[str]
Target = Literal["all"]  # dpserve.contract.control_state.LORA_TARGETS


def request_model(name: str, doc: str, route: str) -> type[BaseModel]:
    """The model of ``route``'s request body, one field per row of its table
    (dpserve/router/fields.py); an unknown field is declared a 400, as the parser answers."""
    defined: dict[str, Any] = {}
    for spec in fields.route_fields(route):
        # A name that is no identifier (image[]) is the alias of one.
        attr = spec.name if spec.name.isidentifier() else spec.name.replace("[]", "_list")
        field = Field(
            ... if spec.required else spec.default,
            alias=None if attr == spec.name else spec.name,
            description=spec.description,
            ge=spec.ge,
            gt=spec.gt,
            le=spec.le,
            max_length=spec.max_length,
        )
        defined[attr] = (spec.type, field)
    config = ConfigDict(extra="forbid")
    model: type[BaseModel] = create_model(name, __config__=config, __doc__=doc, **defined)
    return model


ImageGenerationRequest: Final = request_model(
    "ImageGenerationRequest", "OpenAI's images API with SGLang's extra fields.", fields.GENERATIONS
)
ImageEditForm: Final = request_model(
    "ImageEditForm",
    """OpenAI's edit form (multipart/form-data) with SGLang's extra fields; numbers are
form text. ``image`` or ``image[]`` (the openai client's name for a list): one or
more image files; ``mask`` repaints where it is white (its size is the image's).""",
    fields.EDITS,
)
ImageVariationForm: Final = request_model(
    "ImageVariationForm",
    """OpenAI's variation form: an image-to-image edit of one ``image`` without a prompt
(or a mask; either is a 400 pointing to /v1/images/edits).""",
    fields.VARIATIONS,
)


# ---------------------------------------------------------------- answers


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    seed: int


class InputTokens(BaseModel):
    image_tokens: Literal[0] = 0
    text_tokens: Literal[0] = 0


class Usage(BaseModel):
    """OpenAI's token usage, all zeros: a diffusion model here counts no tokens."""

    input_tokens: Literal[0] = 0
    input_tokens_details: InputTokens
    output_tokens: Literal[0] = 0
    total_tokens: Literal[0] = 0


class ImagesResponse(BaseModel):
    """A generation's or an edit's answer (without stream), the openai client's
    ``ImagesResponse`` and this server's extras."""

    id: str = Field(description="the request's id (also the X-Request-Id header)")
    created: int
    data: list[ImageData]
    background: Literal["opaque"] = "opaque"
    quality: None = Field(None, description="no quality tiers here")
    output_format: str
    size: str = Field(description='"WIDTHxHEIGHT"')
    usage: Usage
    inference_time_s: float = Field(description="the pipeline, without encoding")
    encode_time_s: float
    queue_time_s: float
    peak_memory_mb: float


class CancelResponse(BaseModel):
    id: str
    object: Literal["image.cancel"] = "image.cancel"
    status: Literal["cancelled"] = "cancelled"
    stage: Literal["queued_in_router", "at_replica", "queued_at_replica", "running_at_replica"]


class TenantUsage(BaseModel):
    """One tenant's totals since the router started (dpserve/router/usage.py)."""

    tenant: str = Field(description="a configured tenant; `default` without keys")
    requests: dict[str, int] = Field(
        description="HTTP requests by outcome: ok, client_error, server_error, disconnected"
    )
    requests_by_route: dict[str, dict[str, int]] = Field(
        description="the same, by route template and outcome"
    )
    images: int = Field(description="images made (answered generations, edits, variations)")
    video_frames: int = Field(description="frames of video jobs this router placed, completed")
    realtime_frames: int = Field(description="frames realtime sessions streamed")
    cost_units: float = Field(description="the router's cost estimate of the completed work")
    inference_seconds: float = Field(
        description="seconds the replicas' pipelines ran for it (times GPUs per replica: "
        "GPU-seconds)"
    )


class UsageResponse(BaseModel):
    object: Literal["usage"] = "usage"
    since: int = Field(description="when this router started (unix seconds); totals are its own")
    tenants: list[TenantUsage]


class FieldProblem(BaseModel):
    field: str
    message: str


class ErrorDetail(BaseModel):
    message: str = Field(description="what to fix")
    type: str
    param: str | None = Field(None, description="the first bad field")
    code: str | None = Field(
        None, description="why, e.g. invalid_value, model_not_found (docs/router.md)"
    )
    fields: list[FieldProblem] = Field(description="every bad field")


class ErrorResponse(BaseModel):
    id: str = Field(description="the request's id (also the X-Request-Id header)")
    error: ErrorDetail


STREAM_DOC: Final = (
    "With stream: text/event-stream of `image_generation.partial_image` (or "
    "`image_edit.partial_image`) events, one `*.completed` event per image, or an `error` event"
)


def image_responses() -> dict[int | str, dict[str, Any]]:
    """``responses`` for an image route: JSON, or a stream of events."""
    return {
        200: {
            "model": ImagesResponse,
            "description": STREAM_DOC,
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        400: {"model": ErrorResponse, "description": "a bad field, named"},
        409: {"model": ErrorResponse, "description": "the X-Request-Id is in flight"},
        499: {"model": ErrorResponse, "description": "cancelled"},
    }


class UpdateWeightsRequest(BaseModel):
    model_path: str = Field(description="a diffusers folder (safetensors) under an allowed root")
    modules: Names = Field(
        list(DENOISERS),
        description="which pipeline modules to reload; by default the denoisers (transformer, "
        "and transformer_2 where the model has a second expert, as Wan 2.2 does)",
    )


class SetLoraRequest(BaseModel):
    lora_nickname: Names = Field(description="the adapters to make active, exactly these")
    lora_path: Names | None = Field(None, description="one per nickname; needed to load a new one")
    strength: float | list[float] = Field(1.0, description="one, or one per nickname")
    target: Target = "all"


class MergeLoraRequest(BaseModel):
    strength: float = 1.0
    target: Target = "all"


class UnmergeLoraRequest(BaseModel):
    target: Target = "all"


class NoArgs(BaseModel):
    """The op takes no arguments: send no body, or ``{}``."""


class ChecksumRequest(BaseModel):
    modules: Names | None = Field(None, description="default: every module")


def request_body(
    model: type[BaseModel], required: bool, media_type: str = "application/json"
) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the request body."""
    schema = model.model_json_schema(by_alias=True)
    assert "$defs" not in schema, "keep request models flat: openapi_extra holds no $defs"
    content = {media_type: {"schema": schema}}
    return {"requestBody": {"required": required, "content": content}}


@dataclass(frozen=True)
class FormTypes:
    """Which fields of a form (text, as every form field is) hold integers, numbers or
    switches, and which may hold JSON (an object or a list, as the JSON body takes them:
    a request's ``lora``); the others stay text for their parser."""

    ints: frozenset[str]
    floats: frozenset[str]
    bools: frozenset[str]
    structured: frozenset[str] = frozenset()


def _holds_objects(kind: Any) -> bool:
    """An object, or a list of them (a list of files or of numbers is not JSON here)."""
    origin = typing.get_origin(kind)
    if origin is dict:
        return True
    return origin is list and any(_holds_objects(t) for t in typing.get_args(kind))


def form_types(model: type[BaseModel]) -> FormTypes:
    """The form fields ``model`` declares as int, float or bool (or None)."""
    kinds: dict[type, set[str]] = {int: set(), float: set(), bool: set()}
    structured: set[str] = set()
    for name, info in model.model_fields.items():
        annotation = info.annotation
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        held = set(typing.get_args(annotation) if union else (annotation,)) - {type(None)}
        if any(_holds_objects(t) for t in held):
            structured.add(info.alias or name)
        kind = held.pop() if len(held) == 1 else None
        if kind in kinds:
            kinds[kind].add(info.alias or name)
    ints, floats, bools = (frozenset(kinds[t]) for t in (int, float, bool))
    return FormTypes(ints, floats, bools, frozenset(structured))
