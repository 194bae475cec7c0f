"""Seeded, offline-built Flux-style (and Wan-style video) pipelines and LoRAs for tests and
benchmarks.

Nothing here downloads anything: tokenizers, encoders, transformer, VAE and scheduler are all
constructed from in-code configs with seeded random weights, so CI and air-gapped clusters can
exercise the real diffusers code paths (loading, CFG, LoRA hot-swap) at toy cost.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

# Submodule imports: diffusers' top-level lazy __init__ makes mypy see its dummy placeholders.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

from dpserve.plumbing.durable import fsync_path

__all__ = [
    "LORA_TARGET_MODULES",
    "VARIANTS",
    "VIDEO_VARIANTS",
    "TinyVariant",
    "TinyVideoVariant",
    "build_tiny_lora",
    "build_tiny_pipeline",
    "transformer_config",
]

# Words that get whole-word tokens in both tokenizers, so typical test prompts tokenize to a
# handful of ids (like a real vocab) instead of one id per character.
_WORDS: tuple[str, ...] = (
    "a", "an", "the", "of", "in", "on", "with", "and", "photo", "painting", "cat", "dog",
    "red", "blue", "green", "car", "tree", "house", "sky", "astronaut", "horse", "riding",
    "blurry", "ugly",
)  # fmt: skip

_CLIP_BOS = "<|startoftext|>"
_CLIP_EOS = "<|endoftext|>"
_CLIP_MAX_LEN = 77  # matches CLIP's position table; FluxPipeline pads/truncates to this

LORA_TARGET_MODULES: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True)
class TinyVariant:
    """Sizes for one named variant; text encoders stay tiny because they run once per prompt."""

    num_layers: int
    num_single_layers: int
    attention_head_dim: int
    num_attention_heads: int
    axes_dims_rope: tuple[int, int, int]
    text_dim: int = 32
    text_ff_dim: int = 64
    text_layers: int = 2
    text_heads: int = 4


VARIANTS: Mapping[str, TinyVariant] = MappingProxyType(
    {
        "tiny": TinyVariant(
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            axes_dims_rope=(4, 6, 6),
        ),
        # The tiny model with 4 heads, so tp x ulysses layouts of 4 ranks can split them.
        "tiny4": TinyVariant(
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            axes_dims_rope=(4, 6, 6),
        ),
        "small": TinyVariant(
            num_layers=4,
            num_single_layers=8,
            attention_head_dim=64,
            num_attention_heads=8,
            axes_dims_rope=(16, 24, 24),
        ),
        # FLUX.1's width (24 heads x 128, its rope split) with 6 of its 57 blocks: the
        # per-layer shapes of the real model (what tp/sp kernels and bf16 on a GPU see)
        # at ~1.3e9 parameters, ~5 GB in float32. For GPU benchmarks; slow on a CPU.
        "large": TinyVariant(
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=128,
            num_attention_heads=24,
            axes_dims_rope=(16, 56, 56),
        ),
    }
)


@dataclass(frozen=True)
class TinyVideoVariant:
    """Sizes of a Wan-style video pipeline (WanPipeline: UMT5 encoder, a 3D transformer
    over (frame, height, width) patches, a causal 3D VAE that packs 4 frames and 8x8
    pixels into one latent). ``image_to_video``: a WanImageToVideoPipeline without an
    image encoder, as Wan 2.2's: the first frame's latents and a mask join the noise
    as input channels."""

    num_layers: int
    attention_head_dim: int  # Wan's rope splits it over frames, rows and columns
    num_attention_heads: int
    ffn_dim: int
    vae_base_dim: int
    text_dim: int = 32
    text_ff_dim: int = 64
    text_layers: int = 2
    text_heads: int = 4
    image_to_video: bool = False


VIDEO_VARIANTS: Mapping[str, TinyVideoVariant] = MappingProxyType(
    {
        # A 48x64, 17-frame, 4-step video in well under a second on one CPU thread.
        "video": TinyVideoVariant(
            num_layers=2,
            attention_head_dim=24,
            num_attention_heads=2,
            ffn_dim=64,
            vae_base_dim=8,
        ),
        # Wider and deeper, so the transformer rather than the VAE carries a video's
        # time: what bench/video_parallel.py splits (a 160x128, 33-frame, 10-step
        # video in about 15 s on one CPU thread, a third of it the VAE's).
        "video-small": TinyVideoVariant(
            num_layers=8,
            attention_head_dim=48,
            num_attention_heads=8,
            ffn_dim=1024,
            vae_base_dim=8,
        ),
        # The same sizes, animating an input image.
        "video-i2v": TinyVideoVariant(
            num_layers=2,
            attention_head_dim=24,
            num_attention_heads=2,
            ffn_dim=64,
            vae_base_dim=8,
            image_to_video=True,
        ),
    }
)

_VAE_LATENT_CHANNELS = 4
_LORA_GAIN = 2.0  # B scale; ~2x a random Linear, enough to visibly shift images


def _variant(name: str) -> TinyVariant:
    try:
        return VARIANTS[name]
    except KeyError:
        known = sorted([*VARIANTS, *VIDEO_VARIANTS, *FAMILY_VARIANTS])
        raise ValueError(f"unknown variant {name!r}; expected one of {known}") from None


def transformer_config(variant: str = "tiny") -> dict[str, object]:
    """FluxTransformer2DModel kwargs for ``variant`` (validated, not instantiated)."""
    v = _variant(variant)
    if sum(v.axes_dims_rope) != v.attention_head_dim:
        raise ValueError(f"axes_dims_rope {v.axes_dims_rope} must sum to {v.attention_head_dim}")
    return {
        "patch_size": 1,
        # Flux packs 2x2 latent patches into the channel dim before the transformer.
        "in_channels": 4 * _VAE_LATENT_CHANNELS,
        "num_layers": v.num_layers,
        "num_single_layers": v.num_single_layers,
        "attention_head_dim": v.attention_head_dim,
        "num_attention_heads": v.num_attention_heads,
        "joint_attention_dim": v.text_dim,  # T5 d_model
        "pooled_projection_dim": v.text_dim,  # CLIP pooled output = hidden_size
        "guidance_embeds": False,
        "axes_dims_rope": v.axes_dims_rope,
    }


# --------------------------------------------------------------------------- tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet: every byte maps to a printable, non-space character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _clip_tokenizer() -> CLIPTokenizer:
    alphabet = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for tok in [*alphabet, *(c + "</w>" for c in alphabet)]:
        vocab.setdefault(tok, len(vocab))
    merges: list[tuple[str, str]] = []
    # Merge left to right so each word collapses into one "<word></w>" token; every
    # intermediate prefix is also added to the vocab, as BPE requires.
    for word in _WORDS:
        left = word[0]
        for i, ch in enumerate(word[1:], start=1):
            right = ch + "</w>" if i == len(word) - 1 else ch
            merged = left + right
            if merged not in vocab:
                merges.append((left, right))
                vocab[merged] = len(vocab)
            left = merged
    for special in (_CLIP_BOS, _CLIP_EOS):
        vocab[special] = len(vocab)
    # transformers 5.x builds the BPE backend straight from in-memory vocab/merges, but the
    # tokenizers backend wants merges as (left, right) tuples despite the `list[str]` hint.
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # hint says list[str]; runtime needs tuples
        model_max_length=_CLIP_MAX_LEN,
    )


def _t5_shape(v: TinyVariant | TinyVideoVariant, tokenizer: T5Tokenizer) -> dict[str, Any]:
    """A small T5-family text encoder's config (T5 for Flux, UMT5 for Wan): ``v`` is the
    variant (its text_dim, text_heads, text_ff_dim, text_layers)."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": v.text_dim,
        "d_kv": v.text_dim // v.text_heads,
        "d_ff": v.text_ff_dim,
        "num_layers": v.text_layers,
        "num_heads": v.text_heads,
        "relative_attention_num_buckets": 8,
        "feed_forward_proj": "gated-gelu",
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _t5_tokenizer() -> T5Tokenizer:
    # Unigram scores are log-probs: whole words beat spelling them out, so known words are one
    # token and anything else falls back to characters (or <unk>).
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces.append(("▁", -2.0))
    pieces += [("▁" + w, -5.0) for w in _WORDS]
    chars = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'-:;()"
    pieces += [(c, -8.0) for c in chars]
    # extra_ids=0: no sentinel tokens, which only matter for span-corruption pretraining.
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


