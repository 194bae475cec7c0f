"""Qwen-Image (``QwenImageTransformer2DModel``) split across real gangs computes the
single-rank result: final latents of the tiny Qwen-Image model (float32, same seed, true
CFG, one thread per rank) within 1e-5 of the latents' magnitude in every 2-rank layout and
a 4-rank one, cfg2 byte-identical. The prompt's text tokens do not divide by the split
(the cut pads them with masked keys), and a batch of two prompts of different lengths
exercises the masks that differ between rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel_harness import final_latents, relative_error

pytestmark = pytest.mark.gang

# 27 and 17 text tokens: the split pads them (1 and 3 keys masked at sp=4).
REQUEST = dict(
    prompt="a red fox in snow",
    negative_prompt="ugly blurry",
    true_cfg_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[7],
)
LAYOUTS = {
    "ulysses2": dict(sp=2, ulysses=2),
    "ring2": dict(sp=2, ring=2),
    "tp2": dict(tp=2),
    "ulysses2xring2": dict(sp=4, ulysses=2, ring=2),
    "tp2xulysses2": dict(tp=2, sp=2, ulysses=2),
}


@pytest.fixture(scope="module")
def reference(tiny_qwen_model: Path) -> torch.Tensor:
    return final_latents(tiny_qwen_model, {}, REQUEST)


def test_cfg2_is_byte_identical_to_one_rank(tiny_qwen_model: Path, reference: torch.Tensor) -> None:
    latents = final_latents(tiny_qwen_model, {"cfg": 2}, REQUEST)
    assert torch.equal(latents, reference)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(name: str, tiny_qwen_model: Path, reference: torch.Tensor) -> None:
    latents = final_latents(tiny_qwen_model, LAYOUTS[name], REQUEST)
    assert latents.shape == reference.shape
    error = relative_error(latents, reference)
    print(f"{name}: relative error {error:.2e}")
    assert error <= 1e-5, f"{name}: relative error {error:.2e}"
