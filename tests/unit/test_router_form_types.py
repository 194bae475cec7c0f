"""The forms (an edit's, a video job's) read which of their text fields are numbers
or switches from the models /openapi.json documents: one spelling of each type."""

from __future__ import annotations

from pydantic import BaseModel, Field

from dpserve.contract import protocol as p
from dpserve.router.forms import EDIT_TYPES, typed_value
from dpserve.router.schemas import FormTypes, form_types
from dpserve.router.video_api import FORM_TYPES as VIDEO_TYPES


def test_the_edit_forms_numbers_and_switches_are_the_documented_ones() -> None:
    assert (
        FormTypes(
            ints=frozenset(
                {
                    "n",
                    "num_inference_steps",
                    "output_compression",
                    "partial_images",
                    "width",
                    "height",
                    "max_sequence_length",
                    "seed",
                }
            ),
            floats=frozenset({"guidance_scale", "true_cfg_scale", "strength", "flow_shift"}),
            bools=frozenset(
                {
                    "stream",
                    "vae_use_tiling",
                    "vae_use_slicing",
                    "enable_teacache",
                    "enable_cache_dit",
                }
            ),
            structured=frozenset({"lora", "step_cache"}),  # JSON, or text (a name)
        )
        == EDIT_TYPES
    )
    assert (
        FormTypes(
            ints=frozenset({"width", "height", "fps", "num_frames", "seed", "num_inference_steps"}),
            floats=frozenset({"guidance_scale"}),
            bools=frozenset(),
            structured=frozenset({"lora"}),
        )
        == VIDEO_TYPES
    )


def test_only_a_field_of_one_scalar_type_is_converted() -> None:
    class Form(BaseModel):
        count: int
        scale: float | None = None
        on: bool = False
        either: int | str | None = None
        many: list[int] | None = None
        aliased: int | None = Field(None, alias="count[]")

    assert form_types(Form) == FormTypes(
        frozenset({"count", "count[]"}), frozenset({"scale"}), frozenset({"on"})
    )
    out: list[p.FieldError] = []
    types = form_types(Form)
    assert typed_value("count", "3", out, types) == 3
    assert typed_value("either", "3", out, types) == "3"
    assert typed_value("on", "TRUE", out, types) is True
    assert typed_value("scale", "x", out, types) is None
    assert out == [p.FieldError("scale", "must be a number, got 'x'")]


def test_a_structured_field_is_json_when_it_looks_like_json_else_text() -> None:
    out: list[p.FieldError] = []
    lora = '{"name": "ink", "scale": 0.5}'
    assert typed_value("lora", lora, out, EDIT_TYPES) == {"name": "ink", "scale": 0.5}
    assert typed_value("lora", ' [{"name": "a"}]', out, EDIT_TYPES) == [{"name": "a"}]
    assert typed_value("lora", "ink", out, EDIT_TYPES) == "ink"  # a name alone
    assert typed_value("prompt", "[not json", out, EDIT_TYPES) == "[not json"
    assert out == []
    assert typed_value("lora", "{oops", out, EDIT_TYPES) is None
    assert [f.field for f in out] == ["lora"] and "not valid JSON" in out[0].message
