"""Pure pieces of the worker: argument building, CFG detection, merging rank outcomes."""

from __future__ import annotations

import pytest

from dpserve.protocol import ErrorBody, GenerateParams, RequestError

torch = pytest.importorskip("torch")

from dpserve.worker.executor import _merge_ranks, _RankOutcome  # noqa: E402
from dpserve.worker.pipeline import cfg_requested, pipeline_kwargs  # noqa: E402

FLUX_ARGS = {"negative_prompt": None, "true_cfg_scale": 1.0, "width": None, "height": None,
             "num_inference_steps": 28, "guidance_scale": 3.5}  # fmt: skip


def test_pipeline_kwargs_makes_one_cpu_generator_per_seed() -> None:
    params = GenerateParams(prompt="a", n=2, seed=[5, 6], width=64, num_inference_steps=3)
    kwargs = pipeline_kwargs(params, FLUX_ARGS, "pil")
    assert kwargs["num_images_per_prompt"] == 2 and kwargs["width"] == 64
    assert "height" not in kwargs  # None means the pipeline's own default
    gens = kwargs["generator"]
    assert [g.initial_seed() for g in gens] == [5, 6]
    assert all(g.device.type == "cpu" for g in gens)


def test_fields_the_pipeline_does_not_take_are_refused_by_name() -> None:
    params = GenerateParams(prompt="a", seed=[1], true_cfg_scale=4.0, negative_prompt="b")
    with pytest.raises(RequestError) as err:
        pipeline_kwargs(params, {"negative_prompt": None}, "pil")
    assert err.value.code == "unsupported"
    assert [f.field for f in err.value.fields] == ["true_cfg_scale"]


def test_cfg_needs_a_negative_prompt_and_scale_above_one() -> None:
    qwen_defaults = {"true_cfg_scale": 4.0}
    assert not cfg_requested(GenerateParams(prompt="a"), qwen_defaults)
    assert cfg_requested(GenerateParams(prompt="a", negative_prompt=""), qwen_defaults)
    assert not cfg_requested(GenerateParams(prompt="a", negative_prompt="b"), FLUX_ARGS)
    on = GenerateParams(prompt="a", negative_prompt="b", true_cfg_scale=1.5)
    assert cfg_requested(on, FLUX_ARGS)


def test_merge_first_error_wins_and_checksums_must_agree() -> None:
    ok = _RankOutcome(ok=True, result={"checksums": {"vae": "aa"}})
    bad = _RankOutcome(ok=False, error=ErrorBody(code="invalid_request", message="nope"))
    assert _merge_ranks("get_weights_checksum", [ok, ok]) == {
        "checksums": {"vae": "aa"},
        "ranks": 2,
    }
    with pytest.raises(RequestError, match="rank 1: nope"):
        _merge_ranks("set_lora", [ok, bad])
    other = _RankOutcome(ok=True, result={"checksums": {"vae": "bb"}})
    with pytest.raises(RequestError, match="differ between ranks"):
        _merge_ranks("get_weights_checksum", [ok, other])
