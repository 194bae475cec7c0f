"""The pipeline arguments of a batch: one prompt and one CPU generator per image.

A batch of one request is called exactly as before batching existed (its prompt
once, ``num_images_per_prompt=n``), so ``--max-batch 1`` changes no byte. A batch of
several expands every request to one prompt per image, in batch order, with
``num_images_per_prompt=1``: requests with different ``n`` share the call, and each
image keeps its own seed's generator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dpserve.contract.protocol import (
    GenerateParams,
)
from dpserve.worker.pipeline import pipeline_kwargs


def batch_kwargs(
    batch: Sequence[GenerateParams], accepted: Mapping[str, Any], output_type: str
) -> dict[str, Any]:
    """``pipe(**kwargs)`` for compatible requests (worker/batch.py)."""
    # The shared fields are the first request's; its checks hold for every member.
    kwargs = pipeline_kwargs(batch[0], accepted, output_type)
    if len(batch) == 1:
        return kwargs
    images = [(params, seed) for params in batch for seed in params.seed or ()]
    if len(images) != sum(params.n for params in batch):
        raise ValueError("seeds must be fixed before a request reaches the gang")
    kwargs["prompt"] = [params.prompt for params, _ in images]
    if batch[0].negative_prompt is not None:
        kwargs["negative_prompt"] = [params.negative_prompt for params, _ in images]
    kwargs["num_images_per_prompt"] = 1
    kwargs["generator"] = [torch.Generator("cpu").manual_seed(seed) for _, seed in images]
    return kwargs
