"""Seeded, offline-built Qwen-Image pipelines (``QwenImagePipeline``, and Qwen-Image-Edit's
``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline``) for tests and benchmarks.

A tiny ``Qwen2_5_VLForConditionalGeneration`` text encoder (its vision tower too, one small
block: the class always has one), a byte-level BPE ``Qwen2Tokenizer`` built from code with
the chat template's special tokens, ``AutoencoderKLQwenImage``, the flow-matching scheduler
and ``QwenImageTransformer2DModel``; nothing is downloaded. ``tiny_model.build_tiny_pipeline``
saves them like the other variants.

The edit variants add a ``Qwen2VLProcessor`` (the same tokenizer, and an image processor
whose pixel budget keeps a reference image to a few vision tokens): their pipelines encode
the prompt with the reference image through the vision tower. The edit template's system
words are not whole tokens here, so the 64 tokens the pipeline drops end inside the system
text (with Qwen's vocabulary they end before the image): the rest of it stays in the
prompt's embeddings, which changes their length, not how the model is split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from dpserve.worker.tiny_model import _WORDS, _bytes_to_unicode, _perturb, _seeded


@dataclass(frozen=True)
class TinyQwenVariant:
    num_layers: int
    attention_head_dim: int  # the rope splits it over frame, rows and columns
    num_attention_heads: int
    axes_dims_rope: tuple[int, int, int]
    vae_base_dim: int = 8
    text_dim: int = 32
    text_layers: int = 2
    text_heads: int = 4
    # "text" (QwenImagePipeline), "edit" (QwenImageEditPipeline: one reference image)
    # or "edit-plus" (QwenImageEditPlusPipeline: several).
    pipeline: str = "text"


QWEN_VARIANTS: Mapping[str, TinyQwenVariant] = MappingProxyType(
    {
        # 4 heads: tp2 x ulysses2 can split them.
        "qwen-image": TinyQwenVariant(
            num_layers=2, attention_head_dim=16, num_attention_heads=4, axes_dims_rope=(4, 6, 6)
        ),
        # Wider and deeper, so the transformer carries a request's time (CPU benchmarks).
        "qwen-image-small": TinyQwenVariant(
            num_layers=6,
            attention_head_dim=64,
            num_attention_heads=8,
            axes_dims_rope=(16, 24, 24),
        ),
        # Qwen-Image's width (24 heads x 128, its rope split) with 4 of its 60 blocks: the
        # real model's per-layer shapes for GPU benchmarks (bench/gpu.sh families).
        "qwen-image-large": TinyQwenVariant(
            num_layers=4,
            attention_head_dim=128,
            num_attention_heads=24,
            axes_dims_rope=(16, 56, 56),
        ),
        # Qwen-Image-Edit's pipelines over the tiny model's shapes.
        "qwen-image-edit": TinyQwenVariant(
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            axes_dims_rope=(4, 6, 6),
            pipeline="edit",
        ),
        "qwen-image-edit-plus": TinyQwenVariant(
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            axes_dims_rope=(4, 6, 6),
            pipeline="edit-plus",
        ),
    }
)

_Z_DIM = 4  # latent channels; the transformer sees 2x2 patches of them (16)
# Qwen's chat-template specials, and the vision ones the encoder's config names.
_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Whole-word tokens (GPT-2 style: a leading space is "Ġ"), the template's words among them:
# its system part is then 34 tokens, as with Qwen's own vocabulary (the pipeline drops them).
_TEMPLATE_WORDS = (
    "system", "user", "assistant", "Describe", "image", "by", "detailing", "color", "shape",
    "size", "texture", "quantity", "text", "spatial", "relationships", "objects", "background",
)  # fmt: skip


def qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer: every byte is a token, known words (with or without a
    leading space) merge into one, and the chat specials are added tokens."""
    words = sorted({*_WORDS, *_TEMPLATE_WORDS}, key=lambda w: (-len(w), w))
    # One word's merges (``r`` + ``e``) can break another's spelling (``textur`` + ``e``):
    # the words left in pieces get the first merges, until none is (3 rounds here).
    order = words
    for _ in range(8):
        tokenizer = _bpe(order, words)
        broken = [w for w in words if len(tokenizer.tokenize(w)) != 1]
        if not broken:
            break
        order = broken + [w for w in order if w not in broken]
    return tokenizer


