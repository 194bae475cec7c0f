"""Which denoisers tp and sp can split, and the layout's static constraints on a model.

Torch-free: the supervisor checks a model folder's configs before it starts any
rank, so an impossible layout is refused with the constraint named instead of
failing inside a rank.
"""

from __future__ import annotations

import json
from pathlib import Path

from dpserve.layout import LayoutError, ParallelConfig

SPLITTABLE: tuple[str, ...] = ("FluxTransformer2DModel",)


def splittable_problem(kind: str) -> str | None:
    if kind in SPLITTABLE:
        return None
    # diffusers names its video transformers *Transformer3DModel (Wan, CogVideoX, ...).
    video = (
        " (a video model: sequence parallel over its frames x tokens is not built)"
        if kind.endswith("Transformer3DModel")
        else ""
    )
    return (
        f"tp/sp need a transformer that can be split ({', '.join(SPLITTABLE)}); this "
        f"model's denoiser is {kind}{video}: use --cfg and more replicas instead"
    )


def text_tokens_problem(text_tokens: int, sp: int) -> str | None:
    """sp splits the text tokens too (Flux pads every prompt to --max-sequence-length)."""
    if text_tokens % sp == 0:
        return None
    return (
        f"text tokens ({text_tokens}, --max-sequence-length) must be divisible by sp "
        f"({sp}), which splits them: use a multiple of {sp}"
    )


def layout_problem(model: Path, layout: ParallelConfig, text_tokens: int | None) -> str | None:
    """Why ``layout`` cannot split the model in folder ``model``, or None.

    ``text_tokens`` is ``--max-sequence-length`` when given (Flux pads every prompt
    to it); the pipeline's own default is checked by the ranks once it is loaded.
    """
    if layout.tp == 1 and layout.sp == 1:
        return None
    if text_tokens is not None and (problem := text_tokens_problem(text_tokens, layout.sp)):
        return problem
    config_file = model / "transformer" / "config.json"
    if not config_file.is_file():
        return splittable_problem("not a transformer (no transformer/config.json)")
    config = json.loads(config_file.read_text())
    problem = splittable_problem(str(config.get("_class_name")))
    if problem is not None:
        return problem
    try:
        layout.validate(num_heads=int(config["num_attention_heads"]))
    except LayoutError as exc:
        return str(exc)
    return None
