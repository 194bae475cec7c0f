"""Qwen-Image-Edit (``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``) split across
real gangs computes the single-rank result, through the worker's edit path.

An edit differs from a text-to-image call in two places the split must follow: the
prompt is encoded with the reference image (the VL encoder's pixel inputs, on the output
rank only; its hidden states are relayed), and the reference image's latents are
appended to the image tokens (``img_shapes`` holds one grid per image, the rotary table
covers all of them), so the cut narrows output and reference tokens as one sequence.
Final latents (float32, same seed, true CFG, one thread per rank) within 1e-5 of the
latents' magnitude; cfg2 byte-identical."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.parallel_harness import final_latents, relative_error

pytestmark = pytest.mark.gang

# 64x48: the output is 4x3 tokens; the reference is resized by the pipeline to about
# 1024x1024 pixels (74x56 tokens), 4156 image tokens in all: any split of 2 or 4 divides.
REQUEST = dict(
    prompt="a red fox in snow",
    negative_prompt="ugly blurry",
    true_cfg_scale=4.0,
    num_inference_steps=2,
    seed=[7],
)
LAYOUTS = {
    "ulysses2": dict(sp=2, ulysses=2),
    "ring2": dict(sp=2, ring=2),
    "tp2": dict(tp=2),
    "ulysses2xring2": dict(sp=4, ulysses=2, ring=2),
    "tp2xcfg2": dict(tp=2, cfg=2),
}


def reference_png(
    color: tuple[int, int, int] = (220, 60, 40), size: tuple[int, int] = (64, 48)
) -> bytes:
    """A picture of one colour with seeded grain (the colour is what the tiny model's
    output follows most: random pixels all look alike to it)."""
    grain = np.random.default_rng(3).integers(-16, 17, (size[1], size[0], 3))
    pixels = np.clip(np.array(color) + grain, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


IMAGE = reference_png()


@pytest.fixture(scope="module")
def reference(tiny_qwen_edit_model: Path) -> torch.Tensor:
    return final_latents(tiny_qwen_edit_model, {}, REQUEST, images=(IMAGE,))


def test_the_reference_image_changes_the_edit(
    tiny_qwen_edit_model: Path, reference: torch.Tensor
) -> None:
    other = final_latents(tiny_qwen_edit_model, {}, REQUEST, images=(reference_png((20, 40, 200)),))
    assert reference.shape == (1, 12, 16)
    assert not torch.equal(other, reference)


def test_cfg2_is_byte_identical_to_one_rank(
    tiny_qwen_edit_model: Path, reference: torch.Tensor
) -> None:
    latents = final_latents(tiny_qwen_edit_model, {"cfg": 2}, REQUEST, images=(IMAGE,))
    assert torch.equal(latents, reference)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(
    name: str, tiny_qwen_edit_model: Path, reference: torch.Tensor
) -> None:
    latents = final_latents(tiny_qwen_edit_model, LAYOUTS[name], REQUEST, images=(IMAGE,))
    assert latents.shape == reference.shape
    error = relative_error(latents, reference)
    print(f"{name}: relative error {error:.2e}")
    assert error <= 1e-5, f"{name}: relative error {error:.2e}"


def test_two_references_split_like_one_rank(tiny_qwen_edit_plus_model: Path) -> None:
    """Edit-Plus: two reference images, three grids in ``img_shapes``, under ulysses2."""
    images = (IMAGE, reference_png((20, 40, 200)))
    plain = {k: v for k, v in REQUEST.items() if k not in ("negative_prompt", "true_cfg_scale")}
    whole = final_latents(tiny_qwen_edit_plus_model, {}, plain, images=images)
    split = final_latents(tiny_qwen_edit_plus_model, dict(sp=2, ulysses=2), plain, images=images)
    error = relative_error(split, whole)
    print(f"edit-plus ulysses2: relative error {error:.2e}")
    assert error <= 1e-5, f"relative error {error:.2e}"