def _bpe(order: list[str], words: list[str]) -> Qwen2Tokenizer:
    """Words spelled letter by letter (every prefix in the vocab, as BPE requires) in
    ``order``, then each spaced word in one merge, then the specials."""
    alphabet = list(_bytes_to_unicode().values())
    vocab = {token: i for i, token in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    for word in order:
        left = word[0]
        for ch in word[1:]:
            if left + ch not in vocab:
                merges.append((left, ch))
                vocab[left + ch] = len(vocab)
            left += ch
    space = _bytes_to_unicode()[ord(" ")]
    for word in words:
        merges.append((space, word))
        vocab[space + word] = len(vocab)
    for special in _SPECIALS:
        vocab[special] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # the backend wants (left, right) tuples
        additional_special_tokens=list(_SPECIALS[1:]),
        model_max_length=32768,
    )


def _text_encoder(v: TinyQwenVariant, tokenizer: Qwen2Tokenizer) -> Any:
    ids = {name: int(tokenizer.convert_tokens_to_ids(name)) for name in _SPECIALS}  # type: ignore[arg-type]
    head_dim = v.text_dim // v.text_heads
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": v.text_dim,
            "intermediate_size": 2 * v.text_dim,
            "num_hidden_layers": v.text_layers,
            "num_attention_heads": v.text_heads,
            "num_key_value_heads": v.text_heads // 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                # t, h, w sections of half a head
                "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": _VISION_PATCH,
            "spatial_merge_size": _VISION_MERGE,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": v.text_dim,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config)


# The vision tower's patching (Qwen2.5-VL's): 14-pixel patches, 2 frames, 2x2 merged.
_VISION_PATCH, _VISION_MERGE = 14, 2
# A reference image's pixel budget in the VL encoder: 4x4 merged tokens at most (Qwen's
# own allows 1280), so an edit's prompt stays a few dozen tokens long.
_VISION_MAX_PIXELS = (4 * _VISION_MERGE * _VISION_PATCH) ** 2


def qwen_processor(tokenizer: Qwen2Tokenizer) -> Qwen2VLProcessor:
    """What the edit pipelines encode a prompt and its reference images with. The processor
    class takes a video processor too (transformers' needs torchvision: so does loading
    a real Qwen-Image-Edit); the pipelines never give it a video."""
    unit = _VISION_MERGE * _VISION_PATCH
    sizes: dict[str, Any] = dict(
        min_pixels=unit * unit,
        max_pixels=_VISION_MAX_PIXELS,
        patch_size=_VISION_PATCH,
        temporal_patch_size=2,
        merge_size=_VISION_MERGE,
    )
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**sizes),
    )


def build(
    variant: str, seed: int
) -> QwenImagePipeline | QwenImageEditPipeline | QwenImageEditPlusPipeline:
    """The ``variant`` pipeline with weights seeded from ``seed`` (tiny_model.FAMILY_VARIANTS)."""
    v = QWEN_VARIANTS[variant]
    if sum(v.axes_dims_rope) != v.attention_head_dim:
        raise ValueError(f"axes_dims_rope {v.axes_dims_rope} must sum to {v.attention_head_dim}")
    tokenizer = qwen_tokenizer()

    torch.manual_seed(_seeded(seed, "text_encoder"))
    text_encoder = _text_encoder(v, tokenizer)

    torch.manual_seed(_seeded(seed, "transformer"))
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * _Z_DIM,
        out_channels=_Z_DIM,
        num_layers=v.num_layers,
        attention_head_dim=v.attention_head_dim,
        num_attention_heads=v.num_attention_heads,
        joint_attention_dim=v.text_dim,
        axes_dims_rope=v.axes_dims_rope,
    )

    torch.manual_seed(_seeded(seed, "vae"))
    vae = AutoencoderKLQwenImage(
        base_dim=v.vae_base_dim,
        z_dim=_Z_DIM,
        dim_mult=[1, 1, 1, 1],  # 3 downsamplings: 8x8 pixels per latent
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * _Z_DIM,
        latents_std=[1.0] * _Z_DIM,
    )

    # Qwen-Image's own: dynamic shifting by image size, exponential.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        time_shift_type="exponential",
    )

    for name, mod, scale in (
        ("text_encoder", text_encoder, 0.02),
        ("transformer", transformer, 0.1),
        ("vae", vae, 0.02),
    ):
        if any(p.dtype != torch.float32 for p in mod.parameters()):
            mod.float()
        _perturb(mod, _seeded(seed, name + ":perturb"), scale)
        mod.eval()

    modules: dict[str, Any] = dict(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    if v.pipeline == "text":
        return QwenImagePipeline(**modules)
    edit = QwenImageEditPlusPipeline if v.pipeline == "edit-plus" else QwenImageEditPipeline
    return edit(processor=qwen_processor(tokenizer), **modules)
