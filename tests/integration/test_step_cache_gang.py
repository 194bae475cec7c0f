"""Step caches under CFG-parallel: each rank keeps its own branch's cache state, so a
cfg-2 gang's cached image is byte-identical to one rank's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

CFG_REQUEST = dict(
    prompt="a red fox in the snow",
    negative_prompt="blurry",
    true_cfg_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=8,
    seed=[7],
)


def test_a_cfg_gang_caches_each_branch_as_one_rank_does(tiny_model: Path) -> None:
    # The gang's default skips (threshold 1.0 on random weights); one rank asks per request.
    flags = ("--step-cache", "first_block_cache", "--step-cache-threshold", "1.0")
    with (
        WorkerProcess(tiny_model, "--cfg", "2", *flags) as gang,
        WorkerProcess(tiny_model) as one,
        gang.client() as g,
        one.client() as o,
    ):
        cached = {"type": "first_block_cache", "threshold": 1.0}
        _, gang_png = g.generate(**CFG_REQUEST)
        _, one_png = o.generate(**CFG_REQUEST, step_cache=cached)
        _, plain_png = o.generate(**CFG_REQUEST)
        assert gang_png == one_png and one_png != plain_png
        taylor = {"type": "taylorseer", "interval": 2}
        assert (
            g.generate(**CFG_REQUEST, step_cache=taylor)[1]
            == o.generate(**CFG_REQUEST, step_cache=taylor)[1]
        )
        # No true CFG: not lent to a sequence split while cached; both ranks run it whole.
        plain = {k: v for k, v in CFG_REQUEST.items() if k not in ("negative_prompt",)}
        assert g.generate(**plain)[1] == o.generate(**plain, step_cache=cached)[1]
        assert g.generate(**CFG_REQUEST, step_cache="none")[1] == plain_png
        info = g.control("model_info")
        assert info["features"]["step_cache_default"] == cached
        assert info["without_true_cfg"] == "lent to sequence parallel (ulysses)"
