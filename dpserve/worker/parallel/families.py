"""Each splittable family's plan: where its tokens are cut, its attention under the
cut, and which of its layers tensor parallel splits.

The gang, the exchanges and the processors' shared machinery do not know families;
a family is one entry here (and its traits in ``worker/splittable.py``, which the
supervisor reads before any rank starts). docs/worker.md, "Adding a model family".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dpserve.worker.parallel.flux import FluxCut, SequenceParallelFluxProcessor, flux_plan
from dpserve.worker.parallel.flux2 import Flux2Cut, SequenceParallelFlux2Processor, flux2_plan
from dpserve.worker.parallel.qwen_image import (
    QwenCut,
    SequenceParallelQwenProcessor,
    qwen_image_plan,
)
from dpserve.worker.parallel.sd3 import SD3Cut, SequenceParallelSD3Processor, sd3_plan
from dpserve.worker.parallel.sequence import AttentionScope, SequenceCut
from dpserve.worker.parallel.tensor import Shard
from dpserve.worker.parallel.wan import SequenceParallelWanProcessor, WanCut, wan_plan


@dataclass(frozen=True)
class FamilyPlan:
    """``cut`` and ``processor``: the sequence split (None: sp cannot split it);
    ``tensor_plan``: the tp split of a loaded transformer, layer path to shard (None:
    tp cannot split it)."""

    cut: Callable[[], SequenceCut] | None = None
    processor: Callable[[AttentionScope], Any] | None = None
    tensor_plan: Callable[[Any], dict[str, Shard]] | None = None


PLANS: Mapping[str, FamilyPlan] = MappingProxyType(
    {
        "FluxTransformer2DModel": FamilyPlan(FluxCut, SequenceParallelFluxProcessor, flux_plan),
        "WanTransformer3DModel": FamilyPlan(WanCut, SequenceParallelWanProcessor, wan_plan),
        "Flux2Transformer2DModel": FamilyPlan(Flux2Cut, SequenceParallelFlux2Processor, flux2_plan),
        "SD3Transformer2DModel": FamilyPlan(SD3Cut, SequenceParallelSD3Processor, sd3_plan),
        "QwenImageTransformer2DModel": FamilyPlan(
            QwenCut, SequenceParallelQwenProcessor, qwen_image_plan
        ),
    }
)


def plan_of(transformer: Any) -> FamilyPlan:
    """The plan of ``transformer``'s family (an empty plan for one without)."""
    return PLANS.get(type(transformer).__name__, FamilyPlan())
