"""SD3 (SD3.5-style: dual attention, RMS qk-norm) split every way computes the
single-rank result: final latents of the tiny SD3 model on real gangs (float32, same
seed, guidance CFG batched by the pipeline, one thread per rank) within 1e-5 of the
latents' magnitude. 64x64 is 16 image tokens; the prompt is 32 CLIP + 32 T5 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel_harness import final_latents, relative_error

pytestmark = pytest.mark.gang

REQUEST = dict(
    prompt="a red fox in the snow",
    negative_prompt="blurry",
    guidance_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[7],
)
LAYOUTS = {
    "cfg2": dict(cfg=2),
    "ulysses2": dict(sp=2, ulysses=2),
    "ring2": dict(sp=2, ring=2),
    "tp2": dict(tp=2),
    "cfg2xulysses2": dict(cfg=2, sp=2, ulysses=2),
    "tp2xring2": dict(tp=2, sp=2, ring=2),
}


@pytest.fixture(scope="module")
def reference(tiny_sd3_model: Path) -> torch.Tensor:
    return final_latents(tiny_sd3_model, {}, REQUEST)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sd3_layout_matches_one_rank(
    name: str, tiny_sd3_model: Path, reference: torch.Tensor
) -> None:
    latents = final_latents(tiny_sd3_model, LAYOUTS[name], REQUEST)
    assert latents.shape == reference.shape == (1, 16, 8, 8)
    error = relative_error(latents, reference)
    print(f"{name}: relative error {error:.2e}")
    if name == "cfg2":
        assert torch.equal(latents, reference)
    else:
        assert error <= 1e-5, f"{name}: relative error {error:.2e}"