# --------------------------------------------------------------------------- modules


@torch.no_grad()
def _perturb(module: torch.nn.Module, seed: int, scale: float) -> None:
    """Add small seeded noise to every parameter.

    Default init leaves norm weights at exactly 1 and biases at 0, and the prompt then barely
    reaches the pixels (measured: ~1/255 mean change between prompts vs ~4/255 with this).
    """
    gen = torch.Generator().manual_seed(seed)
    for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def _seeded(seed: int, component: str) -> int:
    """Independent 64-bit seed per component: reshaping one module never reshuffles another."""
    digest = hashlib.sha256(f"dpserve-tiny:{seed}:{component}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _build_components(variant: str, seed: int) -> FluxPipeline:
    v = _variant(variant)
    clip_tok = _clip_tokenizer()
    t5_tok = _t5_tokenizer()

    torch.manual_seed(_seeded(seed, "text_encoder"))
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=v.text_dim,
            intermediate_size=v.text_ff_dim,
            num_hidden_layers=v.text_layers,
            num_attention_heads=v.text_heads,
            max_position_embeddings=_CLIP_MAX_LEN,
            projection_dim=v.text_dim,
            hidden_act="quick_gelu",
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
    )

    torch.manual_seed(_seeded(seed, "text_encoder_2"))
    text_encoder_2 = T5EncoderModel(T5Config(**_t5_shape(v, t5_tok)))

    torch.manual_seed(_seeded(seed, "transformer"))
    transformer = FluxTransformer2DModel(**transformer_config(variant))

    torch.manual_seed(_seeded(seed, "vae"))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=1,
        latent_channels=_VAE_LATENT_CHANNELS,
        norm_num_groups=32,
        # Flux normalises latents with both; values are FLUX.1's.
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )

    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )

    for name, mod in (
        ("text_encoder", text_encoder),
        ("text_encoder_2", text_encoder_2),
        ("transformer", transformer),
        ("vae", vae),
    ):
        if any(p.dtype != torch.float32 for p in mod.parameters()):
            mod.float()  # only if the caller changed torch's default dtype
        _perturb(mod, _seeded(seed, name + ":perturb"), 0.02)
        mod.eval()

    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def _build_video_components(variant: str, seed: int) -> WanPipeline | WanImageToVideoPipeline:
    v = VIDEO_VARIANTS[variant]
    tokenizer = _t5_tokenizer()

    torch.manual_seed(_seeded(seed, "text_encoder"))
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_shape(v, tokenizer)))

    torch.manual_seed(_seeded(seed, "transformer"))
    # Image-to-video: noise, a mask of the given frame (one channel per frame a latent
    # packs) and that frame's latents.
    conditioning = _VAE_LATENT_CHANNELS + 4 if v.image_to_video else 0
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),  # with the VAE's 8: 16 px a token side, one latent frame deep
        num_attention_heads=v.num_attention_heads,
        attention_head_dim=v.attention_head_dim,
        in_channels=_VAE_LATENT_CHANNELS + conditioning,
        out_channels=_VAE_LATENT_CHANNELS,
        text_dim=v.text_dim,
        freq_dim=32,
        ffn_dim=v.ffn_dim,
        num_layers=v.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )

    torch.manual_seed(_seeded(seed, "vae"))
    vae = AutoencoderKLWan(
        base_dim=v.vae_base_dim,
        z_dim=_VAE_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],  # 3 downsamplings: 8x8 pixels per latent
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # 2 of them in time: 4 frames per latent
        latents_mean=[0.0] * _VAE_LATENT_CHANNELS,
        latents_std=[1.0] * _VAE_LATENT_CHANNELS,
    )

    # Wan 2.1's own: UniPC over flow-matching sigmas, shifted as for 480p.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )

    # The transformer gets more noise: at 0.02 the prompt moved a pixel by 0.1/255 on
    # average (Wan's default init barely passes the text on), at 0.1 by about 1.4/255.
    for name, mod, scale in (
        ("text_encoder", text_encoder, 0.02),
        ("transformer", transformer, 0.1),
        ("vae", vae, 0.02),
    ):
        if any(p.dtype != torch.float32 for p in mod.parameters()):
            mod.float()
        _perturb(mod, _seeded(seed, name + ":perturb"), scale)
        mod.eval()

    if v.image_to_video:
        return WanImageToVideoPipeline(
            tokenizer=tokenizer,  # type: ignore[arg-type]  # hint: AutoTokenizer, a factory
            text_encoder=text_encoder,
            vae=vae,
            scheduler=scheduler,
            transformer=transformer,
        )
    return WanPipeline(
        tokenizer=tokenizer,  # type: ignore[arg-type]  # hint: AutoTokenizer, a factory
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
    )


