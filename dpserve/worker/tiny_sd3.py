"""Seeded, offline-built Stable Diffusion 3.5-style pipelines (``--variant sd3``, ``sd3-small``).

The real ``StableDiffusion3Pipeline``: two CLIP text encoders with projection and a T5
encoder (tokenizers built from code, ``tiny_model``'s), a 16-channel ``AutoencoderKL`` as
SD3's, flow-matching Euler, and an ``SD3Transformer2DModel`` shaped like SD3.5's: RMS
qk-norm and dual attention (a second, image-only self-attention) in its first blocks.

**Decision:** the CLIP tokenizer's length (``model_max_length``, which the pipeline pads
every prompt to) is 32 here, not CLIP's 77: the prompt's text tokens are its CLIP length
plus ``--max-sequence-length`` T5 tokens, and with 77 no power-of-two T5 length splits
over sp=2 (77 + 32 = 109). The real models' 77 is read from their tokenizer's config the
same way (``worker/splittable.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
    StableDiffusion3Pipeline,
)
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
)

from dpserve.worker.tiny_model import _clip_tokenizer, _perturb, _seeded, _t5_shape, _t5_tokenizer

CLIP_TOKENS = 32  # the tiny CLIP tokenizer's model_max_length (module docstring)
_LATENT_CHANNELS = 16  # SD3's VAE


@dataclass(frozen=True)
class TinySD3Variant:
    num_layers: int
    dual_attention_layers: tuple[int, ...]
    attention_head_dim: int
    num_attention_heads: int
    pos_embed_max_size: int  # patches a side, 16 px each (8: up to 128x128)
    clip_dim: int = 32  # each CLIP's width; their concatenation pads to the T5 width
    text_dim: int = 64  # T5 d_model (>= 2 * clip_dim, as SD3 pads CLIP up to T5)
    text_ff_dim: int = 128
    text_layers: int = 2
    text_heads: int = 4


SD3_VARIANTS: dict[str, TinySD3Variant] = {
    # A 3-step 64x64 request in a fraction of a second on one CPU thread; 4 heads, so
    # tp2 x ulysses2 can split them.
    "sd3": TinySD3Variant(
        num_layers=4,
        dual_attention_layers=(0, 1),
        attention_head_dim=16,
        num_attention_heads=4,
        pos_embed_max_size=8,
    ),
    # Wide enough that the transformer carries a request's time on a CPU (benchmarks).
    "sd3-small": TinySD3Variant(
        num_layers=6,
        dual_attention_layers=(0, 1, 2),
        attention_head_dim=64,
        num_attention_heads=8,
        pos_embed_max_size=64,
    ),
}


def _clip(v: TinySD3Variant, tokenizer: Any) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=v.clip_dim,
            intermediate_size=2 * v.clip_dim,
            num_hidden_layers=v.text_layers,
            num_attention_heads=v.text_heads,
            max_position_embeddings=77,
            projection_dim=v.clip_dim,
            hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def build(variant: str, seed: int) -> StableDiffusion3Pipeline:
    """The ``variant`` pipeline with weights seeded by ``seed`` (tiny_model.FAMILY_VARIANTS)."""
    v = SD3_VARIANTS[variant]
    clip_tok = _clip_tokenizer()
    clip_tok.model_max_length = CLIP_TOKENS
    t5_tok = _t5_tokenizer()

    torch.manual_seed(_seeded(seed, "text_encoder"))
    text_encoder = _clip(v, clip_tok)
    torch.manual_seed(_seeded(seed, "text_encoder_2"))
    text_encoder_2 = _clip(v, clip_tok)
    torch.manual_seed(_seeded(seed, "text_encoder_3"))
    text_encoder_3 = T5EncoderModel(T5Config(**_t5_shape(v, t5_tok)))  # type: ignore[arg-type]

    torch.manual_seed(_seeded(seed, "transformer"))
    inner = v.num_attention_heads * v.attention_head_dim
    transformer = SD3Transformer2DModel(
        sample_size=8,  # latent side: the pipeline's default size is 64x64
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        num_layers=v.num_layers,
        attention_head_dim=v.attention_head_dim,
        num_attention_heads=v.num_attention_heads,
        joint_attention_dim=v.text_dim,
        caption_projection_dim=inner,
        pooled_projection_dim=2 * v.clip_dim,
        out_channels=_LATENT_CHANNELS,
        pos_embed_max_size=v.pos_embed_max_size,
        dual_attention_layers=v.dual_attention_layers,
        qk_norm="rms_norm",
    )

    torch.manual_seed(_seeded(seed, "vae"))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=32,
        scaling_factor=1.5305,  # SD3's
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)

    for name, mod in (
        ("text_encoder", text_encoder),
        ("text_encoder_2", text_encoder_2),
        ("text_encoder_3", text_encoder_3),
        ("transformer", transformer),
        ("vae", vae),
    ):
        if any(p.dtype != torch.float32 for p in mod.parameters()):
            mod.float()
        _perturb(mod, _seeded(seed, name + ":perturb"), 0.02)
        mod.eval()

    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tok,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tok,
    )
