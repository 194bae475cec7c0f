"""How a preview turns the clean latents a step heads for into images, per latent layout.

The scheduler holds the latents in the pipeline's working layout, which differs by
family; each layout here undoes it the way that pipeline's own end of call does,
through the pipeline's own helpers where it has them, so a preview is what the
image would be if the run stopped at that step:

- *packed, scaled* (Flux): 2x2 patches as tokens (``_unpack_latents``), then
  ``latents / scaling_factor + shift_factor``;
- *packed, per channel* (Qwen-Image): tokens unpacked to one-frame videos, each
  channel scaled back by the VAE's ``latents_std`` and ``latents_mean``;
- *patchified, batch-normed* (FLUX.2): one token per latent position in row-major
  order (``_prepare_latent_ids`` gives their places), 2x2 patches as channels
  normalized by the VAE's batch norm (``vae.bn``'s running statistics), unpatchified
  before decoding (``_unpatchify_latents``);
- *plain, scaled* (SD3): the latent image itself, then as Flux's.

A pipeline in none of these (video pipelines, UNet pipelines on other schedulers)
has no layout, and its replica offers no previews (``partial_images: 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpserve.worker.pipeline import Pipeline

# Clean latents as the scheduler holds them -> the VAE's decoded images, (B, 3, H, W).
Decode = Callable[[torch.Tensor], torch.Tensor]


def _per_channel(config: Any) -> bool:
    """Latents normalized per channel (``latents_mean`` and ``latents_std``, one of
    each per ``z_dim`` channel), decoded as one-frame videos."""
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    z_dim = getattr(config, "z_dim", None)
    return isinstance(z_dim, int) and mean is not None and std is not None and len(mean) == z_dim


def _scaled(config: Any) -> bool:
    return (
        getattr(config, "scaling_factor", None) is not None
        and getattr(config, "shift_factor", None) is not None
    )


def _batch_normed(pipe: Pipeline) -> bool:
    bn = getattr(getattr(pipe, "vae", None), "bn", None)
    return (
        hasattr(bn, "running_mean")
        and hasattr(bn, "running_var")
        and hasattr(pipe, "_unpatchify_latents")
        and hasattr(pipe, "_unpack_latents_with_ids")
        and hasattr(pipe, "_prepare_latent_ids")
    )


def layout(pipe: Pipeline) -> str | None:
    """The name of ``pipe``'s latent layout (module docstring), or None."""
    config = getattr(getattr(pipe, "vae", None), "config", None)
    if config is None:
        return None
    if _batch_normed(pipe):
        return "patchified"
    if hasattr(pipe, "_unpack_latents"):
        if _per_channel(config):
            return "packed-per-channel"
        return "packed" if _scaled(config) else None
    if _scaled(config) and type(pipe).__name__.startswith("StableDiffusion3"):
        return "plain"
    return None


def decoder(pipe: Pipeline, width: int, height: int) -> Decode:
    """``pipe``'s way from clean latents to decoded images at ``width`` x ``height``."""
    vae: Any = pipe.vae
    kind = layout(pipe)

    def decode(latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(latents.to(vae.dtype), return_dict=False)[0]

    def packed(latents: torch.Tensor) -> torch.Tensor:
        unpacked = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        return decode(unpacked / vae.config.scaling_factor + vae.config.shift_factor)

    def packed_per_channel(latents: torch.Tensor) -> torch.Tensor:
        unpacked = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        shape = (1, vae.config.z_dim, 1, 1, 1)  # (B, C, 1, H, W): one-frame videos
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(unpacked)
        std = torch.tensor(vae.config.latents_std).view(shape).to(unpacked)
        return decode(unpacked * std + mean)[:, :, 0]

    def patchified(latents: torch.Tensor) -> torch.Tensor:
        # The pipeline's own sizes: latents of 2x2 patches, each side a multiple of 2.
        rows = int(height) // (pipe.vae_scale_factor * 2)
        cols = int(width) // (pipe.vae_scale_factor * 2)
        batch = latents.shape[0]
        ids = pipe._prepare_latent_ids(latents.new_empty(batch, 0, rows, cols))
        grid = pipe._unpack_latents_with_ids(latents, ids.to(latents.device), rows, cols)
        bn = vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(grid)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(grid)
        return decode(pipe._unpatchify_latents(grid * std + mean))

    def plain(latents: torch.Tensor) -> torch.Tensor:
        return decode(latents / vae.config.scaling_factor + vae.config.shift_factor)

    decoders: dict[str | None, Decode] = {
        "packed": packed,
        "packed-per-channel": packed_per_channel,
        "patchified": patchified,
        "plain": plain,
    }
    if kind not in decoders:
        raise ValueError(f"{type(pipe).__name__} has no latent layout previews know")
    return decoders[kind]
