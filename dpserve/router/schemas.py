"""The request bodies each route takes, declared for /docs and /openapi.json.

These models only document: the routes keep their own parsing
(``parse_image_request``, the control state's checks), which names every bad
field in a 400, so FastAPI validates nothing here (no 422s). Each model mirrors
what its parser accepts: unknown fields are a 400 for generation and ignored by
control ops, as declared (tests/unit/test_router_security.py compares the fields).
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from dpserve import protocol as p

Names = str | list[str]
Target = Literal["all", "transformer"]  # dpserve.control_state.LORA_TARGETS


class ImageGenerationRequest(BaseModel):
    """OpenAI's images API with SGLang's extra fields."""

    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400, named

    prompt: str = Field(max_length=p.MAX_PROMPT_CHARS)
    negative_prompt: str | None = Field(None, max_length=p.MAX_PROMPT_CHARS)
    n: int = Field(1, ge=1, le=p.Limits.max_n, description="images in this request")
    size: str | None = Field(
        None, description='"WIDTHxHEIGHT" (multiples of the model\'s size factor) or "auto"'
    )
    width: int | None = Field(None, description="instead of size, with height")
    height: int | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=p.Limits.max_steps)
    guidance_scale: float | None = Field(None, ge=0, le=p.Limits.max_scale)
    true_cfg_scale: float | None = Field(None, ge=0, le=p.Limits.max_scale)
    seed: int | list[int] | None = Field(
        None, description="one seed (image i gets seed + i) or one per image", ge=0, le=p.MAX_SEED
    )
    output_format: Literal["png", "jpeg", "webp"] = "png"
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json", description="url needs the router's --output-dir"
    )
    model: str | None = Field(None, description="accepted and ignored (one model per service)")
    user: str | None = None
    quality: str | None = None
    style: str | None = None


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


def request_body(model: type[BaseModel], required: bool) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the JSON request body."""
    schema = model.model_json_schema()
    assert "$defs" not in schema, "keep request models flat: openapi_extra holds no $defs"
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": required, "content": content}}


# Each control op's body, and whether the op needs one.
_CONTROL: Final[dict[str, tuple[type[BaseModel], bool]]] = {
    "update_weights_from_disk": (UpdateWeightsRequest, True),
    "release_memory_occupation": (NoArgs, False),
    "resume_memory_occupation": (NoArgs, False),
    "set_lora": (SetLoraRequest, True),
    "merge_lora_weights": (MergeLoraRequest, False),
    "unmerge_lora_weights": (UnmergeLoraRequest, False),
    "list_loras": (NoArgs, False),
    "get_weights_checksum": (ChecksumRequest, False),
}


def control_body(op: str) -> dict[str, Any]:
    model, required = _CONTROL[op]
    return request_body(model, required)
