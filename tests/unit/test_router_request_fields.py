"""Request fields through the router, on the wire: what the replica receives for each
form of ``step_cache``, for this server's call settings, and for the fields SGLang's
and vLLM-Omni's clients send (mapped, accepted or refused: docs/router.md, "Fields
from other servers").

The real app over httpx's ASGI transport against the stub replica, which parses what
arrives as a driver does (tests/stub_replica.py). Pixels: tests/e2e/test_request_fields.py.
"""

from __future__ import annotations

from typing import Any

from dpserve.contract import protocol as p
from dpserve.router import peers
from dpserve.router.fields import request_fields
from tests.unit.test_router_images import BODY, EDITS, GEN, PNG, _router, _run

FBC = p.StepCache(type="first_block_cache")
OFF = p.StepCache(type="none")


def _received(fields: dict[str, Any]) -> p.GenerateParams:
    """What the replica got for a generation of BODY with ``fields``."""

    async def scenario() -> p.GenerateParams:
        async with _router() as (http, stub):
            answer = await http.post(GEN, json={**BODY, **fields})
            assert answer.status_code == 200, answer.text
            assert len(stub.received) == 1
            return stub.received[0][0]

    return _run(scenario)


def _refusals(cases: list[tuple[dict[str, Any], str, str]]) -> None:
    """Each body is a 400 naming the field, with the message part given; none reaches
    the replica."""

    async def scenario() -> None:
        async with _router() as (http, stub):
            for fields, field, says in cases:
                answer = await http.post(GEN, json={**BODY, **fields})
                assert answer.status_code == 400, (fields, answer.text)
                error = answer.json()["error"]
                named = {f["field"]: f["message"] for f in error["fields"]}
                assert field in named, (fields, error)
                assert says in named[field], (fields, named[field])
            assert stub.received == []

    _run(scenario)


def test_every_documented_step_cache_form_reaches_the_replica() -> None:
    forms = {
        "taylorseer": p.StepCache(type="taylorseer"),
        "first_block_cache": FBC,
        "none": OFF,
    }
    dicts: list[tuple[dict[str, Any], p.StepCache]] = [
        ({"type": "taylorseer", "interval": 3}, p.StepCache(type="taylorseer", interval=3)),
        (
            {"type": "first_block_cache", "threshold": 0.08},
            p.StepCache(type="first_block_cache", threshold=0.08),
        ),
        ({"type": "taylorseer", "threshold": None}, p.StepCache(type="taylorseer")),
        ({"type": "none"}, OFF),
    ]

    async def scenario() -> None:
        async with _router() as (http, stub):
            sent = [*forms.items(), *dicts]
            for form, _ in sent:
                answer = await http.post(GEN, json={**BODY, "step_cache": form})
                assert answer.status_code == 200, (form, answer.text)
            assert [params.step_cache for params, _ in stub.received] == [c for _, c in sent]

    _run(scenario)


def test_this_servers_call_settings_reach_the_replica() -> None:
    got = _received(
        {
            "max_sequence_length": 64,
            "flow_shift": 2.5,
            "vae_use_tiling": True,
            "vae_use_slicing": True,
        }
    )
    assert (got.max_sequence_length, got.flow_shift) == (64, 2.5)
    assert got.vae_use_tiling and got.vae_use_slicing
    plain = _received({"vae_use_tiling": None, "vae_use_slicing": False})
    assert not plain.vae_use_tiling and not plain.vae_use_slicing


def test_sglangs_cache_switches_are_step_caches() -> None:
    assert _received({"enable_teacache": True}).step_cache == FBC
    assert _received({"enable_cache_dit": True}).step_cache == FBC
    assert _received({"enable_teacache": True, "enable_cache_dit": False}).step_cache == FBC
    # false asks for no cache, whatever the service's default
    assert _received({"enable_teacache": False}).step_cache == OFF
    assert _received({"enable_teacache": None}).step_cache is None


