"""Sequence parallel over a video's frames x tokens computes the single-rank result:
final latents of a tiny Wan-style model on real gangs (float32, same seed, guidance
CFG, one thread per rank), within the image layouts' tolerance, 1e-5 of the latents'
magnitude. 36 tokens a pass (3 latent frames x 3 x 4 patches) split 2 and 4 ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpserve.contract import protocol as p
from tests.parallel_harness import final_latents, relative_error

pytestmark = pytest.mark.gang

REQUEST = dict(
    prompt="a red car on a wet road",
    negative_prompt="blurry",
    guidance_scale=5.0,
    width=64,
    height=48,
    num_inference_steps=3,
    seed=[7],
    video=p.VideoSpec(num_frames=9, fps=16),
)
LAYOUTS = {
    "ulysses2": dict(sp=2, ulysses=2),
    "ring2": dict(sp=2, ring=2),
    "ulysses2xring2": dict(sp=4, ulysses=2, ring=2),
    "cfg2xulysses2": dict(cfg=2, sp=2, ulysses=2),
}


@pytest.fixture(scope="module")
def reference(tiny_video_model: Path) -> torch.Tensor:
    return final_latents(tiny_video_model, {}, REQUEST)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_video_layout_matches_one_rank(
    name: str, tiny_video_model: Path, reference: torch.Tensor
) -> None:
    latents = final_latents(tiny_video_model, LAYOUTS[name], REQUEST)
    assert latents.shape == reference.shape == (1, 4, 3, 6, 8)
    error = relative_error(latents, reference)
    # (Ulysses alone may be bitwise equal: each rank attends whole heads. That the
    # tokens are really split is test_video_gang's.)
    assert error <= 1e-5, f"{name}: relative error {error:.2e}"


def test_a_video_without_cfg_splits_over_the_cfg_ranks(tiny_video_model: Path) -> None:
    """(As Ulysses over the pair: test_video_gang sees each rank hold half the tokens.)"""
    plain = {**REQUEST, "guidance_scale": 1.0}
    latents = final_latents(tiny_video_model, {"cfg": 2}, plain)
    error = relative_error(latents, final_latents(tiny_video_model, {}, plain))
    assert error <= 1e-5, f"relative error {error:.2e}"


def test_tokens_that_do_not_split_are_refused_with_the_count(tiny_video_model: Path) -> None:
    odd = {**REQUEST, "width": 48, "height": 48}  # 3 x 3 x 3 = 27 tokens over 2 ranks
    with pytest.raises(Exception, match="27 video tokens cannot be split over sp=2"):
        final_latents(tiny_video_model, {"sp": 2, "ulysses": 2}, odd)
