"""Tests for the offline tiny Flux pipeline / LoRA builders (CPU, ~seconds)."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import numpy as np  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline  # noqa: E402

from dpserve.worker.tiny_model import (  # noqa: E402
    VARIANTS,
    build_tiny_lora,
    build_tiny_pipeline,
    transformer_config,
)

PROMPT = "a photo of a cat"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Timings and numerics as on a 1-core worker; also keeps CI noise down.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _load(model_dir: Path) -> Any:
    pipe = DiffusionPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(model_dir: Path) -> Any:
    return _load(model_dir)


def _png(pipe: Any, prompt: str = PROMPT, seed: int = 0, **kwargs: Any) -> bytes:
    image = pipe(
        prompt,
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    ).images[0]
    assert image.size == (64, 64)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int16)


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- build


def test_same_seed_is_byte_identical_and_seed_matters(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_pipeline(tmp_path / "again", seed=0)
    other = build_tiny_pipeline(tmp_path / "other", seed=1)
    ref = _tree_digest(model_dir)
    assert "model_index.json" in ref and "tokenizer/tokenizer.json" in ref
    assert _tree_digest(again) == ref
    other_digest = _tree_digest(other)
    assert other_digest.keys() == ref.keys()
    changed = {k for k in ref if ref[k] != other_digest[k]}
    assert changed == {
        "text_encoder/model.safetensors",
        "text_encoder_2/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    }


def test_layout_size_and_no_leftovers(model_dir: Path) -> None:
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    assert size < 10 * 2**20
    # The temp build dir was renamed into place, not left beside it.
    assert [p.name for p in model_dir.parent.iterdir()] == ["model"]


def test_refuses_non_empty_target_and_keeps_it(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_pipeline(target)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    # An empty directory is fine to fill (e.g. a pre-created volume mount point).
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (build_tiny_pipeline(empty) / "model_index.json").is_file()


def test_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    build_tiny_pipeline(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_variant(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        build_tiny_pipeline(tmp_path / "m", variant="huge")
    assert not any(tmp_path.iterdir())


def test_small_variant_config_is_valid() -> None:
    # Building "small" takes seconds and ~290 MB, so only check its transformer shape-wise.
    small = VARIANTS["small"]
    assert sum(small.axes_dims_rope) == small.attention_head_dim
    with torch.device("meta"):
        model = FluxTransformer2DModel(**transformer_config("small"))
    assert model.inner_dim == 8 * 64
    n_params = sum(p.numel() for p in model.parameters())
    assert 60e6 < n_params < 80e6  # ~275-290 MB in float32
    assert set(VARIANTS) == {"tiny", "tiny4", "small", "large"}


def test_large_variant_has_flux_width() -> None:
    # Building "large" writes ~5 GB (a GPU benchmark's model), so only check it shape-wise.
    large = VARIANTS["large"]
    assert (large.num_attention_heads, large.attention_head_dim) == (24, 128)  # FLUX.1's
    assert large.axes_dims_rope == (16, 56, 56)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**transformer_config("large"))
    assert model.inner_dim == 3072
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.2e9 < n_params < 1.4e9  # 2 double + 4 single blocks: ~5 GB in float32


# --------------------------------------------------------------------------- inference


def test_tokenizers_know_whole_words(pipe: Any) -> None:
    clip_ids = pipe.tokenizer(PROMPT).input_ids
    assert len(clip_ids) == 1 + 5 + 1  # <|startoftext|> a photo of a cat <|endoftext|>
    assert len(pipe.tokenizer_2(PROMPT).input_ids) == 5 + 1  # ▁a ▁photo ▁of ▁a ▁cat </s>
    assert pipe.tokenizer_2.unk_token_id not in pipe.tokenizer_2("zebra 42").input_ids


def test_loads_and_generates(pipe: Any) -> None:
    assert isinstance(pipe, FluxPipeline)
    base = _png(pipe)
    assert _png(pipe) == base  # deterministic for a fixed generator
    assert _pixels(base).std() > 5  # not a flat image
    assert _png(pipe, prompt="a red car") != base
    assert _png(pipe, seed=1) != base
    cfg = _png(pipe, negative_prompt="blurry", true_cfg_scale=4.0)
    assert cfg != base


# --------------------------------------------------------------------------- LoRA


def test_lora_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    a = build_tiny_lora(tmp_path / "a", model_dir, seed=0)
    b = build_tiny_lora(tmp_path / "b", model_dir, seed=0)
    c = build_tiny_lora(tmp_path / "c", model_dir, seed=1)
    assert list(_tree_digest(a)) == ["pytorch_lora_weights.safetensors"]
    assert _tree_digest(a) == _tree_digest(b) != _tree_digest(c)


def test_lora_changes_output_and_fuse_round_trips(model_dir: Path, tmp_path: Path) -> None:
    lora = build_tiny_lora(tmp_path / "lora", model_dir, seed=0)
    pipe = _load(model_dir)  # private copy: this test mutates weights
    base = _png(pipe)
    weights = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}

    pipe.load_lora_weights(lora, adapter_name="x")
    with_lora = _png(pipe)
    assert with_lora != base
    assert np.abs(_pixels(with_lora) - _pixels(base)).mean() > 1.0

    pipe.fuse_lora()
    fused = _png(pipe)
    pipe.unfuse_lora()
    unfused = _png(pipe)
    # Fusing folds B@A into W in float32 and unfusing subtracts it again, so the math agrees
    # only up to rounding; after uint8 quantisation that is at most one grey level.
    assert np.abs(_pixels(fused) - _pixels(with_lora)).max() <= 1
    assert np.abs(_pixels(unfused) - _pixels(with_lora)).max() <= 1

    pipe.unload_lora_weights()
    restored = pipe.transformer.state_dict()
    assert restored.keys() == weights.keys()
    for k, w in weights.items():
        torch.testing.assert_close(restored[k], w, rtol=0, atol=1e-5)
    assert np.abs(_pixels(_png(pipe)) - _pixels(base)).max() <= 1
