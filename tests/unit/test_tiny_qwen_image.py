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


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    from dpserve.worker.tiny_model import build_tiny_pipeline

    a = build_tiny_pipeline(tmp_path / "a", "qwen-image", seed=0)
    b = build_tiny_pipeline(tmp_path / "b", "qwen-image", seed=0)
    assert _digests(a) == _digests(b)
    assert (a / "text_encoder").is_dir() and (a / "tokenizer").is_dir()


def test_the_chat_template_s_system_part_is_34_tokens() -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    from dpserve.worker.tiny_qwen_image import qwen_tokenizer

    template = QwenImagePipeline.__init__.__code__.co_consts  # the template is set in __init__
    (text,) = [c for c in template if isinstance(c, str) and c.startswith("<|im_start|>system")]
    tokens = qwen_tokenizer().tokenize(text.format("a red fox"))
    assert tokens[33:36] == ["Ċ", "a", "Ġred"]
