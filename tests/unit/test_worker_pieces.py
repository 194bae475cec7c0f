"""Pure pieces of the worker: argument building, CFG detection, merging rank outcomes."""

from __future__ import annotations

import pytest

from dpserve.contract.protocol import (
    ErrorBody,
    GenerateParams,
    RequestError,
)

torch = pytest.importorskip("torch")

from dpserve.worker.executor import _merge_ranks, _RankOutcome  # noqa: E402
from dpserve.worker.pipeline import cfg_requested, pipeline_kwargs  # noqa: E402
from tests.stub_replica import model_info  # noqa: E402

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
        "shards": {},
        "ranks": 2,
    }
    with pytest.raises(RequestError, match="rank 1: nope"):
        _merge_ranks("set_lora", [ok, bad])
    other = _RankOutcome(ok=True, result={"checksums": {"vae": "bb"}})
    with pytest.raises(RequestError, match="differ between ranks"):
        _merge_ranks("get_weights_checksum", [ok, other])


def _piece(tp_rank: int, transformer: str, vae: str = "vv") -> _RankOutcome:
    return _RankOutcome(
        ok=True,
        result={
            "checksums": {"transformer": transformer, "vae": vae},
            "tp_rank": tp_rank,
            "sharded": ["transformer"],
        },
    )


def test_sharded_checksums_agree_per_piece_and_digest_the_pieces_in_tp_order() -> None:
    import hashlib

    # cfg2 x tp2: ranks 0, 1 are tp pieces 0, 1 of the cond branch; 2, 3 the same pieces.
    gang = [_piece(0, "t0"), _piece(1, "t1"), _piece(0, "t0"), _piece(1, "t1")]
    merged = _merge_ranks("get_weights_checksum", gang)
    assert merged["shards"] == {"transformer": ["t0", "t1"]}
    assert merged["checksums"]["transformer"] == hashlib.sha256(b"t0|t1").hexdigest()
    assert merged["checksums"]["vae"] == "vv"  # replicated: one checksum
    with pytest.raises(RequestError, match="ranks 1 and 3"):
        _merge_ranks("get_weights_checksum", [*gang[:3], _piece(1, "t9")])
    with pytest.raises(RequestError, match="vae weights differ between ranks 0 and 2"):
        _merge_ranks("get_weights_checksum", [*gang[:2], _piece(0, "t0", vae="x"), gang[3]])


def test_model_info_lists_every_ranks_weights() -> None:
    def info(rank: int, size: int) -> _RankOutcome:
        weights = {"rank": rank, "tp_rank": rank, "sp_rank": 0, "cfg_rank": 0}
        weights["bytes"] = {"transformer": size}
        result = {**model_info(), "layout": "tp2", "rank_weights": [weights]}
        return _RankOutcome(ok=True, result=result)

    merged = _merge_ranks("model_info", [info(0, 10), info(1, 10)])
    assert merged["layout"] == "tp2" and merged["ranks"] == 2
    assert [w["rank"] for w in merged["rank_weights"]] == [0, 1]
