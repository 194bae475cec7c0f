"""Which denoisers tp and sp can split, and the layout's static constraints on a model.

Torch-free: the supervisor checks a model folder's configs before it starts any
rank, so an impossible layout is refused with the constraint named instead of
failing inside a rank.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from dpserve.contract.layout import LayoutError, ParallelConfig


@dataclass(frozen=True)
class FamilyTraits:
    """What a gang can do with one denoiser class; its plan (``parallel/families.py``)
    does it. ``tp``: a sharding plan; ``sp``: a sequence cut; ``text_split``: sp splits
    the text tokens too (joint attention over padded prompts); ``batched_cfg``: its
    pipelines batch both CFG branches into one denoiser call (``worker/denoiser.py``)
    instead of calling it once per branch."""

    tp: bool
    sp: bool
    text_split: bool = False
    clip_tokens: bool = False  # the prompt carries CLIP's padded tokens ahead of T5's (SD3)
    batched_cfg: bool = False


# Every family a gang can split, by denoiser class. Adding one: docs/worker.md,
# "Adding a model family".
FAMILIES: Mapping[str, FamilyTraits] = MappingProxyType(
    {
        "FluxTransformer2DModel": FamilyTraits(tp=True, sp=True, text_split=True),
        # Wan cross-attends, each rank to the whole prompt: its text is not split.
        "WanTransformer3DModel": FamilyTraits(tp=True, sp=True),
        # FLUX.2 pads every prompt to max_sequence_length, as FLUX.1 does.
        "Flux2Transformer2DModel": FamilyTraits(tp=True, sp=True, text_split=True),
        # SD3's joint attention, as Flux's; its prompt is 77 CLIP tokens and then T5's;
        # its pipeline runs both CFG branches as one batch.
        "SD3Transformer2DModel": FamilyTraits(
            tp=True, sp=True, text_split=True, clip_tokens=True, batched_cfg=True
        ),
        # Qwen's prompts have any length: its cut pads them with masked keys.
        "QwenImageTransformer2DModel": FamilyTraits(tp=True, sp=True),
    }
)
TENSOR_SPLITTABLE: tuple[str, ...] = tuple(k for k, f in FAMILIES.items() if f.tp)
SEQUENCE_SPLITTABLE: tuple[str, ...] = tuple(k for k, f in FAMILIES.items() if f.sp)
TEXT_SPLIT: tuple[str, ...] = tuple(k for k, f in FAMILIES.items() if f.text_split)
BATCHED_CFG: frozenset[str] = frozenset(k for k, f in FAMILIES.items() if f.batched_cfg)


def splittable_problem(kind: str, layout: ParallelConfig) -> str | None:
    """Why ``layout``'s tp or sp cannot split a denoiser of class ``kind``, or None."""
    for degree, axis, kinds in (
        (layout.tp, "tp", TENSOR_SPLITTABLE),
        (layout.sp, "sp", SEQUENCE_SPLITTABLE),
    ):
        if degree > 1 and kind not in kinds:
            return (
                f"{axis} needs a transformer it can split ({', '.join(kinds)}); this "
                f"model's denoiser is {kind}: use --cfg and more replicas instead"
            )
    return None


def text_split(kind: str, sp: int, cfg: int) -> int:
    """The most ranks one call may split the text tokens over: where sp splits them
    (Flux), the sequence ranks with the CFG ranks a request without true CFG borrows."""
    return sp * cfg if kind in TEXT_SPLIT else 1


def text_prefix(kind: str, clip_tokens: int) -> int:
    """The tokens a sequence split cuts ahead of the T5 tokens a request sizes: the
    CLIP tokenizer's padded length where the family's prompts carry it (SD3), else 0."""
    traits = FAMILIES.get(kind)
    return clip_tokens if traits is not None and traits.clip_tokens else 0


def text_tokens_problem(
    kind: str, text_tokens: int | None, sp: int, clip_tokens: int = 0
) -> str | None:
    """Where sp splits the text tokens too (Flux, which pads every prompt to
    --max-sequence-length; SD3, which pads it to its CLIP tokenizer's length,
    ``clip_tokens``, and then to --max-sequence-length T5 tokens), they must split
    evenly."""
    if kind not in TEXT_SPLIT or text_tokens is None:
        return None
    clip = text_prefix(kind, clip_tokens)
    if (clip + text_tokens) % sp == 0:
        return None
    if not clip:
        return (
            f"text tokens ({text_tokens}, --max-sequence-length) must be divisible by sp "
            f"({sp}), which splits them: use a multiple of {sp}"
        )
    return (
        f"text tokens ({clip} CLIP + {text_tokens} T5, --max-sequence-length, = "
        f"{clip + text_tokens}) must be divisible by sp ({sp}), which splits them: use a "
        f"--max-sequence-length whose sum with {clip} is a multiple of {sp}"
    )


def clip_tokens(model: Path) -> int:
    """The CLIP tokens a model folder's pipeline pads every prompt to (SD3's
    ``tokenizer_max_length``: its first tokenizer's ``model_max_length``, else 77)."""
    config = model / "tokenizer" / "tokenizer_config.json"
    if config.is_file():
        length = json.loads(config.read_text()).get("model_max_length")
        if isinstance(length, int) and 0 < length < 1 << 20:
            return length
    return 77


def layout_problem(model: Path, layout: ParallelConfig, text_tokens: int | None) -> str | None:
    """Why ``layout`` cannot split the model in folder ``model``, or None.

    ``text_tokens`` is ``--max-sequence-length`` when given (Flux pads every prompt
    to it); the pipeline's own default is checked by the ranks once it is loaded.
    """
    if layout.tp == 1 and layout.sp == 1:
        return None
    config_file = model / "transformer" / "config.json"
    if not config_file.is_file():
        return splittable_problem("not a transformer (no transformer/config.json)", layout)
    config = json.loads(config_file.read_text())
    kind = str(config.get("_class_name"))
    problem = splittable_problem(kind, layout)
    if problem is not None:
        return problem
    if problem := text_tokens_problem(kind, text_tokens, layout.sp, clip_tokens(model)):
        return problem
    try:
        layout.validate(num_heads=int(config["num_attention_heads"]))
    except LayoutError as exc:
        return str(exc)
    return None
