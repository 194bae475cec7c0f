"""What the parallel-mode benches ask of each splittable family: its small tiny variant
(wide enough that splitting pays on a CPU), how a request asks for CFG, and the text
length its sequence split accepts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class BenchFamily:
    variant: str
    # "true_cfg": a negative prompt and true_cfg_scale (Flux, Qwen-Image); "guidance":
    # guidance_scale above 1 is CFG (SD3, Wan); "none": the pipeline has no CFG.
    cfg: str
    text_tokens: int  # --max-sequence-length; sp must split the family's text tokens
    size: int = 512  # where splitting pays on a CPU (and the variant's position table allows)
    negative: bool = True  # the pipeline takes a negative prompt (FLUX.2 klein's does not)
    video: bool = False


FAMILIES: Mapping[str, BenchFamily] = MappingProxyType(
    {
        "flux": BenchFamily("small", "true_cfg", 64),
        "qwen-image": BenchFamily("qwen-image-small", "true_cfg", 64),
        "flux2": BenchFamily("flux2-small", "guidance", 64, negative=False),
        # Its tiny CLIP pads to 32 tokens: 32 + 32 split over 2 and 4 ranks.
        "sd3": BenchFamily("sd3-small", "guidance", 32, size=256),
        "wan": BenchFamily("video-small", "guidance", 64, video=True),
    }
)


def cfg_fields(family: BenchFamily, scale: float = 4.0) -> dict[str, object]:
    """The request fields that turn CFG on for ``family`` (two branches a step)."""
    negative = {"negative_prompt": "blurry, low quality"} if family.negative else {}
    if family.cfg == "true_cfg":
        return {**negative, "true_cfg_scale": scale}
    if family.cfg == "guidance":
        return {**negative, "guidance_scale": scale}
    return {}


def plain_fields(family: BenchFamily) -> dict[str, object]:
    """The request fields of a request without CFG (one branch a step)."""
    return {"guidance_scale": 1.0} if family.cfg == "guidance" else {}
