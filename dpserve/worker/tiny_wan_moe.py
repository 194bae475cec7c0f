"""A tiny Wan 2.2 text-to-video pipeline with two denoisers (``--variant wan-moe``).

As Wan 2.2 T2V A14B: a ``WanPipeline`` with ``transformer`` (the high-noise expert,
timesteps at or above the boundary) and ``transformer_2`` (the low-noise one),
``boundary_ratio`` 0.875 and a flow shift of 12, so a 3-step request runs two steps
on the first expert and one on the second. The text encoder, tokenizer and VAE are
the ``video`` variant's (same seeds). The experts are wider and deeper than the
``video`` variant's transformer (4 heads, 8 blocks), so their blocks, which tensor
parallel splits, outweigh the embedders it keeps whole: a tp2 rank holds at most
0.55 of each (docs/worker.md, "Sequence and tensor parallel").
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler

from dpserve.worker.tiny_model import (
    _VAE_LATENT_CHANNELS,
    VIDEO_VARIANTS,
    _build_video_components,
    _perturb,
    _seeded,
)

BOUNDARY_RATIO = 0.875  # Wan 2.2 T2V A14B's
FLOW_SHIFT = 12.0  # Wan 2.2 T2V A14B's sampling shift


def _expert(seed: int, name: str) -> WanTransformer3DModel:
    torch.manual_seed(_seeded(seed, f"wan-moe:{name}"))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=24,
        in_channels=_VAE_LATENT_CHANNELS,
        out_channels=_VAE_LATENT_CHANNELS,
        text_dim=VIDEO_VARIANTS["video"].text_dim,
        freq_dim=32,
        ffn_dim=768,
        num_layers=8,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )
    _perturb(transformer, _seeded(seed, f"wan-moe:{name}:perturb"), 0.1)
    return transformer.float().eval()


def build(variant: str, seed: int) -> WanPipeline:
    base = _build_video_components("video", seed)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=FLOW_SHIFT
    )
    return WanPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=scheduler,
        transformer=_expert(seed, "transformer"),
        transformer_2=_expert(seed, "transformer_2"),
        boundary_ratio=BOUNDARY_RATIO,
    )