# --------------------------------------------------------------------------- atomic output


@contextmanager
def _atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a hidden sibling directory to write into; publish it as ``out_dir`` on success.

    rename(2) is atomic and only replaces a missing or empty directory, so readers never see a
    half-written model and an existing one is never clobbered. Files are fsynced first so a
    power loss cannot publish a complete-looking folder with empty files.
    """
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Plain mkdir (not mkdtemp) so the published folder gets umask permissions, not 0700:
    # serving processes often run as a different user than the builder.
    tmp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        for path in sorted(tmp.rglob("*"), reverse=True):  # children before parents
            fsync_path(path)
        fsync_path(tmp)
        try:
            tmp.rename(out_dir)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # lost a race with another builder
                raise FileExistsError(f"{out_dir} already exists and is not empty") from exc
            raise
        fsync_path(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- public API


# Other families' variants: variant -> "module:function" building the pipeline from a
# seed (imported when asked for, so a Flux build loads no other family's classes).
FAMILY_VARIANTS: Mapping[str, str] = MappingProxyType(
    {
        "wan-moe": "dpserve.worker.tiny_wan_moe:build",
        "flux2": "dpserve.worker.tiny_flux2:build",
        "flux2-small": "dpserve.worker.tiny_flux2:build",
        "sd3": "dpserve.worker.tiny_sd3:build",
        "sd3-small": "dpserve.worker.tiny_sd3:build",
        "qwen-image": "dpserve.worker.tiny_qwen_image:build",
        "qwen-image-small": "dpserve.worker.tiny_qwen_image:build",
        "qwen-image-large": "dpserve.worker.tiny_qwen_image:build",
        "qwen-image-edit": "dpserve.worker.tiny_qwen_image:build",
        "qwen-image-edit-plus": "dpserve.worker.tiny_qwen_image:build",
    }
)


def _family_builder(variant: str) -> Any:
    module, _, function = FAMILY_VARIANTS[variant].partition(":")
    return getattr(importlib.import_module(module), function)


def build_tiny_pipeline(out_dir: Path, variant: str = "tiny", seed: int = 0) -> Path:
    """Build a seeded random-weight FluxPipeline (a WanPipeline for a ``VIDEO_VARIANTS``
    name, another family's pipeline for a ``FAMILY_VARIANTS`` one) and save it
    (float32) to ``out_dir``.

    The same ``(variant, seed)`` always yields byte-identical files. ``out_dir`` must be absent
    or empty; it appears only once fully written. The global torch RNG is left untouched.
    """
    out_dir = Path(out_dir)
    if variant in FAMILY_VARIANTS:
        build = _family_builder(variant)
    elif variant in VIDEO_VARIANTS:
        build = _build_video_components
    else:
        _variant(variant)
        build = _build_components
    with _atomic_dir(out_dir) as tmp:
        # fork_rng: seeding for the build must not leak into the caller's global RNG.
        with torch.random.fork_rng(devices=[]):
            pipe = build(variant, seed)
        pipe.save_pretrained(tmp, safe_serialization=True)
    return out_dir


def build_tiny_lora(out_dir: Path, model_dir: Path, seed: int = 0, rank: int = 4) -> Path:
    """Write a random diffusers-format LoRA for ``model_dir``'s transformer to ``out_dir``.

    Both A and B are non-zero (a freshly initialised LoRA has B=0 and would be a no-op), so
    loading it visibly changes images. Deterministic per ``seed``; written atomically.
    """
    out_dir = Path(out_dir)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    config = FluxTransformer2DModel.load_config(Path(model_dir) / "transformer")
    # Whichever family's transformer the model has (its config names the class).
    cls = getattr(importlib.import_module("diffusers"), str(config["_class_name"]))
    # Only shapes are needed, so build on the meta device: no weights are read or allocated.
    with torch.device("meta"):
        skeleton = cls.from_config(config)
    suffixes = tuple("." + t for t in LORA_TARGET_MODULES)
    targets = sorted(
        (
            (name, mod)
            for name, mod in skeleton.named_modules()
            if isinstance(mod, torch.nn.Linear) and name.endswith(suffixes)
        ),
        key=lambda item: item[0],
    )
    if not targets:
        raise ValueError(f"no LoRA target modules found in {model_dir}")

    gen = torch.Generator().manual_seed(_seeded(seed, f"lora:{rank}"))
    layers: dict[str, torch.nn.Module | torch.Tensor] = {}
    for name, lin in targets:
        # B @ A entries ~ N(0, (gain^2) / in_features): comparable to the base weights, so the
        # change is clear but activations stay bounded.
        a = torch.randn(rank, lin.in_features, generator=gen) / lin.in_features**0.5
        b = torch.randn(lin.out_features, rank, generator=gen) * (_LORA_GAIN / rank**0.5)
        layers[f"{name}.lora_A.weight"] = a.contiguous()
        layers[f"{name}.lora_B.weight"] = b.contiguous()

    with _atomic_dir(out_dir) as tmp:
        # No adapter metadata: safetensors writes its metadata map in random order, which would
        # break byte-determinism; without it diffusers infers r from shapes and alpha = r.
        FluxPipeline.save_lora_weights(tmp, transformer_lora_layers=layers)
    return out_dir
