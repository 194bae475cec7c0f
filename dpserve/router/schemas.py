"""The request bodies (and answers) each route has, declared for /docs and /openapi.json.

FastAPI validates nothing with these models (no 422s): the routes keep their own
parsing (``parse_image_request``, the edit form's, the control state's checks), which
names every bad field in a 400. The forms read their fields' types from them
(``form_types``: which text fields are numbers or switches), so a form field's type
is spelled here only. Each model mirrors what its parser accepts: unknown fields are a
400 for generation and edits and ignored by control ops, as declared
(tests/unit/test_router_security.py and tests/unit/test_router_images.py compare the
fields).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from dpserve.contract import validation as pv
from dpserve.router import peers

Names = str | list[str]
Target = Literal["all", "transformer"]  # dpserve.contract.control_state.LORA_TARGETS


class _ImageFields(BaseModel):
    """The fields generations and edits share: OpenAI's, and SGLang's extras."""

    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400, named

    prompt: str = Field(max_length=pv.MAX_PROMPT_CHARS)
    negative_prompt: str | None = Field(None, max_length=pv.MAX_PROMPT_CHARS)
    n: int = Field(1, ge=1, le=pv.Limits.max_n, description="images in this request")
    size: str | None = Field(
        None, description='"WIDTHxHEIGHT" (multiples of the model\'s size factor) or "auto"'
    )
    width: int | None = Field(None, description="instead of size, with height")
    height: int | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=pv.Limits.max_steps)
    guidance_scale: float | None = Field(None, ge=0, le=pv.Limits.max_scale)
    true_cfg_scale: float | None = Field(None, ge=0, le=pv.Limits.max_scale)
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(
        None, ge=0, le=100, description="jpeg/webp quality (0-100); not for png"
    )
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json", description="url needs the router's --output-dir; not with stream"
    )
    stream: bool = Field(False, description="answer Server-Sent Events (OpenAI's image events)")
    partial_images: int = Field(
        0, ge=0, le=pv.MAX_PARTIAL_IMAGES, description="previews per image, with stream"
    )
    step_cache: str | dict[str, str | float | None] | None = Field(
        None,
        description='a step cache for this request: "first_block_cache" or "taylorseer" '
        '(its default knob), {"type": "first_block_cache", "threshold": 0.08}, '
        '{"type": "taylorseer", "interval": 3}, or "none" (off, whatever the service\'s '
        "default); which ones a service offers: GET /v1/models features.step_caches",
    )
    max_sequence_length: int | None = Field(
        None,
        ge=1,
        le=pv.MAX_SEQUENCE_LENGTH,
        description="text tokens the prompt is padded or cut to; at most "
        "features.max_sequence_length.max (null there: the model takes none)",
    )
    flow_shift: float | None = Field(
        None,
        ge=pv.FLOW_SHIFT_RANGE[0],
        le=pv.FLOW_SHIFT_RANGE[1],
        description="the flow-matching schedule's shift s (sigma -> s*sigma/(1+(s-1)*sigma)), "
        "instead of the scheduler's own; where features.flow_shift is not null",
    )
    vae_use_tiling: bool = Field(False, description="decode in tiles (less memory)")
    vae_use_slicing: bool = Field(False, description="decode one image at a time (less memory)")
    # SGLang's names (docs/router.md, "Fields from other servers").
    enable_teacache: bool | None = Field(
        None, description='SGLang\'s: true is step_cache "first_block_cache", false "none"'
    )
    enable_cache_dit: bool | None = Field(
        None, description='SGLang\'s: true is step_cache "first_block_cache", false "none"'
    )
    output_quality: Literal["maximum", "high", "default", "medium", "low"] | None = Field(
        None,
        description="SGLang's: output_compression "
        + ", ".join(f"{k} {v}" for k, v in peers.OUTPUT_QUALITIES.items())
        + " (jpeg/webp; a png has none)",
    )
    generator_device: Literal["cpu"] | None = Field(
        None, description="SGLang's: noise is always drawn on the CPU here"
    )
    model: str | None = Field(
        None, description="the served model's name (GET /v1/models); another is a 404"
    )
    user: str | None = None
    quality: Literal["auto"] | None = Field(None, description="no tiers: only auto")
    style: None = Field(None, description="DALL-E 3's; refused: describe the style in the prompt")
    background: Literal["auto", "opaque"] | None = Field(
        None, description="images are opaque; transparent is refused"
    )
    moderation: Literal["auto", "low"] | None = Field(None, description="nothing is filtered")
    safety_identifier: str | None = None


class ImageGenerationRequest(_ImageFields):
    """OpenAI's images API with SGLang's extra fields."""

    seed: int | list[int] | None = Field(
        None, description="one seed (image i gets seed + i) or one per image", ge=0, le=pv.MAX_SEED
    )


class ImageEditForm(_ImageFields):
    """OpenAI's edit form (multipart/form-data) with SGLang's extra fields; numbers are
    form text. ``image`` or ``image[]`` (the openai client's name for a list): one or
    more image files; ``mask`` repaints where it is white (its size is the image's)."""

    image: list[bytes] | None = Field(None, description=f"1-{pv.MAX_EDIT_IMAGES} image files")
    image_list: list[bytes] | None = Field(None, alias="image[]", description="same as image")
    mask: bytes | None = None
    strength: float | None = Field(None, gt=0, le=1, description="how far from the input")
    seed: int | None = Field(None, ge=0, le=pv.MAX_SEED, description="image i gets seed + i")
    input_fidelity: None = Field(None, description="refused: strength says how far to go")


class ImageVariationForm(ImageEditForm):
    """OpenAI's variation form: an image-to-image edit of one ``image`` without a prompt
    (or a mask; either is a 400 pointing to /v1/images/edits)."""

    prompt: None = Field(None, description="refused: with a prompt it is an edit")  # type: ignore[assignment]
    image_list: None = Field(None, alias="image[]", description="one image: send it as image")
    mask: None = Field(None, description="refused: inpainting is an edit")


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
    modules: Names = Field(["transformer"], description="which pipeline modules to reload")


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
    switches; the others stay text for their parser."""

    ints: frozenset[str]
    floats: frozenset[str]
    bools: frozenset[str]


def form_types(model: type[BaseModel]) -> FormTypes:
    """The form fields ``model`` declares as int, float or bool (or None)."""
    kinds: dict[type, set[str]] = {int: set(), float: set(), bool: set()}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        held = set(typing.get_args(annotation) if union else (annotation,)) - {type(None)}
        kind = held.pop() if len(held) == 1 else None
        if kind in kinds:
            kinds[kind].add(info.alias or name)
    return FormTypes(*(frozenset(kinds[t]) for t in (int, float, bool)))
