"""Per-request settings of a pipeline call beyond the prompt and the sampling numbers:
the text length, the scheduler's shift, and how the VAE decodes.

What a replica offers is read from its pipeline once (``offer``), shown in
model_info's features and checked by the driver's admission before a request queues, so a
request never asks for something the call would silently skip:

- ``max_sequence_length``: the pipeline's argument of that name (Flux, Wan,
  Qwen-Image), at most the service's text length (``--max-sequence-length``, else
  the pipeline's default). Where sequence parallel splits the text tokens (Flux),
  a multiple of the ranks that may split them, counted with the tokens the family
  puts ahead of the request's (SD3's padded CLIP prompt: ``splittable.text_prefix``).
- ``flow_shift``: the shift ``s`` of a flow-matching schedule, ``sigma -> s*sigma /
  (1 + (s-1)*sigma)``: the ``shift`` of ``FlowMatchEulerDiscreteScheduler`` or the
  ``flow_shift`` of a multistep scheduler on flow sigmas (UniPC, DPM-Solver). A
  scheduler that shifts by the image size (Flux's dynamic shifting, ``s = e**mu``)
  takes the given ``s`` instead. The call runs with a scheduler made from the
  pipeline's config with that shift, and the pipeline's own comes back after it.
- ``vae_use_tiling`` / ``vae_use_slicing``: the VAE's tiled decoding (tiles blended
  at their seams) and sliced decoding (one image of a batch at a time), on for the
  call. Both save memory and both change pixels (tiling where the image spans several
  tiles; slicing by a batched convolution's rounding), so they are request fields, and
  the batching rule keeps requests that differ in them apart (worker/batch.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from dpserve.contract.model_info import FlowShift, TextLength
from dpserve.contract.protocol import (
    UNSUPPORTED,
    FieldError,
    GenerateParams,
    RequestError,
)

# The scheduler switch that, when on, replaces its shift by one from the image size.
_DYNAMIC: Final = "use_dynamic_shifting"


@dataclass(frozen=True)
class CallSettings:
    """What a request may set on this replica's pipeline call beyond its arguments.

    ``text_length``: the most text tokens a request may ask (None: the pipeline takes
    no ``max_sequence_length``); ``text_multiple``: what they, with the
    ``text_prefix`` tokens the model puts ahead of them, must divide by.
    ``shift_key``: the scheduler config key a ``flow_shift`` sets (None: it has no
    shift); ``shift_default``: the scheduler's own (None: by image size).
    """

    text_length: int | None = None
    text_multiple: int = 1
    text_prefix: int = 0
    shift_key: str | None = None
    shift_default: float | None = None
    vae_tiling: bool = False
    vae_slicing: bool = False

    def text_offer(self) -> TextLength | None:
        """model_info's ``max_sequence_length``: what a request may ask."""
        if self.text_length is None:
            return None
        return TextLength(
            max=self.text_length, multiple_of=self.text_multiple, prefix=self.text_prefix
        )

    def shift_offer(self) -> FlowShift | None:
        """model_info's ``flow_shift``: None where the scheduler has no shift to set."""
        return None if self.shift_key is None else FlowShift(default=self.shift_default)

    def check(self, params: GenerateParams) -> None:
        """Refuse, naming each field and what to send, what this pipeline cannot do."""
        bad: list[FieldError] = []
        length = params.max_sequence_length
        if length is not None:
            if self.text_length is None:
                bad.append(FieldError("max_sequence_length", "is not taken by this pipeline"))
            elif length > self.text_length or (self.text_prefix + length) % self.text_multiple:
                bad.append(FieldError("max_sequence_length", self._text_problem(length)))
        if params.flow_shift is not None and self.shift_key is None:
            bad.append(FieldError("flow_shift", "this model's scheduler has no shift to set"))
        if params.vae_use_tiling and not self.vae_tiling:
            bad.append(FieldError("vae_use_tiling", "this model's VAE cannot decode in tiles"))
        if params.vae_use_slicing and not self.vae_slicing:
            bad.append(FieldError("vae_use_slicing", "this model's VAE cannot decode in slices"))
        if bad:
            detail = "; ".join(f"{e.field} {e.message}" for e in bad)
            raise RequestError(UNSUPPORTED, f"not supported by the served model: {detail}", bad)

    def _text_problem(self, length: int) -> str:
        multiple, prefix = self.text_multiple, self.text_prefix
        if multiple == 1:
            return f"must be at most {self.text_length} (this service's text tokens), got {length}"
        if not prefix:
            return (
                f"must be at most {self.text_length}, a multiple of {multiple} (this "
                f"service's text tokens, split over {multiple} ranks), got {length}"
            )
        return (
            f"must be at most {self.text_length} and, with the model's {prefix} tokens "
            f"ahead of it, a multiple of {multiple} (this service's text tokens, split "
            f"over {multiple} ranks), got {length} ({prefix} + {length} = {prefix + length})"
        )

    @contextlib.contextmanager
    def applied(self, pipe: Any, params: GenerateParams) -> Iterator[None]:
        """``pipe`` with the request's shift and VAE decoding for one call."""
        vae: Any = getattr(pipe, "vae", None)
        before = (getattr(vae, "use_tiling", False), getattr(vae, "use_slicing", False))
        scheduler = pipe.scheduler if params.flow_shift is not None else None
        try:
            if scheduler is not None:
                assert self.shift_key is not None  # checked by the driver's admission
                pipe.scheduler = shifted(scheduler, self.shift_key, params.flow_shift)
            if params.vae_use_tiling:
                vae.use_tiling = True
            if params.vae_use_slicing:
                vae.use_slicing = True
            yield
        finally:
            if scheduler is not None:
                pipe.scheduler = scheduler
            if vae is not None and (params.vae_use_tiling or params.vae_use_slicing):
                vae.use_tiling, vae.use_slicing = before


def shifted(scheduler: Any, key: str, shift: float | None) -> Any:
    """A new scheduler of ``scheduler``'s kind and config with a fixed ``shift``."""
    overrides: dict[str, Any] = {key: shift}
    if _DYNAMIC in scheduler.config:
        overrides[_DYNAMIC] = False
    return type(scheduler).from_config(scheduler.config, **overrides)


def shift_of(scheduler: Any) -> tuple[str | None, float | None]:
    """The config key of ``scheduler``'s flow-matching shift and its value (None when
    it shifts by the image size), or ``(None, None)`` when it has none."""
    config: Mapping[str, Any] = getattr(scheduler, "config", None) or {}
    if "shift" in config and type(scheduler).__name__.startswith("FlowMatch"):
        key = "shift"
    elif config.get("use_flow_sigmas") and "flow_shift" in config:
        key = "flow_shift"
    else:
        return None, None
    value = None if config.get(_DYNAMIC) else float(config[key])
    return key, value


def offer(
    pipe: Any, text_length: int | None, text_multiple: int, text_prefix: int = 0
) -> CallSettings:
    """What ``pipe`` lets a request set. ``text_length``: the service's text tokens
    (None: the pipeline takes no max_sequence_length); ``text_multiple`` and
    ``text_prefix``: how a sequence split constrains them (``CallSettings``)."""
    key, default = shift_of(getattr(pipe, "scheduler", None))
    vae = getattr(pipe, "vae", None)
    return CallSettings(
        text_length=text_length,
        text_multiple=text_multiple,
        text_prefix=text_prefix,
        shift_key=key,
        shift_default=default,
        vae_tiling=hasattr(vae, "use_tiling"),
        vae_slicing=hasattr(vae, "use_slicing"),
    )
