"""The offline tiny Wan-style video pipelines (``make-tiny-model --variant video`` and
``video-i2v``): built byte-identically per seed, loaded by diffusers as a WanPipeline
(a WanImageToVideoPipeline), fast on one thread."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from diffusers import DiffusionPipeline  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan import WanPipeline  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline  # noqa: E402
from PIL import Image  # noqa: E402

from dpserve.cli import build_parser  # noqa: E402
from dpserve.worker.pipeline import guides_by_scale, size_factor  # noqa: E402
from dpserve.worker.tiny_model import (  # noqa: E402
    FAMILY_VARIANTS,
    VARIANTS,
    VIDEO_VARIANTS,
    build_tiny_pipeline,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pipe(tiny_video_model: Path) -> Any:
    loaded = DiffusionPipeline.from_pretrained(
        tiny_video_model, local_files_only=True, use_safetensors=True
    )
    loaded.set_progress_bar_config(disable=True)
    return loaded


def _digest(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def _frames(pipe: Any, seed: int = 0, prompt: str = "a cat", **kwargs: Any) -> Any:
    out = pipe(
        prompt=prompt,
        width=64,
        height=48,
        num_frames=9,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )
    return out.frames


def test_same_seed_same_files_other_seed_other_weights(
    tiny_video_model: Path, tmp_path: Path
) -> None:
    ref = _digest(tiny_video_model)
    assert _digest(build_tiny_pipeline(tmp_path / "again", "video", seed=0)) == ref
    other = _digest(build_tiny_pipeline(tmp_path / "other", "video", seed=1))
    assert {k for k in ref if ref[k] != other[k]} == {
        "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    }
    index = json.loads((tiny_video_model / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert not list(tiny_video_model.rglob("*.bin"))  # safetensors only
    assert sum(f.stat().st_size for f in tiny_video_model.rglob("*") if f.is_file()) < 2**20


def test_loads_as_a_wan_pipeline_with_its_factors(pipe: Any) -> None:
    assert isinstance(pipe, WanPipeline)
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (8, 4)
    assert size_factor(pipe) == 16  # 8 px a latent, 2 latents a patch
    assert guides_by_scale(pipe)  # its guidance_scale is CFG


def test_the_cli_offers_every_variant() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    variant = next(a for a in sub.choices["make-tiny-model"]._actions if a.dest == "variant")
    assert set(variant.choices or ()) == {*VARIANTS, *VIDEO_VARIANTS, *FAMILY_VARIANTS}
    assert set(VIDEO_VARIANTS) == {"video", "video-small", "video-i2v"}


def test_generates_seeded_frames_in_well_under_a_second(pipe: Any) -> None:
    started = time.perf_counter()
    frames = _frames(pipe)
    assert time.perf_counter() - started < 5  # about 0.2 s here; a loaded CI box is slower
    assert frames.shape == (1, 9, 48, 64, 3)
    assert frames.min() >= 0.0 and frames.max() <= 1.0 and frames.std() > 0.05
    assert (_frames(pipe) == frames).all()
    assert (_frames(pipe, seed=1) != frames).any()
    # The prompt reaches the frames, and CFG (guidance_scale > 1, the default) matters.
    assert abs(_frames(pipe, prompt="a red car") - frames).mean() > 0.5 / 255
    assert abs(_frames(pipe, guidance_scale=1.0) - frames).mean() > 0.1 / 255


def test_the_image_to_video_variant_animates_its_input_image(tiny_i2v_model: Path) -> None:
    pipe = DiffusionPipeline.from_pretrained(
        tiny_i2v_model, local_files_only=True, use_safetensors=True
    )
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe, WanImageToVideoPipeline)
    assert pipe.image_encoder is None  # Wan 2.2's way: the image joins as latents
    assert pipe.transformer.config.in_channels == 12  # noise 4, mask 4, image latents 4
    assert size_factor(pipe) == 16 and guides_by_scale(pipe)
    red, blue = (Image.new("RGB", (80, 60), colour) for colour in ((220, 30, 30), (30, 30, 220)))
    frames = _frames(pipe, image=red)
    assert frames.shape == (1, 9, 48, 64, 3)
    assert (_frames(pipe, image=red) == frames).all()
    assert abs(_frames(pipe, image=blue) - frames).mean() > 0.2 / 255
