"""FLUX.2 (``Flux2Transformer2DModel``) split every way computes the single-rank result.

The tiny FLUX.2 is a ``Flux2KleinPipeline`` (4 heads): its CFG is guidance CFG
(``guidance_scale`` > 1 encodes an empty negative prompt), so a request with the
default scale has two branches for CFG gangs, and one at scale 1 has none (the CFG
ranks join the sequence split). Real gloo gangs, float32, same seed, one thread per
rank; the tolerance is the issue's, 1e-5 of the latents' magnitude.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.parallel_harness import final_latents, gang_run, relative_error

pytestmark = pytest.mark.gang

REQUEST = dict(
    prompt="a red fox in the snow",
    guidance_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[7],
)
PLAIN = {**REQUEST, "guidance_scale": 1.0}  # no CFG: a CFG gang lends its ranks to sp

LAYOUTS = {
    "cfg2": dict(cfg=2),
    "ulysses2": dict(sp=2, ulysses=2),
    "ring2": dict(sp=2, ring=2),
    "tp2": dict(tp=2),
    "tp2xulysses2": dict(tp=2, sp=2, ulysses=2),
    "ulysses2xring2": dict(sp=4, ulysses=2, ring=2),
    "cfg2xtp2": dict(cfg=2, tp=2),
}


@pytest.fixture(scope="module")
def reference(flux2_model: Path) -> torch.Tensor:
    return final_latents(flux2_model, {}, REQUEST)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(name: str, flux2_model: Path, reference: torch.Tensor) -> None:
    latents = final_latents(flux2_model, LAYOUTS[name], REQUEST)
    assert latents.shape == reference.shape
    error = relative_error(latents, reference)
    print(f"flux2 {name}: relative error {error:.2e}")
    if name == "cfg2":
        assert torch.equal(latents, reference)  # each rank runs one branch's exact forward
    else:
        assert error <= 1e-5, f"{name}: relative error {error:.2e}"


@pytest.fixture(scope="module")
def one_rank(flux2_model: Path) -> Callable[[], torch.Tensor]:
    return functools.cache(lambda: final_latents(flux2_model, {}, PLAIN))


@pytest.mark.parametrize("layout", [dict(cfg=2), dict(cfg=2, tp=2)], ids=["cfg2", "cfg2xtp2"])
def test_without_cfg_the_cfg_ranks_split_the_sequence(
    layout: dict[str, int], flux2_model: Path, one_rank: Callable[[], torch.Tensor]
) -> None:
    latents = final_latents(flux2_model, layout, PLAIN)
    error = relative_error(latents, one_rank())
    print(f"flux2 lent {layout}: relative error {error:.2e}")
    assert 0 < error <= 1e-5, f"relative error {error:.2e}"


def test_tp_ranks_read_only_their_pieces(flux2_model: Path, reference: torch.Tensor) -> None:
    """Loaded whole and cut after gives the latents reading pieces gives, bitwise; each
    tp rank reads about half the checkpoint."""
    read, reads = gang_run(flux2_model, dict(tp=2), REQUEST, read=True)
    cut = final_latents(flux2_model, dict(tp=2), REQUEST, read=False)
    assert torch.equal(read, cut)
    shares = [r["share"] for r in reads]
    print(f"flux2 tp2 read shares {shares}")
    assert all(s is not None and s <= 0.55 for s in shares), shares
