"""The tiny Qwen-Image pipeline: byte-identical per seed, and its tokenizer spells the
pipeline's chat template as Qwen's own does (the pipeline drops its first 34 tokens)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("diffusers")


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


@pytest.mark.parametrize("variant", ["qwen-image", "qwen-image-edit"])
def test_same_seed_same_bytes(variant: str, tmp_path: Path) -> None:
    from dpserve.worker.tiny_model import build_tiny_pipeline

    if variant != "qwen-image":
        pytest.importorskip("torchvision", reason="Qwen2VLProcessor's video processor needs it")
    a = build_tiny_pipeline(tmp_path / "a", variant, seed=0)
    b = build_tiny_pipeline(tmp_path / "b", variant, seed=0)
    assert _digests(a) == _digests(b)
    assert (a / "text_encoder").is_dir() and (a / "tokenizer").is_dir()


def test_the_chat_template_s_system_part_is_34_tokens() -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    from dpserve.worker.tiny_qwen_image import qwen_tokenizer

    template = QwenImagePipeline.__init__.__code__.co_consts  # the template is set in __init__
    (text,) = [c for c in template if isinstance(c, str) and c.startswith("<|im_start|>system")]
    tokens = qwen_tokenizer().tokenize(text.format("a red fox"))
    assert tokens[33:36] == ["Ċ", "a", "Ġred"]


def test_the_edit_variants_load_like_real_models_and_only_edit(tmp_path: Path) -> None:
    """Qwen-Image-Edit's pipelines, their processor saved and loaded back offline; the
    worker sees an edit-only model (one reference, or several for Plus) without masks."""
    pytest.importorskip("torchvision", reason="Qwen2VLProcessor's video processor needs it")
    import torch

    from dpserve.contract.protocol import RequestError
    from dpserve.contract.validation import MAX_EDIT_IMAGES
    from dpserve.worker.edit import check_generation, edit_support
    from dpserve.worker.pipeline import load_pipeline
    from dpserve.worker.tiny_model import build_tiny_pipeline

    for variant, pipeline, images in (
        ("qwen-image-edit", "QwenImageEditPipeline", 1),
        ("qwen-image-edit-plus", "QwenImageEditPlusPipeline", MAX_EDIT_IMAGES),
    ):
        folder = build_tiny_pipeline(tmp_path / variant, variant, seed=0)
        assert (folder / "processor").is_dir()
        pipe = load_pipeline(folder, torch.device("cpu"), torch.float32)
        assert type(pipe).__name__ == pipeline
        assert type(pipe.processor).__name__ == "Qwen2VLProcessor"
        support = edit_support(pipe)
        assert support.needs_image and not support.inpainting
        assert support.max_images == images
        with pytest.raises(RequestError, match="POST /v1/images/edits"):
            check_generation(support)
