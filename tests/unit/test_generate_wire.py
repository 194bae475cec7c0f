"""What a router sends is what a driver parses: each field of ``GenerateParams``,
encoded as the router encodes it and parsed again as the driver parses it, comes back
equal. A field the router left at its default travels as absent, never as a null the
driver's parse would count as given.

A field added to ``GenerateParams`` without a sample here fails the first test: the
gap that let every per-request ``step_cache`` be a 400 through the router (its unset
knobs went as nulls) had no test between the two ends.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv

LIMITS = pv.Limits()
# One non-default value per field, as a router's parse produces it.
SAMPLES: dict[str, list[Any]] = {
    "negative_prompt": ["blurry"],
    "n": [3],
    "width": [64],
    "height": [96],
    "num_inference_steps": [7],
    "guidance_scale": [3.5],
    "true_cfg_scale": [4.0],
    "seed": [[1]],
    "output_format": ["jpeg"],
    "output_compression": [40],
    "partial_images": [2],
    "edit": [p.EditInput(images=[0]), p.EditInput(images=[0], mask=1, strength=0.5)],
    "step_cache": [
        p.StepCache(type="taylorseer"),
        p.StepCache(type="taylorseer", interval=3),
        p.StepCache(type="first_block_cache"),
        p.StepCache(type="first_block_cache", threshold=0.2),
        p.StepCache(type="none"),
    ],
    "video": [p.VideoSpec(num_frames=9, fps=8)],
    "max_sequence_length": [64],
    "flow_shift": [2.5],
    "vae_use_tiling": [True],
    "vae_use_slicing": [True],
    "lora": [
        [],
        [p.LoraRef(name="ink")],
        [p.LoraRef(name="ink", path="/m/ink", scale=0.5), p.LoraRef(name="wash", scale=-1.0)],
    ],
}
# Fields whose sample needs a companion to be valid.
COMPANIONS: dict[str, dict[str, Any]] = {
    "n": {"seed": [1, 2, 3]},
    "output_compression": {"output_format": "webp"},
}


def _sent(params: p.GenerateParams) -> dict[str, Any]:
    """The body a driver reads from a router's GENERATE message."""
    message = p.decode(p.encode(p.GENERATE, "r", params, [b"a", b"b"]))
    body: dict[str, Any] = message.body_as(dict)
    return body


def _cases() -> list[tuple[str, Any]]:
    return [(name, value) for name, values in SAMPLES.items() for value in values]


def test_every_field_has_a_sample() -> None:
    assert set(SAMPLES) == set(p.GenerateParams.__struct_fields__) - {"prompt"}


@pytest.mark.parametrize(("name", "value"), _cases(), ids=lambda v: str(v)[:40])
def test_a_field_the_router_sets_reaches_the_driver_as_set(name: str, value: Any) -> None:
    params = p.GenerateParams(prompt="x", **{name: value, **COMPANIONS.get(name, {})})
    body = _sent(params)
    if name == "video":  # a job's params: the driver decodes them typed, never re-parses
        assert msgspec.convert(body, p.GenerateParams) == params
        return
    assert pv.parse_generate(body, LIMITS, blobs=2) == params


def test_fields_left_at_their_defaults_are_absent_on_the_wire() -> None:
    assert _sent(p.GenerateParams(prompt="x")) == {"prompt": "x"}
    cache = _sent(p.GenerateParams(prompt="x", step_cache=p.StepCache(type="taylorseer")))
    assert cache["step_cache"] == {"type": "taylorseer"}


def test_all_fields_at_once_round_trip() -> None:
    given: dict[str, Any] = {name: values[-1] for name, values in SAMPLES.items()}
    given.update(n=1, seed=[4], output_format="webp")
    del given["video"]
    params = p.GenerateParams(prompt="x", **given)
    assert pv.parse_generate(_sent(params), LIMITS, blobs=2) == params


def test_a_client_may_send_a_knob_as_null() -> None:
    """A null knob is left out, as a null field is anywhere in a request."""
    body = {
        "prompt": "x",
        "step_cache": {"type": "taylorseer", "interval": None, "threshold": None},
    }
    assert pv.parse_generate(body, LIMITS).step_cache == p.StepCache(type="taylorseer")