def test_sglangs_output_quality_is_the_jpeg_or_webp_quality() -> None:
    for name, quality in peers.OUTPUT_QUALITIES.items():
        got = _received({"output_quality": name, "output_format": "jpeg"})
        assert got.output_compression == quality, name
    assert _received({"output_quality": "low", "output_format": "webp"}).output_compression == 35
    png = _received({"output_quality": "high"})  # a PNG is lossless: nothing to set
    assert png.output_format == "png" and png.output_compression is None


def test_fields_that_cannot_change_the_image_here_are_accepted() -> None:
    got = _received({"generator_device": "cpu", "diffusers_kwargs": None, "extra_params": {}})
    assert got == _received({})
    assert _received({"lora": None}) == got


def test_the_rest_is_refused_naming_what_to_send() -> None:
    _refusals(
        [
            (
                {"generator_device": "cuda"},
                "generator_device",
                "draws every seed's noise on the CPU",
            ),
            ({"enable_teacache": "yes"}, "enable_teacache", "must be true or false"),
            (
                {"enable_cache_dit": True, "step_cache": "taylorseer"},
                "enable_cache_dit",
                "give step_cache or this",
            ),
            ({"output_quality": "ultra"}, "output_quality", "must be one of maximum, high"),
            (
                {"output_quality": "low", "output_format": "jpeg", "output_compression": 5},
                "output_quality",
                "give output_compression or this",
            ),
            (
                {"diffusers_kwargs": {"max_sequence_length": 64, "eta": 1}},
                "diffusers_kwargs",
                "send max_sequence_length as top-level fields",
            ),
            (
                {"extra_params": {"cache_threshold": 0.1}},
                "extra_params",
                "send negative_prompt, num_inference_steps",
            ),
            ({"extra_params": ["x"]}, "extra_params", "does not do"),
            ({"lora": {"name": "a", "path": "/x", "weight": 1}}, "lora", "not weight"),
            ({"lora": {"name": "a", "scale": 11}}, "lora", "between -10 and 10"),
            ({"max_sequence_length": 0}, "max_sequence_length", "between 1 and"),
            ({"flow_shift": -1}, "flow_shift", "between 0.01 and 100"),
            ({"vae_use_tiling": "on"}, "vae_use_tiling", "must be true or false"),
        ]
    )


def test_an_edit_form_takes_the_same_fields_as_text() -> None:
    async def scenario() -> None:
        async with _router() as (http, stub):
            image = {"image": ("a.png", PNG, "image/png")}
            form = {
                "prompt": "y",
                "enable_teacache": "true",
                "vae_use_tiling": "true",
                "max_sequence_length": "32",
                "flow_shift": "1.5",
                "output_format": "jpeg",
                "output_quality": "medium",
                "generator_device": "cpu",
            }
            answer = await http.post(EDITS, data=form, files=image)
            assert answer.status_code == 200, answer.text
            got = stub.received[0][0]
            assert got.step_cache == FBC and got.vae_use_tiling
            assert (got.max_sequence_length, got.flow_shift, got.output_compression) == (
                32,
                1.5,
                55,
            )
            # A name alone nobody knows: a 400 that names it (tests/unit/test_router_lora.py).
            refused = await http.post(EDITS, data={"prompt": "y", "lora": "a"}, files=image)
            assert refused.status_code == 400 and "adapter 'a' is not known" in refused.text

    _run(scenario)


def test_v1_models_advertises_every_field_each_route_takes() -> None:
    async def scenario() -> None:
        async with _router() as (http, _):
            model = (await http.get("/v1/models")).json()["data"][0]
            assert model["router_features"]["request_fields"] == request_fields()

    _run(scenario)
    fields = request_fields()
    assert {"step_cache", "max_sequence_length", "enable_teacache"} <= set(fields["generations"])
    assert not {"diffusers_kwargs", "extra_params"} & set(fields["edits"])
    assert set(fields["edits"]) - set(fields["generations"]) == {
        "image",
        "image[]",
        "mask",
        "strength",
        "input_fidelity",
    }
