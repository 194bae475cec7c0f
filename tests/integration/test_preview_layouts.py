"""Each family's preview decoding, in process: at the last step the clean latents a
preview estimates are the final latents, so decoding them the preview's way must give
the pipeline's own image. A layout decoded wrongly (unpacked in the wrong order, a
scale or a batch norm missed) fails here by far more than a grey level."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from dpserve.contract.protocol import GenerateParams
from dpserve.worker.preview import Previews, can_preview, output_size
from dpserve.worker.preview_latents import decoder, layout

MODELS = {
    "tiny_model": "packed",  # Flux
    "tiny_qwen_model": "packed-per-channel",
    "flux2_model": "patchified",
    "tiny_sd3_model": "plain",
}


def _load(request: pytest.FixtureRequest, fixture: str) -> Any:
    """The pipeline, its latent statistics made distinct from identity (the tiny VAEs
    keep batch norm's initial ones and Qwen's mean 0, std 1), so a decode that skips
    them is caught."""
    folder: Path = request.getfixturevalue(fixture)
    pipe = DiffusionPipeline.from_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    bn = getattr(pipe.vae, "bn", None)
    if bn is not None:
        bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=gen) * 0.5)
        bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=gen) + 0.5)
    if getattr(pipe.vae.config, "latents_mean", None) is not None:
        channels = len(pipe.vae.config.latents_mean)
        pipe.vae.register_to_config(
            latents_mean=(torch.randn(channels, generator=gen) * 0.5).tolist(),
            latents_std=(torch.rand(channels, generator=gen) + 0.5).tolist(),
        )
    return pipe


@pytest.mark.parametrize("fixture", list(MODELS))
def test_the_last_step_s_preview_is_the_pipeline_s_image(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    pipe = _load(request, fixture)
    assert layout(pipe) == MODELS[fixture] and can_preview(pipe)
    torch.manual_seed(0)
    kwargs = dict(prompt="a red fox", width=64, height=48, num_inference_steps=3)
    params = GenerateParams(prompt="a red fox", num_inference_steps=3, partial_images=1)
    previews = Previews("r", params, output_size(pipe, kwargs), lambda reply: None)
    generator = torch.Generator().manual_seed(3)
    with previews.watching(pipe):
        image = pipe(**kwargs, generator=generator).images[0]
    assert previews._around is not None
    _, final, at = previews._around
    assert float(previews._scheduler.sigmas[at]) == 0.0  # the clean latents: the last
    with torch.no_grad():
        decoded = decoder(pipe, 64, 48)(final.float())
    (preview,) = pipe.image_processor.postprocess(decoded, "pil")
    assert preview.size == image.size == (64, 48)
    gap = np.abs(np.asarray(preview, np.int16) - np.asarray(image, np.int16)).max()
    assert gap <= 1, f"{fixture}: {gap} grey levels from the pipeline's image"


def test_a_video_pipeline_offers_no_previews(tiny_wan_moe_model: Path) -> None:
    """Wan 2.2's two-denoiser pipeline: video latents on a multistep scheduler, which
    no preview layout decodes (a replica offers ``partial_images: 0``)."""
    from dpserve.worker.features import features_of

    pipe = DiffusionPipeline.from_pretrained(tiny_wan_moe_model)
    assert layout(pipe) is None and not can_preview(pipe)
    assert features_of(pipe).partial_images == 0
