"""What a pipeline reads of its text encoders' outputs, so a gang relays only that.

The output rank sends each text encoder call's output to the other ranks
(``encoders.py``). Decoder-style encoders called with ``output_hidden_states=True``
return far more than their pipelines read: Qwen-Image reads the last of Qwen2.5-VL's
29 hidden states, FLUX.2 [klein] three of Qwen3's, and both encoders also return
logits over the whole vocabulary (for Qwen3, 512 tokens x 151,936 entries, 155 MB
in bf16, per call). What a pipeline does not read travels as an empty tensor of the
same dtype: the output keeps its fields and its tuple of hidden states their length,
so every index the pipeline uses still lands on the same entry, and what it reads
is the very tensor one rank would have computed.

Each entry follows its pipeline's ``encode_prompt`` in the installed diffusers
(the layers FLUX.2 stacks are its ``text_encoder_out_layers`` default, SD3's CLIP
layer its ``clip_skip`` default). A pipeline without an entry relays everything.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Reads:
    """The output fields a pipeline reads of one encoder's calls, and which entries of
    its ``hidden_states`` (indexes as the pipeline writes them: negative from the end)."""

    fields: frozenset[str]
    layers: frozenset[int]

    def keeps_layer(self, index: int, count: int) -> bool:
        return index in self.layers or index - count in self.layers


def _default(pipe: Any, argument: str) -> Any:
    """The pipeline's default for ``argument`` (the server never passes these)."""
    parameter = inspect.signature(type(pipe).__call__).parameters.get(argument)
    return inspect.Parameter.empty if parameter is None else parameter.default


def _qwen_image(pipe: Any) -> dict[str, Reads]:
    # encode_prompt: text_encoder(..., output_hidden_states=True).hidden_states[-1]
    return {"text_encoder": Reads(frozenset({"hidden_states"}), frozenset({-1}))}


def _flux2(pipe: Any) -> dict[str, Reads]:
    # stack([output.hidden_states[k] for k in text_encoder_out_layers])
    chosen = _default(pipe, "text_encoder_out_layers")
    if not isinstance(chosen, tuple | list):
        return {}  # a FLUX.2 pipeline that chooses its layers elsewhere: relay all
    layers = frozenset(int(k) for k in chosen)
    return {"text_encoder": Reads(frozenset({"hidden_states"}), layers)}


def _sd3(pipe: Any) -> dict[str, Reads]:
    # Each CLIP: output[0] (text_embeds, pooled) and hidden_states[-(clip_skip + 2)].
    skip = _default(pipe, "clip_skip")
    if skip is not None and not isinstance(skip, int):
        return {}
    layer = -2 if skip is None else -(skip + 2)
    clip = Reads(frozenset({"text_embeds", "hidden_states"}), frozenset({layer}))
    return {"text_encoder": clip, "text_encoder_2": clip}


# By the prefix of the pipeline's class name: a family's text-to-image, image-to-image,
# inpainting and edit pipelines share their encode_prompt.
PIPELINES: Mapping[str, Callable[[Any], dict[str, Reads]]] = MappingProxyType(
    {"QwenImage": _qwen_image, "Flux2": _flux2, "StableDiffusion3": _sd3}
)


def reads_of(pipe: Any) -> dict[str, Reads]:
    """What ``pipe`` reads of each text encoder it names; an encoder it does not
    name (or a pipeline without an entry) has its whole output relayed."""
    kind = type(pipe).__name__
    for prefix, reads in PIPELINES.items():
        if kind.startswith(prefix):
            return reads(pipe)
    return {}
